"""The CPU quantized matmul (backends/cpu/matmul.py, type_*.py, simd.py, traits.py, and dispatch.py,
generated from the traits table by scripts/generate_cpu_dispatch.py).

Three oracles:
* float64 NumPy of the dequantized weights: NMSE <= 5e-4 (test-backend-ops' MUL_MAT threshold) on
  uniform [-1, 1] data;
* GGML's own CPU mul_mat through ggml-python, same weights, same thread count: relative error
  ||ours - ggml|| / ||ggml|| <= 1e-4, and bit-identical where GGML's kernels are the AVX2 ones
  that ours follow (every weight type, float ones included);
* each fast ``vec_dot`` against its plain ``_ref`` on random blocks, and the portable (non-AVX2)
  SIMD path in a subprocess with ``LAZYGGML_SIMD=portable NUMBA_ENABLE_AVX=0``.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import njit

from lazyggml.backends.cpu import dispatch as D
from lazyggml.backends.cpu import matmul as M
from lazyggml.backends.cpu import simd, tiled, type_common, type_float, type_k
from lazyggml.backends.cpu.common import KIND
from lazyggml.backends.cpu.params import ALWAYS_PARALLEL, NEVER_PARALLEL, ComputeParams
from lazyggml.backends.cpu.traits import TYPE_TRAITS_CPU, get_type_traits_cpu, types_with
from lazyggml.types import Type, row_size, type_size, blck_size

import ggml  # noqa: E402  (ggml-python, the GGML oracle: the test extra installs it)

N_THREADS = 2
QUANT_TYPES = list(types_with("dot_cols"))   # every quantized weight type of the traits table
FLOAT_TYPES = [Type.F32, Type.F16, Type.BF16]
ALL_TYPES = FLOAT_TYPES + QUANT_TYPES
# ggml-python's GGML is built for this CPU. With AVX2 and FMA its dot products are the AVX2 code our
# kernels follow lane for lane: the same bits for every quantized type; for the float types too,
# unless it was built for AVX-512, whose float sums run 16 lanes wide (type_float.py).
GGML_BITS = simd.HAVE_AVX2 and "fma" in simd._FEATURES
GGML_FLOAT_BITS = GGML_BITS and not simd.HAVE_AVX512


@pytest.fixture(autouse=True)
def ggml_alone(monkeypatch):
    """ggml-python's GGML is built without llamafile's sgemm and has no tiled matmul: every product in
    vec_dot's order (matmul.LLAMAFILE and tiled.TILED off; llama.cpp's orders have their own tests,
    below and in test_mul_mat_orders.py)."""
    monkeypatch.setattr(M, "LLAMAFILE", False)
    monkeypatch.setattr(tiled, "TILED", False)


# ----------------------------------------------------------------------------------------------
# GGML through ggml-python
# ----------------------------------------------------------------------------------------------

def ggml_quantize(t, a):
    """(rows, k) float32 -> (rows, row bytes) uint8 with ggml_quantize_chunk (no imatrix)."""
    a = np.ascontiguousarray(a, np.float32)
    nrow, k = a.shape
    out = np.empty(nrow * row_size(t, k), np.uint8)
    ggml.ggml_quantize_chunk(int(t), a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                             out.ctypes.data, 0, nrow, k, None)
    return out.reshape(nrow, -1)


def ggml_mul_mat(w_bytes, t, x, n_threads=N_THREADS):
    """GGML's CPU mul_mat of weights (ne03, ne02, ne01, row bytes) with x (ne13, ne12, ne11, ne10)."""
    ne03, ne02, ne01, _ = w_bytes.shape
    ne13, ne12, ne11, ne10 = x.shape
    x = np.ascontiguousarray(x, np.float32)
    w_bytes = np.ascontiguousarray(w_bytes)
    dst_n = ne13 * ne12 * ne11 * ne01
    mem = (w_bytes.nbytes + 3 * x.nbytes + 4 * dst_n + 16 * ggml.ggml_tensor_overhead()
           + 2 * ggml.ggml_graph_overhead() + (16 << 20))
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=False))
    try:
        w = ggml.ggml_new_tensor_4d(ctx, int(t), ne10, ne01, ne02, ne03)
        assert ggml.ggml_nbytes(w) == w_bytes.nbytes
        ctypes.memmove(ggml.ggml_get_data(w), w_bytes.ctypes.data, w_bytes.nbytes)
        xt = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, ne10, ne11, ne12, ne13)
        ctypes.memmove(ggml.ggml_get_data(xt), x.ctypes.data, x.nbytes)
        out = ggml.ggml_mul_mat(ctx, w, xt)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, out)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, n_threads)
        p = ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(p, (dst_n,)).reshape(ne13, ne12, ne11, ne01).copy()
    finally:
        ggml.ggml_free(ctx)


# ----------------------------------------------------------------------------------------------
# weights of each type: (array for mul_mat, raw bytes for GGML, float64 dequantized values)
# ----------------------------------------------------------------------------------------------

