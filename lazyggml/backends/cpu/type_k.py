"""GGML's K-quants on the CPU: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and Q8_K, their activation format;
super-blocks of ``QK_K`` = 256 values in 8 or 16 sub-blocks, each with its own scale (and min),
the scales themselves quantized against the super-block's fp16 ``d`` (and ``dmin``). Their
quantizers (GGML's least-squares fits: ``make_qkx2_quants``, ``make_qx_quants``,
``make_q3_quants``), dequantizers and dot products with Q8_K activations (``type_common.py`` says
what each kind of kernel does).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ... import types
from ...cache import tie_cache
from ...types import QK_K, Type, field_offset, type_size
from . import simd, type_common
from .simd import (bcast_half, bcast_pair, concat, crumb, fma, hadd_pairs, hi_half, hsum_f32x4, hsum_f32x8,
                   hsum_f32x8_cols, lane, lo_half, load_f32, load_f32x16, load_f32x8, load_i16x16, load_i8x16,
                   load_i8x32, load_u16, load_u32, madd, madd_acc, maddubs, pick16, sext, splat_f32x16,
                   splat_f32x4, splat_f32x8, splat_i8x32, store_f32x16, store_f32x8, store_i16x16, to_f32,
                   transpose_pairs, u32x4_to_i8x16, vadd, vand, vmul, vor, vsll, vsrl, vsub, widen_as, zext)
from .type_common import TABLE_F32_F16 as _F16
from .type_common import (ACC_PER_COL, GROUP_MAX_EPS, K4_TABLE_BYTES, _col_sums, _f32, _fast, _fmaf, _i16, _i8,
                          _kernel, _ref, _rows2, _signed_absmax, _store_u32, _u32, _u8, _wrap_i8, _zero_cols,
                          load_f16, nearest_int, store_f16)

# block sizes, from the layout table (types.py): constants in the compiled kernels
Q2_K_SIZE = type_size(Type.Q2_K)
Q3_K_SIZE = type_size(Type.Q3_K)
Q4_K_SIZE = type_size(Type.Q4_K)
Q5_K_SIZE = type_size(Type.Q5_K)
Q6_K_SIZE = type_size(Type.Q6_K)
Q8_K_SIZE = type_size(Type.Q8_K)
# where the fields the kernels read start in a block, from the same table (Q4_K's, Q5_K's and Q8_K's
# d are at byte 0; Q2_K, Q3_K and Q6_K keep theirs at the end)
Q2_K_SCALES = field_offset(Type.Q2_K, "scales")
Q2_K_QS = field_offset(Type.Q2_K, "qs")
Q2_K_D = field_offset(Type.Q2_K, "d")
Q2_K_DMIN = field_offset(Type.Q2_K, "dmin")
Q3_K_HMASK = field_offset(Type.Q3_K, "hmask")
Q3_K_QS = field_offset(Type.Q3_K, "qs")
Q3_K_SCALES = field_offset(Type.Q3_K, "scales")
Q3_K_D = field_offset(Type.Q3_K, "d")
Q4_K_DMIN = field_offset(Type.Q4_K, "dmin")
Q4_K_SCALES = field_offset(Type.Q4_K, "scales")
Q4_K_QS = field_offset(Type.Q4_K, "qs")
Q5_K_DMIN = field_offset(Type.Q5_K, "dmin")
Q5_K_SCALES = field_offset(Type.Q5_K, "scales")
Q5_K_QH = field_offset(Type.Q5_K, "qh")
Q5_K_QS = field_offset(Type.Q5_K, "qs")
Q6_K_QL = field_offset(Type.Q6_K, "ql")
Q6_K_QH = field_offset(Type.Q6_K, "qh")
Q6_K_SCALES = field_offset(Type.Q6_K, "scales")
Q6_K_D = field_offset(Type.Q6_K, "d")
Q8_K_QS = field_offset(Type.Q8_K, "qs")
Q8_K_BSUMS = field_offset(Type.Q8_K, "bsums")
# the 12 bytes of packed 6-bit scales (and mins) of Q3_K, Q4_K and Q5_K: GGML's K_SCALE_SIZE
K_SCALE_SIZE = Q4_K_QS - Q4_K_SCALES
# Q4_K and Q5_K share their head (d, dmin, scales), so the code for both reads Q4_K's offsets
assert (Q5_K_DMIN, Q5_K_SCALES) == (Q4_K_DMIN, Q4_K_SCALES)


@_kernel
def make_qkx2_quants(nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """Fit x ~ scale*L + min (L in 0..nmax, min <= 0) by weighted least squares over a grid of
    nstep+1 trial inverse scales (rmin + rdelta*is + nmax)/(max - min); keep the best by weighted
    squared (or, with use_mad, absolute) error. Writes L, returns (scale, the_min = -min).
    Used by q2_K (n=16), q4_K and q5_K (n=32). Every caller has nstep >= 1."""
    n = x.shape[0]
    vmin = x[0]
    vmax = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < vmin:
            vmin = x[i]
        if x[i] > vmax:
            vmax = x[i]
        w = weights[i]
        sum_w += w
        sum_x += w * x[i]
    if vmin > 0:
        vmin = np.float32(0.0)
    if vmax == vmin:
        L.fill(0)
        return np.float32(0.0), -vmin
    fnmax = np.float32(nmax)
    iscale = fnmax / (vmax - vmin)
    scale = np.float32(1.0) / iscale
    best_error = np.float32(0.0)
    for i in range(n):
        l = max(0, min(nmax, nearest_int(iscale * (x[i] - vmin))))
        L[i] = l
        diff = scale * np.float32(l) + vmin - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += weights[i] * diff
    for is_ in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(is_) + fnmax) / (vmax - vmin)
        sum_l = np.float32(0.0)
        sum_l2 = np.float32(0.0)
        sum_xl = np.float32(0.0)
        for i in range(n):
            l = max(0, min(nmax, nearest_int(iscale * (x[i] - vmin))))
            Laux[i] = l
            wl = weights[i] * np.float32(l)
            sum_l += wl
            sum_l2 += wl * np.float32(l)
            sum_xl += wl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = np.float32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = np.float32(0.0)
            for i in range(n):
                diff = this_scale * np.float32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                vmin = this_min
    return scale, -vmin


@_kernel
def make_qx_quants(nmax, x, L):
    """Symmetric fit x ~ scale*(L - nmax), L - nmax in -nmax..nmax-1, weights x^2 (GGML's
    make_qx_quants with rmse_type=1 and no quant weights, the only form the q6_K reference uses).
    Starts from iscale = -nmax/max and tries 18 nearby iscales, keeping the least-squares scale
    with the largest sumlx^2/suml2. Writes L (0..2*nmax-1), returns scale."""
    n = x.shape[0]
    amax, vmax = _signed_absmax(x)
    if amax < GROUP_MAX_EPS:
        L.fill(0)
        return np.float32(0.0)
    fnmax = np.float32(nmax)
    iscale = -fnmax / vmax
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l + nmax
        w = x[i] * x[i]
        sumlx += w * x[i] * np.float32(l)
        suml2 += w * np.float32(l) * np.float32(l)
    scale = sumlx / suml2 if suml2 != 0 else np.float32(0.0)
    best = scale * sumlx
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = -(fnmax + np.float32(0.1) * np.float32(is_)) / vmax
        sumlx = np.float32(0.0)
        suml2 = np.float32(0.0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            w = x[i] * x[i]
            sumlx += w * x[i] * np.float32(l)
            suml2 += w * np.float32(l) * np.float32(l)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@_kernel
def make_q3_quants(nmax, x, L):
    """Symmetric fit for q3_K (do_rmse form): start from iscale = -nmax/max, then up to 5 greedy
    passes that move single L values when that raises sumlx^2/suml2 (weights x^2).
    Writes L (0..2*nmax-1; all 0 for an all-zero group), returns scale."""
    n = x.shape[0]
    amax, vmax = _signed_absmax(x)
    if amax < GROUP_MAX_EPS:
        L.fill(0)
        return np.float32(0.0)
    iscale = -np.float32(nmax) / vmax
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l
        w = x[i] * x[i]
        sumlx += w * x[i] * np.float32(l)
        suml2 += w * np.float32(l) * np.float32(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            li = np.float32(L[i])
            slx = sumlx - w * x[i] * li
            if slx > 0:
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, nearest_int(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    slx += w * x[i] * np.float32(new_l)
                    sl2 += w * np.float32(new_l) * np.float32(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else np.float32(0.0)


@_kernel
def get_scale_min_k4(j, q):
    """Sub-block j's 6-bit (scale, min) from the 12 packed bytes q of q4_K/q5_K (docs/quant-formats.md §2):
    bytes 0-3 / 4-7 hold sc0..3 / m0..3 in bits 0-5 and the top 2 bits of sc4..7 / m4..7 in
    bits 6-7; bytes 8-11 hold the low 4 bits of sc4..7 (low nibble) and m4..7 (high nibble)."""
    if j < 4:
        return np.int64(q[j] & 63), np.int64(q[j + 4] & 63)
    return (np.int64((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)),
            np.int64((q[j + 4] >> 4) | ((q[j] >> 6) << 4)))


@_kernel
def _quantize_superblock_k4(xb, yb, nmax, rmin, rdelta, nstep, L, Laux, weights, scales, mins):
    """Everything q4_K and q5_K share (docs/quant-formats.md §4.2): per 32-element sub-block an affine fit by
    make_qkx2_quants with weights av_x + |x|; the 8 scales and 8 mins quantized to 6 bits against
    their maxima and packed into yb[4:16]; d, dmin as fp16 at yb[0:4]; then every level
    recomputed with the rounded scales. Leaves the final levels (0..nmax) in L."""
    max_scale = np.float32(0.0)
    max_min = np.float32(0.0)
    for j in range(QK_K // 32):
        xs = xb[32 * j:32 * j + 32]
        sum_x2 = np.float32(0.0)
        for l in range(32):
            sum_x2 += xs[l] * xs[l]
        av_x = np.sqrt(sum_x2 / np.float32(32.0))
        for l in range(32):
            weights[l] = av_x + abs(xs[l])
        scales[j], mins[j] = make_qkx2_quants(nmax, xs, weights, L[32 * j:32 * j + 32], Laux,
                                              rmin, rdelta, nstep, np.bool_(False))
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]

    inv_scale = np.float32(63.0) / max_scale if max_scale > 0 else np.float32(0.0)
    inv_min = np.float32(63.0) / max_min if max_min > 0 else np.float32(0.0)
    q = yb[Q4_K_SCALES:Q4_K_SCALES + K_SCALE_SIZE]
    for j in range(QK_K // 32):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)   # C stores to uint8 first
        lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        if j < 4:
            q[j] = ls
            q[j + 4] = lm
        else:
            q[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            q[j - 4] |= (ls >> 4) << 6
            q[j] |= (lm >> 4) << 6
    store_f16(yb, 0, max_scale / np.float32(63.0))
    store_f16(yb, Q4_K_DMIN, max_min / np.float32(63.0))

    d_all = load_f16(yb, 0)
    dmin_all = load_f16(yb, Q4_K_DMIN)
    for j in range(QK_K // 32):
        sc, m = get_scale_min_k4(j, q)
        d = d_all * np.float32(sc)
        if d == 0:
            continue                      # keep make_qkx2_quants' levels
        dm = dmin_all * np.float32(m)
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int((xb[32 * j + ii] + dm) / d)))


@_kernel
def _pack_2bit_128(L, qs):
    """Four 2-bit levels per byte: for each 128 elements, byte l holds elements l, l+32, l+64,
    l+96 in bits 0-1, 2-3, 4-5, 6-7 (q2_K and q3_K qs)."""
    for j in range(0, QK_K, 128):
        for l in range(32):
            qs[j // 4 + l] = (L[j + l] | (L[j + l + 32] << 2)
                              | (L[j + l + 64] << 4) | (L[j + l + 96] << 6))


# ----------------------------------------------------------------------------------------------
# q2_K: 16 sub-blocks of 16, x = d*sc*q - dmin*m with 4-bit sc, m and 2-bit q
#   block_q2_K (84 B): scales[16] @0 (sc low nibble, m high nibble), qs[64] @16, d @80, dmin @82
# ----------------------------------------------------------------------------------------------

@_kernel
def quantize_row_q2_K(x, y):
    L = np.empty(QK_K, np.uint8)
    Laux = np.empty(16, np.uint8)
    weights = np.empty(16, np.float32)
    scales = np.empty(QK_K // 16, np.float32)
    mins = np.empty(QK_K // 16, np.float32)
    q4scale = np.float32(15.0)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K:(i + 1) * QK_K]
        yb = y[i * Q2_K_SIZE:(i + 1) * Q2_K_SIZE]
        max_scale = np.float32(0.0)
        max_min = np.float32(0.0)
        for j in range(QK_K // 16):
            xs = xb[16 * j:16 * j + 16]
            for l in range(16):
                weights[l] = abs(xs[l])
            scales[j], mins[j] = make_qkx2_quants(np.int64(3), xs, weights, L[16 * j:16 * j + 16],
                                                  Laux, np.float32(-0.5), np.float32(0.1),
                                                  np.int64(15), np.bool_(True))
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]

        sm = yb[Q2_K_SCALES:Q2_K_SCALES + QK_K // 16]   # per sub-block: scale (low nibble), min (high)
        if max_scale > 0:
            iscale = q4scale / max_scale
            for j in range(QK_K // 16):
                sm[j] = nearest_int(iscale * scales[j]) & 0xFF
            store_f16(yb, Q2_K_D, max_scale / q4scale)
        else:
            for j in range(QK_K // 16):
                sm[j] = 0
            store_f16(yb, Q2_K_D, np.float32(0.0))
        if max_min > 0:
            iscale = q4scale / max_min
            for j in range(QK_K // 16):
                sm[j] = (sm[j] | (nearest_int(iscale * mins[j]) << 4)) & 0xFF
            store_f16(yb, Q2_K_DMIN, max_min / q4scale)
        else:
            store_f16(yb, Q2_K_DMIN, np.float32(0.0))

        d_all = load_f16(yb, Q2_K_D)
        dmin_all = load_f16(yb, Q2_K_DMIN)
        for j in range(QK_K // 16):
            d = d_all * np.float32(sm[j] & 0xF)
            if d == 0:
                continue
            dm = dmin_all * np.float32(sm[j] >> 4)
            for ii in range(16):
                L[16 * j + ii] = max(0, min(3, nearest_int((xb[16 * j + ii] + dm) / d)))

        _pack_2bit_128(L, yb[Q2_K_QS:Q2_K_QS + 64])


@_kernel
def dequantize_row_q2_K(x, y):
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q2_K_SIZE:(i + 1) * Q2_K_SIZE]
        d = load_f16(xb, Q2_K_D)
        dmin = load_f16(xb, Q2_K_DMIN)
        for e in range(QK_K):
            n, r = divmod(e, 128)          # 128-element half, element inside it
            shift = 2 * (r // 32)
            sc = xb[Q2_K_SCALES + 8 * n + r // 16]   # one scale byte per 16 elements
            q = (xb[Q2_K_QS + 32 * n + (r % 32)] >> shift) & 3
            dl = d * np.float32(sc & 0xF)
            ml = dmin * np.float32(sc >> 4)
            y[i * QK_K + e] = dl * np.float32(q) - ml


# ----------------------------------------------------------------------------------------------
# q3_K: 16 sub-blocks of 16, symmetric, x = d*(sc-32)*(q-4) with 6-bit sc and 3-bit q
#   block_q3_K (110 B): hmask[32] @0 (bit 2 of q: element e -> byte e%32, bit e//32),
#   qs[64] @32 (low 2 bits, as q2_K), scales[12] @96 (low nibbles of sc0..7 in bytes 0-7, of
#   sc8..15 in their high nibbles; bits 4-5 of sc j in byte 8+j%4 at bit 2*(j//4)), d @108
# ----------------------------------------------------------------------------------------------

@_kernel
def _scale_q3_K(j, s):
    """6-bit scale j (0..15) of a q3_K block from its 12 scale bytes s, minus 32."""
    lo = np.int64(s[j] & 0xF) if j < 8 else np.int64(s[j - 8] >> 4)
    hi = np.int64(s[8 + j % 4] >> (2 * (j // 4))) & 3
    return (lo | (hi << 4)) - 32


@_kernel
def quantize_row_q3_K(x, y):
    L = np.empty(QK_K, np.int8)
    scales = np.empty(QK_K // 16, np.float32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K:(i + 1) * QK_K]
        yb = y[i * Q3_K_SIZE:(i + 1) * Q3_K_SIZE]
        amax = np.float32(0.0)
        max_scale = np.float32(0.0)
        for j in range(QK_K // 16):
            scales[j] = make_q3_quants(4, xb[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
            if abs(scales[j]) > amax:
                amax = abs(scales[j])
                max_scale = scales[j]

        s = yb[Q3_K_SCALES:Q3_K_SCALES + K_SCALE_SIZE]
        s.fill(0)
        if max_scale != 0:
            iscale = np.float32(-32.0) / max_scale
            for j in range(QK_K // 16):
                l = max(-32, min(31, _wrap_i8(nearest_int(iscale * scales[j])))) + 32
                if j < 8:
                    s[j] = l & 0xF
                else:
                    s[j - 8] |= (l & 0xF) << 4
                s[j % 4 + 8] |= (l >> 4) << (2 * (j // 4))
            store_f16(yb, Q3_K_D, np.float32(1.0) / iscale)
        else:
            store_f16(yb, Q3_K_D, np.float32(0.0))

        d_all = load_f16(yb, Q3_K_D)
        for j in range(QK_K // 16):
            d = d_all * np.float32(_scale_q3_K(j, s))
            if d == 0:
                continue
            for ii in range(16):
                L[16 * j + ii] = max(-4, min(3, nearest_int(xb[16 * j + ii] / d))) + 4

        hmask = yb[Q3_K_HMASK:Q3_K_HMASK + 32]
        hmask.fill(0)
        for j in range(QK_K):
            if L[j] > 3:
                hmask[j % 32] |= 1 << (j // 32)
                L[j] -= 4
        _pack_2bit_128(L, yb[Q3_K_QS:Q3_K_QS + 64])


@_kernel
def dequantize_row_q3_K(x, y):
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q3_K_SIZE:(i + 1) * Q3_K_SIZE]
        d_all = load_f16(xb, Q3_K_D)
        s = xb[Q3_K_SCALES:Q3_K_SCALES + K_SCALE_SIZE]
        for e in range(QK_K):
            n, r = divmod(e, 128)
            shift = 2 * (r // 32)
            q = np.int64((xb[Q3_K_QS + 32 * n + (r % 32)] >> shift) & 3)
            if not (xb[Q3_K_HMASK + e % 32] >> (e // 32)) & 1:
                q -= 4
            dl = d_all * np.float32(_scale_q3_K(8 * n + r // 16, s))
            y[i * QK_K + e] = dl * np.float32(q)


# ----------------------------------------------------------------------------------------------
# q4_K / q5_K: 8 sub-blocks of 32, x = d*sc*q - dmin*m with 6-bit sc, m (get_scale_min_k4)
#   block_q4_K (144 B): d @0, dmin @2, scales[12] @4, qs[128] @16
#   block_q5_K (176 B): d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48
#   qs: for each 64 elements, byte l holds element l (low nibble) and l+32 (high nibble);
#   q5_K's bit 4 of element e is bit e//32 of qh[e%32].
# ----------------------------------------------------------------------------------------------

@_kernel
def quantize_row_q4_K(x, y):
    """quantize_row_q4_K_ref (docs/quant-formats.md §4.2)."""
    L = np.empty(QK_K, np.uint8)
    Laux = np.empty(32, np.uint8)
    weights = np.empty(32, np.float32)
    scales = np.empty(QK_K // 32, np.float32)
    mins = np.empty(QK_K // 32, np.float32)
    for i in range(x.shape[0] // QK_K):
        yb = y[i * Q4_K_SIZE:(i + 1) * Q4_K_SIZE]
        _quantize_superblock_k4(x[i * QK_K:(i + 1) * QK_K], yb, np.int64(15), np.float32(-1.0),
                                np.float32(0.1), np.int64(20), L, Laux, weights, scales, mins)
        for j in range(0, QK_K, 64):
            for l in range(32):
                yb[Q4_K_QS + j // 2 + l] = L[j + l] | (L[j + l + 32] << 4)


@_kernel
def dequantize_row_q4_K(x, y):
    """dequantize_row_q4_K (docs/quant-formats.md §3): y = (d*sc)*q - dmin*m, each product rounded."""
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q4_K_SIZE:(i + 1) * Q4_K_SIZE]
        d = load_f16(xb, 0)
        dmin = load_f16(xb, Q4_K_DMIN)
        q = xb[Q4_K_SCALES:Q4_K_SCALES + K_SCALE_SIZE]
        for c in range(4):                 # 64 elements = sub-blocks 2c (low nibbles), 2c+1
            sc, m = get_scale_min_k4(2 * c, q)
            d1 = d * np.float32(sc)
            m1 = dmin * np.float32(m)
            sc, m = get_scale_min_k4(2 * c + 1, q)
            d2 = d * np.float32(sc)
            m2 = dmin * np.float32(m)
            o = i * QK_K + 64 * c
            for l in range(32):
                b = xb[Q4_K_QS + 32 * c + l]
                y[o + l] = d1 * np.float32(b & 0xF) - m1
                y[o + 32 + l] = d2 * np.float32(b >> 4) - m2


@_kernel
def quantize_row_q5_K(x, y):
    """quantize_row_q5_K_ref: q4_K's algorithm with 32 levels and search (-0.5, 0.1, 15)."""
    L = np.empty(QK_K, np.uint8)
    Laux = np.empty(32, np.uint8)
    weights = np.empty(32, np.float32)
    scales = np.empty(QK_K // 32, np.float32)
    mins = np.empty(QK_K // 32, np.float32)
    for i in range(x.shape[0] // QK_K):
        yb = y[i * Q5_K_SIZE:(i + 1) * Q5_K_SIZE]
        _quantize_superblock_k4(x[i * QK_K:(i + 1) * QK_K], yb, np.int64(31), np.float32(-0.5),
                                np.float32(0.1), np.int64(15), L, Laux, weights, scales, mins)
        qh = yb[Q5_K_QH:Q5_K_QH + 32]
        qh.fill(0)
        for j in range(0, QK_K, 64):
            for l in range(32):
                l1 = L[j + l]
                l2 = L[j + l + 32]
                qh[l] |= ((l1 >> 4) << (j // 32)) | ((l2 >> 4) << (j // 32 + 1))
                yb[Q5_K_QS + j // 2 + l] = (l1 & 0xF) | ((l2 & 0xF) << 4)


@_kernel
def dequantize_row_q5_K(x, y):
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q5_K_SIZE:(i + 1) * Q5_K_SIZE]
        d = load_f16(xb, 0)
        dmin = load_f16(xb, Q5_K_DMIN)
        q = xb[Q5_K_SCALES:Q5_K_SCALES + K_SCALE_SIZE]
        for c in range(4):
            sc, m = get_scale_min_k4(2 * c, q)
            d1 = d * np.float32(sc)
            m1 = dmin * np.float32(m)
            sc, m = get_scale_min_k4(2 * c + 1, q)
            d2 = d * np.float32(sc)
            m2 = dmin * np.float32(m)
            o = i * QK_K + 64 * c
            for l in range(32):
                b = xb[Q5_K_QS + 32 * c + l]
                h = xb[Q5_K_QH + l] >> (2 * c)
                y[o + l] = d1 * np.float32((b & 0xF) + ((h & 1) << 4)) - m1
                y[o + 32 + l] = d2 * np.float32((b >> 4) + ((h & 2) << 3)) - m2


# ----------------------------------------------------------------------------------------------
# q6_K: 16 sub-blocks of 16, symmetric, x = d*sc*(q-32) with int8 sc and 6-bit q
#   block_q6_K (210 B): ql[128] @0, qh[64] @128, scales[16] int8 @192, d @208 (docs/quant-formats.md §1.8)
# ----------------------------------------------------------------------------------------------

@_kernel
def quantize_row_q6_K(x, y):
    """quantize_row_q6_K_ref: make_qx_quants per 16, scales to int8 against the signed largest."""
    L = np.empty(QK_K, np.uint8)
    scales = np.empty(QK_K // 16, np.float32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K:(i + 1) * QK_K]
        yb = y[i * Q6_K_SIZE:(i + 1) * Q6_K_SIZE]
        max_scale = np.float32(0.0)
        max_abs_scale = np.float32(0.0)
        for ib in range(QK_K // 16):
            scales[ib] = make_qx_quants(32, xb[16 * ib:16 * ib + 16], L[16 * ib:16 * ib + 16])
            if abs(scales[ib]) > max_abs_scale:
                max_abs_scale = abs(scales[ib])
                max_scale = scales[ib]
        if max_abs_scale < GROUP_MAX_EPS:
            yb.fill(0)
            continue

        iscale = np.float32(-128.0) / max_scale
        store_f16(yb, Q6_K_D, np.float32(1.0) / iscale)
        for ib in range(QK_K // 16):
            yb[Q6_K_SCALES + ib] = min(127, nearest_int(iscale * scales[ib])) & 0xFF

        d_all = load_f16(yb, Q6_K_D)
        for j in range(QK_K // 16):
            d = d_all * np.float32(_wrap_i8(yb[Q6_K_SCALES + j]))
            if d == 0:
                continue
            for ii in range(16):
                L[16 * j + ii] = max(-32, min(31, nearest_int(xb[16 * j + ii] / d))) + 32

        for j in range(0, QK_K, 128):
            ql = yb[Q6_K_QL + j // 2:Q6_K_QL + j // 2 + 64]
            qh = yb[Q6_K_QH + j // 4:Q6_K_QH + j // 4 + 32]
            for l in range(32):
                q1 = L[j + l]
                q2 = L[j + l + 32]
                q3 = L[j + l + 64]
                q4 = L[j + l + 96]
                ql[l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
                ql[l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
                qh[l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)


@_kernel
def dequantize_row_q6_K(x, y):
    """dequantize_row_q6_K: y = (d*sc)*(q-32), left to right."""
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q6_K_SIZE:(i + 1) * Q6_K_SIZE]
        d = load_f16(xb, Q6_K_D)
        for n in range(2):                 # 128-element halves
            ql = xb[Q6_K_QL + 64 * n:Q6_K_QL + 64 * n + 64]
            qh = xb[Q6_K_QH + 32 * n:Q6_K_QH + 32 * n + 32]
            sc = xb[Q6_K_SCALES + 8 * n:Q6_K_SCALES + 8 * n + 8]
            o = i * QK_K + 128 * n
            for l in range(32):
                is_ = l // 16
                q1 = np.int64((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
                q2 = np.int64((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
                q3 = np.int64((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
                q4 = np.int64((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
                y[o + l] = d * np.float32(_wrap_i8(sc[is_])) * np.float32(q1)
                y[o + l + 32] = d * np.float32(_wrap_i8(sc[is_ + 2])) * np.float32(q2)
                y[o + l + 64] = d * np.float32(_wrap_i8(sc[is_ + 4])) * np.float32(q3)
                y[o + l + 96] = d * np.float32(_wrap_i8(sc[is_ + 6])) * np.float32(q4)


# ----------------------------------------------------------------------------------------------
# q8_K: the CPU's activation format for the K-quants (docs/quant-formats.md §1.2, §4.3)
#   block_q8_K (292 B): d float32 @0, qs[256] int8 @4, bsums[16] int16 @260
# ----------------------------------------------------------------------------------------------

@_kernel
def quantize_row_q8_K(x, y):
    """quantize_row_q8_K_ref: iscale = -127/max with max the SIGNED largest value, so d = 1/iscale
    is negative when that value is positive; q = min(127, nearest_int(iscale*x));
    bsums[g] = sum of qs[16g..16g+15]. An all-zero block gets d = 0, qs = 0 and (unlike GGML,
    which leaves them untouched) bsums = 0. This is every activation row of a K-quant matmul, so
    each pass is a loop without branches that LLVM vectorizes: the largest |x| and the first
    index that has it in one pass, as the max of the 64-bit key (|x|'s bits << 9 | 511 - j),
    ~2x the speed of a max then a scan for it (8.9 against 16.9 µs for 128 blocks), ~10x that of
    one float pass that tracks both."""
    q = np.empty(QK_K, np.int32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K:(i + 1) * QK_K]
        yb = y[i * Q8_K_SIZE:(i + 1) * Q8_K_SIZE]
        # |x| as the bits of |x| (ordered as the values; NaN's bits count as 0): integers, which
        # vectorize where a float max (NaN's order) does not
        xi = xb.view(np.int32)
        key = np.int64(0)
        for j in range(QK_K):
            a = xi[j] & np.int32(0x7FFFFFFF)
            a = a if a <= np.int32(0x7F800000) else np.int32(0)
            key = max(key, (np.int64(a) << 9) | np.int64(511 - j))
        if key >> 9 == 0:
            yb.fill(0)
            continue
        j = 511 - (key & 511)
        iscale = np.float32(-127.0) / xb[j]
        for j in range(QK_K):   # nearest_int, in int32 lanes
            bits = np.float32(iscale * xb[j] + np.float32(12582912.0)).view(np.int32)
            q[j] = min(np.int32(127), np.int32((bits & np.int32(0x7FFFFF)) - np.int32(0x400000)))
            yb[Q8_K_QS + j] = np.uint8(q[j] & 0xFF)
        for g in range(QK_K // 16):
            bsum = np.int32(0)
            for j in range(16 * g, 16 * g + 16):
                bsum += q[j]
            yb[Q8_K_BSUMS + 2 * g] = bsum & 0xFF
            yb[Q8_K_BSUMS + 2 * g + 1] = (bsum >> 8) & 0xFF
        _store_u32(yb, 0, np.float32(np.float32(1.0) / iscale).view(np.uint32))


@_kernel
def dequantize_row_q8_K(x, y):
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q8_K_SIZE:(i + 1) * Q8_K_SIZE]
        d = np.uint32(_u32(xb, 0)).view(np.float32)
        for j in range(QK_K):
            y[i * QK_K + j] = d * np.float32(_wrap_i8(xb[Q8_K_QS + j]))


@_ref
def _scales_mins_k4(x, o, sc, mn):
    """The 8 six-bit scales and 8 mins of a Q4_K/Q5_K block (12 bytes at x[o]) with the 32-bit
    trick of docs/quant-formats.md §2: four words whose 16 bytes are sc0..sc7, m0..m7."""
    u0, u1, u2 = _u32(x, o), _u32(x, o + 4), _u32(x, o + 8)
    w = (u0 & 0x3F3F3F3F,
         (u2 & 0x0F0F0F0F) | (((u0 >> 6) & 0x03030303) << 4),
         u1 & 0x3F3F3F3F,
         ((u2 >> 4) & 0x0F0F0F0F) | (((u1 >> 6) & 0x03030303) << 4))
    for k in range(4):
        for b in range(4):
            v = np.int32((w[k] >> (8 * b)) & 0xFF)
            if k < 2:
                sc[4 * k + b] = v
            else:
                mn[4 * (k - 2) + b] = v


# =================================================================================================
# Reference kernels: GGML's *_generic, same integer lanes and float order, unfused
# =================================================================================================

@_ref
def _k_lanes_ref(a, y, yo, scale_of, nsub, aux32):
    """aux32[l] += scale * (q8·a) over groups of 8 elements, GGML's generic K-quant inner loop:
    element e goes to lane e % 8 with the scale of its sub-block (e // (256 // nsub))."""
    per = QK_K // nsub
    for e0 in range(0, QK_K, 8):
        scale = scale_of[e0 // per]
        for l in range(8):
            aux32[l] += scale * (_i8(y, yo + Q8_K_QS + e0 + l) * a[e0 + l])


@_ref
def _k4_block_ref(x, xo, y, yo, a, sc, mn, aux32, sums):
    """The part of GGML's generic Q4_K/Q5_K dot products after the quants are unpacked into ``a``:
    the scale term goes into the 8 float lanes ``sums``; the min term is returned, to subtract."""
    _scales_mins_k4(x, xo + Q4_K_SCALES, sc, mn)
    sumi = 0
    for j in range(16):
        sumi += _i16(y, yo + Q8_K_BSUMS + 2 * j) * mn[j // 2]
    aux32[:] = 0
    _k_lanes_ref(a, y, yo, sc, 8, aux32)
    d = load_f16(x, xo) * _f32(y, yo)
    for l in range(8):
        sums[l] += d * np.float32(aux32[l])
    dmin = load_f16(x, xo + Q4_K_DMIN) * _f32(y, yo)
    return dmin * np.float32(sumi)


@_ref
def vec_dot_q4_K_q8_K_ref(n, x, y):
    """ggml_vec_dot_q4_K_q8_K_generic (docs/quant-formats.md §5.2)."""
    nb = n // QK_K
    a = np.empty(QK_K, np.int32)
    sc = np.empty(8, np.int32)
    mn = np.empty(8, np.int32)
    aux32 = np.empty(8, np.int32)
    sums = np.zeros(8, np.float32)
    sumf = np.float32(0.0)
    for i in range(nb):
        xo, yo = i * Q4_K_SIZE, i * Q8_K_SIZE
        for j in range(4):  # chunk j: low nibbles = sub-block 2j, high nibbles = 2j+1
            for l in range(32):
                q = _u8(x, xo + Q4_K_QS + 32 * j + l)
                a[64 * j + l] = q & 0xF
                a[64 * j + 32 + l] = q >> 4
        sumf -= _k4_block_ref(x, xo, y, yo, a, sc, mn, aux32, sums)
    for l in range(8):
        sumf += sums[l]
    return sumf


@_ref
def vec_dot_q5_K_q8_K_ref(n, x, y):
    """ggml_vec_dot_q5_K_q8_K_generic: Q4_K plus a fifth bit from qh (docs/quant-formats.md §1.7)."""
    nb = n // QK_K
    a = np.empty(QK_K, np.int32)
    sc = np.empty(8, np.int32)
    mn = np.empty(8, np.int32)
    aux32 = np.empty(8, np.int32)
    sums = np.zeros(8, np.float32)
    sumf = np.float32(0.0)
    for i in range(nb):
        xo, yo = i * Q5_K_SIZE, i * Q8_K_SIZE
        for j in range(4):
            for l in range(32):
                q = _u8(x, xo + Q5_K_QS + 32 * j + l)
                h = _u8(x, xo + Q5_K_QH + l)
                a[64 * j + l] = (q & 0xF) + (16 if (h >> (2 * j)) & 1 else 0)
                a[64 * j + 32 + l] = (q >> 4) + (16 if (h >> (2 * j + 1)) & 1 else 0)
        sumf -= _k4_block_ref(x, xo, y, yo, a, sc, mn, aux32, sums)
    for l in range(8):
        sumf += sums[l]
    return sumf


@_ref
def vec_dot_q6_K_q8_K_ref(n, x, y):
    """ggml_vec_dot_q6_K_q8_K_generic: 16 sub-blocks of 16 with int8 scales, q − 32 (docs/quant-formats.md §1.8)."""
    nb = n // QK_K
    a = np.empty(QK_K, np.int32)
    sc = np.empty(16, np.int32)
    aux32 = np.empty(8, np.int32)
    sums = np.zeros(8, np.float32)
    sumf = np.float32(0.0)
    for i in range(nb):
        xo, yo = i * Q6_K_SIZE, i * Q8_K_SIZE
        for h in range(2):  # two halves of 128 elements
            ql, qh = xo + Q6_K_QL + 64 * h, xo + Q6_K_QH + 32 * h
            for l in range(32):
                q1, q2, hh = _u8(x, ql + l), _u8(x, ql + 32 + l), _u8(x, qh + l)
                a[128 * h + l] = ((q1 & 0xF) | (((hh >> 0) & 3) << 4)) - 32
                a[128 * h + l + 32] = ((q2 & 0xF) | (((hh >> 2) & 3) << 4)) - 32
                a[128 * h + l + 64] = ((q1 >> 4) | (((hh >> 4) & 3) << 4)) - 32
                a[128 * h + l + 96] = ((q2 >> 4) | (((hh >> 6) & 3) << 4)) - 32
        for s in range(16):
            sc[s] = _i8(x, xo + Q6_K_SCALES + s)
        aux32[:] = 0
        _k_lanes_ref(a, y, yo, sc, 16, aux32)
        d = load_f16(x, xo + Q6_K_D) * _f32(y, yo)
        for l in range(8):
            sums[l] += d * np.float32(aux32[l])
    for l in range(8):
        sumf += sums[l]
    return sumf


@_ref
def vec_dot_q2_K_q8_K_ref(n, x, y):
    """ggml_vec_dot_q2_K_q8_K_generic. block_q2_K (84 B): scales[16] @0 (low nibble = scale,
    high = min of a 16-element sub-block), qs[64] @16 (2-bit quants), d @80, dmin @82."""
    sumf = np.float32(0.0)
    for i in range(n // QK_K):
        xo, yo = i * Q2_K_SIZE, i * Q8_K_SIZE
        summs = 0
        for j in range(16):
            summs += _i16(y, yo + Q8_K_BSUMS + 2 * j) * (_u8(x, xo + Q2_K_SCALES + j) >> 4)
        dall = _f32(y, yo) * load_f16(x, xo + Q2_K_D)
        dmin = _f32(y, yo) * load_f16(x, xo + Q2_K_DMIN)
        isum = 0
        s = 0
        for k in range(2):           # two halves of 128 elements, 32 qs bytes each
            for j in range(4):       # shift 2j picks the 32-element group
                for half in range(2):
                    d = _u8(x, xo + Q2_K_SCALES + s) & 0xF
                    s += 1
                    isuml = 0
                    for l in range(16 * half, 16 * half + 16):
                        q = (_u8(x, xo + Q2_K_QS + 32 * k + l) >> (2 * j)) & 3
                        isuml += _i8(y, yo + Q8_K_QS + 128 * k + 32 * j + l) * q
                    isum += d * isuml
        sumf += dall * np.float32(isum) - dmin * np.float32(summs)
    return sumf


@_ref
def vec_dot_q3_K_q8_K_ref(n, x, y):
    """ggml_vec_dot_q3_K_q8_K_generic. block_q3_K (110 B): hmask[32] @0, qs[64] @32,
    scales[12] @96 (6-bit, minus 32), d @108; q = (2 low bits) − (4 if the hmask bit is clear)."""
    nb = n // QK_K
    a = np.empty(QK_K, np.int32)
    sc = np.empty(16, np.int32)
    aux32 = np.empty(8, np.int32)
    sums = np.zeros(8, np.float32)
    sumf = np.float32(0.0)
    for i in range(nb):
        xo, yo = i * Q3_K_SIZE, i * Q8_K_SIZE
        m = 0
        for j in range(2):
            for g in range(4):
                for l in range(32):
                    q = (_u8(x, xo + Q3_K_QS + 32 * j + l) >> (2 * g)) & 3
                    a[128 * j + 32 * g + l] = q - (0 if (_u8(x, xo + Q3_K_HMASK + l) >> m) & 1 else 4)
                m += 1
        so = xo + Q3_K_SCALES
        for j in range(16):
            lo = (_u8(x, so + j) & 0xF) if j < 8 else (_u8(x, so + j - 8) >> 4)
            hi = (_u8(x, so + 8 + j % 4) >> (2 * (j // 4))) & 3
            sc[j] = (lo | (hi << 4)) - 32
        aux32[:] = 0
        _k_lanes_ref(a, y, yo, sc, 16, aux32)
        d = load_f16(x, xo + Q3_K_D) * _f32(y, yo)
        for l in range(8):
            sums[l] += d * np.float32(aux32[l])
    for l in range(8):
        sumf += sums[l]
    return sumf


# =================================================================================================
# Fast kernels. Shared pieces first: each is a few vector instructions, inlined.
# =================================================================================================

@njit(inline="always")
def _k4_scales_mins(x, o):
    """The 12 scale bytes of Q4_K/Q5_K at x[o] -> <16 x i16>: lanes 0-7 = sc0..7, 8-15 = m0..7
    (GGML: memcpy + the 32-bit trick + _mm256_cvtepu8_epi16)."""
    u0 = load_u32(x, o)
    u1 = load_u32(x, o + 4)
    u2 = load_u32(x, o + 8)
    w0 = u0 & 0x3F3F3F3F
    w1 = (u2 & 0x0F0F0F0F) | (((u0 >> 6) & 0x03030303) << 4)
    w2 = u1 & 0x3F3F3F3F
    w3 = ((u2 >> 4) & 0x0F0F0F0F) | (((u1 >> 6) & 0x03030303) << 4)
    return zext(u32x4_to_i8x16(w0, w1, w2, w3))


@njit(inline="always")
def _k4_head(x, xb):
    """The head of the Q4_K/Q5_K block at x[xb]: d, dmin, the scales and mins (``_k4_scales_mins``)
    and the mins alone."""
    ms = _k4_scales_mins(x, xb + Q4_K_SCALES)
    return _F16[load_u16(x, xb)], _F16[load_u16(x, xb + Q4_K_DMIN)], ms, hi_half(ms)


@njit(inline="always")
def _k4_min_prod(mins, y, yb):
    """4 int32 lanes m[2u]·q8s[2u] + m[2u+1]·q8s[2u+1], where q8s[s] = bsums[2s] + bsums[2s+1] is
    the sum of the 32 activations of sub-block s (GGML: _mm_hadd_epi16 + _mm_madd_epi16). With
    the mins of two rows side by side (``dot2_*``), 4 lanes for each."""
    return madd(mins, widen_as(hadd_pairs(load_i16x16(y, yb + Q8_K_BSUMS)), mins))


@njit(inline="always")
def _k4_sumi_parts(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, sc):
    """Σ_s sc_s · Σ_{e in s} q[e]·q8[e] for one Q4_K/Q5_K block, as four vectors of 8 int32 lanes, part u
    for sub-blocks 2u and 2u+1 (the 64 values GGML's repacked gemm adds at a time: repack.py). l_j/h_j are
    the 32 unsigned quants of sub-blocks 2j/2j+1; each maddubs multiplies 32 of them with 32 int8
    activations into 16 int16 pair sums, and madd weights those by the sub-block's scale into
    8 int32 lanes (madd_acc: accumulate in the same instruction with VNNI). ``sc``: the 8 scales
    in both 128-bit halves (``bcast_half(ms, 0)``). With two rows' quants and scales side by side
    (``dot2_*``), 8 lanes for each row, the activations read once for both. Four partial sums
    added at the end (exact integers, so any order gives GGML's lanes): one chain of eight
    accumulating ``vpdpwssd`` (5 cycles each) was the critical path of a one-column block."""
    s0 = madd_acc(madd(pick16(sc, 0, 0), maddubs(l0, widen_as(load_i8x32(y, yb + Q8_K_QS), l0))),
                  pick16(sc, 1, 1), maddubs(h0, widen_as(load_i8x32(y, yb + Q8_K_QS + 32), l0)))
    s1 = madd_acc(madd(pick16(sc, 2, 2), maddubs(l1, widen_as(load_i8x32(y, yb + Q8_K_QS + 64), l0))),
                  pick16(sc, 3, 3), maddubs(h1, widen_as(load_i8x32(y, yb + Q8_K_QS + 96), l0)))
    s2 = madd_acc(madd(pick16(sc, 4, 4), maddubs(l2, widen_as(load_i8x32(y, yb + Q8_K_QS + 128), l0))),
                  pick16(sc, 5, 5), maddubs(h2, widen_as(load_i8x32(y, yb + Q8_K_QS + 160), l0)))
    s3 = madd_acc(madd(pick16(sc, 6, 6), maddubs(l3, widen_as(load_i8x32(y, yb + Q8_K_QS + 192), l0))),
                  pick16(sc, 7, 7), maddubs(h3, widen_as(load_i8x32(y, yb + Q8_K_QS + 224), l0)))
    return s0, s1, s2, s3


@njit(inline="always")
def _k4_sumi(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, sc):
    """The four parts of ``_k4_sumi_parts`` added: the block's Σ_s sc_s · Σ q·q8 as 8 int32 lanes."""
    s0, s1, s2, s3 = _k4_sumi_parts(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, sc)
    return vadd(vadd(s0, s1), vadd(s2, s3))


@njit(inline="always")
def _q4_K_nibbles(q0, q1, q2, q3):
    """Nibbles of one Q4_K block's quants ``q_j`` (32 bytes, or 64: two rows): chunk j's bytes give
    sub-block 2j (low) and 2j+1 (high)."""
    m4 = widen_as(splat_i8x32(0xF), q0)
    return (vand(q0, m4), vand(vsrl(q0, 4), m4), vand(q1, m4), vand(vsrl(q1, 4), m4),
            vand(q2, m4), vand(vsrl(q2, 4), m4), vand(q3, m4), vand(vsrl(q3, 4), m4))


@njit(inline="always")
def _q4_K_unpack(x, xb):
    return _q4_K_nibbles(load_i8x32(x, xb + Q4_K_QS), load_i8x32(x, xb + Q4_K_QS + 32),
                         load_i8x32(x, xb + Q4_K_QS + 64), load_i8x32(x, xb + Q4_K_QS + 96))


@njit(inline="always")
def _q4_K_unpack2(x, x2, xb):
    return _q4_K_nibbles(_rows2(x, x2, xb + Q4_K_QS), _rows2(x, x2, xb + Q4_K_QS + 32),
                         _rows2(x, x2, xb + Q4_K_QS + 64), _rows2(x, x2, xb + Q4_K_QS + 96))


@njit(inline="always")
def _q5_K_unpack(x, xb):
    """Q4_K's nibbles plus bit 2j (low) / 2j+1 (high) of qh[l] as +16."""
    m4 = splat_i8x32(0xF)
    b4 = splat_i8x32(0x10)
    hb = load_i8x32(x, xb + Q5_K_QH)
    q0 = load_i8x32(x, xb + Q5_K_QS)
    q1 = load_i8x32(x, xb + Q5_K_QS + 32)
    q2 = load_i8x32(x, xb + Q5_K_QS + 64)
    q3 = load_i8x32(x, xb + Q5_K_QS + 96)
    return (vor(vand(q0, m4), vand(vsll(hb, 4), b4)), vor(vand(vsrl(q0, 4), m4), vand(vsll(hb, 3), b4)),
            vor(vand(q1, m4), vand(vsll(hb, 2), b4)), vor(vand(vsrl(q1, 4), m4), vand(vsll(hb, 1), b4)),
            vor(vand(q2, m4), vand(hb, b4)), vor(vand(vsrl(q2, 4), m4), vand(vsrl(hb, 1), b4)),
            vor(vand(q3, m4), vand(vsrl(hb, 2), b4)), vor(vand(vsrl(q3, 4), m4), vand(vsrl(hb, 3), b4)))


# ------------------------------------------------------------------------------------------------
# Q4_K x Q8_K
# ------------------------------------------------------------------------------------------------

@_fast
def dot_q4_K_q8_K(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_q4_K_q8_K, lane for lane (docs/quant-formats.md §5.3)."""
    acc = splat_f32x8(0.0)     # 8 float lanes: the scale term, across blocks
    acc_m = splat_f32x4(0.0)   # 4 float lanes: the min term
    for i in range(n // QK_K):
        xb = i * Q4_K_SIZE
        yb = yo + i * Q8_K_SIZE
        yd = load_f32(y, yb)
        d = yd * _F16[load_u16(x, xb)]
        dmin = -yd * _F16[load_u16(x, xb + Q4_K_DMIN)]   # sign folded in, so the min term is an FMA too
        ms = _k4_scales_mins(x, xb + Q4_K_SCALES)
        acc_m = fma(splat_f32x4(dmin), to_f32(_k4_min_prod(hi_half(ms), y, yb)), acc_m)
        l0, h0, l1, h1, l2, h2, l3, h3 = _q4_K_unpack(x, xb)
        sumi = _k4_sumi(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, bcast_half(ms, 0))
        acc = fma(splat_f32x8(d), to_f32(sumi), acc)
    return hsum_f32x8(acc) + hsum_f32x4(acc_m)


@_fast
def vec_dot_q4_K_q8_K(n, x, y):
    return dot_q4_K_q8_K(n, x, y, n - n)  # a non-literal 0: the matmul's specialization


# A tile's min term, 8 columns at a time. Per (row, column, super-block) the min term is 4 int32
# lanes m[2u]·q8s[2u] + m[2u+1]·q8s[2u+1] (u = 0..3; q8s[s] the sum of the column's sub-block s)
# times -d·dmin. The q8s and d belong to the column: the same for every row of a tile. So a tile
# writes them once (``_k4_min_table``), transposed: for 8 columns, a vector per u whose 32-bit
# lane k holds column k's pair (q8s[2u], q8s[2u+1]); a row then makes lane u of 8 columns with one
# madd of its mins pair broadcast (``bcast_pair``), one conversion and one FMA, where the one-column
# kernel spent a load, a horizontal add, a madd, a conversion, an FMA and a store per column and
# summed the lanes per column at the end. The same products, FMAs and sums per (row, column): the
# same bits. Measured on the dev machine (one thread, 128 columns, best of 40, the two versions
# alternating 6 times): 768x256 Q4_K 757-830 -> 607-628 µs, 768x768 1,839-2,066 -> 1,494-1,561,
# 2048x768 5,491-6,308 -> 4,501-4,683, 768x2048 4,768-5,042 -> 4,119-4,220.

@_fast
def _k4_min_table(n, y, yo, ycs, ybs, nc, acc):
    """The min table of nc columns (whole groups of 8) at byte 4·ACC_PER_COL·nc of acc: per super-block
    i and group g, at K4_TABLE_BYTES·(i·(nc // 8) + g) past it, ``transpose_pairs(u, ...)`` of the
    8 columns' q8s for u = 0..3 (32 bytes each), then their 8 d's."""
    t = 4 * ACC_PER_COL * nc
    for i in range(n // QK_K):
        for g in range(nc // 8):
            yb = yo + 8 * g * ycs + i * ybs
            bs = yb + Q8_K_BSUMS
            q0, q1 = hadd_pairs(load_i16x16(y, bs)), hadd_pairs(load_i16x16(y, bs + ycs))
            q2, q3 = hadd_pairs(load_i16x16(y, bs + 2 * ycs)), hadd_pairs(load_i16x16(y, bs + 3 * ycs))
            q4, q5 = hadd_pairs(load_i16x16(y, bs + 4 * ycs)), hadd_pairs(load_i16x16(y, bs + 5 * ycs))
            q6, q7 = hadd_pairs(load_i16x16(y, bs + 6 * ycs)), hadd_pairs(load_i16x16(y, bs + 7 * ycs))
            store_i16x16(acc, t, transpose_pairs(0, q0, q1, q2, q3, q4, q5, q6, q7))
            store_i16x16(acc, t + 32, transpose_pairs(1, q0, q1, q2, q3, q4, q5, q6, q7))
            store_i16x16(acc, t + 64, transpose_pairs(2, q0, q1, q2, q3, q4, q5, q6, q7))
            store_i16x16(acc, t + 96, transpose_pairs(3, q0, q1, q2, q3, q4, q5, q6, q7))
            for k in range(8):
                acc[(t + 128) // 4 + k] = load_f32(y, yb + k * ycs)
            t += K4_TABLE_BYTES


@njit(inline="always")
def _k4_min_group(acc, t, mins, xdmin, a0, a1, a2, a3):
    """a0..a3 plus one super-block's min lanes u = 0..3 of 8 columns (their table entry at byte t of
    acc) for a row whose 8 mins are ``mins`` and dmin ``xdmin``: lane k of a_u is lane u of
    column k's ``am`` in ``dot_q4_K_q8_K``, with the same products and FMA."""
    dm = vmul(load_f32x8(acc, t + 128), splat_f32x8(-xdmin))
    return (fma(dm, to_f32(madd(bcast_pair(mins, 0), load_i16x16(acc, t))), a0),
            fma(dm, to_f32(madd(bcast_pair(mins, 1), load_i16x16(acc, t + 32))), a1),
            fma(dm, to_f32(madd(bcast_pair(mins, 2), load_i16x16(acc, t + 64))), a2),
            fma(dm, to_f32(madd(bcast_pair(mins, 3), load_i16x16(acc, t + 96))), a3))


@njit(inline="always")
def _k4_group_sums(acc, c, a0, a1, a2, a3, out):
    """out[c:c + 8] = each column's scale lanes summed (``hsum_f32x8``) plus its min lanes summed as
    ``hsum_f32x4`` does, (m0 + m2) + (m1 + m3): lane for lane, dot_q4_K_q8_K's final sum."""
    s = hsum_f32x8_cols(load_f32x8(acc, 64 * c), load_f32x8(acc, 64 * (c + 1)), load_f32x8(acc, 64 * (c + 2)),
                        load_f32x8(acc, 64 * (c + 3)), load_f32x8(acc, 64 * (c + 4)), load_f32x8(acc, 64 * (c + 5)),
                        load_f32x8(acc, 64 * (c + 6)), load_f32x8(acc, 64 * (c + 7)))
    v = vadd(s, vadd(vadd(a0, a2), vadd(a1, a3)))
    for k in range(8):   # lane by lane: ``out`` may be a strided column of the matmul's dst
        out[c + k] = lane(v, k)


# A row against the tile's columns, once the columns' min table is in acc. Per column, acc holds 8
# scale lanes at [16c, 16c+8); the min lanes are per group of 8 columns, group g's lane u at
# [16(8g+u)+8, 16(8g+u)+16), and per column for the columns after the last whole group (4 lanes at
# [16c+8, 16c+12)). Two functions: a row of one super-block (the embedded model's, n_embd 256) writes
# each column's lanes once (the same operations on zeros, without zeroing and reading them back),
# and ``tile_q4_K_q8_K`` inlines it, writing each row's results straight into dst (see there).

@njit(inline="always")
def _k4_tail_sums(acc, c0, nc, out):
    """out[c] for the columns c0..nc after the last whole group: their own scale and min lanes."""
    for c in range(c0, nc):
        out[c] = hsum_f32x8(load_f32x8(acc, 64 * c)) + hsum_f32x4(lo_half(load_f32x8(acc, 64 * c + 32)))


@njit(inline="always")
def _q4_K_row_one_block(x, y, yo, ycs, nc, acc, out):
    """A row of one super-block (n = 256); ``out`` may be strided (a row of the matmul's dst)."""
    zero = splat_f32x8(0.0)
    full = nc - nc % 8                   # columns in whole groups: the table's
    tb = 4 * ACC_PER_COL * nc
    xd, xdmin, ms, mins = _k4_head(x, 0)
    l0, h0, l1, h1, l2, h2, l3, h3 = _q4_K_unpack(x, 0)
    for c in range(nc):
        yb = yo + c * ycs
        yd = load_f32(y, yb)
        sumi = _k4_sumi(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, bcast_half(ms, 0))
        store_f32x8(acc, 64 * c, fma(splat_f32x8(yd * xd), to_f32(sumi), zero))
        if c >= full:
            am = fma(splat_f32x4(-yd * xdmin), to_f32(_k4_min_prod(mins, y, yb)), lo_half(zero))
            store_f32x8(acc, 64 * c + 32, concat(am, am))
    for g in range(full // 8):
        a0, a1, a2, a3 = _k4_min_group(acc, tb + K4_TABLE_BYTES * g, mins, xdmin, zero, zero, zero, zero)
        _k4_group_sums(acc, 8 * g, a0, a1, a2, a3, out)
    _k4_tail_sums(acc, full, nc, out)


@_fast
def _q4_K_row_blocks(n, x, y, yo, ycs, ybs, nc, acc, out):
    """A row of any number of super-blocks."""
    full = nc - nc % 8                   # columns in whole groups: the table's
    tb = 4 * ACC_PER_COL * nc
    _zero_cols(acc, nc, 2)
    for i in range(n // QK_K):
        xb = i * Q4_K_SIZE
        xd, xdmin, ms, mins = _k4_head(x, xb)
        l0, h0, l1, h1, l2, h2, l3, h3 = _q4_K_unpack(x, xb)
        for c in range(nc):
            yb = yo + c * ycs + i * ybs
            yd = load_f32(y, yb)
            sumi = _k4_sumi(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, bcast_half(ms, 0))
            store_f32x8(acc, 64 * c, fma(splat_f32x8(yd * xd), to_f32(sumi), load_f32x8(acc, 64 * c)))
            if c >= full:
                am = fma(splat_f32x4(-yd * xdmin), to_f32(_k4_min_prod(mins, y, yb)),
                         lo_half(load_f32x8(acc, 64 * c + 32)))
                store_f32x8(acc, 64 * c + 32, concat(am, am))
        for g in range(full // 8):
            o = 64 * 8 * g + 32
            a0, a1, a2, a3 = _k4_min_group(acc, tb + K4_TABLE_BYTES * (i * (full // 8) + g), mins, xdmin,
                                           load_f32x8(acc, o), load_f32x8(acc, o + 64),
                                           load_f32x8(acc, o + 128), load_f32x8(acc, o + 192))
            store_f32x8(acc, o, a0)
            store_f32x8(acc, o + 64, a1)
            store_f32x8(acc, o + 128, a2)
            store_f32x8(acc, o + 192, a3)
    for g in range(full // 8):
        o = 64 * 8 * g + 32
        _k4_group_sums(acc, 8 * g, load_f32x8(acc, o), load_f32x8(acc, o + 64), load_f32x8(acc, o + 128),
                       load_f32x8(acc, o + 192), out)
    _k4_tail_sums(acc, full, nc, out)


@_fast
def dot_cols_q4_K_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    """dot_q4_K_q8_K of one weight row with nc columns (acc: ``acc_floats(n, nc)`` floats): the
    columns' min table, then the row (``tile_q4_K_q8_K`` makes the table once for many rows)."""
    _k4_min_table(n, y, yo, ycs, ybs, nc, acc)
    if n == QK_K:
        _q4_K_row_one_block(x, y, yo, ycs, nc, acc, out)
    else:
        _q4_K_row_blocks(n, x, y, yo, ycs, ybs, nc, acc, out)


@_fast
def tile_q4_K_q8_K(n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, acc, out, dst, i3, i2, c0):
    """Weight rows r0..r1 of w4[j3, j2] each dotted with nc columns into dst[i3, i2, c0:c0 + nc]
    (``dispatch.dot_tile``'s parameters): the columns' min table once, then row by row. Rows of one
    super-block are inlined here and write their results straight into their strided column of
    dst; longer rows go through ``out`` and a copy. Measured on the dev machine (one thread, 128
    columns, the two versions alternating 5 times): 768x256 608-647 -> 569-601 µs with the direct
    writes; 2048x768, 768x768 and 768x2048 3-5% slower with them, so those keep the copy."""
    _k4_min_table(n, y, yo, ycs, ybs, nc, acc)
    if n == QK_K:
        for r in range(r0, r1):
            _q4_K_row_one_block(w4[j3, j2, r], y, yo, ycs, nc, acc, dst[i3, i2, c0:c0 + nc, r])
        return
    for r in range(r0, r1):
        _q4_K_row_blocks(n, w4[j3, j2, r], y, yo, ycs, ybs, nc, acc, out)
        for k in range(nc):
            dst[i3, i2, c0 + k, r] = out[k]


@_fast
def dot_cols2_q4_K_q8_K(n, x, x2, y, yo, ycs, ybs, nc, acc, out):
    """dot_cols_q4_K_q8_K of rows x and x2 at once: row x in the low 256 bits of each vector, x2 in
    the high, so each instruction does both rows' lanes (AVX-512), with per row the lanes and
    operations of dot_cols_q4_K_q8_K (the same results, bit for bit). out[2c] and out[2c + 1]
    receive column c's products with x and x2. Per column, acc holds the 16 scale lanes (both
    rows) at [32c, 32c+16) and the 8 min lanes at [32c+16, 32c+24)."""
    zero = splat_f32x16(0.0)
    for c in range(nc):
        store_f32x16(acc, 128 * c, zero)
        store_f32x16(acc, 128 * c + 64, zero)
    for i in range(n // QK_K):
        xb = i * Q4_K_SIZE
        xd = concat(splat_f32x8(_F16[load_u16(x, xb)]), splat_f32x8(_F16[load_u16(x2, xb)]))
        xdmin = concat(splat_f32x4(_F16[load_u16(x, xb + Q4_K_DMIN)]), splat_f32x4(_F16[load_u16(x2, xb + Q4_K_DMIN)]))
        ms, ms2 = _k4_scales_mins(x, xb + Q4_K_SCALES), _k4_scales_mins(x2, xb + Q4_K_SCALES)
        mins = concat(hi_half(ms), hi_half(ms2))
        sc = concat(bcast_half(ms, 0), bcast_half(ms2, 0))
        l0, h0, l1, h1, l2, h2, l3, h3 = _q4_K_unpack2(x, x2, xb)
        for c in range(nc):
            yb = yo + c * ycs + i * ybs
            yd = load_f32(y, yb)
            am = fma(vmul(splat_f32x8(-yd), xdmin), to_f32(_k4_min_prod(mins, y, yb)),
                     load_f32x8(acc, 128 * c + 64))
            sumi = _k4_sumi(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, sc)
            a = fma(vmul(splat_f32x16(yd), xd), to_f32(sumi), load_f32x16(acc, 128 * c))
            store_f32x16(acc, 128 * c, a)
            store_f32x8(acc, 128 * c + 64, am)
    for c in range(nc):
        a, am = load_f32x16(acc, 128 * c), load_f32x8(acc, 128 * c + 64)
        out[2 * c] = hsum_f32x8(lo_half(a)) + hsum_f32x4(lo_half(am))
        out[2 * c + 1] = hsum_f32x8(hi_half(a)) + hsum_f32x4(hi_half(am))


# ------------------------------------------------------------------------------------------------
# Q5_K x Q8_K: Q4_K with a fifth bit; GGML's AVX2 kernel sums the min term as a scalar
# ------------------------------------------------------------------------------------------------

@_fast
def dot_q5_K_q8_K(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_q5_K_q8_K, lane for lane."""
    acc = splat_f32x8(0.0)
    summs = np.float32(0.0)
    for i in range(n // QK_K):
        xb = i * Q5_K_SIZE
        yb = yo + i * Q8_K_SIZE
        yd = load_f32(y, yb)
        d = yd * _F16[load_u16(x, xb)]
        dmin = -yd * _F16[load_u16(x, xb + Q5_K_DMIN)]
        ms = _k4_scales_mins(x, xb + Q5_K_SCALES)
        summs = _fmaf(dmin, np.float32(simd.hsum_i32(_k4_min_prod(hi_half(ms), y, yb))), summs)
        l0, h0, l1, h1, l2, h2, l3, h3 = _q5_K_unpack(x, xb)
        sumi = _k4_sumi(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, bcast_half(ms, 0))
        acc = fma(splat_f32x8(d), to_f32(sumi), acc)
    return hsum_f32x8(acc) + summs


@_fast
def vec_dot_q5_K_q8_K(n, x, y):
    return dot_q5_K_q8_K(n, x, y, n - n)  # a non-literal 0: the matmul's specialization


@_fast
def dot_cols_q5_K_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    """dot_q5_K_q8_K with nc columns; acc[16c+8] holds column c's scalar min term."""
    _zero_cols(acc, nc, 2)
    for i in range(n // QK_K):
        xb = i * Q5_K_SIZE
        xd, xdmin, ms, mins = _k4_head(x, xb)
        l0, h0, l1, h1, l2, h2, l3, h3 = _q5_K_unpack(x, xb)
        for c in range(nc):
            yb = yo + c * ycs + i * ybs
            yd = load_f32(y, yb)
            pm = np.float32(simd.hsum_i32(_k4_min_prod(mins, y, yb)))
            acc[16 * c + 8] = _fmaf(-yd * xdmin, pm, acc[16 * c + 8])
            sumi = _k4_sumi(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, bcast_half(ms, 0))
            store_f32x8(acc, 64 * c, fma(splat_f32x8(yd * xd), to_f32(sumi), load_f32x8(acc, 64 * c)))
    for c in range(nc):
        out[c] = hsum_f32x8(load_f32x8(acc, 64 * c)) + acc[16 * c + 8]


# ------------------------------------------------------------------------------------------------
# Q6_K x Q8_K: 6-bit unsigned q (0..63), 16 int8 scales; the −32 goes through the bsums
# ------------------------------------------------------------------------------------------------

@njit(inline="always")
def _q6_K_unpack(x, xb, h):
    """The 4 vectors of 32 six-bit quants (0..63) of half h (128 elements): element l, l+32, l+64,
    l+96 of the half (docs/quant-formats.md §1.8); low 4 bits from ql, high 2 bits from qh."""
    return _q6_K_quants(load_i8x32(x, xb + Q6_K_QL + 64 * h), load_i8x32(x, xb + Q6_K_QL + 64 * h + 32),
                        load_i8x32(x, xb + Q6_K_QH + 32 * h))


@njit(inline="always")
def _q6_K_unpack2(x, x2, xb, h):
    """_q6_K_unpack of rows x and x2 side by side."""
    return _q6_K_quants(_rows2(x, x2, xb + Q6_K_QL + 64 * h), _rows2(x, x2, xb + Q6_K_QL + 64 * h + 32),
                        _rows2(x, x2, xb + Q6_K_QH + 32 * h))


@njit(inline="always")
def _q6_K_quants(b1, b2, bh):
    """Six-bit quants from ql bytes b1, b2 and qh bytes bh (32 bytes each, or 64: two rows)."""
    m4 = widen_as(splat_i8x32(0xF), b1)
    m3 = widen_as(splat_i8x32(0x3), b1)
    return (vor(vand(b1, m4), vsll(vand(bh, m3), 4)),
            vor(vand(b2, m4), vsll(vand(vsrl(bh, 2), m3), 4)),
            vor(vand(vsrl(b1, 4), m4), vsll(vand(vsrl(bh, 4), m3), 4)),
            vor(vand(vsrl(b2, 4), m4), vsll(vand(vsrl(bh, 6), m3), 4)))


@njit(inline="always")
def _q6_K_half(y, yb, h, q0, q1, q2, q3, sc):
    """Half h's Σ sc·q·q8: each 32-element vector spans 2 sub-blocks of 16, so its scale
    vector carries sc[2k] in lanes 0-7 and sc[2k+1] in lanes 8-15 (``pick16`` of ``sc``, the
    half's 8 scales in both 128-bit halves)."""
    o = yb + Q8_K_QS + 128 * h
    s0 = madd(pick16(sc, 0, 1), maddubs(q0, widen_as(load_i8x32(y, o), q0)))
    s1 = madd(pick16(sc, 2, 3), maddubs(q1, widen_as(load_i8x32(y, o + 32), q0)))
    s0 = madd_acc(s0, pick16(sc, 4, 5), maddubs(q2, widen_as(load_i8x32(y, o + 64), q0)))
    s1 = madd_acc(s1, pick16(sc, 6, 7), maddubs(q3, widen_as(load_i8x32(y, o + 96), q0)))
    return vadd(s0, s1)   # two chains (see _k4_sumi)


@njit(inline="always")
def _q6_K_sumi(y, yb, a0, a1, a2, a3, b0, b1, b2, b3, sc16):
    """8 int32 lanes of Σ sc·(q−32)·q8 for one block: GGML computes Σ sc·q·q8 and subtracts
    32·Σ_s sc_s·bsum_s (madd of bsums and scales, shifted left by 5). With two rows' quants and
    scales side by side (``dot2_*``), 8 lanes for each."""
    corr = vsll(madd(widen_as(load_i16x16(y, yb + Q8_K_BSUMS), sc16), sc16), 5)
    return vsub(vadd(_q6_K_half(y, yb, 0, a0, a1, a2, a3, bcast_half(sc16, 0)),
                     _q6_K_half(y, yb, 1, b0, b1, b2, b3, bcast_half(sc16, 1))), corr)


@_fast
def dot_q6_K_q8_K(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_q6_K_q8_K, lane for lane."""
    acc = splat_f32x8(0.0)
    for i in range(n // QK_K):
        xb = i * Q6_K_SIZE
        yb = yo + i * Q8_K_SIZE
        d = load_f32(y, yb) * _F16[load_u16(x, xb + Q6_K_D)]
        sc16 = sext(load_i8x16(x, xb + Q6_K_SCALES))
        a0, a1, a2, a3 = _q6_K_unpack(x, xb, 0)
        b0, b1, b2, b3 = _q6_K_unpack(x, xb, 1)
        sumi = _q6_K_sumi(y, yb, a0, a1, a2, a3, b0, b1, b2, b3, sc16)
        acc = fma(splat_f32x8(d), to_f32(sumi), acc)
    return hsum_f32x8(acc)


@_fast
def vec_dot_q6_K_q8_K(n, x, y):
    return dot_q6_K_q8_K(n, x, y, n - n)  # a non-literal 0: the matmul's specialization


@_fast
def dot_cols_q6_K_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    _zero_cols(acc, nc, 1)
    for i in range(n // QK_K):
        xb = i * Q6_K_SIZE
        xd = _F16[load_u16(x, xb + Q6_K_D)]
        sc16 = sext(load_i8x16(x, xb + Q6_K_SCALES))
        a0, a1, a2, a3 = _q6_K_unpack(x, xb, 0)
        b0, b1, b2, b3 = _q6_K_unpack(x, xb, 1)
        for c in range(nc):
            yb = yo + c * ycs + i * ybs
            sumi = _q6_K_sumi(y, yb, a0, a1, a2, a3, b0, b1, b2, b3, sc16)
            a = fma(splat_f32x8(load_f32(y, yb) * xd), to_f32(sumi), load_f32x8(acc, 64 * c))
            store_f32x8(acc, 64 * c, a)
    _col_sums(acc, 64, -1, nc, out)


@_fast
def dot2_q6_K_q8_K(n, x, x2, y, yo):
    """dot_q6_K_q8_K of rows x and x2 at once (as dot_cols2_q4_K_q8_K): the same results, bit for bit."""
    acc = splat_f32x16(0.0)
    for i in range(n // QK_K):
        xb = i * Q6_K_SIZE
        yb = yo + i * Q8_K_SIZE
        yd = load_f32(y, yb)
        d = concat(splat_f32x8(yd * _F16[load_u16(x, xb + Q6_K_D)]), splat_f32x8(yd * _F16[load_u16(x2, xb + Q6_K_D)]))
        sc16 = concat(sext(load_i8x16(x, xb + Q6_K_SCALES)), sext(load_i8x16(x2, xb + Q6_K_SCALES)))
        a0, a1, a2, a3 = _q6_K_unpack2(x, x2, xb, 0)
        b0, b1, b2, b3 = _q6_K_unpack2(x, x2, xb, 1)
        sumi = _q6_K_sumi(y, yb, a0, a1, a2, a3, b0, b1, b2, b3, sc16)
        acc = fma(d, to_f32(sumi), acc)
    return hsum_f32x8(lo_half(acc)), hsum_f32x8(hi_half(acc))


@_fast
def dot_cols2_q6_K_q8_K(n, x, x2, y, yo, ycs, ybs, nc, acc, out):
    """dot_cols_q6_K_q8_K of rows x and x2 at once (as dot_cols2_q4_K_q8_K)."""
    zero = splat_f32x16(0.0)
    for c in range(nc):
        store_f32x16(acc, 128 * c, zero)
    for i in range(n // QK_K):
        xb = i * Q6_K_SIZE
        xd = concat(splat_f32x8(_F16[load_u16(x, xb + Q6_K_D)]), splat_f32x8(_F16[load_u16(x2, xb + Q6_K_D)]))
        sc16 = concat(sext(load_i8x16(x, xb + Q6_K_SCALES)), sext(load_i8x16(x2, xb + Q6_K_SCALES)))
        a0, a1, a2, a3 = _q6_K_unpack2(x, x2, xb, 0)
        b0, b1, b2, b3 = _q6_K_unpack2(x, x2, xb, 1)
        for c in range(nc):
            yb = yo + c * ycs + i * ybs
            sumi = _q6_K_sumi(y, yb, a0, a1, a2, a3, b0, b1, b2, b3, sc16)
            a = fma(vmul(splat_f32x16(load_f32(y, yb)), xd), to_f32(sumi), load_f32x16(acc, 128 * c))
            store_f32x16(acc, 128 * c, a)
    for c in range(nc):
        a = load_f32x16(acc, 128 * c)
        out[2 * c] = hsum_f32x8(lo_half(a))
        out[2 * c + 1] = hsum_f32x8(hi_half(a))


# ------------------------------------------------------------------------------------------------
# Q2_K x Q8_K and Q3_K x Q8_K: GGML's AVX2 kernels. Per 32 quants of sub-block pair (2s, 2s+1):
# maddubs (unsigned 2-bit quants x signed activations) to 16 int16 pair sums, then madd with the
# pair's two scales (8 lanes each, ``pick16`` of the half's scales), into 8 int32 lanes; one FMA
# per super-block. The 2-bit planes are ``crumb``s (one instruction each with GFNI). Q2_K's mins go
# through the activations' bsums (dmin·Σ min_s·bsum_s, one FMA before the quants'); Q3_K's third
# bit subtracts 4 where its hmask bit is clear, and its 6-bit scales are stored minus 32.
# ------------------------------------------------------------------------------------------------


@njit(inline="always")
def _crumbs(x, qo):
    """The four 2-bit planes of 32 quant bytes: runs 0..3 of a 128-value half."""
    q = load_i8x32(x, qo)
    return vand(q, splat_i8x32(3)), crumb(q, 2), crumb(q, 4), crumb(q, 6)


@njit(inline="always")
def _q3_hi(hb, k):
    """4 where bit ``k`` (0..3, a literal after inlining) of each hmask byte is clear, else 0."""
    one = splat_i8x32(1)
    if k == 0:
        b = hb
    elif k == 1:
        b = vsrl(hb, 1)
    elif k == 2:
        b = vsrl(hb, 2)
    else:
        b = vsrl(hb, 3)
    return vsll(vsub(one, vand(b, one)), 2)


@njit(inline="always")
def _q3_K_scales(x, xb):
    """The 16 six-bit scales of the Q3_K block at x[xb], minus 32, as <16 x i16> (GGML's kmask trick)."""
    so = xb + Q3_K_SCALES
    a0, a1, a2 = load_u32(x, so), load_u32(x, so + 4), load_u32(x, so + 8)
    k2, k1 = 0x0F0F0F0F, 0x03030303
    sc = u32x4_to_i8x16((a0 & k2) | ((a2 & k1) << 4), (a1 & k2) | (((a2 >> 2) & k1) << 4),
                        ((a0 >> 4) & k2) | (((a2 >> 4) & k1) << 4), ((a1 >> 4) & k2) | (((a2 >> 6) & k1) << 4))
    return sext(vsub(sc, simd.splat_i8x16(32)))


@njit(inline="always")
def _k23_unpack(x, i, q3):
    """Block i of a Q2_K (``q3`` False) or Q3_K row: d, dmin (0 for Q3_K), its halves' scales
    (``bcast_half``), Q2_K's mins, the hmask bytes of each half (zeros for Q2_K) and the eight
    2-bit planes."""
    if q3:
        xb = i * Q3_K_SIZE
        scales = _q3_K_scales(x, xb)
        hb0 = load_i8x32(x, xb + Q3_K_HMASK)
        c0, c1, c2, c3 = _crumbs(x, xb + Q3_K_QS)
        c4, c5, c6, c7 = _crumbs(x, xb + Q3_K_QS + 32)
        return (_F16[load_u16(x, xb + Q3_K_D)], np.float32(0.0), bcast_half(scales, 0), bcast_half(scales, 1),
                scales, hb0, vsrl(hb0, 4), c0, c1, c2, c3, c4, c5, c6, c7)
    xb = i * Q2_K_SIZE
    m4 = simd.splat_i8x16(0xF)
    ms = load_i8x16(x, xb + Q2_K_SCALES)
    scales = sext(vand(ms, m4))
    none = splat_i8x32(0)
    c0, c1, c2, c3 = _crumbs(x, xb + Q2_K_QS)
    c4, c5, c6, c7 = _crumbs(x, xb + Q2_K_QS + 32)
    return (_F16[load_u16(x, xb + Q2_K_D)], _F16[load_u16(x, xb + Q2_K_DMIN)], bcast_half(scales, 0),
            bcast_half(scales, 1), sext(vand(vsrl(ms, 4), m4)), none, none, c0, c1, c2, c3, c4, c5, c6, c7)


@njit(inline="always")
def _k23_sumi(c0, c1, c2, c3, c4, c5, c6, c7, hb0, hb1, q3, y, yb, sc0, sc1):
    """A Q2_K/Q3_K block's Σ_s sc_s · Σ q·q8 (``_k23_unpack``'s pieces) as 8 int32 lanes."""
    return vadd(_k23_half(c0, c1, c2, c3, hb0, q3, y, yb + Q8_K_QS, sc0),
                _k23_half(c4, c5, c6, c7, hb1, q3, y, yb + Q8_K_QS + 128, sc1))


@njit(inline="always")
def _k2_min_prod(mins, y, yb):
    """Q2_K's Σ_s m_s·bsum_s of one block as 8 int32 lanes (madd of the 16 mins and bsums)."""
    return madd(mins, load_i16x16(y, yb + Q8_K_BSUMS))


@njit(inline="always")
def _k2_run(q, hi, q8):
    """maddubs(q, q8) − maddubs(hi, q8): 32 quants against their activations, as 16 int16 pair sums."""
    p = maddubs(q, q8)
    if hi is not None:
        p = vsub(p, maddubs(hi, q8))
    return p


@njit(inline="always")
def _k23_half(c0, c1, c2, c3, hb, q3, y, yo, sc):
    """One 128-quant half of a Q2_K/Q3_K block, its four 2-bit planes ``c0..c3`` (and for Q3_K the
    hmask bits ``hb``) against the 128 activations at ``yo``, as 8 int32 lanes; ``sc`` is
    ``bcast_half`` of the half's 8 sub-block scales (int16)."""
    h0 = _q3_hi(hb, 0) if q3 else None
    h1 = _q3_hi(hb, 1) if q3 else None
    h2 = _q3_hi(hb, 2) if q3 else None
    h3 = _q3_hi(hb, 3) if q3 else None
    return vadd(vadd(madd(pick16(sc, 0, 1), _k2_run(c0, h0, load_i8x32(y, yo))),
                     madd(pick16(sc, 2, 3), _k2_run(c1, h1, load_i8x32(y, yo + 32)))),
                vadd(madd(pick16(sc, 4, 5), _k2_run(c2, h2, load_i8x32(y, yo + 64))),
                     madd(pick16(sc, 6, 7), _k2_run(c3, h3, load_i8x32(y, yo + 96)))))


@_fast
def dot_q2_K_q8_K(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_q2_K_q8_K: per block, the min term's FMA, then the quants'."""
    acc = splat_f32x8(0.0)
    for i in range(n // QK_K):
        yb = yo + i * Q8_K_SIZE
        yd = load_f32(y, yb)
        xd, xdmin, sc0, sc1, mins, hb0, hb1, c0, c1, c2, c3, c4, c5, c6, c7 = _k23_unpack(x, i, False)
        acc = fma(splat_f32x8(-yd * xdmin), to_f32(_k2_min_prod(mins, y, yb)), acc)
        acc = fma(splat_f32x8(yd * xd),
                  to_f32(_k23_sumi(c0, c1, c2, c3, c4, c5, c6, c7, hb0, hb1, False, y, yb, sc0, sc1)), acc)
    return hsum_f32x8(acc)


@_fast
def dot_q3_K_q8_K(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_q3_K_q8_K."""
    acc = splat_f32x8(0.0)
    for i in range(n // QK_K):
        yb = yo + i * Q8_K_SIZE
        xd, _, sc0, sc1, _, hb0, hb1, c0, c1, c2, c3, c4, c5, c6, c7 = _k23_unpack(x, i, True)
        acc = fma(splat_f32x8(load_f32(y, yb) * xd),
                  to_f32(_k23_sumi(c0, c1, c2, c3, c4, c5, c6, c7, hb0, hb1, True, y, yb, sc0, sc1)), acc)
    return hsum_f32x8(acc)


@_fast
def vec_dot_q2_K_q8_K(n, x, y):
    return dot_q2_K_q8_K(n, x, y, n - n)  # a non-literal 0: the matmul's specialization


@njit(inline="always")
def _k23_cols(n, x, y, yo, ycs, ybs, nc, acc, out, q3):
    """dot_cols for Q2_K (``q3`` False) and Q3_K: each super-block's eight 2-bit planes and its
    scales unpacked once, then used for every column, whose float lanes wait in ``acc``; per
    column the arithmetic is dot_q2_K/q3_K's (the same FMAs in the same order)."""
    zero = splat_f32x8(0.0)
    for c in range(nc):
        store_f32x8(acc, 4 * ACC_PER_COL * c, zero)
    for i in range(n // QK_K):
        xd, xdmin, sc0, sc1, mins, hb0, hb1, c0, c1, c2, c3, c4, c5, c6, c7 = _k23_unpack(x, i, q3)
        for c in range(nc):
            yb = yo + c * ycs + i * ybs
            yd = load_f32(y, yb)
            a = load_f32x8(acc, 4 * ACC_PER_COL * c)
            if not q3:
                a = fma(splat_f32x8(-yd * xdmin), to_f32(_k2_min_prod(mins, y, yb)), a)
            a = fma(splat_f32x8(yd * xd),
                    to_f32(_k23_sumi(c0, c1, c2, c3, c4, c5, c6, c7, hb0, hb1, q3, y, yb, sc0, sc1)), a)
            store_f32x8(acc, 4 * ACC_PER_COL * c, a)
    _col_sums(acc, 4 * ACC_PER_COL, -1, nc, out)


@_fast
def dot_cols_q2_K_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    _k23_cols(n, x, y, yo, ycs, ybs, nc, acc, out, False)


@_fast
def vec_dot_q3_K_q8_K(n, x, y):
    return dot_q3_K_q8_K(n, x, y, n - n)


@_fast
def dot_cols_q3_K_q8_K(n, x, y, yo, ycs, ybs, nc, acc, out):
    _k23_cols(n, x, y, yo, ycs, ybs, nc, acc, out, True)


# the cache of every kernel above also depends on these files (lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, type_common.__file__, types.__file__, __file__)
