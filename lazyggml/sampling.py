"""Choosing the next token from a row of logits, as llama.cpp's sampler chain does (``llama-sampling.cpp``).

A sampler step works on *candidates*: token ids with their logits (llama.cpp's
``llama_token_data_array``). Each filter below takes ``(ids, logits)`` and returns the candidates it
keeps, sorted by logit, highest first:

* ``top_k(ids, logits, k)``: the ``k`` most likely (``k <= 0``: all);
* ``top_p(ids, logits, p)``: the smallest set whose probability reaches ``p`` (nucleus sampling);
* ``min_p(ids, logits, p)``: those at least ``p`` times as likely as the best one;
* ``temperature(ids, logits, t)``: logits divided by ``t``; ``t <= 0`` keeps only the best token.

``Sampler`` chains them in llama.cpp's default order, top-k -> top-p -> min-p -> temperature, then
draws from the softmax of what is left (llama.cpp's ``dist`` sampler) with a NumPy ``Generator``.
Since top-p and min-p come before the temperature, the temperature reshapes the distribution over
the chosen tokens but does not change which tokens are chosen. ``greedy(logits)`` is the argmax.

Same seed, same draws; the draws are not llama.cpp's (it uses a ``std::mt19937``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["Sampler", "softmax", "greedy", "top_k", "top_p", "min_p", "temperature"]


def _sorted(ids, logits):
    """Candidates by descending logit; equal logits keep the lower id first."""
    order = np.argsort(-logits, kind="stable")
    return ids[order], logits[order]


def softmax(logits) -> np.ndarray:
    """Probabilities from logits, in float64; ``-inf`` logits get probability 0."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def greedy(logits) -> int:
    """The id of the largest logit (the first one on ties), llama.cpp's greedy sampler."""
    return int(np.argmax(logits))


def top_k(ids, logits, k: int):
    """Keep the ``k`` highest logits; ``k <= 0`` or ``k >= len`` keeps all (sorted).

    Like llama.cpp's partial sort, this selects in O(n) before sorting only the ``k`` kept, which
    matters for a 128k-token vocabulary: the k-th largest logit is found by partitioning, then the
    larger ones and, for ties at that value, the lowest ids are kept."""
    return _top_k(np.asarray(ids), np.asarray(logits), int(k))


@njit(cache=True)
def _top_k(ids, logits, k):
    """``top_k`` compiled: a dozen NumPy calls cost ~17 µs for 1,024 logits, and three times that
    between decode steps, whose kernels have pushed NumPy's code out of the caches. Comparisons
    and a stable sort only, so its choice is exactly NumPy's."""
    n = logits.shape[0]
    if 0 < k < n:
        kth = np.partition(logits, n - k)[n - k]
        keep = np.empty(k, np.int64)
        m = 0
        for i in range(n):          # the larger ones, by id...
            if logits[i] > kth:
                keep[m] = i
                m += 1
        for i in range(n):          # ...then the ties at the k-th value, lowest ids first
            if m == k:
                break
            if logits[i] == kth:
                keep[m] = i
                m += 1
        ids, logits = ids[keep], logits[keep]
    order = np.argsort(-logits, kind="mergesort")   # stable: equal logits keep the lower id first
    return ids[order], logits[order]


def top_p(ids, logits, p: float, min_keep: int = 1):
    """Keep the most likely tokens until their probability sum reaches ``p`` (the token that
    crosses ``p`` included, at least ``min_keep``); ``p >= 1`` keeps all."""
    return _top_p(*_sorted(ids, logits), p, min_keep)


def min_p(ids, logits, p: float, min_keep: int = 1):
    """Keep the tokens whose probability is at least ``p`` times the best one's, i.e. whose logit is
    at least ``max + log(p)``; ``p <= 0`` keeps all."""
    return _min_p(*_sorted(ids, logits), p, min_keep)


def temperature(ids, logits, t: float):
    """Divide the logits by ``t``; ``t <= 0`` keeps only the best token (greedy)."""
    return _temperature(*_sorted(ids, logits), t)


# The filters on candidates already sorted (as every filter returns them): the chain sorts once.
# Their arithmetic is compiled: as NumPy calls on a few dozen candidates, the chain and the draw
# took ~40 µs, a tenth of a small model's decode step.

@njit(cache=True)
def _softmax64(x):
    e = np.exp(x.astype(np.float64) - np.float64(x.max()))
    return e / e.sum()


@njit(cache=True)
def _n_top_p(logits, p):
    """How many sorted candidates it takes for their probabilities to reach ``p``."""
    return np.searchsorted(np.cumsum(_softmax64(logits)), p) + 1


