"""mmvq: quantized matrix times a few vectors (GGML's ``mul_mat_vec_q``, docs/quant-formats.md §6.2-6.3).

Used for ``mul_mat(W, x)`` with W in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K or Q6_K and x of at most 8
columns (decoding).
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
| Q4_K | 256 | 32 | 8 | 4 | 8 / 1 |
| Q6_K | 256 | 32 | 8 | 4 | 8 / 1 |
| Q8_0 | 32 | 8 | 2 | 4 | 8 / 1 |
| Q4_0, Q4_1, Q5_0, Q5_1 | 32 | 4 | 2 | 2 | 16 / 2 |

GGML gives Q4_K ``vdr = 2`` (16 threads per super-block) and Q6_K ``vdr = 1``. Here a lane takes a
whole 64-value chunk of Q4_K, so the block's scales, ``d`` and ``dmin`` are decoded once per 64
values instead of per 16, and its 32 bytes of quants come in two 16-byte loads (``load_int4``);
the old n = 1 kernel was bound by instruction issue, not by memory, and this cuts its instructions
per weight about fourfold.

**Two rows per warp.** Each lane computes its share for both rows with the same activations: the
compiler loads and sums an activation chunk once for the two ``vec_dot`` calls (measured on an
H200: n = 8 went from 94 to 64 µs, n = 1 from 11.5 to 9.9 µs).

**Reduction.** Each lane keeps two partial sums; a butterfly over its group's lanes
(``warp_reduce_sum`` with the group's width) adds them, and the group's first lane writes.

Weights come as two views of the same bytes: ``int32`` (``uint16`` for the 2-byte aligned Q8_0
blocks) for quants and scales, and ``float16`` for the block scales ``d``/``dmin``; the q8_1
activations likewise (``int32`` and ``float16``), all 2-D with one row per block. Q6_K's int32
view is flat: its blocks are 210 bytes (``_int_q6_K``).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...types import Type
from .common import (device, jit_kernel, F32_ZERO, MATRIX_ROW_PADDING, QK8_1, cdiv, dp4a, half2_float2, load_int2,
                     load_int4, round_up, warp_reduce_sum)

MMVQ_MAX_BATCH_SIZE = 8

M4 = np.int32(0x0F0F0F0F)     # low nibble of each byte
M2 = np.int32(0x03030303)     # low two bits of each byte
ONES = np.int32(0x01010101)   # dp4a(ONES, u, 0) = sum of u's four bytes
I0 = np.int32(0)


# -- Q4_K (block_q4_K: 36 ints = dm | scales[12] | qs[128]) -----------------------------------------
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
def _dot8(q, shift, u):
    """Σ dp4a of the nibbles ``(q[i] >> shift) & 0xF`` with u[i] over 8 ints, and Σ of u's bytes."""
    d = I0
    s = I0
    for i in range(8):
        d = dp4a((q[i] >> shift) & M4, u[i], d)
        s = dp4a(ONES, u[i], s)
    return d, s


