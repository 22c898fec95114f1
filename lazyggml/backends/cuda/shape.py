"""CONCAT, PAD and REPEAT on the GPU (the CPU's ``shape.py`` states the ops): pure data movement,
so the elements move as raw bits through views of their size (``BITS``: uint16 for F16 and BF16,
int32 for F32 and I32), and one kernel serves every such type. Each walks ``dst`` as rows
(``elementwise.grid_rows``); zeros of PAD are zero bits, which are 0.0 in every float type.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from .common import jit_kernel, plane, wrap

BITS = {2: np.uint16, 4: np.int32}   # element size -> the view the kernels move


@jit_kernel()
def repeat(a, dst, ne0, ne1, ne2, ne3, ae0, ae1, ae2, ae3, sa0, sa1, sa2, sa3, sd0, sd1, sd2, sd3):
    """``dst[i3, i2, i1, i0] = a[i3 % ae3, i2 % ae2, i1 % ae1, i0 % ae0]``."""
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            ra = wrap(i1, ae1) * sa1 + wrap(i2, ae2) * sa2 + wrap(i3, ae3) * sa3
            rd = i1 * sd1 + i2 * sd2 + i3 * sd3
            i0 = x0
            while i0 < ne0:
                dst[rd + i0 * sd0] = a[ra + wrap(i0, ae0) * sa0]
                i0 += dx
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z


@jit_kernel()
def pad(a, dst, ne0, ne1, ne2, ne3, ae0, ae1, ae2, ae3, sa0, sa1, sa2, sa3, sd0, sd1, sd2, sd3,
        lp0, lp1, lp2, lp3):
    """``a`` placed at offsets ``lp0..lp3`` in ``dst``, zeros around it."""
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        j2, j3 = i2 - lp2, i3 - lp3
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            j1 = i1 - lp1
            inside = 0 <= j1 < ae1 and 0 <= j2 < ae2 and 0 <= j3 < ae3
            ra = j1 * sa1 + j2 * sa2 + j3 * sa3
            rd = i1 * sd1 + i2 * sd2 + i3 * sd3
            i0 = x0
            while i0 < ne0:
                j0 = i0 - lp0
                if inside and 0 <= j0 < ae0:
                    dst[rd + i0 * sd0] = a[ra + j0 * sa0]
                else:
                    dst[rd + i0 * sd0] = 0
                i0 += dx
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z


@jit_kernel()
def concat(a, b, dst, dim, na, ne0, ne1, ne2, ne3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3, sd0, sd1, sd2, sd3):
    """``dst`` = ``a`` then ``b`` along ``dim``, where ``a`` has ``na`` elements."""
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            rd = i1 * sd1 + i2 * sd2 + i3 * sd3
            i0 = x0
            while i0 < ne0:
                c = i0 if dim == 0 else (i1 if dim == 1 else (i2 if dim == 2 else i3))
                if c < na:
                    v = a[i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3]
                else:   # b's coordinate along dim starts at 0
                    k0 = i0 - na if dim == 0 else i0
                    k1 = i1 - na if dim == 1 else i1
                    k2 = i2 - na if dim == 2 else i2
                    k3 = i3 - na if dim == 3 else i3
                    v = b[k0 * sb0 + k1 * sb1 + k2 * sb2 + k3 * sb3]
                dst[rd + i0 * sd0] = v
                i0 += dx
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z
