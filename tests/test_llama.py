"""The runner end to end: logits of random tiny models against a float64 NumPy forward pass of
the dequantized weights (NMSE within ``TOLERANCE``: see there why not 5e-4), on the CPU and with
every split of the layers over the OpenCL device and the CPU, and over two stand-in GPUs; the other
families' graphs (Qwen2's biases, Qwen3's per-head norms, NEOX RoPE, Gemma 3's sliding-window layers
and post-norms, Phi-3's fused matrices and LongRoPE, Mixtral's and Qwen3-MoE's experts) the same
way; the KV cache; bad input."""
import dataclasses
import math
import os

import numpy as np
import pytest

import lazyggml as lg
from lazyggml.testing import make_tiny_llama, make_tiny_model

SEED = np.random.SeedSequence().entropy % 2**32


def _nmse(a, b):
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def _weights(path):
    f = lg.read_gguf(path)
    hp = lg.HParams.from_metadata(f.metadata, path)
    infos = lg.check_tensors(hp, f.tensors, path)
    w = {}
    for name, info in infos.items():
        rows = lg.dequantize(info.type, f.mmap[info.offset:info.offset + info.nbytes], info.ne[0])
        w[name] = rows.astype(np.float64).reshape(tuple(reversed(info.ne)))
    return hp, w