@device
def vec_dot_q4_K_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """One lane's share of one Q4_K super-block: chunk ``c = iqs/8`` (64 values, 32 bytes of qs).

    Its bytes hold sub-block 2c in the low nibbles and 2c+1 in the high ones, against q8_1 blocks
    ``kby + 2c`` and ``kby + 2c + 1``. The weight block is read as 16-byte pieces (header: ``dm``
    and the 12 scale bytes; then the 32 quant bytes: every 144-byte block of a tensor in a buffer
    aligned to 128 bytes is 16-byte aligned), the two q8_1 blocks (72 bytes, 8-byte aligned since
    ``kby + 2c`` is even and a q8_1 row of 512-padded values is 576·k bytes) as nine 8-byte pieces.
    """
    c = iqs // 8
    o = np.uint32(kbx) * 36
    dm, s1, s2, s3 = load_int4(vx, o)
    qa = load_int4(vx, o + 4 + 8 * c)
    qb = load_int4(vx, o + 8 + 8 * c)
    q = (qa[0], qa[1], qa[2], qa[3], qb[0], qb[1], qb[2], qb[3])
    sc, m = _scales_q4_K(s1, s2, s3, c)

    p = np.uint32(kby + 2 * c) * 9            # the pair of q8_1 blocks: ints p .. p+17
    h0, a0 = load_int2(vy, p)
    a1, a2 = load_int2(vy, p + 2)
    a3, a4 = load_int2(vy, p + 4)
    a5, a6 = load_int2(vy, p + 6)
    a7, h1 = load_int2(vy, p + 8)
    b0, b1 = load_int2(vy, p + 10)
    b2, b3 = load_int2(vy, p + 12)
    b4, b5 = load_int2(vy, p + 14)
    b6, b7 = load_int2(vy, p + 16)
    d8a = half2_float2(h0)[0]
    d8b = half2_float2(h1)[0]
    dot_a, sum_a = _dot8(q, 0, (a0, a1, a2, a3, a4, a5, a6, a7))
    dot_b, sum_b = _dot8(q, 4, (b0, b1, b2, b3, b4, b5, b6, b7))

    d, dmin = half2_float2(dm)
    sumf_d = d8a * np.float32(np.int32(dot_a * (sc & 0xFF))) + d8b * np.float32(np.int32(dot_b * (sc >> 8)))
    sumf_m = d8a * np.float32(np.int32(sum_a * (m & 0xFF))) + d8b * np.float32(np.int32(sum_b * (m >> 8)))
    return d * sumf_d - dmin * sumf_m


# -- Q6_K (block_q6_K: ql[128] | qh[64] | scales[16] int8 | d, 210 bytes) ----------------------------
@device
def _int_q6_K(vx, w0, sh, j):
    """Int ``j`` of a Q6_K block whose first byte is ``4·w0 + sh/8`` in the tensor's int32 view.
    Blocks are 210 bytes, so every other one starts 2 bytes past a 4-byte boundary (``sh`` = 16):
    its ints are put together from two aligned loads, and a lane's consecutive ints share one
    (9 loads for 8 ints, against 16 two-byte loads)."""
    lo = np.uint32(vx[w0 + j])
    if sh == 0:
        return np.int32(lo)
    hi = np.uint32(vx[w0 + j + 1])
    return np.int32((lo >> np.uint32(16)) | (hi << np.uint32(16)))


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
    byte = np.uint64(kbx) * np.uint64(210)
    w0 = byte >> np.uint64(2)
    sh = np.uint32(byte & np.uint64(2))
    yb_lo = np.uint32(kby + 4 * n + h)
    yb_hi = np.uint32(kby + 4 * n + 2 + h)
    s_lo = _int_q6_K(vx, w0, sh, 48 + 2 * n)
    s_hi = _int_q6_K(vx, w0, sh, 49 + 2 * n)
    sumf = F32_ZERO
    for g in range(2):
        dot_lo = dot_hi = sum_lo = sum_hi = I0
        for r in range(4 * g, 4 * g + 4):
            vl = _int_q6_K(vx, w0, sh, iqs + r)
            vh = _int_q6_K(vx, w0, sh, 32 + 8 * n + r) >> (2 * h)
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
    """Ints ``iqs`` and ``iqs+1`` of the 8 quant ints of one Q8_0 block against its q8_1 twin."""
    b = np.uint32(kbx)
    v0 = _int_b2(vx, b, 1 + 2 * iqs)
    v1 = _int_b2(vx, b, 3 + 2 * iqs)
    yb = np.uint32(kby)
    sumi = dp4a(v1, vy[yb, 2 + iqs], dp4a(v0, vy[yb, 1 + iqs], I0))
    return np.float32(vx_h[b, 0]) * np.float32(vy_h[yb, 0]) * np.float32(sumi)


