"""SOFT_MAX with GGML's extensions: ``softmax(x·scale + slope·mask)`` per row, one block per row
(``row_grid``).

The mask (F32 or F16, rows contiguous) is indexed by the row ``i1`` and broadcast over dims 2 and 3
(``i2 % mask.ne[2]``). ``slope`` is 1, or ALiBi's per-head slope when ``max_bias > 0``: for head
``h = i2``, ``m0^(h+1)`` below ``n_head_log2`` (the largest power of two <= n_head) and
``m1^(2·(h − n_head_log2) + 1)`` above, with ``m0 = 2^(−max_bias/n_head_log2)``,
``m1 = 2^(−max_bias/2/n_head_log2)``, computed on the host in float32 as GGML does
(``ops.soft_max_alibi``, shared by every backend). Three passes over the row: the max, the
exponentials (kept in dst) and their sum, the division.

DIAG_MASK_INF (``diag_mask_inf``): ``y[.., i1, i0] = -inf`` where ``i0 > n_past + i1``, else ``x``;
walked as rows (``elementwise.grid_rows``).
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import cuda

from .common import (jit_kernel, plane, F32_ONE, F32_ZERO, alibi_slope, block_reduce_max, block_reduce_sum,
                     row_block_size, row_grid)


@jit_kernel(launch_bounds=(1024, 1))   # row_block_size may ask for 1024 threads
def soft_max(x, mask, has_mask, dst, ne0, ne1, ne2, nrows, mne1, mne2, mne3, ms1, ms2, ms3, scale,
             max_bias, m0, m1, n_head_log2, empty_zero):
    tid = cuda.threadIdx.x
    part = cuda.shared.array(32, numba.float32)
    for r in range(cuda.blockIdx.x, nrows, cuda.gridDim.x):
        i1 = r % ne1
        i2 = (r // ne1) % ne2
        i3 = r // (ne1 * ne2)
        xb = r * ne0                                   # src0 and dst are contiguous
        mb = (i3 % mne3) * ms3 + (i2 % mne2) * ms2 + i1 * ms1

        slope = alibi_slope(i2, max_bias, m0, m1, n_head_log2)

        mx = np.float32(-np.inf)
        for k in range(tid, ne0, cuda.blockDim.x):
            v = x[xb + k] * scale
            if has_mask:
                v += slope * np.float32(mask[mb + k])
            mx = max(mx, v)
        mx = block_reduce_max(mx, part)
        if empty_zero and mx == -np.inf:     # every cell masked: zeros (flash attention's rule)
            for k in range(tid, ne0, cuda.blockDim.x):
                dst[xb + k] = F32_ZERO
            continue

        s = F32_ZERO
        for k in range(tid, ne0, cuda.blockDim.x):
            v = x[xb + k] * scale
            if has_mask:
                v += slope * np.float32(mask[mb + k])
            e = np.float32(math.exp(v - mx))
            dst[xb + k] = e
            s += e
        inv = F32_ONE / block_reduce_sum(s, part)
        for k in range(tid, ne0, cuda.blockDim.x):
            dst[xb + k] *= inv


def launch_soft_max(stream, x, mask_view, dst, src, mask, scale, max_bias, alibi, empty_zero=False):
    """``alibi``: ``ops.soft_max_alibi(n_head, max_bias)``. ``src`` and ``mask`` need only ``ne`` and
    ``nb``. ``empty_zero``: a row whose every element is -inf gives zeros (SOFT_MAX gives NaN there,
    as GGML's)."""
    ne = src.ne
    if mask is None:
        mne, ms, has_mask = (1, 1, 1), (0, 0, 0), False
    else:
        e = mask.nb[0]
        mne, ms, has_mask = mask.ne[1:], (mask.nb[1] // e, mask.nb[2] // e, mask.nb[3] // e), True
    nrows = ne[1] * ne[2] * ne[3]
    soft_max[row_grid(nrows), row_block_size(ne[0], nrows), stream](
        x, mask_view, has_mask, dst, ne[0], ne[1], ne[2], nrows, mne[0], mne[1], mne[2], ms[0], ms[1], ms[2],
        np.float32(scale), np.float32(max_bias), alibi.m0, alibi.m1, alibi.n_head_log2, empty_zero)


F32_NEG_INF = np.float32(-np.inf)


@jit_kernel()
def diag_mask_inf(x, dst, n_past, ne0, ne1, ne2, ne3, s1, s2, s3, sd1, sd2, sd3):
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            ra = i1 * s1 + i2 * s2 + i3 * s3
            rd = i1 * sd1 + i2 * sd2 + i3 * sd3
            i0 = x0
            while i0 < ne0:
                dst[rd + i0] = F32_NEG_INF if i0 > n_past + i1 else x[ra + i0]
                i0 += dx
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z