@njit(cache=True)
def _n_min_p(logits, p):
    """How many sorted candidates have a logit of at least ``max + log(p)``."""
    return np.count_nonzero(logits >= logits[0] + np.float32(np.log(p)))


@njit(cache=True)
def _draw(logits, u):
    """The index of the candidate that the uniform ``u`` picks in their cumulative distribution."""
    cdf = np.cumsum(_softmax64(logits))
    return min(np.searchsorted(cdf, u * cdf[-1], side="right"), logits.shape[0] - 1)


@njit(cache=True)
def _chain(logits, k, p, min_p, t, u):
    """The whole chain and the draw in one compiled call (``Sampler.sample``; five calls cost
    ~40 µs a token, a twelfth of the embedded model's decode step): ``(token, whether the uniform
    u was drawn on)``, or ``(-1, False)`` for logits with a NaN or no finite value. The filters'
    arithmetic is the functions' above; a single candidate left takes no draw."""
    m = logits.max()
    if not np.isfinite(m):              # a NaN anywhere makes the max NaN
        return -1, False
    if t <= 0.0:    # greedy: the filters' first candidate, the largest logit (the lowest id on ties),
        return np.argmax(logits), False   # without their partition and sort (~0.3 ms at 32k logits)
    ids, logits = _top_k(np.arange(logits.shape[0]), logits, k)
    n = logits.shape[0]
    if p < 1.0:
        n = min(n, max(1, _n_top_p(logits, p)))
    if min_p > 0.0:
        n = max(1, _n_min_p(logits[:n], min_p))
    if n == 1:
        return ids[0], False
    return ids[_draw(logits[:n] / np.float32(t), u)], True


def _top_p(ids, logits, p, min_keep=1):
    if p >= 1.0:
        return ids, logits
    n = max(min_keep, int(_n_top_p(logits, p)))
    return ids[:n], logits[:n]


def _min_p(ids, logits, p, min_keep=1):
    if p <= 0.0:
        return ids, logits
    n = max(min_keep, int(_n_min_p(logits, np.float64(p))))
    return ids[:n], logits[:n]


def _temperature(ids, logits, t):
    if t <= 0.0:
        return ids[:1], logits[:1]
    return ids, logits / np.float32(t)


class Sampler:
    """llama.cpp's default sampler chain: top-k -> top-p -> min-p -> temperature -> dist.

    The defaults are llama.cpp's (``common_params_sampling``). ``temp <= 0`` is greedy decoding;
    ``top_k <= 0``, ``top_p >= 1`` and ``min_p <= 0`` turn those steps off. ``seed``: an int for
    reproducible draws, None for fresh entropy.
    """

    def __init__(self, temp: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 seed=None):
        if not (0.0 <= top_p <= 1.0 and 0.0 <= min_p <= 1.0):
            raise ValueError(f"top_p={top_p} and min_p={min_p} must lie in [0, 1]")
        if not np.isfinite(temp):
            raise ValueError(f"temp={temp} must be finite")
        self.temp = float(temp)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.min_p = float(min_p)
        self.rng = np.random.default_rng(seed)
        self._u = None      # a uniform taken from rng and not used yet (``sample``)

    def candidates(self, logits):
        """The ``(ids, logits)`` left after the filters, before the draw."""
        logits = np.asarray(logits, dtype=np.float32).reshape(-1)
        if logits.size == 0 or not np.isfinite(logits.max()):    # a NaN anywhere makes the max NaN
            raise ValueError("logits must be a non-empty row with no NaN and at least one finite value")
        ids, logits = top_k(np.arange(logits.size), logits, self.top_k)   # sorted from here on
        ids, logits = _top_p(ids, logits, self.top_p)
        ids, logits = _min_p(ids, logits, self.min_p)
        return _temperature(ids, logits, self.temp)

    def sample(self, logits) -> int:
        """Draw the next token id from one row of logits (any float array of ``n_vocab`` values):
        the ``candidates``, then the dist step, a uniform draw located in their cumulative
        distribution. The uniform is taken from the generator before the compiled chain runs and
        kept for the next call when one candidate is left, so the draws are those of the chain
        step by step."""
        logits = np.asarray(logits, dtype=np.float32).reshape(-1)
        if logits.size == 0:
            raise ValueError("logits must be a non-empty row with no NaN and at least one finite value")
        if self._u is None:
            self._u = self.rng.random()
        tok, drawn = _chain(logits, self.top_k, self.top_p, self.min_p, self.temp, self._u)
        if tok < 0:
            raise ValueError("logits must be a non-empty row with no NaN and at least one finite value")
        if drawn:
            self._u = None
        return int(tok)
