"""Every op, declared once: its constructor, its shape rule and its ``op_params`` (GGML's ggml.c).
The ``Op`` enum itself is in ``types.py``, below the tensor that records it.

Constructors build lazy tensors: they check shapes and types where GGML asserts, raising
``ValueError`` with the op and the shapes, and record ``op``, ``src`` and ``op_params``. They
compute nothing; each backend registers its own kernel per op.

GGML's pattern is kept: a constructor that can run in place is an ``_impl(..., inplace)`` with
two thin wrappers, ``op`` (a fresh result) and ``op_inplace`` (a view of the first operand).

``op_params`` is a plain tuple of ints and floats in GGML's order; the scheduler, graph printing and
CUDA graph keys compare and hash it as it is. Each op with params declares them once, next to its
constructor, as a ``NamedTuple`` whose field order *is* that order: the constructor builds the tuple
from it and the accessor (``rope_params(t)``, ``soft_max_params(t)``, ...) reads it back, so no
backend indexes ``op_params`` by position. The constants GGML derives from them on the host
(``rope_yarn_corr_dims``, ``rope_theta_scale``, ``soft_max_alibi``) are here too, in float32 as
GGML's C computes them, so that every backend gets the same bits.

``OP_DEFS`` holds the rest of what is known of each op, one row per op (``OpDef``): its number in
GGML's enum, its params type, how a node is made again by its constructor (the RPC ends check every
node so), and its in-place and view rules (``INPLACE_OPS``, ``VIEW_OPS``, ``EMPTY_OPS`` and
``OP_PARAMS`` are read from it).
"""
from __future__ import annotations

import enum
import functools
import math
from typing import NamedTuple

import numpy as np

from .errors import ShapeError, TensorTypeError
from .tensor import Tensor, current_context, MAX_DIMS
from .types import GluOp, Op, SortOrder, Type, UnaryOp, type_name, type_size

__all__ = ["Op", "OpDef", "OP_DEFS", "OP_PARAMS", "UnaryOp", "GluOp", "SortOrder", "ROPE_TYPE_NORMAL", "ROPE_TYPE_NEOX", "VIEW_OPS", "EMPTY_OPS",
           "INPLACE_OPS", "is_view_op", "op_can_inplace", "op_desc", "can_repeat", "dup",
           "dup_inplace", "cpy", "cont", "cont_4d", "cont_1d", "cont_2d", "cont_3d", "add", "add_inplace",
           "sub", "sub_inplace", "mul", "mul_inplace", "div", "div_inplace", "add1", "add1_inplace",
           "repeat", "concat", "sqr", "sqr_inplace", "sqrt", "sqrt_inplace", "log", "log_inplace", "sin",
           "cos", "unary", "abs", "abs_inplace", "sgn", "neg", "neg_inplace", "step", "tanh", "tanh_inplace",
           "elu", "relu", "relu_inplace", "sigmoid", "sigmoid_inplace", "gelu", "gelu_inplace", "gelu_erf",
           "gelu_quick", "silu", "silu_inplace", "hardswish", "hardsigmoid", "exp", "exp_inplace", "scale",
           "scale_inplace", "scale_bias", "clamp", "sum", "sum_rows", "mean", "argmax", "argsort", "argsort_top_k", "norm",
           "norm_inplace", "rms_norm", "rms_norm_inplace", "mul_mat", "mul_mat_id", "get_rows", "set_rows",
           "diag_mask_inf", "diag_mask_inf_inplace", "soft_max", "soft_max_inplace", "soft_max_ext",
           "soft_max_ext_inplace", "flash_attn_ext", "flash_attn_ext_set_prec", "PREC_DEFAULT", "PREC_F32",
           "rope_ext", "rope_ext_inplace", "rope", "rope_inplace", "swiglu",
           "swiglu_swapped", "swiglu_split", "geglu", "geglu_split", "reglu", "reglu_split", "pad_ext",
           "pad", "reshape", "reshape_1d", "reshape_2d", "reshape_3d", "reshape_4d", "view_1d", "view_2d",
           "view_3d", "view_4d", "permute", "transpose",
           # op_params, typed (one NamedTuple per op, its fields in GGML's order), and their accessors
           "ConcatParams", "UnaryParams", "ScaleParams", "ClampParams", "NormParams", "DiagMaskParams",
           "SoftMaxParams", "FlashAttnParams", "RopeParams", "GluParams", "PadParams", "ViewParams",
           "PermuteParams", "SortParams", "concat_dim", "unary_op", "scale_params", "clamp_params", "norm_eps",
           "diag_mask_n_past", "soft_max_params", "flash_attn_params", "rope_params", "glu_params",
           "pad_params", "view_offset", "permute_axes", "sort_order",
           # constants GGML derives from op_params on the host
           "rope_yarn_corr_dims", "rope_theta_scale", "AlibiParams", "soft_max_alibi"]


# rope modes (GGML_ROPE_TYPE_*)
ROPE_TYPE_NORMAL = 0
ROPE_TYPE_NEOX = 2

def is_view_op(op):
    """True for the ops whose result is a view of their source (VIEW, RESHAPE, PERMUTE, TRANSPOSE), as
    ``ggml_is_view_op``."""
    return op in VIEW_OPS


def op_can_inplace(op):
    """True for the ops whose result may take over a source's memory when the allocator finds it free
    (``INPLACE_OPS``)."""
    return op in INPLACE_OPS


def op_desc(t):
    """GGML's ``ggml_op_desc``: the sub-op name for UNARY and GLU, else the op name."""
    if t.op == Op.UNARY:
        return unary_op(t).name
    if t.op == Op.GLU:
        return glu_params(t).op.name
    return t.op.name


# -- helpers ---------------------------------------------------------------------------------------
def _ctx(ctx, a):
    """Where a result goes: ``ctx=``, else the innermost ``with ctx:``, else the operand's."""
    return ctx or current_context() or a.ctx


def _need(name, *tensors):
    for t in tensors:
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a Tensor, got {type(t).__name__}")


def tensor_desc(t):
    """A tensor as messages show it: its label, type and shape, e.g. ``'x' f32[4, 3]``."""
    return f"{t.label} {type_name(t.type)}{list(t.ne)}"


def node_desc(node):
    """A node as messages show it: the op, the result and its sources."""
    srcs = ", ".join(tensor_desc(s) for s in node.src if s is not None)
    return f"{op_desc(node)} -> {tensor_desc(node)}" + (f" from {srcs}" if srcs else "")


def _shapes(*ts):
    return ", ".join(tensor_desc(t) for t in ts)


def _fail(name, why, *ts, error=ShapeError):
    raise error(f"{name}: {why} ({_shapes(*ts)})")


def _result(ctx, a, inplace):
    """GGML's ``inplace ? ggml_view_tensor(a) : ggml_dup_tensor(a)``."""
    return ctx.view_tensor(a) if inplace else ctx.dup_tensor(a)


def _set(t, op, srcs, params=()):
    """Record the op; ``params`` (the op's NamedTuple) become a plain tuple: enums and bools as ints,
    as GGML stores them in its int32 slots."""
    t.op = op
    for i, s in enumerate(srcs):
        t.src[i] = s
    t.op_params = tuple(int(v) if isinstance(v, (bool, enum.IntEnum)) else v for v in params)
    return t


def _read(t, params_type, *ops):
    """``t.op_params`` as ``params_type``, for a node whose op is one of ``ops``."""
    if t.op not in ops:
        raise ValueError(f"{params_type.__name__}: node {t.label} is {t.op.name}, not "
                         f"{' or '.join(op.name for op in ops)}")
    return params_type._make(t.op_params)


# -- C float arithmetic on the host (GGML computes its op constants in C float) -----------------------
_F32 = np.float32


def powf(x, y):
    """C's ``powf``: the double power of the float32 operands, rounded once to float32. That is
    glibc's result but in rare last-bit cases; NumPy's float32 power is 1 ulp off already for
    10000^(-1/32), which moves every angle of a long context."""
    return _F32(math.pow(float(_F32(x)), float(_F32(y))))


def logf(x):
    """C's ``logf``, the same way (NumPy's float32 log misses glibc's last bit far more often)."""
    return _F32(math.log(float(_F32(x)))) if x > 0 else _F32(-np.inf if x == 0 else np.nan)


def can_repeat(t0, t1):
    """``t0`` can be tiled to ``t1``'s shape (GGML's ``ggml_can_repeat``)."""
    return t0.nelements() == 0 or all(t0.ne[i] and t1.ne[i] % t0.ne[i] == 0 for i in range(MAX_DIMS))


def _is_padded_1d(t):
    return t.nb[0] == type_size(t.type) and t.nb[2] == t.nb[1] * t.ne[1] and t.nb[3] == t.nb[2] * t.ne[2]


