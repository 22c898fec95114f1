"""Real GGUF files nobody here made, against llama.cpp (llama-cpp-python, ``llama_cpp_oracle.py``).

Random weights hide what trained ones show: Gemma 3's activations reach 1e4, and a last-bit difference
in one layer grows layer after layer. The files (``lazyggml.testing.REAL_GGUF``; the test extra
installs their packages): SmolLM2-135M-Instruct in Q4_1 (llama architecture, 30 layers) and Gemma 3
270M in Q4_K_M (18 layers, head size 256, one KV head; Q5_0, Q4_K, Q8_0 and Q6_K tensors, since rows of
640 fall back from the K-quants). With flash attention on and off, on the CPU, with 2 threads:

* the token ids of several texts are llama.cpp's;
* the logits at every position of a 42-token prompt are llama.cpp's bit for bit, and so are the
  logits of 64 greedy steps after it, whose tokens are llama.cpp's, in two configurations of both
  engines: as shipped (llama.cpp's defaults: Gemma's Q4_K matrices repacked, ``ggml-cpu/repack.cpp``,
  its K-quant prompt batches through the tiled matmul, ``ggml-cpu/tiled``; lazyggml's defaults
  follow both) and with GGML's reference kernels (``vec_dot``: llama.cpp without repacked weights and
  with ``GGML_CPU_TILED_MM=0``; lazyggml with ``repack=False`` and ``tiled.TILED`` off).

SmolLM2 requantized by llama.cpp's quantizer into Q4_0 and IQ4_NL, the other two types llama.cpp repacks
on AVX2, gives llama.cpp's prompt logits as shipped bit for bit too.

The two configurations are apart by as much as a quantized model is from its float weights' in the
last bits: llama.cpp as shipped against its own reference kernels gives NMSE 4.9e-3 on Gemma 3's
prompt logits (the first layer differs in the last bit, NMSE 4e-15, the last at 2e-3), and 0 on
SmolLM2, none of whose types it repacks or tiles. bench/compare_llama_cpp.py reports both
configurations on any file.
"""
from __future__ import annotations

import numpy as np
import pytest

import lazyggml as lg
from lazyggml.backends.cpu import simd, tiled
from lazyggml.testing import real_gguf
from llama_cpp_oracle import nmse, run_llama_cpp

FILES = ("smollm2-135m-q4_1", "gemma3-270m-q4_k_m")
THREADS = 2
N_CTX = 256
N_GREEDY = 64
#: the prompt (42 tokens for Gemma's vocabulary, 41 for SmolLM2's): below 64, so both engines run
#: the prompt's attention row by row
PROMPT = ("The quick brown fox jumps over the lazy dog. In the beginning God created the heaven and the "
          "earth. And the earth was without form, and void; and darkness was upon the face of the deep.")
#: tokenizer cases: plain prose, numbers, code, accents and CJK, runs of spaces and newlines
TEXTS = [PROMPT, "In 1611, 42 translators met 3.14 times; cost: $1,000.50!",
         "def f(x):\n    return x**2  # square\n\n\n", "Café naïve façade — 日本語のテキスト 😀", "  a  b   c\t\td \n e"]
CONFIGS = ("reference", "shipped")
#: llama.cpp's GGML runs the AVX2 code lazyggml follows (an x86 host with AVX2 and FMA, the oracle
#: built without AVX-512, ``tests/oracle_cflags.sh``: with it, float lanes add 16 at a time and
#: SmolLM2's prompt logits drift to NMSE 0.06): then its bits are asserted, else the issue's targets
#: (NMSE <= 1e-4 at every position, the same greedy tokens)
BITS = simd.HAVE_AVX2 and "fma" in simd._FEATURES and not simd.HAVE_AVX512
NMSE_TARGET = 1e-4


def assert_same(ours, theirs, what):
    per_pos = [nmse(a, b) for a, b in zip(ours, theirs)]
    if BITS:
        assert np.array_equal(ours, theirs), f"{what}: positions off: {[(i, f'{e:.2g}') for i, e in enumerate(per_pos) if e][:8]}"
    else:
        assert max(per_pos) <= NMSE_TARGET, f"{what}: NMSE {max(per_pos):.3g}"
