"""The float types on the CPU: F32, F16 and BF16 rows, their conversions from and to float32 and
their dot products. Each is its own ``vec_dot_type``: activations are rounded to the weight's
type first, then everything is float32 arithmetic in GGML's order. The matmul's float path uses
``dot_pair_*`` (2 rows, one column), ``dot_tile_*`` (2 rows × 3 columns, held in registers) and
``dot_sgemm_*`` (llamafile's order) with typed weight rows; ``vec_dot_*`` take byte rows like
every other type's (``type_common.py``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ... import types
from ...cache import tie_cache
from . import simd, type_common
from .simd import (bf16x8_to_f32, f16x8_to_f32, fma, hadd_f32x8_cols, hsum_f32x8_cols, lane, load_f32, load_f32x8,
                   load_i16x8, load_u16, splat_f32x8, vadd)
from .type_common import TABLE_F32_F16 as _F16
from .type_common import (_bf16, _f32, _fast, _kernel, _ref, bf16_to_fp32, fp32_to_bf16, fp32_to_fp16, load_f16)


# ----------------------------------------------------------------------------------------------
# f32 / f16 / bf16 rows (4 or 2 bytes per element, little-endian)
# ----------------------------------------------------------------------------------------------

@_kernel
def quantize_row_f32(x, y):
    """F32 'quantization' is a copy of the bytes."""
    y[:] = x.view(np.uint8)


@_kernel
def dequantize_row_f32(x, y):
    y[:] = x.view(np.float32)


@_kernel
def quantize_row_f16(x, y):
    for i in range(x.shape[0]):
        h = fp32_to_fp16(x[i])
        y[2 * i] = h & 0xFF
        y[2 * i + 1] = h >> 8


@_kernel
def dequantize_row_f16(x, y):
    for i in range(y.shape[0]):
        y[i] = load_f16(x, 2 * i)


@_kernel
def quantize_row_bf16(x, y):
    for i in range(x.shape[0]):
        h = fp32_to_bf16(x[i])
        y[2 * i] = h & 0xFF
        y[2 * i + 1] = h >> 8


@_kernel
def dequantize_row_bf16(x, y):
    for i in range(y.shape[0]):
        y[i] = bf16_to_fp32(np.uint32(x[2 * i]) | (np.uint32(x[2 * i + 1]) << 8))


# =================================================================================================
# Reference kernels: GGML's *_generic, same integer lanes and float order, unfused
# =================================================================================================

@_ref
def vec_dot_f32_ref(n, x, y):
    """Sequential float32 dot of two F32 rows (bytes). GGML's SIMD version sums in lanes: the
    two differ by rounding only."""
    s = np.float32(0.0)
    for i in range(n):
        s += _f32(x, 4 * i) * _f32(y, 4 * i)
    return s


@_ref
def vec_dot_f16_ref(n, x, y):
    """ggml_vec_dot_f16's scalar tail: products of decoded halves summed in float64
    (ggml_float), returned as float32."""
    s = 0.0
    for i in range(n):
        s += np.float64(load_f16(x, 2 * i)) * np.float64(load_f16(y, 2 * i))
    return np.float32(s)


@_ref
def vec_dot_bf16_ref(n, x, y):
    """ggml_vec_dot_bf16's scalar tail: float64 sum of decoded products."""
    s = 0.0
    for i in range(n):
        s += np.float64(_bf16(x, 2 * i)) * np.float64(_bf16(y, 2 * i))
    return np.float32(s)