FLOAT_TYPES = (Type.F32, Type.F16, Type.BF16)
_INTEGER_TYPES = (Type.I8, Type.I16, Type.I32, Type.I64)


def _need_float(name, *ts):
    """``_need``, and each tensor holds floats: GGML computes these ops on F32/F16/BF16 only and
    aborts at compute on anything else, so we say so while the graph is built."""
    _need(name, *ts)
    for t in ts:
        if t.type not in FLOAT_TYPES:
            _fail(name, f"{type_name(t.type)} input; this op takes f32, f16 or bf16", *ts, error=TensorTypeError)


# -- copies ----------------------------------------------------------------------------------------
def _dup_impl(a, inplace, ctx):
    _need("dup", a)
    return _set(_result(_ctx(ctx, a), a, inplace), Op.DUP, [a])


def dup(a, *, ctx=None):
    """A copy of ``a``: a new packed tensor of the same type and shape (``ggml_dup``)."""
    return _dup_impl(a, False, ctx)


def dup_inplace(a, *, ctx=None):
    """As ``dup``, but the result is a view of ``a`` (the copy writes onto itself)."""
    return _dup_impl(a, True, ctx)


def cpy(a, b, *, ctx=None):
    """Copy ``a`` into ``b`` (converting the type); the result is a view of ``b``."""
    _need("cpy", a, b)
    if a.nelements() != b.nelements():
        _fail("cpy", "element counts differ", a, b)
    r = _ctx(ctx, a).view_tensor(b)
    r.name = f"{b.name} (copy of {a.name})" if b.name else f"{a.name} (copy)"
    return _set(r, Op.CPY, [a, b])


def cont(a, *, ctx=None):
    """A packed (contiguous) copy of ``a``, same type and shape: what a permuted or transposed view needs
    before ``reshape``."""
    _need("cont", a)
    r = _ctx(ctx, a).dup_tensor(a)
    r.name = f"{a.name} (cont)"
    return _set(r, Op.CONT, [a])


def cont_4d(a, ne0, ne1=1, ne2=1, ne3=1, *, ctx=None):
    """A packed copy of ``a`` with the shape [ne0, ne1, ne2, ne3]; the element count must stay the same."""
    _need("cont", a)
    if a.nelements() != ne0 * ne1 * ne2 * ne3:
        _fail("cont", f"cannot make {[ne0, ne1, ne2, ne3]} from {a.nelements()} elements", a)
    r = _ctx(ctx, a).new_tensor(a.type, (ne0, ne1, ne2, ne3))
    r.name = f"{a.name} (cont)"
    return _set(r, Op.CONT, [a])


def cont_1d(a, ne0, *, ctx=None):
    """``cont_4d`` to the shape [ne0]."""
    return cont_4d(a, ne0, ctx=ctx)


def cont_2d(a, ne0, ne1, *, ctx=None):
    """``cont_4d`` to the shape [ne0, ne1]."""
    return cont_4d(a, ne0, ne1, ctx=ctx)


def cont_3d(a, ne0, ne1, ne2, *, ctx=None):
    """``cont_4d`` to the shape [ne0, ne1, ne2]."""
    return cont_4d(a, ne0, ne1, ne2, ctx=ctx)


# -- element-wise binary ops (b is tiled over a: GGML's "repeat" broadcasting) -----------------------
def _binary_impl(name, op, a, b, inplace, ctx):
    _need(name, a, b)
    if not can_repeat(b, a):
        _fail(name, "b cannot be broadcast to a (each a.ne[i] must be a multiple of b.ne[i])", a, b)
    return _set(_result(_ctx(ctx, a), a, inplace), op, [a, b])


def add(a, b, *, ctx=None):
    """a + b, element-wise; ``b`` is broadcast (repeated) over ``a``'s shape, and the result has ``a``'s type
    and shape, as ``ggml_add``."""
    return _binary_impl("add", Op.ADD, a, b, False, ctx)


def add_inplace(a, b, *, ctx=None):
    """As ``add``, but the result is a view of ``a``: the sum is written over ``a``."""
    return _binary_impl("add", Op.ADD, a, b, True, ctx)


def sub(a, b, *, ctx=None):
    """a - b, element-wise; ``b`` is broadcast (repeated) over ``a``'s shape, as ``ggml_sub``."""
    return _binary_impl("sub", Op.SUB, a, b, False, ctx)


def sub_inplace(a, b, *, ctx=None):
    """As ``sub``, but the result is a view of ``a``: the difference is written over ``a``."""
    return _binary_impl("sub", Op.SUB, a, b, True, ctx)


def mul(a, b, *, ctx=None):
    """a * b, element-wise (not a matrix product: see ``mul_mat``); ``b`` is broadcast (repeated) over ``a``'s
    shape, as ``ggml_mul``."""
    return _binary_impl("mul", Op.MUL, a, b, False, ctx)


def mul_inplace(a, b, *, ctx=None):
    """As ``mul``, but the result is a view of ``a``: the product is written over ``a``."""
    return _binary_impl("mul", Op.MUL, a, b, True, ctx)


def div(a, b, *, ctx=None):
    """a / b, element-wise; ``b`` is broadcast (repeated) over ``a``'s shape, as ``ggml_div``."""
    return _binary_impl("div", Op.DIV, a, b, False, ctx)


def div_inplace(a, b, *, ctx=None):
    """As ``div``, but the result is a view of ``a``: the quotient is written over ``a``."""
    return _binary_impl("div", Op.DIV, a, b, True, ctx)


def _add1_impl(a, b, inplace, ctx):
    _need("add1", a, b)
    if not b.is_scalar():
        _fail("add1", "b must be a scalar", a, b)
    if not _is_padded_1d(a):
        _fail("add1", "a must be padded 1-d (rows packed above dim 1)", a, b)
    return _set(_result(_ctx(ctx, a), a, inplace), Op.ADD1, [a, b])


def add1(a, b, *, ctx=None):
    """a + b where ``b`` is a one-element tensor, added to every element of ``a`` (``ggml_add1``)."""
    return _add1_impl(a, b, False, ctx)


def add1_inplace(a, b, *, ctx=None):
    """As ``add1``, but the result is a view of ``a``: the sum is written over ``a``."""
    return _add1_impl(a, b, True, ctx)


def repeat(a, b, *, ctx=None):
    """Tile ``a`` to ``b``'s shape."""
    _need("repeat", a, b)
    if not can_repeat(a, b):
        _fail("repeat", "a cannot be tiled to b's shape", a, b)
    return _set(_ctx(ctx, a).new_tensor(a.type, b.ne), Op.REPEAT, [a])


class ConcatParams(NamedTuple):
    """CONCAT's ``op_params``: the dim along which the sources are joined."""
    dim: int


def concat_dim(t):
    """The dim along which a CONCAT node joins its sources."""
    return _read(t, ConcatParams, Op.CONCAT).dim


def concat(a, b, dim, *, ctx=None):
    """``a`` and ``b`` joined along ``dim``: the shapes must agree in every other dim, and the types must be
    equal."""
    _need("concat", a, b)
    if a.type != b.type:
        _fail("concat", "types differ", a, b, error=TensorTypeError)
    if not 0 <= dim < MAX_DIMS:
        _fail("concat", f"dim {dim} is not in 0..3", a, b)
    if any(a.ne[d] != b.ne[d] for d in range(MAX_DIMS) if d != dim):
        _fail("concat", f"shapes differ outside dim {dim}", a, b)
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    return _set(_ctx(ctx, a).new_tensor(a.type, ne), Op.CONCAT, [a, b], ConcatParams(dim))


# -- element-wise unary ops --------------------------------------------------------------------------
def _simple_impl(name, op, a, inplace, ctx, params=()):
    _need_float(name, a)
    return _set(_result(_ctx(ctx, a), a, inplace), op, [a], params)


def sqr(a, *, ctx=None):
    """x², element-wise."""
    return _simple_impl("sqr", Op.SQR, a, False, ctx)


def sqr_inplace(a, *, ctx=None):
    """As ``sqr``, but written over ``a`` (the result is a view of it)."""
    return _simple_impl("sqr", Op.SQR, a, True, ctx)


def sqrt(a, *, ctx=None):
    """√x, element-wise."""
    return _simple_impl("sqrt", Op.SQRT, a, False, ctx)


def sqrt_inplace(a, *, ctx=None):
    """As ``sqrt``, but written over ``a`` (the result is a view of it)."""
    return _simple_impl("sqrt", Op.SQRT, a, True, ctx)


def log(a, *, ctx=None):
    """The natural logarithm, element-wise."""
    return _simple_impl("log", Op.LOG, a, False, ctx)


