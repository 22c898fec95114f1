"""End to end against llama.cpp (llama-cpp-python, the whole-model oracle), for every weight type.

What is compared
----------------
Three LLaMA models, each requantized by llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``,
``llama_model_quantize_default_params()``, ``LLAMA_FTYPE_MOSTLY_*``) into each of the twelve mixes
of ``MIXES``:

* ``tiny576``: ``make_tiny_model`` with n_embd 576 (9 heads, 3 KV heads, n_ff 512), written in F32.
  Rows of 576 are not a multiple of 256, so llama.cpp's quantizer falls back for every matrix but
  ``ffn_down`` (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0, IQ4_XS -> IQ4_NL, ...),
  and those fallbacks, as llama.cpp chooses them, are what this model is for;
* ``tiny256``: the same with n_embd 256 (4 heads, 2 KV heads), so that the K-quants and IQ4_XS
  themselves hold most matrices;
* ``default``: the embedded trained model (``lazyggml/data/default.gguf``, Q4_K_M), requantized
  (``allow_requantize``: llama.cpp dequantizes its Q4_K/Q6_K and quantizes again).

The other families (``FAMILIES``: Qwen2, Qwen3, Gemma 3, Phi-3), as ``make_tiny_model(arch=...)``
writes them (with n_embd 256), on their F32 weights and in Q4_K_M, with and without flash attention.

``test_quantized_files_hold_the_intended_types`` reads every file back and asserts that the mix's
type (on tiny576: its 32-block fallback, and the K-type in ``ffn_down``) holds the most matrices,
so that no case passes vacuously.

Logits: a 16-token prompt from an empty cache, lazyggml's CPU backend against llama.cpp's
(``Llama(path, n_ctx, n_threads=2, logits_all=True, verbose=False)``, ``eval``, ``scores``). Greedy:
for the embedded model, 64 tokens after each of the three prompts of ``default.json``, llama.cpp's
(argmax of its logits, as its greedy sampler) against lazyggml's (``Sampler(temp=0)``, one ``eval``
per token, fed llama.cpp's tokens); the prompts' token ids must be llama.cpp's.

llama.cpp runs in three configurations, and lazyggml in the same one each time:

* as shipped: ``Llama`` as a user runs it, with flash attention. On x86 with AVX2 its GGML also (a)
  repacks Q4_0, Q4_K and IQ4_NL weights (``ggml-cpu/repack.cpp``, gemv/gemm kernels of their own),
  (b) runs prompt batches of K-quants and IQ4_XS through its tiled matmul (``ggml-cpu/tiled``) and (c)
  float and the other 32-block types' batches through llamafile's tinyBLAS; lazyggml's defaults follow
  all three (``backends/cpu/repack.py``, ``tiled.py``, ``matmul.LLAMAFILE``);
* reference kernels (the default model only): llama.cpp loaded with ``use_extra_bufts = False`` (no
  CPU_REPACK buffer) and ``GGML_CPU_TILED_MM=0``, lazyggml with ``repack=False`` and ``tiled.TILED``
  off: GGML's ``vec_dot`` for every weight matmul, but IQ4_NL's prompt batches, which tinyBLAS adds in
  its own order (no run-time switch) and lazyggml in vec_dot's;
* unfused: as shipped, without flash attention (``flash_attn=False`` on both sides, llama-cpp-python's
  default).

What is asserted
----------------
On an x86 host with AVX2 and FMA and without AVX-512, llama.cpp's build of GGML runs the AVX2 code
that lazyggml follows, and the logits are llama.cpp's bit for bit: every mix of every model in every
configuration, and 64 greedy tokens per prompt without a single near tie (measured with
llama-cpp-python 0.3.36: NMSE 0 in 154 of the 155 comparisons, the mixtures of experts too, whose
3-D expert matrices llama.cpp repacks and whose experts with 8 routed rows or more it tiles). The
exception, compared within tolerances: IQ4_NL with the reference kernels (tinyBLAS, above: 5.7e-15).

A build for AVX-512 (llama.cpp compiled for such a host) adds 16 lanes at a time where GGML's AVX2
code adds 8 (exponentials, F16 dot products), so there the logits differ in the last bits; such a
difference stays invisible unless it moves a value across a rounding boundary, of the F16 KV cache
or of the 8-bit rounding (Q8_0/Q8_1/Q8_K) that every quantized matmul applies to its input, where
each later rounding amplifies it (NMSE_out ~ 0.05 * sqrt(NMSE_in) per rounding, measured node by
node). Two layers of random weights then end at 1e-6 to 2.3e-4 in some seeds (measured over 11
seeds before lazyggml followed llama.cpp's repacked and tiled orders: ``TINY_TOLERANCE``), the trained
model within 5e-6 (``DEFAULT_TOLERANCE``); a near tie may go either way (``TIE_MARGIN``).

llama.cpp runs in child processes (``llama_cpp_oracle.py``; the test extra installs llama-cpp-python):
``GGML_CPU_TILED_MM`` is read once per process, so the two configurations need two processes, and a
child keeps llama.cpp's libggml apart from ggml-python's (loaded by other test modules). A
module-scoped fixture makes every quantized file once and runs every llama.cpp evaluation in one
pass per configuration.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import lazyggml as lg
from lazyggml.backends.cpu import simd, tiled
from lazyggml.sampling import Sampler
from lazyggml.testing import make_tiny_model
from lazyggml.types import blck_size
from llama_cpp_oracle import nmse as _nmse, run_llama_cpp

DEFAULT_GGUF = Path(lg.__file__).resolve().parent / "data" / "default.gguf"
DEFAULT_JSON = DEFAULT_GGUF.with_suffix(".json")

#: mix -> the type it is named after (llama_cpp.LLAMA_FTYPE_MOSTLY_<MIX>)
MIXES = {
    "q4_0": lg.Q4_0, "q4_1": lg.Q4_1, "q5_0": lg.Q5_0, "q5_1": lg.Q5_1, "q8_0": lg.Q8_0,
    "q2_k": lg.Q2_K, "q3_k_m": lg.Q3_K, "q4_k_m": lg.Q4_K, "q5_k_m": lg.Q5_K, "q6_k": lg.Q6_K,
    "iq4_nl": lg.IQ4_NL, "iq4_xs": lg.IQ4_XS,
}
#: the random models (make_tiny_model arguments; written in F32, llama.cpp quantizes them)
TINY = {
    "tiny576": dict(n_layer=2, n_embd=576, n_head=9, n_head_kv=3, n_ff=512, n_vocab=512, n_ctx=128),
    "tiny256": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx=128),
}
#: the other families' random models, with the features their real checkpoints use (Qwen2.5's small
#: models tie the output to the embeddings; Qwen3's heads are wider than n_embd / n_head). The weight
#: types are the LLaMA models' business: these check each family's graph on its F32 weights, where
#: nothing rounds activations to 8 bits (the sharp check), and in llama.cpp's Q4_K_M.
FAMILIES = {
    "qwen2": dict(arch="qwen2", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx=128,
                  tie_output=True),
    "qwen3": dict(arch="qwen3", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx=128,
                  head_dim=128),
    # Gemma 3: tied output, wide heads, a window of 6 under the 16-token prompt, layer 0 sliding and
    # layer 1 global (a pattern of 2), linear RoPE scaling on the global layer
    "gemma3": dict(arch="gemma3", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx=128,
                   head_dim=128, tie_output=True, n_swa=6, swa_pattern=2, rope_scaling_factor=8.0),
    # Phi-3: fused QKV and gate/up, LongRoPE with an original context of 64 (the long factors at 128)
    "phi3": dict(arch="phi3", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx=128,
                 rope_factors_ctx=64),
    # mixtures of experts: Mixtral-style llama (8 experts of n_ff, 2 used) and Qwen3-MoE (experts of
    # their own width, per-head norms)
    "mixtral": dict(arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx=128,
                    n_expert=8, n_expert_used=2),
    "qwen3moe": dict(arch="qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512,
                     n_ctx=128, head_dim=64, n_expert=8, n_expert_used=2, n_ff_exp=256),
}
FAMILY_MIXES = ("f32", "q4_k_m")
MODELS = list(TINY) + ["default"] + list(FAMILIES)
SEED = 20240611
THREADS = 2
N_CTX = 128             # the context of the logits runs (the tiny models' training context)
N_PROMPT = 16
LOGITS_TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void"
N_GREEDY = 64
N_CTX_GREEDY = 256      # the embedded model's training context: decode steps see 256-cell KV windows in both

#: whether llama.cpp's GGML runs the AVX2 code lazyggml follows (module docstring): then its bits
BITS = simd.HAVE_AVX2 and "fma" in simd._FEATURES and not simd.HAVE_AVX512
# NMSE against llama.cpp where its bits are not expected (module docstring: why). The embedded model:
# the figure. The random models: the largest NMSE per mix over 11 seeds x 2 models, measured
# before lazyggml followed the repacked and tiled orders, was 2.3e-4 (Q2_K; Q4_0 1.0e-4, Q5_1 4.2e-6):
# one cascade of rounding-boundary crossings, whose size does not depend on the weight type, so one
# tolerance for every mix, 2x the largest figure. For scale: the same weights quantized into a
# neighbouring type give 8e-4 (Q8_0 against Q6_K, tiny576) to 0.2 (Q4_0 against Q4_1).
DEFAULT_TOLERANCE = 1e-5
TINY_TOLERANCE = 5e-4
#: the families' F32 files: no 8-bit rounding of activations to amplify a last-bit difference (F32
#: products: llamafile's sgemm adds in another order), only the F16 KV cache's, so a graph's error
#: shows at once (a missing bias or norm, the wrong RoPE: 1e-3 and more). Measured against an AVX-512
#: build, as shipped and unfused: qwen2 6.8e-9 / 1.3e-9, qwen3 6.0e-8 / 3.6e-9, phi3 6.5e-8 / 1.4e-9, gemma3 6.2e-8 / 1.8e-8
#: (Q4_K_M 3.7e-5 / 1.1e-5). Gemma's GEGLU reads GGML's fp16 GELU table as GGML's CPU does; with
#: the formula instead it was 1.3e-7 / 7.7e-8 (Q4_K_M 2.2e-4 / 2.0e-4). For scale, on this gemma3
#: file: every layer sliding 0.1, no window 0.23, no RoPE scaling on the global layer 0.02, another
#: RoPE base on the sliding layers 3e-5.
F32_TOLERANCE = 1e-6
#: A mixture of experts picks each token's experts by rank: where two experts' router
#: probabilities nearly tie, a last-bit cascade (above) can make llama.cpp pick the other one, and
#: that token's logits then differ by far more than the tolerance, the tokens after it not at all
#: (the KV cache is per layer input, and the flip stays in its token's FFN). Measured: qwen3moe in
#: Q4_K_M with flash attention, token 6 (layer 1's 2nd and 3rd experts 7.8e-5 apart): NMSE 2e-2
#: there, 7e-5 to 1.6e-4 at the 15 others; without flash attention 6e-12 over all. So these cases
#: are compared token by token, allowing this many tokens of the 16 above the tolerance.
MOE_FLIPS = 2
#: greedy: a near tie that a last-bit difference may decide either way (the largest logit
#: difference measured between lazyggml and llama.cpp on the embedded model is 0.035, as shipped;
#: its logits have an RMS of ~4)
TIE_MARGIN = 0.1


def prompt_tokens(model):
    """The 16 token ids whose logits are compared: text for the trained model, random ids else."""
    if model == "default":
        tok = lg.Tokenizer(lg.read_gguf(DEFAULT_GGUF).metadata, DEFAULT_GGUF)
        return tok.tokenize(LOGITS_TEXT, add_special=True)[:N_PROMPT]
    n_vocab = (TINY.get(model) or FAMILIES[model])["n_vocab"]
    return np.random.default_rng(SEED + 1).integers(3, n_vocab, N_PROMPT).tolist()


def greedy_prompts():
    return [s["prompt"] for s in json.loads(DEFAULT_JSON.read_text())["samples"]]


def configs(model):
    return {"default": ("shipped", "reference", "unfused")}.get(model, ("shipped", "unfused") if model in FAMILIES
                                                               else ("shipped",))


def mixes(model):
    return FAMILY_MIXES if model in FAMILIES else list(MIXES)


def bits_expected(model, mix, config):
    """Whether lazyggml's logits must be llama.cpp's bit for bit (module docstring: the exception)."""
    return BITS and not (mix == "iq4_nl" and config == "reference")


def build_oracle(d):
    """Write the tiny models into folder ``d``, quantize every model into its mixes there (a family's
    "f32" is its source file), and run
    llama.cpp: {"files": {(model, mix): path}, ("logits", config, model, mix): array,
    ("greedy", config, mix): [{"prompt_ids", "ids"} per prompt], "version": str}."""
    sources = {"default": (str(DEFAULT_GGUF), True)}
    for model, kw in {**TINY, **FAMILIES}.items():
        src = d / f"{model}-f32.gguf"
        make_tiny_model(src, types={"*": lg.F32}, seed=SEED, **kw)
        sources[model] = (str(src), False)
    files = {(model, mix): str(d / f"{model}-{mix}.gguf") for model in MODELS for mix in mixes(model)}
    quantize = [dict(src=sources[model][0], dst=path, mix=mix, requantize=sources[model][1])
                for (model, mix), path in files.items() if mix != "f32"]
    out = {"files": files}
    for config in ("shipped", "reference", "unfused"):       # the first child quantizes
        keys = [key for key in files if config in configs(key[0])]
        npy = {key: str(d / f"{config}-{key[0]}-{key[1]}.npy") for key in keys}
        greedy = config != "unfused"
        job = dict(reference=config == "reference", flash_attn=config != "unfused",
                   quantize=quantize if config == "shipped" else [],
                   logits=[dict(path=files[key], n_ctx=N_CTX, tokens=prompt_tokens(key[0]), out=npy[key])
                           for key in keys],
                   greedy=[dict(path=files["default", mix], n_ctx=N_CTX_GREEDY, prompts=greedy_prompts(),
                                n=N_GREEDY) for mix in MIXES if greedy])
        res = run_llama_cpp(job, d, config)
        for key in keys:
            out["logits", config, *key] = np.load(npy[key])
        for mix in MIXES if greedy else ():
            out["greedy", config, mix] = res["greedy"][files["default", mix]]
        out["version"] = res["version"]
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return build_oracle(tmp_path_factory.mktemp("llama_cpp"))


_OURS = {}


def load_as(path, config, **kw):
    """lazyggml's model of ``path`` in llama.cpp's ``config``: its defaults as shipped (repacked
    weights, tiled matmul) and without flash attention (unfused), GGML's vec_dot kernels for the
    reference configuration (``repack=False``; ``tiled.TILED`` off, which ``configured`` sets)."""
    return lg.load_model(path, n_threads=THREADS, repack=config != "reference", **kw)


@pytest.fixture
def configured(monkeypatch, config):
    monkeypatch.setattr(tiled, "TILED", config != "reference")


def lazyggml_logits(path, tokens, config):
    """lazyggml's logits of ``tokens`` from an empty cache (CPU backend) in ``config``, computed once
    per file and configuration."""
    if (path, config) not in _OURS:
        model = load_as(path, config, n_ctx=N_CTX, flash_attn=config != "unfused")
        _OURS[path, config] = model.eval(tokens)
    return _OURS[path, config]


@pytest.mark.parametrize("model,mix", [(model, mix) for model in MODELS for mix in mixes(model) if mix != "f32"])
def test_quantized_files_hold_the_intended_types(oracle, model, mix):
    """The mix's own type holds the most matrices (tiny256, default, the families); on tiny576, where
    the mix is a K-quant or IQ4_XS, a fallback type of 32-element blocks does (every row but
    ffn_down's has 576 elements) and a 256-block type is left in ffn_down (512-element rows). Norms
    and biases stay F32."""
    f = lg.read_gguf(oracle["files"][model, mix])
    counts = {}
    for name, info in f.tensors.items():
        if len(info.ne) == 1 or info.ne[1] == 1:
            assert info.type == lg.F32, name
        else:
            counts[info.type] = counts.get(info.type, 0) + 1
        assert info.ne[0] % blck_size(info.type) == 0, name
    main = max(counts, key=counts.get)
    want = MIXES[mix]
    if model == "tiny576" and blck_size(want) == 256:
        assert blck_size(main) == 32, counts
        for name, info in f.tensors.items():
            if name.endswith(("attn_q.weight", "attn_k.weight", "ffn_up.weight")):
                assert blck_size(info.type) == 32, (name, info.type)
        assert blck_size(f.tensors["blk.0.ffn_down.weight"].type) == 256, counts
    else:
        assert main == want, counts


LOGITS_CASES = [pytest.param(mix, model, config, id=f"{model}-{mix}-{config}")
                for model in MODELS for mix in mixes(model) for config in configs(model)]


@pytest.mark.parametrize("mix,model,config", LOGITS_CASES)
def test_logits_match_llama_cpp(oracle, mix, model, config, configured):
    """The logits' NMSE within the tolerance (module docstring). For a mixture of experts in Q4_K_M
    with flash attention, token by token: all but ``MOE_FLIPS`` tokens within it (see there)."""
    ours = lazyggml_logits(oracle["files"][model, mix], prompt_tokens(model), config)
    theirs = oracle["logits", config, model, mix]
    err = _nmse(ours, theirs)
    tol = DEFAULT_TOLERANCE if model == "default" else F32_TOLERANCE if mix == "f32" else TINY_TOLERANCE
    print(f"\n{model} {mix} {config}: NMSE {err:.3g} (max |d| {np.abs(ours - theirs).max():.3g})")
    if bits_expected(model, mix, config):
        assert np.array_equal(ours, theirs), (f"{model} {mix}: NMSE {err:.3g} against llama.cpp {oracle['version']} "
                                              f"({config}), expected its bits")
        return
    if FAMILIES.get(model, {}).get("n_expert") and mix != "f32" and config != "unfused":
        per_token = [_nmse(a, b) for a, b in zip(ours, theirs)]
        off = [(i, f"{e:.2g}") for i, e in enumerate(per_token) if e > tol]
        print(f"tokens above {tol:g}: {off}")
        assert len(off) <= MOE_FLIPS and np.median(per_token) <= tol, (
            f"{model} {mix}: tokens {off} above {tol:g} against llama.cpp {oracle['version']} ({config})")
        return
    assert err <= tol, (f"{model} {mix}: NMSE {err:.3g} against llama.cpp {oracle['version']} ({config}), "
                        f"tolerance {tol:g}")


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("config", ["shipped", "reference"])
def test_greedy_continuation_matches_llama_cpp(oracle, mix, config, configured):
    """The embedded model requantized into ``mix``: 64 greedy tokens after each of three prompts are
    llama.cpp's, in both configurations. lazyggml is fed llama.cpp's tokens, and its own greedy
    choice must be llama.cpp's at every position (where llama.cpp's bits are not expected, but a
    near tie: module docstring)."""
    model = load_as(oracle["files"]["default", mix], config, n_ctx=N_CTX_GREEDY)
    for i, prompt in enumerate(greedy_prompts()):
        ids = model.tokenize(prompt)
        theirs = oracle["greedy", config, mix][i]["ids"]
        assert ids == oracle["greedy", config, mix][i]["prompt_ids"], (config, prompt, ids)
        assert len(theirs) == N_GREEDY
        sampler = Sampler(temp=0)
        model.reset()
        logits = model.eval(ids, logits_all=False)[-1]
        for k, tok in enumerate(theirs):
            ours = sampler.sample(logits)
            if ours != tok:
                margin = float(logits[ours] - logits[tok])
                second = int(np.argsort(-logits, kind="stable")[1])
                print(f"\n{mix} {config} {prompt!r}: a near tie at token {k}: ours {ours}, llama.cpp's {tok}, "
                      f"{margin:.3g} below ours")
                assert not bits_expected("default", mix, config), (mix, config, prompt, k)
                assert tok == second and margin < TIE_MARGIN, (
                    f"{mix} {config}, prompt {prompt!r}: at token {k} our greedy choice is {ours}, llama.cpp's "
                    f"{tok} (its logit {margin:.3g} below ours; our runner-up {second})")
            if k + 1 < len(theirs):
                logits = model.eval([tok], logits_all=False)[-1]
