"""Constrained JSON output (``lazyggml.serving.grammar``, issue 43): the answers a ``response_format``
allows, on the vocabularies of tiny models (SentencePiece with byte fallback; byte-level BPE with
chat tokens) and of the real files' tokenizers (SmolLM2's 49,152 tokens, Gemma 3's 262,144; only
their metadata is read).

A "model" here is random logits (seeded) plus a bonus for the tokens that start with a quote and a
malus for those that open an object or an array, so that strings and objects end within a few dozen
steps; the mask must do the rest.
Without it the first token is already no JSON (a bonus token such as ``",``, which ``accept``
refuses), so every answer test fails if ``mask_logits`` does nothing; the mask tests check the
allowed sets directly too.
"""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from lazyggml.gguf_io import read_gguf
from lazyggml.serving.grammar import GrammarFactory
from lazyggml.testing import make_tiny_model, real_gguf
from lazyggml.tokenizer import Tokenizer

MAX_STEPS = 300
EXTRA_ROWS = 7      # logits past the tokenizer's vocabulary, as a padded output matrix gives

CHAT_SPECIALS = ("<|im_start|>", "<|im_end|>")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}

ITEM = {"type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "count": {"type": "integer", "minimum": 0, "maximum": 99},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        "required": ["color", "count", "tags"], "additionalProperties": False}


def _factory(path):
    return GrammarFactory(Tokenizer(read_gguf(path).metadata, path))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> GrammarFactory of a tiny model's vocabulary."""
    d = tmp_path_factory.mktemp("grammar")
    small = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32)
    # 300 ids: not a multiple of 32, so the mask's last word is partly past the vocabulary
    return {"spm": _factory(make_tiny_model(d / "spm.gguf", arch="llama", **small)),
            "bpe": _factory(make_tiny_model(d / "bpe.gguf", arch="qwen2", n_vocab=300,
                                            extra_special=CHAT_SPECIALS, **small))}


_REAL = {}


def real(name):
    """The GrammarFactory of a real file's tokenizer, made once for the whole module."""
    if name not in _REAL:
        _REAL[name] = _factory(real_gguf(name))
    return _REAL[name]


@pytest.fixture(params=["spm", "bpe", "smollm2-135m-q4_1", "gemma3-270m-q4_k_m"])
def factory(request, tiny):
    return tiny[request.param] if request.param in tiny else real(request.param)


def _taste(piece):
    """The "model"'s taste: short strings (inside one, a token that starts with a quote closes it),
    and no nesting (a token that opens an object or an array comes only when nothing else may)."""
    return -4.0 if b"{" in piece or b"[" in piece else 4.0 if piece.startswith(b'"') else 0.0


@functools.lru_cache(maxsize=None)
def _bonus(tk):
    b = np.array([_taste(tk.token_to_piece(i)) for i in range(tk.n_vocab)], np.float32)
    return np.concatenate([b, np.zeros(EXTRA_ROWS, np.float32)])


def generate(factory, constraint, seed):
    """Mask, sample (argmax of noisy logits), accept until the grammar is done or an
    end-of-generation token comes; the text (without that token)."""
    tk = factory.tokenizer
    bonus = _bonus(tk)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(MAX_STEPS):
        logits = rng.standard_normal(tk.n_vocab + EXTRA_ROWS).astype(np.float32) + bonus
        constraint.mask_logits(logits)
        tok = int(np.argmax(logits))
        assert np.isfinite(logits[tok]), "the mask left nothing"
        constraint.accept(tok)
        if tk.is_eog(tok):
            assert constraint.is_done()
            break
        out.append(tok)
        if constraint.is_done():
            break
    else:
        pytest.fail(f"no end after {MAX_STEPS} tokens: {tk.detokenize(out)!r}")
    return tk.detokenize(out)


def allowed(constraint, n_vocab):
    """The ids ``mask_logits`` leaves finite (ids past the vocabulary included)."""
    logits = np.zeros(n_vocab + EXTRA_ROWS, np.float32)
    constraint.mask_logits(logits)
    assert not np.isposinf(logits).any() and not np.isnan(logits).any()
    return set(np.flatnonzero(np.isfinite(logits)).tolist())


def feed(factory, constraint, text):
    """Accept the tokens of exactly ``text`` (llguidance's tokenization: without the space a
    SentencePiece vocabulary puts in front) one by one."""
    for t in factory.ll_tokenizer.tokenize_str(text):
        constraint.accept(t)


# --- answers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_json_object_gives_an_object(factory, seed):
    text = generate(factory, factory.from_response_format({"type": "json_object"}), seed)
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_with_enum_integer_and_string_array(factory, seed):
    rf = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM, "strict": True}}
    text = generate(factory, factory.from_response_format(rf), seed)
    obj = json.loads(text)
    assert set(obj) == {"color", "count", "tags"}, text
    assert obj["color"] in ("red", "green", "blue")
    assert type(obj["count"]) is int and 0 <= obj["count"] <= 99
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 8 for t in obj["tags"])


def test_json_schema_person_on_smollm2():
    f = real("smollm2-135m-q4_1")
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(3):
        obj = json.loads(generate(f, f.from_response_format(rf), seed))
        assert set(obj) == {"name", "age"}
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 12 and type(obj["age"]) is int


# --- the mask ----------------------------------------------------------------------------------------