def log_inplace(a, *, ctx=None):
    """As ``log``, but written over ``a`` (the result is a view of it)."""
    return _simple_impl("log", Op.LOG, a, True, ctx)


def sin(a, *, ctx=None):
    """sin(x), element-wise."""
    return _simple_impl("sin", Op.SIN, a, False, ctx)


def cos(a, *, ctx=None):
    """cos(x), element-wise."""
    return _simple_impl("cos", Op.COS, a, False, ctx)


class UnaryParams(NamedTuple):
    """UNARY's ``op_params``: which activation (a ``UnaryOp``)."""
    op: UnaryOp


def unary_op(t):
    """The ``UnaryOp`` of an ``Op.UNARY`` node."""
    return UnaryOp(_read(t, UnaryParams, Op.UNARY).op)


def unary(a, uop, *, ctx=None):
    """The activation ``uop`` (a ``UnaryOp``) applied element-wise: one UNARY node, its sub-op in
    ``op_params``; ``a`` must be contiguous, though its rows may be spaced apart."""
    return _unary_impl(a, UnaryOp(uop), False, ctx)


def _unary_impl(a, uop, inplace, ctx):
    name = uop.name.lower()
    _need_float(name, a)
    if not a.is_contiguous_1():
        _fail(name, "input must be contiguous along its rows", a)
    return _set(_result(_ctx(ctx, a), a, inplace), Op.UNARY, [a], UnaryParams(uop))


def abs(a, *, ctx=None):  # noqa: A001 - GGML's name
    """|x|, element-wise (a UNARY node)."""
    return _unary_impl(a, UnaryOp.ABS, False, ctx)


def abs_inplace(a, *, ctx=None):
    """As ``abs``, but written over ``a`` (the result is a view of it)."""
    return _unary_impl(a, UnaryOp.ABS, True, ctx)


def sgn(a, *, ctx=None):
    """The sign of each element: -1, 0 or 1."""
    return _unary_impl(a, UnaryOp.SGN, False, ctx)


def neg(a, *, ctx=None):
    """-x, element-wise; also ``-a``."""
    return _unary_impl(a, UnaryOp.NEG, False, ctx)


def neg_inplace(a, *, ctx=None):
    """As ``neg``, but written over ``a`` (the result is a view of it)."""
    return _unary_impl(a, UnaryOp.NEG, True, ctx)


def step(a, *, ctx=None):
    """1 where x > 0, else 0, element-wise."""
    return _unary_impl(a, UnaryOp.STEP, False, ctx)


def tanh(a, *, ctx=None):
    """tanh(x), element-wise."""
    return _unary_impl(a, UnaryOp.TANH, False, ctx)


def tanh_inplace(a, *, ctx=None):
    """As ``tanh``, but written over ``a`` (the result is a view of it)."""
    return _unary_impl(a, UnaryOp.TANH, True, ctx)


def elu(a, *, ctx=None):
    """x where x > 0, else exp(x) - 1, element-wise."""
    return _unary_impl(a, UnaryOp.ELU, False, ctx)


def relu(a, *, ctx=None):
    """max(x, 0), element-wise."""
    return _unary_impl(a, UnaryOp.RELU, False, ctx)


def relu_inplace(a, *, ctx=None):
    """As ``relu``, but written over ``a`` (the result is a view of it)."""
    return _unary_impl(a, UnaryOp.RELU, True, ctx)


def sigmoid(a, *, ctx=None):
    """1 / (1 + exp(-x)), element-wise."""
    return _unary_impl(a, UnaryOp.SIGMOID, False, ctx)


def sigmoid_inplace(a, *, ctx=None):
    """As ``sigmoid``, but written over ``a`` (the result is a view of it)."""
    return _unary_impl(a, UnaryOp.SIGMOID, True, ctx)


def gelu(a, *, ctx=None):
    """GELU in its tanh form, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), element-wise."""
    return _unary_impl(a, UnaryOp.GELU, False, ctx)


def gelu_inplace(a, *, ctx=None):
    """As ``gelu``, but written over ``a`` (the result is a view of it)."""
    return _unary_impl(a, UnaryOp.GELU, True, ctx)


def gelu_erf(a, *, ctx=None):
    """GELU exactly, 0.5·x·(1 + erf(x/√2)), element-wise."""
    return _unary_impl(a, UnaryOp.GELU_ERF, False, ctx)


def gelu_quick(a, *, ctx=None):
    """The quick GELU, x·sigmoid(1.702·x), element-wise."""
    return _unary_impl(a, UnaryOp.GELU_QUICK, False, ctx)


def silu(a, *, ctx=None):
    """x·sigmoid(x) (SiLU, or swish), element-wise."""
    return _unary_impl(a, UnaryOp.SILU, False, ctx)


def silu_inplace(a, *, ctx=None):
    """As ``silu``, but written over ``a`` (the result is a view of it)."""
    return _unary_impl(a, UnaryOp.SILU, True, ctx)


def hardswish(a, *, ctx=None):
    """x·hardsigmoid(x), element-wise."""
    return _unary_impl(a, UnaryOp.HARDSWISH, False, ctx)


def hardsigmoid(a, *, ctx=None):
    """min(1, max(0, (x + 3)/6)), element-wise."""
    return _unary_impl(a, UnaryOp.HARDSIGMOID, False, ctx)


def exp(a, *, ctx=None):
    """exp(x), element-wise."""
    return _unary_impl(a, UnaryOp.EXP, False, ctx)


def exp_inplace(a, *, ctx=None):
    """As ``exp``, but written over ``a`` (the result is a view of it)."""
    return _unary_impl(a, UnaryOp.EXP, True, ctx)


class ScaleParams(NamedTuple):
    """SCALE's ``op_params``: the result is ``a*s + b``."""
    s: float
    b: float


def scale_params(t):
    """A SCALE node's factor and bias as ``ScaleParams(s, b)``."""
    return _read(t, ScaleParams, Op.SCALE)


def _scale_impl(a, s, b, inplace, ctx):
    _need_float("scale", a)
    if not _is_padded_1d(a):
        _fail("scale", "input must be padded 1-d (rows packed above dim 1)", a)
    return _set(_result(_ctx(ctx, a), a, inplace), Op.SCALE, [a], ScaleParams(float(s), float(b)))


def scale(a, s, *, ctx=None):
    """a·s for a float ``s``, element-wise (``ggml_scale``); also ``a * 2.0``."""
    return _scale_impl(a, s, 0.0, False, ctx)


def scale_inplace(a, s, *, ctx=None):
    """As ``scale``, but written over ``a`` (the result is a view of it)."""
    return _scale_impl(a, s, 0.0, True, ctx)


def scale_bias(a, s, b, *, ctx=None):
    """``a*s + b``."""
    return _scale_impl(a, s, b, False, ctx)


class ClampParams(NamedTuple):
    """CLAMP's ``op_params``: the bounds of the result."""
    min: float
    max: float


def clamp_params(t):
    """A CLAMP node's bounds as ``ClampParams(min, max)``."""
    return _read(t, ClampParams, Op.CLAMP)


def clamp(a, min, max, *, ctx=None):  # noqa: A002 - GGML's names
    """Clamp to ``[min, max]``; always a view of ``a`` in GGML."""
    _need_float("clamp", a)
    if min > max:
        _fail("clamp", f"min {min} > max {max}", a)
    return _set(_ctx(ctx, a).view_tensor(a), Op.CLAMP, [a], ClampParams(float(min), float(max)))


# -- reductions ------------------------------------------------------------------------------------
def sum(a, *, ctx=None):  # noqa: A001 - GGML's name
    """The sum of all elements of ``a``, as a one-element tensor of ``a``'s type."""
    _need_float("sum", a)
    return _set(_ctx(ctx, a).new_tensor_1d(a.type, 1), Op.SUM, [a])


def sum_rows(a, *, ctx=None):
    """The sum of each row (along dim 0): [ne0, ne1, ne2, ne3] -> [1, ne1, ne2, ne3], ``a``'s type."""
    _need_float("sum_rows", a)
    return _set(_ctx(ctx, a).new_tensor(a.type, (1,) + a.ne[1:]), Op.SUM_ROWS, [a])


def mean(a, *, ctx=None):
    """The mean of each row (along dim 0): [ne0, ne1, ne2, ne3] -> F32 [1, ne1, ne2, ne3]."""
    _need_float("mean", a)
    return _set(_ctx(ctx, a).new_tensor(Type.F32, (1,) + a.ne[1:]), Op.MEAN, [a])


