"""Tokenizers of both vocabulary kinds: hand-computed merges, byte fallback, special tokens, BOS/EOS,
llama.cpp's detokenizer quirks, vocabulary validation, round trips over random Unicode text, and
every pre-tokenizer kind of the tiny models against llama.cpp's own tokenizer on 3,500 texts."""
import pytest
from hypothesis import given, settings, strategies as st

from lazyggml.gguf_io import GGUFError, read_gguf
from lazyggml.testing import make_tiny_llama, make_tiny_model
from lazyggml.tokenizer import (BYTE_TO_UNICODE, SPIECE_UNDERLINE as U, TokenAttr, Tokenizer, byte_encode,
                                clean_up_tokenization_spaces, pre_tokenize)

N_SPM_FIXED = 3 + 256  # <unk> <s> </s> and the byte tokens come before the pieces


def spm(pieces: dict, **extra):
    """A SentencePiece vocabulary: specials, <0x00>..<0xFF>, then ``pieces`` (text -> score)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * N_SPM_FIXED + [float(s) for s in pieces.values()],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces)}
    meta.update(extra)
    return Tokenizer(meta, "spm.gguf")


def bpe(merges, extra_tokens=(), pre="gpt-2", specials=("<|bos|>", "<|eos|>"), **extra):
    """A byte-level BPE vocabulary: the 256-character alphabet, the merge results, extra tokens,
    then control tokens (BOS, EOS)."""
    tokens = list(BYTE_TO_UNICODE)
    for m in merges:
        a, b = m.split(" ")
        if a + b not in tokens:
            tokens.append(a + b)
    tokens += [t for t in extra_tokens if t not in tokens]
    n_normal = len(tokens)
    tokens += list(specials)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * n_normal + [3] * len(specials),
            "tokenizer.ggml.merges": list(merges),
            "tokenizer.ggml.bos_token_id": n_normal, "tokenizer.ggml.eos_token_id": n_normal + 1}
    meta.update(extra)
    return Tokenizer(meta, "bpe.gguf")


def ids_of(tok, *pieces):
    return [tok.tokens.index(p) for p in pieces]


# --- SentencePiece ------------------------------------------------------------------------------

def test_spm_merges_by_score():
    tok = spm({"a": -1, "b": -2, "c": -3, "ab": -5, "bc": -0.5, U: -4, U + "a": -6},
              **{"tokenizer.ggml.add_space_prefix": False})
    assert tok.tokenize("abc", add_special=False) == ids_of(tok, "a", "bc")  # "bc" outscores "ab"
    tok = spm({"a": -1, "b": -2, "c": -3, "ab": -5, "bc": -0.5, U: -4, U + "a": -6})
    # with the space prefix: "▁abc" -> bc first, "ab" is then stale, "▁a" still merges
    assert tok.tokenize("abc") == [1] + ids_of(tok, U + "a", "bc")


def test_spm_ties_merge_leftmost_first():
    tok = spm({"a": -1, "b": -1, "ab": -2, "ba": -2}, **{"tokenizer.ggml.add_space_prefix": False})
    assert tok.tokenize("aba", add_special=False) == ids_of(tok, "ab", "a")
    assert tok.tokenize("bab", add_special=False) == ids_of(tok, "ba", "b")


def test_spm_byte_fallback_and_spaces():
    tok = spm({U: -1, "h": -2, "i": -3, U + "h": -4, "hi": -5, U + "hi": -6})
    byte = lambda b: 3 + b  # noqa: E731
    assert tok.tokenize("hi") == [1] + ids_of(tok, U + "hi")
    assert tok.tokenize("hi é", add_special=False) == ids_of(tok, U + "hi", U) + [byte(0xC3), byte(0xA9)]
    assert tok.tokenize("😀", add_special=False) == ids_of(tok, U) + [byte(b) for b in "😀".encode()]
    assert tok.tokenize("a\nb", add_special=False) == ids_of(tok, U) + [byte(0x61), byte(0x0A), byte(0x62)]
    assert tok.tokenize("", add_special=True) == [1] and tok.tokenize("", add_special=False) == []
    assert tok.detokenize(tok.tokenize("hi é 😀 世界\n x", add_special=False)) == "hi é 😀 世界\n x"


def test_spm_detokenize_quirks():
    tok = spm({U: -1, "h": -2, "i": -3, U + "h": -4, "hi": -5, U + "hi": -6})
    hi = tok.tokens.index(U + "hi")
    assert tok.detokenize([hi]) == "hi"              # the prefix space is removed from the first token
    assert tok.detokenize([hi, hi]) == "hi hi"
    assert tok.detokenize([1, hi]) == " hi"          # ... but a BOS before it takes that turn (llama.cpp)
    assert tok.detokenize([1, hi, 2], remove_special=True) == " hi"
    assert tok.detokenize([1, hi, 2], unparse_special=True) == "<s> hi</s>"
    assert tok.token_to_piece(hi) == b" hi" and tok.token_to_piece(1) == b""
    assert tok.token_to_piece(1, special=True) == b"<s>" and tok.token_to_piece(3 + 0xE4) == b"\xe4"
    assert tok.detokenize([3 + 0xE4, 3 + 0xB8]) == "\ufffd"  # a cut-off character
    with pytest.raises(ValueError, match="out of the vocabulary"):
        tok.detokenize([tok.n_vocab])


def test_spm_special_tokens_and_flags():
    tok = spm({U: -1, "h": -2, "i": -3, "hi": -4, U + "hi": -5, "<tool>": 0},
              **{"tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 5 + [4],
                 "tokenizer.ggml.add_eos_token": True})
    tool = tok.tokens.index("<tool>")
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.add_bos, tok.add_eos) == (1, 2, 0, True, True)
    assert tok.tokenize("hi") == [1, tok.tokens.index(U + "hi"), 2]
    # control tokens in the text are text unless parse_special; user-defined ones always match
    assert tok.tokenize("<s>hi", add_special=False, parse_special=True) == [1] + ids_of(tok, U + "hi")
    assert 1 not in tok.tokenize("<s>hi", add_special=False)
    assert tok.tokenize("hi<tool>hi", add_special=False) == ids_of(tok, U + "hi") + [tool] + ids_of(tok, U + "hi")
    assert tok.attrs[tool] == TokenAttr.USER_DEFINED and tok.token_to_piece(tool) == b"<tool>"
    assert tok.is_eog(2) and not tok.is_eog(1)


def test_missing_byte_token_uses_unk():
    """llama.cpp throws when a byte has no token; SentencePiece, and lazyggml, emit <unk>."""
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", U, "a"],
            "tokenizer.ggml.token_type": [2, 3, 3, 1, 1]}
    assert Tokenizer(meta).tokenize("ab", add_special=False) == [3, 4, 0]
    assert Tokenizer({**meta, "tokenizer.ggml.unknown_token_id": 2}).tokenize("ab", add_special=False) == [3, 4, 2]
    assert Tokenizer({**meta, "tokenizer.ggml.unknown_token_id": 99}).unk_id == 0  # out of range: ignored


# --- byte-level BPE -----------------------------------------------------------------------------

def test_bpe_merges_by_rank():
    tok = bpe(["b c", "a b", "a bc"])
    assert tok.tokenize("abc", add_special=False) == ids_of(tok, "abc")
    tok = bpe(["a b", "b c"])
    assert tok.tokenize("abc", add_special=False) == ids_of(tok, "ab", "c")
    space = byte_encode(" ")
    tok = bpe([f"{space} a", "b c"])  # words "a", " bc", " a": the space merges only with "a"
    assert tok.tokenize("a bc a", add_special=False) == ids_of(tok, "a", space, "bc", space + "a")


def test_bpe_bytes_and_unicode():
    tok = bpe([])
    text = "é世😀\n"
    assert tok.tokenize(text, add_special=False) == [tok.tokens.index(c) for c in byte_encode(text)]
    assert tok.detokenize(tok.tokenize(text)) == text
    assert byte_encode(" \n") == "ĠĊ"


def test_bpe_ignore_merges_llama3():
    """Llama 3 takes a word that is a token as it is, even when no merges lead to it."""
    whole = byte_encode("abc")
    assert bpe([], [whole], pre="llama-bpe").tokenize("abc", add_special=False) == [256]
    tok = bpe([], [whole], pre="gpt-2")
    assert tok.tokenize("abc", add_special=False) == ids_of(tok, "a", "b", "c")


def test_bpe_flags_by_pre_tokenizer():
    assert bpe([], pre="llama-bpe").add_bos and not bpe([], pre="gpt-2").add_bos
    tok = bpe([], pre="llama-bpe")
    assert tok.tokenize("a")[0] == tok.bos_id and tok.detokenize(tok.tokenize("a")) == "a"
    assert bpe([], pre="default").clean_spaces and not bpe([], pre="smollm").clean_spaces
    text = "Hello , world . It 's"
    assert bpe([], pre="default").detokenize(bpe([], pre="default").tokenize(text)) == "Hello, world. It's"
    assert bpe([], pre="smollm").detokenize(bpe([], pre="smollm").tokenize(text)) == text
    tok = bpe([], extra_tokens=["<|eot_id|>"])
    eot = tok.tokens.index("<|eot_id|>")
    assert tok.is_eog(eot) and tok.attrs[eot] & TokenAttr.CONTROL  # recognised by its text
    assert tok.is_eog(tok.eos_id)


def test_bpe_special_tokens():
    tok = bpe([], pre="llama-bpe", specials=("<|begin_of_text|>", "<|end_of_text|>"))
    bos = tok.bos_id
    assert tok.tokenize("<|begin_of_text|>x", parse_special=True) == [bos, bos, tok.tokens.index("x")]
    assert tok.tokenize("<|begin_of_text|>x", add_special=False).count(bos) == 0
    assert tok.detokenize([bos, tok.tokens.index("x")], unparse_special=True) == "<|begin_of_text|>x"


def test_clean_up_tokenization_spaces():
    c = clean_up_tokenization_spaces
    assert c(b"a , b . c ! d ?") == b"a, b. c! d?"
    assert c(b"x ' y") == b"x'y" and c(b" ' ' ") == b"'' "
    assert c(b"I 'm you 're we 've it 's") == b"I'm you're we've it's"
    assert c(b"don 't I 'd we 'll") == b"don 't I 'd we 'll"


@pytest.mark.parametrize("pre, text, words", [
    ("gpt-2", "Hello, world! 1234", ["Hello", ",", " world", "!", " 1234"]),
    ("gpt-2", "a  b\n\n  c  ", ["a", " ", " b", "\n\n ", " c", "  "]),
    ("gpt-2", "I'm here's", ["I", "'m", " here", "'s"]),
    ("default", "Hello, world! 1234", ["Hello", ",", " world", "!", " ", "123", "4"]),
    ("llama-bpe", "a  b\n\n  c  ", ["a", " ", " b", "\n\n", " ", " c", "  "]),
    ("llama-bpe", "x\t\ty 1234567", ["x", "\t", "\ty", " ", "123", "456", "7"]),
    ("llama-bpe", "IT'S", ["IT", "'S"]),
    ("smollm", "a 12", ["a", " ", "1", "2"]),
    ("qwen2", "x 12", ["x", " ", "1", "2"]),
])
def test_pre_tokenizers(pre, text, words):
    assert pre_tokenize(text, pre) == words


# --- validation ---------------------------------------------------------------------------------

# ten tokens: too few for the BPE default BOS/EOS id 11, so there is no BOS or EOS
BASE = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": list("abcdefghij"),
        "tokenizer.ggml.merges": []}


@pytest.mark.parametrize("change, field, message", [
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model", "missing"),
    ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model", "unsupported tokenizer"),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens", "missing"),
    ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens", "empty"),
    ({"tokenizer.ggml.tokens": ["a", 1]}, "tokenizer.ggml.tokens", "array of str"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a"]}, "tokenizer.ggml.tokens[2]", "duplicate token"),
    ({"tokenizer.ggml.scores": [0.0]}, "tokenizer.ggml.scores", "entries for 10 tokens"),
    ({"tokenizer.ggml.token_type": [1.5] * 10}, "tokenizer.ggml.token_type", "array of int"),
    ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges", "missing"),
    ({"tokenizer.ggml.pre": "tekken"}, "tokenizer.ggml.pre", "unsupported pre-tokenizer"),
    ({"tokenizer.ggml.pre": "llama-bpe"}, "tokenizer.ggml.add_bos_token", "bos_token_id is not set"),
    ({"tokenizer.ggml.add_eos_token": True}, "tokenizer.ggml.add_eos_token", "eos_token_id is not set"),
    ({"tokenizer.ggml.add_bos_token": 1}, "tokenizer.ggml.add_bos_token", "expected a bool"),
])
def test_vocabulary_errors(change, field, message):
    meta = dict(BASE)
    for k, v in change.items():
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    with pytest.raises(GGUFError, match=message) as e:
        Tokenizer(meta, "v.gguf")
    assert e.value.field == field and e.value.path == "v.gguf"


def test_empty_token_is_renamed():
    tok = Tokenizer({**BASE, "tokenizer.ggml.tokens": ["a", "", "b"]})
    assert tok.tokens == ["a", "[EMPTY_1]", "b"]


# --- round trips on make_tiny_llama vocabularies --------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tokenizers(tmp_path_factory):
    d = tmp_path_factory.mktemp("vocab")
    files = {"spm": make_tiny_llama(d / "spm.gguf", n_vocab=400),
             "spm256": make_tiny_llama(d / "spm256.gguf"),
             "llama-bpe": make_tiny_llama(d / "l3.gguf", vocab="gpt2", n_vocab=400),
             "default": make_tiny_llama(d / "def.gguf", vocab="gpt2", tokenizer_pre="default"),
             "smollm": make_tiny_llama(d / "sm.gguf", vocab="gpt2", tokenizer_pre="smollm", n_vocab=300)}
    return {k: Tokenizer(read_gguf(p).metadata, p) for k, p in files.items()}


def test_tiny_vocabularies(tiny_tokenizers):
    spm_tok = tiny_tokenizers["spm"]
    assert spm_tok.model == "llama" and spm_tok.n_vocab == 400 and spm_tok.tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert spm_tok.tokens[3 + 0x0A] == "<0x0A>" and U in spm_tok.tokens
    small = tiny_tokenizers["spm256"]
    assert small.n_vocab == 256 and "<0xC0>" not in small.tokens and "<0xF4>" in small.tokens
    l3 = tiny_tokenizers["llama-bpe"]
    assert l3.model == "gpt2" and l3.pre == "llama-bpe" and l3.add_bos
    assert l3.tokens[l3.bos_id] == "<|begin_of_text|>" and l3.is_eog(l3.eos_id)
    # the learnt merges are used: common English comes out in fewer tokens than bytes
    text = "the quick brown fox, the lazy dog"
    for tok in (spm_tok, l3):
        assert len(tok.tokenize(text, add_special=False)) < len(text) * 0.8


unicode_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
# joined fragments that stress the tokenizers: spaces, newlines, contractions, combining marks,
# emoji sequences, digits, the "▁" character itself and special-token text
mixed_text = st.lists(st.sampled_from(list("ab e.,'!? \n\t") + [
    "é", "ß", "世", "界", "😀", "👍🏽", "\u0301", "1", "23", " 's", U, "<s>", "\0"]), max_size=30).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=st.one_of(unicode_text, mixed_text))
def test_round_trip_spm(tiny_tokenizers, text):
    for name in ("spm", "spm256"):
        tok = tiny_tokenizers[name]
        ids = tok.tokenize(text)
        assert ids[0] == tok.bos_id and all(0 <= i < tok.n_vocab for i in ids)
        # SentencePiece cannot tell "▁" written in the text from a space
        assert tok.detokenize(ids[1:]) == text.replace(U, " ")
        pieces = b"".join(tok.token_to_piece(i) for i in ids).decode()
        assert pieces == (" " + text if text else "").replace(U, " ")  # the pieces keep the prefix space


@settings(max_examples=150, deadline=None)
@given(text=st.one_of(unicode_text, mixed_text))
def test_round_trip_bpe(tiny_tokenizers, text):
    for name in ("llama-bpe", "default", "smollm"):
        tok = tiny_tokenizers[name]
        ids = tok.tokenize(text)
        expected = clean_up_tokenization_spaces(text.encode()).decode() if tok.clean_spaces else text
        assert tok.detokenize(ids) == expected
        assert b"".join(tok.token_to_piece(i) for i in ids) == text.encode()
        assert "".join(pre_tokenize(text, tok.pre)) == text


# --- against llama.cpp's own tokenizer -------------------------------------------------------------

# llama.cpp's own llama_detokenize (llama-cpp-python's Llama.detokenize is Python of its own)
LLAMA_CPP_TOKENIZE = r"""
import ctypes, json, sys
import llama_cpp
job = json.load(open(sys.argv[1]))
out = {}

