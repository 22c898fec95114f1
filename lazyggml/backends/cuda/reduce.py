"""SUM, SUM_ROWS, MEAN and ARGMAX on the GPU (the CPU's ``reduce.py`` states the ops).

``reduce_rows``: one block per row (``row_grid``), each thread summing the values ``tid, tid +
blockDim, ...`` of its row (any strides) in float32, then a block-wide sum; MEAN divides the row sum by ``ne0``.
SUM runs one block over every row and reduces once at the end. The sums are float32 in a different
order than the CPU's float64 ones, as GGML's CUDA sums are.

``argmax_rows``: one block per row; each thread keeps the largest value it saw and, among equal
maxima, the last index (GGML's CPU loop keeps the last of equal maxima); thread 0 then scans the
threads' candidates in order with the same rule. Used on logits, rarely: the scan is plain.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from .common import F32_ZERO, SIM, block_reduce_sum, jit_kernel, row_block_size, row_grid

R_SUM, R_SUM_ROWS, R_MEAN = 0, 1, 2
ARGMAX_THREADS = 32 if SIM else 256   # one warp under the simulator (threads are costly there)


@jit_kernel()
def reduce_rows(mode, x, dst, ne0, ne1, ne2, nrows, s0, s1, s2, s3, sd1, sd2, sd3):
    tid = cuda.threadIdx.x
    part = cuda.shared.array(32, numba.float32)
    acc = F32_ZERO
    r = cuda.blockIdx.x
    while r < nrows:
        i1 = r % ne1
        i2 = (r // ne1) % ne2
        i3 = r // (ne1 * ne2)
        xb = i1 * s1 + i2 * s2 + i3 * s3
        s = F32_ZERO
        k = tid
        while k < ne0:
            s += x[xb + k * s0]
            k += cuda.blockDim.x
        if mode == R_SUM:
            acc += s
        else:
            t = block_reduce_sum(s, part)
            if tid == 0:
                dst[i1 * sd1 + i2 * sd2 + i3 * sd3] = t if mode == R_SUM_ROWS else t / np.float32(ne0)
        r += cuda.gridDim.x
    if mode == R_SUM:
        t = block_reduce_sum(acc, part)
        if tid == 0:
            dst[0] = t


@jit_kernel()
def argmax_rows(x, dst, ne0, nrows, s0, s1):
    tid = cuda.threadIdx.x
    vals = cuda.shared.array(ARGMAX_THREADS, numba.float32)
    idxs = cuda.shared.array(ARGMAX_THREADS, numba.int32)
    r = cuda.blockIdx.x
    while r < nrows:
        vmax = -np.float32(np.inf)
        idx = 0
        k = tid
        while k < ne0:
            v = x[r * s1 + k * s0]
            vmax = vmax if vmax > v else v       # C's MAX(a, b), then the last index of the maximum
            if vmax == v:
                idx = k
            k += cuda.blockDim.x
        vals[tid] = vmax
        idxs[tid] = idx
        cuda.syncthreads()
        if tid == 0:
            best, bi = vals[0], idxs[0]
            for t in range(1, cuda.blockDim.x):
                if vals[t] > best or (vals[t] == best and idxs[t] > bi):
                    best, bi = vals[t], idxs[t]
            dst[r] = bi
        cuda.syncthreads()
        r += cuda.gridDim.x


def launch_reduce(stream, mode, x, dst, src, dst_t):
    ne = src.ne
    s = [nb // 4 for nb in src.nb]
    sd = [nb // 4 for nb in dst_t.nb]
    nrows = ne[1] * ne[2] * ne[3]
    grid = 1 if mode == R_SUM else row_grid(nrows)
    reduce_rows[grid, row_block_size(ne[0], nrows), stream](
        mode, x, dst, ne[0], ne[1], ne[2], nrows, *s, sd[1], sd[2], sd[3])


def launch_argmax(stream, x, dst, src):
    nrows = src.ne[1]
    argmax_rows[row_grid(nrows), ARGMAX_THREADS, stream](x, dst, src.ne[0], nrows, src.nb[0] // 4, src.nb[1] // 4)