# ------------------------------------------------------------------------------------------------
# Float rows. F32 weights: F32 activations. F16/BF16 weights: activations rounded to F16/BF16
# first (GGML's vec_dot_type), then everything is float32 arithmetic on exact values, in the order
# of GGML's ggml_vec_dot_f32 / _f16 / _bf16 (ggml-cpu/vec.cpp) as GCC builds them for AVX2 + FMA:
#
# * per 32 values, four 8-lane accumulators: vector j of the 32 is FMA'd into s_j (BF16's source
#   says _mm256_add_ps(_mm256_mul_ps(...)), which GCC contracts into the same FMA);
# * (s0 + s2) + (s1 + s3), then its 8 lanes: r = lo4 + hi4, then (r0 + r1) + (r2 + r3) for F32 and
#   F16 (GGML_F32x8_REDUCE: two hadds), (r0 + r2) + (r1 + r3) for BF16 (movehl, movehdup);
# * the values past the last multiple of 32 one at a time (``_float_tail``).
#
# GGML's mul_mat calls that vec_dot once per (row, column) whatever the shape or thread count (the
# float types' ``nrows`` is 1), so these are its bits for every float product, unless GGML was
# built with llamafile's sgemm, as llama.cpp builds it: then products of 2 columns or more add in
# tinyBLAS's order instead (``_sgemm_tile``; matmul.LLAMAFILE chooses).
# ------------------------------------------------------------------------------------------------

@njit(inline="always")
def _wload(x, o, kind):
    """8 weights at byte offset o as float32: kind 0 = F32, 1 = F16, 2 = BF16."""
    if kind == 0:
        return load_f32x8(x, o)
    elif kind == 1:
        return f16x8_to_f32(load_i16x8(x, o))
    else:
        return bf16x8_to_f32(load_i16x8(x, o))


@njit(inline="always")
def _wscalar(x, o, kind):
    if kind == 0:
        return load_f32(x, o)
    elif kind == 1:
        return _F16[load_u16(x, o)]
    else:
        return np.uint32(np.uint32(load_u16(x, o)) << 16).view(np.float32)


@njit(inline="always")
def _float_tail(n, n32, x, y, yo, kind, s):
    """GGML's leftovers: values n32..n of row x and the column at byte ``yo`` of y added to the
    lanes' sum s one at a time. F16/BF16: in double (``ggml_float``; the products of two halves or
    two bf16 are exact in float32), rounded to float32 at the end. F32: in float32, as GCC
    vectorised that loop: groups of 4 products rounded, then added in order; the last
    (n - n32) % 4 (all of them, when fewer than 4) fused into FMAs."""
    if kind == 0:
        first_fma = n - (n - n32) % 4 if n - n32 >= 4 else n32
        for i in range(n32, n):
            if i < first_fma:
                s += load_f32(x, 4 * i) * load_f32(y, yo + 4 * i)
            else:
                s = fma(load_f32(x, 4 * i), load_f32(y, yo + 4 * i), s)
        return s
    d = np.float64(s)
    for i in range(n32, n):
        d += np.float64(_wscalar(x, 2 * i, kind) * load_f32(y, yo + 4 * i))
    return np.float32(d)


@njit(inline="always")
def _fma6(x0, x1, wo, y, y0, y1, y2, kind, acc, nc):
    """Vector ``wo`` (byte offset) of rows x0, x1 times the same vector of columns y0..y2 (byte
    offsets into y), FMA'd into acc = (r0c0, r0c1, r0c2, r1c0, r1c1, r1c2); with ``nc`` 1 (a
    literal), column y0 only, the other accumulators passed through. Each column vector is used as
    soon as it is loaded: with the three loaded first, LLVM spilled an accumulator in BF16's tiles
    (whose weights take two instructions to decode), 14% slower."""
    w0 = _wload(x0, wo, kind)
    w1 = _wload(x1, wo, kind)
    v0 = load_f32x8(y, y0)
    if nc == 1:
        return (fma(w0, v0, acc[0]), acc[1], acc[2], fma(w1, v0, acc[3]), acc[4], acc[5])
    a0, a3 = fma(w0, v0, acc[0]), fma(w1, v0, acc[3])
    v1 = load_f32x8(y, y1)
    a1, a4 = fma(w0, v1, acc[1]), fma(w1, v1, acc[4])
    v2 = load_f32x8(y, y2)
    return (a0, a1, fma(w0, v2, acc[2]), a3, a4, fma(w1, v2, acc[5]))


