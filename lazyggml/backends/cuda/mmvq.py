"""mmvq: quantized matrix times a few vectors (GGML's ``mul_mat_vec_q``, docs/quant-formats.md §6.2-6.3).

Used for ``mul_mat(W, x)`` with W in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL or IQ4_XS and x of at most 8 columns (decoding); for the types without mmq (all but Q4_K),
2-D products of up to ``MMVQ_GROUPED_MAX_COLS`` columns too, a launch per group of 8 columns
(``launch_mmvq``'s ``cols``: a group's q8_1 blocks and results are runs of the views).
x is first quantized to q8_1 (``quantize.py``); each output is then a sum of integer dot products
of weight quants with activation quants, scaled per block.

**Who does what.** Each warp owns two rows of W and all ``ncols`` columns of x; a CUDA block is
``MMVQ_NWARPS`` = 4 such warps, each on its own rows (so no block-wide reduction and no barrier).
The 32 lanes of a warp split into ``next_pow2(ncols)`` groups of ``32/next_pow2(ncols)`` lanes, one
group per column (groups past the last column repeat it and write nothing). Within a group, a weight
block of ``qk`` values is shared by ``qi/vdr`` lanes: ``qi`` is the number of int32s of quants in the
block, ``vdr`` ("vec dot ratio") how many of them one lane takes. Lane ``l`` of a group starts at
weight block ``kbx = l / (qi/vdr)`` with quant offset ``iqs = vdr·(l % (qi/vdr))`` and steps by
``group size·vdr/qi`` blocks; its partner activation blocks start at ``kby = kbx·qk/32``.

| type | qk | qi | vdr | lanes per block | blocks per group and iteration, 1 column / 8 columns |
| --- | --- | --- | --- | --- | --- |
| Q4_K, Q5_K, Q6_K, IQ4_XS | 256 | 32 | 8 | 4 | 8 / 1 |
| Q2_K, Q3_K | 256 | 16 | 8 | 2 | 16 / 2 |
| Q8_0 | 32 | 8 | 8 | 1 | 32 / 4 |
| Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL | 32 | 4 | 4 | 1 | 32 / 4 |

GGML gives Q4_K ``vdr = 2`` (16 threads per super-block) and Q6_K ``vdr = 1``. Here a lane takes a
whole 64-value chunk of Q4_K, so the block's scales, ``d`` and ``dmin`` are decoded once per 64
values instead of per 16, and its 32 bytes of quants come in two 16-byte loads (``load_int4``);
the old n = 1 kernel was bound by instruction issue, not by memory, and this cuts its instructions
per weight about fourfold. The types added later follow that design (GGML's ``vdr``: Q5_K 2,
IQ4_XS 4, Q2_K and Q3_K 1, IQ4_NL, Q4_0, Q4_1, Q5_0 and Q5_1 2, Q8_0 2): Q5_K and IQ4_XS take Q4_K's
64-value chunk; Q2_K and Q3_K a 128-value half, all 32 of its quant bytes, whose four 2-bit fields
belong to four q8_1 blocks (read in nine 16-byte loads, ``_q8_1_quad``); the 32-value types a whole
block (measured on an H200 at n = 1: Q8_0 43 → 23 µs, Q5_1 34 → 15 µs, Q4_1 14.2 → 13.6 µs).

**Two rows per warp.** Each lane computes its share for both rows with the same activations: the
compiler loads and sums an activation chunk once for the two ``vec_dot`` calls (measured on an
H200: n = 8 went from 94 to 64 µs, n = 1 from 11.5 to 9.9 µs).

**Reduction.** Each lane keeps two partial sums; a butterfly over its group's lanes
(``warp_reduce_sum`` with the group's width) adds them, and the group's first lane writes.

**MUL_MAT_ID** (``launch_mmvq_id``): the one-column kernel built with ``moe``, laid out as GGML's
(``ncols_dst = 1`` with ids): grid y walks a token's expert slots and z its tokens; each CUDA
block reads its pair's expert id on the device and skips the pair when the id is out of range.
Built without ``moe``, the kernel has no ids code (a constant of the closure: compiled out).

Weights come as two views of the same bytes: ``int32`` (``uint16`` for the 2-byte aligned Q8_0,
Q4_0, Q5_0 and IQ4_NL blocks) for quants and scales, and ``float16`` for the block scales
``d``/``dmin``; the q8_1 activations likewise (``int32`` and ``float16``), all 2-D with one row
per block. The int32 views of Q3_K and Q6_K are flat: their blocks are 110 and 210 bytes
(``_block_u2``). The wide loads need the tensor at an aligned offset (``ALIGN``).
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import libdevice

from ...types import KVALUES_IQ4NL, Type
from .common import (SIM, device, jit_kernel, F32_ZERO, MATRIX_ROW_PADDING, QK8_1, cdiv, dp4a, half2_float2,
                     load_int2, load_int4, round_up, warp_reduce_sum)

MMVQ_MAX_BATCH_SIZE = 8
# A 2-D product of up to this many columns runs mmvq on groups of 8 (ops.py), reading the weights
# once per group: up to here those ncols/8 passes still cost less than dequantizing the weights to
# F16 for a GEMM (GGML takes mmq here, which lazyggml has for Q4_K only)
MMVQ_GROUPED_MAX_COLS = 64

M4 = np.int32(0x0F0F0F0F)     # low nibble of each byte
M2 = np.int32(0x03030303)     # low two bits of each byte
ONES = np.int32(0x01010101)   # dp4a(ONES, u, 0) = sum of u's four bytes
I0 = np.int32(0)


# -- the K-quants' shared parts: Q4_K's and Q5_K's scales, integer dots, q8_1 loads ----------------
@device
def _scales_q4_K(s1, s2, s3, c):
    """The 6-bit scales and mins of sub-blocks 2c, 2c+1 (docs/quant-formats.md §2, §6.2), as the two
    bytes of ``sc`` and ``m``, from scale ints 1..3 (bytes 0..11). Chunks 0, 1 keep theirs in the
    low 6 bits of bytes 0..7; chunks 2, 3 combine a nibble of bytes 8..11 with the top two bits of
    bytes 0..7. Written without a branch (``c`` differs between the lanes of a warp): for ``c < 2`` the nibble mask is 0."""
    sh = 16 * (c % 2)                          # the 16-bit half of each int that holds this pair
    hi = c // 2
    nib = np.int32(0x0F0F * hi)
    top = 2 * hi
    top_mask = np.int32(0x3F3F - 0x0F0F * hi)  # 0x3F3F (6 bits) or 0x3030 (2 bits, shifted up)
    sc = ((s3 >> sh) & nib) | ((s1 >> (sh + top)) & top_mask)
    m = ((s3 >> (sh + 4)) & nib) | ((s2 >> (sh + top)) & top_mask)
    return np.int32(sc), np.int32(m)


@device
def _dot_k(q, shift, bits, qh, hshift, u, i0, n):
    """The K-quants' integer dot product over ints ``i0 .. i0+n-1`` of the 8 ints ``q`` against the
    q8_1 quants ``u`` (n = 8: a 32-value block; n = 4: a 16-value half, which Q2_K and Q3_K scale
    on its own): Σ q·u and Σ u.

    A value's low ``bits`` bits are bits ``shift ..`` of its byte of ``q[i]``; its top bit (Q3_K,
    Q5_K) is bit ``hshift`` of its byte of ``qh[i]``, put above them (``qh = Z8`` for the types
    without: the compiler drops the term). Σ u is counted from u's quants, as GGML's mmvq does
    (dp4a with ones)."""
    mask = ONES * ((1 << bits) - 1)
    d = s = I0
    for i in range(i0, i0 + n):
        d = dp4a(((q[i] >> shift) & mask) | (((qh[i] >> hshift) & ONES) << bits), u[i], d)
        s = dp4a(ONES, u[i], s)
    return d, s


Z8 = (I0,) * 8   # no high bits


@device
def _q8_1_pair(vy, p):
    """q8_1 blocks ``p/9`` and ``p/9 + 1`` (ints ``p .. p+17``, 8-byte aligned: ``p/9`` is even and a
    q8_1 row of 512-padded values is 576·k bytes) as nine 8-byte loads: (d, quants) of each."""
    h0, a0 = load_int2(vy, p)
    a1, a2 = load_int2(vy, p + 2)
    a3, a4 = load_int2(vy, p + 4)
    a5, a6 = load_int2(vy, p + 6)
    a7, h1 = load_int2(vy, p + 8)
    b0, b1 = load_int2(vy, p + 10)
    b2, b3 = load_int2(vy, p + 12)
    b4, b5 = load_int2(vy, p + 14)
    b6, b7 = load_int2(vy, p + 16)
    return ((half2_float2(h0)[0], (a0, a1, a2, a3, a4, a5, a6, a7)),
            (half2_float2(h1)[0], (b0, b1, b2, b3, b4, b5, b6, b7)))


@device
def _q8_1_quad(vy, p):
    """q8_1 blocks ``p/9 .. p/9 + 3`` (144 bytes, 16-byte aligned: ``p/9`` is a multiple of 4) as
    nine 16-byte loads: (d, quants) of each."""
    h0, a0, a1, a2 = load_int4(vy, p)
    a3, a4, a5, a6 = load_int4(vy, p + 4)
    a7, h1, b0, b1 = load_int4(vy, p + 8)
    b2, b3, b4, b5 = load_int4(vy, p + 12)
    b6, b7, h2, c0 = load_int4(vy, p + 16)
    c1, c2, c3, c4 = load_int4(vy, p + 20)
    c5, c6, c7, h3 = load_int4(vy, p + 24)
    e0, e1, e2, e3 = load_int4(vy, p + 28)
    e4, e5, e6, e7 = load_int4(vy, p + 32)
    return ((half2_float2(h0)[0], (a0, a1, a2, a3, a4, a5, a6, a7)),
            (half2_float2(h1)[0], (b0, b1, b2, b3, b4, b5, b6, b7)),
            (half2_float2(h2)[0], (c0, c1, c2, c3, c4, c5, c6, c7)),
            (half2_float2(h3)[0], (e0, e1, e2, e3, e4, e5, e6, e7)))


# -- Q4_K (block_q4_K: 36 ints = dm | scales[12] | qs[128]) -----------------------------------------
@device
def _vec_dot_q45_K(dm, s1, s2, s3, c, q, qh, vy, kby):
    """Chunk ``c`` (64 values) of a Q4_K or Q5_K super-block: header int ``dm`` and scale ints
    ``s1..s3``, its 8 ints of nibbles ``q``, the 8 ints of fifth bits ``qh`` (``Z8`` for Q4_K).

    The nibbles' low halves are sub-block 2c (fifth bit ``2c`` of qh's bytes), their high halves
    sub-block 2c+1 (bit ``2c+1``), against q8_1 blocks ``kby + 2c`` and ``kby + 2c + 1``."""
    sc, m = _scales_q4_K(s1, s2, s3, c)
    (d8a, a), (d8b, b) = _q8_1_pair(vy, np.uint32(kby + 2 * c) * 9)
    dot_a, sum_a = _dot_k(q, 0, 4, qh, 2 * c, a, 0, 8)
    dot_b, sum_b = _dot_k(q, 4, 4, qh, 2 * c + 1, b, 0, 8)
    d, dmin = half2_float2(dm)
    sumf_d = d8a * np.float32(np.int32(dot_a * (sc & 0xFF))) + d8b * np.float32(np.int32(dot_b * (sc >> 8)))
    sumf_m = d8a * np.float32(np.int32(sum_a * (m & 0xFF))) + d8b * np.float32(np.int32(sum_b * (m >> 8)))
    return d * sumf_d - dmin * sumf_m


@device
def vec_dot_q4_K_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """One lane's share of one Q4_K super-block: chunk ``c = iqs/8`` (64 values, 32 bytes of qs).

    The weight block is read as 16-byte pieces (header: ``dm`` and the 12 scale bytes; then the 32
    quant bytes: every 144-byte block of a tensor at a 16-byte aligned offset is 16-byte aligned),
    the two q8_1 blocks as nine 8-byte pieces (``_q8_1_pair``).
    """
    c = iqs // 8
    o = np.uint32(kbx) * 36
    dm, s1, s2, s3 = load_int4(vx, o)
    qa = load_int4(vx, o + 4 + 8 * c)
    qb = load_int4(vx, o + 8 + 8 * c)
    q = (qa[0], qa[1], qa[2], qa[3], qb[0], qb[1], qb[2], qb[3])
    return _vec_dot_q45_K(dm, s1, s2, s3, c, q, Z8, vy, kby)


# -- Q5_K (block_q5_K: 44 ints = dm | scales[12] | qh[32] | qs[128]) ----------------------------------
@device
def vec_dot_q5_K_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """Q4_K's chunk (``c = iqs/8``) with a fifth bit per value from ``qh`` (all 32 bytes: bits 2c
    and 2c+1). Blocks are 176 bytes, 16-byte aligned like Q4_K's: five 16-byte loads."""
    c = iqs // 8
    o = np.uint32(kbx) * 44
    dm, s1, s2, s3 = load_int4(vx, o)
    ha = load_int4(vx, o + 4)
    hb = load_int4(vx, o + 8)
    qa = load_int4(vx, o + 12 + 8 * c)
    qb = load_int4(vx, o + 16 + 8 * c)
    q = (qa[0], qa[1], qa[2], qa[3], qb[0], qb[1], qb[2], qb[3])
    qh = (ha[0], ha[1], ha[2], ha[3], hb[0], hb[1], hb[2], hb[3])
    return _vec_dot_q45_K(dm, s1, s2, s3, c, q, qh, vy, kby)


