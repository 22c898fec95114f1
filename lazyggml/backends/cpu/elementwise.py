"""Element-wise ops on the CPU: ADD, SUB, MUL, DIV, ADD1 (binary, GGML's repeat broadcasting),
SQR, SQRT, LOG, SIN, COS, SCALE, CLAMP and every UNARY sub-op (one kernel), and GLU.

Each family is one loop over rows (i3, i2, i1), split over threads by ``common.parallel_kernel``,
that calls a row function with an integer op code. The code is tested once per row and each
branch is a plain loop, so LLVM vectorizes the cheap ones (a per-element switch would not). The scalar formulas are GGML's (``vec.h``,
``unary-ops.cpp``), in float32 with GGML's evaluation order.

Exponentials: SILU, SWIGLU (and SOFT_MAX, softmax.py) use ``v_expf``, GGML's own vectorizable
``expf`` (``ggml_v_expf``: Cody-Waite reduction by ln 2 and a degree-5 polynomial, with FMAs),
which GGML's SIMD paths use for these ops. LLVM vectorizes it, so a SILU row costs about 0.5 ns
per element on one core instead of ~4 ns of libm ``expf``. It is bit for bit GGML's AVX2
``ggml_v_expf`` and ``ggml_v_silu`` (checked on 2M inputs, specials included, against them
compiled with ``-mavx2 -mfma``); GGML's AVX-512 build uses a ``vscalefps`` variant that can differ
by an ulp. GGML computes a row's last ``n % 8`` elements with libm's ``expf`` (``ggml_silu_f32``), and
so do these (``silu_libm``). SIGMOID, EXP and ELU use libm's ``expf`` / ``expm1f``, as GGML does for them.

GELU, GELU_QUICK and GEGLU as GGML's CPU backend computes them by default (``GGML_GELU_FP16``,
``GGML_GELU_QUICK_FP16``): looked up in a table of the 65,536 fp16 values, indexed by the input
rounded to fp16, the formula's result rounded to fp16 (``GELU_TABLES``); GELU and GEGLU give 0 at
or below -10 and x at or above 10 instead. That is up to ~1e-3 off the formula, and it is what
llama.cpp's Gemma computes on the CPU. The formulas, ``0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715
x^2)))`` and ``x / (1 + exp(-1.702 x))``, build the tables once at import, in float32 with GGML's
evaluation order. (GGML's GPU backends compute the formula; so do lazyggml's.)

Broadcasting (GGML's ``ggml_can_repeat(b, a)``): ``b``'s row ``(i3 % ne13, i2 % ne12, i1 % ne11)``
serves ``a``'s row ``(i3, i2, i1)``; along dim 0 ``b`` is tiled first (rare: scalars, ADD1).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ... import types
from ...cache import tie_cache
from ...ops import GluOp, Op, UnaryOp, clamp_params, glu_params, scale_params, unary_op
from ...types import Type
from . import common, pool, simd, type_common
from .table import forward
from .common import chunk, parallel_kernel, unravel_row
from .type_common import fp32_to_fp16
from .simd import fma as fmaf  # a*b + c, fused where the target has FMA (as GCC contracts GGML's C)

_kernel = njit(cache=True, error_model="numpy")
_pkernel = parallel_kernel

# GGML's constants (vec.h), as float32 so that numba keeps the arithmetic in float32
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_HALF = np.float32(0.5)
_THREE = np.float32(3.0)
_SIX = np.float32(6.0)
GELU_COEF_A = np.float32(0.044715)
GELU_QUICK_COEF = np.float32(-1.702)
SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)
SQRT_2_INV = np.float32(0.70710678118654752440084436210484)


# -- GGML's vectorizable expf ------------------------------------------------------------------------
def _hex32(s):
    return np.float32(float.fromhex(s))


# exp(x) = 2^n * exp(b), n = round(x / ln2), b = x - n*ln2 (ln2 split in two: Cody-Waite), exp(b) by
# a degree-5 polynomial; n is rounded by adding 1.5 * 2^23 (its low mantissa bits then hold n)
_ROUND = _hex32("0x1.8p23")
_LOG2E = _hex32("0x1.715476p+0")
_LN2_HI, _LN2_LO = _hex32("0x1.62e4p-1"), _hex32("0x1.7f7d1cp-20")
_C1, _C2, _C3 = _hex32("0x1.ffffecp-1"), _hex32("0x1.fffdb6p-2"), _hex32("0x1.555e66p-3")
_C4, _C5 = _hex32("0x1.573e2ep-5"), _hex32("0x1.0e4020p-7")
_U32 = np.uint32


@_kernel
def v_expf(x):
    """GGML's ``ggml_v_expf`` for one lane, branch-free so that loops calling it vectorize.
    Overflows to inf above ~88.38, flushes to 0 below ~-103.97; NaN stays NaN."""
    z = fmaf(x, _LOG2E, _ROUND)
    n = z - _ROUND
    b = fmaf(-n, _LN2_LO, fmaf(-n, _LN2_HI, x))
    e = _U32(np.float32(z).view(_U32) << _U32(23))
    k = _U32(e + _U32(0x3F800000)).view(np.float32)             # 2^n, when n is in range
    u = b * b
    j = fmaf(fmaf(fmaf(_C5, b, _C4), u, fmaf(_C3, b, _C2)), u, _C1 * b)   # exp(b) - 1
    # |n| > 126: 2^n does not fit one float; scale in two steps s1 * s2 (s1 * s1 when |n| > 192).
    # All three results are computed and one selected (no branches, so loops vectorize); s1 and
    # s2 are 1 in lanes that do not need them, or their products would underflow into denormals,
    # which cost a microcode assist each on x86 (GGML's vector code skips that path instead).
    an = abs(n)
    far = an > 126
    g = _U32(0x82000000) if n <= 0 else _U32(0)
    s1 = _U32(g + _U32(0x7F000000)).view(np.float32) if far else _ONE
    s2 = _U32(e - g).view(np.float32) if far else _ONE
    small, big, huge = fmaf(j, k, k), fmaf(s2, j, s2) * s1, s1 * s1
    return huge if an > 192 else (big if far else small)


# -- op codes ---------------------------------------------------------------------------------------
# the unary family: UnaryOp's values, then the ops that GGML has as separate OPs
_ABS, _SGN, _NEG, _STEP = int(UnaryOp.ABS), int(UnaryOp.SGN), int(UnaryOp.NEG), int(UnaryOp.STEP)
_TANH, _ELU, _RELU, _SIGMOID = int(UnaryOp.TANH), int(UnaryOp.ELU), int(UnaryOp.RELU), int(UnaryOp.SIGMOID)
_GELU, _GELU_QUICK, _SILU = int(UnaryOp.GELU), int(UnaryOp.GELU_QUICK), int(UnaryOp.SILU)
_HARDSWISH, _HARDSIGMOID = int(UnaryOp.HARDSWISH), int(UnaryOp.HARDSIGMOID)
_EXP, _GELU_ERF = int(UnaryOp.EXP), int(UnaryOp.GELU_ERF)
_SQR, _SQRT, _LOG, _SIN, _COS, _SCALE, _CLAMP = 100, 101, 102, 103, 104, 105, 106

_OP_CODE = {Op.SQR: _SQR, Op.SQRT: _SQRT, Op.LOG: _LOG, Op.SIN: _SIN, Op.COS: _COS,
            Op.SCALE: _SCALE, Op.CLAMP: _CLAMP}

# the binary family
_ADD, _SUB, _MUL, _DIV = 0, 1, 2, 3
_BINARY_CODE = {Op.ADD: _ADD, Op.ADD1: _ADD, Op.SUB: _SUB, Op.MUL: _MUL, Op.DIV: _DIV}

_REGLU, _GEGLU, _SWIGLU = int(GluOp.REGLU), int(GluOp.GEGLU), int(GluOp.SWIGLU)


# -- scalar formulas shared by UNARY and GLU ------------------------------------------------------
def _gelu_tables():
    """[GELU, GELU_QUICK] of every fp16 value (by its bits), rounded to fp16, as float32: GGML's
    ``ggml_table_gelu_f16`` and ``ggml_table_gelu_quick_f16``."""
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(all="ignore"):   # the NaN and infinite entries are never looked up for finite x
        # as GGML's C compiles: 1 + A x x contracted into one FMA (exact product in float64, one
        # rounding); tanhf and expf correctly rounded (float64, then float32) as glibc's, where
        # NumPy's float32 tanh and exp are an ulp off. Every finite fp16 input gives libggml's bits.
        inner = (GELU_COEF_A * x).astype(np.float64) * x + 1.0
        u = SQRT_2_OVER_PI * x * inner.astype(np.float32)
        g = _HALF * x * (_ONE + np.tanh(u.astype(np.float64)).astype(np.float32))
        e = np.exp((GELU_QUICK_COEF * x).astype(np.float64)).astype(np.float32)
        q = x * (_ONE / (_ONE + e))
    return np.stack([g, q]).astype(np.float16).astype(np.float32)


GELU_TABLES = _gelu_tables()
_GELU_LIMIT = np.float32(10.0)


@_kernel
def gelu(x, tab):
    """GELU by GGML's table (``tab``: ``GELU_TABLES``): 0 at or below -10, x at or above 10."""
    if x <= -_GELU_LIMIT:
        return _ZERO
    if x >= _GELU_LIMIT:
        return x
    return tab[0, fp32_to_fp16(x)]


