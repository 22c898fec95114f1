"""GET_ROWS and SET_ROWS: gather rows of a table by index, scatter rows into a table (KV cache).

``get_rows(a, idx)``: ``dst[:, i10, i11, i12] = a[:, idx[i10, i11, i12], i11, i12]`` as F32, with
``a`` in F32, F16, BF16 (``a_bf16``: read through a uint16 view) or a quantized type
(``dequant.rows_kernel``, which dequantizes).
``set_rows(a, b, idx)``: ``a[:, idx[i1, i2 % ., i3 % .], i2, i3] = b[:, i1, i2, i3]``, converting F32
to ``a``'s type (F32, F16 or BF16); the index is broadcast over b's dims 2 and 3. Indices are I32 or
I64 (numba compiles a variant for each). One thread per value, walking rows as ``elementwise.py``'s
kernels do (``grid_rows``): the index is read once per row; rows are contiguous.

An index outside ``[0, n_rows)`` of the tensor it indexes touches no memory: GET_ROWS writes a row
of zeros, SET_ROWS leaves the destination as it is. GGML leaves such an index undefined (its CPU
asserts, lazyggml's CPU raises); reporting it from here would cost a device-to-host round trip per
step, so the GPU only makes it harmless, with one test per row (``ops.get_rows``).
"""
from __future__ import annotations

import numba
from numba import cuda

from .common import F32_ZERO, bf16_to_float, float_to_bf16, jit_kernel, plane, wrap


@jit_kernel()
def get_rows_f(a, a_bf16, idx, dst, ne0, ne01, ne10, ne11, ne12, s00, s01, s02, s03, si0, si1, si2, sd1, sd2,
               sd3):
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < ne11 * ne12:
        i11, i12 = plane(i23, ne11)
        i10 = cuda.blockIdx.y
        while i10 < ne10:
            r = idx[i10 * si0 + i11 * si1 + i12 * si2]
            rd = i10 * sd1 + i11 * sd2 + i12 * sd3
            i0 = x0
            if r < 0 or r >= ne01:      # an index out of range: a row of zeros, nothing read
                while i0 < ne0:
                    dst[rd + i0] = F32_ZERO
                    i0 += dx
            else:
                ra = r * s01 + i11 * s02 + i12 * s03
                while i0 < ne0:
                    v = a[ra + i0 * s00]
                    dst[rd + i0] = bf16_to_float(v) if a_bf16 else numba.float32(v)
                    i0 += dx
            i10 += cuda.gridDim.y
        i23 += cuda.gridDim.z


@jit_kernel()
def set_rows(b, idx, dst, d_bf16, ne0, ne1, ne2, ne3, s1, s2, s3, ni1, ni2, si0, si1, si2, nd1, sd1, sd2, sd3):
    """``nd1``: the destination's number of rows, the range of the indices."""
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            r = idx[i1 * si0 + wrap(i2, ni1) * si1 + wrap(i3, ni2) * si2]
            if r >= 0 and r < nd1:      # an index out of range writes nothing
                rb = i1 * s1 + i2 * s2 + i3 * s3
                rd = r * sd1 + i2 * sd2 + i3 * sd3
                i0 = x0
                while i0 < ne0:
                    if d_bf16:
                        dst[rd + i0] = float_to_bf16(b[rb + i0])
                    else:
                        dst[rd + i0] = b[rb + i0]
                    i0 += dx
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z