# -- Q2_K (block_q2_K: 21 ints = scales[16] | qs[64] | dm) -------------------------------------------
@device
def vec_dot_q2_K_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """One lane, half ``n = iqs/8`` of a Q2_K super-block (128 values, qs ints ``8n .. 8n+7``).

    Bits ``2j, 2j+1`` of those 32 bytes are values ``128n + 32j + byte`` (q8_1 block
    ``kby + 4n + j``); each 16 values have a scale byte (scale in the low nibble, min in the high
    one): bytes ``8n .. 8n+7``, ints ``2n`` and ``2n+1``. Value = ``d·sc·q − dmin·m``. Blocks are
    84 bytes, only 4-byte aligned: 4-byte loads; the four q8_1 blocks are 16-byte aligned."""
    n = iqs // 8
    b = np.uint32(kbx)
    w = np.uint32(4 + 8 * n)
    q = (vx[b, w], vx[b, w + 1], vx[b, w + 2], vx[b, w + 3], vx[b, w + 4], vx[b, w + 5], vx[b, w + 6], vx[b, w + 7])
    ws = np.uint32(2 * n)
    sc01, sc23 = vx[b, ws], vx[b, ws + 1]
    y0, y1, y2, y3 = _q8_1_quad(vy, np.uint32(kby + 4 * n) * 9)
    fd0, fm0 = _q2_K_32(q, 0, sc01, y0)
    fd1, fm1 = _q2_K_32(q, 1, sc01 >> 16, y1)
    fd2, fm2 = _q2_K_32(q, 2, sc23, y2)
    fd3, fm3 = _q2_K_32(q, 3, sc23 >> 16, y3)
    d, dmin = half2_float2(vx[b, 20])
    return d * (fd0 + fd1 + fd2 + fd3) - dmin * (fm0 + fm1 + fm2 + fm3)