@_kernel
def gelu_erf(x):
    return _HALF * x * (_ONE + math.erf(x * SQRT_2_INV))


@_kernel
def gelu_quick(x, tab):
    """GELU_QUICK by GGML's table, for every input."""
    return tab[1, fp32_to_fp16(x)]


@_kernel
def silu(x):
    return x / (_ONE + v_expf(-x))


@_kernel
def silu_libm(x):
    """GGML's scalar ``ggml_silu_f32`` (libm's ``expf``), which its SIMD rows use past the last 8."""
    return x / (_ONE + np.float32(math.exp(-x)))


@_kernel
def hardsigmoid(x):
    return min(_ONE, max(_ZERO, (x + _THREE) / _SIX))


# -- rows ---------------------------------------------------------------------------------------------
@_kernel
def _unary_row(code, x, y, p0, p1, tab):
    """``y = f(x)`` for the op ``code``; ``p0``, ``p1`` are SCALE's (s, b) or CLAMP's (min, max),
    ``tab`` the GELU tables."""
    n = x.shape[0]
    if code == _ABS:
        for i in range(n):
            y[i] = abs(x[i])
    elif code == _SGN:
        for i in range(n):
            y[i] = _ONE if x[i] > 0 else (-_ONE if x[i] < 0 else _ZERO)
    elif code == _NEG:
        for i in range(n):
            y[i] = -x[i]
    elif code == _STEP:
        for i in range(n):
            y[i] = _ONE if x[i] > 0 else _ZERO
    elif code == _TANH:
        for i in range(n):
            y[i] = math.tanh(x[i])
    elif code == _ELU:
        for i in range(n):
            y[i] = x[i] if x[i] > 0 else math.expm1(x[i])
    elif code == _RELU:
        for i in range(n):
            y[i] = x[i] if x[i] > 0 else _ZERO
    elif code == _SIGMOID:
        for i in range(n):
            y[i] = _ONE / (_ONE + math.exp(-x[i]))
    elif code == _GELU:
        for i in range(n):
            y[i] = gelu(x[i], tab)
    elif code == _GELU_QUICK:
        for i in range(n):
            y[i] = gelu_quick(x[i], tab)
    elif code == _SILU:
        n8 = n - n % 8
        for i in range(n8):
            y[i] = silu(x[i])
        for i in range(n8, n):
            y[i] = silu_libm(x[i])
    elif code == _HARDSWISH:
        for i in range(n):
            y[i] = x[i] * hardsigmoid(x[i])
    elif code == _HARDSIGMOID:
        for i in range(n):
            y[i] = hardsigmoid(x[i])
    elif code == _EXP:
        for i in range(n):
            y[i] = math.exp(x[i])
    elif code == _GELU_ERF:
        for i in range(n):
            y[i] = gelu_erf(x[i])
    elif code == _SQR:
        for i in range(n):
            y[i] = x[i] * x[i]
    elif code == _SQRT:
        for i in range(n):
            y[i] = math.sqrt(x[i])
    elif code == _LOG:
        for i in range(n):
            y[i] = math.log(x[i])
    elif code == _SIN:
        for i in range(n):
            y[i] = math.sin(x[i])
    elif code == _COS:
        for i in range(n):
            y[i] = math.cos(x[i])
    elif code == _SCALE:
        if p1 == 0:
            for i in range(n):
                y[i] = x[i] * p0
        else:
            for i in range(n):
                y[i] = fmaf(x[i], p0, p1)  # GGML's ggml_vec_mad1_f32: one FMA
    elif code == _CLAMP:
        # GGML's MAX(MIN(x, max), min) with C's macros (a NaN becomes max)
        for i in range(n):
            v = x[i] if x[i] < p1 else p1
            y[i] = v if v > p0 else p0