def make_weights(t, wf):
    """wf: float32 (ne03, ne02, ne01, k)."""
    shp, k = wf.shape[:3], wf.shape[3]
    if t == Type.F32:
        return wf, wf.view(np.uint8), wf.astype(np.float64)
    if t == Type.F16:
        h = wf.astype(np.float16)
        return h, h.view(np.uint8), h.astype(np.float64)
    if t == Type.BF16:
        bits = np.empty(wf.size * 2, np.uint8)
        type_float.quantize_row_bf16(wf.reshape(-1), bits)
        u16 = bits.view(np.uint16).reshape(wf.shape)
        deq = (u16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return u16, bits.reshape(*shp, -1), deq
    qb = ggml_quantize(t, wf.reshape(-1, k)).reshape(*shp, -1)
    deq = np.empty(wf.size, np.float32)
    D.dequantize_chunk(int(t), qb.reshape(-1), deq)
    return qb, qb, deq.reshape(wf.shape).astype(np.float64)


def reference(deq, x):
    """float64 GGML mul_mat semantics with broadcasting."""
    ne03, ne02 = deq.shape[:2]
    ne13, ne12 = x.shape[:2]
    r2, r3 = ne12 // ne02, ne13 // ne03
    out = np.empty(x.shape[:3] + (deq.shape[2],), np.float64)
    for i3 in range(ne13):
        for i2 in range(ne12):
            out[i3, i2] = x[i3, i2].astype(np.float64) @ deq[i3 // r3, i2 // r2].T
    return out


def columns(rng, ne13, ne12, n, k, noncontig):
    """Activations (ne13, ne12, n, k), uniform in [-1, 1]; ``noncontig``: a permuted view with
    padded rows, x[i3, i2, i1, :] being base[i3, i1, i2, :k]."""
    if not noncontig:
        return rng.uniform(-1, 1, (ne13, ne12, n, k)).astype(np.float32)
    base = rng.uniform(-1, 1, (ne13, n, ne12, k + 8)).astype(np.float32)
    x = base.transpose(0, 2, 1, 3)[..., :k]
    assert not x.flags.c_contiguous
    return x


def nmse(a, b):
    return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# (k, m, n, (ne03, ne02), (ne13, ne12), non-contiguous x)
CASES = [
    (256, 16, 1, (1, 1), (1, 1), False),
    (768, 40, 2, (1, 2), (1, 4), True),
    (1280, 24, 3, (1, 1), (2, 1), False),
    (256, 33, 8, (2, 1), (2, 3), True),
    (768, 17, 17, (1, 1), (1, 1), True),
    (256, 64, 128, (1, 1), (1, 1), False),
]


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_mul_mat_vs_numpy_and_ggml(t):
    rng = np.random.default_rng(int(t) + 1)
    for k, m, n, (ne03, ne02), (ne13, ne12), noncontig in CASES:
        wf = rng.uniform(-1, 1, (ne03, ne02, m, k)).astype(np.float32)
        w, wbytes, deq = make_weights(t, wf)
        x = columns(rng, ne13, ne12, n, k, noncontig)
        dst = np.full((ne13, ne12, n, m), np.nan, np.float32)
        M.mul_mat(w, t, x, dst)
        ref = reference(deq, x)
        assert nmse(dst, ref) <= 5e-4, (t.name, k, m, n)
        g = ggml_mul_mat(wbytes, t, x)
        err = rel(dst, g)
        assert err <= 1e-4, (t.name, k, m, n, err)
        if GGML_FLOAT_BITS if t in FLOAT_TYPES else GGML_BITS:
            # same activation conversion, same integer lanes, same FMA order as GGML's AVX2 code
            assert np.array_equal(dst, g), (t.name, k, m, n, err)


# (k, m, n, non-contiguous x): the 96 x 2048 weights at 1, 8 and 64 columns (GGML's
# chunking and our tiles differ with n), and k past a multiple of 32 (GGML's scalar leftovers)
FLOAT_CASES = [
    (2048, 96, 1, False), (2048, 96, 8, False), (2048, 96, 64, False), (2048, 96, 8, True),
    (2000, 96, 1, False), (2000, 96, 64, True), (100, 33, 5, False), (35, 17, 3, True), (7, 9, 2, False),
]


@pytest.mark.skipif(not GGML_FLOAT_BITS, reason="GGML's float dot products here are not its AVX2 ones")
@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_mul_mat_is_ggml_bits(t):
    """F32, F16 and BF16 weights give GGML's CPU mul_mat bit for bit (its ggml_vec_dot_f32 / _f16 /
    _bf16 per row and column: type_float.py), for one column (two rows at a time) and
    for tiles of columns, with and without the leftovers past the last 32 values."""
    rng = np.random.default_rng(500 + int(t))
    for k, m, n, noncontig in FLOAT_CASES:
        w, wbytes, _ = make_weights(t, rng.uniform(-1, 1, (1, 1, m, k)).astype(np.float32))
        x = columns(rng, 1, 1, n, k, noncontig)
        dst = M.mul_mat(w, t, x, np.empty((1, 1, n, m), np.float32))
        g = ggml_mul_mat(wbytes, t, x)
        assert np.array_equal(dst, g), (t.name, k, m, n, float(np.abs(dst - g).max()))


@njit(cache=False)
def _sgemm_ref(w, x, out):
    """tinyBLAS's order (llamafile's sgemm on AVX2), plainly: per (row, column) eight float32 FMA
    chains, lane l taking the values l, l + 8, ..., then r = lanes 0..3 + lanes 4..7 and
    (r0 + r2) + (r1 + r3). w, x: float32 rows (weights and activations already in float32)."""
    for c in range(x.shape[0]):
        for r in range(w.shape[0]):
            acc = np.zeros(8, np.float32)
            for i in range(w.shape[1]):
                acc[i % 8] = simd.fma(w[r, i], x[c, i], acc[i % 8])
            h = np.empty(4, np.float32)
            for j in range(4):
                h[j] = acc[j] + acc[j + 4]
            out[c, r] = (h[0] + h[2]) + (h[1] + h[3])


@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_products_in_llamafile_order(t, monkeypatch):
    """With matmul.LLAMAFILE (llama.cpp's build of GGML), a float product of 2 columns or more, k a
    multiple of 8 and m of 4 (F32: contiguous activations), adds each dot product as tinyBLAS does
    (``_sgemm_ref``), bit for bit, on activations rounded to the weight type; one column, or
    another shape, stays in vec_dot's order (GGML then calls vec_dot)."""
    monkeypatch.setattr(M, "LLAMAFILE", True)
    rng = np.random.default_rng(700 + int(t))
    for k, m, n, noncontig in [(2048, 96, 8, False), (2048, 96, 64, False), (64, 12, 2, False), (256, 20, 5, True)]:
        w, _, deq = make_weights(t, rng.uniform(-1, 1, (1, 1, m, k)).astype(np.float32))
        x = columns(rng, 1, 1, n, k, noncontig)
        got = M.mul_mat(w, t, x, np.empty((1, 1, n, m), np.float32))
        if t == Type.F32 and noncontig:
            monkeypatch.setattr(M, "LLAMAFILE", False)
            assert np.array_equal(got, M.mul_mat(w, t, x, np.empty((1, 1, n, m), np.float32)))
            monkeypatch.setattr(M, "LLAMAFILE", True)
            continue
        xr = np.ascontiguousarray(x[0, 0])
        if t != Type.F32:   # rounded to the weight type as GGML's vec_dot_type (matmul.round_acts)
            M.round_acts(KIND[t], x, x4 := np.empty(x.shape, np.float32))
            xr = x4[0, 0]
        want = np.empty((n, m), np.float32)
        _sgemm_ref(np.ascontiguousarray(deq[0, 0], np.float32), xr, want)
        assert np.array_equal(got[0, 0], want), (t.name, k, m, n, float(np.abs(got[0, 0] - want).max()))
    # one column, k not a multiple of 8, m not of 4: vec_dot's order, as with LLAMAFILE off
    for k, m, n in [(2048, 96, 1), (100, 12, 4), (64, 10, 4)]:
        w, _, _ = make_weights(t, rng.uniform(-1, 1, (1, 1, m, k)).astype(np.float32))
        x = columns(rng, 1, 1, n, k, False)
        got = M.mul_mat(w, t, x, np.empty((1, 1, n, m), np.float32))
        monkeypatch.setattr(M, "LLAMAFILE", False)
        assert np.array_equal(got, M.mul_mat(w, t, x, np.empty((1, 1, n, m), np.float32))), (t.name, k, m, n)
        monkeypatch.setattr(M, "LLAMAFILE", True)


def ggml_get_rows(w_bytes, t, k, m):
    """Rows 0..m-1 of a (m, k) tensor of type t, as GGML's CPU backend's GET_ROWS gives them."""
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=w_bytes.nbytes + 8 * k * m + (16 << 20), mem_buffer=None,
                                               no_alloc=False))
    try:
        w = ggml.ggml_new_tensor_2d(ctx, int(t), k, m)
        ctypes.memmove(ggml.ggml_get_data(w), w_bytes.ctypes.data, w_bytes.nbytes)
        idx = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_I32, m)
        ia = np.arange(m, dtype=np.int32)
        ctypes.memmove(ggml.ggml_get_data(idx), ia.ctypes.data, ia.nbytes)
        out = ggml.ggml_get_rows(ctx, w, idx)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, out)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, 1)
        p = ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(p, (m * k,)).reshape(m, k).copy()
    finally:
        ggml.ggml_free(ctx)


