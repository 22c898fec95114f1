"""Constrained output: the tokens a request may sample, so that its answer is JSON (OpenAI's
``response_format``), through llguidance, the grammar engine llama.cpp builds in as its option
``LLAMA_LLGUIDANCE``.

What a client asks (OpenAI's ``response_format``):

* absent or ``{"type": "text"}``: nothing is constrained;
* ``{"type": "json_object"}``: any JSON object (the JSON schema ``{"type": "object"}``); llama-server's
  ``{"type": "json_object", "schema": {...}}`` is read too;
* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: an
  answer valid against ``schema``. With ``strict`` true a keyword llguidance cannot enforce
  (``uniqueItems``, ``not``, an unknown ``format`` ...) is refused, as OpenAI's strict mode refuses
  what it does not support; otherwise it is ignored and the rest of the schema still holds.

A bad ``response_format`` raises ``ValueError`` naming the field (``response_format.json_schema.schema``
...), which the server answers with HTTP 400.

How: llguidance sees the vocabulary as bytes. ``GrammarFactory`` gives it every token's piece once per
model (an ``LLTokenizer``: a trie of the pieces, ~0.6 s for SmolLM2's 49,152 tokens); control tokens
get llguidance's special-token marker, the byte 0xFF, in front, which never occurs in UTF-8 text, so
no grammar over text can produce them. The end-of-generation tokens are llguidance's EOS tokens: its
mask allows them exactly when the JSON is complete, and the engine ends the request when one is
sampled. Each request compiles its schema into an ``LLMatcher`` (~0.5 ms for a schema of a few
properties), whose state advances with each accepted token:

    mask_logits(logits)   the matcher's bitmask (one bit per token, computed in Rust), then -inf
                          on every token it does not allow (~40 µs a token for SmolLM2)
    accept(token)         the matcher consumes the token (ValueError if it was not allowed)
    is_done()             nothing more can follow (the closing brace of the top-level object)

Whitespace between JSON tokens is bounded as llama.cpp's JSON grammars bound it (one space, or one or
two newlines and up to 20 spaces or tabs): llguidance's default allows any run of it, and a small
model can spend its whole ``max_tokens`` on newlines inside an unfinished object.
"""
from __future__ import annotations

import functools

import llguidance
import numpy as np
from numba import njit

from ..tokenizer import TokenAttr

__all__ = ["GrammarFactory", "Constraint"]

# llama.cpp's json-schema-to-grammar SPACE_RULE: | " " | "\n"{1,2} [ \t]{0,20}
_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})"
_SPECIAL_MARKER = b"\xff"        # llguidance's TokTrie::SPECIAL_TOKEN_MARKER
_TYPES = ("text", "json_object", "json_schema")


class _Vocabulary:
    """The vocabulary as ``llguidance.TokenizerWrapper`` reads it: ``tokens`` (bytes per id),
    ``eos_token_id``, ``bos_token_id``, ``special_token_ids``, and a call giving the ids of a text.

    llguidance calls it while computing a mask, on the bytes the grammar forces next (``{"color"``
    where a schema's first key is required): answers are kept, since the same schemas come back and
    a call can be slow (~10 ms for Gemma 3's 262,144 tokens, ~40 µs for SmolLM2's). A SentencePiece
    vocabulary that adds a space prefix would turn "a" into " a", so a text is tokenized behind a
    sentinel character (one that merges with nothing, found when the vocabulary is read) whose
    tokens are then dropped, as llguidance does with llama.cpp's tokenizer."""

    def __init__(self, tokenizer, pieces):
        self._tok = tokenizer
        self.tokens = pieces
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = []      # marked in the pieces already
        self._sentinel, self._sentinel_ids = "", []
        self._exact_ids = functools.lru_cache(maxsize=4096)(self._exact_ids)
        if tokenizer.model == "llama" and tokenizer.add_space_prefix:
            for c in map(chr, range(1, 32)):
                if all(self._behind(c, t) for t in ("a", ' {"', "1")):
                    self._sentinel, self._sentinel_ids = c, self._ids(c)
                    break

    def _ids(self, text):
        return self._tok.tokenize(text, add_special=False)

    def _behind(self, c, text) -> bool:
        """``c + text`` tokenizes as ``c`` alone, then tokens spelling exactly ``text``."""
        head, ids = self._ids(c), self._ids(c + text)
        return ids[:len(head)] == head and b"".join(self.tokens[i] for i in ids[len(head):]) == text.encode()

    def _exact_ids(self, text):
        if not self._sentinel:
            return tuple(self._ids(text))
        return tuple(self._ids(self._sentinel + text)[len(self._sentinel_ids):])

    def __call__(self, text):
        if isinstance(text, bytes):      # TokenizerWrapper tries bytes first
            text = text.decode()
        return list(self._exact_ids(text))


def _pieces(tokenizer) -> list:
    """Each token's bytes as llguidance should see them: the text it stands for, or, for a control
    token (and a user-defined one written like a tag, ``<...>``, as llguidance's llama.cpp bridge
    treats them), the marker and its name, a token no text can match. Unused tokens are empty,
    which llguidance never allows."""
    out = []
    eog = tokenizer.eog_ids
    for i, name in enumerate(tokenizer.tokens):
        attr = tokenizer.attrs[i]
        if attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN) or i in eog or \
                (attr & TokenAttr.USER_DEFINED and name.startswith("<") and name.endswith(">")):
            out.append(_SPECIAL_MARKER + name.encode())
        else:
            out.append(tokenizer.token_to_piece(i))
    return out


