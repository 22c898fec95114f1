"""GGML's tiled matmul (``ggml-cpu/tiled``): the order in which it adds a quantized product.

llama.cpp's GGML computes a product of 8 activation columns or more (``src1->ne[1] >= 8``) whose
weights are K-quants or IQ types (here: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) and not repacked
(``repack.py``) through its tiled matmul, on by default (``GGML_CPU_TILED_MM=0`` turns it off).
Its integer work is vec_dot's (the same Q8_K activations, exact sums), but its AVX2 micro-kernel
finishes each (row, column, super-block) on its own, where vec_dot keeps 8 float lanes of
``d·d8·sumi`` across the blocks and adds them up at the end:

    s1 = Σ_s scale_s · Σ_{e in s} q[e]·q8[e]        exact, one int32 (Q6_K, Q3_K: signed quants)
    s2 = Σ_s min_s · bsum_s                          exact (the types with mins: Q2_K, Q4_K, Q5_K)
    res = d · float(s1)                              float32
    res = fma(−dmin, float(s2), res)                 (the types with mins)
    buf = fma(res, d8, buf)                          buf starts at 0; blocks in order

(``tiled_run_microtile_avx2``: ``_mm256_mul_ps(d0, cvt(s1))``, ``_mm256_fnmadd_ps(dmin0, cvt(s2),
res)``, ``_mm256_fmadd_ps(res, d8, buf)``, 8 columns per vector, the same per column). The kernels
here are the type modules' integer pieces (unpacked once per block for all columns) with those float
steps, per column: one weight row against ``nc`` columns, ``dot_cols``' parameters. The matmul
takes them where GGML would (``TILED``; off: vec_dot's order, as GGML built alone, ggml-python,
computes every product).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ... import debug, types
from ...cache import tie_cache
from ...types import QK_K
from . import simd, type_common, type_iq, type_k
from .simd import (bcast_half, bcast_pair, fma, hsum_i32, load_f32, load_f32x8, load_i8x16,
                   load_i16x16, load_u16, madd, sext, splat_f32x8, store_f32x8, to_f32, vadd, vmul)
from .type_common import TABLE_F32_F16 as _F16
from .type_common import _fmaf
from .type_iq import IQ4_XS_SIZE
from .type_k import Q4_K_SIZE, Q5_K_SIZE, Q6_K_SIZE

_fast = njit(cache=True)

#: Quantized products of TILED_MIN_COLS columns or more in the tiled order, as llama.cpp's GGML
#: computes them (``ggml_tiled_min_batch``); off (``LAZYGGML_TILED_MM=0``, as
#: ``GGML_CPU_TILED_MM=0``), vec_dot's order. Read when a graph's plan is made.
TILED = debug.flag("LAZYGGML_TILED_MM")
TILED_MIN_COLS = 8


@njit(inline="always")
def _step(buf, d, dmin, s1, s2, d8, has_min):
    """One super-block of one (row, column) added to ``buf`` in the tiled kernel's order."""
    res = d * np.float32(s1)
    if has_min:
        res = _fmaf(-dmin, np.float32(s2), res)
    return _fmaf(res, d8, buf)


