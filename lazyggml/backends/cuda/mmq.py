"""mmq: quantized matrix times matrix through shared-memory tiles (GGML's ``mul_mat_q``, docs/quant-formats.md §6.4).

Used for ``mul_mat(W, x)`` with W in Q4_K and x of more than 8 columns (prompt processing, or a
decode step of many sequences). GGML on Turing and newer feeds int8 tensor cores (``mma.sync``),
which numba-cuda has no API for (the MMA variant below reaches them through inline PTX); the
reference kernel is the **dp4a layout**, GGML's path for GPUs without int8 MMA, in our own
arrangement.

**Tiles.** A CUDA block of ``nwarps`` warps computes an ``I × J`` tile of the result: ``I`` rows of
W (output features) by ``J`` columns of x (tokens). The K loop takes one Q4_K super-block
(``MMQ_ITER_K`` = 256 values) per row per iteration. Each iteration:

1. ``load_tiles``: all threads copy the x tile (I rows × 32 ints of packed nibbles) and unpack
   each row's 12 scale bytes into floats ``d·sc_k`` and ``dmin·m_k`` (k = 8 sub-blocks, stored
   ``[k][row]``); then the y tile: for J columns, the two ``block_q8_1_mmq`` (DS4 layout, see
   ``quantize.py``) that cover these 256 values, quants to ``ys[col][64]`` and the headers to
   ``yd[k][col]`` (``d_k``) and ``ysum[k][col]`` (``s_k = Σx``). The copies go in 16-byte pieces
   whose addresses each thread computes once, before the K loop (``_load_tiles`` says how).
2. ``syncthreads``; every thread adds its ``R × C`` outputs; ``syncthreads``.

**Thread tile.** Lane ``tx`` owns rows ``tx + 32·rr`` (``rr < R = I/32``) and warp ``ty`` owns
columns ``ty + nwarps·cc`` (``cc < C = J/nwarps``): the 32 lanes of a warp read 32 different rows
of x (conflict-free: x rows are 33 ints apart) and one column of y (a broadcast). For sub-block ``k`` (32 values: the low
nibbles of chunk ``k/2`` when k is even, the high ones when odd), the integer sums
``sumi = Σ_l dp4a(nibbles(x[row][8·(k/2) + l]), y[col][8k + l])`` over ``l < 8`` go to registers,
then ``acc += (d·sc_k)·d8_k·sumi − (dmin·m_k)·s_k``: the min term uses the activations' float
sums ``s``, which is why mmq needs the DS4 header while mmvq recounts from the quants.

The ``I × J`` tile: I = 128, J up to 64, 8 warps (45 KB of shared memory, under the 48 KB a numba
kernel may declare statically). Rows and columns past the end are clamped on load and skipped on
store. This kernel is the reference: it runs everywhere, the simulator included.

**MMA variant** (``mul_mat_q4_K_mma``, GPUs with int8 tensor cores, sm_80+; GGML's path on an
H200). The same tiles and loads; the products go through ``mma.sync.m16n8k32`` (a warp-wide
16×32 by 32×8 int8 product, ``common.mma_s8_16x8x32``, inline PTX). One sub-block of 32 values is
exactly one k=32 step, so warp ``w`` takes rows ``16w .. 16w+15`` and, per sub-block, builds the A
fragment from the nibbles of its rows (four ints, reused for every column tile) and runs one MMA
per 8 columns; the int32 results get the same float epilogue ``(d·sc_k)·d8_k·C − (dmin·m_k)·s_k``
(GGML's ``dA·dB·C + mA·sB``), as two fused multiply-adds per result. Shared rows are padded so
that the fragment reads hit 32 different banks: x rows 36 ints, y rows 68 ints (lane ``(g, t)``
reads int ``g·36 + t``: bank ``4g + t``); both are multiples of 4 ints, so the loader stores
16-byte pieces. Each lane's shared-memory reads are a per-lane base (``np.uint32``, computed once)
plus constants, which the compiler folds into the load instructions (common.py's index note).

Unlike GGML's MMA kernel the factors ``d·sc`` stay in float32 (GGML rounds them to fp16).

**Split-K.** The grid has a block per tile, ``cdiv(rows, 128) × cdiv(ncols, J)`` per channel:
with few columns (a decode step of 32 sequences: one column tile) a 4096-row product is 32 blocks
on an H100's 132 multiprocessors, each walking all of K, and took as long as one with 14336 rows.
When the grid has at most half the blocks the GPU runs at once (``MMQ_MIN_BLOCKS`` per
multiprocessor; ``split_k``), the K loop is cut into ``n_split`` ranges of super-blocks, as many
as keep the grid within those blocks, each ``MMQ_SPLIT_MIN_KB`` super-blocks or more. Grid z
numbers (channel, range) as ``i23·n_split + sp``; each block writes its partial tile, laid out as
dst, to copy ``sp`` in a work area, and ``sum_splits`` then adds the copies in the order sp = 0,
1, ...: the same result on every run (no atomics), which differs from the unsplit one only in the
order of the float sums. A prompt's grid is full and is not split; with one range the kernels
write dst directly.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from ... import debug
from . import common
from .common import (F32_ZERO, Q8_1_MMQ_INTS, SIM, cdiv, device, dp4a, half2_float2, jit_kernel, load_int4,
                     multiprocessors, store_int4, tensor_cores)
from .quantize import mmq_kblocks

MMQ_ITER_K = 256
MMQ_I = 128
MMQ_NWARPS = 8
MMQ_J = (8, 16, 32, 64)
MMQ_MIN_BLOCKS = 2   # launch bounds: registers capped (128) so that two blocks share a multiprocessor
MMQ_SPLIT_MIN_KB = 2   # super-blocks per split-K range at least: its fixed costs stay small beside its K loop

M4 = np.int32(0x0F0F0F0F)
M6 = np.int32(0x3F3F3F3F)
M2 = np.int32(0x03030303)
I0 = np.int32(0)

_kernels = {}


def _make_kernel(I, J, nwarps):
    R = I // 32
    C = J // nwarps
    RC = R * C
    nthreads = 32 * nwarps
    XS = 33                      # x row stride in ints: 32 + 1 pad
    n_xs, n_xsc = I * XS, 8 * I
    n_ys, n_ysc = J * 64, 8 * J
    tile_offsets, load_tiles = _load_tiles(I, J, XS, 64, nthreads)
    NXQ, NYQ = _pieces(I, J, nthreads)

    @jit_kernel(launch_bounds=(nthreads, MMQ_MIN_BLOCKS))
    def mul_mat_q4_K(vx, vy, dst, blocks_per_row, nrows_x, stride_row_x, ncols_y,
                     stride_col_dst, channel_ratio, stride_channel_x, stride_channel_dst, sample_ratio,
                     stride_sample_x, stride_sample_dst, kblocks, ne2, n_split, stride_split_dst):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = 32 * ty + tx
        row0 = I * cuda.blockIdx.x
        col0 = J * cuda.blockIdx.y
        i23 = cuda.blockIdx.z // n_split
        sp = cuda.blockIdx.z - i23 * n_split     # split-K: this block's range of super-blocks
        kb0 = sp * blocks_per_row // n_split
        kb1 = (sp + 1) * blocks_per_row // n_split
        i2 = i23 % ne2
        i3 = i23 // ne2
        x0 = (i3 // sample_ratio) * stride_sample_x + (i2 // channel_ratio) * stride_channel_x
        y0 = i23 * kblocks * ncols_y              # first q8_1_mmq block of this channel
        d0 = sp * stride_split_dst + i3 * stride_sample_dst + i2 * stride_channel_dst

        xs = cuda.shared.array(n_xs, numba.int32)
        xd = cuda.shared.array(n_xsc, numba.float32)      # d·sc_k, [k][row]
        xm = cuda.shared.array(n_xsc, numba.float32)      # dmin·m_k, [k][row]
        ys = cuda.shared.array(n_ys, numba.int32)         # [col][64 ints]
        yd = cuda.shared.array(n_ysc, numba.float32)      # d_k, [k][col]
        ysum = cuda.shared.array(n_ysc, numba.float32)    # s_k, [k][col]

        acc = cuda.local.array(RC, numba.float32)
        for a in range(RC):
            acc[a] = F32_ZERO
        sumi = cuda.local.array(RC, numba.int32)
        yv = cuda.local.array(C, numba.int32)

        xo = cuda.local.array(NXQ, numba.int64)
        yo = cuda.local.array(NYQ, numba.int64)
        xh, yh = tile_offsets(tid, x0, y0, row0, col0, nrows_x, stride_row_x, ncols_y, xo, yo)
        for kb in range(kb0, kb1):
            load_tiles(vx, vy, xs, xd, xm, ys, yd, ysum, tid, xo, yo, xh, yh, kb, ncols_y)
            cuda.syncthreads()

            # -- vec_dot: 8 sub-blocks of 32 values
            for k in range(8):
                for a in range(RC):
                    sumi[a] = I0
                shift = 4 * (k % 2)
                for l in range(8):
                    for cc in range(C):
                        yv[cc] = ys[np.uint32((ty + nwarps * cc) * 64 + 8 * k + l)]
                    for rr in range(R):
                        v = (xs[np.uint32((tx + 32 * rr) * XS + 8 * (k // 2) + l)] >> shift) & M4
                        for cc in range(C):
                            sumi[rr * C + cc] = dp4a(v, yv[cc], sumi[rr * C + cc])
                for rr in range(R):
                    dk = xd[np.uint32(k * I + tx + 32 * rr)]
                    mk = xm[np.uint32(k * I + tx + 32 * rr)]
                    for cc in range(C):
                        col = ty + nwarps * cc
                        acc[rr * C + cc] += (dk * yd[np.uint32(k * J + col)]) * np.float32(sumi[rr * C + cc]) \
                            - mk * ysum[np.uint32(k * J + col)]
            cuda.syncthreads()

        for rr in range(R):
            row = row0 + tx + 32 * rr
            for cc in range(C):
                col = col0 + ty + nwarps * cc
                if row < nrows_x and col < ncols_y:
                    dst[d0 + col * stride_col_dst + row] = acc[rr * C + cc]

    return mul_mat_q4_K


def _pieces(I, J, nthreads):
    """16-byte pieces of the x and the y tile that each thread copies (the last y piece of a thread
    may be past the end)."""
    assert I * 8 % nthreads == 0 and 2 * I == nthreads
    return I * 8 // nthreads, cdiv(J * 16, nthreads)


@device
def _store_ints(a, i, v0, v1, v2, v3):
    """``store_int4`` for rows whose stride is not a multiple of 4 ints (the dp4a kernel's 33)."""
    a[i] = v0
    a[i + 1] = v1
    a[i + 2] = v2
    a[i + 3] = v3


def _load_tiles(I, J, XS, YS, nthreads):
    """The tile loader shared by both kernels (step 1 in the module docstring).

    Everything moves in 16-byte pieces (``load_int4``/``store_int4``): a Q4_K block (144 bytes)
    and a ``block_q8_1_mmq`` (144 bytes) are 9 pieces each, 16-byte aligned. Thread ``tid`` copies
    the same pieces in every iteration, so ``tile_offsets`` computes their addresses once; an
    iteration adds ``kb`` blocks to them.

    * x quants: ``I × 8`` pieces; piece ``p = tid + nthreads·r`` is piece ``p % 8`` of row ``p / 8``.
    * y quants: ``J × 2 × 8`` pieces; piece ``p`` is piece ``p % 8`` of half ``(p/8) % 2`` of
      column ``p / 16``.
    * headers: thread ``tid < I`` unpacks row ``tid``'s scales (``d·sc_k``), ``tid >= I`` (up to
      ``2I``) its mins (``dmin·m_k``); thread ``tid < 2J`` (a column and a half) the four
      ``half2(d_k, s_k)`` of a y block.
    """
    NXQ, NYQ = _pieces(I, J, nthreads)
    store_x = store_int4 if XS % 4 == 0 else _store_ints

    @device
    def tile_offsets(tid, x0, y0, row0, col0, nrows_x, stride_row_x, ncols_y, xo, yo):
        """Fill ``xo``/``yo`` with the int offsets of this thread's pieces at ``kb = 0``; returns the
        offsets of its x header and y header."""
        q = tid % 8
        for r in range(NXQ):
            row = tid // 8 + (nthreads // 8) * r
            xo[r] = (x0 + min(row0 + row, nrows_x - 1) * stride_row_x) * 36 + 4 + 4 * q
        for r in range(NYQ):
            p = tid + nthreads * r
            col = min(col0 + p // 16, ncols_y - 1)
            yo[r] = (y0 + (p // 8) % 2 * ncols_y + col) * Q8_1_MMQ_INTS + 4 + 4 * q
        xh = (x0 + min(row0 + tid % I, nrows_x - 1) * stride_row_x) * 36
        yh = (y0 + tid % 2 * ncols_y + min(col0 + tid // 2, ncols_y - 1)) * Q8_1_MMQ_INTS
        return xh, yh

    @device
    def load_tiles(vx, vy, xs, xd, xm, ys, yd, ysum, tid, xo, yo, xh, yh, kb, ncols_y):
        xk = kb * 36                               # ints per Q4_K block
        yk = 2 * kb * ncols_y * Q8_1_MMQ_INTS      # two q8_1_mmq blocks per column and super-block
        q = tid % 8
        for r in range(NXQ):
            v0, v1, v2, v3 = load_int4(vx, xo[r] + xk)
            store_x(xs, (tid // 8 + (nthreads // 8) * r) * XS + 4 * q, v0, v1, v2, v3)
        for r in range(NYQ):
            p = tid + nthreads * r
            if p < J * 16:
                v0, v1, v2, v3 = load_int4(vy, yo[r] + yk)
                store_int4(ys, p // 16 * YS + 32 * ((p // 8) % 2) + 4 * q, v0, v1, v2, v3)

        # scales (tid < I) or mins (tid >= I) of row tid % I: sc0..3 / m0..3 in the low 6 bits of
        # scale ints 1 / 2, sc4..7 / m4..7 from the nibbles of int 3 and the top bits of ints 1 / 2
        row = tid % I
        dm, s1, s2, s3 = load_int4(vx, xh + xk)
        fd, fm = half2_float2(dm)
        if tid < I:
            f, lo, hi, dstv = fd, s1 & M6, (s3 & M4) | (((s1 >> 6) & M2) << 4), xd
        else:
            f, lo, hi, dstv = fm, s2 & M6, ((s3 >> 4) & M4) | (((s2 >> 6) & M2) << 4), xm
        for k in range(4):
            dstv[k * I + row] = f * np.float32((lo >> (8 * k)) & 0xFF)
            dstv[(k + 4) * I + row] = f * np.float32((hi >> (8 * k)) & 0xFF)
        if tid < 2 * J:
            col = tid // 2
            h = tid % 2
            hdr = load_int4(vy, yh + yk)
            for w in range(4):
                d, s_ = half2_float2(hdr[w])
                yd[(4 * h + w) * J + col] = d
                ysum[(4 * h + w) * J + col] = s_

    return tile_offsets, load_tiles


def _make_mma_kernel(J):
    I, nwarps = MMQ_I, MMQ_NWARPS      # 16 rows per warp
    NT = J // 8                  # 8-column MMA tiles per warp
    NACC = 4 * NT
    XS, YS = 36, 68
    n_xs, n_xsc, n_ys, n_ysc = I * XS, 8 * I, J * YS, 8 * J
    tile_offsets, load_tiles = _load_tiles(I, J, XS, YS, 32 * nwarps)
    NXQ, NYQ = _pieces(I, J, 32 * nwarps)
    mma = common.mma_s8_16x8x32

    @jit_kernel(launch_bounds=(32 * nwarps, MMQ_MIN_BLOCKS))
    def mul_mat_q4_K_mma(vx, vy, dst, blocks_per_row, nrows_x, stride_row_x, ncols_y,
                         stride_col_dst, channel_ratio, stride_channel_x, stride_channel_dst, sample_ratio,
                         stride_sample_x, stride_sample_dst, kblocks, ne2, n_split, stride_split_dst):
        lane = cuda.threadIdx.x
        w = cuda.threadIdx.y
        tid = 32 * w + lane
        g = lane // 4
        t = lane % 4
        row0 = I * cuda.blockIdx.x
        col0 = J * cuda.blockIdx.y
        i23 = cuda.blockIdx.z // n_split
        sp = cuda.blockIdx.z - i23 * n_split
        kb0 = sp * blocks_per_row // n_split
        kb1 = (sp + 1) * blocks_per_row // n_split
        i2 = i23 % ne2
        i3 = i23 // ne2
        x0 = (i3 // sample_ratio) * stride_sample_x + (i2 // channel_ratio) * stride_channel_x
        y0 = i23 * kblocks * ncols_y
        d0 = sp * stride_split_dst + i3 * stride_sample_dst + i2 * stride_channel_dst

        xs = cuda.shared.array(n_xs, numba.int32)
        xd = cuda.shared.array(n_xsc, numba.float32)
        xm = cuda.shared.array(n_xsc, numba.float32)
        ys = cuda.shared.array(n_ys, numba.int32)
        yd = cuda.shared.array(n_ysc, numba.float32)
        ysum = cuda.shared.array(n_ysc, numba.float32)

        acc = cuda.local.array(NACC, numba.float32)
        for a in range(NACC):
            acc[a] = F32_ZERO
        r0 = 16 * w + g          # this lane's two rows of the warp's 16 (and r0 + 8)
        # per-lane bases of the shared reads; sub-block k and tile nt add constants to them
        xa = np.uint32(r0 * XS + t)
        xsa = np.uint32(r0)
        yb = np.uint32(g * YS + t)
        yc = np.uint32(2 * t)

        xo = cuda.local.array(NXQ, numba.int64)
        yo = cuda.local.array(NYQ, numba.int64)
        xh, yh = tile_offsets(tid, x0, y0, row0, col0, nrows_x, stride_row_x, ncols_y, xo, yo)
        for kb in range(kb0, kb1):
            load_tiles(vx, vy, xs, xd, xm, ys, yd, ysum, tid, xo, yo, xh, yh, kb, ncols_y)
            cuda.syncthreads()
            for k in range(8):
                xk = np.uint32(xa + 8 * (k // 2))
                sh = 4 * (k % 2)
                a0 = (xs[xk] >> sh) & M4
                a1 = (xs[xk + 8 * XS] >> sh) & M4
                a2 = (xs[xk + 4] >> sh) & M4
                a3 = (xs[xk + 8 * XS + 4] >> sh) & M4
                sk = np.uint32(xsa + k * I)
                dA0 = xd[sk]
                dA1 = xd[sk + 8]
                mA0 = xm[sk]
                mA1 = xm[sk + 8]
                ybk = np.uint32(yb + 8 * k)
                yck = np.uint32(yc + k * J)
                for nt in range(NT):
                    c0, c1, c2, c3 = mma(a0, a1, a2, a3, ys[ybk + 8 * YS * nt], ys[ybk + 8 * YS * nt + 4])
                    d8a = yd[yck + 8 * nt]
                    d8b = yd[yck + 8 * nt + 1]
                    s8a = ysum[yck + 8 * nt]
                    s8b = ysum[yck + 8 * nt + 1]
                    # (dA·d8)·C − mA·s8, as two fused multiply-adds into the accumulator
                    acc[4 * nt] = (acc[4 * nt] - mA0 * s8a) + (dA0 * d8a) * np.float32(c0)
                    acc[4 * nt + 1] = (acc[4 * nt + 1] - mA0 * s8b) + (dA0 * d8b) * np.float32(c1)
                    acc[4 * nt + 2] = (acc[4 * nt + 2] - mA1 * s8a) + (dA1 * d8a) * np.float32(c2)
                    acc[4 * nt + 3] = (acc[4 * nt + 3] - mA1 * s8b) + (dA1 * d8b) * np.float32(c3)
            cuda.syncthreads()

        for nt in range(NT):
            for hf in range(2):
                row = row0 + r0 + 8 * hf
                for e in range(2):
                    col = col0 + 8 * nt + 2 * t + e
                    if row < nrows_x and col < ncols_y:
                        dst[d0 + col * stride_col_dst + row] = acc[4 * nt + 2 * hf + e]

    return mul_mat_q4_K_mma


def use_mma():
    """Tensor cores when the GPU has int8 MMA (sm_80+) unless ``LAZYGGML_CUDA_MMQ=dp4a``."""
    return tensor_cores() and debug.value("LAZYGGML_CUDA_MMQ") != "dp4a"


def pick_J(ncols):
    """The smallest tile width that covers the columns in one tile, else the widest."""
    for J in MMQ_J:
        if ncols <= J:
            return J
    return MMQ_J[-1]


def get_kernel(J, mma):
    k = _kernels.get((J, mma))
    if k is None:
        k = _kernels[(J, mma)] = _make_mma_kernel(J) if mma else _make_kernel(MMQ_I, J, MMQ_NWARPS)
    return k


def split_k(nblocks, blocks_per_row, nsm):
    """How many ranges of super-blocks the K loop is cut into (split-K, module docstring): enough
    copies of a grid of ``nblocks`` to come near ``MMQ_MIN_BLOCKS`` blocks per multiprocessor
    without passing it, each range ``MMQ_SPLIT_MIN_KB`` super-blocks or more; 1 for a grid that
    already has half that many blocks (a prompt's)."""
    return max(1, min(MMQ_MIN_BLOCKS * nsm // nblocks, blocks_per_row // MMQ_SPLIT_MIN_KB))


SUM_THREADS = 32 if SIM else 256    # one warp under the simulator, where every thread costs a Python thread


@jit_kernel()
def sum_splits(part, dst, n, n_split):
    """``dst[i] = Σ_sp part[sp·n + i]``, the splits added in order: the same sum on every run."""
    i = cuda.blockIdx.x * SUM_THREADS + cuda.threadIdx.x
    if i < n:
        acc = part[i]
        for sp in range(1, n_split):
            acc += part[sp * n + i]
        dst[i] = acc


def launch_mmq(be, vx, vy, dst, src0, dst_t):
    """``dst_t = mul_mat(src0, src1)`` for Q4_K src0 (``vx``, as int32), src1 already in ``vy``
    (DS4), on ``be``'s stream; split-K partial tiles go to its "mmq_part" work area. The kernels read
    the ``half2`` block headers as int32s too (``half2_float2``)."""
    ne00, ne01, ne02, ne03 = src0.ne
    ncols, ne2, ne3 = dst_t.ne[1], dst_t.ne[2], dst_t.ne[3]
    bs = src0.nb[0]
    J = pick_J(ncols)
    blocks_per_row = ne00 // MMQ_ITER_K
    grid = (cdiv(ne01, MMQ_I), cdiv(ncols, J), ne2 * ne3)
    n_split = split_k(grid[0] * grid[1] * grid[2], blocks_per_row, multiprocessors())
    n = ne01 * ncols * ne2 * ne3           # dst's elements: a split's partial result is laid out as dst
    out = dst if n_split == 1 else be.scratch("mmq_part", 4 * n * n_split, np.float32)
    get_kernel(J, use_mma())[grid[:2] + (grid[2] * n_split,), (32, MMQ_NWARPS), be.stream](
        vx, vy, out, blocks_per_row, ne01, src0.nb[1] // bs, ncols,
        ne01, ne2 // ne02, src0.nb[2] // bs, ne01 * ncols, ne3 // ne03, src0.nb[3] // bs,
        ne01 * ncols * ne2, mmq_kblocks(ne00), ne2, n_split, n)
    if n_split > 1:
        sum_splits[cdiv(n, SUM_THREADS), SUM_THREADS, be.stream](out, dst, n, n_split)