@_kernel
def _binary_row(code, x, y, z):
    n = x.shape[0]
    if code == _ADD:
        for i in range(n):
            z[i] = x[i] + y[i]
    elif code == _SUB:
        for i in range(n):
            z[i] = x[i] - y[i]
    elif code == _MUL:
        for i in range(n):
            z[i] = x[i] * y[i]
    else:
        for i in range(n):
            z[i] = x[i] / y[i]


@_kernel
def _glu_row(code, x, g, y, tab):
    n = y.shape[0]
    if code == _REGLU:
        for i in range(n):
            y[i] = x[i] * g[i] if x[i] > 0 else _ZERO
    elif code == _GEGLU:
        for i in range(n):
            y[i] = _ZERO if x[i] <= -_GELU_LIMIT else gelu(x[i], tab) * g[i]   # GGML's +0, not 0 * g
    else:
        n8 = n - n % 8
        for i in range(n8):
            y[i] = silu(x[i]) * g[i]
        for i in range(n8, n):
            y[i] = silu_libm(x[i]) * g[i]


# -- kernels ----------------------------------------------------------------------------------------
@_pkernel
def unary(ch, nch, code, x, dst, p0, p1, tab):
    """``p0``, ``p1``: SCALE's (s, b) or CLAMP's (min, max), used as float32; ``tab``: ``GELU_TABLES``."""
    n3, n2, n1, _ = dst.shape
    q0, q1 = np.float32(p0), np.float32(p1)
    for r in chunk(n3 * n2 * n1, ch, nch):
        i3, i2, i1 = unravel_row(r, n1, n2)
        _unary_row(code, x[i3, i2, i1], dst[i3, i2, i1], q0, q1, tab)