@njit(inline="always")
def _k4_row(n, x, y, yo, ycs, ybs, nc, acc, out, q5):
    """A Q4_K (``q5`` False) or Q5_K row against nc columns, the columns' min table
    (``type_k._k4_min_table``) in acc. Whole groups of 8 columns as GGML's kernel does them, a
    vector lane per column: their s1 (each summed and converted on its own, then side by side in
    scratch), their s2 from the table, the float steps once for all 8. Column c's sum waits in
    acc[c]. (Keeping the 8 columns' int32 vectors in registers for a transposed sum spilled them
    and took 2x as long.)"""
    ng = nc // 8
    tb = 4 * type_common.ACC_PER_COL * nc
    acc[:nc] = 0
    for i in range(n // QK_K):
        xb = i * (Q5_K_SIZE if q5 else Q4_K_SIZE)
        xd, xdmin, ms, mins = type_k._k4_head(x, xb)
        if q5:
            l0, h0, l1, h1, l2, h2, l3, h3 = type_k._q5_K_unpack(x, xb)
        else:
            l0, h0, l1, h1, l2, h2, l3, h3 = type_k._q4_K_unpack(x, xb)
        sc = bcast_half(ms, 0)
        for g in range(ng):
            yb = yo + 8 * g * ycs + i * ybs
            for k in range(8):   # each column's s1, as float32, into 8 lanes of scratch at acc[nc:]
                acc[nc + k] = np.float32(hsum_i32(type_k._k4_sumi(y, yb + k * ycs, l0, h0, l1, h1, l2, h2, l3, h3, sc)))
            t = tb + type_common.K4_TABLE_BYTES * (i * ng + g)
            s2 = vadd(vadd(madd(bcast_pair(mins, 0), load_i16x16(acc, t)), madd(bcast_pair(mins, 1), load_i16x16(acc, t + 32))),
                      vadd(madd(bcast_pair(mins, 2), load_i16x16(acc, t + 64)), madd(bcast_pair(mins, 3), load_i16x16(acc, t + 96))))
            res = fma(splat_f32x8(-xdmin), to_f32(s2), vmul(splat_f32x8(xd), load_f32x8(acc, 4 * nc)))
            store_f32x8(acc, 32 * g, fma(res, load_f32x8(acc, t + 128), load_f32x8(acc, 32 * g)))
        for c in range(8 * ng, nc):
            yb = yo + c * ycs + i * ybs
            s1 = hsum_i32(type_k._k4_sumi(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, sc))
            s2 = hsum_i32(type_k._k4_min_prod(mins, y, yb))
            acc[c] = _step(acc[c], xd, xdmin, s1, s2, load_f32(y, yb), True)
    out[:nc] = acc[:nc]


@njit(inline="always")
def _k4_tile(n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, acc, out, dst, i3, i2, c0, q5):
    type_k._k4_min_table(n, y, yo, ycs, ybs, nc, acc)
    for r in range(r0, r1):
        _k4_row(n, w4[j3, j2, r], y, yo, ycs, ybs, nc, acc, out, q5)
        for k in range(nc):
            dst[i3, i2, c0 + k, r] = out[k]


@_fast
def tiled_cols_q4_K_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    """One row against nc columns (acc: ``type_common.acc_floats(n, nc)``): the min table, the row."""
    type_k._k4_min_table(n, y, yo, ycs, ybs, nc, acc)
    _k4_row(n, x, y, yo, ycs, ybs, nc, acc, out, False)


@_fast
def tiled_cols_q5_K_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    type_k._k4_min_table(n, y, yo, ycs, ybs, nc, acc)
    _k4_row(n, x, y, yo, ycs, ybs, nc, acc, out, True)


@_fast
def tile_tiled_q4_K_q8_K(n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, acc, out, dst, i3, i2, c0):
    """A whole tile (``tiled_tile``'s parameters): the columns' min table once, then row by row."""
    _k4_tile(n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, acc, out, dst, i3, i2, c0, False)


@_fast
def tile_tiled_q5_K_q8_K(n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, acc, out, dst, i3, i2, c0):
    _k4_tile(n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, acc, out, dst, i3, i2, c0, True)


@_fast
def tiled_cols_q6_K_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    acc[:nc] = 0
    for i in range(n // QK_K):
        xb = i * Q6_K_SIZE
        xd = _F16[load_u16(x, xb + 208)]
        sc16 = sext(load_i8x16(x, xb + 192))
        a0, a1, a2, a3 = type_k._q6_K_unpack(x, xb, 0)
        b0, b1, b2, b3 = type_k._q6_K_unpack(x, xb, 1)
        for c in range(nc):
            yb = yo + c * ycs + i * ybs
            s1 = hsum_i32(type_k._q6_K_sumi(y, yb, a0, a1, a2, a3, b0, b1, b2, b3, sc16))
            acc[c] = _step(acc[c], xd, xd, s1, 0, load_f32(y, yb), False)
    out[:nc] = acc[:nc]


@njit(inline="always")
def _k23_cols(n, x, y, yo, ycs, ybs, nc, acc, out, q3):
    """Q2_K (``q3`` False) and Q3_K."""
    acc[:nc] = 0
    for i in range(n // QK_K):
        xd, xdmin, sc0, sc1, mins, hb0, hb1, c0, c1, c2, c3, c4, c5, c6, c7 = type_k._k23_unpack(x, i, q3)
        for c in range(nc):
            yb = yo + c * ycs + i * ybs
            s1 = hsum_i32(type_k._k23_sumi(c0, c1, c2, c3, c4, c5, c6, c7, hb0, hb1, q3, y, yb, sc0, sc1))
            s2 = 0 if q3 else hsum_i32(type_k._k2_min_prod(mins, y, yb))
            acc[c] = _step(acc[c], xd, xdmin, s1, s2, load_f32(y, yb), not q3)
    out[:nc] = acc[:nc]


@_fast
def tiled_cols_q2_K_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    _k23_cols(n, x, y, yo, ycs, ybs, nc, acc, out, False)


@_fast
def tiled_cols_q3_K_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    _k23_cols(n, x, y, yo, ycs, ybs, nc, acc, out, True)


@_fast
def tiled_cols_iq4_xs_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    acc[:nc] = 0
    for i in range(n // QK_K):
        xb = i * IQ4_XS_SIZE
        xd = _F16[load_u16(x, xb)]
        for c in range(nc):
            yb = yo + c * ycs + i * ybs
            s1 = hsum_i32(type_iq._iq4_xs_sumi(x, xb, y, yb))
            acc[c] = _step(acc[c], xd, xd, s1, 0, load_f32(y, yb), False)
    out[:nc] = acc[:nc]


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, type_common.__file__, type_k.__file__, type_iq.__file__, types.__file__, __file__)