@device
def _q2_K_32(q, j, sc, y):
    """Values ``32j ..`` of a lane's Q2_K half against q8_1 block ``y`` = (d8, quants), with the
    scale bytes of their two 16-value halves in the low 16 bits of ``sc``: (d8·Σ sc·q·u, d8·Σ m·u)."""
    d8, u = y
    d0, s0 = _dot_k(q, 2 * j, 2, Z8, 0, u, 0, 4)
    d1, s1 = _dot_k(q, 2 * j, 2, Z8, 0, u, 4, 4)
    return (d8 * np.float32(np.int32(d0 * (sc & 0xF) + d1 * ((sc >> 8) & 0xF))),
            d8 * np.float32(np.int32(s0 * ((sc >> 4) & 0xF) + s1 * ((sc >> 12) & 0xF))))


# -- big blocks at 2-byte aligned addresses (Q3_K: 110 bytes, Q6_K: 210) ----------------------------
# Every other block starts 2 bytes past a 4-byte boundary. The kernels read them through the
# tensor's flat int32 view (the tensor at a 4-byte aligned offset): an int of the block is put
# together from the two aligned ints around it with one funnel shift, and a lane's consecutive ints
# share their loads (9 loads for 8 ints, against 16 two-byte loads), with no branch on alignment.
# Both end with d (read through the float16 view): their last whole int ends 2 bytes before the
# block does, so no aligned word read for it (``_int_u2_last``) reaches past the block.
# A caller that wants a lane-dependent field of each byte adds its shift (at most 7 bits) to ``sh``:
# the funnel then also does that shift, and the next byte's low bits that come in at the top of each
# byte are masked off by the caller.
@device
def _block_u2(byte):
    """The block at byte ``byte`` of the tensor: (its first aligned int, ``sh`` = 0 or 16 bits past it)."""
    return byte >> np.uint64(2), (byte & np.uint64(2)) * np.uint64(8)