@_pkernel
def binary(ch, nch, code, a, b, dst):
    """``dst = a op b`` with ``b``'s rows repeated over dims 1..3 (``b.shape[3] == a.shape[3]``)."""
    n3, n2, n1, _ = dst.shape
    m3, m2, m1, _ = b.shape
    for r in chunk(n3 * n2 * n1, ch, nch):
        i3, i2, i1 = unravel_row(r, n1, n2)
        _binary_row(code, a[i3, i2, i1], b[i3 % m3, i2 % m2, i1 % m1], dst[i3, i2, i1])


@_pkernel
def glu(ch, nch, code, a, b, dst, split, swapped, tab):
    """GGML's GLU: ``f(x) * g`` with x, g the two halves of a row of ``a`` (swapped: g first), or
    the rows of ``a`` and ``b`` (split)."""
    n3, n2, n1, nc = dst.shape
    for r in chunk(n3 * n2 * n1, ch, nch):
        i3, i2, i1 = unravel_row(r, n1, n2)
        ra = a[i3, i2, i1]
        if split:
            x, g = ra, b[i3, i2, i1]
        elif swapped:
            x, g = ra[nc:2 * nc], ra[:nc]
        else:
            x, g = ra[:nc], ra[nc:2 * nc]
        _glu_row(code, x, g, dst[i3, i2, i1], tab)


# -- forward -----------------------------------------------------------------------------------------
_F32 = Type.F32
_UNARY_CODES = frozenset(int(u) for u in UnaryOp)
_GLU_CODES = frozenset((_REGLU, _GEGLU, _SWIGLU))


def _all_f32(node):
    """The result and its (at most two) sources are F32."""
    a, b = node.src[0], node.src[1]
    return node.type == _F32 and a.type == _F32 and (b is None or b.type == _F32)


def _unary_supported(node):
    return _all_f32(node) and (node.op != Op.UNARY or unary_op(node) in _UNARY_CODES)


@forward(Op.UNARY, Op.SQR, Op.SQRT, Op.LOG, Op.SIN, Op.COS, Op.SCALE, Op.CLAMP,
         supports=_unary_supported)
def unary_forward(node, dst, srcs, params):
    p0 = p1 = 0.0
    if node.op == Op.UNARY:
        code = int(unary_op(node))
    else:
        code = _OP_CODE[node.op]
        if node.op == Op.SCALE:
            p0, p1 = scale_params(node)
        elif node.op == Op.CLAMP:
            p0, p1 = clamp_params(node)
    return [params.launch(unary, dst.size, code, srcs[0], dst, float(p0), float(p1), GELU_TABLES)]


@forward(Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.ADD1, supports=_all_f32)
def binary_forward(node, dst, srcs, params):
    a, b = srcs[0], srcs[1]
    kernel, args = params.launch(binary, dst.size, _BINARY_CODE[node.op], a, b, dst)
    if b.shape[3] != dst.shape[3]:  # repeat along dim 0: tile b's rows (small: b divides a)
        return [(_Tiled(kernel), args)]
    return [(kernel, args)]


class _Tiled:
    """A plan step: ``kernel`` (``binary`` on this thread or its pool driver ``binary.run``, as
    ``params.launch`` chose) with b's rows tiled to dst's length, at every run (b's contents change
    between runs)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, c, nc, code, a, b, dst):
        self.kernel(c, nc, code, a, np.tile(b, (1, 1, 1, dst.shape[3] // b.shape[3])), dst)


def _glu_supported(node):
    return _all_f32(node) and glu_params(node).op in _GLU_CODES


@forward(Op.GLU, supports=_glu_supported)
def glu_forward(node, dst, srcs, params):
    gop, swapped = glu_params(node)
    split = srcs[1] is not None
    return [params.launch(glu, dst.size, int(gop), srcs[0], srcs[1] if split else srcs[0], dst, split, swapped,
                   GELU_TABLES)]


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, common.__file__, pool.__file__, type_common.__file__,
          types.__file__, __file__)   # types: UnaryOp's values