# -- the 32-value types: Q4_0 (18 bytes), Q4_1 (20), Q5_0 (22), Q5_1 (24) ----------------------------
# A lane takes ints iqs, iqs+1 of the block's 4 quant ints (vdr = 2, two lanes per block): int w
# holds elements 4w..4w+3 in its low nibbles (q8_1 int w) and 16+4w.. in its high ones (int 4+w).
# The activations' sums are recounted from their quants (dp4a with ONES) for the −8/−16 offsets
# and the mins, as the K-quant kernels do, rather than taken from the q8_1 block's rounded s.
@device
def _fifth_bits(qh, w):
    """Bits 4w..4w+3 of ``qh`` as bit 4 of bytes 0..3 (the fifth bits of int w's four values)."""
    h = qh >> (4 * w)
    return ((h & 1) << 4) | ((h & 2) << 11) | ((h & 4) << 18) | ((h & 8) << 25)


@device
def _dot_32(v0, v1, qh, vy, yb, iqs):
    """(Σ q·u, Σ u) over the lane's 16 values: ints v0, v1 of nibbles, with the fifth bits taken
    from ``qh`` (0 for the 4-bit types; the high nibbles' bits are 16 further on)."""
    sumi = su = I0
    for i in range(2):
        v = v0 if i == 0 else v1
        u_lo = vy[yb, 1 + iqs + i]
        u_hi = vy[yb, 5 + iqs + i]
        sumi = dp4a((v & M4) | _fifth_bits(qh, iqs + i), u_lo, sumi)
        sumi = dp4a(((v >> 4) & M4) | _fifth_bits(qh >> 16, iqs + i), u_hi, sumi)
        su = dp4a(ONES, u_lo, dp4a(ONES, u_hi, su))
    return sumi, su


@device
def vec_dot_q4_0_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """Q4_0 (uint16 view, 9 half-words: d | qs): d·d8·Σ (q − 8)·u."""
    b, yb = np.uint32(kbx), np.uint32(kby)
    sumi, su = _dot_32(_int_b2(vx, b, 1 + 2 * iqs), _int_b2(vx, b, 3 + 2 * iqs), I0, vy, yb, iqs)
    return np.float32(vx_h[b, 0]) * np.float32(vy_h[yb, 0]) * np.float32(sumi - 8 * su)


@device
def vec_dot_q4_1_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """Q4_1 (int32 view, 5 ints: d, m | qs): d·d8·Σ q·u + m·d8·Σ u."""
    b, yb = np.uint32(kbx), np.uint32(kby)
    sumi, su = _dot_32(vx[b, 1 + iqs], vx[b, 2 + iqs], I0, vy, yb, iqs)
    d8 = np.float32(vy_h[yb, 0])
    return np.float32(vx_h[b, 0]) * d8 * np.float32(sumi) + np.float32(vx_h[b, 1]) * d8 * np.float32(su)


@device
def vec_dot_q5_0_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """Q5_0 (uint16 view, 11 half-words: d | qh | qs): d·d8·Σ (q − 16)·u."""
    b, yb = np.uint32(kbx), np.uint32(kby)
    sumi, su = _dot_32(_int_b2(vx, b, 3 + 2 * iqs), _int_b2(vx, b, 5 + 2 * iqs), _int_b2(vx, b, 1), vy, yb, iqs)
    return np.float32(vx_h[b, 0]) * np.float32(vy_h[yb, 0]) * np.float32(sumi - 16 * su)


@device
def vec_dot_q5_1_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """Q5_1 (int32 view, 6 ints: d, m | qh | qs): d·d8·Σ q·u + m·d8·Σ u."""
    b, yb = np.uint32(kbx), np.uint32(kby)
    sumi, su = _dot_32(vx[b, 2 + iqs], vx[b, 3 + iqs], vx[b, 1], vy, yb, iqs)
    d8 = np.float32(vy_h[yb, 0])
    return np.float32(vx_h[b, 0]) * d8 * np.float32(sumi) + np.float32(vx_h[b, 1]) * d8 * np.float32(su)