def argmax(a, *, ctx=None):
    """The index of the largest element of each row of the matrix ``a`` [ne0, ne1] -> I32 [ne1]; of equal
    maxima, the last."""
    _need_float("argmax", a)
    if not a.is_matrix():
        _fail("argmax", "input must be a matrix", a)
    return _set(_ctx(ctx, a).new_tensor_1d(Type.I32, a.ne[1]), Op.ARGMAX, [a])


class SortParams(NamedTuple):
    """ARGSORT's ``op_params``: ascending or descending (a ``SortOrder``)."""
    order: int


def sort_order(t):
    """The ``SortOrder`` of an ARGSORT node."""
    return SortOrder(_read(t, SortParams, Op.ARGSORT).order)


def argsort(a, order=SortOrder.ASC, *, ctx=None):
    """Per row of ``a`` [ne0, ...]: the I32 indices 0..ne0-1 ordered by their values, ascending or
    descending (``order``); of equal values, the lower index first (GGML's CPU sort does not
    promise an order for ties)."""
    _need_float("argsort", a)
    if order not in tuple(SortOrder):
        _fail("argsort", f"order must be a SortOrder (0 ascending, 1 descending), got {order!r}", a)
    return _set(_ctx(ctx, a).new_tensor(Type.I32, a.ne), Op.ARGSORT, [a], SortParams(SortOrder(order)))


def argsort_top_k(a, k, *, ctx=None):
    """The indices of the ``k`` largest values of each row of ``a``, largest first: a view of the
    first ``k`` columns of a descending ``argsort`` (GGML's ``ggml_argsort_top_k``)."""
    if not 0 < k <= a.ne[0]:
        _fail("argsort_top_k", f"k={k} must lie in [1, {a.ne[0]}]", a)
    s = argsort(a, SortOrder.DESC, ctx=ctx)
    return view_4d(s, k, s.ne[1], s.ne[2], s.ne[3], s.nb[1], s.nb[2], s.nb[3], 0, ctx=ctx)


# -- normalisation ---------------------------------------------------------------------------------
class NormParams(NamedTuple):
    """NORM's and RMS_NORM's ``op_params``: the ``eps`` added to the variance."""
    eps: float


def norm_eps(t):
    """``eps`` of a NORM or RMS_NORM node."""
    return _read(t, NormParams, Op.NORM, Op.RMS_NORM).eps


def _norm_impl(name, op, a, eps, inplace, ctx):
    _need_float(name, a)
    if eps < 0:
        _fail(name, f"eps must be non-negative, got {eps}", a)
    return _set(_result(_ctx(ctx, a), a, inplace), op, [a], NormParams(float(eps)))


def norm(a, eps=1e-5, *, ctx=None):
    """Per row: subtract the mean, divide by sqrt(variance + eps)."""
    return _norm_impl("norm", Op.NORM, a, eps, False, ctx)


def norm_inplace(a, eps=1e-5, *, ctx=None):
    """As ``norm``, but written over ``a`` (the result is a view of it)."""
    return _norm_impl("norm", Op.NORM, a, eps, True, ctx)


def rms_norm(a, eps=1e-6, *, ctx=None):
    """Per row: divide by sqrt(mean(x²) + eps)."""
    return _norm_impl("rms_norm", Op.RMS_NORM, a, eps, False, ctx)


def rms_norm_inplace(a, eps=1e-6, *, ctx=None):
    """As ``rms_norm``, but written over ``a`` (the result is a view of it)."""
    return _norm_impl("rms_norm", Op.RMS_NORM, a, eps, True, ctx)


# -- matrix multiplication -----------------------------------------------------------------------
def mul_mat(a, b, *, ctx=None):
    """``a`` [k, m, p, q] (weights, may be quantized) times ``b`` [k, n, P, Q] -> F32 [m, n, P, Q].

    Each result element is the dot product of a row of ``a`` with a row of ``b``; ``b``'s dims 2
    and 3 must be multiples of ``a``'s, which are broadcast (GGML's ``ggml_can_mul_mat``).
    """
    _need("mul_mat", a)
    _need_float("mul_mat", b)
    if a.type in _INTEGER_TYPES:
        _fail("mul_mat", f"{type_name(a.type)} weights; a must hold floats or quantized blocks", a, b,
              error=TensorTypeError)
    if a.ne[0] != b.ne[0]:
        _fail("mul_mat", "inner sizes ne[0] differ", a, b)
    if b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
        _fail("mul_mat", "b.ne[2] and b.ne[3] must be multiples of a's", a, b)
    if a.is_transposed():
        _fail("mul_mat", "a must not be transposed", a, b)
    r = _ctx(ctx, a).new_tensor(Type.F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]))
    return _set(r, Op.MUL_MAT, [a, b])


def mul_mat_id(as_, b, ids, *, ctx=None):
    """Mixture of experts: ``as_`` [k, m, n_expert] (one weight matrix per expert), ``b`` [k, n_b,
    n_tokens] F32, ``ids`` I32 [n_used, n_tokens] -> F32 [m, n_used, n_tokens], where

        result[:, e, t] = as_[:, :, ids[e, t]] @ b[:, e % n_b, t]

    (``n_b`` is 1, one row per token broadcast to every expert it uses, or ``n_used``). Each result
    element is a dot product as ``mul_mat``'s. An id outside [0, n_expert) is an error when the
    node is computed."""
    _need("mul_mat_id", as_, b, ids)
    _need_float("mul_mat_id", b)
    if as_.type in _INTEGER_TYPES:
        _fail("mul_mat_id", f"{type_name(as_.type)} weights; as must hold floats or quantized blocks", as_, b, ids,
              error=TensorTypeError)
    if ids.type != Type.I32:
        _fail("mul_mat_id", "ids must be I32", as_, b, ids, error=TensorTypeError)
    if as_.is_transposed():
        _fail("mul_mat_id", "as must not be transposed", as_, b, ids)
    if as_.ne[3] != 1 or b.ne[3] != 1 or ids.ne[2] != 1 or ids.ne[3] != 1:
        _fail("mul_mat_id", "as and b must be 3-D and ids 2-D", as_, b, ids)
    if as_.ne[0] != b.ne[0]:
        _fail("mul_mat_id", "inner sizes ne[0] differ", as_, b, ids)
    if ids.ne[1] != b.ne[2]:
        _fail("mul_mat_id", "ids needs one list of experts per token (ids.ne[1] == b.ne[2])", as_, b, ids)
    if ids.ne[0] % b.ne[1]:
        _fail("mul_mat_id", "b.ne[1] must divide ids.ne[0] (b's rows are broadcast over the experts used)",
              as_, b, ids)
    r = _ctx(ctx, as_).new_tensor(Type.F32, (as_.ne[1], ids.ne[0], b.ne[2], 1))
    return _set(r, Op.MUL_MAT_ID, [as_, b, ids])


# -- rows --------------------------------------------------------------------------------------------
_INDEX_TYPES = (Type.I32, Type.I64)


def get_rows(a, b, *, ctx=None):
    """Gather rows of ``a`` [n_embd, n_rows, p, q] by the indices ``b`` [n, p, q] -> [n_embd, n, p, q].

    An index outside ``[0, n_rows)`` is undefined in GGML (its CPU asserts). Here the CPU raises
    ``IndexError`` when the graph is computed; a GPU (CUDA, OpenCL) reads nothing for it and writes
    a row of zeros: raising there would need a read-back from the device at every step."""
    _need("get_rows", a, b)
    if b.type not in _INDEX_TYPES:
        _fail("get_rows", "indices must be I32 or I64", a, b, error=TensorTypeError)
    if a.ne[2] != b.ne[1] or a.ne[3] != b.ne[2] or b.ne[3] != 1:
        _fail("get_rows", "index dims 1, 2 must match a's dims 2, 3", a, b)
    rtype = Type.I32 if a.type == Type.I32 else Type.F32
    r = _ctx(ctx, a).new_tensor(rtype, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]))
    return _set(r, Op.GET_ROWS, [a, b])


def set_rows(a, b, c, *, ctx=None):
    """Write the rows of ``b`` into ``a`` at the row indices ``c``; the result is a view of ``a``.

    An index outside ``[0, a.ne[1])`` is undefined in GGML (its CPU asserts). Here the CPU raises
    ``IndexError`` when the graph is computed; a GPU (CUDA, OpenCL) skips that row of ``b``:
    nothing is written for it, and nothing is raised."""
    _need("set_rows", a, b, c)
    if a.ne[0] != b.ne[0] or a.ne[2] != b.ne[2] or a.ne[3] != b.ne[3]:
        _fail("set_rows", "a and b must agree in dims 0, 2, 3", a, b, c)
    if b.ne[1] != c.ne[0] or b.ne[2] % c.ne[1] or b.ne[3] % c.ne[2] or c.ne[3] != 1:
        _fail("set_rows", "one index per row of b, broadcast over b's dims 2, 3", a, b, c)
    if b.type != Type.F32 or c.type not in _INDEX_TYPES:
        _fail("set_rows", "b must be F32 and c I32 or I64", a, b, c, error=TensorTypeError)
    if not (a.is_contiguous_rows() and b.is_contiguous_rows()):
        _fail("set_rows", "rows must be contiguous", a, b, c)
    # src order (b, c, a) is GGML's, kept for its legacy reasons
    return _set(_ctx(ctx, a).view_tensor(a), Op.SET_ROWS, [b, c, a])


