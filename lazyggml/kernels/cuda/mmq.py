"""mmq: quantized matrix times matrix through shared-memory tiles (GGML's ``mul_mat_q``, spec §6.4).

Used for ``mul_mat(W, x)`` with W in Q4_K and x of more than 8 columns (prompt processing). GGML
on Turing and newer feeds int8 tensor cores (``mma.sync``), which numba-cuda cannot issue; this is
the **dp4a layout**, GGML's path for GPUs without int8 MMA, in our own arrangement.

**Tiles.** A CUDA block of ``nwarps`` warps computes an ``I × J`` tile of the result: ``I`` rows of
W (output features) by ``J`` columns of x (tokens). The K loop takes one Q4_K super-block
(``MMQ_ITER_K`` = 256 values) per row per iteration. Each iteration:

1. ``load_tiles``: all threads copy the x tile (I rows × 32 ints of packed nibbles, row stride 33
   ints so that 32 lanes reading 32 consecutive rows hit 32 different banks) and unpack each row's
   12 scale bytes into floats ``d·sc_k`` and ``dmin·m_k`` (k = 8 sub-blocks, stored ``[k][row]``);
   then the y tile: for J columns, the two ``block_q8_1_mmq`` (DS4 layout, see ``quantize.py``)
   that cover these 256 values, quants to ``ys[col][64]`` and the headers to ``yd[k][col]``
   (``d_k``) and ``ys_sum[k][col]`` (``s_k = Σx``).
2. ``syncthreads``; every thread adds its ``R × C`` outputs; ``syncthreads``.

**Thread tile.** Lane ``tx`` owns rows ``tx + 32·rr`` (``rr < R = I/32``) and warp ``ty`` owns
columns ``ty + nwarps·cc`` (``cc < C = J/nwarps``): the 32 lanes of a warp read 32 different rows
of x (conflict-free) and one column of y (a broadcast). For sub-block ``k`` (32 values: the low
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
(GGML's ``dA·dB·C + mA·sB``). Shared rows are padded so that the fragment reads hit 32 different
banks: x rows 36 ints, y rows 68 ints (lane ``(g, t)`` reads int ``g·36 + t``: bank ``4g + t``).

Unlike GGML's MMA kernel the factors ``d·sc`` stay in float32 (GGML rounds them to fp16).
"""
from __future__ import annotations

import os

import numba
import numpy as np
from numba import cuda

from . import common
from .common import F32_ZERO, Q8_1_MMQ_INTS, SIM, cdiv, dp4a, jit_kernel
from .quantize import mmq_kblocks