@pytest.mark.parametrize("t", QUANT_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_ggml_get_rows(t):
    """Every weight type's rows dequantize to GGML's CPU backend's bits (its GET_ROWS: the token
    embeddings of a model), not only to gguf's NumPy dequantizer's."""
    x = np.random.default_rng(int(t)).uniform(-1, 1, (16, 512)).astype(np.float32)
    wb = ggml_quantize(t, x)
    ours = np.empty_like(x)
    for r in range(x.shape[0]):
        get_type_traits_cpu(t).to_float(wb[r], ours[r])
    assert np.array_equal(ours, ggml_get_rows(wb, t, 512, 16))


@pytest.mark.parametrize("t", [Type.Q4_K, Type.F16], ids=lambda t: t.name)
def test_mul_mat_serial_and_parallel_agree(t):
    """Small products run on one thread, large ones on all (each path with its own threshold): the
    two drivers give the same bits."""
    rng = np.random.default_rng(7)
    wf = rng.uniform(-1, 1, (1, 1, 64, 512)).astype(np.float32)
    w = make_weights(Type.Q4_K, wf)[0] if t == Type.Q4_K else wf.astype(np.float16)
    x = rng.uniform(-1, 1, (1, 1, 20, 512)).astype(np.float32)
    a = np.empty((1, 1, 20, 64), np.float32)
    b = np.empty_like(a)
    M.mul_mat(w, t, x, a, params=ComputeParams(2, NEVER_PARALLEL))
    M.mul_mat(w, t, x, b, params=ComputeParams(2, ALWAYS_PARALLEL))
    assert np.array_equal(a, b)


def test_mul_mat_rejects_bad_shapes():
    w = np.zeros((1, 1, 4, 144), np.uint8)
    with pytest.raises(ValueError):
        M.mul_mat(w, Type.Q4_K, np.zeros((1, 1, 2, 512), np.float32), np.zeros((1, 1, 2, 4), np.float32))
    with pytest.raises(ValueError):
        M.mul_mat(w, Type.Q4_K, np.zeros((1, 1, 2, 256), np.float32), np.zeros((1, 1, 4, 2), np.float32))
    with pytest.raises(ValueError):
        M.mul_mat(np.zeros((1, 2, 4, 144), np.uint8), Type.Q4_K, np.zeros((1, 3, 2, 256), np.float32),
                  np.zeros((1, 3, 2, 4), np.float32))


# ----------------------------------------------------------------------------------------------
# vec_dot kernels on random blocks
# ----------------------------------------------------------------------------------------------

# byte offsets of the fp16 scales in each block: random bytes there could be inf/NaN
SCALE_OFFSETS = {Type.Q4_K: (0, 2), Type.Q5_K: (0, 2), Type.Q6_K: (208,), Type.Q8_0: (0,),
                 Type.Q4_0: (0,), Type.Q4_1: (0, 2), Type.Q5_0: (0,), Type.Q5_1: (0, 2),
                 Type.Q2_K: (80, 82), Type.Q3_K: (108,), Type.IQ4_NL: (0,), Type.IQ4_XS: (0,)}


def random_blocks(rng, t, n):
    nb = n // blck_size(t)
    b = rng.integers(0, 256, (nb, type_size(t)), dtype=np.uint8)
    for o in SCALE_OFFSETS[t]:
        b[:, o:o + 2] = rng.uniform(-0.05, 0.05, nb).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


def activation_row(rng, t, n):
    vdt = get_type_traits_cpu(t).vec_dot_type
    x = rng.uniform(-1, 1, n).astype(np.float32)
    y = np.empty(row_size(vdt, n), np.uint8)
    get_type_traits_cpu(vdt).from_float(x, y)
    return vdt, y


def oracle(t, vdt, n, x, y):
    """float64 dot product of the dequantized rows."""
    a = np.empty(n, np.float32)
    b = np.empty(n, np.float32)
    get_type_traits_cpu(t).to_float(x, a)
    get_type_traits_cpu(vdt).to_float(y, b)
    return float(np.dot(a.astype(np.float64), b.astype(np.float64))), float(np.dot(np.abs(a), np.abs(b)))


@pytest.mark.parametrize("t", QUANT_TYPES, ids=lambda t: t.name)
def test_vec_dot_fast_vs_ref(t):
    rng = np.random.default_rng(100 + int(t))
    tr = get_type_traits_cpu(t)
    for n in (256, 1024, 4096):
        for _ in range(5):
            x = random_blocks(rng, t, n)
            vdt, y = activation_row(rng, t, n)
            exact, scale = oracle(t, vdt, n, x, y)
            fast, ref = tr.vec_dot(n, x, y), tr.vec_dot_ref(n, x, y)
            # the integer parts are exact; only float32 rounding of the per-block sums differs,
            # plus, with Q8_1, the fp16 rounding of its stored s = d*Σq (used for the min term)
            tol = (2e-6 if vdt != Type.Q8_1 else 1e-3) * scale + 1e-6
            assert abs(ref - exact) <= tol, (t.name, n, ref, exact)
            assert abs(fast - exact) <= tol, (t.name, n, fast, exact)


@pytest.mark.parametrize("t", [Type.Q4_K, Type.Q5_K, Type.Q6_K, Type.Q8_0, Type.Q4_0, Type.Q4_1, Type.Q5_0,
                               Type.Q5_1, Type.Q2_K, Type.Q3_K, Type.IQ4_NL, Type.IQ4_XS, Type.F16],
                         ids=lambda t: t.name)
def test_columns_together_equal_columns_alone(t):
    """dot_cols_* (many columns per weight row) does, per column, exactly the arithmetic of the
    single-column dot_*: a 13-column product (8 columns summed together by ``_col_sums`` and 5
    alone) equals 13 one-column products, bit for bit."""
    rng = np.random.default_rng(200 + int(t))
    wf = rng.uniform(-1, 1, (1, 1, 12, 1280)).astype(np.float32)
    w, _, _ = make_weights(t, wf)
    x = rng.uniform(-1, 1, (1, 1, 13, 1280)).astype(np.float32)
    together = np.empty((1, 1, 13, 12), np.float32)
    M.mul_mat(w, t, x, together)
    for c in range(13):
        alone = np.empty((1, 1, 1, 12), np.float32)
        M.mul_mat(w, t, x[:, :, c:c + 1], alone)
        assert np.array_equal(alone[0, 0, 0], together[0, 0, c]), c


@pytest.mark.parametrize("n", [256, 768, 2048])
def test_q4_K_tile_min_table(n):
    """Q4_K's tiles share their columns' min table across rows (type_k._k4_min_table): a tile of
    1 to 24 columns (0 to 3 groups of 8, and 0 to 7 alone; from the second column on) over 4 of 5
    random rows, its scratch NaN at first, gives each (row, column) the bits of the one-column dot_q4_K_q8_K, and
    dot_cols_q4_K_q8_K gives them for one row."""
    rng = np.random.default_rng(n)
    w4 = np.stack([random_blocks(rng, Type.Q4_K, n) for _ in range(5)]).reshape(1, 1, 5, -1)
    ys = np.concatenate([activation_row(rng, Type.Q4_K, n)[1] for _ in range(25)])
    rs = ys.size // 25
    want = np.array([[type_k.dot_q4_K_q8_K(n, w4[0, 0, r], ys, c * rs) for r in range(5)] for c in range(25)],
                    np.float32)
    for nc in (1, 7, 8, 9, 16, 21, 24):
        acc = np.full(type_common.acc_floats(n, nc), np.nan, np.float32)
        out, dst = np.empty(nc, np.float32), np.full((1, 1, nc + 2, 5), np.nan, np.float32)
        type_k.tile_q4_K_q8_K(n, w4, 0, 0, 1, 5, ys, rs, rs, type_size(Type.Q8_K), nc, acc, out, dst, 0, 0, 2)
        assert np.array_equal(dst[0, 0, 2:, 1:].view(np.uint32), want[1:1 + nc, 1:].view(np.uint32)), nc
        assert np.isnan(dst[0, 0, :2]).all() and np.isnan(dst[0, 0, :, 0]).all(), nc   # nothing else written
        type_k.dot_cols_q4_K_q8_K(n, w4[0, 0, 0], ys, 0, rs, type_size(Type.Q8_K), nc, acc, out)
        assert np.array_equal(out.view(np.uint32), want[:nc, 0].view(np.uint32)), nc


@pytest.mark.parametrize("t", types_with("dot_cols2"), ids=lambda t: t.name)
def test_two_rows_equal_rows_alone(t):
    """dot2_* / dot_cols2_* (two weight rows at once, 512-bit vectors) do per row exactly the
    arithmetic of dot_* / dot_cols_*: bit for bit, on random blocks, for 1 to 16 columns; and
    through the matmul with an odd number of rows (the last one alone) and one or more columns."""
    rng = np.random.default_rng(400 + int(t))
    tr = get_type_traits_cpu(t)
    assert tr.dot_cols2 is not None
    for n in (256, 768, 2048):
        x, x2 = random_blocks(rng, t, n), random_blocks(rng, t, n)
        ys = np.concatenate([activation_row(rng, t, n)[1] for _ in range(16)])
        rs = ys.size // 16
        if tr.dot2 is not None:
            pair = tr.dot2(n, x, x2, ys, 0)
            assert (pair[0], pair[1]) == (tr.dot(n, x, ys, 0), tr.dot(n, x2, ys, 0)), n
        for nc in (1, 5, 16):
            acc = np.empty(type_common.acc_floats(n, nc), np.float32)
            one, two = np.empty(nc, np.float32), np.empty(2 * nc, np.float32)
            tr.dot_cols2(n, x, x2, ys, 0, rs, type_size(Type.Q8_K), nc, acc, two)
            for row, got in ((x, two[0::2]), (x2, two[1::2])):
                tr.dot_cols(n, row, ys, 0, rs, type_size(Type.Q8_K), nc, acc, one)
                assert np.array_equal(got.view(np.uint32), one.view(np.uint32)), (n, nc)
    wf = rng.uniform(-1, 1, (1, 1, 13, 1024)).astype(np.float32)
    w, _, _ = make_weights(t, wf)
    for ncol in (1, 7, 40):
        xs = rng.uniform(-1, 1, (1, 1, ncol, 1024)).astype(np.float32)
        together = M.mul_mat(w, t, xs, np.empty((1, 1, ncol, 13), np.float32))
        for r in range(13):
            alone = M.mul_mat(w[:, :, r:r + 1], t, xs, np.empty((1, 1, ncol, 1), np.float32))
            assert np.array_equal(alone[..., 0], together[..., r]), (ncol, r)


@pytest.mark.parametrize("t", [Type.F32, Type.F16, Type.BF16], ids=lambda t: t.name)
def test_vec_dot_float(t):
    rng = np.random.default_rng(300 + int(t))
    tr = get_type_traits_cpu(t)
    for n in (1, 7, 64, 100, 1000):
        xf = rng.uniform(-1, 1, n).astype(np.float32)
        yf = rng.uniform(-1, 1, n).astype(np.float32)
        x = np.empty(row_size(t, n), np.uint8)
        y = np.empty(row_size(t, n), np.uint8)
        tr.from_float(xf, x)
        tr.from_float(yf, y)
        exact, scale = oracle(t, t, n, x, y)
        assert abs(tr.vec_dot(n, x, y) - exact) <= 1e-6 * scale + 1e-7
        assert abs(tr.vec_dot_ref(n, x, y) - exact) <= 1e-6 * scale + 1e-7


def test_traits_table():
    for t in ALL_TYPES:
        tr = TYPE_TRAITS_CPU[t]
        assert tr.type == t and tr.vec_dot is not None and tr.to_float is not None and tr.fast
        assert (tr.blck_size, tr.type_size) == (blck_size(t), type_size(t))
    assert TYPE_TRAITS_CPU[Type.Q4_K].vec_dot_type == Type.Q8_K
    assert TYPE_TRAITS_CPU[Type.Q8_0].vec_dot_type == Type.Q8_0
    assert TYPE_TRAITS_CPU[Type.F16].vec_dot_type == Type.F16
    assert not TYPE_TRAITS_CPU[Type.Q8_K].fast and TYPE_TRAITS_CPU[Type.F32].from_float_ref is None
    # the matmul's weight types are the table's, and so are this file's: a type added to the table
    # needs its tests here
    assert M.QUANT_TYPES == types_with("dot_cols") and set(M.SUPPORTED_TYPES) == set(ALL_TYPES)
    assert set(QUANT_TYPES) == set(types_with("dot_cols"))


# ----------------------------------------------------------------------------------------------
# dispatch.py: the type switches, generated from the traits table
# ----------------------------------------------------------------------------------------------

def _generator():
    """scripts/generate_cpu_dispatch.py as a module."""
    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "generate_cpu_dispatch.py"
    spec = importlib.util.spec_from_file_location("generate_cpu_dispatch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dispatch_is_what_the_generator_writes():
    """dispatch.py is committed generated code: regenerating it from the table gives the same file."""
    assert _generator().render() == pathlib.Path(D.__file__).read_text(), \
        "lazyggml/backends/cpu/dispatch.py is stale: run .venv/bin/python scripts/generate_cpu_dispatch.py"


def _kernel_name(fn):
    return f"{fn.py_func.__module__.rpartition('.')[2]}.{fn.__name__}"


def test_dispatch_has_every_type_of_the_table():
    """Each generated switch has a branch for every type of the traits table that has its kernel,
    calling that kernel, and no other branch; the chunk and activation switches also give the bytes
    of the table's own kernels (a type added to the table without regenerating fails here)."""
    want = {name: {} for name in ("quantize_chunk", "dequantize_chunk", "from_float", "dot_rows", "dot_tile")}
    for t, tr in TYPE_TRAITS_CPU.items():
        if tr.from_float_ref is not None:
            want["quantize_chunk"][int(t)] = _kernel_name(tr.from_float_ref)
            want["dequantize_chunk"][int(t)] = _kernel_name(tr.to_float)
        if tr.dot_cols is not None:
            want["dot_rows"][int(t)] = _kernel_name(tr.dot) + (f"+{_kernel_name(tr.dot2)}" if tr.dot2 else "")
            want["dot_tile"][int(t)] = (_kernel_name(tr.tile or tr.dot_cols)
                                        + (f"+{_kernel_name(tr.dot_cols2)}" if tr.dot_cols2 else ""))
            vdt = tr.vec_dot_type
            want["from_float"][int(vdt)] = _kernel_name(TYPE_TRAITS_CPU[vdt].from_float)
    for name, cases in want.items():
        have = D.SWITCHES.get(name, {})
        wrong = sorted(Type(i).name for i in cases.keys() | have.keys() if cases.get(i) != have.get(i))
        assert not wrong, f"dispatch.{name}: the branches of {wrong} do not match the traits table: " \
                          "run .venv/bin/python scripts/generate_cpu_dispatch.py"

    rng = np.random.default_rng(11)
    x = rng.uniform(-1, 1, 512).astype(np.float32)
    for t in types_with("from_float_ref"):
        tr = TYPE_TRAITS_CPU[t]
        ref, got = np.zeros(row_size(t, 512), np.uint8), np.full(row_size(t, 512), 0xA5, np.uint8)
        tr.from_float_ref(x, ref)
        D.quantize_chunk(int(t), x, got)
        assert np.array_equal(got, ref), t.name
        ref.flags.writeable = False   # as convert.dequantize passes them
        f, g = np.empty(512, np.float32), np.full(512, np.nan, np.float32)
        tr.to_float(ref, f)
        D.dequantize_chunk(int(t), ref, g)
        assert np.array_equal(g.view(np.uint32), f.view(np.uint32)), t.name
    for vdt in {TYPE_TRAITS_CPU[t].vec_dot_type for t in types_with("dot_cols")}:
        ref, got = np.zeros(row_size(vdt, 512), np.uint8), np.full(row_size(vdt, 512), 0xA5, np.uint8)
        TYPE_TRAITS_CPU[vdt].from_float(x, ref)
        D.from_float(int(vdt), x, got)
        assert np.array_equal(got, ref), vdt.name


# ----------------------------------------------------------------------------------------------
# The portable path: a fresh interpreter with AVX2 (indeed all AVX) switched off
# ----------------------------------------------------------------------------------------------

_TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q2_K", "Q3_K")
_CHILD = f"TYPES = {_TYPES!r}\n" + textwrap.dedent("""
    import json, sys
    import numpy as np
    from lazyggml.backends.cpu import simd, type_common, type_float, type_k, matmul as M
    from lazyggml.backends.cpu.traits import get_type_traits_cpu
    from lazyggml.types import Type
    if sys.argv[2] == "portable":
        assert simd.ISA == "portable" and not simd.HAVE_AVX2 and not simd.HAVE_F16C, simd.ISA
    else:
        assert simd.HAVE_AVX2 and not simd.HAVE_GFNI, simd.ISA
    d = np.load(sys.argv[1])
    out = {}
    for name in TYPES:
        t = Type[name]
        tr = get_type_traits_cpu(t)
        out[name] = float(tr.vec_dot(int(d["n"]), d[name + "_x"], d[name + "_y"]))
    # several columns at once: Q4_K (K-quant path) and F16 (float path with fp16 decode)
    n, nc = int(d["n"]), int(d["nc"])
    acc = np.empty(type_common.acc_floats(n, nc + 4), np.float32)
    res = np.empty(nc, np.float32)
    type_k.dot_cols_q4_K_q8_K(n, d["Q4_K_x"], d["ys"], n - n, int(d["rs"]), 292, nc, acc, res)
    out["cols"] = res.tolist()
    # two rows at once: per row the same arithmetic as one row, in this build too
    q4, q4b, q6, q6b = d["Q4_K_x"], d["Q4_K_x2"], d["Q6_K_x"], d["Q6_K_x2"]
    two = np.empty(2 * nc, np.float32)
    type_k.dot_cols2_q4_K_q8_K(n, q4, q4b, d["ys"], 0, int(d["rs"]), 292, nc, acc, two)
    type_k.dot_cols_q4_K_q8_K(n, q4b, d["ys"], 0, int(d["rs"]), 292, nc, acc, res)
    assert two[0::2].tolist() == out["cols"] and two[1::2].tolist() == res.tolist()
    y6 = d["Q6_K_y"]
    assert type_k.dot2_q6_K_q8_K(n, q6, q6b, y6, 0) == (type_k.dot_q6_K_q8_K(n, q6, y6, 0),
                                                        type_k.dot_q6_K_q8_K(n, q6b, y6, 0))
    type_k.dot_cols2_q6_K_q8_K(n, q6, q6b, d["ys"], 0, int(d["rs"]), 292, nc, acc, two)
    type_k.dot_cols_q6_K_q8_K(n, q6b, d["ys"], 0, int(d["rs"]), 292, nc, acc, res)
    assert two[1::2].tolist() == res.tolist()
    w16 = d["w16"]
    out["f16"] = [float(v) for v in type_float.dot_tile_f16(n, w16, w16, d["yf"], 0, 4 * n, 8 * n)[:3]]
    # the portable fp16 decode on all 65536 halves (subnormals, infinities, NaNs)
    from numba import njit
    @njit
    def decode(h, f):
        for i in range(0, h.size, 8):
            simd.store_f32x8(f, 4 * i, simd.f16x8_to_f32(simd.load_i16x8(h, 2 * i)))
    h = np.arange(65536, dtype=np.uint16)
    f = np.empty(h.size, np.float32)
    decode(h, f)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(f), nan)
    assert np.array_equal(f[~nan].view(np.uint32), want[~nan].view(np.uint32))
    # the portable fp32 -> fp16 rounding (flash attention's F16 sums): every half, the midpoints
    # between neighbours (ties to even), random floats of every scale, overflow and NaN
    @njit
    def round16(x, y):
        for i in range(0, x.size, 8):
            simd.store_f32x8(y, 4 * i, simd.round_f16x8(simd.load_f32x8(x, 4 * i)))
    rng = np.random.default_rng(3)
    halves = want[np.isfinite(want)].astype(np.float64)
    x = np.concatenate([halves, (halves[:-1] + halves[1:]) / 2,
                        rng.standard_normal(1 << 16) * 10.0 ** rng.integers(-9, 6, 1 << 16),
                        [65519.0, 65520.0, 1e9, -1e9, np.inf, -np.inf, np.nan]]).astype(np.float32)
    x = np.concatenate([x, np.zeros(-x.size % 8, np.float32)])
    y = np.empty_like(x)
    round16(x, y)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(y), nan)
    assert np.array_equal(y[~nan].view(np.uint32), want[~nan].view(np.uint32))
    # every flash-attention case (8-lane dot products here, F16 sums, tiled and split paths)
    # against its float64 oracle
    from lazyggml import op_cases
    for c in op_cases.CASES:
        if c.family == "flash_attn":
            assert op_cases.run_case(c) == "ok", c.name
    print(json.dumps(out))
""")


def _features_without_gfni():
    from numba.core.codegen import get_host_cpu_features
    return get_host_cpu_features().replace("+gfni", "-gfni")


@pytest.mark.parametrize("path", ["portable", "avx2-without-gfni"])
def test_portable_simd_path(tmp_path, path):
    """The kernels compiled without AVX at all, and with AVX2 but without GFNI (``crumb``'s other
    body), in a fresh interpreter: the same results as this process's; there also the fp16
    conversions against NumPy's and every flash-attention op case against its oracle."""
    if path != "portable" and not simd.HAVE_AVX2:
        pytest.skip("this CPU has no AVX2")
    rng = np.random.default_rng(9)
    n = 512
    data = {"n": np.int64(n)}
    expect = {}
    for name in _TYPES:
        t = Type[name]
        x = random_blocks(rng, t, n)
        _, y = activation_row(rng, t, n)
        data[name + "_x"], data[name + "_y"] = x, y
        expect[name] = float(get_type_traits_cpu(t).vec_dot(n, x, y))
    data["Q4_K_x2"], data["Q6_K_x2"] = random_blocks(rng, Type.Q4_K, n), random_blocks(rng, Type.Q6_K, n)
    nc = 11   # 8 columns summed together (type_common._col_sums) and 3 alone
    ys = np.concatenate([activation_row(rng, Type.Q4_K, n)[1] for _ in range(nc)])
    rs = ys.size // nc
    expect["cols"] = [float(type_k.vec_dot_q4_K_q8_K(n, data["Q4_K_x"], ys[c * rs:(c + 1) * rs]))
                      for c in range(nc)]
    # F16 weights with subnormals and large values; activations already fp16-rounded floats
    w16 = rng.uniform(-1, 1, n).astype(np.float16)
    w16[:8] = np.array([6e-8, -6e-8, 1e-5, -3e-5, 0.0, -0.0, 6.5e4, -6.5e4], np.float16)
    yf = rng.uniform(-1, 1, (nc, n)).astype(np.float16).astype(np.float32)
    expect["f16"] = [float(np.dot(w16.astype(np.float64), yf[c].astype(np.float64))) for c in range(3)]
    data.update(nc=np.int64(nc), ys=ys, rs=np.int64(rs), w16=w16.view(np.uint16), yf=yf.reshape(-1))
    np.savez(tmp_path / "in.npz", **data)
    # its own kernel cache, so the portable build never replaces the main one
    cache = str(tmp_path / "numba_cache")
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, LAZYGGML_CACHE_DIR=cache)
    if path == "portable":
        env.update(LAZYGGML_SIMD="portable", NUMBA_ENABLE_AVX="0")
    else:
        env.update(NUMBA_CPU_FEATURES=_features_without_gfni())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "in.npz"), path], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for name in _TYPES:
        # integer parts are exact; float lanes may round differently without FMA hardware
        assert abs(got[name] - expect[name]) <= 1e-5 * max(1.0, abs(expect[name])), name
    assert np.allclose(got["cols"], expect["cols"], rtol=1e-5, atol=1e-5)
    assert np.allclose(got["f16"], expect["f16"], rtol=1e-5, atol=1e-3)
