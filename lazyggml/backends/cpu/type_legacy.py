"""GGML's first block formats on the CPU: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q8_1, blocks of 32
values with one fp16 scale (and, for the ``_1`` formats, a min or a sum). Their quantizers and
dequantizers, GGML's CPU activation quantizers for Q8_0 and Q8_1, and their dot products with
Q8_0 / Q8_1 activations (``type_common.py`` says what each kind of kernel does).

Layouts (docs/quant-formats.md §1): element j (0..15) sits in the low nibble of qs[j], element
j+16 in the high nibble; for the 5-bit ones bit 4 of element j is bit j of the 32-bit qh.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ... import types
from ...cache import tie_cache
from ...types import Type, blck_size, field_offset, type_size
from . import simd, type_common
from .simd import (bits_to_bytes, concat, dot4_acc, fma, hsum_f32x8, load_f32x8, load_i8x16, load_i8x32, load_u16,
                   load_u32, splat_f32x8, splat_i32x8, splat_i8x32, store_f32x8, to_f32, vabs, vand, vor, vsrl,
                   vsub)
from .type_common import TABLE_F32_F16 as _F16
from .type_common import (ACC_PER_COL, _c_int, _col_sums, _fast, _fmaf, _i8, _kernel, _min_max, _nibbles,
                          _q8_block_f32, _ref, _roundf, _signed_absmax, _store_u32, _u32, _u8, _wrap_i8,
                          _zero_cols, load_f16, store_f16)

# block sizes, from the layout table (types.py): constants in the compiled kernels
QK4_0 = blck_size(Type.Q4_0)
QK4_1 = blck_size(Type.Q4_1)
QK5_0 = blck_size(Type.Q5_0)
QK5_1 = blck_size(Type.Q5_1)
QK8_0 = blck_size(Type.Q8_0)
QK8_1 = blck_size(Type.Q8_1)
Q4_0_SIZE = type_size(Type.Q4_0)
Q4_1_SIZE = type_size(Type.Q4_1)
Q5_0_SIZE = type_size(Type.Q5_0)
Q5_1_SIZE = type_size(Type.Q5_1)
Q8_0_SIZE = type_size(Type.Q8_0)
Q8_1_SIZE = type_size(Type.Q8_1)
# where the fields the kernels read start in a block, from the same table (every d is at byte 0)
Q4_0_QS = field_offset(Type.Q4_0, "qs")
Q4_1_M = field_offset(Type.Q4_1, "m")
Q4_1_QS = field_offset(Type.Q4_1, "qs")
Q5_0_QH = field_offset(Type.Q5_0, "qh")
Q5_0_QS = field_offset(Type.Q5_0, "qs")
Q5_1_M = field_offset(Type.Q5_1, "m")
Q5_1_QH = field_offset(Type.Q5_1, "qh")
Q5_1_QS = field_offset(Type.Q5_1, "qs")
Q8_0_QS = field_offset(Type.Q8_0, "qs")
Q8_1_S = field_offset(Type.Q8_1, "s")
Q8_1_QS = field_offset(Type.Q8_1, "qs")


# ----------------------------------------------------------------------------------------------
# 32-element formats: q4_0 q4_1 q5_0 q5_1 q8_0 q8_1
#   element j (0..15) sits in the low nibble of qs[j], element j+16 in the high nibble;
#   for the 5-bit ones bit 4 of element j is bit j of the 32-bit qh.
# ----------------------------------------------------------------------------------------------



@_kernel
def quantize_row_q4_0(x, y):
    """block_q4_0 (18 B): d fp16 @0, qs[16] @2. d = max/-8 with max the signed largest value,
    so that value lands on level 0 (= -8*d); levels are (int8_t)(x/d + 8.5), at most 15."""
    for i in range(x.shape[0] // QK4_0):
        xb = x[i * QK4_0:(i + 1) * QK4_0]
        yb = y[i * Q4_0_SIZE:(i + 1) * Q4_0_SIZE]
        _, vmax = _signed_absmax(xb)
        d = vmax / np.float32(-8.0)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        store_f16(yb, 0, d)
        for j in range(16):
            xi0 = min(15, _wrap_i8(_c_int(xb[j] * id_ + np.float32(8.5))))
            xi1 = min(15, _wrap_i8(_c_int(xb[j + 16] * id_ + np.float32(8.5))))
            yb[Q4_0_QS + j] = (xi0 & 0xFF) | ((xi1 << 4) & 0xFF)


@_kernel
def dequantize_row_q4_0(x, y):
    for i in range(y.shape[0] // QK4_0):
        xb = x[i * Q4_0_SIZE:(i + 1) * Q4_0_SIZE]
        d = load_f16(xb, 0)
        for j in range(16):
            y[i * 32 + j] = np.float32((xb[Q4_0_QS + j] & 0xF) - 8) * d
            y[i * 32 + j + 16] = np.float32((xb[Q4_0_QS + j] >> 4) - 8) * d


@_kernel
def quantize_row_q4_1(x, y):
    """block_q4_1 (20 B): d fp16 @0, m fp16 @2, qs[16] @4. x = d*q + m with m = min(x),
    d = (max-min)/15, levels (int8_t)((x-min)/d + 0.5), at most 15."""
    for i in range(x.shape[0] // QK4_1):
        xb = x[i * QK4_1:(i + 1) * QK4_1]
        yb = y[i * Q4_1_SIZE:(i + 1) * Q4_1_SIZE]
        vmin, vmax = _min_max(xb)
        d = (vmax - vmin) / np.float32(15.0)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        store_f16(yb, 0, d)
        store_f16(yb, Q4_1_M, vmin)
        for j in range(16):
            xi0 = min(15, _wrap_i8(_c_int((xb[j] - vmin) * id_ + np.float32(0.5))))
            xi1 = min(15, _wrap_i8(_c_int((xb[j + 16] - vmin) * id_ + np.float32(0.5))))
            yb[Q4_1_QS + j] = (xi0 & 0xFF) | ((xi1 << 4) & 0xFF)


@_kernel
def dequantize_row_q4_1(x, y):
    for i in range(y.shape[0] // QK4_1):
        xb = x[i * Q4_1_SIZE:(i + 1) * Q4_1_SIZE]
        d = load_f16(xb, 0)
        m = load_f16(xb, Q4_1_M)
        for j in range(16):
            y[i * 32 + j] = np.float32(xb[Q4_1_QS + j] & 0xF) * d + m
            y[i * 32 + j + 16] = np.float32(xb[Q4_1_QS + j] >> 4) * d + m


@_kernel
def quantize_row_q5_0(x, y):
    """block_q5_0 (22 B): d fp16 @0, qh u32 @2, qs[16] @6. Like q4_0 with 32 levels:
    d = max/-16, levels (int8_t)(x/d + 16.5), at most 31; bit 4 of each level goes to qh."""
    for i in range(x.shape[0] // QK5_0):
        xb = x[i * QK5_0:(i + 1) * QK5_0]
        yb = y[i * Q5_0_SIZE:(i + 1) * Q5_0_SIZE]
        _, vmax = _signed_absmax(xb)
        d = vmax / np.float32(-16.0)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        store_f16(yb, 0, d)
        qh = np.uint32(0)
        for j in range(16):
            xi0 = min(31, _wrap_i8(_c_int(xb[j] * id_ + np.float32(16.5)))) & 0xFF
            xi1 = min(31, _wrap_i8(_c_int(xb[j + 16] * id_ + np.float32(16.5)))) & 0xFF
            yb[Q5_0_QS + j] = (xi0 & 0xF) | ((xi1 & 0xF) << 4)
            qh |= np.uint32(((xi0 & 0x10) >> 4) << j)
            qh |= np.uint32(((xi1 & 0x10) >> 4) << (j + 16))
        _store_u32(yb, Q5_0_QH, qh)


@_kernel
def dequantize_row_q5_0(x, y):
    for i in range(y.shape[0] // QK5_0):
        xb = x[i * Q5_0_SIZE:(i + 1) * Q5_0_SIZE]
        d = load_f16(xb, 0)
        qh = _u32(xb, Q5_0_QH)
        for j in range(16):
            h0 = ((qh >> j) << 4) & 0x10
            h1 = (qh >> (j + 12)) & 0x10
            y[i * 32 + j] = np.float32(np.int64((xb[Q5_0_QS + j] & 0xF) | h0) - 16) * d
            y[i * 32 + j + 16] = np.float32(np.int64((xb[Q5_0_QS + j] >> 4) | h1) - 16) * d


@_kernel
def quantize_row_q5_1(x, y):
    """block_q5_1 (24 B): d fp16 @0, m fp16 @2, qh u32 @4, qs[16] @8. Like q4_1 with
    d = (max-min)/31 and levels (uint8_t)((x-min)/d + 0.5) (no clamp in GGML)."""
    for i in range(x.shape[0] // QK5_1):
        xb = x[i * QK5_1:(i + 1) * QK5_1]
        yb = y[i * Q5_1_SIZE:(i + 1) * Q5_1_SIZE]
        vmin, vmax = _min_max(xb)
        d = (vmax - vmin) / np.float32(31.0)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        store_f16(yb, 0, d)
        store_f16(yb, Q5_1_M, vmin)
        qh = np.uint32(0)
        for j in range(16):
            xi0 = _c_int((xb[j] - vmin) * id_ + np.float32(0.5)) & 0xFF
            xi1 = _c_int((xb[j + 16] - vmin) * id_ + np.float32(0.5)) & 0xFF
            yb[Q5_1_QS + j] = (xi0 & 0xF) | ((xi1 & 0xF) << 4)
            qh |= np.uint32(((xi0 & 0x10) >> 4) << j)
            qh |= np.uint32(((xi1 & 0x10) >> 4) << (j + 16))
        _store_u32(yb, Q5_1_QH, qh)


@_kernel
def dequantize_row_q5_1(x, y):
    for i in range(y.shape[0] // QK5_1):
        xb = x[i * Q5_1_SIZE:(i + 1) * Q5_1_SIZE]
        d = load_f16(xb, 0)
        m = load_f16(xb, Q5_1_M)
        qh = _u32(xb, Q5_1_QH)
        for j in range(16):
            h0 = ((qh >> j) << 4) & 0x10
            h1 = (qh >> (j + 12)) & 0x10
            y[i * 32 + j] = np.float32((xb[Q5_1_QS + j] & 0xF) | h0) * d + m
            y[i * 32 + j + 16] = np.float32((xb[Q5_1_QS + j] >> 4) | h1) * d + m


@_kernel
def _quantize_block_q8(xb, qs):
    """The q8_0/q8_1 reference block: d = amax/127, q = roundf(x/d) (computed as x*(1/d), half
    away from zero). Writes qs (32 bytes, int8 bits); returns (d, sum of the q)."""
    amax = np.float32(0.0)
    for v in xb:
        amax = amax if amax > abs(v) else abs(v)       # C's MAX(amax, fabsf(v))
    d = amax / np.float32(127.0)
    id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    qsum = 0
    for j in range(32):
        q = _wrap_i8(_c_int(_roundf(xb[j] * id_)))
        qs[j] = q & 0xFF
        qsum += q
    return d, qsum


@_kernel
def quantize_row_q8_0(x, y):
    """block_q8_0 (34 B): d fp16 @0, qs[32] int8 @2 (quantize_row_q8_0_ref)."""
    for i in range(x.shape[0] // QK8_0):
        yb = y[i * Q8_0_SIZE:(i + 1) * Q8_0_SIZE]
        d, _ = _quantize_block_q8(x[i * 32:(i + 1) * 32], yb[Q8_0_QS:Q8_0_QS + 32])
        store_f16(yb, 0, d)


@_kernel
def dequantize_row_q8_0(x, y):
    for i in range(y.shape[0] // QK8_0):
        xb = x[i * Q8_0_SIZE:(i + 1) * Q8_0_SIZE]
        d = load_f16(xb, 0)
        for j in range(32):
            y[i * 32 + j] = np.float32(_wrap_i8(xb[Q8_0_QS + j])) * d


@_kernel
def quantize_row_q8_1(x, y):
    """block_q8_1 (36 B): d fp16 @0, s fp16 @2, qs[32] int8 @4. The reference stores
    s = d * (sum of the integer q), not the sum of the floats (CUDA's q8_1 does that)."""
    for i in range(x.shape[0] // QK8_1):
        yb = y[i * Q8_1_SIZE:(i + 1) * Q8_1_SIZE]
        d, qsum = _quantize_block_q8(x[i * 32:(i + 1) * 32], yb[Q8_1_QS:Q8_1_QS + 32])
        store_f16(yb, 0, d)
        store_f16(yb, Q8_1_S, np.float32(qsum) * d)


@_kernel
def dequantize_row_q8_1(x, y):
    """GGML has no q8_1 dequantizer; this is the obvious d*q (s is redundant)."""
    for i in range(y.shape[0] // QK8_1):
        xb = x[i * Q8_1_SIZE:(i + 1) * Q8_1_SIZE]
        d = load_f16(xb, 0)
        for j in range(32):
            y[i * 32 + j] = np.float32(_wrap_i8(xb[Q8_1_QS + j])) * d


# =================================================================================================
# Activation quantizers of GGML's CPU backend (type_traits_cpu[].from_float)
# =================================================================================================
# Q8_K: x86 GGML calls the reference quantizer (type_k.quantize_row_q8_K). Q8_0/Q8_1: the AVX2
# code differs from quantize_row_q8_0 (above) in two ways that change a few quants: it
# multiplies by id = 127/amax instead of 1/d, and rounds half to EVEN (_mm256_round_ps) instead of
# half away from zero. Matching it keeps us within ~1e-7 of GGML instead of ~1e-4.

@_ref
def _q8_block_cpu(x, xo, y, yo):
    amax = np.float32(0.0)
    for j in range(32):
        amax = max(amax, abs(x[xo + j]))
    d = amax / np.float32(127.0)
    idd = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
    qsum = 0
    for j in range(32):
        q = np.int32(np.rint(x[xo + j] * idd))
        y[yo + j] = q & 0xFF
        qsum += q
    return d, qsum


@_ref
def quantize_row_q8_0_cpu(x, y):
    """x (float32[n]) -> Q8_0 row y, as GGML's x86 AVX2 quantize_row_q8_0."""
    for i in range(x.shape[0] // 32):
        d, _ = _q8_block_cpu(x, 32 * i, y, Q8_0_SIZE * i + Q8_0_QS)
        store_f16(y, Q8_0_SIZE * i, d)


@_ref
def quantize_row_q8_1_cpu(x, y):
    """x (float32[n]) -> Q8_1 row y (d, s = d*Σq, qs), as GGML's x86 AVX2 quantize_row_q8_1."""
    for i in range(x.shape[0] // 32):
        d, qsum = _q8_block_cpu(x, 32 * i, y, Q8_1_SIZE * i + Q8_1_QS)
        store_f16(y, Q8_1_SIZE * i, d)
        store_f16(y, Q8_1_SIZE * i + Q8_1_S, d * np.float32(qsum))


# =================================================================================================
# Reference kernels: GGML's *_generic, same integer lanes and float order, unfused
# =================================================================================================

@_ref
def vec_dot_q8_0_q8_0_ref(n, x, y):
    """ggml_vec_dot_q8_0_q8_0_generic: sumf += sumi * (dx*dy), block by block."""
    sumf = np.float32(0.0)
    for i in range(n // 32):
        xo, yo = i * Q8_0_SIZE, i * Q8_0_SIZE
        sumi = 0
        for j in range(32):
            sumi += _i8(x, xo + Q8_0_QS + j) * _i8(y, yo + Q8_0_QS + j)
        sumf += np.float32(sumi) * (load_f16(x, xo) * load_f16(y, yo))
    return sumf


@_ref
def vec_dot_q4_0_q8_0_ref(n, x, y):
    """ggml_vec_dot_q4_0_q8_0_generic: element j = low nibble of qs[j] − 8, element j+16 = high
    nibble − 8; sumf += sumi*dx*dy (left to right)."""
    sumf = np.float32(0.0)
    for i in range(n // 32):
        xo, yo = i * Q4_0_SIZE, i * Q8_0_SIZE
        s0 = 0
        s1 = 0
        for j in range(16):
            q = _u8(x, xo + Q4_0_QS + j)
            s0 += ((q & 0xF) - 8) * _i8(y, yo + Q8_0_QS + j)
            s1 += ((q >> 4) - 8) * _i8(y, yo + Q8_0_QS + j + 16)
        sumf += np.float32(s0 + s1) * load_f16(x, xo) * load_f16(y, yo)
    return sumf


@_ref
def vec_dot_q4_1_q8_1_ref(n, x, y):
    """ggml_vec_dot_q4_1_q8_1_generic: block_q4_1 = d, m (fp16), qs[16]; x = d*q + m.
    sumf += (dx*dy)*sumi + mx*sy, where sy is the q8_1 block's stored d*Σq."""
    sumf = np.float32(0.0)
    for i in range(n // 32):
        xo, yo = i * Q4_1_SIZE, i * Q8_1_SIZE
        s0 = 0
        s1 = 0
        for j in range(16):
            q = _u8(x, xo + Q4_1_QS + j)
            s0 += (q & 0xF) * _i8(y, yo + Q8_1_QS + j)
            s1 += (q >> 4) * _i8(y, yo + Q8_1_QS + j + 16)
        sumf += ((load_f16(x, xo) * load_f16(y, yo)) * np.float32(s0 + s1)
                 + load_f16(x, xo + Q4_1_M) * load_f16(y, yo + Q8_1_S))
    return sumf


@_ref
def vec_dot_q5_0_q8_0_ref(n, x, y):
    """ggml_vec_dot_q5_0_q8_0_generic: block_q5_0 = d (fp16), qh (u32), qs[16]; 5-bit q − 16."""
    sumf = np.float32(0.0)
    for i in range(n // 32):
        xo, yo = i * Q5_0_SIZE, i * Q8_0_SIZE
        qh = _u32(x, xo + Q5_0_QH)
        s0 = 0
        s1 = 0
        for j in range(16):
            q = _u8(x, xo + Q5_0_QS + j)
            xh0 = np.int32(((qh >> j) << 4) & 0x10)
            xh1 = np.int32((qh >> (j + 12)) & 0x10)
            s0 += (((q & 0xF) | xh0) - 16) * _i8(y, yo + Q8_0_QS + j)
            s1 += (((q >> 4) | xh1) - 16) * _i8(y, yo + Q8_0_QS + j + 16)
        sumf += (load_f16(x, xo) * load_f16(y, yo)) * np.float32(s0 + s1)
    return sumf


@_ref
def vec_dot_q5_1_q8_1_ref(n, x, y):
    """ggml_vec_dot_q5_1_q8_1_generic: block_q5_1 = d, m (fp16), qh (u32), qs[16]."""
    sumf = np.float32(0.0)
    for i in range(n // 32):
        xo, yo = i * Q5_1_SIZE, i * Q8_1_SIZE
        qh = _u32(x, xo + Q5_1_QH)
        s0 = 0
        s1 = 0
        for j in range(16):
            q = _u8(x, xo + Q5_1_QS + j)
            xh0 = np.int32(((qh >> j) << 4) & 0x10)
            xh1 = np.int32((qh >> (j + 12)) & 0x10)
            s0 += ((q & 0xF) | xh0) * _i8(y, yo + Q8_1_QS + j)
            s1 += ((q >> 4) | xh1) * _i8(y, yo + Q8_1_QS + j + 16)
        sumf += ((load_f16(x, xo) * load_f16(y, yo)) * np.float32(s0 + s1)
                 + load_f16(x, xo + Q5_1_M) * load_f16(y, yo + Q8_1_S))
    return sumf


# ------------------------------------------------------------------------------------------------
# Q8_0 x Q8_0 and Q4_0 x Q8_0: 32-element blocks, signed x signed bytes
# ------------------------------------------------------------------------------------------------

@njit(inline="always")
def _q4_0_unpack(x, xb):
    """Q4_0's 16 bytes -> 32 signed quants: low nibbles are elements 0-15, high 16-31, minus 8."""
    raw = load_i8x16(x, xb + Q4_0_QS)
    m4 = simd.splat_i8x16(0xF)
    q = concat(vand(raw, m4), vand(vsrl(raw, 4), m4))
    return vsub(q, splat_i8x32(8))


@_fast
def dot_q8_0_q8_0(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_q8_0_q8_0: acc = fma(dx*dy, float(lanes), acc) per block."""
    acc = splat_f32x8(0.0)
    for i in range(n // 32):
        xb = i * Q8_0_SIZE
        yb = yo + i * Q8_0_SIZE
        d = _F16[load_u16(x, xb)] * _F16[load_u16(y, yb)]
        qx = load_i8x32(x, xb + Q8_0_QS)
        acc = fma(splat_f32x8(d), _q8_block_f32(vabs(qx), qx, load_i8x32(y, yb + Q8_0_QS)), acc)
    return hsum_f32x8(acc)


@_fast
def vec_dot_q8_0_q8_0(n, x, y):
    return dot_q8_0_q8_0(n, x, y, n - n)  # a non-literal 0: the matmul's specialization


@_fast
def dot_q4_0_q8_0(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_q4_0_q8_0."""
    acc = splat_f32x8(0.0)
    for i in range(n // 32):
        xb = i * Q4_0_SIZE
        yb = yo + i * Q8_0_SIZE
        d = _F16[load_u16(x, xb)] * _F16[load_u16(y, yb)]
        qx = _q4_0_unpack(x, xb)
        acc = fma(splat_f32x8(d), _q8_block_f32(vabs(qx), qx, load_i8x32(y, yb + Q8_0_QS)), acc)
    return hsum_f32x8(acc)


@_fast
def vec_dot_q4_0_q8_0(n, x, y):
    return dot_q4_0_q8_0(n, x, y, n - n)  # a non-literal 0: the matmul's specialization


@njit(inline="always")
def _q8_0_cols_4(x, xb0, xbs, y, yb0, ybs, ycs, nc, acc, q4):
    """4 consecutive weight blocks (Q8_0 or, with q4, Q4_0) against nc columns: the 4 weight
    blocks are unpacked once; each column's 8 float lanes are loaded and stored once."""
    if q4:
        x0 = _q4_0_unpack(x, xb0)
        x1 = _q4_0_unpack(x, xb0 + xbs)
        x2 = _q4_0_unpack(x, xb0 + 2 * xbs)
        x3 = _q4_0_unpack(x, xb0 + 3 * xbs)
    else:
        x0 = load_i8x32(x, xb0 + Q8_0_QS)
        x1 = load_i8x32(x, xb0 + xbs + Q8_0_QS)
        x2 = load_i8x32(x, xb0 + 2 * xbs + Q8_0_QS)
        x3 = load_i8x32(x, xb0 + 3 * xbs + Q8_0_QS)
    a0, a1, a2, a3 = vabs(x0), vabs(x1), vabs(x2), vabs(x3)
    d0 = _F16[load_u16(x, xb0)]
    d1 = _F16[load_u16(x, xb0 + xbs)]
    d2 = _F16[load_u16(x, xb0 + 2 * xbs)]
    d3 = _F16[load_u16(x, xb0 + 3 * xbs)]
    for c in range(nc):
        yb = yb0 + c * ycs
        a = load_f32x8(acc, 64 * c)
        a = fma(splat_f32x8(d0 * _F16[load_u16(y, yb)]), _q8_block_f32(a0, x0, load_i8x32(y, yb + Q8_0_QS)), a)
        yb += ybs
        a = fma(splat_f32x8(d1 * _F16[load_u16(y, yb)]), _q8_block_f32(a1, x1, load_i8x32(y, yb + Q8_0_QS)), a)
        yb += ybs
        a = fma(splat_f32x8(d2 * _F16[load_u16(y, yb)]), _q8_block_f32(a2, x2, load_i8x32(y, yb + Q8_0_QS)), a)
        yb += ybs
        a = fma(splat_f32x8(d3 * _F16[load_u16(y, yb)]), _q8_block_f32(a3, x3, load_i8x32(y, yb + Q8_0_QS)), a)
        store_f32x8(acc, 64 * c, a)


@njit(inline="always")
def _q8_0_cols_1(x, xb, y, yb0, ycs, nc, acc, q4):
    if q4:
        qx = _q4_0_unpack(x, xb)
    else:
        qx = load_i8x32(x, xb + Q8_0_QS)
    ax = vabs(qx)
    dx = _F16[load_u16(x, xb)]
    for c in range(nc):
        yb = yb0 + c * ycs
        a = fma(splat_f32x8(dx * _F16[load_u16(y, yb)]), _q8_block_f32(ax, qx, load_i8x32(y, yb + Q8_0_QS)),
                load_f32x8(acc, 64 * c))
        store_f32x8(acc, 64 * c, a)


@njit(inline="always")
def _q8_0_cols(n, x, y, yo, ycs, ybs, nc, acc, out, xbs, q4):
    _zero_cols(acc, nc, 1)
    nb = n // 32
    nb4 = nb - nb % 4
    for i in range(0, nb4, 4):
        _q8_0_cols_4(x, i * xbs, xbs, y, yo + i * ybs, ybs, ycs, nc, acc, q4)
    for i in range(nb4, nb):
        _q8_0_cols_1(x, i * xbs, y, yo + i * ybs, ycs, nc, acc, q4)
    _col_sums(acc, 64, -1, nc, out)


@_fast
def dot_cols_q8_0_q8_0(n, x, y, yo, ycs, ybs, nc, acc, out):
    _q8_0_cols(n, x, y, yo, ycs, ybs, nc, acc, out, Q8_0_SIZE, False)


@_fast
def dot_cols_q4_0_q8_0(n, x, y, yo, ycs, ybs, nc, acc, out):
    _q8_0_cols(n, x, y, yo, ycs, ybs, nc, acc, out, Q4_0_SIZE, True)


# ------------------------------------------------------------------------------------------------
# Q4_1 x Q8_1, Q5_0 x Q8_0, Q5_1 x Q8_1: 32-element blocks, GGML's AVX2 kernels lane for lane.
# Q4_1/Q5_1 quants are unsigned (x = d·q + m): an unsigned x signed product, and the min term
# m·s per block (s = the q8_1 block's d·Σq) summed apart, as GGML's ``summs``. Q5_0 quants are
# q − 16, signed, as Q4_0's. The fifth bit of element j is bit j of the block's 32-bit ``qh``.
# ------------------------------------------------------------------------------------------------

@njit(inline="always")
def _q5_high_bits(x, o):
    """The 32 bits of ``qh`` at byte ``o`` as 32 bytes: 0x10 where the bit is set."""
    return bits_to_bytes(load_u32(x, o), 0x10)


@njit(inline="always")
def _legacy_unpack(x, xb, kind):
    """One block's 32 quants: kind 0 = Q4_1 (0..15), 1 = Q5_0 (−16..15), 2 = Q5_1 (0..31)."""
    if kind == 0:
        return _nibbles(x, xb + Q4_1_QS)
    if kind == 1:
        return vsub(vor(_nibbles(x, xb + Q5_0_QS), _q5_high_bits(x, xb + Q5_0_QH)), splat_i8x32(16))
    return vor(_nibbles(x, xb + Q5_1_QS), _q5_high_bits(x, xb + Q5_1_QH))


@njit(inline="always")
def _legacy_block(x, xb, y, yb, kind, qx, acc, summs):
    """Block ``xb`` of x (already unpacked to ``qx``) against block ``yb`` of y: GGML's
    ``acc = fma(dx·dy, float(lanes), acc)`` and, with a min, ``summs += m·s`` (fused, as GCC
    compiles it)."""
    d = _F16[load_u16(x, xb)] * _F16[load_u16(y, yb)]
    if kind == 1:
        return fma(splat_f32x8(d), _q8_block_f32(vabs(qx), qx, load_i8x32(y, yb + Q8_0_QS)), acc), summs
    xm = Q4_1_M if kind == 0 else Q5_1_M
    summs = _fmaf(_F16[load_u16(x, xb + xm)], _F16[load_u16(y, yb + Q8_1_S)], summs)
    return fma(splat_f32x8(d), to_f32(dot4_acc(splat_i32x8(0), qx, load_i8x32(y, yb + Q8_1_QS))), acc), summs


@njit(inline="always")
def _legacy_dot(n, x, y, yo, kind, xbs, ybs):
    acc = splat_f32x8(0.0)
    summs = np.float32(0.0)
    for i in range(n // 32):
        xb = i * xbs
        acc, summs = _legacy_block(x, xb, y, yo + i * ybs, kind, _legacy_unpack(x, xb, kind), acc, summs)
    return hsum_f32x8(acc) + summs


@njit(inline="always")
def _legacy_cols_step(x, xb, xbs, y, yb, ybs, kind, q0, q1, q2, q3, nq, a, sm):
    """``nq`` (1 or 4) consecutive blocks of x, unpacked, against one column."""
    a, sm = _legacy_block(x, xb, y, yb, kind, q0, a, sm)
    if nq == 4:
        a, sm = _legacy_block(x, xb + xbs, y, yb + ybs, kind, q1, a, sm)
        a, sm = _legacy_block(x, xb + 2 * xbs, y, yb + 2 * ybs, kind, q2, a, sm)
        a, sm = _legacy_block(x, xb + 3 * xbs, y, yb + 3 * ybs, kind, q3, a, sm)
    return a, sm


@njit(inline="always")
def _legacy_cols(n, x, y, yo, ycs, ybs, nc, acc, out, kind, xbs):
    """dot_cols for the legacy types: 4 blocks unpacked at a time, then used for every column,
    whose 8 float lanes (bytes ``64c ..`` of ``acc``) and ``summs`` (``acc[16c + 8]``) are loaded
    and stored once per 4 blocks; per column the blocks are taken in order, as dot_* does."""
    zero = splat_f32x8(0.0)
    for c in range(nc):
        store_f32x8(acc, 4 * ACC_PER_COL * c, zero)
        acc[ACC_PER_COL * c + 8] = np.float32(0.0)
    nb = n // 32
    i = 0
    while i < nb:
        nq = 4 if i + 4 <= nb else 1
        xb = i * xbs
        q0 = _legacy_unpack(x, xb, kind)
        q1 = _legacy_unpack(x, xb + xbs, kind) if nq == 4 else q0
        q2 = _legacy_unpack(x, xb + 2 * xbs, kind) if nq == 4 else q0
        q3 = _legacy_unpack(x, xb + 3 * xbs, kind) if nq == 4 else q0
        for c in range(nc):
            a, sm = _legacy_cols_step(x, xb, xbs, y, yo + c * ycs + i * ybs, ybs, kind, q0, q1, q2, q3, nq,
                                      load_f32x8(acc, 4 * ACC_PER_COL * c), acc[ACC_PER_COL * c + 8])
            store_f32x8(acc, 4 * ACC_PER_COL * c, a)
            acc[ACC_PER_COL * c + 8] = sm
        i += nq
    for c in range(nc):
        out[c] = hsum_f32x8(load_f32x8(acc, 4 * ACC_PER_COL * c)) + acc[ACC_PER_COL * c + 8]


@_fast
def dot_q4_1_q8_1(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_q4_1_q8_1."""
    return _legacy_dot(n, x, y, yo, 0, Q4_1_SIZE, Q8_1_SIZE)


@_fast
def vec_dot_q4_1_q8_1(n, x, y):
    return dot_q4_1_q8_1(n, x, y, n - n)  # a non-literal 0: the matmul's specialization


@_fast
def dot_cols_q4_1_q8_1(n, x, y, yo, ycs, ybs, nc, acc, out):
    _legacy_cols(n, x, y, yo, ycs, ybs, nc, acc, out, 0, Q4_1_SIZE)


@_fast
def dot_q5_0_q8_0(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_q5_0_q8_0."""
    return _legacy_dot(n, x, y, yo, 1, Q5_0_SIZE, Q8_0_SIZE)


@_fast
def vec_dot_q5_0_q8_0(n, x, y):
    return dot_q5_0_q8_0(n, x, y, n - n)


@_fast
def dot_cols_q5_0_q8_0(n, x, y, yo, ycs, ybs, nc, acc, out):
    _legacy_cols(n, x, y, yo, ycs, ybs, nc, acc, out, 1, Q5_0_SIZE)


@_fast
def dot_q5_1_q8_1(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_q5_1_q8_1."""
    return _legacy_dot(n, x, y, yo, 2, Q5_1_SIZE, Q8_1_SIZE)


@_fast
def vec_dot_q5_1_q8_1(n, x, y):
    return dot_q5_1_q8_1(n, x, y, n - n)


@_fast
def dot_cols_q5_1_q8_1(n, x, y, yo, ycs, ybs, nc, acc, out):
    _legacy_cols(n, x, y, yo, ycs, ybs, nc, acc, out, 2, Q5_1_SIZE)


# the cache of every kernel above also depends on these files (lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, type_common.__file__, types.__file__, __file__)