# -- attention helpers ---------------------------------------------------------------------------
class DiagMaskParams(NamedTuple):
    """DIAG_MASK_INF's ``op_params``: how many past positions each row may also see."""
    n_past: int


def diag_mask_n_past(t):
    """``n_past`` of a DIAG_MASK_INF node."""
    return _read(t, DiagMaskParams, Op.DIAG_MASK_INF).n_past


def _diag_mask_inf_impl(a, n_past, inplace, ctx):
    _need_float("diag_mask_inf", a)
    return _set(_result(_ctx(ctx, a), a, inplace), Op.DIAG_MASK_INF, [a], DiagMaskParams(int(n_past)))


def diag_mask_inf(a, n_past, *, ctx=None):
    """Set ``a[.., i1, i0] = -inf`` where ``i0 > n_past + i1`` (a causal mask)."""
    return _diag_mask_inf_impl(a, n_past, False, ctx)


def diag_mask_inf_inplace(a, n_past, *, ctx=None):
    """As ``diag_mask_inf``, but written over ``a`` (the result is a view of it)."""
    return _diag_mask_inf_impl(a, n_past, True, ctx)


class SoftMaxParams(NamedTuple):
    """SOFT_MAX's ``op_params``: the factor on the input and ALiBi's maximum bias (0: no ALiBi)."""
    scale: float
    max_bias: float


def soft_max_params(t):
    """A SOFT_MAX node's ``SoftMaxParams(scale, max_bias)``."""
    return _read(t, SoftMaxParams, Op.SOFT_MAX)


class AlibiParams(NamedTuple):
    """ALiBi's host constants (``soft_max_alibi``): the slope bases ``m0``, ``m1`` and ``n_head_log2``."""
    m0: np.float32
    m1: np.float32
    n_head_log2: int


@functools.lru_cache(maxsize=64)
def soft_max_alibi(n_head, max_bias):
    """ALiBi's constants as GGML's soft_max computes them on the host, in float32: head ``h`` gets
    the slope ``m0^(h+1)`` below ``n_head_log2`` (the largest power of two <= n_head), else
    ``m1^(2(h - n_head_log2) + 1)``. With ``max_bias == 0``, m0 = m1 = 1."""
    n_head_log2 = 1 << int(math.floor(math.log2(n_head))) if n_head > 0 else 1
    m0 = powf(2.0, -_F32(max_bias) / _F32(n_head_log2))
    m1 = powf(2.0, -(_F32(max_bias) / _F32(2.0)) / _F32(n_head_log2))
    return AlibiParams(m0, m1, n_head_log2)


def _soft_max_impl(a, mask, scale_, max_bias, inplace, ctx):
    _need_float("soft_max", a)
    if not a.is_contiguous():
        _fail("soft_max", "input must be contiguous", a)
    if mask is not None:
        _need("soft_max", mask)
        if mask.type not in (Type.F16, Type.F32):
            _fail("soft_max", "mask must be F16 or F32", a, mask, error=TensorTypeError)
        if not mask.is_contiguous() or mask.ne[0] != a.ne[0] or mask.ne[1] < a.ne[1]:
            _fail("soft_max", "mask must be contiguous with ne[0] = a's and ne[1] >= a's", a, mask)
        if a.ne[2] % mask.ne[2] or a.ne[3] % mask.ne[3]:
            _fail("soft_max", "mask dims 2, 3 must divide a's", a, mask)
    if max_bias > 0 and mask is None:
        _fail("soft_max", "ALiBi (max_bias > 0) needs a mask", a)
    return _set(_result(_ctx(ctx, a), a, inplace), Op.SOFT_MAX, [a, mask],
                SoftMaxParams(float(scale_), float(max_bias)))


def soft_max(a, *, ctx=None):
    """Softmax of each row (along dim 0) of the contiguous ``a``: exp(x - max) / Σ exp(x - max)."""
    return _soft_max_impl(a, None, 1.0, 0.0, False, ctx)


def soft_max_inplace(a, *, ctx=None):
    """As ``soft_max``, but written over ``a`` (the result is a view of it)."""
    return _soft_max_impl(a, None, 1.0, 0.0, True, ctx)


def soft_max_ext(a, mask=None, scale=1.0, max_bias=0.0, *, ctx=None):
    """``softmax(a*scale + mask*slope)`` per row; ``slope`` is ALiBi's per-head slope when
    ``max_bias > 0``, else 1."""
    return _soft_max_impl(a, mask, scale, max_bias, False, ctx)


def soft_max_ext_inplace(a, mask=None, scale=1.0, max_bias=0.0, *, ctx=None):
    """As ``soft_max_ext``, but written over ``a`` (the result is a view of it)."""
    return _soft_max_impl(a, mask, scale, max_bias, True, ctx)


# GGML's enum ggml_prec (ggml.h): FLASH_ATTN_EXT's op_params[3]
PREC_DEFAULT = 0
PREC_F32 = 10


class FlashAttnParams(NamedTuple):
    """FLASH_ATTN_EXT's ``op_params`` (GGML's ``ggml_flash_attn_ext``): three floats, then the
    precision. ``scale`` is the caller's: with a soft cap, each kernel computes
    ``softcap * tanh(scale/softcap * q·k)`` from it (the division is done in float32 when the kernel
    is launched, as GGML's backends do)."""
    scale: float
    max_bias: float       # ALiBi's maximum bias (0: no ALiBi)
    logit_softcap: float  # 0: no soft cap
    prec: int             # PREC_DEFAULT or PREC_F32 (``flash_attn_ext_set_prec``); a hint GGML's CPU ignores


def flash_attn_params(t):
    """A FLASH_ATTN_EXT node's ``FlashAttnParams(scale, max_bias, logit_softcap, prec)``."""
    return _read(t, FlashAttnParams, Op.FLASH_ATTN_EXT)


def _row_packed(t):
    return t.nb[0] == type_size(t.type)


def flash_attn_ext(q, k, v, mask=None, scale=1.0, max_bias=0.0, logit_softcap=0.0, *, ctx=None):
    """Fused attention (GGML's ``ggml_flash_attn_ext``): ``softmax(scale * q·kᵀ + slope * mask) · v``
    per query and head, without materialising the scores.

    ``q`` F32 [D, n_q, n_head, ne3]; ``k`` F16 or F32 [D, n_kv, n_head_kv, ne3k]; ``v`` of ``k``'s
    type [Dv, n_kv, n_head_kv, ne3k] (not transposed); query head ``h`` reads kv head
    ``h // (n_head / n_head_kv)`` and dim 3 is broadcast the same way (GQA). q, k and v may be
    views with any strides as long as each row (dim 0) is packed. ``mask`` (optional, contiguous)
    is F16 [n_kv, >= n_q, m2, m3]: query ``i`` adds row ``i``, dims 2 and 3 broadcast by modulo as
    in ``soft_max_ext``; -inf cells are skipped. F16 only, as GGML asserts: its kernels read the
    mask as ``ggml_fp16_t``, and GGML's RPC server, which does not check again, would read an F32
    mask's bytes as halves (``soft_max_ext`` takes either; ``cpy`` an F32 mask into an F16 tensor
    for this op). ``slope`` is ALiBi's per-head slope when ``max_bias > 0`` (which needs a mask), else 1. With ``logit_softcap`` != 0 the score becomes
    ``logit_softcap * tanh(score / logit_softcap)`` before the mask is added. A query whose every
    cell is masked gets zeros.

    The result is F32 [Dv, n_head, n_q, ne3]: heads in dim 1, queries in dim 2 (GGML's permuted
    layout, ready to be reshaped to [Dv * n_head, n_q]). Sources: ``[q, k, v, mask]``; op_params:
    ``FlashAttnParams`` (precision ``PREC_DEFAULT``; see ``flash_attn_ext_set_prec``)."""
    name = "flash_attn_ext"
    _need_float(name, q, k, v)
    if q.type != Type.F32:
        _fail(name, "q must be F32", q, k, v, error=TensorTypeError)
    if k.type not in (Type.F16, Type.F32) or v.type != k.type:
        _fail(name, "k must be F16 or F32 and v of k's type", q, k, v, error=TensorTypeError)
    if not (_row_packed(q) and _row_packed(k) and _row_packed(v)):
        _fail(name, "q, k and v rows (dim 0) must be packed", q, k, v)
    if k.ne[0] != q.ne[0]:
        _fail(name, "q and k must have the same head size ne[0]", q, k, v)
    if v.ne[1] != k.ne[1] or v.ne[2] != k.ne[2] or v.ne[3] != k.ne[3]:
        _fail(name, "v must match k in dims 1, 2, 3 (n_kv, n_head_kv, ne3)", q, k, v)
    if q.ne[2] % k.ne[2] or q.ne[3] % k.ne[3]:
        _fail(name, "q's dims 2, 3 (n_head, ne3) must be multiples of k's (GQA broadcast)", q, k, v)
    if mask is not None:
        _need(name, mask)
        if mask.type != Type.F16:
            _fail(name, "mask must be F16 (GGML's contract; cpy an F32 mask into an F16 tensor)", q, k, v, mask,
                  error=TensorTypeError)
        if not mask.is_contiguous():
            _fail(name, "mask must be contiguous", q, k, v, mask)
        if mask.ne[0] != k.ne[1] or mask.ne[1] < q.ne[1]:
            _fail(name, "mask must have ne[0] = n_kv (k.ne[1]) and ne[1] >= n_q (q.ne[1])", q, k, v, mask)
        if q.ne[2] % mask.ne[2] or q.ne[3] % mask.ne[3]:
            _fail(name, "mask dims 2, 3 must divide q's", q, k, v, mask)
    if max_bias > 0 and mask is None:
        _fail(name, "ALiBi (max_bias > 0) needs a mask", q, k, v)
    r = _ctx(ctx, q).new_tensor(Type.F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]))
    return _set(r, Op.FLASH_ATTN_EXT, [q, k, v, mask],
                FlashAttnParams(float(scale), float(max_bias), float(logit_softcap), PREC_DEFAULT))


