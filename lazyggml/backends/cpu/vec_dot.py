"""Dot products of a weight row with an activation row: GGML's ``vec_dot`` table, for the CPU.

A quantized matmul is a grid of dot products between weight rows (Q4_K, Q6_K, Q8_0, ...) and
activation columns that were quantized ONCE, up front, to the weight type's ``vec_dot_type`` (Q8_K
for the K-quants, Q8_0 for Q4_0/Q8_0/Q5_0, Q8_1 for Q4_1/Q5_1). Both sides then hold small
integers, so the inner loop is integer multiply-adds, and floats appear only once per block:

    Σ_blocks  d_w·d_a · Σ_sub-blocks scale_s · Σ_{e in s} q_w[e]·q_a[e]   (− the min/offset term)

Three kernels per weight type, from slow and obvious to fast:

``vec_dot_<w>_<a>_ref(n, x, y)``
    GGML's ``*_generic`` C code, transcribed: scalar loops, the same integer lanes (``aux32[8]``),
    the same float32 accumulation order, unfused multiplies. The oracle for the others.

``dot_<w>_<a>(n, x, y, yo)``  (``vec_dot_<w>_<a>(n, x, y)`` = the same with yo = 0)
    One row against one column with the SIMD vocabulary of ``simd.py``, following GGML's AVX2
    kernel lane for lane: per block 8 int32 lanes of exact integer sums, converted once and added
    into 8 float lanes with one FMA; the horizontal sum happens once, at the end of the row. With
    FMA hardware the result is bit-identical to GGML's AVX2 ``ggml_vec_dot_*`` (the tests check it).

``dot_cols_<w>_<a>(n, x, y, yo, ycs, ybs, nc, acc, out)``
    One weight row against ``nc`` columns at once (column c's block i is at byte
    ``yo + c*ycs + i*ybs`` of ``y``); ``out[c]`` receives each dot product; ``acc`` holds
    ``acc_floats(n, nc)`` floats. Each weight block
    is unpacked (nibbles split, scales broadcast) ONCE and then used for every column, while the
    per-column float lanes wait in the scratch array ``acc`` (``ACC_PER_COL`` float32 per column,
    in L1). Per (row, column) it does exactly the arithmetic of ``dot_*``, so the results are
    identical; it just skips redoing the unpacking for each column. This is what makes prefill
    faster than GGML's column-by-column ``vec_dot`` loop (see bench/results/mul_mat_cpu.md).

``tile_q4_K_q8_K(n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, acc, out, dst, i3, i2, c0)``
    A whole tile of the matmul (its rows against its columns), for Q4_K: the work that depends
    only on the columns (their min-term table) done once for all rows, then ``dot_cols`` row by row.

``dot2_<w>_<a>(n, x, x2, y, yo)`` and ``dot_cols2_<w>_<a>(n, x, x2, y, yo, ycs, ybs, nc, acc, out)``
    ``dot_*`` and ``dot_cols_*`` of two weight rows at once, on 512-bit vectors: row x in the low
    256 bits, x2 in the high, the activations widened to both halves (``simd.widen_as``, one
    ``vbroadcasti64x4``), so each AVX-512 instruction does both rows' lanes. Per row, the lanes and
    operations of the one-row kernel: the same results, bit for bit. Measured on the dev machine
    (one thread, weights in cache, best of 15), 16 columns: Q4_K 5.2-6.2 -> 4.4-4.7 ns a block and
    column at 768 elements, 5.0-5.4 -> 3.7-3.9 at 2048; Q6_K 4.6-4.9 -> 3.6-3.7 at 768. One column:
    Q6_K 8.5 -> 6.6-7.4 ns a block, but Q4_K 8.6 -> 9.9 at 2048 elements (its two rows' scales are
    unpacked by scalar code and moved into vectors on the shuffle port that the 512-bit
    multiplies also need), so Q4_K has no ``dot2``. Types without them run row by row, and so
    does every type on a CPU without AVX-512BW, where LLVM splits 512-bit operations in two and
    emulates the byte multiply-adds (AMD Zen 3: Q6_K mat-vec 2.2x slower through ``dot2``).

All rows are raw bytes (``uint8`` 1-D arrays, the weight row starting at x[0]; ``yo`` is a byte
offset into y), in GGML's block
layouts (docs/quant-formats.md §1). Float rows (F32/F16/BF16) are bytes too for ``vec_dot_*``;
the matmul's float path uses ``dot_pair_*`` (2 rows, one column) and ``dot_tile_*`` (2 rows ×
3 columns, held in registers) with typed weight rows instead.
Every quantized weight type has all three.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ... import types
from ...cache import tie_cache
from ...types import KVALUES_IQ4NL, QK_K
from . import quant, simd
from .quant import (IQ4_NL_SIZE, IQ4_XS_SIZE, Q2_K_SIZE, Q3_K_SIZE, Q4_0_SIZE, Q4_1_SIZE, Q4_K_SIZE,  # bytes per
                    Q5_0_SIZE, Q5_1_SIZE, Q5_K_SIZE, Q6_K_SIZE, Q8_0_SIZE, Q8_1_SIZE, Q8_K_SIZE)  # block (types.py)
from .quant import TABLE_F32_F16 as _F16
from .quant import fp32_to_fp16 as _fp32_to_fp16
from .simd import (bcast_half, bcast_pair, bf16x8_to_f32, bits_to_bytes, concat, crumb, dot4_acc,
                   f16x8_to_f32, fma, hadd_pairs, hi_half, lookup16, hsum_f32x4, hsum_f32x4_cols, hsum_f32x8,
                   hadd_f32x8_cols, hsum_f32x8_cols, lane, lo_half, load_f32,
                   load_f32x8, load_f32x16, load_i16x8, load_i16x16, load_i8x16, load_i8x32, load_u16, load_u32,
                   madd, madd_acc, maddubs, pick16, sext, splat_f32x4, splat_f32x8, splat_f32x16, splat_i8x32,
                   splat_i32x8, store_f32x8, store_f32x16, store_i16x16, to_f32, transpose_pairs, u32x4_to_i8x16, vabs, vadd, vand, vmul, vor,
                   vsign, vsll, vsrl, vsub, widen_as, zext)


_ref = njit(cache=True)
_fast = njit(cache=True)
#: floats of per-column scratch that ``dot_cols_*`` (16) and ``dot_cols2_*`` (32) need in ``acc``
ACC_PER_COL = 32


# =================================================================================================
# Activation quantizers of GGML's CPU backend (type_traits_cpu[].from_float)
# =================================================================================================
# Q8_K: x86 GGML calls the reference quantizer (quant.quantize_row_q8_K). Q8_0/Q8_1: the AVX2
# code differs from quantize_row_q8_0_ref (quant.py) in two ways that change a few quants: it
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
def _store_f16(y, o, f):
    h = _fp32_to_fp16(f)
    y[o] = h & 0xFF
    y[o + 1] = h >> 8


@_ref
def quantize_row_q8_0_cpu(x, y):
    """x (float32[n]) -> Q8_0 row y, as GGML's x86 AVX2 quantize_row_q8_0."""
    for i in range(x.shape[0] // 32):
        d, _ = _q8_block_cpu(x, 32 * i, y, Q8_0_SIZE * i + 2)
        _store_f16(y, Q8_0_SIZE * i, d)


@_ref
def quantize_row_q8_1_cpu(x, y):
    """x (float32[n]) -> Q8_1 row y (d, s = d*Σq, qs), as GGML's x86 AVX2 quantize_row_q8_1."""
    for i in range(x.shape[0] // 32):
        d, qsum = _q8_block_cpu(x, 32 * i, y, 36 * i + 4)
        _store_f16(y, 36 * i, d)
        _store_f16(y, 36 * i + 2, d * np.float32(qsum))


# =================================================================================================
# Scalar byte readers for the reference kernels (plain code, no SIMD)
# =================================================================================================

@_ref
def _u8(b, o):
    return np.int32(b[o])


@_ref
def _i8(b, o):
    v = np.int32(b[o])
    return v - ((v & 0x80) << 1)


@_ref
def _i16(b, o):
    v = np.int32(b[o]) | (np.int32(b[o + 1]) << 8)
    return v - ((v & 0x8000) << 1)


@_ref
def _u32(b, o):
    return (np.uint32(b[o]) | (np.uint32(b[o + 1]) << 8) | (np.uint32(b[o + 2]) << 16)
            | (np.uint32(b[o + 3]) << 24))


@_ref
def _f16(b, o):
    return _F16[np.int32(b[o]) | (np.int32(b[o + 1]) << 8)]


@_ref
def _f32(b, o):
    return np.uint32(_u32(b, o)).view(np.float32)


@_ref
def _bf16(b, o):
    return np.uint32((np.uint32(b[o]) | (np.uint32(b[o + 1]) << 8)) << 16).view(np.float32)


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
            aux32[l] += scale * (_i8(y, yo + 4 + e0 + l) * a[e0 + l])


@_ref
def _k4_block_ref(x, xo, y, yo, a, sc, mn, aux32, sums):
    """The part of GGML's generic Q4_K/Q5_K dot products after the quants are unpacked into ``a``:
    the scale term goes into the 8 float lanes ``sums``; the min term is returned, to subtract."""
    _scales_mins_k4(x, xo + 4, sc, mn)
    sumi = 0
    for j in range(16):
        sumi += _i16(y, yo + 260 + 2 * j) * mn[j // 2]
    aux32[:] = 0
    _k_lanes_ref(a, y, yo, sc, 8, aux32)
    d = _f16(x, xo) * _f32(y, yo)
    for l in range(8):
        sums[l] += d * np.float32(aux32[l])
    dmin = _f16(x, xo + 2) * _f32(y, yo)
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
                q = _u8(x, xo + 16 + 32 * j + l)
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
                q = _u8(x, xo + 48 + 32 * j + l)
                h = _u8(x, xo + 16 + l)
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
            ql, qh = xo + 64 * h, xo + 128 + 32 * h
            for l in range(32):
                q1, q2, hh = _u8(x, ql + l), _u8(x, ql + 32 + l), _u8(x, qh + l)
                a[128 * h + l] = ((q1 & 0xF) | (((hh >> 0) & 3) << 4)) - 32
                a[128 * h + l + 32] = ((q2 & 0xF) | (((hh >> 2) & 3) << 4)) - 32
                a[128 * h + l + 64] = ((q1 >> 4) | (((hh >> 4) & 3) << 4)) - 32
                a[128 * h + l + 96] = ((q2 >> 4) | (((hh >> 6) & 3) << 4)) - 32
        for s in range(16):
            sc[s] = _i8(x, xo + 192 + s)
        aux32[:] = 0
        _k_lanes_ref(a, y, yo, sc, 16, aux32)
        d = _f16(x, xo + 208) * _f32(y, yo)
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
            summs += _i16(y, yo + 260 + 2 * j) * (_u8(x, xo + j) >> 4)
        dall = _f32(y, yo) * _f16(x, xo + 80)
        dmin = _f32(y, yo) * _f16(x, xo + 82)
        isum = 0
        s = 0
        for k in range(2):           # two halves of 128 elements, 32 qs bytes each
            for j in range(4):       # shift 2j picks the 32-element group
                for half in range(2):
                    d = _u8(x, xo + s) & 0xF
                    s += 1
                    isuml = 0
                    for l in range(16 * half, 16 * half + 16):
                        q = (_u8(x, xo + 16 + 32 * k + l) >> (2 * j)) & 3
                        isuml += _i8(y, yo + 4 + 128 * k + 32 * j + l) * q
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
                    q = (_u8(x, xo + 32 + 32 * j + l) >> (2 * g)) & 3
                    a[128 * j + 32 * g + l] = q - (0 if (_u8(x, xo + l) >> m) & 1 else 4)
                m += 1
        for j in range(16):
            lo = (_u8(x, xo + 96 + j) & 0xF) if j < 8 else (_u8(x, xo + 96 + j - 8) >> 4)
            hi = (_u8(x, xo + 104 + j % 4) >> (2 * (j // 4))) & 3
            sc[j] = (lo | (hi << 4)) - 32
        aux32[:] = 0
        _k_lanes_ref(a, y, yo, sc, 16, aux32)
        d = _f16(x, xo + 108) * _f32(y, yo)
        for l in range(8):
            sums[l] += d * np.float32(aux32[l])
    for l in range(8):
        sumf += sums[l]
    return sumf


@_ref
def vec_dot_q8_0_q8_0_ref(n, x, y):
    """ggml_vec_dot_q8_0_q8_0_generic: sumf += sumi * (dx*dy), block by block."""
    sumf = np.float32(0.0)
    for i in range(n // 32):
        xo, yo = i * Q8_0_SIZE, i * Q8_0_SIZE
        sumi = 0
        for j in range(32):
            sumi += _i8(x, xo + 2 + j) * _i8(y, yo + 2 + j)
        sumf += np.float32(sumi) * (_f16(x, xo) * _f16(y, yo))
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
            q = _u8(x, xo + 2 + j)
            s0 += ((q & 0xF) - 8) * _i8(y, yo + 2 + j)
            s1 += ((q >> 4) - 8) * _i8(y, yo + 2 + j + 16)
        sumf += np.float32(s0 + s1) * _f16(x, xo) * _f16(y, yo)
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
            q = _u8(x, xo + 4 + j)
            s0 += (q & 0xF) * _i8(y, yo + 4 + j)
            s1 += (q >> 4) * _i8(y, yo + 4 + j + 16)
        sumf += (_f16(x, xo) * _f16(y, yo)) * np.float32(s0 + s1) + _f16(x, xo + 2) * _f16(y, yo + 2)
    return sumf


@_ref
def vec_dot_q5_0_q8_0_ref(n, x, y):
    """ggml_vec_dot_q5_0_q8_0_generic: block_q5_0 = d (fp16), qh (u32), qs[16]; 5-bit q − 16."""
    sumf = np.float32(0.0)
    for i in range(n // 32):
        xo, yo = i * Q5_0_SIZE, i * Q8_0_SIZE
        qh = _u32(x, xo + 2)
        s0 = 0
        s1 = 0
        for j in range(16):
            q = _u8(x, xo + 6 + j)
            xh0 = np.int32(((qh >> j) << 4) & 0x10)
            xh1 = np.int32((qh >> (j + 12)) & 0x10)
            s0 += (((q & 0xF) | xh0) - 16) * _i8(y, yo + 2 + j)
            s1 += (((q >> 4) | xh1) - 16) * _i8(y, yo + 2 + j + 16)
        sumf += (_f16(x, xo) * _f16(y, yo)) * np.float32(s0 + s1)
    return sumf


@_ref
def vec_dot_q5_1_q8_1_ref(n, x, y):
    """ggml_vec_dot_q5_1_q8_1_generic: block_q5_1 = d, m (fp16), qh (u32), qs[16]."""
    sumf = np.float32(0.0)
    for i in range(n // 32):
        xo, yo = i * Q5_1_SIZE, i * Q8_1_SIZE
        qh = _u32(x, xo + 4)
        s0 = 0
        s1 = 0
        for j in range(16):
            q = _u8(x, xo + 8 + j)
            xh0 = np.int32(((qh >> j) << 4) & 0x10)
            xh1 = np.int32((qh >> (j + 12)) & 0x10)
            s0 += ((q & 0xF) | xh0) * _i8(y, yo + 4 + j)
            s1 += ((q >> 4) | xh1) * _i8(y, yo + 4 + j + 16)
        sumf += (_f16(x, xo) * _f16(y, yo)) * np.float32(s0 + s1) + _f16(x, xo + 2) * _f16(y, yo + 2)
    return sumf


@_ref
def vec_dot_iq4_nl_q8_0_ref(n, x, y):
    """ggml_vec_dot_iq4_nl_q8_0_generic: block_iq4_nl = d (fp16), qs[16] of level indices."""
    kv = KVALUES_IQ4NL
    sumf = np.float32(0.0)
    for i in range(n // 32):
        xo, yo = i * Q4_0_SIZE, i * Q8_0_SIZE
        s0 = 0
        s1 = 0
        for j in range(16):
            q = _u8(x, xo + 2 + j)
            s0 += _i8(y, yo + 2 + j) * kv[q & 0xF]
            s1 += _i8(y, yo + 2 + j + 16) * kv[q >> 4]
        sumf += (_f16(y, yo) * _f16(x, xo)) * np.float32(s0 + s1)
    return sumf


@_ref
def vec_dot_iq4_xs_q8_K_ref(n, x, y):
    """ggml_vec_dot_iq4_xs_q8_K_generic: per super-block d·d8, then per sub-block of 32 its 6-bit
    scale ls − 32 (low nibble from scales_l, high bits from scales_h)."""
    kv = KVALUES_IQ4NL
    sumf = np.float32(0.0)
    for i in range(n // QK_K):
        xo, yo = i * IQ4_XS_SIZE, i * Q8_K_SIZE
        d4d8 = _f16(x, xo) * _f32(y, yo)
        h = np.int64(_u8(x, xo + 2)) | (np.int64(_u8(x, xo + 3)) << 8)
        for ib in range(8):
            ls = ((_u8(x, xo + 4 + ib // 2) >> (4 * (ib % 2))) & 0xF) | (((h >> (2 * ib)) & 3) << 4)
            s0 = 0
            s1 = 0
            for j in range(16):
                q = _u8(x, xo + 8 + 16 * ib + j)
                s0 += _i8(y, yo + 4 + 32 * ib + j) * kv[q & 0xF]
                s1 += _i8(y, yo + 4 + 32 * ib + j + 16) * kv[q >> 4]
            sumf += (d4d8 * np.float32(ls - 32)) * np.float32(s0 + s1)
    return sumf


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
        s += np.float64(_f16(x, 2 * i)) * np.float64(_f16(y, 2 * i))
    return np.float32(s)


@_ref
def vec_dot_bf16_ref(n, x, y):
    """ggml_vec_dot_bf16's scalar tail: float64 sum of decoded products."""
    s = 0.0
    for i in range(n):
        s += np.float64(_bf16(x, 2 * i)) * np.float64(_bf16(y, 2 * i))
    return np.float32(s)


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
    ms = _k4_scales_mins(x, xb + 4)
    return _F16[load_u16(x, xb)], _F16[load_u16(x, xb + 2)], ms, hi_half(ms)


@njit(inline="always")
def _k4_min_prod(mins, y, yb):
    """4 int32 lanes m[2u]·q8s[2u] + m[2u+1]·q8s[2u+1], where q8s[s] = bsums[2s] + bsums[2s+1] is
    the sum of the 32 activations of sub-block s (GGML: _mm_hadd_epi16 + _mm_madd_epi16). With
    the mins of two rows side by side (``dot2_*``), 4 lanes for each."""
    return madd(mins, widen_as(hadd_pairs(load_i16x16(y, yb + 260)), mins))


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
    s0 = madd_acc(madd(pick16(sc, 0, 0), maddubs(l0, widen_as(load_i8x32(y, yb + 4), l0))),
                  pick16(sc, 1, 1), maddubs(h0, widen_as(load_i8x32(y, yb + 36), l0)))
    s1 = madd_acc(madd(pick16(sc, 2, 2), maddubs(l1, widen_as(load_i8x32(y, yb + 68), l0))),
                  pick16(sc, 3, 3), maddubs(h1, widen_as(load_i8x32(y, yb + 100), l0)))
    s2 = madd_acc(madd(pick16(sc, 4, 4), maddubs(l2, widen_as(load_i8x32(y, yb + 132), l0))),
                  pick16(sc, 5, 5), maddubs(h2, widen_as(load_i8x32(y, yb + 164), l0)))
    s3 = madd_acc(madd(pick16(sc, 6, 6), maddubs(l3, widen_as(load_i8x32(y, yb + 196), l0))),
                  pick16(sc, 7, 7), maddubs(h3, widen_as(load_i8x32(y, yb + 228), l0)))
    return s0, s1, s2, s3


@njit(inline="always")
def _k4_sumi(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, sc):
    """The four parts of ``_k4_sumi_parts`` added: the block's Σ_s sc_s · Σ q·q8 as 8 int32 lanes."""
    s0, s1, s2, s3 = _k4_sumi_parts(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, sc)
    return vadd(vadd(s0, s1), vadd(s2, s3))


@njit(inline="always")
def _rows2(x, x2, o):
    """The 32 bytes at ``o`` of row ``x`` and of row ``x2``, side by side in one 512-bit vector."""
    return concat(load_i8x32(x, o), load_i8x32(x2, o))


@njit(inline="always")
def _q4_K_nibbles(q0, q1, q2, q3):
    """Nibbles of one Q4_K block's quants ``q_j`` (32 bytes, or 64: two rows): chunk j's bytes give
    sub-block 2j (low) and 2j+1 (high)."""
    m4 = widen_as(splat_i8x32(0xF), q0)
    return (vand(q0, m4), vand(vsrl(q0, 4), m4), vand(q1, m4), vand(vsrl(q1, 4), m4),
            vand(q2, m4), vand(vsrl(q2, 4), m4), vand(q3, m4), vand(vsrl(q3, 4), m4))


@njit(inline="always")
def _q4_K_unpack(x, xb):
    return _q4_K_nibbles(load_i8x32(x, xb + 16), load_i8x32(x, xb + 48), load_i8x32(x, xb + 80),
                         load_i8x32(x, xb + 112))


@njit(inline="always")
def _q4_K_unpack2(x, x2, xb):
    return _q4_K_nibbles(_rows2(x, x2, xb + 16), _rows2(x, x2, xb + 48), _rows2(x, x2, xb + 80),
                         _rows2(x, x2, xb + 112))


@njit(inline="always")
def _q5_K_unpack(x, xb):
    """Q4_K's nibbles plus bit 2j (low) / 2j+1 (high) of qh[l] as +16."""
    m4 = splat_i8x32(0xF)
    b4 = splat_i8x32(0x10)
    hb = load_i8x32(x, xb + 16)
    q0 = load_i8x32(x, xb + 48)
    q1 = load_i8x32(x, xb + 80)
    q2 = load_i8x32(x, xb + 112)
    q3 = load_i8x32(x, xb + 144)
    return (vor(vand(q0, m4), vand(vsll(hb, 4), b4)), vor(vand(vsrl(q0, 4), m4), vand(vsll(hb, 3), b4)),
            vor(vand(q1, m4), vand(vsll(hb, 2), b4)), vor(vand(vsrl(q1, 4), m4), vand(vsll(hb, 1), b4)),
            vor(vand(q2, m4), vand(hb, b4)), vor(vand(vsrl(q2, 4), m4), vand(vsrl(hb, 1), b4)),
            vor(vand(q3, m4), vand(vsrl(hb, 2), b4)), vor(vand(vsrl(q3, 4), m4), vand(vsrl(hb, 3), b4)))


# ------------------------------------------------------------------------------------------------
# Q4_K x Q8_K
# ------------------------------------------------------------------------------------------------

@_fast
def _col_sums(acc, cst, mins, nc, out):
    """The end of a row's ``dot_cols_*``: ``out[c]`` = ``hsum_f32x8`` of the 8 float lanes at byte
    ``cst * c`` of ``acc``, plus, where ``mins >= 0``, ``hsum_f32x4`` of the 4 at byte ``cst * c + mins``
    (the K-quants' min term). Eight columns at a time through ``simd.hsum_*_cols``: the same sums in
    the same order, with ~half the instructions; with rows of one super-block (a 3.7M model's, whose
    n_embd is 256) that end is a fifth of a tile's work."""
    c = 0
    while c + 8 <= nc:
        s = hsum_f32x8_cols(load_f32x8(acc, cst * c), load_f32x8(acc, cst * (c + 1)), load_f32x8(acc, cst * (c + 2)),
                            load_f32x8(acc, cst * (c + 3)), load_f32x8(acc, cst * (c + 4)), load_f32x8(acc, cst * (c + 5)),
                            load_f32x8(acc, cst * (c + 6)), load_f32x8(acc, cst * (c + 7)))
        if mins >= 0:
            o = cst * c + mins
            s = vadd(s, hsum_f32x4_cols(lo_half(load_f32x8(acc, o)), lo_half(load_f32x8(acc, o + cst)),
                                        lo_half(load_f32x8(acc, o + 2 * cst)), lo_half(load_f32x8(acc, o + 3 * cst)),
                                        lo_half(load_f32x8(acc, o + 4 * cst)), lo_half(load_f32x8(acc, o + 5 * cst)),
                                        lo_half(load_f32x8(acc, o + 6 * cst)), lo_half(load_f32x8(acc, o + 7 * cst))))
        store_f32x8(out, 4 * c, s)
        c += 8
    for c in range(c, nc):
        s = hsum_f32x8(load_f32x8(acc, cst * c))
        if mins >= 0:
            s += hsum_f32x4(lo_half(load_f32x8(acc, cst * c + mins)))
        out[c] = s


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
        dmin = -yd * _F16[load_u16(x, xb + 2)]   # sign folded in, so the min term is an FMA too
        ms = _k4_scales_mins(x, xb + 4)
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

#: bytes of the min table per super-block and group of 8 columns: the four pair vectors, 8 d's
K4_TABLE_BYTES = 160


@njit(cache=True)
def acc_floats(n, nc):
    """Floats of scratch ``acc`` that ``dot_cols_*`` / ``tile_*`` need for nc columns of n elements:
    ``ACC_PER_COL`` per column, then the Q4_K min table (``_k4_min_table``)."""
    return ACC_PER_COL * nc + (n // QK_K) * (nc // 8) * (K4_TABLE_BYTES // 4)


@njit(inline="always")
def _zero_cols(acc, nc, nvec):
    """Zero the first ``nvec`` 8-float lane vectors of each of nc columns' accumulators in ``acc``
    (``dot_cols_*``'s layout: 16 floats, 64 bytes, a column)."""
    zero = splat_f32x8(0.0)
    for c in range(nc):
        for v in range(nvec):
            store_f32x8(acc, 64 * c + 32 * v, zero)


@_fast
def _k4_min_table(n, y, yo, ycs, ybs, nc, acc):
    """The min table of nc columns (whole groups of 8) at byte 4·ACC_PER_COL·nc of acc: per super-block
    i and group g, at K4_TABLE_BYTES·(i·(nc // 8) + g) past it, ``transpose_pairs(u, ...)`` of the
    8 columns' q8s for u = 0..3 (32 bytes each), then their 8 d's."""
    t = 4 * ACC_PER_COL * nc
    for i in range(n // QK_K):
        for g in range(nc // 8):
            yb = yo + 8 * g * ycs + i * ybs
            q0, q1 = hadd_pairs(load_i16x16(y, yb + 260)), hadd_pairs(load_i16x16(y, yb + ycs + 260))
            q2, q3 = hadd_pairs(load_i16x16(y, yb + 2 * ycs + 260)), hadd_pairs(load_i16x16(y, yb + 3 * ycs + 260))
            q4, q5 = hadd_pairs(load_i16x16(y, yb + 4 * ycs + 260)), hadd_pairs(load_i16x16(y, yb + 5 * ycs + 260))
            q6, q7 = hadd_pairs(load_i16x16(y, yb + 6 * ycs + 260)), hadd_pairs(load_i16x16(y, yb + 7 * ycs + 260))
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
        xdmin = concat(splat_f32x4(_F16[load_u16(x, xb + 2)]), splat_f32x4(_F16[load_u16(x2, xb + 2)]))
        ms, ms2 = _k4_scales_mins(x, xb + 4), _k4_scales_mins(x2, xb + 4)
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
        dmin = -yd * _F16[load_u16(x, xb + 2)]
        ms = _k4_scales_mins(x, xb + 4)
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


@njit(inline="always")
def _fmaf(a, b, c):
    """a*b + c on float32 scalars, fused where the target has FMA: GCC contracts GGML's C
    ``summs += dmin * x`` the same way."""
    return fma(np.float32(a), np.float32(b), np.float32(c))


# ------------------------------------------------------------------------------------------------
# Q6_K x Q8_K: 6-bit unsigned q (0..63), 16 int8 scales; the −32 goes through the bsums
# ------------------------------------------------------------------------------------------------

@njit(inline="always")
def _q6_K_unpack(x, xb, h):
    """The 4 vectors of 32 six-bit quants (0..63) of half h (128 elements): element l, l+32, l+64,
    l+96 of the half (docs/quant-formats.md §1.8); low 4 bits from ql, high 2 bits from qh."""
    return _q6_K_quants(load_i8x32(x, xb + 64 * h), load_i8x32(x, xb + 64 * h + 32),
                        load_i8x32(x, xb + 128 + 32 * h))


@njit(inline="always")
def _q6_K_unpack2(x, x2, xb, h):
    """_q6_K_unpack of rows x and x2 side by side."""
    return _q6_K_quants(_rows2(x, x2, xb + 64 * h), _rows2(x, x2, xb + 64 * h + 32),
                        _rows2(x, x2, xb + 128 + 32 * h))


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
    o = yb + 4 + 128 * h
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
    corr = vsll(madd(widen_as(load_i16x16(y, yb + 260), sc16), sc16), 5)
    return vsub(vadd(_q6_K_half(y, yb, 0, a0, a1, a2, a3, bcast_half(sc16, 0)),
                     _q6_K_half(y, yb, 1, b0, b1, b2, b3, bcast_half(sc16, 1))), corr)


@_fast
def dot_q6_K_q8_K(n, x, y, yo):
    """GGML's AVX2 ggml_vec_dot_q6_K_q8_K, lane for lane."""
    acc = splat_f32x8(0.0)
    for i in range(n // QK_K):
        xb = i * Q6_K_SIZE
        yb = yo + i * Q8_K_SIZE
        d = load_f32(y, yb) * _F16[load_u16(x, xb + 208)]
        sc16 = sext(load_i8x16(x, xb + 192))
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
        xd = _F16[load_u16(x, xb + 208)]
        sc16 = sext(load_i8x16(x, xb + 192))
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
        d = concat(splat_f32x8(yd * _F16[load_u16(x, xb + 208)]), splat_f32x8(yd * _F16[load_u16(x2, xb + 208)]))
        sc16 = concat(sext(load_i8x16(x, xb + 192)), sext(load_i8x16(x2, xb + 192)))
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
        xd = concat(splat_f32x8(_F16[load_u16(x, xb + 208)]), splat_f32x8(_F16[load_u16(x2, xb + 208)]))
        sc16 = concat(sext(load_i8x16(x, xb + 192)), sext(load_i8x16(x2, xb + 192)))
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
# Q8_0 x Q8_0 and Q4_0 x Q8_0: 32-element blocks, signed x signed bytes
# ------------------------------------------------------------------------------------------------

@njit(inline="always")
def _q8_block_f32(ax, sx, qy):
    """float(Σ_4 x·y) in 8 lanes: x·y = |x|·sign(y, x), an unsigned x signed product
    (GGML's mul_sum_i8_pairs_float; with VNNI one vpdpbusd)."""
    return to_f32(dot4_acc(splat_i32x8(0), ax, vsign(qy, sx)))


@njit(inline="always")
def _q4_0_unpack(x, xb):
    """Q4_0's 16 bytes -> 32 signed quants: low nibbles are elements 0-15, high 16-31, minus 8."""
    raw = load_i8x16(x, xb + 2)
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
        qx = load_i8x32(x, xb + 2)
        acc = fma(splat_f32x8(d), _q8_block_f32(vabs(qx), qx, load_i8x32(y, yb + 2)), acc)
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
        acc = fma(splat_f32x8(d), _q8_block_f32(vabs(qx), qx, load_i8x32(y, yb + 2)), acc)
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
        x0 = load_i8x32(x, xb0 + 2)
        x1 = load_i8x32(x, xb0 + xbs + 2)
        x2 = load_i8x32(x, xb0 + 2 * xbs + 2)
        x3 = load_i8x32(x, xb0 + 3 * xbs + 2)
    a0, a1, a2, a3 = vabs(x0), vabs(x1), vabs(x2), vabs(x3)
    d0 = _F16[load_u16(x, xb0)]
    d1 = _F16[load_u16(x, xb0 + xbs)]
    d2 = _F16[load_u16(x, xb0 + 2 * xbs)]
    d3 = _F16[load_u16(x, xb0 + 3 * xbs)]
    for c in range(nc):
        yb = yb0 + c * ycs
        a = load_f32x8(acc, 64 * c)
        a = fma(splat_f32x8(d0 * _F16[load_u16(y, yb)]), _q8_block_f32(a0, x0, load_i8x32(y, yb + 2)), a)
        yb += ybs
        a = fma(splat_f32x8(d1 * _F16[load_u16(y, yb)]), _q8_block_f32(a1, x1, load_i8x32(y, yb + 2)), a)
        yb += ybs
        a = fma(splat_f32x8(d2 * _F16[load_u16(y, yb)]), _q8_block_f32(a2, x2, load_i8x32(y, yb + 2)), a)
        yb += ybs
        a = fma(splat_f32x8(d3 * _F16[load_u16(y, yb)]), _q8_block_f32(a3, x3, load_i8x32(y, yb + 2)), a)
        store_f32x8(acc, 64 * c, a)


@njit(inline="always")
def _q8_0_cols_1(x, xb, y, yb0, ycs, nc, acc, q4):
    if q4:
        qx = _q4_0_unpack(x, xb)
    else:
        qx = load_i8x32(x, xb + 2)
    ax = vabs(qx)
    dx = _F16[load_u16(x, xb)]
    for c in range(nc):
        yb = yb0 + c * ycs
        a = fma(splat_f32x8(dx * _F16[load_u16(y, yb)]), _q8_block_f32(ax, qx, load_i8x32(y, yb + 2)),
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
def _nibbles(x, o):
    """16 bytes at ``o`` -> 32 quants: low nibbles are elements 0-15, high ones 16-31."""
    raw = load_i8x16(x, o)
    m4 = simd.splat_i8x16(0xF)
    return concat(vand(raw, m4), vand(vsrl(raw, 4), m4))


@njit(inline="always")
def _legacy_unpack(x, xb, kind):
    """One block's 32 quants: kind 0 = Q4_1 (0..15), 1 = Q5_0 (−16..15), 2 = Q5_1 (0..31)."""
    if kind == 0:
        return _nibbles(x, xb + 4)
    if kind == 1:
        return vsub(vor(_nibbles(x, xb + 6), _q5_high_bits(x, xb + 2)), splat_i8x32(16))
    return vor(_nibbles(x, xb + 8), _q5_high_bits(x, xb + 4))


@njit(inline="always")
def _legacy_block(x, xb, y, yb, kind, qx, acc, summs):
    """Block ``xb`` of x (already unpacked to ``qx``) against block ``yb`` of y: GGML's
    ``acc = fma(dx·dy, float(lanes), acc)`` and, with a min, ``summs += m·s`` (fused, as GCC
    compiles it)."""
    d = _F16[load_u16(x, xb)] * _F16[load_u16(y, yb)]
    if kind == 1:
        return fma(splat_f32x8(d), _q8_block_f32(vabs(qx), qx, load_i8x32(y, yb + 2)), acc), summs
    summs = _fmaf(_F16[load_u16(x, xb + 2)], _F16[load_u16(y, yb + 2)], summs)
    return fma(splat_f32x8(d), to_f32(dot4_acc(splat_i32x8(0), qx, load_i8x32(y, yb + 4))), acc), summs


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
    a0, a1, a2 = load_u32(x, xb + 96), load_u32(x, xb + 100), load_u32(x, xb + 104)
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
        hb0 = load_i8x32(x, xb)
        c0, c1, c2, c3 = _crumbs(x, xb + 32)
        c4, c5, c6, c7 = _crumbs(x, xb + 64)
        return (_F16[load_u16(x, xb + 108)], np.float32(0.0), bcast_half(scales, 0), bcast_half(scales, 1),
                scales, hb0, vsrl(hb0, 4), c0, c1, c2, c3, c4, c5, c6, c7)
    xb = i * Q2_K_SIZE
    m4 = simd.splat_i8x16(0xF)
    ms = load_i8x16(x, xb)
    scales = sext(vand(ms, m4))
    none = splat_i8x32(0)
    c0, c1, c2, c3 = _crumbs(x, xb + 16)
    c4, c5, c6, c7 = _crumbs(x, xb + 48)
    return (_F16[load_u16(x, xb + 80)], _F16[load_u16(x, xb + 82)], bcast_half(scales, 0), bcast_half(scales, 1),
            sext(vand(vsrl(ms, 4), m4)), none, none, c0, c1, c2, c3, c4, c5, c6, c7)


@njit(inline="always")
def _k23_sumi(c0, c1, c2, c3, c4, c5, c6, c7, hb0, hb1, q3, y, yb, sc0, sc1):
    """A Q2_K/Q3_K block's Σ_s sc_s · Σ q·q8 (``_k23_unpack``'s pieces) as 8 int32 lanes."""
    return vadd(_k23_half(c0, c1, c2, c3, hb0, q3, y, yb + 4, sc0),
                _k23_half(c4, c5, c6, c7, hb1, q3, y, yb + 132, sc1))


@njit(inline="always")
def _k2_min_prod(mins, y, yb):
    """Q2_K's Σ_s m_s·bsum_s of one block as 8 int32 lanes (madd of the 16 mins and bsums)."""
    return madd(mins, load_i16x16(y, yb + 4 + QK_K))


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
    q = _iq4_levels(x, xb + 2)
    return fma(splat_f32x8(d), _q8_block_f32(vabs(q), q, load_i8x32(y, yb + 2)), acc)


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
        q = _iq4_levels(x, xb + 2)
        sumi = simd.hsum_i32(dot4_acc(splat_i32x8(0), vabs(q), vsign(load_i8x32(y, yb + 2), q)))
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
    sh = np.int32(load_u16(x, xb + 2))
    s1 = splat_i32x8(0)
    s2 = splat_i32x8(0)
    for ib in range(0, 8, 2):
        q1 = _iq4_levels(x, xb + 8 + 16 * ib)
        q2 = _iq4_levels(x, xb + 24 + 16 * ib)
        p1 = maddubs(vabs(q1), vsign(load_i8x32(y, yb + 4 + 32 * ib), q1))
        p2 = maddubs(vabs(q2), vsign(load_i8x32(y, yb + 36 + 32 * ib), q2))
        sl = np.int32(x[xb + 4 + ib // 2])
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
        q0, q1 = _iq4_levels(x, xb0 + 2), _iq4_levels(x, xb1 + 2)
        a0, a1 = vabs(q0), vabs(q1)
        d0, d1 = _F16[load_u16(x, xb0)], _F16[load_u16(x, xb1)]
        for c in range(nc):
            yb = yo + c * ycs + ib * ybs
            o = 4 * ACC_PER_COL * c
            store_f32x8(acc, o, fma(splat_f32x8(_F16[load_u16(y, yb)] * d0),
                                    _q8_block_f32(a0, q0, load_i8x32(y, yb + 2)), load_f32x8(acc, o)))
            store_f32x8(acc, o + 32, fma(splat_f32x8(_F16[load_u16(y, yb + ybs)] * d1),
                                         _q8_block_f32(a1, q1, load_i8x32(y, yb + ybs + 2)), load_f32x8(acc, o + 32)))
        ib += 2
    for c in range(nc):
        o = 4 * ACC_PER_COL * c
        sumf = hsum_f32x8(vadd(load_f32x8(acc, o), load_f32x8(acc, o + 32)))
        if ib < nb:
            xb, yb = ib * IQ4_NL_SIZE, yo + c * ycs + ib * ybs
            q = _iq4_levels(x, xb + 2)
            sumi = simd.hsum_i32(dot4_acc(splat_i32x8(0), vabs(q), vsign(load_i8x32(y, yb + 2), q)))
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


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, quant.__file__, types.__file__, __file__)