def detokenize(vocab, ids):
    buf = ctypes.create_string_buffer(64 * len(ids) + 64)
    n = llama_cpp.llama_detokenize(vocab, (llama_cpp.llama_token * len(ids))(*ids), len(ids), buf, len(buf),
                                   False, False)
    assert n >= 0, n
    return buf.raw[:n].decode("utf-8", "replace")

for name, path in job["files"].items():
    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    ids = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in job["texts"]]
    out[name] = {"ids": ids, "text": [detokenize(llm._model.vocab, i) for i in ids]}
    llm.close()
json.dump(out, open(sys.argv[2], "w"))
"""
N_ORACLE_TEXTS = 3500
FRAGMENTS = list("ab e.,'!?-\n\t\r:;()") + [
    "  ", "\n\n", "   x", "é", "ß", "世界", "😀", "👍🏽", "\u0301", "1", "23", "456", "7890", " 's", "'re", "'LL",
    U, "<s>", "<|endoftext|>", "\u00a0", "Ωmega", "naïve", "こんにちは", "Привет", "مرحبا", "\u200b", "  \n "]


def oracle_texts(n):
    """``n`` texts: lines of the embedded model's evaluation text (English, KJV), alone and run
    together, and as many mixtures of the fragments above (scripts, emoji, digit runs,
    contractions, whitespace runs, special-token text)."""
    import gzip
    import random
    from importlib.resources import files
    lines = gzip.decompress((files("lazyggml") / "data" / "kjv-eval.txt.gz").read_bytes()).decode().splitlines()
    rng = random.Random(20241202)
    english = [" ".join(lines[i:i + rng.randint(1, 3)]) for i in rng.sample(range(len(lines) - 3), n // 2)]
    mixed = ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 40))) for _ in range(n - n // 2)]
    return english + mixed


def test_tokenizers_match_llama_cpp(tmp_path):
    """Every vocabulary kind make_tiny_model writes (SentencePiece; byte-level BPE with the
    llama-bpe, qwen2, default and smollm pre-tokenizers), loaded by llama.cpp (llama-cpp-python,
    ``vocab_only``) and by lazyggml: the same ids for each of 3,500 texts, and the same text back."""
    import json
    import subprocess
    import sys
    files = {"spm": make_tiny_llama(tmp_path / "spm.gguf", n_vocab=400),
             "llama-bpe": make_tiny_llama(tmp_path / "l3.gguf", vocab="gpt2", n_vocab=400),
             "qwen2": make_tiny_model(tmp_path / "q2.gguf", arch="qwen2", n_vocab=400),
             "default": make_tiny_llama(tmp_path / "def.gguf", vocab="gpt2", tokenizer_pre="default"),
             "smollm": make_tiny_llama(tmp_path / "sm.gguf", vocab="gpt2", tokenizer_pre="smollm", n_vocab=300)}
    texts = oracle_texts(N_ORACLE_TEXTS)
    job, result = tmp_path / "job.json", tmp_path / "result.json"
    job.write_text(json.dumps({"files": {k: str(p) for k, p in files.items()}, "texts": texts}))
    r = subprocess.run([sys.executable, "-c", LLAMA_CPP_TOKENIZE, str(job), str(result)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    theirs = json.loads(result.read_text())
    for name, path in files.items():
        tok = Tokenizer(read_gguf(path).metadata, path)
        for text, ids, back in zip(texts, theirs[name]["ids"], theirs[name]["text"]):
            ours = tok.tokenize(text)
            assert ours == ids, (name, text)
            assert tok.detokenize(ours) == back, (name, text)
