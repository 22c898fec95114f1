"""One thread per output element: binary ops with broadcasting, unary ops, GLUs, scale, copies.

Every kernel takes flat views of its tensors and their strides in elements, and walks the output
with a grid-stride loop over the flat index ``i`` = ``i0 + ne0·(i1 + ne1·(i2 + ne2·i3))``. The
op is an int argument (the branch is the same for all threads), so one compiled kernel serves a
whole family; numba compiles one variant per dtype combination (F32/F16 for the copies).

* binary (ADD, SUB, MUL, DIV): ``dst = src0 op src1`` where src1 is tiled over src0 (GGML's
  ``ggml_can_repeat``): its index is ``i_k % ne1_k`` in each dim.
* unary (ABS, NEG, RELU, SIGMOID, TANH, GELU, SILU, EXP ...), ``scale`` (``x·s + b``).
* GLU (REGLU, GEGLU, SWIGLU): ``act(a)·g`` with ``a``, ``g`` the two halves of a row of src0, or
  src0 and src1 when split, swapped by ``glu_params(node).swapped``.
* copy (DUP, CONT, CPY): element ``k`` of src in its own shape order goes to element ``k`` of dst in
  dst's, with conversion between F32 and F16 (``cpy`` may reshape).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ...ops import GluOp, Op, UnaryOp
from .common import coords, device, jit_kernel, F32_ONE, F32_ZERO, SIM, cdiv

BIN_ADD, BIN_SUB, BIN_MUL, BIN_DIV = 0, 1, 2, 3
BINARY_CODE = {Op.ADD: BIN_ADD, Op.SUB: BIN_SUB, Op.MUL: BIN_MUL, Op.DIV: BIN_DIV}
UNARY_OPS = (UnaryOp.ABS, UnaryOp.SGN, UnaryOp.NEG, UnaryOp.STEP, UnaryOp.TANH, UnaryOp.RELU,
             UnaryOp.SIGMOID, UnaryOp.GELU, UnaryOp.GELU_QUICK, UnaryOp.SILU, UnaryOp.EXP)
GLU_OPS = (GluOp.REGLU, GluOp.GEGLU, GluOp.SWIGLU)

U_ABS, U_SGN, U_NEG, U_STEP, U_TANH, U_RELU, U_SIGMOID, U_GELU, U_GELU_QUICK, U_SILU, U_EXP = (
    int(u) for u in UNARY_OPS)
G_REGLU, G_GEGLU, G_SWIGLU = (int(g) for g in GLU_OPS)

SQRT_2_OVER_PI = np.float32(0.7978845608028654)
GELU_COEF_A = np.float32(0.044715)
GELU_QUICK_COEF = np.float32(-1.702)
F32_HALF = np.float32(0.5)

# Launch shape of the grid-stride kernels. The simulator pays ~2 ms to start each thread and little
# per loop iteration, so there a few warps walk the whole tensor.
BLOCK = 32 if SIM else 256
MAX_GRID = 2 if SIM else 1 << 16


def grid_for(n):
    return max(1, min(cdiv(n, BLOCK), MAX_GRID))


@device
def _gelu(x):
    return F32_HALF * x * (F32_ONE + math.tanh(SQRT_2_OVER_PI * x * (F32_ONE + GELU_COEF_A * x * x)))


@device
def _silu(x):
    return x / (F32_ONE + math.exp(-x))


@device
def unary_f(op, x):
    if op == U_SILU:
        return _silu(x)
    if op == U_GELU:
        return _gelu(x)
    if op == U_RELU:
        return max(x, F32_ZERO)
    if op == U_NEG:
        return -x
    if op == U_ABS:
        return abs(x)
    if op == U_SGN:
        return F32_ONE if x > F32_ZERO else (-F32_ONE if x < F32_ZERO else F32_ZERO)
    if op == U_STEP:
        return F32_ONE if x > F32_ZERO else F32_ZERO
    if op == U_TANH:
        return np.float32(math.tanh(x))
    if op == U_SIGMOID:
        return F32_ONE / (F32_ONE + math.exp(-x))
    if op == U_GELU_QUICK:
        return x / (F32_ONE + math.exp(GELU_QUICK_COEF * x))
    return np.float32(math.exp(x))   # U_EXP


@jit_kernel()
def binary(op, a, b, dst, n, ne0, ne1, ne2, sa0, sa1, sa2, sa3, nb0, nb1, nb2, nb3, sb0, sb1, sb2, sb3,
           sd0, sd1, sd2, sd3):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    while i < n:
        i0, i1, i2, i3 = coords(i, ne0, ne1, ne2)
        x = a[i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3]
        y = b[(i0 % nb0) * sb0 + (i1 % nb1) * sb1 + (i2 % nb2) * sb2 + (i3 % nb3) * sb3]
        if op == BIN_ADD:
            r = x + y
        elif op == BIN_SUB:
            r = x - y
        elif op == BIN_MUL:
            r = x * y
        else:
            r = x / y
        dst[i0 * sd0 + i1 * sd1 + i2 * sd2 + i3 * sd3] = r
        i += cuda.gridDim.x * cuda.blockDim.x


@jit_kernel()
def unary(op, a, dst, n, ne0, ne1, ne2, sa0, sa1, sa2, sa3, sd0, sd1, sd2, sd3):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    while i < n:
        i0, i1, i2, i3 = coords(i, ne0, ne1, ne2)
        dst[i0 * sd0 + i1 * sd1 + i2 * sd2 + i3 * sd3] = unary_f(op, a[i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3])
        i += cuda.gridDim.x * cuda.blockDim.x


@jit_kernel()
def scale(a, dst, s, b, n, ne0, ne1, ne2, sa0, sa1, sa2, sa3, sd0, sd1, sd2, sd3):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    while i < n:
        i0, i1, i2, i3 = coords(i, ne0, ne1, ne2)
        dst[i0 * sd0 + i1 * sd1 + i2 * sd2 + i3 * sd3] = a[i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3] * s + b
        i += cuda.gridDim.x * cuda.blockDim.x


@jit_kernel()
def glu(op, a, g, dst, n, ne0, ne1, ne2, sa1, sa2, sa3, sg1, sg2, sg3, sd1, sd2, sd3):
    """``a``/``g`` are the flat views already offset to the value and gate halves (rows contiguous)."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    while i < n:
        i0, i1, i2, i3 = coords(i, ne0, ne1, ne2)
        x = a[i0 + i1 * sa1 + i2 * sa2 + i3 * sa3]
        gate = g[i0 + i1 * sg1 + i2 * sg2 + i3 * sg3]
        if op == G_SWIGLU:
            r = _silu(x) * gate
        elif op == G_GEGLU:
            r = _gelu(x) * gate
        else:
            r = max(x, F32_ZERO) * gate
        dst[i0 + i1 * sd1 + i2 * sd2 + i3 * sd3] = r
        i += cuda.gridDim.x * cuda.blockDim.x


@jit_kernel()
def copy(a, dst, n, ne0, ne1, ne2, sa0, sa1, sa2, sa3, me0, me1, me2, sd0, sd1, sd2, sd3):
    """Element ``i`` of ``a`` (shape ne) to element ``i`` of ``dst`` (shape me)."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    while i < n:
        i0, i1, i2, i3 = coords(i, ne0, ne1, ne2)
        j0, j1, j2, j3 = coords(i, me0, me1, me2)
        dst[j0 * sd0 + j1 * sd1 + j2 * sd2 + j3 * sd3] = a[i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3]
        i += cuda.gridDim.x * cuda.blockDim.x