def _rms(x, g, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def _rope(x, pos, n_rot, base, neox=False, freq_scale=1.0, factors=None, mscale=1.0):
    """GGML's normal mode: rotate adjacent pairs (x[2i], x[2i+1]) by pos * base^(-2i/n_rot); NEOX
    mode: the pairs (x[i], x[i + n_rot/2]). Linear scaling multiplies the angles by ``freq_scale``,
    frequency factors divide them; cos and sin are scaled by ``mscale`` (the attention factor)."""
    theta = freq_scale * pos[:, None] * base ** (-np.arange(0, n_rot, 2) / n_rot)   # (n_tokens, n_rot/2)
    if factors is not None:
        theta = theta / factors
    c, s = mscale * np.cos(theta)[:, None, :], mscale * np.sin(theta)[:, None, :]
    i0, i1 = (slice(0, n_rot // 2), slice(n_rot // 2, n_rot)) if neox else \
        (slice(0, n_rot, 2), slice(1, n_rot, 2))
    x0, x1 = x[..., i0].copy(), x[..., i1].copy()
    out = x.copy()
    out[..., i0] = x0 * c - x1 * s
    out[..., i1] = x0 * s + x1 * c
    return out


def reference_logits(hp, w, tokens, n_ctx=None, gaps=None):
    """A float64 forward pass of the LLaMA graph over ``tokens`` from position 0, keys and values
    rounded to F16 as the model's KV cache holds them; with the biases and per-head Q/K norms that
    ``w`` has, and NEOX RoPE for the other families. Gemma 3: embeddings times sqrt(n_embd), the
    queries' own scale, post-norms, GELU gate, sliding-window layers with their own RoPE base; Phi-3:
    fused QKV and gate/up, LongRoPE factors (the long ones when ``n_ctx`` exceeds the original
    context). A mixture of experts: each token's ``n_expert_used`` most probable experts (soft-max
    router), their gated FFNs weighted by their probabilities renormalized to sum to 1; ``gaps``,
    if given a list, gets each layer's smallest gap per token between the last chosen expert's
    probability and the next one's (a near tie that float32 rounding may decide the other way)."""
    def mm(x, name):
        return x @ w[name].T + w.get(name.replace(".weight", ".bias"), 0.0)

    def rope(x, il):
        swa = hp.is_swa(il)
        long = (n_ctx or hp.n_ctx_train) > hp.n_ctx_orig_yarn
        factors = w.get("rope_factors_long.weight" if long else "rope_factors_short.weight")
        return _rope(x, pos, hp.n_rot, hp.rope_freq_base_swa if swa else hp.rope_freq_base,
                     neox=hp.arch != "llama", freq_scale=1.0 if swa else hp.rope_freq_scale, factors=factors,
                     mscale=hp.rope_attn_factor)

    def head_norm(x, name):
        return _rms(x, w[name], hp.f_norm_rms_eps) if name in w else x

    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    hd, nh, nkv = hp.n_embd_head_k, hp.n_head, hp.n_head_kv
    gemma = hp.arch == "gemma3"
    x = w["token_embd.weight"][tokens] * (math.sqrt(hp.n_embd) if gemma else 1.0)
    dist = np.arange(n)[:, None] - np.arange(n)[None, :]
    mask = np.where(dist >= 0, 0.0, -np.inf)
    mask_swa = np.where((dist >= 0) & (dist < hp.n_swa), 0.0, -np.inf)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        h = _rms(x, w[b + "attn_norm.weight"], hp.f_norm_rms_eps)
        if b + "attn_qkv.weight" in w:                           # Phi-3: rows Q, K, V
            q, k, v = np.split(mm(h, b + "attn_qkv.weight"), [nh * hd, (nh + nkv) * hd], axis=1)
        else:
            q, k, v = (mm(h, b + f"attn_{t}.weight") for t in "qkv")
        q = rope(head_norm(q.reshape(n, nh, hd), b + "attn_q_norm.weight"), il)
        k = rope(head_norm(k.reshape(n, nkv, hd), b + "attn_k_norm.weight"), il)
        v = v.reshape(n, nkv, hd)
        k, v = (np.repeat(t.astype(np.float16).astype(np.float64), nh // nkv, axis=1)  # F16 KV cache
                for t in (k, v))
        scale = hp.f_attention_scale or 1 / math.sqrt(hd)
        att = np.einsum("thd,shd->hts", q, k) * scale + (mask_swa if hp.is_swa(il) else mask)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = mm(np.einsum("hts,shd->thd", att, v).reshape(n, nh * hd), b + "attn_output.weight")
        x = x + (_rms(o, w[b + "post_attention_norm.weight"], hp.f_norm_rms_eps) if gemma else o)
        h = _rms(x, w[b + "ffn_norm.weight"], hp.f_norm_rms_eps)
        if hp.n_expert:
            x = x + _moe_ffn(hp, w, b, h, gaps)
            continue
        if b + "ffn_gate.weight" in w:
            gate, up = mm(h, b + "ffn_gate.weight"), mm(h, b + "ffn_up.weight")
        else:                                                    # Phi-3: rows gate, then up
            gate, up = np.split(mm(h, b + "ffn_up.weight"), 2, axis=1)
        if gemma:   # GELU, tanh form
            act = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
        else:
            act = gate / (1 + np.exp(-gate))
        f = mm(act * up, b + "ffn_down.weight")
        x = x + (_rms(f, w[b + "post_ffw_norm.weight"], hp.f_norm_rms_eps) if gemma else f)
    return mm(_rms(x, w["output_norm.weight"], hp.f_norm_rms_eps), "output.weight")


def _moe_ffn(hp, w, b, h, gaps):
    """Layer ``b``'s mixture of experts on the normed rows ``h`` (see ``reference_logits``)."""
    logits = h @ w[b + "ffn_gate_inp.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")
    k = hp.n_expert_used
    if gaps is not None and k < hp.n_expert:
        ranked = np.take_along_axis(probs, order, -1)
        gaps.append(ranked[:, k - 1] - ranked[:, k])
    out = np.zeros_like(h)
    for t, chosen in enumerate(order[:, :k]):
        weights = probs[t, chosen] / probs[t, chosen].sum()
        for e, we in zip(chosen, weights):
            gate, up = (h[t] @ w[b + f"ffn_{m}_exps.weight"][e].T for m in ("gate", "up"))
            out[t] += we * ((gate / (1 + np.exp(-gate)) * up) @ w[b + "ffn_down_exps.weight"][e].T)
    return out


def _tokens_without_near_ties(hp, w, n, seed, min_gap=1e-3):
    """``n`` random tokens whose float64 routing (a mixture of experts) has no near tie: at every
    layer the last chosen expert's probability leads the next one's by ``min_gap``, so that
    lazyggml picks the reference's experts (a flip would change that token's FFN by far more than
    any tolerance). Flash attention rounds the queries to F16, which moves the router's
    probabilities by up to ~1e-4 here: a gap of 8.4e-5 flipped (mixtral, seed 1402920756).
    Other models: the first draw."""
    for s in range(seed, seed + 200):
        toks, gaps = _tokens(n, hp.n_vocab, s), []
        if not hp.n_expert:
            return toks
        reference_logits(hp, w, toks, gaps=gaps)
        if min(g.min() for g in gaps) > min_gap:
            return toks
    raise AssertionError(f"no tie-free tokens from seed {seed}")


# Tolerances of the logits against the float64 forward pass. GGML's CPU rounds the activations of
# every weight matmul to 8 bits (Q8_K per 256 values for the K-quants, Q8_0 per 32): each such
# rounding adds an NMSE of ~5e-5, and a layer has seven of them, so a random Q4_K_M model lands
# at 3e-4 to 1e-3 after three layers, Q8_0 at 2e-4 to 5e-4 (measured; GGML's own CPU backend does
# the same arithmetic, and feeding the reference GGML's rounded activations does not bring it much
# closer: float32 vs float64 differences move values across rounding boundaries). F16 weights
# round the activations to F16 only. llama.cpp itself (llama-cpp-python 0.3.36, 2 threads) on
# the same files and tokens, three seeds each, against this reference: Q4_K_M 8.3e-4 to 8.8e-4,
# Q8_0 3.5e-4 to 4.5e-4, F16 6.8e-7 to 9.3e-7 -- so issue 8's 5e-4 is beyond GGML's own
# arithmetic for Q4_K_M. lazyggml against llama.cpp on those runs: Q8_0 bit-identical, F16 2e-7 to
# 4e-7, Q4_K_M 1e-12 to 4e-4 (every weight matmul is bit-identical to libggml given the same
# input; the F16 attention products differ in the last bit, summed in another order, and a
# later 8-bit rounding can turn that into a one-step difference).
TOLERANCE = {"q4_k_m": 2e-3, "q8_0": 1e-3, "f16": 1e-5}


@pytest.fixture(scope="module", params=list(TOLERANCE))
def tiny(request, tmp_path_factory):
    """A random 3-layer model of each weight mix: Q4_K_M (Q4_K + Q6_K), Q8_0 and F16."""
    types = {"q4_k_m": None, "q8_0": {"*norm*": lg.F32, "*.weight": lg.Q8_0},
             "f16": {"*norm*": lg.F32, "*.weight": lg.F16}}[request.param]
    path = str(tmp_path_factory.mktemp("llama") / f"{request.param}.gguf")
    make_tiny_llama(path, n_layer=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=300,
                    n_ctx=128, types=types, seed=SEED)
    hp, w = _weights(path)
    return path, hp, w, TOLERANCE[request.param]


def _tokens(n, n_vocab, seed):
    return np.random.default_rng(seed).integers(0, n_vocab, n).tolist()


def test_logits_match_float64_reference_on_cpu(tiny):
    path, hp, w, tol = tiny
    toks = _tokens(20, hp.n_vocab, SEED)
    model = lg.load_model(path)
    got = model.eval(toks)
    assert got.shape == (20, hp.n_vocab)
    assert _nmse(got, reference_logits(hp, w, toks)) < tol, f"seed {SEED}"


def test_cpu_weights_are_used_in_place_from_the_mapped_file(tiny):
    """llama.cpp's ``use_mmap``: the CPU's weights are the file's bytes, in place (a private map, so
    the page cache holds them once); ``mmap=False`` copies them; both give the same logits."""
    path, hp, w, tol = tiny
    mapped, copied = lg.load_model(path), lg.load_model(path, mmap=False)
    for name, info in lg.read_gguf(path).tensors.items():
        t = mapped.w[name]
        assert isinstance(t.buffer.data.base, np.memmap) and t.buffer.data.base.filename == os.path.abspath(path)
        assert t.offset == info.offset
        assert not isinstance(copied.w[name].buffer.data.base, np.memmap)
    toks = _tokens(12, hp.n_vocab, SEED)
    np.testing.assert_array_equal(mapped.eval(toks), copied.eval(toks))


def test_bf16_norms_are_widened_at_load_and_a_quantized_norm_is_refused(tmp_path):
    """A file is judged at load: BF16 (or F16) norm weights, which the backends' MUL does not take,
    are loaded as F32, exactly (the logits are the float64 reference's); a Q8_0 norm, which nothing
    runs, is a GGUFError naming the tensor before anything is allocated."""
    path = make_tiny_llama(tmp_path / "bf16_norms.gguf", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                           n_vocab=300, types={"*norm*": lg.BF16, "*.weight": lg.Q8_0}, seed=SEED)
    hp, w = _weights(path)
    model = lg.load_model(path)
    norm = model.w["blk.1.ffn_norm.weight"]
    assert norm.type == lg.F32
    assert norm.buffer is not model.w["blk.1.ffn_up.weight"].buffer   # a copy; the Q8_0 matrix is the file's
    np.testing.assert_array_equal(lg.tensor_get(norm).ravel(), w["blk.1.ffn_norm.weight"])
    toks = _tokens(9, hp.n_vocab, SEED)
    assert _nmse(model.eval(toks), reference_logits(hp, w, toks)) < TOLERANCE["q8_0"]

    bad = make_tiny_llama(tmp_path / "q8_0_norm.gguf", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                          n_vocab=300, types={"blk.1.attn_norm.weight": lg.Q8_0}, seed=SEED)
    with pytest.raises(lg.GGUFError, match=r"tensor 'blk.1.attn_norm.weight': q8_0 weights: the CPU backend "
                                           r"cannot run MUL on them"):
        lg.load_model(bad)


def test_a_model_larger_than_free_memory_is_refused_before_anything_is_allocated(tmp_path, monkeypatch, capsys):
    """The placement's weights and KV cache are weighed against each device's free memory first: an
    OutOfMemoryError that gives the sizes and what to change, and nothing half-loaded; the CLI says
    it in one line."""
    from lazyggml.backends.cpu.backend import CPUDevice
    from lazyggml.cli import main
    path = make_tiny_llama(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300,
                           n_ctx=128, seed=SEED)
    monkeypatch.setattr(CPUDevice, "memory", lambda self: (64 * 1024, 1 << 30))
    allocated = []
    orig = lg.BufferType.alloc_buffer
    monkeypatch.setattr(lg.BufferType, "alloc_buffer", lambda buft, size: allocated.append(size) or orig(buft, size))
    with pytest.raises(lg.OutOfMemoryError, match=r"CPU has 64 KiB free, but its share of the model needs "
                                                  r"\d+ KiB \(\d+ KiB of weights, 32 KiB of KV cache for a "
                                                  r"context of 128\); put fewer layers there \(-ngl\) or use a "
                                                  r"smaller context \(-c\)"):
        lg.load_model(path)
    assert allocated == []
    capsys.readouterr()
    assert main(["generate", str(path), "-n", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lazyggml: error:" in err and "KiB free" in err


def test_flash_attention_gives_the_unfused_logits(tiny, monkeypatch):
    """flash_attn=True (FLASH_ATTN_EXT over a V cache stored like K) matches the float64 reference
    and the unfused path, through a prefill and decode steps; by default the CPU takes the fused
    path (llama.cpp's ``-fa auto``); a backend that cannot run the node is refused by name."""
    path, hp, w, tol = tiny
    toks = _tokens(14, hp.n_vocab, SEED + 3)
    fused = lg.load_model(path, flash_attn=True)
    assert fused.flash_attn and fused.kv.v[0].ne[:2] == (hp.n_embd_v_gqa, fused.n_ctx)
    got = np.concatenate([fused.eval(toks[:9])] + [fused.eval([t]) for t in toks[9:]])
    assert _nmse(got, reference_logits(hp, w, toks)) < tol, f"seed {SEED}"
    assert lg.load_model(path).flash_attn
    plain = lg.load_model(path, flash_attn=False)
    assert not plain.flash_attn
    assert _nmse(got, plain.eval(toks)) < tol, f"seed {SEED}"
    ocl = lg.dev_by_name("OpenCL0")
    if ocl is not None:      # an OpenCL device that cannot run the node: refused at load, by name
        monkeypatch.setattr(ocl, "supports_op", lambda t, f=ocl.supports_op: t.op != lg.Op.FLASH_ATTN_EXT and f(t))
        with pytest.raises(ValueError, match="flash attention: the OpenCL0 backend cannot run FLASH_ATTN_EXT"):
            lg.load_model(path, n_gpu_layers=99, device="OpenCL0", flash_attn=True)
        assert not lg.load_model(path, n_gpu_layers=99, device="OpenCL0").flash_attn


def _opencl_device():
    dev = lg.dev_by_name("OpenCL0")
    if dev is None:
        pytest.skip("no OpenCL device on this machine")
    return dev


@pytest.mark.parametrize("n_gpu_layers", [1, 2, 3, 4])
def test_logits_with_layers_on_opencl(tiny, n_gpu_layers):
    _opencl_device()
    path, hp, w, tol = tiny
    toks = _tokens(12, hp.n_vocab, SEED + n_gpu_layers)
    model = lg.load_model(path, n_gpu_layers=n_gpu_layers, device="OpenCL0")
    assert [b.name for b in model.backends] == ["OpenCL0", "CPU"]
    got = model.eval(toks)
    assert model.sched.n_splits >= 2
    assert _nmse(got, reference_logits(hp, w, toks)) < tol, f"seed {SEED}, ngl {n_gpu_layers}"


#: the other families' features as their real checkpoints use them
FAMILY_KW = {
    "qwen2": dict(tie_output=True),
    "qwen3": dict(head_dim=128),
    # tied output, wide heads, a window of 5 (the prompts run past it), layers 0 and 1 sliding and 2
    # global, linear RoPE scaling on the global layer (Gemma 3 4B and larger)
    "gemma3": dict(tie_output=True, head_dim=128, n_swa=5, swa_pattern=3, rope_scaling_factor=8.0),
    # LongRoPE with an original context of 64: the long factors at the models' n_ctx of 128
    "phi3": dict(rope_factors_ctx=64),
    # mixtures of experts, 8 experts of which each token uses 2: Mixtral-style LLaMA (experts of
    # n_ff) and Qwen3-MoE (experts of their own width, per-head norms)
    "mixtral": dict(arch="llama", n_expert=8, n_expert_used=2),
    "qwen3moe": dict(head_dim=64, n_expert=8, n_expert_used=2, n_ff_exp=256),
}


@pytest.fixture(scope="module", params=list(FAMILY_KW))
def family(request, tmp_path_factory):
    """A random 3-layer model of another family, F16 weights (norms and biases F32): Qwen2 with its
    output tied to the embeddings, Qwen3 with heads wider than n_embd / n_head, Gemma 3 with
    sliding-window and global layers, Phi-3 with LongRoPE, mixtures of experts (``FAMILY_KW``)."""
    return _family_model(tmp_path_factory.mktemp("family"), request.param)


def _family_model(folder, name):
    kw = dict(FAMILY_KW[name])
    path = str(folder / f"{name}.gguf")
    make_tiny_model(path, arch=kw.pop("arch", name), n_layer=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                    n_vocab=512, n_ctx=128, seed=SEED, **kw,
                    # the router F32, as llama.cpp's quantizer keeps it: an F16 matrix would round its
                    # input to F16 and move the router's probabilities by ~1e-4 (near ties: see
                    # _tokens_without_near_ties)
                    types={"*norm*": lg.F32, "*.bias": lg.F32, "*ffn_gate_inp*": lg.F32, "*.weight": lg.F16})
    hp, w = _weights(path)
    return path, hp, w, TOLERANCE["f16"]


@pytest.mark.parametrize("where", ["cpu", "cpu-unfused", "opencl-1", "opencl-all"])
def test_family_logits_match_float64_reference(family, where):
    """Each family's graph on the CPU (with and without flash attention) and with one or every layer
    on OpenCL, through a prefill and decode steps."""
    path, hp, w, tol = family
    kw = {"cpu": {}, "cpu-unfused": dict(flash_attn=False),
          "opencl-1": dict(n_gpu_layers=1, device="OpenCL0"), "opencl-all": dict(n_gpu_layers=99, device="OpenCL0")}[where]
    if "device" in kw:
        _opencl_device()
    model = lg.load_model(path, **kw)
    assert model.arch.name == hp.arch
    toks = _tokens_without_near_ties(hp, w, 14, SEED + 5)
    got = np.concatenate([model.eval(toks[:9])] + [model.eval([t]) for t in toks[9:]])
    ref = reference_logits(hp, w, toks)
    assert _nmse(got, ref) < tol, f"{hp.arch} {where}, seed {SEED}"
    if where == "opencl-all" and not hp.n_expert:
        # the embeddings' lookup on the CPU, then one split: no layer reads a weight across devices
        # (Phi-3's RoPE factors: a copy on each layer's device)
        assert model.sched.n_splits == 2
    if hp.n_swa:   # the window matters here: without it the logits are far off
        assert hp.swa_layers == (True, True, False)
        assert _nmse(reference_logits(dataclasses.replace(hp, swa_layers=()), w, toks), ref) > 1e-3


def test_every_tensor_an_architecture_declares_feeds_a_declared_op():
    """The loader places each weight by the op ``archs.TENSOR_OPS`` says it feeds: every tensor of
    every architecture (with experts where it has them) has one, and an unknown kind is an error."""
    from lazyggml.models.archs import ARCHITECTURES, TENSOR_OPS, tensor_op
    from lazyggml.models.loader import weight_node
    for arch in ARCHITECTURES.values():
        for n_expert in (0, 4):
            hp = lg.HParams(arch.name, n_vocab=32, n_ctx_train=64, n_embd=64, n_layer=2, n_ff=128, n_head=4, n_head_kv=2,
                            n_embd_head_k=16, n_embd_head_v=16, n_rot=16, f_norm_rms_eps=1e-6, rope_freq_base=1e4,
                            rope_scaling_type="none", rope_freq_scale=1.0, n_ctx_orig_yarn=64, n_expert=n_expert,
                            n_expert_used=2 if n_expert else 0, n_ff_exp=64 if n_expert else 0)
            required, optional = arch.tensors(hp)
            for name, ne in {**required, **optional}.items():
                assert weight_node(name, lg.F32, ne).op == tensor_op(name), (arch.name, name)
    assert set(TENSOR_OPS.values()) == {lg.Op.GET_ROWS, lg.Op.MUL, lg.Op.ADD, lg.Op.ROPE, lg.Op.MUL_MAT, lg.Op.MUL_MAT_ID}
    with pytest.raises(KeyError, match="blk.0.ffn_mystery.weight"):
        tensor_op("blk.0.ffn_mystery.weight")


def test_gemma3_with_every_layer_sliding(tmp_path):
    """Fewer layers than Gemma 3's period of 6: every layer slides, so the graph has only the
    sliding-window mask; a prefill and decode steps past the window give the float64 reference's
    logits, with flash attention and without."""
    path = make_tiny_model(tmp_path / "g.gguf", arch="gemma3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2,
                           n_ff=128, n_vocab=300, head_dim=32, n_swa=4, seed=SEED,
                           types={"*norm*": lg.F32, "*.weight": lg.F16})
    hp, w = _weights(path)
    assert hp.swa_layers == (True, True)
    toks = _tokens(12, hp.n_vocab, SEED + 8)
    ref = reference_logits(hp, w, toks)
    for flash_attn in (True, False):
        model = lg.load_model(path, flash_attn=flash_attn)
        got = np.concatenate([model.eval(toks[:7])] + [model.eval([t]) for t in toks[7:]])
        assert _nmse(got, ref) < TOLERANCE["f16"], f"flash_attn={flash_attn}, seed {SEED}"


def test_phi3_rope_factors_follow_the_context(tmp_path):
    """Phi-3's LongRoPE: within the original context (n_ctx 64) the short factors, beyond it the
    long ones (the ``family`` test), as llama.cpp's get_rope_factors; the two differ."""
    path, hp, w, tol = _family_model(tmp_path, "phi3")
    toks = _tokens(12, hp.n_vocab, SEED + 6)
    got = lg.load_model(path, n_ctx=64).eval(toks)
    short = reference_logits(hp, w, toks, n_ctx=64)
    assert _nmse(got, short) < tol, f"seed {SEED}"
    assert _nmse(reference_logits(hp, w, toks), short) > 1e-3


def test_kv_cache_continues_a_sequence(tiny):
    """Prefill then token-by-token decode gives the logits of one long prefill, within the model
    type's tolerance. Not bit for bit: decode steps attend over a window padded to KV_PAD (256)
    cells and a prefill batch over one padded to KV_PAD_BATCH (32), so soft_max sums rows of other
    lengths in another order. F16 measured 0 for most seeds and up to 5e-8 for some. With 8-bit
    activations a last-bit difference can cross a rounding step: Q4_K_M reached 1e-5. A wrong
    cache cell would give errors of order 1."""
    path, hp, _, tol = tiny
    toks = _tokens(10, hp.n_vocab, SEED + 7)
    model = lg.load_model(path)
    full = model.eval(toks)
    model.reset()
    parts = [model.eval(toks[:6])] + [model.eval([t]) for t in toks[6:]]
    assert _nmse(np.concatenate(parts), full) < tol, f"seed {SEED}"
    assert model.n_past == len(toks)
    model.reset()
    last = model.eval(toks, logits_all=False)
    assert last.shape == (1, hp.n_vocab)
    assert _nmse(last, full[-1:]) < 1e-10


def test_decode_graphs_are_kept_per_kv_window(tmp_path, monkeypatch):
    """A decode step reuses the graph of its KV window (256 cells each) after a prompt, a reset and
    other windows in between: nothing is rebuilt. At most DECODE_GRAPHS are kept; a fifth window
    takes the least recently used one's scheduler. The logits are a fresh model's."""
    from lazyggml.models import graphs
    path = str(tmp_path / "m.gguf")
    make_tiny_llama(path, n_layer=1, n_embd=256, n_head=4, n_head_kv=4, n_ff=512, n_vocab=300,
                    n_ctx=1280, seed=SEED)
    toks = _tokens(1100, 300, SEED)
    model = lg.load_model(path)
    built = []
    real = model.graphs.build
    monkeypatch.setattr(model.graphs, "build", lambda sched, *key: built.append(key) or real(sched, *key))

    def decode_at(depth):
        model.reset()
        if depth:
            model.eval(toks[:depth], logits_all=False)
        return model.eval([toks[depth]])

    first = decode_at(0)
    for depth in (300, 600, 900):
        decode_at(depth)
    steps = [k for k in built if k[0] == 1 and k[1] != 1280]  # (new schedulers reserve with (1, n_ctx, 1))
    assert steps == [(1, 256, 1), (1, 512, 1), (1, 768, 1), (1, 1024, 1)]
    built.clear()
    again = decode_at(0)
    assert not [k for k in built if k[0] == 1]               # window 256's graph, kept
    assert np.array_equal(again, first)
    decode_at(1050)                                          # a fifth window: 512's scheduler goes
    assert len(model.graphs.decode) == graphs.DECODE_GRAPHS and (1, 512, 1) not in model.graphs.decode
    fresh = lg.load_model(path)
    for depth in (600, 1050):
        fresh.reset()
        fresh.eval(toks[:depth], logits_all=False)
        assert np.array_equal(decode_at(depth), fresh.eval([toks[depth]]))


def test_prompt_graphs_are_kept_per_shape(tmp_path, monkeypatch):
    """A prompt's micro-batches (64 tokens, KV windows of 32 cells) come back in the same shapes
    after a reset: their graphs are kept (PROMPT_GRAPHS at most, least recently used given up) and
    nothing is rebuilt; the logits are the first run's."""
    from lazyggml.models import graphs
    path = str(tmp_path / "m.gguf")
    make_tiny_llama(path, n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, n_ctx=512,
                    seed=SEED)
    toks = _tokens(400, 300, SEED)
    model = lg.load_model(path, n_batch=64)
    built = []
    real = model.graphs.build
    monkeypatch.setattr(model.graphs, "build", lambda sched, *key: built.append(key) or real(sched, *key))
    first = model.eval(toks[:200], logits_all=False)            # micro-batches of 64, 64, 64, 8
    # (new schedulers reserve with (64, n_ctx, 1)); keys: (tokens, KV window, rows of logits)
    assert [k for k in built if k[0] > 1 and k[1] != 512] == [(64, 64, 1), (64, 128, 1), (64, 192, 1), (8, 224, 1)]
    built.clear()
    model.reset()
    assert np.array_equal(model.eval(toks[:200], logits_all=False), first)
    assert not built
    model.reset()
    model.eval(toks[:320], logits_all=False)                    # (64, 256), (64, 320): two new shapes
    assert len(model.graphs.prompt) == graphs.PROMPT_GRAPHS and (64, 64, 1) not in model.graphs.prompt


def test_prefill_longer_than_a_micro_batch(tmp_path):
    path = str(tmp_path / "m.gguf")
    make_tiny_llama(path, n_layer=1, n_embd=256, n_head=4, n_head_kv=4, n_ff=512, n_vocab=300,
                    n_ctx=256, seed=SEED)
    hp, w = _weights(path)
    toks = _tokens(150, hp.n_vocab, SEED)
    got = lg.load_model(path).eval(toks)
    assert _nmse(got, reference_logits(hp, w, toks)) < TOLERANCE["q4_k_m"]


def test_generate_streams_text_and_stats(tiny):
    path, hp, _, _ = tiny
    model = lg.load_model(path)
    stats = {}
    pieces = list(model.generate("hello world", 8, temp=0.0, seed=1, stats=stats))
    assert all(isinstance(p, str) for p in pieces)
    assert stats["n_prompt"] >= 2 and 0 <= stats["n_decoded"] <= 8
    model.reset()
    again = list(model.generate("hello world", 8, temp=0.0, seed=1))
    assert pieces == again  # greedy is deterministic


def test_bad_input_is_a_clear_error(tiny):
    path, hp, _, _ = tiny
    model = lg.load_model(path, n_ctx=16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.eval([hp.n_vocab])
    with pytest.raises(ValueError, match="no tokens"):
        model.eval([])
    with pytest.raises(ValueError, match="exceed the context"):
        model.eval([1] * 17)
    with pytest.raises(ValueError, match="no device named"):
        lg.load_model(path, n_gpu_layers=1, device="NoSuchDevice")
    with pytest.raises(lg.GGUFError):
        lg.load_model(__file__)


# -- several devices: llama.cpp's layer split and pipeline parallelism ------------------------------
def test_split_layers_follows_llama_cpp():
    from lazyggml.models.runner import split_layers
    from lazyggml.testing import StandInDevice
    d = [StandInDevice("DEV0"), StandInDevice("DEV1")]
    # 12 layers + the output over two equal devices: positions il/13 below 0.5 go to the first
    assert split_layers(12, 99, d) == [0] * 7 + [1] * 6
    assert split_layers(12, 99, d, tensor_split=[3, 1]) == [0] * 10 + [1] * 3
    assert split_layers(12, 99, d, tensor_split=[0, 1]) == [1] * 13
    # the last 4 repeating layers only; the output stays on the CPU
    assert split_layers(12, 4, d) == [None] * 8 + [0, 0, 1, 1, None]
    assert split_layers(12, 0, d) == [None] * 13
    assert split_layers(12, 99, []) == [None] * 13
    # by free memory when no ratios are given
    m = [StandInDevice("DEV0", free_memory=1 << 30), StandInDevice("DEV1", free_memory=3 << 30)]
    assert split_layers(3, 4, m) == [0, 1, 1, 1]
    for bad in ([1], [1, -1], [0, 0]):
        with pytest.raises(ValueError, match="tensor_split"):
            split_layers(12, 99, d, tensor_split=bad)


@pytest.fixture(scope="module")
def two_layer_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama2") / "m.gguf")
    make_tiny_llama(path, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=300,
                    n_ctx=256, seed=SEED)
    return path


@pytest.mark.parametrize("deferred", [False, True])
def test_logits_split_over_two_devices(two_layer_model, deferred):
    """Layers and output on two stand-in GPUs (asynchronous ones: with events, so the scheduler
    runs pipeline-parallel with 4 copy slots) give the CPU's logits, for a prompt of several
    micro-batches whose early batches are queued without waiting, and then token by token."""
    from lazyggml.testing import StandInDevice
    toks = _tokens(64 * 2 + 20, 300, SEED + 11)
    # the stand-ins run the CPU's kernels on their own plain buffers: the CPU's reference keeps its
    # weights in plain buffers too (no CPU_REPACK, whose products add in another order)
    cpu = lg.load_model(two_layer_model, repack=False)
    ref = [cpu.eval(toks, logits_all=False)] + [cpu.eval([t]) for t in toks[:3]]
    devs = [StandInDevice("DEV0", deferred), StandInDevice("DEV1", deferred)]
    assert lg.load_model(two_layer_model, n_gpu_layers=3, device=devs).n_batch == 256   # N_BATCH_GPU, capped
    # three micro-batches, with the CPU's kernels (stand-ins run them) and the same fused attention
    model = lg.load_model(two_layer_model, n_gpu_layers=3, device=devs, n_batch=64)
    assert [b.name for b in model.backends] == ["DEV0", "DEV1", "CPU"]
    assert [b.name for b in model.layer_backends] == ["DEV0", "DEV0", "DEV1"]   # 0, 1/3 | 2/3
    assert model.sched.n_copies == (4 if deferred else 1)
    got = [model.eval(toks, logits_all=False)] + [model.eval([t]) for t in toks[:3]]
    assert model.sched.n_splits == 3   # CPU (embeddings) -> DEV0 -> DEV1
    for g, r in zip(got, ref):
        assert _nmse(g, r) < 1e-6


@pytest.mark.parametrize("deferred", [False, True])
def test_offloaded_experts_copy_only_those_the_batch_uses(tmp_path, monkeypatch, deferred):
    """GGML's scheduler shortcut for a mixture of experts: a device that takes MUL_MAT_ID from host
    memory (CUDA's ``offload_op``, 32 tokens or more) gets only the experts the micro-batch's ids
    pick, runs of consecutive experts in one copy each (GGML's padding after each); unused experts'
    bytes in the copy are stale (another batch's) and never read: two batches that pick different
    experts give the CPU's logits."""
    from lazyggml import sched
    from lazyggml.testing import StandInDevice

    class Offloading(StandInDevice):
        def offload_op(self, t):
            return t.op == lg.Op.MUL_MAT_ID and t.ne[2] >= 32

    path = make_tiny_model(tmp_path / "moe.gguf", arch="qwen3moe", n_layer=2, n_embd=64, n_head=4, n_head_kv=2,
                           head_dim=16, n_ff=128, n_ff_exp=32, n_expert=64, n_expert_used=2, n_vocab=300, n_ctx=128,
                           seed=SEED)
    toks = _tokens(64, 300, SEED + 12)
    cpu = lg.load_model(path, repack=False)   # as the stand-in's plain buffers (see above)
    ref = np.concatenate([cpu.eval(toks[:32]), cpu.eval(toks[32:])])
    copies = []
    monkeypatch.setattr(sched, "tensor_set_async", lambda b, t, data, off, n, f=sched.tensor_set_async:
                        copies.append((t.name, off, n)) or f(b, t, data, off, n))
    model = lg.load_model(path, n_gpu_layers=1, device=[Offloading("DEV0", deferred)])
    assert [b.name for b in model.layer_backends] == ["CPU", "DEV0", "CPU"]
    got = np.concatenate([model.eval(toks[:32]), model.eval(toks[32:])])
    assert _nmse(got, ref) < 1e-6, f"seed {SEED}"
    # layer 0's three expert tensors, in each of the two batches: some experts, never all
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        w = model.w[f"blk.0.{name}.weight"]
        sizes = [n for t, off, n in copies if t.endswith(f"blk.0.{name}.weight#0")]
        # whole experts, and GGML's padding (min(expert, 512) bytes) unless a run ends at the last one
        assert all(n % w.nb[2] in (0, min(w.nb[2], 512)) for n in sizes) and len(sizes) >= 2
        assert 0 < sum(sizes) < 2 * w.nbytes()