@device
def _funnel(lo, hi, sh):
    """Bits ``sh .. sh+31`` of the 64-bit ``hi:lo``."""
    return np.int32((np.uint64(np.uint32(hi)) << np.uint64(32) | np.uint64(np.uint32(lo))) >> sh)


@device
def _int_u2(vx, w0, sh, j):
    """Int ``j`` of the block at ``(w0, sh)``; reads aligned int ``w0 + j + 1``, which must lie within
    the block (else ``_int_u2_last``). Unsigned indices: no wrap-around check, and the loads of
    consecutive ints are seen to be shared."""
    return _funnel(vx[w0 + np.uint64(j)], vx[w0 + np.uint64(j + 1)], sh)


@device
def _int_u2_last(vx, w0, sh, j):
    """Int ``j``, the block's last whole one: the next aligned int is read only where the block is
    not aligned (else it could lie past the tensor's end)."""
    return _funnel(vx[w0 + np.uint64(j)], vx[w0 + np.uint64(j) + (sh >> np.uint64(4))], sh)


@device
def _ints8_u2(vx, w0, sh, j):
    """Ints ``j .. j+7`` of the block at ``(w0, sh)``: nine aligned loads."""
    return (_int_u2(vx, w0, sh, j), _int_u2(vx, w0, sh, j + 1), _int_u2(vx, w0, sh, j + 2),
            _int_u2(vx, w0, sh, j + 3), _int_u2(vx, w0, sh, j + 4), _int_u2(vx, w0, sh, j + 5),
            _int_u2(vx, w0, sh, j + 6), _int_u2(vx, w0, sh, j + 7))


# -- Q3_K (block_q3_K: hmask[32] | qs[64] | scales[12] | d, 110 bytes) -------------------------------
@device
def vec_dot_q3_K_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """One lane, half ``n = iqs/8`` of a Q3_K super-block (128 values, qs ints ``8n .. 8n+7``).

    As in Q2_K, bits ``2j, 2j+1`` of those bytes are values ``128n + 32j + byte`` (q8_1 block
    ``kby + 4n + j``); their third bit is bit ``4n + j`` of the same byte of ``hmask`` (all 32
    bytes); value = ``q − 4`` (``dp4a(q, u) − 4·Σu``). The 16-value sub-block ``s = 8n + 2j + h``
    has a 6-bit scale, minus 32: low four bits in nibble ``n`` of scale byte ``s % 8``, top two at
    bit ``2·(s/4)`` of byte ``8 + s%4``. Value = ``d·(sc − 32)·(q − 4)``.
    """
    n = iqs // 8
    w0, sh = _block_u2(np.uint64(kbx) * np.uint64(110))
    shn = sh + np.uint64(4 * n)                # nibble n of each byte first: hmask bit 4n + j is bit j
    hm = _ints8_u2(vx, w0, shn, 0)
    q = _ints8_u2(vx, w0, sh, 8 + 8 * n)
    top = _int_u2_last(vx, w0, shn, 26)
    # the lane's eight 6-bit scales, a byte each: (j, h) = (0, 0), (0, 1), (1, 0), (1, 1), then j = 2, 3
    sc01 = (_int_u2(vx, w0, shn, 24) & M4) | ((top & M2) << 4)
    sc23 = (_int_u2(vx, w0, shn, 25) & M4) | (((top >> 2) & M2) << 4)
    y0, y1, y2, y3 = _q8_1_quad(vy, np.uint32(kby + 4 * n) * 9)
    sumf = _q3_K_32(q, hm, 0, sc01, y0) + _q3_K_32(q, hm, 1, sc01 >> 16, y1) \
        + _q3_K_32(q, hm, 2, sc23, y2) + _q3_K_32(q, hm, 3, sc23 >> 16, y3)
    return np.float32(vx_h[np.uint32(kbx), 54]) * sumf


@device
def _q3_K_32(q, hm, j, sc, y):
    """Values ``32j ..`` of a lane's Q3_K half against q8_1 block ``y`` = (d8, quants): their third
    bits are bit j of hm's bytes, the 6-bit scales of their two 16-value halves the low two bytes
    of ``sc``: d8·Σ (sc − 32)·(q − 4)·u."""
    d8, u = y
    d0, s0 = _dot_k(q, 2 * j, 2, hm, j, u, 0, 4)
    d1, s1 = _dot_k(q, 2 * j, 2, hm, j, u, 4, 4)
    return d8 * np.float32(np.int32(((sc & 0xFF) - 32) * (d0 - 4 * s0) + (((sc >> 8) & 0xFF) - 32) * (d1 - 4 * s1)))


# -- Q6_K (block_q6_K: ql[128] | qh[64] | scales[16] int8 | d, 210 bytes) ----------------------------
@device
def _byte_s8(x, k):
    """Signed byte ``k`` of int ``x``."""
    return np.int32(x << np.int32(24 - 8 * k)) >> np.int32(24)


