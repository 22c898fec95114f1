"""RMS_NORM and NORM: one block per row (``row_grid``), a block-wide sum, then a pass that scales.

``rms_norm``: ``y = x · rsqrt(mean(x²) + eps)``. ``norm``: ``y = (x − mean) · rsqrt(var + eps)``
with the variance summed over ``(x − mean)²`` (two reductions, as GGML's CPU code does). A row is
read with stride 1 (``nb[0]`` = 4) and any row strides; 32 threads for rows under 1024 values,
else 256, or 1024 for a few rows (``row_block_size``). With a weight row ``w`` the kernel also
multiplies by it: the backend's fusion of ``mul(rms_norm(x), w)`` (``ops.fuse``); with a second
input ``y`` it first adds it (the residual ``add`` before the norm, its sum written too).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from .common import jit_kernel, F32_ZERO, block_reduce_sum, row_block_size, row_grid, rsqrtf


NV = 8   # values of its row a thread keeps in registers (the rest, of rows over 8 · threads, re-read)


@jit_kernel(launch_bounds=(1024, 1))   # row_block_size may ask for 1024 threads
def norm_rows(rms, x, dst, ne0, ne1, ne2, nrows, s1, s2, s3, sd1, sd2, sd3, eps, w, has_w, y, xy, has_y):
    tid = cuda.threadIdx.x
    bd = cuda.blockDim.x
    part = cuda.shared.array(32, numba.float32)
    vals = cuda.local.array(NV, numba.float32)
    n = np.float32(ne0)
    xs = xy if has_y else x
    for r in range(cuda.blockIdx.x, nrows, cuda.gridDim.x):
        i1 = r % ne1
        i2 = (r // ne1) % ne2
        i3 = r // (ne1 * ne2)
        xb = i1 * s1 + i2 * s2 + i3 * s3
        db = i1 * sd1 + i2 * sd2 + i3 * sd3

        # the thread's values k = tid + i·bd: all their loads issued at once, then kept (a loop
        # that loads, adds and loads again waits once per value: 10 µs for a 4096-value row)
        for i in range(NV):
            k = tid + i * bd
            v = F32_ZERO
            if k < ne0:
                v = x[xb + k]
                if has_y:       # the residual add before the norm: x + y, kept in xy, is normalised
                    v += y[xb + k]
                    xy[xb + k] = v
            vals[i] = v
        if has_y:
            for k in range(tid + NV * bd, ne0, bd):
                xy[xb + k] = x[xb + k] + y[xb + k]      # read back below by the same thread
        mean = F32_ZERO
        if not rms:
            s = F32_ZERO
            for i in range(NV):
                if tid + i * bd < ne0:
                    s += vals[i]
            for k in range(tid + NV * bd, ne0, bd):
                s += xs[xb + k]
            mean = block_reduce_sum(s, part) / n
        sq = F32_ZERO
        for i in range(NV):
            if tid + i * bd < ne0:
                v = vals[i] - mean
                sq += v * v
        for k in range(tid + NV * bd, ne0, bd):
            v = xs[xb + k] - mean
            sq += v * v
        scale = rsqrtf(block_reduce_sum(sq, part) / n + eps)
        for i in range(NV):
            k = tid + i * bd
            if k < ne0:
                v = vals[i] - mean
                dst[db + k] = (v * scale) * w[k] if has_w else v * scale
        for k in range(tid + NV * bd, ne0, bd):
            v = xs[xb + k] - mean
            dst[db + k] = (v * scale) * w[k] if has_w else v * scale


def launch_norm(stream, rms, x, dst, src, dst_t, eps, w=None, y=None, xy=None):
    """``w``: a weight row to multiply by in the same pass (the fused ``mul(rms_norm(x), w)``; the
    same float32 operations as the two nodes, so the same bits). ``y``, ``xy``: normalise
    ``x + y`` instead, written to ``xy`` (the fused residual ``add`` before the norm; ``y`` and
    ``xy`` laid out as ``x``)."""
    ne = src.ne
    s = [nb // 4 for nb in src.nb]
    sd = [nb // 4 for nb in dst_t.nb]
    nrows = ne[1] * ne[2] * ne[3]
    norm_rows[row_grid(nrows), row_block_size(ne[0], nrows), stream](
        rms, x, dst, ne[0], ne[1], ne[2], nrows, s[1], s[2], s[3], sd[1], sd[2], sd[3], np.float32(eps),
        x if w is None else w, w is not None, x if y is None else y, x if xy is None else xy, y is not None)
