"""What one request asks of the sampler, and the sampler that does it (llama.cpp's
``common_params_sampling`` and the chain ``common_sampler`` builds for each of its server's slots).

``SamplingParams`` holds a request's choices, checked when it is made (a ``ValueError`` naming the
field, which the server answers with HTTP 400). ``RequestSampler`` applies them to one row of logits,
in llama.cpp's order:

    logit bias -> penalties (repeat, frequency, presence) -> grammar mask -> top-k -> top-p -> min-p
    -> temperature -> draw

The last five steps are ``lazyggml.sampling.Sampler``'s; the first three are per request. Each
request draws from its own generator seeded with its ``seed``, so the same seed gives the same text
whatever else the server is doing (the tokens of other requests never touch it).

Defaults are llama.cpp's server's (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, no penalty),
not OpenAI's (temperature 1, no top-k, top-p 1): a client that sets nothing gets what llama-server
would give it.

Penalties (llama.cpp's ``penalties`` sampler) count the last ``repeat_last_n`` tokens of the
sequence, prompt included, as llama-server does: a token seen ``c`` times has its logit divided by
``repeat_penalty`` when positive (multiplied when not), then lowered by ``c * frequency_penalty +
presence_penalty``. Log-probabilities are those of the model's own distribution (the soft-max of
the raw logits), as llama-server reports by default and OpenAI documents.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..sampling import Sampler

__all__ = ["SamplingParams", "RequestSampler", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20        # OpenAI's limit on top_logprobs


@dataclass
class SamplingParams:
    """One request's sampling and stopping choices (see the module's docstring for the order)."""
    max_tokens: int | None = None          # None: until the end of generation or the slot's context
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None                 # None: fresh entropy
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)     # token id -> added to its logit
    stop: list = field(default_factory=list)           # strings that end the text (not included)
    logprobs: int | None = None              # None: none; n: the chosen token's and the n most likely
    ignore_eos: bool = False

    def check(self, n_vocab):
        """Raise ValueError naming the first field out of range (``n_vocab``: the model's)."""
        def bad(name, why):
            raise ValueError(f"{name}: {why}")
        if self.max_tokens is not None and self.max_tokens < 0:
            bad("max_tokens", f"{self.max_tokens} is negative")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"{self.temperature} must be a finite number >= 0")
        for name in ("top_p", "min_p"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                bad(name, f"{v} must lie in [0, 1]")
        if not (np.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            bad("repeat_penalty", f"{self.repeat_penalty} must be positive")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (np.isfinite(v) and -2.0 <= v <= 2.0):
                bad(name, f"{v} must lie in [-2, 2]")
        if self.repeat_last_n < -1:
            bad("repeat_last_n", f"{self.repeat_last_n} must be -1 (the whole sequence), 0 (off) or more")
        if self.seed is not None and not 0 <= self.seed < 2 ** 64:
            bad("seed", f"{self.seed} must be a non-negative integer below 2**64")
        for tok, bias in self.logit_bias.items():
            if not 0 <= int(tok) < n_vocab:
                bad("logit_bias", f"token {tok} is outside the vocabulary of {n_vocab}")
            if np.isnan(bias) or bias == np.inf:     # +inf: no finite logit left to sample from
                bad("logit_bias", f"token {tok} has bias {bias} (NaN and +inf are not biases; -inf bans)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"{self.logprobs} must lie in 0..{MAX_LOGPROBS}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "each stop sequence must be a non-empty string")
        return self


class RequestSampler:
    """The sampler of one request: ``sample(logits)`` the next token from a row of raw logits
    (not changed), ``accept(token)`` after it is chosen (the penalties' window and the grammar).
    ``constraint``: a ``grammar.Constraint`` or None; ``history``: the prompt's tokens."""

    def __init__(self, params, constraint=None, history=()):
        self.params = params
        self.constraint = constraint
        self.chain = Sampler(temp=params.temperature, top_k=params.top_k, top_p=params.top_p,
                             min_p=params.min_p, seed=params.seed)
        self.history = [int(t) for t in history]
        bias = params.logit_bias
        self._bias_ids = np.fromiter((int(t) for t in bias), np.int64, len(bias))
        self._bias = np.fromiter((float(b) for b in bias.values()), np.float32, len(bias))

    def _penalise(self, logits):
        p = self.params
        n = len(self.history) if p.repeat_last_n == -1 else p.repeat_last_n
        if n == 0 or not self.history or (p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0
                                          and p.presence_penalty == 0.0):
            return
        ids, counts = np.unique(np.asarray(self.history[-n:], np.int64), return_counts=True)
        x = logits[ids]
        x = np.where(x <= 0, x * p.repeat_penalty, x / p.repeat_penalty)
        logits[ids] = x - counts * np.float32(p.frequency_penalty) - np.float32(p.presence_penalty)

    def sample(self, logits):
        """``(token, logprobs)``: the chosen id, and when the request asked for them a dict
        ``{"logprob": ..., "top": [(id, logprob), ...]}`` from the model's distribution."""
        x = np.array(logits, dtype=np.float32).reshape(-1)
        if len(self._bias_ids):
            x[self._bias_ids] += self._bias
        self._penalise(x)
        if self.constraint is not None:
            self.constraint.mask_logits(x)
        tok = self.chain.sample(x)
        return tok, (None if self.params.logprobs is None else self._logprobs(logits, tok))

    def _logprobs(self, logits, tok):
        x = np.asarray(logits, np.float64).reshape(-1)
        m = x.max()
        lp = x - (m + np.log(np.exp(x - m).sum()))
        k = self.params.logprobs
        top = np.argsort(-lp, kind="stable")[:k] if k else []
        return {"logprob": float(lp[tok]), "top": [(int(i), float(lp[i])) for i in top]}

    def accept(self, token):
        """The chosen token joins the history (the grammar advances, ValueError if it may not)."""
        self.history.append(int(token))
        if self.constraint is not None:
            self.constraint.accept(int(token))

    @property
    def grammar_done(self):
        """The grammar accepts nothing more (the answer is complete)."""
        return self.constraint is not None and self.constraint.is_done()