@device
def vec_dot_q6_K_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """One lane, ints ``w = iqs .. iqs+7`` of ``ql`` (``iqs`` = 0, 8, 16, 24): 32 low and 32 high nibbles.

    In half ``n = iqs/16`` of the super-block, with ``h = (iqs%16)/8``, the low nibbles are values
    ``128n + 32h ..`` (q8_1 block ``4n + h``), the high ones ``128n + 64 + 32h ..`` (block
    ``4n + 2 + h``). The two high bits of each value sit in ``qh`` int ``8n + w%8`` (block int
    ``32 + 8n + w%8``), at bit ``2h`` (low nibbles) and ``4 + 2h`` (high). Each 16 values (4 ints)
    share a signed 8-bit scale: the lane's four are bytes ``2h, 2h+1`` of block ints ``48 + 2n``
    (low) and ``49 + 2n`` (high). Values are ``q - 32``: ``dp4a(q, u) - 32·Σu``.
    """
    n = iqs // 16
    h = (iqs % 16) // 8
    b = np.uint32(kbx)
    w0, sh = _block_u2(np.uint64(kbx) * np.uint64(210))
    yb_lo = np.uint32(kby + 4 * n + h)
    yb_hi = np.uint32(kby + 4 * n + 2 + h)
    ql = _ints8_u2(vx, w0, sh, iqs)
    qh = _ints8_u2(vx, w0, sh + np.uint64(2 * h), 32 + 8 * n)    # the lane's bits 2h.. of each byte first
    s_lo = _int_u2(vx, w0, sh, 48 + 2 * n)
    s_hi = _int_u2_last(vx, w0, sh, 49 + 2 * n)     # int 51 for n = 1: the last before d
    sumf = F32_ZERO
    for g in range(2):
        dot_lo = dot_hi = sum_lo = sum_hi = I0
        for r in range(4 * g, 4 * g + 4):
            vl = ql[r]
            vh = qh[r]
            u_lo = vy[yb_lo, 1 + r]
            u_hi = vy[yb_hi, 1 + r]
            dot_lo = dp4a((vl & M4) | ((vh & M2) << 4), u_lo, dot_lo)
            dot_hi = dp4a(((vl >> 4) & M4) | (((vh >> 4) & M2) << 4), u_hi, dot_hi)
            sum_lo = dp4a(ONES, u_lo, sum_lo)
            sum_hi = dp4a(ONES, u_hi, sum_hi)
        sc_lo = _byte_s8(s_lo, 2 * h + g)
        sc_hi = _byte_s8(s_hi, 2 * h + g)
        sumf += np.float32(vy_h[yb_lo, 0]) * np.float32(np.int32(sc_lo * (dot_lo - 32 * sum_lo))) \
            + np.float32(vy_h[yb_hi, 0]) * np.float32(np.int32(sc_hi * (dot_hi - 32 * sum_hi)))
    return np.float32(vx_h[b, 104]) * sumf


# -- Q8_0 (block_q8_0: d | qs[32] int8, 34 bytes = 17 half-words) ------------------------------------
@device
def _int_b2(vx16, b, j):
    """An int32 from half-words j, j+1 of block b (GGML's get_int_b2, for 2-byte aligned blocks)."""
    return np.int32(vx16[b, j]) | (np.int32(vx16[b, j + 1]) << 16)


@device
def vec_dot_q8_0_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """A whole Q8_0 block, its 8 quant ints (vdr = 8), against its q8_1 twin."""
    b = np.uint32(kbx)
    yb = np.uint32(kby)
    sumi = I0
    for i in range(8):
        sumi = dp4a(_int_b2(vx, b, 1 + 2 * i), vy[yb, 1 + i], sumi)
    return np.float32(vx_h[b, 0]) * np.float32(vy_h[yb, 0]) * np.float32(sumi)


# -- the 32-value types: Q4_0 (18 bytes), Q4_1 (20), Q5_0 (22), Q5_1 (24) ----------------------------
# A lane takes a whole block, its 4 quant ints (vdr = 4): int w holds elements 4w..4w+3 in its low
# nibbles (q8_1 int w) and 16+4w.. in its high ones (int 4+w). The block's scales, and Q5's high
# bits, are loaded and decoded once per 32 values (with two lanes per block, as GGML's vdr = 2, the
# instructions per weight kept Q5_1 at 1.3 TB/s, 34 µs for GGML's 17). The activations' sums are
# recounted from their quants (dp4a with ONES) for the −8/−16 offsets and the mins, as the K-quant
# kernels do, rather than taken from the q8_1 block's rounded s.
@device
def _fifth_bits(qh, w):
    """Bits 4w..4w+3 of ``qh`` as bit 4 of bytes 0..3 (the fifth bits of int w's four values)."""
    h = qh >> (4 * w)
    return ((h & 1) << 4) | ((h & 2) << 11) | ((h & 4) << 18) | ((h & 8) << 25)


@device
def _dot_32(v0, v1, v2, v3, qh, vy, yb):
    """(Σ q·u, Σ u) over a block's 32 values: its ints v0..v3 of nibbles, with the fifth bits taken
    from ``qh`` (0 for the 4-bit types; the high nibbles' bits are 16 further on)."""
    sumi = su = I0
    for i in range(4):
        v = v0 if i == 0 else (v1 if i == 1 else (v2 if i == 2 else v3))
        u_lo = vy[yb, 1 + i]
        u_hi = vy[yb, 5 + i]
        sumi = dp4a((v & M4) | _fifth_bits(qh, i), u_lo, sumi)
        sumi = dp4a(((v >> 4) & M4) | _fifth_bits(qh >> 16, i), u_hi, sumi)
        su = dp4a(ONES, u_lo, dp4a(ONES, u_hi, su))
    return sumi, su


