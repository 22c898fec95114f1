"""SUM, SUM_ROWS, MEAN, ARGMAX and ARGSORT on the GPU (the CPU's ``reduce.py`` states the ops).

``reduce_rows``: one block per row (``row_grid``), each thread summing the values ``tid, tid +
blockDim, ...`` of its row (any strides) in float32, then a block-wide sum; MEAN divides the row sum by ``ne0``.
SUM runs one block over every row and reduces once at the end. The sums are float32 in a different
order than the CPU's float64 ones, as GGML's CUDA sums are.

``argmax_rows``: one block per row; each thread keeps the largest value it saw and, among equal
maxima, the last index (GGML's CPU loop keeps the last of equal maxima); thread 0 then scans the
threads' candidates in order with the same rule. Used on logits, rarely: the scan is plain.

``argsort_rows`` (GGML's bitonic argsort): one block per row; the row's values and the indices
0..npad-1 (``npad``, the row's length rounded up to a power of two, at most ``ARGSORT_MAX``) go to
shared memory, and a bitonic network sorts the indices, a barrier after each of its
``log2(npad)·(log2(npad)+1)/2`` steps. The order compares (value, index): equal values keep the
lower index first, the CPU's stable order (a bitonic network is not stable by itself), and the
padding indices sort after every real one. A mixture of experts sorts rows of 8 to 256 router
scores.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from .common import F32_ZERO, SIM, block_reduce_sum, device, jit_kernel, row_block_size, row_grid

R_SUM, R_SUM_ROWS, R_MEAN = 0, 1, 2
ARGMAX_THREADS = 32 if SIM else 256   # one warp under the simulator (threads are costly there)
ARGSORT_MAX = 1024                    # values per row (their values and indices: 8 KB of shared memory)


@device
def _row_index(r, ne1, ne2):
    """Row ``r`` of a tensor with ``ne1`` rows per matrix and ``ne2`` matrices per batch: (i1, i2, i3)."""
    return r % ne1, (r // ne1) % ne2, r // (ne1 * ne2)


@jit_kernel()
def reduce_rows(mode, x, dst, ne0, ne1, ne2, nrows, s0, s1, s2, s3, sd1, sd2, sd3):
    tid = cuda.threadIdx.x
    part = cuda.shared.array(32, numba.float32)
    acc = F32_ZERO
    r = cuda.blockIdx.x
    while r < nrows:
        i1, i2, i3 = _row_index(r, ne1, ne2)
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


@device
def _sorts_after(vals, a, b, ncols, desc):
    """Does index ``a`` come after index ``b`` in the row's order? Padding (an index past ``ncols``)
    after every value; equal values by index."""
    if a >= ncols or b >= ncols:
        return a > b
    va, vb = vals[a], vals[b]
    if va == vb:
        return a > b
    return va < vb if desc else va > vb


@jit_kernel()
def argsort_rows(x, dst, desc, ncols, npad, nrows, ne1, ne2, s0, s1, s2, s3, sd1, sd2, sd3):
    tid = cuda.threadIdx.x
    vals = cuda.shared.array(ARGSORT_MAX, numba.float32)
    idx = cuda.shared.array(ARGSORT_MAX, numba.int32)
    r = cuda.blockIdx.x
    while r < nrows:
        i1, i2, i3 = _row_index(r, ne1, ne2)
        xb = i1 * s1 + i2 * s2 + i3 * s3
        for i in range(tid, npad, cuda.blockDim.x):
            idx[i] = i
            if i < ncols:
                vals[i] = x[xb + i * s0]
        cuda.syncthreads()
        # bitonic merges of runs of k: a pair (i, i^j) is put in ascending order where bit k of i
        # is 0, descending where it is 1, so that each merge gets a bitonic run
        k = 2
        while k <= npad:
            j = k // 2
            while j > 0:
                for i in range(tid, npad, cuda.blockDim.x):
                    p = i ^ j
                    if p > i:
                        a, b = idx[i], idx[p]
                        if _sorts_after(vals, a, b, ncols, desc) == ((i & k) == 0):
                            idx[i] = b
                            idx[p] = a
                cuda.syncthreads()
                j //= 2
            k *= 2
        db = i1 * sd1 + i2 * sd2 + i3 * sd3
        for i in range(tid, ncols, cuda.blockDim.x):
            dst[db + i] = idx[i]
        cuda.syncthreads()      # the next row reuses the shared arrays
        r += cuda.gridDim.x


def launch_argsort(stream, x, dst, desc, src, dst_t):
    """Each row of the F32 ``src`` (flat view ``x``) sorted into the same row of the I32 ``dst_t``
    (flat view ``dst``); rows of at most ``ARGSORT_MAX`` values."""
    ne = src.ne
    npad = 1 << (ne[0] - 1).bit_length()
    nrows = ne[1] * ne[2] * ne[3]
    threads = 32 if SIM else max(npad // 2, 32)    # two values per thread: one pair per step
    s = [nb // 4 for nb in src.nb]
    sd = [nb // 4 for nb in dst_t.nb]
    argsort_rows[row_grid(nrows), threads, stream](
        x, dst, desc, ne[0], npad, nrows, ne[1], ne[2], *s, sd[1], sd[2], sd[3])
