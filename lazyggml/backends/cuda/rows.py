"""GET_ROWS and SET_ROWS: gather rows of a table by index, scatter rows into a table (KV cache).

``get_rows(a, idx)``: ``dst[:, i10, i11, i12] = a[:, idx[i10, i11, i12], i11, i12]`` as F32, with
``a`` in F32, F16 or a quantized type (dequantized value by value, ``dequant.py``).
``set_rows(a, b, idx)``: ``a[:, idx[i1, i2 % ., i3 % .], i2, i3] = b[:, i1, i2, i3]``, converting F32
to ``a``'s type (F32 or F16); the index is broadcast over b's dims 2 and 3. Indices are I32 or
I64 (numba compiles a variant for each). One thread per value; rows are contiguous.
"""
from __future__ import annotations

import numba
from numba import cuda

from .common import coords, jit_kernel
from .dequant import dequantize


@jit_kernel()
def get_rows_f(a, idx, dst, n, ne0, ne10, ne11, s01, s02, s03, si0, si1, si2, sd1, sd2, sd3):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    while i < n:
        i0, i10, i11, i12 = coords(i, ne0, ne10, ne11)
        r = idx[i10 * si0 + i11 * si1 + i12 * si2]
        dst[i0 + i10 * sd1 + i11 * sd2 + i12 * sd3] = numba.float32(a[i0 + r * s01 + i11 * s02 + i12 * s03])
        i += cuda.gridDim.x * cuda.blockDim.x


@jit_kernel()
def get_rows_q(ty, qk, bs, u8, h, idx, dst, n, ne0, ne10, ne11, nb01, nb02, nb03, si0, si1, si2,
               sd1, sd2, sd3):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    while i < n:
        i0, i10, i11, i12 = coords(i, ne0, ne10, ne11)
        r = idx[i10 * si0 + i11 * si1 + i12 * si2]
        B = r * nb01 + i11 * nb02 + i12 * nb03 + (i0 // qk) * bs
        dst[i0 + i10 * sd1 + i11 * sd2 + i12 * sd3] = dequantize(ty, u8, h, B, i0 % qk)
        i += cuda.gridDim.x * cuda.blockDim.x


@jit_kernel()
def set_rows(b, idx, dst, n, ne0, ne1, ne2, s1, s2, s3, ni1, ni2, si0, si1, si2, sd1, sd2, sd3):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    while i < n:
        i0, i1, i2, i3 = coords(i, ne0, ne1, ne2)
        r = idx[i1 * si0 + (i2 % ni1) * si1 + (i3 % ni2) * si2]
        dst[i0 + r * sd1 + i2 * sd2 + i3 * sd3] = b[i0 + i1 * s1 + i2 * s2 + i3 * s3]
        i += cuda.gridDim.x * cuda.blockDim.x