@device
def vec_dot_q4_0_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """Q4_0 (uint16 view, 9 half-words: d | qs): d·d8·Σ (q − 8)·u."""
    b, yb = np.uint32(kbx), np.uint32(kby)
    sumi, su = _dot_32(_int_b2(vx, b, 1), _int_b2(vx, b, 3), _int_b2(vx, b, 5), _int_b2(vx, b, 7), I0, vy, yb)
    return np.float32(vx_h[b, 0]) * np.float32(vy_h[yb, 0]) * np.float32(sumi - 8 * su)


@device
def vec_dot_q4_1_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """Q4_1 (int32 view, 5 ints: d, m | qs): d·d8·Σ q·u + m·d8·Σ u."""
    b, yb = np.uint32(kbx), np.uint32(kby)
    sumi, su = _dot_32(vx[b, 1], vx[b, 2], vx[b, 3], vx[b, 4], I0, vy, yb)
    d8 = np.float32(vy_h[yb, 0])
    return np.float32(vx_h[b, 0]) * d8 * np.float32(sumi) + np.float32(vx_h[b, 1]) * d8 * np.float32(su)


@device
def vec_dot_q5_0_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """Q5_0 (uint16 view, 11 half-words: d | qh | qs): d·d8·Σ (q − 16)·u."""
    b, yb = np.uint32(kbx), np.uint32(kby)
    sumi, su = _dot_32(_int_b2(vx, b, 3), _int_b2(vx, b, 5), _int_b2(vx, b, 7), _int_b2(vx, b, 9),
                       _int_b2(vx, b, 1), vy, yb)
    return np.float32(vx_h[b, 0]) * np.float32(vy_h[yb, 0]) * np.float32(sumi - 16 * su)


@device
def vec_dot_q5_1_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """Q5_1 (int32 view, 6 ints: d, m | qh | qs): d·d8·Σ q·u + m·d8·Σ u."""
    b, yb = np.uint32(kbx), np.uint32(kby)
    sumi, su = _dot_32(vx[b, 2], vx[b, 3], vx[b, 4], vx[b, 5], vx[b, 1], vy, yb)
    d8 = np.float32(vy_h[yb, 0])
    return np.float32(vx_h[b, 0]) * d8 * np.float32(sumi) + np.float32(vx_h[b, 1]) * d8 * np.float32(su)


# -- IQ4_NL (d | qs[16], 18 bytes) and IQ4_XS (d | scales_h | scales_l[4] | qs[128], 136 bytes) --------
# Nibbles index the 16 int8 levels kvalues_iq4nl, laid out as Q4_0's. The levels are the 16 bytes of
# four int32 constants (registers, no memory), and a byte permute picks four of them at a time.
if SIM:
    @device
    def byte_perm(x, y, s):
        """CUDA's ``__byte_perm``: byte i of the result is byte ``(s >> 4i) & 7`` of ``y:x``."""
        xy = (int(y) & 0xFFFFFFFF) << 32 | (int(x) & 0xFFFFFFFF)
        r = 0
        for i in range(4):
            r |= ((xy >> (8 * ((int(s) >> (4 * i)) & 7))) & 0xFF) << (8 * i)
        return np.int32(r - (1 << 32) if r >> 31 else r)
else:
    byte_perm = libdevice.byte_perm       # prmt.b32 on the selector's 3-bit fields

KV0, KV1, KV2, KV3 = (np.int32(v) for v in KVALUES_IQ4NL.view(np.int32))


@device
def _iq4nl_levels(q):
    """The levels of the 8 nibbles of ``q``: (those of its low nibbles, those of its high ones), byte
    ``b`` from byte ``b`` of q (GGML's ``get_int_from_table_16``). A permute looks each nibble's low
    three bits up in levels 0..7 and in levels 8..15; a third takes one of the two by the nibble's top
    bit; two more gather the low and the high nibbles' bytes."""
    pick = ((q >> 1) & 0x44444444) | 0x32103210        # byte i of the low or of the high lookup
    v0 = byte_perm(byte_perm(KV0, KV1, q), byte_perm(KV2, KV3, q), pick)                    # nibbles 0..3
    v1 = byte_perm(byte_perm(KV0, KV1, q >> 16), byte_perm(KV2, KV3, q >> 16), pick >> 16)  # nibbles 4..7
    return byte_perm(v0, v1, 0x6420), byte_perm(v0, v1, 0x7531)


@device
def vec_dot_iq4_nl_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """A whole IQ4_NL block per lane (``vdr = qi = 4``): int w of qs holds values 4w.. in its low
    nibbles (q8_1 int w) and 16+4w.. in its high ones (int 4+w); d·d8·Σ level·u. uint16 view, as
    Q4_0's: with ``_int_u2``, a 4-byte aligned block's last two bytes would come from a word that
    ends past the block, hence past the tensor for its last block."""
    b, yb = np.uint32(kbx), np.uint32(kby)
    sumi = I0
    for w in range(4):
        lo, hi = _iq4nl_levels(_int_b2(vx, b, 1 + 2 * w))
        sumi = dp4a(hi, vy[yb, 5 + w], dp4a(lo, vy[yb, 1 + w], sumi))
    return np.float32(vx_h[b, 0]) * np.float32(vy_h[yb, 0]) * np.float32(sumi)