# type -> (vec_dot, qk, qi, vdr, dtype of the quant view); the kernels see a view 2-D, one row per
# block (``view.reshape(-1, block bytes / itemsize)``), so an index is ``[block, word]``: one
# address computation per block, then fixed offsets; Q6_K's 210-byte blocks are not a whole number
# of int32s, so its view is the flat int32 array of the tensor (``_int_q6_K``).
VEC_DOT = {
    Type.Q4_K: (vec_dot_q4_K_q8_1, 256, 32, 8, np.int32),
    Type.Q6_K: (vec_dot_q6_K_q8_1, 256, 32, 8, np.int32),
    Type.Q8_0: (vec_dot_q8_0_q8_1, 32, 8, 2, np.uint16),
    Type.Q4_0: (vec_dot_q4_0_q8_1, 32, 4, 2, np.uint16),
    Type.Q4_1: (vec_dot_q4_1_q8_1, 32, 4, 2, np.int32),
    Type.Q5_0: (vec_dot_q5_0_q8_1, 32, 4, 2, np.uint16),
    Type.Q5_1: (vec_dot_q5_1_q8_1, 32, 4, 2, np.int32),
}

_kernels = {}


def _make_kernel(type_, ncols):
    vec_dot, qk, qi, vdr, _ = VEC_DOT[type_]
    lanes_per_col = 32 // next_pow2(ncols)
    lanes = qi // vdr                       # lanes per weight block
    blocks_per_iter = lanes_per_col // lanes
    y_per_x = qk // QK8_1
    nwarps = MMVQ_NWARPS

    @jit_kernel()
    def mul_mat_vec_q(vx, vx_h, vy, vy_h, dst, blocks_per_row, nrows_x, stride_row_x, stride_col_y,
                      stride_col_dst, channel_ratio, stride_channel_x, stride_channel_y,
                      stride_channel_dst, sample_ratio, stride_sample_x, stride_sample_y,
                      stride_sample_dst):
        lane = cuda.threadIdx.x
        row0 = MMVQ_ROWS * (nwarps * cuda.blockIdx.x + cuda.threadIdx.y)
        if row0 >= nrows_x:
            return
        channel_dst = np.uint32(cuda.blockIdx.y)
        sample_dst = np.uint32(cuda.blockIdx.z)
        x0 = np.uint32(sample_dst // np.uint32(sample_ratio)) * stride_sample_x \
            + np.uint32(channel_dst // np.uint32(channel_ratio)) * stride_channel_x
        j = lane // lanes_per_col
        jc = min(j, ncols - 1)                  # lanes past the last column repeat it, unwritten
        y0 = sample_dst * stride_sample_y + channel_dst * stride_channel_y + jc * stride_col_y
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


def get_kernel(type_, ncols):
    k = _kernels.get((type_, ncols))
    if k is None:
        k = _kernels[(type_, ncols)] = _make_kernel(type_, ncols)
    return k


def launch_mmvq(stream, type_, vx, vx_h, vy, vy_h, dst, src0, dst_t):
    """``dst_t = mul_mat(src0, src1)`` with src1 already quantized to q8_1 in ``vy``/``vy_h``
    (rows of ``round_up(ne10, 512)`` values, in the order channel, sample, column)."""
    qk = VEC_DOT[type_][1]
    ne00, ne01, ne02, ne03 = src0.ne
    ncols, ne2, ne3 = dst_t.ne[1], dst_t.ne[2], dst_t.ne[3]
    bs = src0.nb[0]                                   # bytes per block
    yrow = round_up(ne00, MATRIX_ROW_PADDING) // QK8_1   # q8_1 blocks per src1 column
    grid = (cdiv(ne01, MMVQ_NWARPS * MMVQ_ROWS), ne2, ne3)
    get_kernel(type_, ncols)[grid, (32, MMVQ_NWARPS), stream](
        vx, vx_h, vy, vy_h, dst, ne00 // qk, ne01, src0.nb[1] // bs, yrow,
        ne01, ne2 // ne02, src0.nb[2] // bs, ncols * yrow, ne01 * ncols,
        ne3 // ne03, src0.nb[3] // bs, ne2 * ncols * yrow, ne01 * ncols * ne2)