def flash_attn_ext_set_prec(t, prec):
    """Set a FLASH_ATTN_EXT node's precision (``PREC_DEFAULT`` or ``PREC_F32``) in its
    ``op_params``, as GGML's ``ggml_flash_attn_ext_set_prec``: a hint to backends that would
    otherwise compute in F16 (lazyggml's CPU kernel is float32 either way)."""
    if not isinstance(t, Tensor) or t.op != Op.FLASH_ATTN_EXT:
        raise ValueError(f"flash_attn_ext_set_prec: {getattr(t, 'label', type(t).__name__)} is not a "
                         f"FLASH_ATTN_EXT node")
    p = flash_attn_params(t)
    if prec not in (PREC_DEFAULT, PREC_F32):
        raise ValueError(f"flash_attn_ext_set_prec: precision {prec!r} is neither PREC_DEFAULT (0) nor "
                         f"PREC_F32 (10)")
    t.op_params = tuple(p._replace(prec=int(prec)))


class RopeParams(NamedTuple):
    """ROPE's op_params (GGML's ``ggml_rope_impl``): five ints, then the YaRN floats."""
    n_past: int         # unused, always 0 (GGML keeps the slot)
    n_dims: int
    mode: int
    n_ctx: int          # unused, always 0
    n_ctx_orig: int
    freq_base: float
    freq_scale: float
    ext_factor: float
    attn_factor: float
    beta_fast: float
    beta_slow: float


def rope_params(t):
    """A ROPE node's ``op_params`` as ``RopeParams``."""
    return _read(t, RopeParams, Op.ROPE)


def rope_theta_scale(freq_base, n_dims):
    """GGML's ``theta_scale = powf(freq_base, -2.0f/n_dims)``: pair ``k`` turns by
    ``pos * theta_scale^k``."""
    return powf(freq_base, _F32(-2.0) / _F32(n_dims))


@functools.lru_cache(maxsize=64)
def rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    """GGML's ``ggml_rope_yarn_corr_dims``, in C float as GGML computes it: the first and last dims
    YaRN's ramp corrects, as float32 (tests/test_op_params.py checks it against libggml; a float64
    computation lands on the other side of floor/ceil for some parameters). Cached: the glue asks
    once per launch."""
    def corr_dim(n_rot):   # ggml_rope_yarn_corr_dim
        with np.errstate(divide="ignore", invalid="ignore"):   # n_ctx_orig = 0: -inf, as in C
            return (_F32(n_dims) * logf(_F32(n_ctx_orig) / (_F32(n_rot) * _F32(2) * _F32(math.pi)))
                    / (_F32(2) * logf(freq_base)))
    start = np.floor(corr_dim(beta_fast))
    end = np.ceil(corr_dim(beta_slow))
    # C's MAX(0, start) and MIN(n_dims - 1, end)
    return _F32(0 if 0 > start else start), _F32(n_dims - 1 if n_dims - 1 < end else end)


def _rope_impl(a, b, c, n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
               beta_fast, beta_slow, inplace, ctx):
    _need("rope", b)
    _need_float("rope", a)
    if mode not in (ROPE_TYPE_NORMAL, ROPE_TYPE_NEOX):
        _fail("rope", f"mode {mode} is not supported (0 = normal, 2 = NeoX)", a, b)
    if not b.is_vector() or b.type != Type.I32 or b.ne[0] != a.ne[2]:
        _fail("rope", "positions must be an I32 vector with one entry per a.ne[2]", a, b)
    if n_dims <= 0 or n_dims % 2 or n_dims > a.ne[0]:
        _fail("rope", f"n_dims {n_dims} must be even and at most ne[0]", a, b)
    if c is not None:
        _need("rope", c)
        if c.type != Type.F32 or c.ne[0] < n_dims // 2:
            _fail("rope", "freq factors must be F32 with at least n_dims/2 entries", a, b, c,
                  error=TensorTypeError if c.type != Type.F32 else ShapeError)
    params = RopeParams(n_past=0, n_dims=int(n_dims), mode=int(mode), n_ctx=0,
                        n_ctx_orig=int(n_ctx_orig), freq_base=float(freq_base),
                        freq_scale=float(freq_scale), ext_factor=float(ext_factor),
                        attn_factor=float(attn_factor), beta_fast=float(beta_fast),
                        beta_slow=float(beta_slow))
    return _set(_result(_ctx(ctx, a), a, inplace), Op.ROPE, [a, b, c], params)


def rope_ext(a, b, c, n_dims, mode, n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0,
             attn_factor=1.0, beta_fast=32.0, beta_slow=1.0, *, ctx=None):
    """Rotary position embedding with YaRN scaling. ``a`` [head_dim, n_head, n_tokens, ...],
    ``b`` I32 positions [n_tokens], ``c`` optional F32 frequency factors."""
    return _rope_impl(a, b, c, n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor,
                      attn_factor, beta_fast, beta_slow, False, ctx)


def rope_ext_inplace(a, b, c, n_dims, mode, n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0,
                     ext_factor=0.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0, *, ctx=None):
    """As ``rope_ext``, but written over ``a`` (the result is a view of it)."""
    return _rope_impl(a, b, c, n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor,
                      attn_factor, beta_fast, beta_slow, True, ctx)


def rope(a, b, n_dims, mode, *, ctx=None):
    """``rope_ext`` with no frequency factors and no context scaling: rotates pairs among the first ``n_dims``
    values of each head of ``a`` by angles from the I32 positions ``b``; ``mode`` 0 pairs neighbours,
    ``ROPE_TYPE_NEOX`` pairs i with i + n_dims/2."""
    return rope_ext(a, b, None, n_dims, mode, ctx=ctx)


def rope_inplace(a, b, n_dims, mode, *, ctx=None):
    """As ``rope``, but written over ``a`` (the result is a view of it)."""
    return rope_ext_inplace(a, b, None, n_dims, mode, ctx=ctx)


class GluParams(NamedTuple):
    """GLU's ``op_params``: which gated unit (a ``GluOp``), and whether the gate comes first."""
    op: GluOp
    swapped: bool   # the gate is the first half of the row (one-tensor form only)


def glu_params(t):
    """A GLU node's ``GluParams(op, swapped)``, ``op`` as a ``GluOp``."""
    op, swapped = _read(t, GluParams, Op.GLU)
    return GluParams(GluOp(op), bool(swapped))