@njit(inline="always")
def _add6(a, b):
    return (vadd(a[0], b[0]), vadd(a[1], b[1]), vadd(a[2], b[2]),
            vadd(a[3], b[3]), vadd(a[4], b[4]), vadd(a[5], b[5]))


@njit(inline="always")
def _float_pass(n32, x0, x1, y, y0, y1, y2, kind, nc, j, all4):
    """GGML's accumulators of rows x0, x1 against the columns at byte offsets y0, y1, y2 (``nc`` 3)
    or y0 alone (``nc`` 1), each as ``_fma6``'s 6-tuple: s_j + s_(j+2) (``j`` 0 or 1: vectors j and
    j + 2 of each 32 values), and with ``all4`` (j 0) also s_1 + s_3, from the same pass."""
    ws = 4 if kind == 0 else 2
    z = splat_f32x8(0.0)
    a = b = c = d = (z, z, z, z, z, z)
    for i in range(8 * j, n32, 32):
        a = _fma6(x0, x1, ws * i, y, y0 + 4 * i, y1 + 4 * i, y2 + 4 * i, kind, a, nc)
        if all4:
            c = _fma6(x0, x1, ws * (i + 8), y, y0 + 4 * i + 32, y1 + 4 * i + 32, y2 + 4 * i + 32, kind, c, nc)
        b = _fma6(x0, x1, ws * (i + 16), y, y0 + 4 * i + 64, y1 + 4 * i + 64, y2 + 4 * i + 64, kind, b, nc)
        if all4:
            d = _fma6(x0, x1, ws * (i + 24), y, y0 + 4 * i + 96, y1 + 4 * i + 96, y2 + 4 * i + 96, kind, d, nc)
    return _add6(a, b), _add6(c, d)


@njit(inline="always")
def _float_tile(n, x0, x1, y, y0, y1, y2, kind, nc):
    """GGML's vec_dot of rows x0, x1 with the columns at byte offsets y0, y1, y2 (``nc`` 3), or with
    y0 alone (``nc`` 1), as (r0c0, r0c1, r0c2, r1c0, r1c1, r1c2). Three columns: each weight vector
    is decoded once for 3 columns and each column vector loaded once for 2 rows, 6 FMAs per 5 loads
    (a row against one column at a time is bound by its loads: 2 per FMA); GGML's four accumulators
    of 6 dot products would take 24 registers, and AVX2 has 16, so the rows are walked twice, for
    s0 + s2 and then s1 + s3, 12 accumulators each. One column: the two rows' four chains each, 8
    accumulators, in one pass (walking the rows twice, the second time from L2, made a 4096 x
    14336 mat-vec ~1.3x slower)."""
    n32 = n - n % 32
    if nc == 1:
        p, q = _float_pass(n32, x0, x1, y, y0, y1, y2, kind, nc, 0, True)
    else:
        p = _float_pass(n32, x0, x1, y, y0, y1, y2, kind, nc, 0, False)[0]
        q = _float_pass(n32, x0, x1, y, y0, y1, y2, kind, nc, 1, False)[0]
    s = _add6(p, q)
    # the lanes of the 6 sums reduced together (8 at once: the last one repeated)
    if kind == 2:
        r = hsum_f32x8_cols(s[0], s[1], s[2], s[3], s[4], s[5], s[5], s[5])
    else:
        r = hadd_f32x8_cols(s[0], s[1], s[2], s[3], s[4], s[5], s[5], s[5])
    s00 = _float_tail(n, n32, x0, y, y0, kind, lane(r, 0))
    s10 = _float_tail(n, n32, x1, y, y0, kind, lane(r, 3))
    if nc == 1:
        return (s00, s00, s00, s10, s10, s10)
    return (s00, _float_tail(n, n32, x0, y, y1, kind, lane(r, 1)), _float_tail(n, n32, x0, y, y2, kind, lane(r, 2)),
            s10, _float_tail(n, n32, x1, y, y1, kind, lane(r, 4)), _float_tail(n, n32, x1, y, y2, kind, lane(r, 5)))