@device
def vec_dot_iq4_xs_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """One lane, sub-blocks ``2c, 2c+1`` of an IQ4_XS super-block (``c = iqs/8``; 64 values, qs ints
    ``8c .. 8c+7``, against q8_1 blocks ``kby + 2c``, ``+1``); each sub-block as an IQ4_NL block,
    with the 6-bit scale ``ls`` (low four bits: nibble of ``scales_l`` byte c; top two: bits
    ``2ib`` of ``scales_h``): value = ``d·(ls − 32)·level``. Blocks are 136 bytes, 8-byte aligned:
    8-byte loads."""
    c = iqs // 8
    o = np.uint32(kbx) * 34
    h, sl = load_int2(vx, o)                               # d | scales_h, scales_l
    q0, q1 = load_int2(vx, o + 2 + 8 * c)
    q2, q3 = load_int2(vx, o + 4 + 8 * c)
    q4, q5 = load_int2(vx, o + 6 + 8 * c)
    q6, q7 = load_int2(vx, o + 8 + 8 * c)
    q = (q0, q1, q2, q3, q4, q5, q6, q7)
    (d8a, a), (d8b, b) = _q8_1_pair(vy, np.uint32(kby + 2 * c) * 9)
    dot_a = dot_b = I0
    for w in range(4):
        lo, hi = _iq4nl_levels(q[w])
        dot_a = dp4a(hi, a[4 + w], dp4a(lo, a[w], dot_a))
        lo, hi = _iq4nl_levels(q[4 + w])
        dot_b = dp4a(hi, b[4 + w], dp4a(lo, b[w], dot_b))
    ls = ((sl >> (8 * c)) & 0xFF) | ((h >> (16 + 4 * c)) << 8)   # bits 0..7: scales_l byte, 8..11: scales_h
    ls_a = ((ls & 0xF) | ((ls >> 4) & 0x30)) - 32
    ls_b = (((ls >> 4) & 0xF) | ((ls >> 6) & 0x30)) - 32
    return half2_float2(h)[0] * (d8a * np.float32(np.int32(dot_a * ls_a)) + d8b * np.float32(np.int32(dot_b * ls_b)))


# type -> (vec_dot, qk, qi, vdr, dtype of the quant view); the kernels see a view 2-D, one row per
# block (``view.reshape(-1, block bytes / itemsize)``), so an index is ``[block, word]``: one
# address computation per block, then fixed offsets; blocks that are not a whole number of int32s
# (Q3_K, Q6_K) get the flat int32 array of the tensor (``_block_u2``).
VEC_DOT = {
    Type.Q4_K: (vec_dot_q4_K_q8_1, 256, 32, 8, np.int32),
    Type.Q5_K: (vec_dot_q5_K_q8_1, 256, 32, 8, np.int32),
    Type.Q6_K: (vec_dot_q6_K_q8_1, 256, 32, 8, np.int32),
    Type.Q2_K: (vec_dot_q2_K_q8_1, 256, 16, 8, np.int32),
    Type.Q3_K: (vec_dot_q3_K_q8_1, 256, 16, 8, np.int32),
    Type.IQ4_XS: (vec_dot_iq4_xs_q8_1, 256, 32, 8, np.int32),
    Type.IQ4_NL: (vec_dot_iq4_nl_q8_1, 32, 4, 4, np.uint16),
    Type.Q8_0: (vec_dot_q8_0_q8_1, 32, 8, 8, np.uint16),
    Type.Q4_0: (vec_dot_q4_0_q8_1, 32, 4, 4, np.uint16),
    Type.Q4_1: (vec_dot_q4_1_q8_1, 32, 4, 4, np.int32),
    Type.Q5_0: (vec_dot_q5_0_q8_1, 32, 4, 4, np.uint16),
    Type.Q5_1: (vec_dot_q5_1_q8_1, 32, 4, 4, np.int32),
}

# The alignment (bytes) of the tensor's offset that the widest weight loads need; blocks that are a
# multiple of it in size all have it then (Q4_K 144 and Q5_K 176 bytes: 16; IQ4_XS 136: 8). The
# others take 4 (int32 views, flat or not) or less; the mmvq path asks for at least 4.
ALIGN = {Type.Q4_K: 16, Type.Q5_K: 16, Type.IQ4_XS: 8}

_kernels = {}


