"""Element-wise kernels: binary ops with broadcasting, unary ops, GLUs, scale, copies.

Every kernel takes flat views of its tensors and their strides in elements, and walks the output
**as rows** (``grid_rows``): threads along dim 0 (``i0 = blockIdx.x·blockDim.x + threadIdx.x``,
striding by the grid's width), grid dim y over the rows ``i1``, grid dim z over the planes
``i2 + ne2·i3``; where a tensor has more rows or planes than CUDA allows (65,535), the blocks stride
over the rest; with many rows a thread takes ``ROW_RUN`` values of a row. A thread computes a row's
offsets once, and no division runs per element: with one flat index, the 4-D coordinates cost six 64-bit divisions per element (Python's floor semantics
included), which made SWIGLU over a 14336 × 512 prompt compute-bound (119 µs, 0.7 TB/s). The op is
an int argument (the branch is the same for all threads), so one compiled kernel serves a whole
family; numba compiles one variant per dtype combination (F32/F16 for the copies). The walk (three
``while`` loops) is written out in each kernel here and in ``rows.py``, ``rope.py``, ``dequant.py``
and ``fattn.py``: a numba-cuda kernel cannot take the per-element work as a function argument, and
the loops are the part whose cost matters.

* binary (ADD, SUB, MUL, DIV): ``dst = src0 op src1`` where src1 is tiled over src0 (GGML's
  ``ggml_can_repeat``): its index is ``i_k % ne1_k`` in each dim (per row; along dim 0 only when
  src1's row is shorter).
* unary (every ``UnaryOp``, and SQR, SQRT, LOG, SIN, COS, CLAMP as codes after them), ``scale``
  (``x·s + b``).
* GLU (REGLU, GEGLU, SWIGLU): ``act(a)·g`` with ``a``, ``g`` the two halves of a row of src0, or
  src0 and src1 when split, swapped by ``glu_params(node).swapped``.
* copy (DUP, CONT, CPY): element ``k`` of src in its own shape order goes to element ``k`` of dst in
  dst's, with conversion between F32, F16 and BF16 (``cpy`` may reshape: only then does dst's
  position come from a division of the flat index).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ...ops import GluOp, Op, UnaryOp
from .common import bf16_to_float, cdiv, coords, float_to_bf16, device, jit_kernel, plane, wrap, F32_ONE, F32_ZERO, SIM

BIN_ADD, BIN_SUB, BIN_MUL, BIN_DIV = 0, 1, 2, 3
BINARY_CODE = {Op.ADD: BIN_ADD, Op.ADD1: BIN_ADD, Op.SUB: BIN_SUB, Op.MUL: BIN_MUL, Op.DIV: BIN_DIV}
UNARY_OPS = tuple(UnaryOp)
GLU_OPS = (GluOp.REGLU, GluOp.GEGLU, GluOp.SWIGLU)

U_ABS, U_SGN, U_NEG, U_STEP, U_TANH, U_RELU, U_SIGMOID, U_GELU, U_GELU_QUICK, U_SILU, U_EXP = (
    int(u) for u in (UnaryOp.ABS, UnaryOp.SGN, UnaryOp.NEG, UnaryOp.STEP, UnaryOp.TANH, UnaryOp.RELU,
                     UnaryOp.SIGMOID, UnaryOp.GELU, UnaryOp.GELU_QUICK, UnaryOp.SILU, UnaryOp.EXP))
U_ELU, U_HARDSWISH, U_HARDSIGMOID, U_GELU_ERF = (int(u) for u in (UnaryOp.ELU, UnaryOp.HARDSWISH,
                                                                  UnaryOp.HARDSIGMOID, UnaryOp.GELU_ERF))
# the ops GGML keeps apart from UNARY, as codes of the same kernel (after UnaryOp's values)
U_SQR, U_SQRT, U_LOG, U_SIN, U_COS, U_CLAMP = 100, 101, 102, 103, 104, 105
UNARY_CODE = {Op.SQR: U_SQR, Op.SQRT: U_SQRT, Op.LOG: U_LOG, Op.SIN: U_SIN, Op.COS: U_COS, Op.CLAMP: U_CLAMP}
G_REGLU, G_GEGLU, G_SWIGLU = (int(g) for g in GLU_OPS)

SQRT_2_OVER_PI = np.float32(0.7978845608028654)
GELU_COEF_A = np.float32(0.044715)
GELU_QUICK_COEF = np.float32(-1.702)
F32_HALF = np.float32(0.5)
F32_THREE = np.float32(3)
F32_SIX = np.float32(6)
SQRT_2_INV = np.float32(0.7071067811865476)

# Launch shape of the grid-stride kernels. The simulator pays ~2 ms to start each thread and little
# per loop iteration, so there a few warps walk the whole tensor.
BLOCK = 32 if SIM else 256
MAX_GRID = 2 if SIM else 1 << 16
MAX_YZ = 1 if SIM else 65535      # CUDA's limit on grid dims y and z
# Values a thread takes along a row once a tensor has MANY_ROWS rows: its setup is then paid once
# per 8 (measured on an H200 over 4096 x 512 and 4096 x 14336: scale 12.4 -> 6.4 and 303 -> 162 µs,
# binary 21.0 -> 9.8 and 537 -> 229 µs). Fewer rows (decoding) keep one value per thread, so that
# a single row still spreads over several multiprocessors.
ROW_RUN = 8
MANY_ROWS = 64


def grid_for(n):
    """Blocks for a kernel that walks ``n`` values with one flat grid-stride index."""
    return max(1, min(cdiv(n, BLOCK), MAX_GRID))


def grid_rows(ne):
    """Blocks for a kernel that walks a tensor of shape ``ne`` as rows (module docstring)."""
    run = ROW_RUN if ne[1] * ne[2] * ne[3] >= MANY_ROWS else 1
    return (grid_for(cdiv(ne[0], run)), max(1, min(ne[1], MAX_YZ)), max(1, min(ne[2] * ne[3], MAX_YZ)))


@device
def _gelu(x):
    return F32_HALF * x * (F32_ONE + math.tanh(SQRT_2_OVER_PI * x * (F32_ONE + GELU_COEF_A * x * x)))


@device
def _silu(x):
    return x / (F32_ONE + math.exp(-x))


@device
def _hardsigmoid(x):
    return min(F32_ONE, max(F32_ZERO, (x + F32_THREE) / F32_SIX))


@device
def unary_f(op, x, p0, p1):
    """Unary op ``op`` of ``x``; ``p0``, ``p1``: CLAMP's min and max."""
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
    if op == U_ELU:
        return x if x > F32_ZERO else np.float32(math.expm1(x))
    if op == U_HARDSWISH:
        return x * _hardsigmoid(x)
    if op == U_HARDSIGMOID:
        return _hardsigmoid(x)
    if op == U_GELU_ERF:
        return F32_HALF * x * (F32_ONE + np.float32(math.erf(x * SQRT_2_INV)))
    if op == U_SQR:
        return x * x
    if op == U_SQRT:
        return np.float32(math.sqrt(x))
    if op == U_LOG:
        return np.float32(math.log(x))
    if op == U_SIN:
        return np.float32(math.sin(x))
    if op == U_COS:
        return np.float32(math.cos(x))
    if op == U_CLAMP:       # GGML's MAX(MIN(x, max), min): a NaN becomes max
        v = x if x < p1 else p1
        return v if v > p0 else p0
    return np.float32(math.exp(x))   # U_EXP


