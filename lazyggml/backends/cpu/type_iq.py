"""GGML's IQ types on the CPU: IQ4_NL and IQ4_XS, 4-bit indices into one non-linear table of 16
levels (``types.KVALUES_IQ4NL``), with blocks of 32 values (IQ4_NL, Q8_0 activations) or
super-blocks of 256 with 6-bit sub-block scales (IQ4_XS, Q8_K activations). Their quantizers
(without an importance matrix, as ``ggml_quantize_chunk`` runs them), dequantizers and dot
products (``type_common.py`` says what each kind of kernel does).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ... import types
from ...cache import tie_cache
from ...types import KVALUES_IQ4NL, QK_K, Type, field_offset, type_size
from . import simd, type_common
from .simd import (dot4_acc, fma, hsum_f32x8, load_f32, load_f32x8, load_i8x16, load_i8x32, load_u16, lookup16,
                   madd, maddubs, splat_f32x8, splat_i32x8, store_f32x8, to_f32, vabs, vadd, vsign)
from .type_common import TABLE_F32_F16 as _F16
from .type_common import (ACC_PER_COL, GROUP_MAX_EPS, _f32, _fast, _fmaf, _i8, _kernel, _nibbles, _q8_block_f32,
                          _ref, _u8, load_f16, nearest_int, store_f16)

# block sizes, from the layout table (types.py): constants in the compiled kernels
Q8_0_SIZE = type_size(Type.Q8_0)
Q8_K_SIZE = type_size(Type.Q8_K)
IQ4_NL_SIZE = type_size(Type.IQ4_NL)
IQ4_XS_SIZE = type_size(Type.IQ4_XS)
# where the fields the kernels read start in a block, from the same table (every d is at byte 0)
IQ4_NL_QS = field_offset(Type.IQ4_NL, "qs")
IQ4_XS_SCALES_H = field_offset(Type.IQ4_XS, "scales_h")
IQ4_XS_SCALES_L = field_offset(Type.IQ4_XS, "scales_l")
IQ4_XS_QS = field_offset(Type.IQ4_XS, "qs")
Q8_0_QS = field_offset(Type.Q8_0, "qs")
Q8_K_QS = field_offset(Type.Q8_K, "qs")


# ----------------------------------------------------------------------------------------------
# IQ4_NL and IQ4_XS: 4-bit indices into one non-linear table of 16 levels (kvalues_iq4nl).
#   block_iq4_nl (18 B, 32 values): d fp16 @0, qs[16] @2 (element j in the low nibble of qs[j],
#     j+16 in the high one); x = d * KVALUES[index].
#   block_iq4_xs (136 B, 256 values): d fp16 @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8;
#     eight sub-blocks of 32, each with a 6-bit scale ls (low 4 bits: nibble ib%2 of
#     scales_l[ib/2]; high 2 bits: bits 2*ib of scales_h): x = d*(ls - 32) * KVALUES[index].
# ----------------------------------------------------------------------------------------------

IQ4_NTRY = 7   # scale candidates either side of the first guess (ggml_quantize_chunk's choice)


@_kernel
def _best_index_iq4(x):
    """The level of KVALUES_IQ4NL nearest to x (GGML's best_index_int8: a binary search, ties to
    the upper level)."""
    v = KVALUES_IQ4NL
    if x <= np.float32(v[0]):
        return 0
    if x >= np.float32(v[15]):
        return 15
    lo, hi = 0, 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < np.float32(v[mid]):
            hi = mid
        else:
            lo = mid
    return hi - 1 if x - np.float32(v[hi - 1]) < np.float32(v[hi]) - x else hi


@_kernel
def _iq4_sums(xb, w, id_, L):
    """Σ w·q·x and Σ w·q² with q the level nearest id_·x (levels written to L when given)."""
    sumqx = np.float32(0.0)
    sumq2 = np.float32(0.0)
    for j in range(32):
        l = _best_index_iq4(id_ * xb[j])
        if L is not None:
            L[j] = l
        q = np.float32(KVALUES_IQ4NL[l])
        sumqx += w[j] * q * xb[j]
        sumq2 += w[j] * q * q
    return sumqx, sumq2


@_kernel
def _iq4_block_scale(xb, w, L):
    """One block of 32: the scale that minimises Σ x²·(x − d·q)² over the first guess max/127 and
    the 2·IQ4_NTRY + 1 candidates (itry − 127)/max (GGML's quantize_row_iq4_nl_impl without an
    importance matrix; float32 throughout, unfused, in GGML's order). 0 for an all-zero block."""
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for j in range(32):
        w[j] = xb[j] * xb[j]
        ax = abs(xb[j])
        if ax > amax:
            amax = ax
            vmax = xb[j]
    if amax < GROUP_MAX_EPS:
        return np.float32(0.0)
    d = -vmax / np.float32(KVALUES_IQ4NL[0])
    sumqx, sumq2 = _iq4_sums(xb, w, np.float32(1.0) / d, L)
    d = sumqx / sumq2 if sumq2 > 0 else np.float32(0.0)
    best = d * sumqx
    for itry in range(-IQ4_NTRY, IQ4_NTRY + 1):
        id_ = np.float32(itry + KVALUES_IQ4NL[0]) / vmax
        sumqx, sumq2 = _iq4_sums(xb, w, id_, None)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@_kernel
def _iq4_pack(L, y, o, n):
    """Levels of n values (n/32 blocks) as nibbles at y[o:]: element j of a block low, j+16 high."""
    for i in range(n // 32):
        for j in range(16):
            y[o + 16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4)


@_kernel
def quantize_row_iq4_nl(x, y):
    w = np.empty(32, np.float32)
    L = np.empty(32, np.uint8)
    for i in range(x.shape[0] // 32):
        xb = x[32 * i:32 * (i + 1)]
        d = _iq4_block_scale(xb, w, L)
        store_f16(y, IQ4_NL_SIZE * i, d)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        for j in range(32):
            L[j] = _best_index_iq4(id_ * xb[j])
        _iq4_pack(L, y, IQ4_NL_SIZE * i + IQ4_NL_QS, 32)


@_kernel
def quantize_row_iq4_xs(x, y):
    """Per sub-block scales as IQ4_NL's, then one super-block scale d = −(the scale largest in
    magnitude)/32 and 6-bit sub-block scales l = nearest_int(scale/d), clamped to −32..31; the
    levels are chosen again for the rounded scales d·l."""
    w = np.empty(32, np.float32)
    L = np.empty(QK_K, np.uint8)
    scales = np.empty(8, np.float32)
    for i in range(x.shape[0] // QK_K):
        xs = x[QK_K * i:QK_K * (i + 1)]
        o = IQ4_XS_SIZE * i
        amax_scale = np.float32(0.0)
        max_scale = np.float32(0.0)
        for ib in range(8):
            scales[ib] = _iq4_block_scale(xs[32 * ib:32 * (ib + 1)], w, L[32 * ib:32 * (ib + 1)])
            if abs(scales[ib]) > amax_scale:
                amax_scale = abs(scales[ib])
                max_scale = scales[ib]
        d = -max_scale / np.float32(32.0)
        store_f16(y, o, d)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        sh = 0
        for k in range(4):
            y[o + IQ4_XS_SCALES_L + k] = 0
        for ib in range(8):
            l = min(31, max(-32, nearest_int(id_ * scales[ib])))
            dl = d * np.float32(l)
            idl = np.float32(1.0) / dl if dl != 0 else np.float32(0.0)
            for j in range(32):
                L[32 * ib + j] = _best_index_iq4(idl * xs[32 * ib + j])
            l += 32
            y[o + IQ4_XS_SCALES_L + ib // 2] |= (l & 0xF) << (4 * (ib % 2))
            sh |= (l >> 4) << (2 * ib)
        y[o + IQ4_XS_SCALES_H] = sh & 0xFF
        y[o + IQ4_XS_SCALES_H + 1] = sh >> 8
        _iq4_pack(L, y, o + IQ4_XS_QS, QK_K)


@_kernel
def dequantize_row_iq4_nl(x, y):
    for i in range(y.shape[0] // 32):
        d = load_f16(x, IQ4_NL_SIZE * i)
        for j in range(16):
            q = x[IQ4_NL_SIZE * i + IQ4_NL_QS + j]
            y[32 * i + j] = d * np.float32(KVALUES_IQ4NL[q & 0xF])
            y[32 * i + j + 16] = d * np.float32(KVALUES_IQ4NL[q >> 4])


@_kernel
def dequantize_row_iq4_xs(x, y):
    for i in range(y.shape[0] // QK_K):
        o = IQ4_XS_SIZE * i
        d = load_f16(x, o)
        sh = np.int64(x[o + IQ4_XS_SCALES_H]) | (np.int64(x[o + IQ4_XS_SCALES_H + 1]) << 8)
        for ib in range(8):
            ls = ((np.int64(x[o + IQ4_XS_SCALES_L + ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
            dl = d * np.float32(ls - 32)
            for j in range(16):
                q = x[o + IQ4_XS_QS + 16 * ib + j]
                y[QK_K * i + 32 * ib + j] = dl * np.float32(KVALUES_IQ4NL[q & 0xF])
                y[QK_K * i + 32 * ib + j + 16] = dl * np.float32(KVALUES_IQ4NL[q >> 4])


# =================================================================================================
# Reference kernels: GGML's *_generic, same integer lanes and float order, unfused
# =================================================================================================

@_ref
def vec_dot_iq4_nl_q8_0_ref(n, x, y):
    """ggml_vec_dot_iq4_nl_q8_0_generic: block_iq4_nl = d (fp16), qs[16] of level indices."""
    kv = KVALUES_IQ4NL
    sumf = np.float32(0.0)
    for i in range(n // 32):
        xo, yo = i * IQ4_NL_SIZE, i * Q8_0_SIZE
        s0 = 0
        s1 = 0
        for j in range(16):
            q = _u8(x, xo + IQ4_NL_QS + j)
            s0 += _i8(y, yo + Q8_0_QS + j) * kv[q & 0xF]
            s1 += _i8(y, yo + Q8_0_QS + j + 16) * kv[q >> 4]
        sumf += (load_f16(y, yo) * load_f16(x, xo)) * np.float32(s0 + s1)
    return sumf


@_ref
def vec_dot_iq4_xs_q8_K_ref(n, x, y):
    """ggml_vec_dot_iq4_xs_q8_K_generic: per super-block d·d8, then per sub-block of 32 its 6-bit
    scale ls − 32 (low nibble from scales_l, high bits from scales_h)."""
    kv = KVALUES_IQ4NL
    sumf = np.float32(0.0)
    for i in range(n // QK_K):
        xo, yo = i * IQ4_XS_SIZE, i * Q8_K_SIZE
        d4d8 = load_f16(x, xo) * _f32(y, yo)
        h = np.int64(_u8(x, xo + IQ4_XS_SCALES_H)) | (np.int64(_u8(x, xo + IQ4_XS_SCALES_H + 1)) << 8)
        for ib in range(8):
            ls = ((_u8(x, xo + IQ4_XS_SCALES_L + ib // 2) >> (4 * (ib % 2))) & 0xF) | (((h >> (2 * ib)) & 3) << 4)
            s0 = 0
            s1 = 0
            for j in range(16):
                q = _u8(x, xo + IQ4_XS_QS + 16 * ib + j)
                s0 += _i8(y, yo + Q8_K_QS + 32 * ib + j) * kv[q & 0xF]
                s1 += _i8(y, yo + Q8_K_QS + 32 * ib + j + 16) * kv[q >> 4]
            sumf += (d4d8 * np.float32(ls - 32)) * np.float32(s0 + s1)
    return sumf


# ------------------------------------------------------------------------------------------------
# IQ4_NL x Q8_0 and IQ4_XS x Q8_K: GGML's AVX2 kernels. The 4-bit indices become their levels by
# a byte shuffle of the 16-entry table (``lookup16``), then a signed x signed product
# (|q| x sign(y, q)). IQ4_NL keeps two float accumulators, even and odd blocks, and finishes a last
# odd block in scalar code; IQ4_XS weights each sub-block's int16 pair sums by its scale.
# ------------------------------------------------------------------------------------------------
_KV = KVALUES_IQ4NL


@njit(inline="always")
def _iq4_levels(x, o):
    """The 32 levels of the 16 index bytes at ``o``: low nibbles are elements 0-15, high 16-31."""
    return lookup16(load_i8x16(_KV, 0), _nibbles(x, o))


@njit(inline="always")
def _iq4_nl_block(x, xb, y, yb, acc):
    d = _F16[load_u16(y, yb)] * _F16[load_u16(x, xb)]
    q = _iq4_levels(x, xb + IQ4_NL_QS)
    return fma(splat_f32x8(d), _q8_block_f32(vabs(q), q, load_i8x32(y, yb + Q8_0_QS)), acc)


@njit(inline="always")
def _iq4_nl_dot(n, x, y, yo, ybs):
    acc1 = splat_f32x8(0.0)
    acc2 = splat_f32x8(0.0)
    nb = n // 32
    ib = 0
    while ib + 1 < nb:
        acc1 = _iq4_nl_block(x, ib * IQ4_NL_SIZE, y, yo + ib * ybs, acc1)
        acc2 = _iq4_nl_block(x, (ib + 1) * IQ4_NL_SIZE, y, yo + (ib + 1) * ybs, acc2)
        ib += 2
    sumf = hsum_f32x8(vadd(acc1, acc2))
    if ib < nb:       # GGML's scalar tail: sumf += d·Σ, fused as GCC compiles it
        xb, yb = ib * IQ4_NL_SIZE, yo + ib * ybs
        q = _iq4_levels(x, xb + IQ4_NL_QS)
        sumi = simd.hsum_i32(dot4_acc(splat_i32x8(0), vabs(q), vsign(load_i8x32(y, yb + Q8_0_QS), q)))
        sumf = _fmaf(_F16[load_u16(y, yb)] * _F16[load_u16(x, xb)], np.float32(sumi), sumf)
    return sumf


@njit(inline="always")
def _iq4_xs_dot(n, x, y, yo, ybs):
    acc = splat_f32x8(0.0)
    for i in range(n // QK_K):
        xb = i * IQ4_XS_SIZE
        yb = yo + i * ybs
        acc = fma(splat_f32x8(_F16[load_u16(x, xb)] * load_f32(y, yb)), to_f32(_iq4_xs_sumi(x, xb, y, yb)), acc)
    return hsum_f32x8(acc)


@njit(inline="always")
def _iq4_xs_sumi(x, xb, y, yb):
    """The IQ4_XS block at x[xb] against the Q8_K block at y[yb]: Σ_s (ls_s − 32) · Σ level·q8 as 8
    int32 lanes, two chains (even and odd sub-blocks) as GGML's."""
    sh = np.int32(load_u16(x, xb + IQ4_XS_SCALES_H))
    s1 = splat_i32x8(0)
    s2 = splat_i32x8(0)
    for ib in range(0, 8, 2):
        q1 = _iq4_levels(x, xb + IQ4_XS_QS + 16 * ib)
        q2 = _iq4_levels(x, xb + IQ4_XS_QS + 16 + 16 * ib)
        p1 = maddubs(vabs(q1), vsign(load_i8x32(y, yb + Q8_K_QS + 32 * ib), q1))
        p2 = maddubs(vabs(q2), vsign(load_i8x32(y, yb + Q8_K_QS + 32 + 32 * ib), q2))
        sl = np.int32(x[xb + IQ4_XS_SCALES_L + ib // 2])
        ls1 = ((sl & 0xF) | ((sh << 4) & 0x30)) - 32
        ls2 = ((sl >> 4) | ((sh << 2) & 0x30)) - 32
        sh >>= 4
        s1 = vadd(madd(p1, simd.splat_i16x16(ls1)), s1)
        s2 = vadd(madd(p2, simd.splat_i16x16(ls2)), s2)
    return vadd(s1, s2)


@_fast
def dot_iq4_nl_q8_0(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_iq4_nl_q8_0."""
    return _iq4_nl_dot(n, x, y, yo, Q8_0_SIZE)


@_fast
def vec_dot_iq4_nl_q8_0(n, x, y):
    return dot_iq4_nl_q8_0(n, x, y, n - n)  # a non-literal 0: the matmul's specialization


@_fast
def dot_cols_iq4_nl_q8_0(n, x, y, yo, ycs, ybs, nc, acc, out):
    """Each pair of blocks unpacked once for all columns; a column's even and odd accumulators wait
    in ``acc`` (bytes ``64c ..`` and ``64c + 32 ..``); then dot_iq4_nl_q8_0's sum and scalar tail."""
    zero = splat_f32x8(0.0)
    for c in range(nc):
        store_f32x8(acc, 4 * ACC_PER_COL * c, zero)
        store_f32x8(acc, 4 * ACC_PER_COL * c + 32, zero)
    nb = n // 32
    ib = 0
    while ib + 1 < nb:
        xb0, xb1 = ib * IQ4_NL_SIZE, (ib + 1) * IQ4_NL_SIZE
        q0, q1 = _iq4_levels(x, xb0 + IQ4_NL_QS), _iq4_levels(x, xb1 + IQ4_NL_QS)
        a0, a1 = vabs(q0), vabs(q1)
        d0, d1 = _F16[load_u16(x, xb0)], _F16[load_u16(x, xb1)]
        for c in range(nc):
            yb = yo + c * ycs + ib * ybs
            o = 4 * ACC_PER_COL * c
            store_f32x8(acc, o, fma(splat_f32x8(_F16[load_u16(y, yb)] * d0),
                                    _q8_block_f32(a0, q0, load_i8x32(y, yb + Q8_0_QS)), load_f32x8(acc, o)))
            store_f32x8(acc, o + 32, fma(splat_f32x8(_F16[load_u16(y, yb + ybs)] * d1),
                                         _q8_block_f32(a1, q1, load_i8x32(y, yb + ybs + Q8_0_QS)),
                                         load_f32x8(acc, o + 32)))
        ib += 2
    for c in range(nc):
        o = 4 * ACC_PER_COL * c
        sumf = hsum_f32x8(vadd(load_f32x8(acc, o), load_f32x8(acc, o + 32)))
        if ib < nb:
            xb, yb = ib * IQ4_NL_SIZE, yo + c * ycs + ib * ybs
            q = _iq4_levels(x, xb + IQ4_NL_QS)
            sumi = simd.hsum_i32(dot4_acc(splat_i32x8(0), vabs(q), vsign(load_i8x32(y, yb + Q8_0_QS), q)))
            sumf = _fmaf(_F16[load_u16(y, yb)] * _F16[load_u16(x, xb)], np.float32(sumi), sumf)
        out[c] = sumf


@_fast
def dot_iq4_xs_q8_K(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_iq4_xs_q8_K."""
    return _iq4_xs_dot(n, x, y, yo, Q8_K_SIZE)


@_fast
def vec_dot_iq4_xs_q8_K(n, x, y):
    return dot_iq4_xs_q8_K(n, x, y, n - n)


@_fast
def dot_cols_iq4_xs_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    """One dot product per column, each as dot_iq4_xs_q8_K's (the weight blocks are unpacked per
    column: its prefill already beats GGML's, 1.4x)."""
    for c in range(nc):
        out[c] = _iq4_xs_dot(n, x, y, yo + c * ycs, ybs)


# the cache of every kernel above also depends on these files (lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, type_common.__file__, types.__file__, __file__)
