"""The CPU matmul in the orders of llama.cpp's GGML: its tiled matmul (``tiled.py``) and its repacked
weights (``repack.py``), bit for bit against an oracle written here from GGML's formulas.

The oracle's integer parts come from the reference dequantizer (checked against GGML in
test_quant.py) on copies of the weights whose block scales are patched: with d = 1 and dmin = 0 a
dequantized value is ``scale_s·q`` exactly, so Σ value·q8 over a block (or a 64-value part) is s1;
with d = 0 and dmin = 1 it is ``−min_s``, which gives s2. Its float steps are float64 products and
sums rounded once to float32: an FMA's result (float64 holds a float32 product exactly).
"""
from __future__ import annotations

import numpy as np
import pytest

import lazyggml as lg
from lazyggml.backends.cpu import matmul as M
from lazyggml.backends.cpu import simd, tiled
from lazyggml.backends.cpu.traits import TYPE_TRAITS_CPU
from lazyggml.types import Type, row_size, type_size

pytestmark = pytest.mark.skipif(not (simd.HAVE_AVX2 and "fma" in simd._FEATURES),
                                reason="GGML's orders are those of its AVX2 + FMA kernels")

QK_K = 256
#: per type: byte offsets of d and dmin (None: no mins) in a block
SCALES = {Type.Q2_K: (80, 82), Type.Q3_K: (108, None), Type.Q4_K: (0, 2), Type.Q5_K: (0, 2),
          Type.Q6_K: (208, None), Type.IQ4_XS: (0, None)}
F16_ONE, F16_ZERO = np.float16(1.0).view(np.uint16), np.float16(0.0).view(np.uint16)


def fma(a, b, c):
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def f16_at(row, o):
    return np.float32(row[o:o + 2].view(np.float16)[0])