def test_mask_allows_only_the_grammar(factory):
    """At the start of a JSON object only "{" may come: no "[", no
    end of generation, no id past the vocabulary; a top-level object ends at its "}", after which
    only the end of generation may come."""
    f, tk = factory, factory.tokenizer
    c = factory.from_response_format({"type": "json_object"})
    ok = allowed(c, tk.n_vocab)
    assert ok and all(i < tk.n_vocab for i in ok)
    assert not ok & tk.eog_ids
    assert all(tk.token_to_piece(i).startswith(b"{") for i in ok)
    assert tk.tokenize("[", add_special=False)[0] not in ok
    feed(f, c, '{"a": [1, "x"]')
    assert not allowed(c, tk.n_vocab) & tk.eog_ids and not c.is_done()
    feed(f, c, "}")
    assert c.is_done()
    assert allowed(c, tk.n_vocab) == set(factory.ll_tokenizer.eos_tokens) <= tk.eog_ids


def test_end_of_generation_exactly_when_complete(tiny):
    """A top-level integer may go on after "12", so it is complete but not done: then, and only
    then, the end-of-generation token is allowed, and accepting it ends the answer."""
    f = tiny["bpe"]
    tk = f.tokenizer
    c = f.from_json_schema({"type": "integer"})
    assert not allowed(c, tk.n_vocab) & tk.eog_ids
    feed(f, c, "-")
    assert not allowed(c, tk.n_vocab) & tk.eog_ids
    feed(f, c, "12")
    ok = allowed(c, tk.n_vocab)
    assert tk.eos_id in ok and tk.tokenize("3", add_special=False)[0] in ok and not c.is_done()
    c.accept(tk.eos_id)
    assert c.is_done()


def test_control_tokens_are_not_text(factory):
    """Inside a JSON string any text may come, but no control token (nor the end of generation)."""
    f, tk = factory, factory.tokenizer
    c = factory.from_json_schema({"type": "string"})
    feed(f, c, '"')
    ok = allowed(c, tk.n_vocab)
    assert len(ok) > tk.n_vocab // 4        # text is free...
    control = [i for i in range(tk.n_vocab) if tk.tokens[i] in ("<s>", "</s>", "<bos>", "<eos>", "<|im_start|>",
                                                                 "<|im_end|>", "<|endoftext|>", "<start_of_turn>",
                                                                 "<|end_of_text|>", "<|begin_of_text|>")]
    assert control and not ok & set(control)   # ...but markup tokens are not text
    assert not ok & tk.eog_ids


def test_whitespace_is_bounded(tiny):
    """One space between tokens, not two (llama.cpp's JSON whitespace)."""
    f = tiny["bpe"]
    tk = f.tokenizer
    space, = tk.tokenize(" ", add_special=False)
    c = f.from_response_format({"type": "json_object"})
    feed(f, c, "{")
    c.accept(space)
    assert space not in allowed(c, tk.n_vocab)
    with pytest.raises(ValueError):
        c.accept(space)


def test_accept_refuses_a_token_not_allowed(tiny):
    f = tiny["spm"]
    tk = f.tokenizer
    c = f.from_response_format({"type": "json_object"})
    bracket = tk.tokenize("[", add_special=False)[-1]
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(bracket)
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(tk.n_vocab + 1)          # past the vocabulary
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(tk.eos_id)               # nothing written yet
    feed(f, c, "{}")                     # the state was left as it was
    assert c.is_done()
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(bracket)


# --- response_format ---------------------------------------------------------------------------------


def test_text_is_unconstrained(tiny):
    f = tiny["bpe"]
    assert f.from_response_format(None) is None
    assert f.from_response_format({"type": "text"}) is None


@pytest.mark.parametrize("rf, message", [
    ("json", "response_format must be an object"),
    ({}, "response_format.type"),
    ({"type": "xml"}, "response_format.type must be one of"),
    ({"type": "json_schema"}, "response_format.json_schema is missing"),
    ({"type": "json_schema", "json_schema": "person"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, "response_format.json_schema.schema is missing"),
    ({"type": "json_schema", "json_schema": {"schema": [1, 2]}}, "response_format.json_schema.schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": True}}, "response_format.json_schema.schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": PERSON}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON, "strict": "yes"}}, "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": "name"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "[a-"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/missing"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "minLength": 5, "maxLength": 2}}},
     "response_format.json_schema.schema"),                          # no answer satisfies it
    ({"type": "json_object", "schema": "x"}, "response_format.schema"),
])
def test_bad_response_format_raises(tiny, rf, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        tiny["bpe"].from_response_format(rf)


def test_strict_refuses_what_cannot_be_enforced(tiny):
    """``uniqueItems`` cannot be enforced token by token: refused when strict, else ignored (a warning)."""
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    f = tiny["bpe"]
    with pytest.raises(ValueError, match="uniqueItems"):
        f.from_response_format({"type": "json_schema", "json_schema": {"schema": schema, "strict": True}})
    c = f.from_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    assert any("uniqueItems" in w for w in c.warnings)


def test_json_object_with_a_schema(tiny):
    """llama-server's ``{"type": "json_object", "schema": ...}``."""
    f = tiny["spm"]
    obj = json.loads(generate(f, f.from_response_format({"type": "json_object", "schema": PERSON}), 0))
    assert set(obj) == {"name", "age"}


def test_text_of_the_vocabulary_round_trips(tiny):
    """llguidance's own tokenization of text (a SentencePiece vocabulary adds a space in front,
    which the sentinel takes away) gives back exactly the text."""
    for f in tiny.values():
        for text in ("a", ' {"x": 1}', "été"):
            ids = f.ll_tokenizer.tokenize_str(text)
            assert f.ll_tokenizer.decode_str(ids) == text