@njit(inline="always")
def _sgemm_tile(n, x0, x1, y, y0, y1, y2, kind):
    """llamafile's tinyBLAS (``ggml-cpu/llamafile/sgemm.cpp``, AVX2: ``KN`` = 8), which GGML built
    with GGML_LLAMAFILE (llama.cpp's default) runs for float products of 2 columns or more: each
    dot product of rows x0, x1 with columns y0, y1, y2 is one 8-lane FMA chain over all ``n`` values
    (a multiple of 8), then ``hsum``: r = lo4 + hi4, then (r0 + r2) + (r1 + r3). Same tuple as
    ``_float_tile``; 6 accumulators, one pass."""
    ws = 4 if kind == 0 else 2
    z = splat_f32x8(0.0)
    a = (z, z, z, z, z, z)
    for i in range(0, n, 8):
        a = _fma6(x0, x1, ws * i, y, y0 + 4 * i, y1 + 4 * i, y2 + 4 * i, kind, a, 3)
    r = hsum_f32x8_cols(a[0], a[1], a[2], a[3], a[4], a[5], a[5], a[5])
    return (lane(r, 0), lane(r, 1), lane(r, 2), lane(r, 3), lane(r, 4), lane(r, 5))


# the matmul's float kernels, by weight kind: 2 rows x 3 columns (``tile``, vec_dot's order, or
# ``sgemm``, tinyBLAS's) or x 1 column (``pair``)
@_fast
def dot_sgemm_f32(n, x0, x1, y, y0, y1, y2):
    return _sgemm_tile(n, x0, x1, y, y0, y1, y2, 0)


@_fast
def dot_sgemm_f16(n, x0, x1, y, y0, y1, y2):
    return _sgemm_tile(n, x0, x1, y, y0, y1, y2, 1)


@_fast
def dot_sgemm_bf16(n, x0, x1, y, y0, y1, y2):
    return _sgemm_tile(n, x0, x1, y, y0, y1, y2, 2)


@_fast
def dot_tile_f32(n, x0, x1, y, y0, y1, y2):
    return _float_tile(n, x0, x1, y, y0, y1, y2, 0, 3)


@_fast
def dot_tile_f16(n, x0, x1, y, y0, y1, y2):
    return _float_tile(n, x0, x1, y, y0, y1, y2, 1, 3)


@_fast
def dot_tile_bf16(n, x0, x1, y, y0, y1, y2):
    return _float_tile(n, x0, x1, y, y0, y1, y2, 2, 3)


@_fast
def dot_pair_f32(n, x0, x1, y, yo):
    return _float_tile(n, x0, x1, y, yo, yo, yo, 0, 1)


@_fast
def dot_pair_f16(n, x0, x1, y, yo):
    return _float_tile(n, x0, x1, y, yo, yo, yo, 1, 1)


@_fast
def dot_pair_bf16(n, x0, x1, y, yo):
    return _float_tile(n, x0, x1, y, yo, yo, yo, 2, 1)


@_fast
def vec_dot_f32(n, x, y):
    """Two F32 rows (bytes), as GGML's ggml_vec_dot_f32."""
    return _float_tile(n, x, x, y, 0, 0, 0, 0, 1)[0]


@_fast
def vec_dot_f16(n, x, y):
    """Two F16 rows (bytes), as GGML's ggml_vec_dot_f16: halves decoded, float32 FMAs."""
    yf = np.empty(n, np.float32)
    for i in range(n):
        yf[i] = _F16[load_u16(y, 2 * i)]
    return _float_tile(n, x, x, yf, 0, 0, 0, 1, 1)[0]


@_fast
def vec_dot_bf16(n, x, y):
    """Two BF16 rows (bytes), as GGML's ggml_vec_dot_bf16."""
    yf = np.empty(n, np.float32)
    for i in range(n):
        yf[i] = np.uint32(np.uint32(load_u16(y, 2 * i)) << 16).view(np.float32)
    return _float_tile(n, x, x, yf, 0, 0, 0, 2, 1)[0]


# the cache of every kernel above also depends on these files (lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, type_common.__file__, types.__file__, __file__)
