"""mmvq: quantized matrix times a few vectors (GGML's ``mul_mat_vec_q``, spec §6.2-6.3).

Used for ``mul_mat(W, x)`` with W in Q4_K, Q6_K or Q8_0 and x of at most 8 columns (decoding).
x is first quantized to q8_1 (``quantize.py``); each output is then a sum of integer dot products
of weight quants with activation quants, scaled per block.

**Who does what.** A CUDA block has ``nwarps`` warps of 32 threads (``tid = 32·threadIdx.y +
threadIdx.x``) and computes ``rows_per_block`` rows of W against ``ncols`` columns of x. A weight
block of ``qk`` values is shared by ``qi/vdr`` threads: ``qi`` is the number of int32s of quants in
the block, ``vdr`` ("vec dot ratio") how many of them one thread takes per call. Thread ``tid``
starts at weight block ``kbx = tid / (qi/vdr)`` with quant offset ``iqs = vdr·(tid % (qi/vdr))``
and steps by ``blocks_per_iter = vdr·nwarps·32/qi`` blocks; its partner activation blocks start
at ``kby = kbx·qk/32``.

| type | qk | qi | vdr | threads per block | blocks per iteration (4 warps) |
| --- | --- | --- | --- | --- | --- |
| Q4_K | 256 | 32 | 2 | 16 | 8 |
| Q6_K | 256 | 32 | 1 | 32 | 4 |
| Q8_0 | 32 | 8 | 2 | 4 | 32 |

**Reduction.** Each thread keeps ``ncols × rows_per_block`` partial sums in registers. Warps 1..n-1
store theirs to shared memory, warp 0 adds them in warp order, then a warp butterfly
(``warp_reduce_sum``) leaves the total in every lane, and lane ``i`` writes row ``row0 + i``.

**Launch table** (GGML's generic NVIDIA table, Hopper included): 1 column: 4 warps, 1 row per block
(``rows_per_block = nwarps`` when K is small: fewer blocks per row than one iteration takes);
2-4 columns: 4 warps, 2 rows; 5-8 columns: 2 warps, 2 rows.

Weights come as two views of the same bytes: ``int32`` (or ``uint16`` for the 2-byte aligned
Q6_K/Q8_0 blocks) for quants and scales, and ``float16`` for the block scales ``d``/``dmin``; the
q8_1 activations likewise (``int32`` and ``float16``), all 2-D with one row per block.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from ...types import Type
from .common import F32_ZERO, MATRIX_ROW_PADDING, QK8_1, cdiv, dp4a, round_up, warp_reduce_sum

MMVQ_MAX_BATCH_SIZE = 8

M4 = np.int32(0x0F0F0F0F)     # low nibble of each byte
M2 = np.int32(0x03030303)     # low two bits of each byte
ONES = np.int32(0x01010101)   # dp4a(ONES, u, 0) = sum of u's four bytes
I0 = np.int32(0)


# -- Q4_K (block_q4_K: 36 ints = dm | scales[12] | qs[128]) -----------------------------------------
@cuda.jit(device=True, inline=True)
def vec_dot_q4_K_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """One thread's share of one Q4_K super-block: 8 quants of sub-block 2c and 8 of 2c+1.

    ``t = iqs/2`` in 0..15; the 64-value chunk is ``c = t/4`` and ``r = t%4`` picks positions
    ``4r..4r+3`` and ``16+4r..16+4r+3`` of its 32 bytes. Their low nibbles belong to sub-block 2c
    (q8_1 block ``bq8_offset = 2c``), their high nibbles to sub-block 2c+1 (q8_1 block 2c+1).
    """
    t = iqs // 2
    c = t // 4
    r = t % 4
    bq8_offset = 2 * c
    b = np.uint32(kbx)
    v0 = vx[b, 4 + 8 * c + r]
    v1 = vx[b, 8 + 8 * c + r]

    # the 6-bit scales and mins of sub-blocks 2c, 2c+1, read as the 16-bit words sc16[] (spec §6.2):
    # sc16[k] is half k%2 of scale int 1 + k/2; for chunk c the words needed are halves c%2
    hsh = 16 * (c % 2)
    s1 = (vx[b, 1] >> hsh) & 0xFFFF
    s2 = (vx[b, 2] >> hsh) & 0xFFFF
    if c < 2:
        aux0 = s1 & 0x3F3F
        aux1 = s2 & 0x3F3F
    else:
        s3 = (vx[b, 3] >> hsh) & 0xFFFF
        aux0 = (s3 & 0x0F0F) | ((s1 & 0xC0C0) >> 2)
        aux1 = ((s3 >> 4) & 0x0F0F) | ((s2 & 0xC0C0) >> 2)

    sumf_d = F32_ZERO
    sumf_m = F32_ZERO
    for i in range(2):
        yb = np.uint32(kby + bq8_offset + i)
        u0 = vy[yb, 1 + r]
        u1 = vy[yb, 5 + r]
        d8 = np.float32(vy_h[yb, 0])
        v0i = (v0 >> (4 * i)) & M4
        v1i = (v1 >> (4 * i)) & M4
        dot1 = dp4a(v1i, u1, dp4a(v0i, u0, I0))      # Σ q4·q8 over the 8 values
        dot2 = dp4a(ONES, u1, dp4a(ONES, u0, I0))    # Σ q8: the min term (mmvq ignores q8_1's s)
        sc = (aux0 >> (8 * i)) & 0xFF
        m = (aux1 >> (8 * i)) & 0xFF
        sumf_d += d8 * np.float32(dot1 * sc)
        sumf_m += d8 * np.float32(dot2 * m)
    return np.float32(vx_h[b, 0]) * sumf_d - np.float32(vx_h[b, 1]) * sumf_m


# -- Q6_K (block_q6_K: ql[128] | qh[64] | scales[16] int8 | d, 210 bytes = 105 half-words) ------------
@cuda.jit(device=True, inline=True)
def _int_b2(vx16, b, j):
    """An int32 from half-words j, j+1 of block b (GGML's get_int_b2, for 2-byte aligned blocks)."""
    return np.int32(vx16[b, j]) | (np.int32(vx16[b, j + 1]) << 16)


@cuda.jit(device=True, inline=True)
def _scale_q6_K(vx16, b, idx):
    """Signed 8-bit scale ``idx`` of super-block ``b`` (the scales start at half-word 96)."""
    s = (np.int32(vx16[b, 96 + idx // 2]) >> (8 * (idx % 2))) & 0xFF
    return s - 256 if s > 127 else s


@cuda.jit(device=True, inline=True)
def vec_dot_q6_K_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """One thread, one int of ``ql`` (``w = iqs`` in 0..31): 4 low and 4 high nibbles.

    In half ``n = w/16`` of the super-block, bytes ``b = 4·(w%16)``: for ``b < 32`` (``h = 0``) the
    low nibbles are values ``128n + b..``, the high ones ``128n + 64 + b..``; for ``b >= 32``
    (``h = 1``) they are ``128n + 32 + (b-32)..`` and ``128n + 96 + (b-32)..``. The two high bits of
    each value sit in ``qh`` int ``8n + w%8``, at bit ``2h`` (low nibbles) and ``4 + 2h`` (high).
    Values are ``q - 32``: ``dp4a(q, u) - 32·Σu``.
    """
    w = iqs
    n = w // 16
    h = (w % 16) // 8
    r = w % 8
    b = np.uint32(kbx)
    vl = _int_b2(vx, b, 2 * w)
    vh = _int_b2(vx, b, 64 + 2 * (8 * n + r)) >> (2 * h)
    q_lo = (vl & M4) | ((vh & M2) << 4)
    q_hi = ((vl >> 4) & M4) | (((vh >> 4) & M2) << 4)

    yb_lo = np.uint32(kby + 4 * n + h)
    yb_hi = np.uint32(kby + 4 * n + 2 + h)
    u_lo = vy[yb_lo, 1 + r]
    u_hi = vy[yb_hi, 1 + r]
    sc_lo = _scale_q6_K(vx, b, 8 * n + 2 * h + r // 4)
    sc_hi = _scale_q6_K(vx, b, 8 * n + 4 + 2 * h + r // 4)
    dot_lo = dp4a(q_lo, u_lo, I0) - 32 * dp4a(ONES, u_lo, I0)
    dot_hi = dp4a(q_hi, u_hi, I0) - 32 * dp4a(ONES, u_hi, I0)
    d8_lo = np.float32(vy_h[yb_lo, 0])
    d8_hi = np.float32(vy_h[yb_hi, 0])
    return np.float32(vx_h[b, 104]) * (d8_lo * np.float32(sc_lo * dot_lo) + d8_hi * np.float32(sc_hi * dot_hi))


# -- Q8_0 (block_q8_0: d | qs[32] int8, 34 bytes = 17 half-words) ------------------------------------
@cuda.jit(device=True, inline=True)
def vec_dot_q8_0_q8_1(vx, vx_h, kbx, vy, vy_h, kby, iqs):
    """Ints ``iqs`` and ``iqs+1`` of the 8 quant ints of one Q8_0 block against its q8_1 twin."""
    b = np.uint32(kbx)
    v0 = _int_b2(vx, b, 1 + 2 * iqs)
    v1 = _int_b2(vx, b, 3 + 2 * iqs)
    yb = np.uint32(kby)
    sumi = dp4a(v1, vy[yb, 2 + iqs], dp4a(v0, vy[yb, 1 + iqs], I0))
    return np.float32(vx_h[b, 0]) * np.float32(vy_h[yb, 0]) * np.float32(sumi)


# type -> (vec_dot, qk, qi, vdr, dtype of the quant view); the kernels see every view 2-D, one row
# per block (``view.reshape(-1, block bytes / itemsize)``), so an index is ``[block, word]``: one
# address computation per block, then fixed offsets.
VEC_DOT = {
    Type.Q4_K: (vec_dot_q4_K_q8_1, 256, 32, 2, np.int32),
    Type.Q6_K: (vec_dot_q6_K_q8_1, 256, 32, 1, np.uint16),
    Type.Q8_0: (vec_dot_q8_0_q8_1, 32, 8, 2, np.uint16),
}

_kernels = {}


def _make_kernel(type_, ncols, rows_per_block, nwarps):
    vec_dot, qk, qi, vdr, _ = VEC_DOT[type_]
    qi_vdr = qi // vdr
    blocks_per_iter = vdr * nwarps * 32 // qi
    y_per_x = qk // QK8_1
    n_acc = ncols * rows_per_block
    n_shared = max(1, (nwarps - 1) * n_acc * 32)

    @cuda.jit
    def mul_mat_vec_q(vx, vx_h, vy, vy_h, dst, blocks_per_row, nrows_x, stride_row_x, stride_col_y,
                      stride_col_dst, channel_ratio, stride_channel_x, stride_channel_y,
                      stride_channel_dst, sample_ratio, stride_sample_x, stride_sample_y,
                      stride_sample_dst):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = 32 * ty + tx
        row0 = rows_per_block * cuda.blockIdx.x
        channel_dst = cuda.blockIdx.y
        sample_dst = cuda.blockIdx.z
        x0 = (sample_dst // sample_ratio) * stride_sample_x + (channel_dst // channel_ratio) * stride_channel_x
        y0 = sample_dst * stride_sample_y + channel_dst * stride_channel_y
        d0 = sample_dst * stride_sample_dst + channel_dst * stride_channel_dst + row0

        tmp = cuda.local.array(n_acc, numba.float32)
        for a in range(n_acc):
            tmp[a] = F32_ZERO

        kqs = vdr * (tid % qi_vdr)
        kbx = tid // qi_vdr
        while kbx < blocks_per_row:
            kby = kbx * y_per_x
            for j in range(ncols):
                for i in range(rows_per_block):
                    row = min(row0 + i, nrows_x - 1)   # a partial last block re-reads the last row
                    tmp[j * rows_per_block + i] += vec_dot(
                        vx, vx_h, x0 + row * stride_row_x + kbx, vy, vy_h, y0 + j * stride_col_y + kby, kqs)
            kbx += blocks_per_iter

        tmp_shared = cuda.shared.array(n_shared, numba.float32)
        if ty > 0:
            for a in range(n_acc):
                tmp_shared[((ty - 1) * n_acc + a) * 32 + tx] = tmp[a]
        cuda.syncthreads()
        if ty > 0:
            return

        for j in range(ncols):
            for i in range(rows_per_block):
                a = j * rows_per_block + i
                for w in range(nwarps - 1):
                    tmp[a] += tmp_shared[(w * n_acc + a) * 32 + tx]
                tmp[a] = warp_reduce_sum(tmp[a], 32)
                if tx == i and row0 + i < nrows_x:
                    dst[d0 + j * stride_col_dst + i] = tmp[a]

    return mul_mat_vec_q


def launch_params(type_, ncols, blocks_per_row):
    """(nwarps, rows_per_block) from GGML's generic NVIDIA table."""
    _, _, qi, vdr, _ = VEC_DOT[type_]
    if ncols == 1:
        nwarps = 4
        small_k = blocks_per_row < nwarps * (vdr * 32 // qi)
        return nwarps, (nwarps if small_k else 1)
    if ncols <= 4:
        return 4, 2
    return 2, 2


def get_kernel(type_, ncols, blocks_per_row):
    nwarps, rpb = launch_params(type_, ncols, blocks_per_row)
    key = (type_, ncols, rpb, nwarps)
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = _make_kernel(type_, ncols, rpb, nwarps)
    return k, nwarps, rpb


def launch_mmvq(stream, type_, vx, vx_h, vy, vy_h, dst, src0, dst_t):
    """``dst_t = mul_mat(src0, src1)`` with src1 already quantized to q8_1 in ``vy``/``vy_h``
    (rows of ``round_up(ne10, 512)`` values, in the order channel, sample, column)."""
    qk = VEC_DOT[type_][1]
    ne00, ne01, ne02, ne03 = src0.ne
    ncols, ne2, ne3 = dst_t.ne[1], dst_t.ne[2], dst_t.ne[3]
    bs = src0.nb[0]                                   # bytes per block
    blocks_per_row = ne00 // qk
    kernel, nwarps, rpb = get_kernel(type_, ncols, blocks_per_row)
    yrow = round_up(ne00, MATRIX_ROW_PADDING) // QK8_1   # q8_1 blocks per src1 column
    grid = (cdiv(ne01, rpb), ne2, ne3)
    kernel[grid, (32, nwarps), stream](
        vx, vx_h, vy, vy_h, dst, blocks_per_row, ne01, src0.nb[1] // bs, yrow,
        ne01, ne2 // ne02, src0.nb[2] // bs, ncols * yrow, ne01 * ncols,
        ne3 // ne03, src0.nb[3] // bs, ne2 * ncols * yrow, ne01 * ncols * ne2)