MMQ_ITER_K = 256
MMQ_I = 128
MMQ_NWARPS = 8
MMQ_J = (8, 16, 32, 64)
MMQ_MIN_BLOCKS = 2   # launch bounds: registers capped (128) so that two blocks share a multiprocessor

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
    load_tiles = _load_tiles(I, J, XS, 64, nthreads)

    @jit_kernel(launch_bounds=(nthreads, MMQ_MIN_BLOCKS))
    def mul_mat_q4_K(vx, vx_h, vy, vy_h, dst, blocks_per_row, nrows_x, stride_row_x, ncols_y,
                     stride_col_dst, channel_ratio, stride_channel_x, stride_channel_dst, sample_ratio,
                     stride_sample_x, stride_sample_dst, kblocks, ne2):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = 32 * ty + tx
        row0 = I * cuda.blockIdx.x
        col0 = J * cuda.blockIdx.y
        i23 = cuda.blockIdx.z
        i2 = i23 % ne2
        i3 = i23 // ne2
        x0 = (i3 // sample_ratio) * stride_sample_x + (i2 // channel_ratio) * stride_channel_x
        y0 = i23 * kblocks * ncols_y              # first q8_1_mmq block of this channel
        d0 = i3 * stride_sample_dst + i2 * stride_channel_dst

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

        for kb in range(blocks_per_row):
            load_tiles(vx, vx_h, vy, vy_h, xs, xd, xm, ys, yd, ysum, tid, x0, y0, row0, col0, kb, nrows_x,
                       stride_row_x, ncols_y)
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


def _load_tiles(I, J, XS, YS, nthreads):
    """The tile loader shared by both kernels (step 1 in the module docstring)."""

    @cuda.jit(device=True, inline=True)
    def load_tiles(vx, vx_h, vy, vy_h, xs, xd, xm, ys, yd, ysum, tid, x0, y0, row0, col0, kb, nrows_x,
                   stride_row_x, ncols_y):
        for idx in range(tid, I * 32, nthreads):
            row = idx // 32
            gr = min(row0 + row, nrows_x - 1)
            xs[row * XS + idx % 32] = vx[np.uint32((x0 + gr * stride_row_x + kb) * 36 + 4 + idx % 32)]
        for idx in range(tid, 2 * I, nthreads):
            row = idx % I
            bx = (x0 + min(row0 + row, nrows_x - 1) * stride_row_x + kb) * 36
            u0 = vx[np.uint32(bx + 1)]
            u1 = vx[np.uint32(bx + 2)]
            u2 = vx[np.uint32(bx + 3)]
            if idx < I:      # scales: sc0..3 in u0's low 6 bits, sc4..7 from u2 and u0's top bits
                f = np.float32(vx_h[np.uint32(2 * bx)])
                lo = u0 & M6
                hi = (u2 & M4) | (((u0 >> 6) & M2) << 4)
                dstv = xd
            else:            # mins: the same from u1 and u2's high nibbles
                f = np.float32(vx_h[np.uint32(2 * bx + 1)])
                lo = u1 & M6
                hi = ((u2 >> 4) & M4) | (((u1 >> 6) & M2) << 4)
                dstv = xm
            for k in range(4):
                dstv[k * I + row] = f * np.float32((lo >> (8 * k)) & 0xFF)
                dstv[(k + 4) * I + row] = f * np.float32((hi >> (8 * k)) & 0xFF)
        for idx in range(tid, J * 2 * Q8_1_MMQ_INTS, nthreads):
            col = idx // (2 * Q8_1_MMQ_INTS)
            h = (idx // Q8_1_MMQ_INTS) % 2            # which 128-value half of the super-block
            w = idx % Q8_1_MMQ_INTS
            src = (y0 + (2 * kb + h) * ncols_y + min(col0 + col, ncols_y - 1)) * Q8_1_MMQ_INTS + w
            if w < 4:
                yd[(4 * h + w) * J + col] = np.float32(vy_h[np.uint32(2 * src)])
                ysum[(4 * h + w) * J + col] = np.float32(vy_h[np.uint32(2 * src + 1)])
            else:
                ys[col * YS + 32 * h + w - 4] = vy[np.uint32(src)]

    return load_tiles


def _make_mma_kernel(J):
    I, nwarps = MMQ_I, MMQ_NWARPS
    NT = J // 8                  # 8-column MMA tiles per warp
    NACC = 4 * NT
    XS, YS = 36, 68
    n_xs, n_xsc, n_ys, n_ysc = I * XS, 8 * I, J * YS, 8 * J
    load_tiles = _load_tiles(I, J, XS, YS, 32 * nwarps)
    mma = common.mma_s8_16x8x32

    @jit_kernel(launch_bounds=(32 * nwarps, MMQ_MIN_BLOCKS))
    def mul_mat_q4_K_mma(vx, vx_h, vy, vy_h, dst, blocks_per_row, nrows_x, stride_row_x, ncols_y,
                         stride_col_dst, channel_ratio, stride_channel_x, stride_channel_dst, sample_ratio,
                         stride_sample_x, stride_sample_dst, kblocks, ne2):
        lane = cuda.threadIdx.x
        w = cuda.threadIdx.y
        tid = 32 * w + lane
        g = lane // 4
        t = lane % 4
        row0 = I * cuda.blockIdx.x
        col0 = J * cuda.blockIdx.y
        i23 = cuda.blockIdx.z
        i2 = i23 % ne2
        i3 = i23 // ne2
        x0 = (i3 // sample_ratio) * stride_sample_x + (i2 // channel_ratio) * stride_channel_x
        y0 = i23 * kblocks * ncols_y
        d0 = i3 * stride_sample_dst + i2 * stride_channel_dst

        xs = cuda.shared.array(n_xs, numba.int32)
        xd = cuda.shared.array(n_xsc, numba.float32)
        xm = cuda.shared.array(n_xsc, numba.float32)
        ys = cuda.shared.array(n_ys, numba.int32)
        yd = cuda.shared.array(n_ysc, numba.float32)
        ysum = cuda.shared.array(n_ysc, numba.float32)

        acc = cuda.local.array(NACC, numba.float32)
        for a in range(NACC):
            acc[a] = F32_ZERO
        r0 = 16 * w + g          # this lane's two rows of the warp's 16
        r1 = r0 + 8

        for kb in range(blocks_per_row):
            load_tiles(vx, vx_h, vy, vy_h, xs, xd, xm, ys, yd, ysum, tid, x0, y0, row0, col0, kb, nrows_x,
                       stride_row_x, ncols_y)
            cuda.syncthreads()
            for k in range(8):
                xo = 8 * (k // 2) + t
                sh = 4 * (k % 2)
                a0 = (xs[np.uint32(r0 * XS + xo)] >> sh) & M4
                a1 = (xs[np.uint32(r1 * XS + xo)] >> sh) & M4
                a2 = (xs[np.uint32(r0 * XS + xo + 4)] >> sh) & M4
                a3 = (xs[np.uint32(r1 * XS + xo + 4)] >> sh) & M4
                dA0 = xd[np.uint32(k * I + r0)]
                dA1 = xd[np.uint32(k * I + r1)]
                mA0 = xm[np.uint32(k * I + r0)]
                mA1 = xm[np.uint32(k * I + r1)]
                for nt in range(NT):
                    yo = (8 * nt + g) * YS + 8 * k + t
                    c0, c1, c2, c3 = mma(a0, a1, a2, a3, ys[np.uint32(yo)], ys[np.uint32(yo + 4)])
                    ca = np.uint32(k * J + 8 * nt + 2 * t)
                    d8a = yd[ca]
                    d8b = yd[ca + 1]
                    s8a = ysum[ca]
                    s8b = ysum[ca + 1]
                    acc[4 * nt] += (dA0 * d8a) * np.float32(c0) - mA0 * s8a
                    acc[4 * nt + 1] += (dA0 * d8b) * np.float32(c1) - mA0 * s8b
                    acc[4 * nt + 2] += (dA1 * d8a) * np.float32(c2) - mA1 * s8a
                    acc[4 * nt + 3] += (dA1 * d8b) * np.float32(c3) - mA1 * s8b
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
    if SIM or os.environ.get("LAZYGGML_CUDA_MMQ", "") == "dp4a":
        return False
    return cuda.get_current_device().compute_capability >= (8, 0)


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


def launch_mmq(stream, vx, vx_h, vy, vy_h, dst, src0, dst_t):
    """``dst_t = mul_mat(src0, src1)`` for Q4_K src0, src1 already in ``vy``/``vy_h`` (DS4)."""
    ne00, ne01, ne02, ne03 = src0.ne
    ncols, ne2, ne3 = dst_t.ne[1], dst_t.ne[2], dst_t.ne[3]
    bs = src0.nb[0]
    J = pick_J(ncols)
    grid = (cdiv(ne01, MMQ_I), cdiv(ncols, J), ne2 * ne3)
    get_kernel(J, use_mma())[grid, (32, MMQ_NWARPS), stream](
        vx, vx_h, vy, vy_h, dst, ne00 // MMQ_ITER_K, ne01, src0.nb[1] // bs, ncols,
        ne01, ne2 // ne02, src0.nb[2] // bs, ne01 * ncols, ne3 // ne03, src0.nb[3] // bs,
        ne01 * ncols * ne2, mmq_kblocks(ne00), ne2)