@jit_kernel()
def binary(op, a, b, dst, ne0, ne1, ne2, ne3, sa0, sa1, sa2, sa3, nb0, nb1, nb2, nb3, sb0, sb1, sb2, sb3,
           sd0, sd1, sd2, sd3):
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            ra = i1 * sa1 + i2 * sa2 + i3 * sa3
            rb = wrap(i1, nb1) * sb1 + wrap(i2, nb2) * sb2 + wrap(i3, nb3) * sb3
            rd = i1 * sd1 + i2 * sd2 + i3 * sd3
            i0 = x0
            while i0 < ne0:
                x = a[ra + i0 * sa0]
                y = b[rb + wrap(i0, nb0) * sb0]
                if op == BIN_ADD:
                    r = x + y
                elif op == BIN_SUB:
                    r = x - y
                elif op == BIN_MUL:
                    r = x * y
                else:
                    r = x / y
                dst[rd + i0 * sd0] = r
                i0 += dx
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z


@jit_kernel()
def unary(op, p0, p1, a, dst, ne0, ne1, ne2, ne3, sa0, sa1, sa2, sa3, sd0, sd1, sd2, sd3):
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            ra = i1 * sa1 + i2 * sa2 + i3 * sa3
            rd = i1 * sd1 + i2 * sd2 + i3 * sd3
            i0 = x0
            while i0 < ne0:
                dst[rd + i0 * sd0] = unary_f(op, a[ra + i0 * sa0], p0, p1)
                i0 += dx
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z