@njit(cache=True)
def _apply_bitmask(logits, bitmask, n):
    """-inf on each of ``logits`` whose bit in ``bitmask`` (int32 words, bit ``i % 32`` of word
    ``i // 32``) is clear, and on every id from ``n`` on; whether any id is left. Compiled and
    word by word: a mask is mostly whole words of "no" (between JSON tokens) or of "yes" (inside
    a string), which NumPy's unpack-and-select (~50 µs for SmolLM2's vocabulary) cannot skip
    (~10 µs here)."""
    ninf = np.float32(-np.inf)
    m = min(n, logits.shape[0])
    any_left = False
    for w in range((m + 31) // 32):
        bits = bitmask[w]
        lo = w * 32
        hi = min(lo + 32, m)
        if bits == -1 and hi - lo == 32:
            any_left = True
        elif bits == 0:
            logits[lo:hi] = ninf
        else:
            for i in range(lo, hi):
                if (bits >> (i - lo)) & 1:
                    any_left = True
                else:
                    logits[i] = ninf
    logits[m:] = ninf
    return any_left


def _field(obj, key, kind, where, required=False):
    """``obj[key]`` checked to be a ``kind`` (None when absent and not required)."""
    v = obj.get(key)
    if v is None:
        if required:
            raise ValueError(f"{where}.{key} is missing")
        return None
    if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        names = {dict: "an object", str: "a string", bool: "true or false"}
        raise ValueError(f"{where}.{key} must be {names[kind]}, not {type(v).__name__} {v!r:.60}")
    return v


class GrammarFactory:
    """Makes a request's ``Constraint`` from its ``response_format``; one per model, since reading
    the vocabulary into llguidance takes a while (``tokenizer``: the model's ``Tokenizer``).

    ``n_vocab``: the ids llguidance knows (the tokenizer's); logits may have more rows (a padded
    output matrix), and those ids are never allowed."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.n_vocab = tokenizer.n_vocab
        wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, _pieces(tokenizer)))
        eog = sorted(tokenizer.eog_ids)
        self.ll_tokenizer = llguidance.LLTokenizer(wrapper, eos_token=eog or None)
        _apply_bitmask(np.zeros(1, np.float32), np.zeros(1, np.int32), 1)   # compiled now, not in a request

    def from_response_format(self, response_format) -> Constraint | None:
        """The constraint ``response_format`` asks for (module docstring), or None for plain text;
        ``ValueError`` naming the field for anything else."""
        where = "response_format"
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise ValueError(f"{where} must be an object such as {{\"type\": \"json_object\"}}, "
                             f"not {type(response_format).__name__}")
        kind = response_format.get("type")
        if kind not in _TYPES:
            raise ValueError(f"{where}.type must be one of {', '.join(map(repr, _TYPES))}, not {kind!r}")
        if kind == "text":
            return None
        strict = False
        if kind == "json_object":
            schema = _field(response_format, "schema", dict, where) or {"type": "object"}
        else:
            where += ".json_schema"
            spec = _field(response_format, "json_schema", dict, "response_format", required=True)
            _field(spec, "name", str, where)
            strict = bool(_field(spec, "strict", bool, where))
            schema = _field(spec, "schema", dict, where, required=True)
            where += ".schema"
        return self.from_json_schema(schema, strict=strict, where=where)

    def from_json_schema(self, schema: dict, strict: bool = False, where: str = "schema") -> Constraint:
        """The constraint of one JSON schema (a dict); ``strict``: refuse keywords llguidance cannot
        enforce instead of ignoring them. ``ValueError`` (starting with ``where``) for a schema
        llguidance cannot compile."""
        options = {"whitespace_pattern": _WHITESPACE, "lenient": not strict}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as e:       # not JSON-serializable
            raise ValueError(f"{where} is not valid JSON: {e}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{where} is not a JSON schema llguidance can enforce: {matcher.get_error()}")
        return Constraint(matcher, self.n_vocab, self.ll_tokenizer)


class Constraint:
    """One request's grammar state: which tokens may come next (``mask_logits``), the tokens that
    came (``accept``), whether the answer is complete (``is_done``). ``warnings``: what llguidance
    ignored in the schema (unsupported keywords when not strict)."""

    def __init__(self, matcher, n_vocab, ll_tokenizer):
        self._matcher = matcher
        self.n_vocab = n_vocab
        self._eos = frozenset(ll_tokenizer.eos_tokens)
        self._bitmask = np.zeros((ll_tokenizer.vocab_size + 31) // 32, np.int32)   # a bit per llguidance id
        self.warnings = matcher.get_grammar_warnings()

    def _check(self):
        if self._matcher.is_error():
            raise ValueError(f"the grammar cannot go on: {self._matcher.get_error().splitlines()[0]}")

    def mask_logits(self, logits: np.ndarray) -> None:
        """Set every token the grammar does not allow next to -inf, in place (``logits``: float32,
        one per id; ids beyond the tokenizer's are never allowed). ``ValueError`` if none is left."""
        self._check()
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if not _apply_bitmask(logits, self._bitmask, self.n_vocab):
            raise ValueError("the grammar allows no token of the vocabulary next")

    def accept(self, token: int) -> None:
        """Advance past ``token``; ``ValueError`` (the state unchanged) if the grammar does not allow
        it next."""
        self._check()
        m, token = self._matcher, int(token)
        # a complete answer allows only the end of generation, which validate_tokens does not know
        if not (0 <= token < self.n_vocab and
                (token in self._eos if m.is_stopped() else m.validate_tokens([token]) == 1)):
            raise ValueError(f"token {token} is not allowed here by the response_format's grammar")
        if not m.consume_token(token):
            self._check()

    def is_done(self) -> bool:
        """The grammar accepts nothing more: the JSON is complete (or an end-of-generation token
        ended it)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()