#: SmolLM2 requantized by llama.cpp's own quantizer into the mixes whose types llama.cpp repacks with
#: kernels of their own (Q4_0, IQ4_NL: ``repack.py``), compared as shipped with flash attention
REQUANTIZED = ("q4_0", "iq4_nl")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """llama.cpp's logits and greedy continuations for every file, configuration and flash attention:
    {"files": {name: path}, ("logits", config, fa, name): array, ("greedy", config, fa, name):
    {"prompt_ids", "ids", "logits"}, ("tokens", name): [ids per text]}."""
    d = tmp_path_factory.mktemp("real")
    files = {name: str(real_gguf(name, d)) for name in FILES}
    out = {"files": files}
    prompt = {name: lg.Tokenizer(lg.read_gguf(path).metadata, path).tokenize(PROMPT, add_special=True)
              for name, path in files.items()}
    for config in CONFIGS:
        for fa in (False, True):
            tag = f"{config}-{'fa' if fa else 'nofa'}"
            requant = {mix: str(d / f"smollm2-{mix}.gguf") for mix in REQUANTIZED} if tag == "shipped-fa" else {}
            job = dict(reference=config == "reference", flash_attn=fa,
                       quantize=[dict(src=files[FILES[0]], dst=p, mix=mix, requantize=True) for mix, p in requant.items()],
                       logits=[dict(path=p, n_ctx=N_CTX, tokens=prompt[n], out=str(d / f"{tag}-{n}.npy"))
                               for n, p in files.items()]
                       + [dict(path=p, n_ctx=N_CTX, tokens=prompt[FILES[0]], out=str(d / f"{tag}-{mix}.npy"))
                          for mix, p in requant.items()],
                       greedy=[dict(path=p, n_ctx=N_CTX, prompts=[PROMPT], n=N_GREEDY, out=str(d / f"{tag}-{n}-greedy"))
                               for n, p in files.items()],
                       tokenize=[dict(path=p, texts=TEXTS) for p in files.values()] if tag == "shipped-fa" else [])
            res = run_llama_cpp(job, d, tag)
            for name, path in files.items():
                out["logits", config, fa, name] = np.load(d / f"{tag}-{name}.npy")
                g = res["greedy"][path][0]
                out["greedy", config, fa, name] = dict(g, logits=np.load(d / f"{tag}-{name}-greedy-0.npy"))
                if res["tokens"]:
                    out["tokens", name] = res["tokens"][path]
            for mix, path in requant.items():
                out["requantized", mix] = path, np.load(d / f"{tag}-{mix}.npy"), prompt[FILES[0]]
    return out


_MODELS = {}


def model(oracle, name, fa, config):
    """lazyggml's model of file ``name`` on the CPU (one per file, attention and configuration, KV
    cache reset): as shipped, llama.cpp's defaults (repacked weights, tiled matmul); the reference
    configuration without either (``repack=False``, ``tiled.TILED`` off, which ``configured`` sets
    around every test so that each graph's plan is made in its configuration)."""
    if (name, fa, config) not in _MODELS:
        _MODELS.clear()    # one 270M model at a time is enough memory
        _MODELS[name, fa, config] = lg.load_model(oracle["files"][name], n_ctx=N_CTX, n_threads=THREADS,
                                                  flash_attn=fa, repack=config == "shipped")
    m = _MODELS[name, fa, config]
    m.reset()
    return m


@pytest.fixture
def configured(monkeypatch, config):
    monkeypatch.setattr(tiled, "TILED", config == "shipped")


CASES = [pytest.param(config, name, fa, id=f"{config}-{name}-{'fa' if fa else 'nofa'}")
         for config in CONFIGS for name in FILES for fa in (False, True)]


@pytest.mark.parametrize("name", FILES)
def test_tokens_are_llama_cpp(oracle, name):
    path = oracle["files"][name]
    tok = lg.Tokenizer(lg.read_gguf(path).metadata, path)
    for text, theirs in zip(TEXTS, oracle["tokens", name]):
        assert tok.tokenize(text, add_special=True) == theirs, text


@pytest.mark.parametrize("config, name, fa", CASES)
def test_prompt_logits_are_llama_cpps_bits(oracle, config, name, fa, configured):
    """Every position's logits equal llama.cpp's in the same configuration, bit for bit (``BITS``)."""
    theirs = oracle["logits", config, fa, name]
    ours = model(oracle, name, fa, config).eval(oracle["greedy", config, fa, name]["prompt_ids"])
    assert_same(ours, theirs, "prompt")


@pytest.mark.parametrize("config, name, fa", CASES)
def test_greedy_continuation_is_llama_cpps(oracle, config, name, fa, configured):
    """64 greedy tokens after the prompt: ours (argmax of our logits, step by step) are llama.cpp's,
    and the logits of every step equal theirs bit for bit."""
    g = oracle["greedy", config, fa, name]
    m = model(oracle, name, fa, config)
    logits = m.eval(g["prompt_ids"], logits_all=False)[-1]
    for k, (tok, theirs) in enumerate(zip(g["ids"], g["logits"])):
        assert_same(logits[None], theirs[None], f"step {k}")
        assert int(np.argmax(logits)) == tok, f"step {k}"
        if k + 1 < N_GREEDY:
            logits = m.eval([tok], logits_all=False)[-1]


@pytest.mark.parametrize("mix", REQUANTIZED)
def test_requantized_smollm2_is_llama_cpp_as_shipped(oracle, mix, monkeypatch):
    """SmolLM2's trained weights in Q4_0 and IQ4_NL (llama.cpp's quantizer), whose matrices llama.cpp
    repacks: every prompt position's logits are its own as shipped, bit for bit."""
    monkeypatch.setattr(tiled, "TILED", True)
    path, theirs, ids = oracle["requantized", mix]
    assert {t.type for t in lg.read_gguf(path).tensors.values()} >= {lg.Type[mix.upper()]}
    _MODELS.clear()
    ours = lg.load_model(path, n_ctx=N_CTX, n_threads=THREADS, flash_attn=True).eval(ids)
    assert_same(ours, theirs, mix)