def _make_kernel(type_, ncols, moe):
    vec_dot, qk, qi, vdr, _ = VEC_DOT[type_]
    lanes_per_col = 32 // next_pow2(ncols)
    lanes = qi // vdr                       # lanes per weight block
    blocks_per_iter = lanes_per_col // lanes
    y_per_x = qk // QK8_1
    nwarps = MMVQ_NWARPS
    MOE = moe                               # a constant of the closure: the plain kernel has no ids code

    @jit_kernel()
    def mul_mat_vec_q(vx, vx_h, vy, vy_h, dst, blocks_per_row, nrows_x, stride_row_x, stride_col_y,
                      stride_col_dst, channel_ratio, stride_channel_x, stride_channel_y,
                      stride_channel_dst, sample_ratio, stride_sample_x, stride_sample_y,
                      stride_sample_dst, ids, ids_s0, ids_s1, nchannels_x, nchannels_y):
        lane = cuda.threadIdx.x
        row0 = MMVQ_ROWS * (nwarps * cuda.blockIdx.x + cuda.threadIdx.y)
        if row0 >= nrows_x:
            return
        channel_dst = np.uint32(cuda.blockIdx.y)
        sample_dst = np.uint32(cuda.blockIdx.z)
        if MOE:     # MUL_MAT_ID: channel = the token's expert slot, sample = the token
            expert = ids[channel_dst * ids_s0 + sample_dst * ids_s1]
            if expert < 0 or expert >= nchannels_x:
                return      # an id out of range: nothing read, nothing written (GGML asserts)
            x0 = np.uint32(expert) * stride_channel_x
            channel_y = channel_dst % np.uint32(nchannels_y)   # b's row: the token's one, or the slot's
        else:
            x0 = np.uint32(sample_dst // np.uint32(sample_ratio)) * stride_sample_x \
                + np.uint32(channel_dst // np.uint32(channel_ratio)) * stride_channel_x
            channel_y = channel_dst
        j = lane // lanes_per_col
        jc = min(j, ncols - 1)                  # lanes past the last column repeat it, unwritten
        y0 = sample_dst * stride_sample_y + channel_y * stride_channel_y + jc * stride_col_y
        d0 = sample_dst * stride_sample_dst + channel_dst * stride_channel_dst + jc * stride_col_dst + row0

        xr0 = x0 + row0 * stride_row_x
        xr1 = x0 + min(row0 + 1, nrows_x - 1) * stride_row_x   # a last odd row is read twice
        acc0 = acc1 = F32_ZERO
        kl = lane % lanes_per_col
        kqs = vdr * (kl % lanes)
        kbx = kl // lanes
        while kbx < blocks_per_row:
            kby = y0 + kbx * y_per_x
            acc0 += vec_dot(vx, vx_h, xr0 + kbx, vy, vy_h, kby, kqs)
            acc1 += vec_dot(vx, vx_h, xr1 + kbx, vy, vy_h, kby, kqs)   # same activations
            kbx += blocks_per_iter

        acc0 = warp_reduce_sum(acc0, lanes_per_col)
        acc1 = warp_reduce_sum(acc1, lanes_per_col)
        if kl == 0 and j < ncols:
            dst[d0] = acc0
            if row0 + 1 < nrows_x:
                dst[d0 + 1] = acc1

    return mul_mat_vec_q


def next_pow2(n):
    return 1 << (n - 1).bit_length()


MMVQ_NWARPS = 4      # warps per CUDA block, each on its own rows
MMVQ_ROWS = 2        # rows per warp: the kernel is written for two (acc0, acc1)


def get_kernel(type_, ncols, moe=False):
    k = _kernels.get((type_, ncols, moe))
    if k is None:
        k = _kernels[(type_, ncols, moe)] = _make_kernel(type_, ncols, moe)
    return k


def launch_mmvq(stream, type_, vx, vx_h, vy, vy_h, dst, src0, dst_t, cols=None):
    """``dst_t = mul_mat(src0, src1)`` with src1 already quantized to q8_1 in ``vy``/``vy_h``
    (rows of ``round_up(ne10, 512)`` values, in the order channel, sample, column); with ``cols``
    = (c0, c1), only columns c0 .. c1-1 (at most 8) of a 2-D product."""
    qk = VEC_DOT[type_][1]
    ne00, ne01, ne02, ne03 = src0.ne
    ncols, ne2, ne3 = dst_t.ne[1], dst_t.ne[2], dst_t.ne[3]
    bs = src0.nb[0]                                   # bytes per block
    yrow = round_up(ne00, MATRIX_ROW_PADDING) // QK8_1   # q8_1 blocks per src1 column
    if cols is not None:    # columns are consecutive runs of q8_1 blocks (the views' rows) and of dst
        c0, c1 = cols
        assert ne2 == ne3 == 1 and c1 - c0 <= MMVQ_MAX_BATCH_SIZE
        vy, vy_h, dst, ncols = vy[c0 * yrow:c1 * yrow], vy_h[c0 * yrow:c1 * yrow], dst[c0 * ne01:c1 * ne01], c1 - c0
    grid = (cdiv(ne01, MMVQ_NWARPS * MMVQ_ROWS), ne2, ne3)
    get_kernel(type_, ncols)[grid, (32, MMVQ_NWARPS), stream](
        vx, vx_h, vy, vy_h, dst, ne00 // qk, ne01, src0.nb[1] // bs, yrow,
        ne01, ne2 // ne02, src0.nb[2] // bs, ncols * yrow, ne01 * ncols,
        ne3 // ne03, src0.nb[3] // bs, ne2 * ncols * yrow, ne01 * ncols * ne2,
        dst, 0, 0, 0, 1)                              # no ids (the plain kernel never reads them)


def launch_mmvq_id(stream, type_, vx, vx_h, vy, vy_h, dst, src0, src1, ids, ids_t):
    """``mul_mat_id(src0, src1, ids)`` (src0 [k, m, n_expert], src1 [k, n_b, n_tokens], ids I32
    [n_used, n_tokens] read through the flat view ``ids``) with src1 quantized to q8_1 in ``vy``/
    ``vy_h``: the one-column kernel with GGML's MUL_MAT_ID layout, a CUDA block's grid y the expert
    slot and z the token (``mul_mat_vec_q`` with ``ids``; GGML's ``is_multi_token_id`` for several
    tokens). Each (token, slot) pair reads its expert's rows: for a prompt the experts' rows are
    read once per token that uses them (GGML's mmq with ids groups the tokens by expert)."""
    qk = VEC_DOT[type_][1]
    ne00, ne01, n_expert = src0.ne[0], src0.ne[1], src0.ne[2]
    n_b, n_tokens = src1.ne[1], src1.ne[2]
    n_used = ids_t.ne[0]
    bs = src0.nb[0]
    yrow = round_up(ne00, MATRIX_ROW_PADDING) // QK8_1   # q8_1 blocks per src1 row
    grid = (cdiv(ne01, MMVQ_NWARPS * MMVQ_ROWS), n_used, n_tokens)
    get_kernel(type_, 1, moe=True)[grid, (32, MMVQ_NWARPS), stream](
        vx, vx_h, vy, vy_h, dst, ne00 // qk, ne01, src0.nb[1] // bs, yrow,
        ne01, 1, src0.nb[2] // bs, yrow, ne01,
        1, 0, n_b * yrow, ne01 * n_used,
        ids, ids_t.nb[0] // 4, ids_t.nb[1] // 4, n_expert, n_b)