def parts(t, wrow, q8, k, width):
    """Per ``width`` values of a weight row: (s1, s2) exact, from patched copies (module docstring)."""
    do, mo = SCALES[t]
    bs = type_size(t)
    deq = TYPE_TRAITS_CPU[t].to_float
    out = []
    for d, m in ((F16_ONE, F16_ZERO), (F16_ZERO, F16_ONE)):
        if mo is None and d == F16_ZERO:
            out.append(np.zeros(k // width, np.int64))
            continue
        w = wrow.copy()
        for b in range(k // QK_K):
            w[b * bs + do:b * bs + do + 2] = np.array([d], np.uint16).view(np.uint8)
            if mo is not None:
                w[b * bs + mo:b * bs + mo + 2] = np.array([m], np.uint16).view(np.uint8)
        v = np.empty(k, np.float32)
        deq(w, v)
        prod = (v.astype(np.int64) * q8).reshape(-1, width).sum(axis=1)
        out.append(prod if d == F16_ONE else -prod)
    return out


def q8_K(x):
    """A column quantized to Q8_K as the matmul does: per block (d, int8 quants)."""
    k = x.size
    y = np.empty(row_size(Type.Q8_K, k), np.uint8)
    TYPE_TRAITS_CPU[Type.Q8_K].from_float(x, y)
    blocks = y.reshape(-1, type_size(Type.Q8_K))
    return blocks[:, :4].copy().view(np.float32)[:, 0], blocks[:, 4:4 + QK_K].view(np.int8).astype(np.int64).reshape(-1)


def oracle(t, wq, X, order, ngemm=0):
    """dst (n, m) in GGML's ``order``: "tiled", or "repack" (the first ``ngemm`` columns the gemm's)."""
    m, n, k = wq.shape[0], X.shape[0], X.shape[1]
    do, mo = SCALES[t]
    bs = type_size(t)
    out = np.empty((n, m), np.float32)
    for c in range(n):
        d8, q8 = q8_K(X[c])
        for r in range(m):
            width = 64 if order == "repack" and c < ngemm else QK_K
            s1, s2 = parts(t, wq[r], q8, k, width)
            per = QK_K // width
            buf = a = mm = np.float32(0)
            for b in range(k // QK_K):
                d = f16_at(wq[r], b * bs + do)
                dmin = f16_at(wq[r], b * bs + mo) if mo is not None else np.float32(0)
                if order == "tiled":
                    res = np.float32(d * np.float32(s1[b]))
                    if mo is not None:
                        res = fma(-dmin, np.float32(s2[b]), res)
                    buf = fma(res, d8[b], buf)
                else:
                    for u in range(per):
                        a = fma(np.float32(s1[b * per + u]), np.float32(d * d8[b]), a)
                        mm = fma(np.float32(s2[b * per + u]), np.float32(dmin * d8[b]), mm)
            out[c, r] = buf if order == "tiled" else np.float32(a - mm)
    return out


def weights(t, rng, m, k):
    W = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.5, 2, (m, 1)).astype(np.float32)
    wq = np.empty((m, row_size(t, k)), np.uint8)
    for r in range(m):
        TYPE_TRAITS_CPU[t].from_float_ref(W[r], wq[r])
    return wq


@pytest.mark.parametrize("t", sorted(SCALES, key=int), ids=lambda t: t.name)
def test_tiled_order(t, monkeypatch):
    """8 columns or more: GGML's tiled matmul's order, bit for bit; fewer, or TILED off: vec_dot's."""
    monkeypatch.setattr(tiled, "TILED", True)
    rng = np.random.default_rng(40 + int(t))
    k, m = 512, 12
    wq = weights(t, rng, m, k)
    for n in (8, 19):
        X = rng.standard_normal((n, k)).astype(np.float32)
        got = M.mul_mat(wq.reshape(1, 1, m, -1), t, X.reshape(1, 1, n, k), np.empty((1, 1, n, m), np.float32))
        want = oracle(t, wq, X, "tiled")
        assert np.array_equal(got[0, 0], want), (t.name, n, float(np.abs(got[0, 0] - want).max()))
        monkeypatch.setattr(tiled, "TILED", False)
        plain = M.mul_mat(wq.reshape(1, 1, m, -1), t, X.reshape(1, 1, n, k), np.empty((1, 1, n, m), np.float32))
        monkeypatch.setattr(tiled, "TILED", True)
        assert not np.array_equal(plain, got)   # the orders differ somewhere (the test can fail)
    X = rng.standard_normal((7, k)).astype(np.float32)
    a = M.mul_mat(wq.reshape(1, 1, m, -1), t, X.reshape(1, 1, 7, k), np.empty((1, 1, 7, m), np.float32))
    monkeypatch.setattr(tiled, "TILED", False)
    b = M.mul_mat(wq.reshape(1, 1, m, -1), t, X.reshape(1, 1, 7, k), np.empty((1, 1, 7, m), np.float32))
    assert np.array_equal(a, b)


def oracle_b32(t, wq, X):
    """dst (n, m) for repacked Q4_0 / IQ4_NL weights: per 32-value block the exact Σ q·q8 (from the
    dequantizer with d = 1), one chain A = fma(s, d·d8, A), gemm and gemv alike."""
    m, n, k = wq.shape[0], X.shape[0], X.shape[1]
    out = np.empty((n, m), np.float32)
    for c in range(n):
        y = np.empty(row_size(Type.Q8_0, k), np.uint8)
        TYPE_TRAITS_CPU[Type.Q8_0].from_float(X[c], y)
        yb = y.reshape(-1, 34)
        d8 = yb[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
        q8 = yb[:, 2:].view(np.int8).astype(np.int64)
        for r in range(m):
            wb = wq[r].reshape(-1, 18)
            d = wb[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
            ones = wb.copy()
            ones[:, :2] = np.array([F16_ONE], np.uint16).view(np.uint8)
            v = np.empty(k, np.float32)
            TYPE_TRAITS_CPU[t].to_float(ones.reshape(-1), v)
            s = (v.astype(np.int64).reshape(-1, 32) * q8).sum(axis=1)
            a = np.float32(0)
            for b in range(k // 32):
                a = fma(np.float32(s[b]), np.float32(d[b] * d8[b]), a)
            out[c, r] = a
    return out


@pytest.mark.parametrize("t", [Type.Q4_0, Type.Q4_K, Type.IQ4_NL], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 12, 13, 19])
def test_repacked_order(t, n, monkeypatch):
    """A repacked weight (Q4_K: its first n - n % 4 columns in GGML's gemm's order when n > 3, the
    rest in its gemv's; Q4_0 and IQ4_NL: one order for both), a single column (decode) too, bit
    for bit, tiled matmul on or off."""
    rng = np.random.default_rng(90 + n + int(t))
    k, m = 768, 16
    wq = weights(t, rng, m, k)
    X = rng.standard_normal((n, k)).astype(np.float32)
    want = oracle(t, wq, X, "repack", n - n % 4 if n > 3 else 0) if t == Type.Q4_K else oracle_b32(t, wq, X)
    for on in (True, False):
        monkeypatch.setattr(tiled, "TILED", on)
        got = M.mul_mat(wq.reshape(1, 1, m, -1), t, X.reshape(1, 1, n, k), np.empty((1, 1, n, m), np.float32),
                        repacked=True)
        assert np.array_equal(got[0, 0], want), (n, on, float(np.abs(got[0, 0] - want).max()))


def test_repack_buffer_type_takes_ggml_weights():
    """CPU_REPACK runs a MUL_MAT of a 2-D Q4_0/Q4_K/IQ4_NL weight with rows in multiples of 8 and F32
    activations, as GGML's (x86 AVX2) extra buffer type does; nothing else."""
    buft, = lg.dev_by_name("CPU").get_extra_buffer_types()
    ctx = lg.Context()
    x = ctx.new_tensor_1d(Type.F32, 256)
    assert buft.get_name() == "CPU_REPACK" and buft.is_host()
    assert buft.supports_op(lg.mul_mat(ctx.new_tensor_2d(Type.Q4_K, 256, 16), x))
    assert not buft.supports_op(lg.mul_mat(ctx.new_tensor_2d(Type.Q4_K, 256, 12), x))   # rows % 8
    assert buft.supports_op(lg.mul_mat(ctx.new_tensor_2d(Type.Q4_0, 256, 16), x))
    assert not buft.supports_op(lg.mul_mat(ctx.new_tensor_2d(Type.Q6_K, 256, 16), x))   # no kernel
    assert not buft.supports_op(lg.mul_mat(ctx.new_tensor_3d(Type.Q4_K, 256, 16, 2),
                                          ctx.new_tensor_3d(Type.F32, 256, 1, 2)))  # 3-D
    assert not buft.supports_op(lg.get_rows(ctx.new_tensor_2d(Type.Q4_K, 256, 16),
                                                ctx.new_tensor_1d(Type.I32, 1)))


@pytest.mark.parametrize("t, repacked", [(Type.Q6_K, False), (Type.Q4_K, False), (Type.Q4_K, True)],
                         ids=["Q6_K-tiled", "Q4_K-tiled", "Q4_K-repacked"])
def test_mul_mat_id_orders(t, repacked, monkeypatch):
    """MUL_MAT_ID as llama.cpp's GGML: an expert with 8 routed (token, slot) pairs or more in the tiled
    matmul's order, fewer in vec_dot's (``ggml_compute_forward_mul_mat_id_tiled``); repacked experts
    (CPU_REPACK) routed row by routed row through the gemv. Each pair's row equals the plain product
    of its expert in that order: mul_mat of the expert with the pair's column alone (gemv, vec_dot)
    or among 8 columns (tiled, whose order is per column)."""
    from lazyggml.backends.cpu import matmul_id
    from lazyggml.backends.cpu.params import ComputeParams
    monkeypatch.setattr(tiled, "TILED", True)
    rng = np.random.default_rng(7 + int(t) + repacked)
    n_expert, m, k, n_tok, n_used = 4, 16, 512, 12, 2
    wq = np.stack([weights(t, rng, m, k) for _ in range(n_expert)])[None]
    x = rng.standard_normal((1, n_tok, 1, k)).astype(np.float32)
    ids = np.zeros((1, 1, n_tok, n_used), np.int32)
    ids[0, 0, :, 0] = 0                                # expert 0: 12 pairs (tiled when not repacked)
    ids[0, 0, :, 1] = 1 + np.arange(n_tok) % 3         # experts 1..3: 4 pairs each (vec_dot)
    dst = np.empty((1, n_tok, n_used, m), np.float32)
    for step, args in matmul_id.mul_mat_id_steps(wq, t, x, ids, dst, ComputeParams(2), repacked):
        step(*args)
    for tok in range(n_tok):
        for e in range(n_used):
            ex = int(ids[0, 0, tok, e])
            cols = x[0, tok:tok + 1, 0] if (repacked or ex != 0) else np.roll(x[0, :, 0], -tok, axis=0)[:8]
            want = M.mul_mat(wq[:, ex:ex + 1], t, cols.reshape(1, 1, -1, k), np.empty((1, 1, len(cols), m), np.float32),
                             repacked=repacked)
            assert np.array_equal(dst[0, tok, e], want[0, 0, 0]), (t.name, repacked, tok, e, ex)