@jit_kernel()
def scale(a, dst, s, b, ne0, ne1, ne2, ne3, sa0, sa1, sa2, sa3, sd0, sd1, sd2, sd3):
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            ra = i1 * sa1 + i2 * sa2 + i3 * sa3
            rd = i1 * sd1 + i2 * sd2 + i3 * sd3
            i0 = x0
            while i0 < ne0:
                dst[rd + i0 * sd0] = a[ra + i0 * sa0] * s + b
                i0 += dx
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z


@jit_kernel()
def glu(op, a, g, dst, ne0, ne1, ne2, ne3, sa1, sa2, sa3, sg1, sg2, sg3, sd1, sd2, sd3):
    """``a``/``g`` are the flat views already offset to the value and gate halves (rows contiguous)."""
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            ra = i1 * sa1 + i2 * sa2 + i3 * sa3
            rg = i1 * sg1 + i2 * sg2 + i3 * sg3
            rd = i1 * sd1 + i2 * sd2 + i3 * sd3
            i0 = x0
            while i0 < ne0:
                x = a[ra + i0]
                gate = g[rg + i0]
                if op == G_SWIGLU:
                    r = _silu(x) * gate
                elif op == G_GEGLU:
                    r = _gelu(x) * gate
                else:
                    r = max(x, F32_ZERO) * gate
                dst[rd + i0] = r
                i0 += dx
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z


@jit_kernel()
def copy(a, a_bf16, dst, d_bf16, ne0, ne1, ne2, ne3, sa0, sa1, sa2, sa3, same, me0, me1, me2, sd0, sd1, sd2,
         sd3):
    """Element ``k`` of ``a`` (shape ne) to element ``k`` of ``dst`` (shape me; ``same``: me == ne),
    through a float32; ``a_bf16``/``d_bf16``: that side is BF16, read through a uint16 view."""
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            ra = i1 * sa1 + i2 * sa2 + i3 * sa3
            rd = i1 * sd1 + i2 * sd2 + i3 * sd3
            k0 = ne0 * (i1 + ne1 * i23)        # the row's first flat index
            i0 = x0
            while i0 < ne0:
                if same:
                    o = rd + i0 * sd0
                else:
                    j0, j1, j2, j3 = coords(k0 + i0, me0, me1, me2)
                    o = j0 * sd0 + j1 * sd1 + j2 * sd2 + j3 * sd3
                v = a[ra + i0 * sa0]
                x = bf16_to_float(v) if a_bf16 else np.float32(v)
                if d_bf16:
                    dst[o] = float_to_bf16(x)
                else:
                    dst[o] = x
                i0 += dx
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z