def _glu_impl(a, b, gop, swapped, ctx):
    name = gop.name.lower()
    _need_float(name, a)
    if not a.is_contiguous_1():
        _fail(name, "input must be contiguous along its rows", a)
    if b is None:
        if a.ne[0] % 2:
            _fail(name, "ne[0] must be even (two halves: value and gate)", a)
        ne = (a.ne[0] // 2,) + a.ne[1:]
    else:
        _need(name, b)
        if not b.is_contiguous_1() or b.ne != a.ne or b.type != a.type:
            _fail(name, "a and b must have the same type and shape", a, b)
        ne = a.ne
    return _set(_ctx(ctx, a).new_tensor(a.type, ne), Op.GLU, [a, b], GluParams(gop, bool(swapped)))


def swiglu(a, *, ctx=None):
    """``silu(x) * g`` where ``x`` and ``g`` are the first and second halves of each row."""
    return _glu_impl(a, None, GluOp.SWIGLU, False, ctx)


def swiglu_swapped(a, *, ctx=None):
    """As ``swiglu``, but the gate ``g`` is the first half of each row and ``x`` the second."""
    return _glu_impl(a, None, GluOp.SWIGLU, True, ctx)


def swiglu_split(a, b, *, ctx=None):
    """``silu(a) * b``."""
    return _glu_impl(a, b, GluOp.SWIGLU, False, ctx)


def geglu(a, *, ctx=None):
    """``gelu(x) * g`` where ``x`` and ``g`` are the first and second halves of each row: ne0 is halved."""
    return _glu_impl(a, None, GluOp.GEGLU, False, ctx)


def geglu_split(a, b, *, ctx=None):
    """``gelu(a) * b``, for ``a`` and ``b`` of one type and shape."""
    return _glu_impl(a, b, GluOp.GEGLU, False, ctx)


def reglu(a, *, ctx=None):
    """``relu(x) * g`` where ``x`` and ``g`` are the first and second halves of each row: ne0 is halved."""
    return _glu_impl(a, None, GluOp.REGLU, False, ctx)


def reglu_split(a, b, *, ctx=None):
    """``relu(a) * b``, for ``a`` and ``b`` of one type and shape."""
    return _glu_impl(a, b, GluOp.REGLU, False, ctx)


class PadParams(NamedTuple):
    """PAD's ``op_params``: zeros added before (``lpN``) and after (``rpN``) each dim N."""
    lp0: int
    rp0: int
    lp1: int
    rp1: int
    lp2: int
    rp2: int
    lp3: int
    rp3: int


def pad_params(t):
    """A PAD node's paddings, left and right per dim, as ``PadParams``."""
    return _read(t, PadParams, Op.PAD)


def pad_ext(a, lp0, rp0, lp1=0, rp1=0, lp2=0, rp2=0, lp3=0, rp3=0, *, ctx=None):
    """Zero-pad each dim on the left (``lpN``) and right (``rpN``)."""
    _need("pad", a)
    p = PadParams(lp0, rp0, lp1, rp1, lp2, rp2, lp3, rp3)
    if any(not isinstance(x, int) or x < 0 for x in p):
        _fail("pad", f"paddings must be non-negative ints, got {list(p)}", a)
    ne = tuple(a.ne[i] + p[2 * i] + p[2 * i + 1] for i in range(MAX_DIMS))
    return _set(_ctx(ctx, a).new_tensor(a.type, ne), Op.PAD, [a], p)


def pad(a, p0, p1=0, p2=0, p3=0, *, ctx=None):
    """Zero-pad each dim at its end."""
    return pad_ext(a, 0, p0, 0, p1, 0, p2, 0, p3, ctx=ctx)


# -- views (no data movement) ---------------------------------------------------------------------
def reshape(a, b, *, ctx=None):
    """A view of contiguous ``a`` with ``b``'s shape."""
    _need("reshape", a, b)
    return _reshape(a, b.ne, ctx)


def _reshape(a, ne, ctx):
    if not a.is_contiguous():
        _fail("reshape", "input must be contiguous (use cont first)", a)
    ne = tuple(ne) + (1,) * (MAX_DIMS - len(ne))
    if a.nelements() != ne[0] * ne[1] * ne[2] * ne[3]:
        _fail("reshape", f"cannot view {a.nelements()} elements as {list(ne)}", a)
    r = _ctx(ctx, a)._new(a.type, ne, view_src=a, view_offs=0, what="reshape")
    r.name = f"{a.name} (reshaped)"
    return _set(r, Op.RESHAPE, [a])


def reshape_1d(a, ne0, *, ctx=None):
    """A view of the contiguous ``a`` with the shape [ne0] (the element count must match)."""
    return _reshape(a, (ne0,), ctx)


def reshape_2d(a, ne0, ne1, *, ctx=None):
    """A view of the contiguous ``a`` with the shape [ne0, ne1] (the element count must match)."""
    return _reshape(a, (ne0, ne1), ctx)


def reshape_3d(a, ne0, ne1, ne2, *, ctx=None):
    """A view of the contiguous ``a`` with the shape [ne0, ne1, ne2] (the element count must match)."""
    return _reshape(a, (ne0, ne1, ne2), ctx)


def reshape_4d(a, ne0, ne1, ne2, ne3, *, ctx=None):
    """A view of the contiguous ``a`` with the shape [ne0, ne1, ne2, ne3] (the element count must match)."""
    return _reshape(a, (ne0, ne1, ne2, ne3), ctx)


class ViewParams(NamedTuple):
    """VIEW's ``op_params``: where the view starts in its source."""
    offset: int   # bytes into the source's data


def view_offset(t):
    """A VIEW node's offset, in bytes, into its source's data."""
    return _read(t, ViewParams, Op.VIEW).offset


def _view(a, ne, nb, offset, ctx):
    _need("view", a)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        _fail("view", f"offset must be a non-negative int, got {offset!r}", a)
    ne = tuple(ne) + (1,) * (MAX_DIMS - len(ne))
    r = _ctx(ctx, a)._new(a.type, ne, nb, view_src=a, view_offs=offset, what="view")
    r.name = f"{a.name} (view)"
    return _set(r, Op.VIEW, [a], ViewParams(offset))


def view_1d(a, ne0, offset=0, *, ctx=None):
    """A view of ``ne0`` consecutive elements of ``a``, starting ``offset`` bytes into its data."""
    return _view(a, (ne0,), None, offset, ctx)


def view_2d(a, ne0, ne1, nb1, offset=0, *, ctx=None):
    """A view of ``a`` as ``ne1`` rows of ``ne0`` elements, rows ``nb1`` bytes apart, starting ``offset``
    bytes into its data."""
    nb0 = type_size(a.type)
    return _view(a, (ne0, ne1), (nb0, nb1, nb1 * ne1, nb1 * ne1), offset, ctx)


def view_3d(a, ne0, ne1, ne2, nb1, nb2, offset=0, *, ctx=None):
    """A view of ``a`` with the shape [ne0, ne1, ne2] and the byte strides ``nb1``, ``nb2``, starting
    ``offset`` bytes into its data."""
    nb0 = type_size(a.type)
    return _view(a, (ne0, ne1, ne2), (nb0, nb1, nb2, nb2 * ne2), offset, ctx)


def view_4d(a, ne0, ne1, ne2, ne3, nb1, nb2, nb3, offset=0, *, ctx=None):
    """A view of ``a`` with the shape [ne0, ne1, ne2, ne3] and the byte strides ``nb1``, ``nb2``, ``nb3``,
    starting ``offset`` bytes into its data."""
    return _view(a, (ne0, ne1, ne2, ne3), (type_size(a.type), nb1, nb2, nb3), offset, ctx)


class PermuteParams(NamedTuple):
    """PERMUTE's and TRANSPOSE's ``op_params``: the result dim that each source dim became."""
    axis0: int
    axis1: int
    axis2: int
    axis3: int


def permute_axes(t):
    """Where each dim of the source went, for a PERMUTE or TRANSPOSE node."""
    return _read(t, PermuteParams, Op.PERMUTE, Op.TRANSPOSE)


def permute(a, axis0, axis1, axis2=2, axis3=3, *, ctx=None):
    """Dim ``i`` of ``a`` becomes dim ``axis_i`` of the result (GGML's convention)."""
    _need("permute", a)
    axes = PermuteParams(axis0, axis1, axis2, axis3)
    if sorted(axes) != [0, 1, 2, 3]:
        _fail("permute", f"axes {list(axes)} must be a permutation of 0..3", a)
    ne, nb = [0] * 4, [0] * 4
    for i, ax in enumerate(axes):
        ne[ax], nb[ax] = a.ne[i], a.nb[i]
    r = _ctx(ctx, a).view_tensor(a, tuple(ne), tuple(nb), what="permute")
    r.name = f"{a.name} (permuted)"
    return _set(r, Op.PERMUTE, [a], axes)


def transpose(a, *, ctx=None):
    """Swap dims 0 and 1 (a view)."""
    _need("transpose", a)
    ne = (a.ne[1], a.ne[0]) + a.ne[2:]
    nb = (a.nb[1], a.nb[0]) + a.nb[2:]
    r = _ctx(ctx, a).view_tensor(a, ne, nb, what="transpose")
    r.name = f"{a.name} (transposed)"
    return _set(r, Op.TRANSPOSE, [a], PermuteParams(1, 0, 2, 3))


# -- every op's facts, one row each --------------------------------------------------------------------
class OpDef(NamedTuple):
    """What lazyggml knows of an op beside its constructor, in one row (GGML keeps these in several
    tables: its enum's numbering, ``ggml_is_view_op``, ``ggml_op_can_inplace``, the RPC server's
    deserializer). Adding an op is its ``Op`` member, its constructor above and its row here."""
    ggml_id: int                 # its number in GGML's enum ggml_op (ggml.h, GGML_OP_COUNT = 101): the RPC wire's
    params: type = None          # its op_params, typed: the NamedTuple above (GGML's order); None when it has none
    rebuild: object = None       # (sources, params, t) -> the node made again by its constructor, whose
    #                              checks are GGML's (the RPC ends check every computed node so); None: not computed
    inplace: bool = False        # its constructor has an ``_inplace`` twin: the result may be a view of source 0
    can_inplace: bool = False    # the allocator may give its result a free source's memory (ggml_op_can_inplace,
    #                              docs/graph-alloc-sched.md §3)
    view: bool = False           # its result is a view of its source (ggml_is_view_op): nothing computes it


def _rebuild_flash_attn(s, p, t):
    r = flash_attn_ext(s[0], s[1], s[2], s[3], p[0], p[1], p[2])
    flash_attn_ext_set_prec(r, p[3])
    return r


# ``rebuild``'s sources ``s`` are in GGML's slots, its params ``p`` a tuple in GGML's order, and ``t``
# the tensor as described (CONT and REPEAT take their result shape from it).
OP_DEFS = {
    Op.NONE: OpDef(0),
    Op.DUP: OpDef(1, rebuild=lambda s, p, t: dup(s[0]), inplace=True),
    Op.ADD: OpDef(2, rebuild=lambda s, p, t: add(s[0], s[1]), inplace=True, can_inplace=True),
    Op.ADD1: OpDef(4, rebuild=lambda s, p, t: add1(s[0], s[1]), inplace=True, can_inplace=True),
    Op.SUB: OpDef(6, rebuild=lambda s, p, t: sub(s[0], s[1]), inplace=True, can_inplace=True),
    Op.MUL: OpDef(7, rebuild=lambda s, p, t: mul(s[0], s[1]), inplace=True, can_inplace=True),
    Op.DIV: OpDef(8, rebuild=lambda s, p, t: div(s[0], s[1]), inplace=True, can_inplace=True),
    Op.SQR: OpDef(9, rebuild=lambda s, p, t: sqr(s[0]), inplace=True, can_inplace=True),
    Op.SQRT: OpDef(10, rebuild=lambda s, p, t: sqrt(s[0]), inplace=True, can_inplace=True),
    Op.LOG: OpDef(11, rebuild=lambda s, p, t: log(s[0]), inplace=True, can_inplace=True),
    Op.SIN: OpDef(12, rebuild=lambda s, p, t: sin(s[0]), inplace=True),
    Op.COS: OpDef(13, rebuild=lambda s, p, t: cos(s[0]), inplace=True),
    Op.SUM: OpDef(14, rebuild=lambda s, p, t: sum(s[0])),
    Op.SUM_ROWS: OpDef(15, rebuild=lambda s, p, t: sum_rows(s[0])),
    Op.MEAN: OpDef(17, rebuild=lambda s, p, t: mean(s[0])),
    Op.ARGMAX: OpDef(18, rebuild=lambda s, p, t: argmax(s[0])),
    Op.REPEAT: OpDef(20, rebuild=lambda s, p, t: repeat(s[0], t)),
    Op.CONCAT: OpDef(22, ConcatParams, lambda s, p, t: concat(s[0], s[1], p[0])),
    Op.NORM: OpDef(24, NormParams, lambda s, p, t: norm(s[0], p[0]), inplace=True),
    Op.RMS_NORM: OpDef(25, NormParams, lambda s, p, t: rms_norm(s[0], p[0]), inplace=True, can_inplace=True),
    Op.MUL_MAT: OpDef(29, rebuild=lambda s, p, t: mul_mat(s[0], s[1])),
    Op.MUL_MAT_ID: OpDef(30, rebuild=lambda s, p, t: mul_mat_id(s[0], s[1], s[2])),
    Op.SCALE: OpDef(32, ScaleParams, lambda s, p, t: scale_bias(s[0], p[0], p[1]), inplace=True, can_inplace=True),
    Op.CPY: OpDef(34, rebuild=lambda s, p, t: cpy(s[0], s[1])),
    Op.CONT: OpDef(35, rebuild=lambda s, p, t: cont_4d(s[0], *t.ne)),
    Op.RESHAPE: OpDef(36, view=True),
    Op.VIEW: OpDef(37, ViewParams, view=True),
    Op.PERMUTE: OpDef(38, PermuteParams, view=True),
    Op.TRANSPOSE: OpDef(39, PermuteParams, view=True),
    Op.GET_ROWS: OpDef(40, rebuild=lambda s, p, t: get_rows(s[0], s[1])),
    # GGML's slots: rows, indices, destination
    Op.SET_ROWS: OpDef(42, rebuild=lambda s, p, t: set_rows(s[2], s[0], s[1])),
    Op.DIAG_MASK_INF: OpDef(44, DiagMaskParams, lambda s, p, t: diag_mask_inf(s[0], p[0]), inplace=True,
                            can_inplace=True),
    Op.SOFT_MAX: OpDef(46, SoftMaxParams, lambda s, p, t: soft_max_ext(s[0], s[1], p[0], p[1]), inplace=True,
                       can_inplace=True),
    # p[0] and p[3] are unused slots of GGML's
    Op.ROPE: OpDef(48, RopeParams, lambda s, p, t: rope_ext(s[0], s[1], s[2], p[1], p[2], p[4], *p[5:]),
                   inplace=True, can_inplace=True),
    Op.CLAMP: OpDef(50, ClampParams, lambda s, p, t: clamp(s[0], p[0], p[1])),
    Op.PAD: OpDef(64, PadParams, lambda s, p, t: pad_ext(s[0], *p)),
    Op.ARGSORT: OpDef(69, SortParams, lambda s, p, t: argsort(s[0], p[0])),
    Op.FLASH_ATTN_EXT: OpDef(74, FlashAttnParams, _rebuild_flash_attn),
    Op.UNARY: OpDef(91, UnaryParams, lambda s, p, t: unary(s[0], p[0]), inplace=True, can_inplace=True),
    # GGML's ggml_glu_impl: the public wrappers (swiglu, geglu_split, ...) name only some pairs
    Op.GLU: OpDef(100, GluParams, lambda s, p, t: _glu_impl(s[0], s[1], GluOp(p[0]), p[1], None)),
}
assert set(OP_DEFS) == set(Op), "every Op needs its OpDef"
assert all((d.rebuild is None) == (d.view or op == Op.NONE) for op, d in OP_DEFS.items()), \
    "every computed op needs its rebuild"

#: the scheduler's view ops (ggml_is_view_op) and the CPU backend's no-op list (ggml_op_is_empty)
VIEW_OPS = frozenset(op for op, d in OP_DEFS.items() if d.view)
EMPTY_OPS = VIEW_OPS | {Op.NONE}
#: ops whose result may take over the memory of a source (ggml_op_can_inplace)
INPLACE_OPS = frozenset(op for op, d in OP_DEFS.items() if d.can_inplace)
#: each op's op_params type (an op not here has none)
OP_PARAMS = {op: d.params for op, d in OP_DEFS.items() if d.params is not None}


# -- operator sugar on Tensor: thin wrappers over the constructors above (tensor.py sits below ops) --
def _tensor_mul(a, o):
    return scale(a, float(o)) if isinstance(o, (int, float)) else mul(a, o)


def _tensor_truediv(a, o):
    return scale(a, 1.0 / float(o)) if isinstance(o, (int, float)) else div(a, o)


def _tensor_matmul(a, o):
    """``w @ x`` is ``mul_mat(w, x)``: GGML's (rows of w) · (columns of x)."""
    return mul_mat(a, o)


Tensor.__add__ = lambda a, o: add(a, o)
Tensor.__sub__ = lambda a, o: sub(a, o)
Tensor.__mul__ = _tensor_mul
Tensor.__truediv__ = _tensor_truediv
Tensor.__neg__ = lambda a: neg(a)
Tensor.__matmul__ = _tensor_matmul
