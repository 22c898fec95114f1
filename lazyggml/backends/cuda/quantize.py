"""Activation quantizers: F32 src1 -> q8_1 blocks, before the integer matrix products (docs/quant-formats.md §4.5).

Both work on a src1 of any strides (it may be a permuted view) and write a packed scratch buffer;
the kernels take it as an ``int32`` view (quants, four per int) and a ``float16`` view (the
``half2`` headers) of the same bytes.

``quantize_q8_1`` (for mmvq): one thread per value, 256 threads per block, grid
``(ne0_padded/256, ne1, ne2·ne3)``. A row is padded with zeros to ``ne0_padded``, a multiple of
``MATRIX_ROW_PADDING`` = 512, so that the dot-product kernels may run over whole blocks. The 32
lanes of a warp are exactly one q8_1 block: ``amax`` and ``sum`` are warp reductions, then
``d = amax/127`` and ``q = roundf(x/d)`` (a true division, halves away from zero), and lane 0
writes the header ``half2(d, Σx)``. Row ``i1`` of channel ``i2``, sample ``i3`` starts at block
``((i3·ne2 + i2)·ne1 + i1)·ne0_padded/32``.

``quantize_mmq_q8_1`` (for mmq, header layout DS4): 128 threads per block, four values per thread,
grid ``(ne1, ceil(ne0/512), ne2·ne3)``. A ``block_q8_1_mmq`` holds 128 values of one column and four
``half2(d_k, s_k)``, one per 32 values; the blocks of all columns of one 128-value slice of K lie
next to each other (block ``kb·ne1 + i1``, per channel), so mmq copies a tile of J columns with one
flat load. Here ``d_inv = 127/amax``, ``q = roundf(x·d_inv)``, ``d = 1/d_inv``: GGML's exact
order, with the ``amax = 0`` case pinned to ``q = 0, d = 0`` (GGML leaves it to a NaN cast).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from .common import (jit_kernel, F32_ZERO, MATRIX_ROW_PADDING, Q8_1_INTS, Q8_1_MMQ_INTS, QK8_1, QK8_1_MMQ, cdiv,
                     round_up, roundf, warp_reduce_max, warp_reduce_sum)

CUDA_QUANTIZE_BLOCK_SIZE = 256
CUDA_QUANTIZE_BLOCK_SIZE_MMQ = 128
F127 = np.float32(127.0)


@jit_kernel()
def quantize_q8_1(x, vy, vy_h, ne00, ne0_pad, ne1, ne2, s01, s02, s03):
    i0 = cuda.blockDim.x * cuda.blockIdx.x + cuda.threadIdx.x
    i1 = cuda.blockIdx.y
    i23 = cuda.blockIdx.z
    i2 = i23 % ne2
    i3 = i23 // ne2

    xi = F32_ZERO
    if i0 < ne00:
        xi = x[i3 * s03 + i2 * s02 + i1 * s01 + i0]
    amax = warp_reduce_max(abs(xi), 32)
    sum_ = warp_reduce_sum(xi, 32)

    d = amax / F127
    q = 0 if amax == F32_ZERO else np.int32(roundf(xi / d))

    ib = (i23 * ne1 + i1) * (ne0_pad // QK8_1) + i0 // QK8_1   # this value's q8_1 block
    iqs = i0 % QK8_1                                               # and its place in it
    # the quants of block ib start at byte 4 of its 36: write the byte through a 1-byte view
    vy[ib * (4 * Q8_1_INTS) + 4 + iqs] = q
    if iqs == 0:
        vy_h[ib * (2 * Q8_1_INTS)] = np.float16(d)
        vy_h[ib * (2 * Q8_1_INTS) + 1] = np.float16(sum_)


@jit_kernel()
def quantize_mmq_q8_1(x, vy, vy_h, ne00, ne1, ne2, s01, s02, s03, kblocks):
    i1 = cuda.blockIdx.x
    i23 = cuda.blockIdx.z
    i2 = i23 % ne2
    i3 = i23 // ne2
    i0 = 4 * (cuda.blockDim.x * cuda.blockIdx.y + cuda.threadIdx.x)   # first of this thread's 4

    base = i3 * s03 + i2 * s02 + i1 * s01
    x0 = x[base + i0] if i0 < ne00 else F32_ZERO
    x1 = x[base + i0 + 1] if i0 + 1 < ne00 else F32_ZERO
    x2 = x[base + i0 + 2] if i0 + 2 < ne00 else F32_ZERO
    x3 = x[base + i0 + 3] if i0 + 3 < ne00 else F32_ZERO

    # 8 threads hold one group of 32 values: reduce over lanes xor 4, 2, 1
    amax = warp_reduce_max(max(max(abs(x0), abs(x1)), max(abs(x2), abs(x3))), 8)
    sum_ = warp_reduce_sum(x0 + x1 + x2 + x3, 8)

    if amax == F32_ZERO:
        d = F32_ZERO
        q0 = q1 = q2 = q3 = 0
    else:
        d_inv = F127 / amax
        d = np.float32(1.0) / d_inv
        q0 = np.int32(roundf(x0 * d_inv))
        q1 = np.int32(roundf(x1 * d_inv))
        q2 = np.int32(roundf(x2 * d_inv))
        q3 = np.int32(roundf(x3 * d_inv))

    kb = i0 // QK8_1_MMQ                  # 128-value slice of K
    iqs = i0 % QK8_1_MMQ                  # place in the block
    ib = (i23 * kblocks + kb) * ne1 + i1  # blocks of one slice are consecutive over columns
    vy[ib * Q8_1_MMQ_INTS + 4 + iqs // 4] = np.int32(
        (q0 & 0xFF) | ((q1 & 0xFF) << 8) | ((q2 & 0xFF) << 16) | ((q3 & 0xFF) << 24))
    if iqs % QK8_1 == 0:
        vy_h[ib * (2 * Q8_1_MMQ_INTS) + 2 * (iqs // QK8_1)] = np.float16(d)
        vy_h[ib * (2 * Q8_1_MMQ_INTS) + 2 * (iqs // QK8_1) + 1] = np.float16(sum_)


def q8_1_bytes(ne00, nrows):
    """Scratch bytes for ``quantize_q8_1`` of ``nrows`` rows of ``ne00`` values."""
    return nrows * round_up(ne00, MATRIX_ROW_PADDING) // QK8_1 * 4 * Q8_1_INTS


def mmq_q8_1_bytes(ne00, ne1, nchannels):
    return nchannels * mmq_kblocks(ne00) * ne1 * 4 * Q8_1_MMQ_INTS


def mmq_kblocks(ne00):
    """128-value slices per column, rounded up to whole 512-value quantizer blocks."""
    return cdiv(ne00, 4 * CUDA_QUANTIZE_BLOCK_SIZE_MMQ) * 4


def launch_quantize_q8_1(stream, x, scratch_i8, scratch_h, ne, s):
    """x: flat F32 view of src1; ne: its ne; s: its element strides (s01, s02, s03); the scratch as
    ``int8`` and ``float16`` views."""
    ne0_pad = round_up(ne[0], MATRIX_ROW_PADDING)
    grid = (ne0_pad // CUDA_QUANTIZE_BLOCK_SIZE, ne[1], ne[2] * ne[3])
    quantize_q8_1[grid, CUDA_QUANTIZE_BLOCK_SIZE, stream](
        x, scratch_i8, scratch_h, ne[0], ne0_pad, ne[1], ne[2], s[0], s[1], s[2])


def launch_quantize_mmq_q8_1(stream, x, scratch_i32, scratch_h, ne, s):
    kblocks = mmq_kblocks(ne[0])
    grid = (ne[1], kblocks // 4, ne[2] * ne[3])
    quantize_mmq_q8_1[grid, CUDA_QUANTIZE_BLOCK_SIZE_MMQ, stream](
        x, scratch_i32, scratch_h, ne[0], ne[1], ne[2], s[0], s[1], s[2], kblocks)
