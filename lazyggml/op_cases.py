"""The op-case catalogue: every op configuration lazyggml checks, warms up and reports, declared once.

``CASES`` is a table of small graphs in the style of GGML's test-backend-ops: each op on
contiguous tensors, with broadcasting, on strided and permuted views, in place, over every tensor
type it accepts (``mul_mat``, ``get_rows``, ``set_rows`` and ``cpy`` over every weight type), at
sizes that take the CPU's threaded paths as well as its single-threaded ones, an attention
block shaped like the model runner's, and fused attention (``flash_attn_ext``: GQA, masks with -inf
cells, ALiBi, soft cap, K/V as views of a cache). Three readers share it:

* ``tests/test_backend_ops.py`` runs every case on the CPU (``run_case``) and compares it with its
  float64 NumPy oracle; ``tests/test_opencl.py`` and ``tests/test_cuda.py`` run it on their backends
  (the CUDA simulator ``LIGHT_CASES``: all but the products and the flash attention over hundreds of
  KV cells);
* ``lazyggml warmup`` (``warmup.py``) runs every case through ``run_case`` to compile the kernel
  signatures real graphs need; ``--cases`` picks cases by name, ``--types`` by the types they
  exercise, ``--jobs`` hands out families;
* ``lazyggml info`` asks each device whether it supports the first case of each op.

A case
------
``case(name, family, inputs, op, ref)``: ``inputs`` lists the leaf tensors as (type, ne);
``op(*leafs)`` builds the output (views, permutes and extra tensors made inside it, with ``new``).
It may return several tensors: they are computed in that order and the last is the result, the
others are writes it depends on (a KV cache filled by ``set_rows`` before attention reads it).
``ref(*values)`` is the oracle. It gets each input's *values* as a 4-D float64 array in NumPy order
(``reversed(ne)``; indices as int64; quantized inputs dequantized) and returns the expected values
of the result in the same layout. Results stored as F16 / BF16 are compared with the oracle
rounded to that type (``q_round``), as the kernel must round too; quantized results are rounded by
the case's oracle (re-quantizing already quantized values is not the identity, so only the oracle
knows which values were written). ``family`` groups the cases that share kernels (a warm-up worker
takes a family). ``types``, the tensor types a case exercises (what ``warmup --types`` selects
by), are by default those in its graph other than F32 and the index types, so that float32 cases
are always warmed; the cases over every weight type declare their weight type, F32 included.

Checking a case
---------------
``run_case(case, backend)`` fills the inputs with uniform [-1, 1] data (or what the case's ``fill``
asks for: positive values, indices), computes on the backend and compares with the oracle by
GGML's normalized mean squared error ``sum((a - b)^2) / sum(b^2) <= max_nmse`` (1e-7; 5e-4 for
products, as GGML's test_mul_mat: the CPU rounds activations to the weights' dot-product type, and
for flash attention over F16 K/V, as GGML's test_flash_attn_ext),
after checking that NaN and Inf agree and that no input was written other than the outputs' own
memory. The seed is random per process unless ``LAZYGGML_TEST_SEED`` is set; a failure prints it.

The oracles and their helpers (``np_permute``, ``rope_ref``, ``soft_max_ref``, ``q_round``...) are
independent float64 NumPy code: they follow GGML's definitions, never lazyggml's kernels.

Row indices out of range
------------------------
No case has one: the CPU raises ``IndexError`` for it. ``run_rows_out_of_range(backend, op, type,
index type)`` checks what the GPU backends do instead (``ops.get_rows``, ``ops.set_rows``): good
rows right, GET_ROWS' other rows zeros, no byte written that a good index does not name.
"""
from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import debug, ops, quants
from .alloc import Gallocr, alloc_ctx_tensors
from .backend import backend_graph_compute, tensor_get, tensor_get_bytes, tensor_set
from .backends.cpu import CPUBackend, backend_cpu_init
from .graph import Graph
from .tensor import Context, current_context, set_input, set_output
from .types import QK_K, WEIGHT_TYPES, Type, blck_size, is_quantized, type_name

F32, F16, BF16, I32, I64 = Type.F32, Type.F16, Type.BF16, Type.I32, Type.I64
Q4_0, Q8_0, Q4_K = Type.Q4_0, Type.Q8_0, Type.Q4_K
NEOX = ops.ROPE_TYPE_NEOX
MAX_NMSE = 1e-7
MUL_MAT_NMSE = 5e-4   # GGML's test_mul_mat::max_nmse_err
FLASH_ATTN_NMSE = 5e-4   # GGML's test_flash_attn_ext::max_nmse_err, for F16 K/V (F16 dot products, F16 sums)
# A write into Q8_0 (cpy, set_rows) is checked against the reference quantizer, which scales by
# 1/(amax/127) and rounds half away from zero; GGML's CPU from_float scales by 127/amax and rounds half
# to even, so a value within a last bit of a half step lands one step apart: ~1e-6 in a 192-value tensor.
# Bits are checked against libggml itself in tests/test_backend_ops.py (test_parity_with_libggml).
Q8_WRITE_NMSE = 5e-6
_SEED = debug.value("LAZYGGML_TEST_SEED")
SEED = int(_SEED) if _SEED is not None else random.randrange(2**31)



# =================================================================================================
# The table
# =================================================================================================
@dataclass
class Case:
    name: str
    family: str            # the cases sharing kernels (a warm-up --jobs worker takes a family)
    inputs: list           # [(type, ne), ...]: the leafs that run_case fills
    op: Callable           # (*leafs) -> result, or (writes..., result)
    ref: Callable          # (*input values) -> expected values of the result
    fill: dict = field(default_factory=dict)   # input index -> (rng, numpy shape) -> values
    max_nmse: float = MAX_NMSE
    types: tuple = None    # the tensor types it exercises (warmup --types); () = float32 only

    def __post_init__(self):
        if self.types is None:  # by default every type in the graph but F32 and the index types
            ctx = Context()
            self.build(ctx)
            self.types = tuple(sorted({t.type for t in ctx.tensors()} - {F32, I32, I64}))

    def build(self, ctx):
        """(inputs, outputs) built in ``ctx``; the last output is the result."""
        with ctx:
            leafs = [ctx.new_tensor(t, ne) for t, ne in self.inputs]
            outs = self.op(*leafs)
        return leafs, list(outs) if isinstance(outs, (list, tuple)) else [outs]

    def __repr__(self):
        return self.name


CASES: list[Case] = []


def case(name, family, inputs, op, ref, fill=None, max_nmse=MAX_NMSE, types=None):
    """Add a case to ``CASES`` (the module docstring describes the arguments)."""
    CASES.append(Case(name, family, inputs, op, ref, fill or {}, max_nmse, types))


def new(type_, *ne):
    """A tensor in the context the case is being built in (a cpy destination, a repeat shape)."""
    return current_context().new_tensor(type_, ne)


def f32(*ne):
    return (F32, ne)


# fills
def positive(rng, shape):
    return rng.uniform(0.1, 2.0, shape)


def uniform_in(lo, hi):
    return lambda rng, shape: rng.uniform(lo, hi, shape)


def indices(n):
    return lambda rng, shape: rng.integers(0, n, shape)


def distinct_indices(n):
    """Per (i3, i2) a sample of distinct row numbers (SET_ROWS with repeats is a race)."""
    def fill(rng, shape):
        out = np.empty(shape, np.int64)
        for ix in np.ndindex(*shape[:-1]):
            out[ix] = rng.permutation(n)[:shape[-1]]
        return out
    return fill


# -- NumPy helpers for the oracles ---------------------------------------------------------------
def np_permute(x, *axes):
    """GGML's permute on a NumPy-order 4-D array: GGML dim i goes to dim axes[i]."""
    perm = [0] * 4
    for i, ax in enumerate(axes):
        perm[3 - ax] = 3 - i
    return np.transpose(x, perm)


def np_transpose(x):
    return np.swapaxes(x, 2, 3)


def tile_to(b, shape):
    """GGML's repeat: ``b`` tiled to ``shape``."""
    return np.tile(b, [s // t for s, t in zip(shape, b.shape)])


def to_bf16_bits(x):
    """float -> bf16 bits, round to nearest even (GGML's ggml_compute_fp32_to_bf16, finite x)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b):
    return (np.asarray(b).astype(np.uint32) << 16).view(np.float32)


def write_nmse(type_):
    """The tolerance of a write into ``type_`` checked against ``q_round`` (see Q8_WRITE_NMSE)."""
    return Q8_WRITE_NMSE if type_ == Q8_0 else MAX_NMSE


def q_round(type_, x):
    """Values after a trip through ``type_`` (F16, BF16 or quantized rows; F32 rounding too)."""
    x = np.asarray(x, np.float64)
    if type_ == F32:
        return x.astype(np.float32).astype(np.float64)
    if type_ == F16:
        return x.astype(np.float32).astype(np.float16).astype(np.float64)
    if type_ == BF16:
        return from_bf16_bits(to_bf16_bits(x)).astype(np.float64)
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    back = quants.dequantize(type_, quants.quantize(type_, rows), x.shape[-1])
    return back.reshape(x.shape).astype(np.float64)


# =================================================================================================
# Running a case
# =================================================================================================
def _encode(t, values):
    """Values (NumPy order) -> the bytes of tensor t."""
    if t.type == F32:
        return values.astype(np.float32)
    if t.type == F16:
        return values.astype(np.float16)
    if t.type == BF16:
        return to_bf16_bits(values)
    if t.type in (I32, I64):
        return values.astype(np.int32 if t.type == I32 else np.int64)
    if is_quantized(t.type):
        return quants.quantize(t.type, values.reshape(-1, t.ne[0]).astype(np.float32))
    raise ValueError(f"no encoder for {type_name(t.type)}")


def decode(t, raw):
    """tensor_get's array -> values: float64, int64 for indices, quantized rows dequantized."""
    if t.type == BF16:
        return from_bf16_bits(raw).astype(np.float64)
    if t.type in (I32, I64):
        return raw.astype(np.int64)
    if is_quantized(t.type):
        rows = quants.dequantize(t.type, np.ascontiguousarray(raw).reshape(-1, raw.shape[-1]), t.ne[0])
        return rows.reshape(tuple(reversed(t.ne))).astype(np.float64)
    return raw.astype(np.float64)


def nmse(got, ref):
    """GGML's normalized mean squared error over the finite entries."""
    m = np.isfinite(ref)
    den = np.sum(ref[m] ** 2)
    err = np.sum((got[m] - ref[m]) ** 2)
    return err / den if den > 0 else err


def compare(got, ref, max_nmse):
    """None when they agree, else a message (shape, NaN/Inf agreement, then NMSE)."""
    if got.shape != ref.shape:
        return f"shape {got.shape} != expected {ref.shape}"
    if not np.array_equal(np.isnan(got), np.isnan(ref)):
        return f"NaN mismatch at {np.argwhere(np.isnan(got) != np.isnan(ref))[:5].tolist()}"
    inf_g, inf_r = np.isinf(got), np.isinf(ref)
    if not np.array_equal(inf_g, inf_r) or not np.array_equal(got[inf_g], ref[inf_r]):
        return "Inf mismatch"
    e = nmse(got, ref)
    return None if e <= max_nmse else f"NMSE {e:.3e} > {max_nmse:.1e}"


def run_case(case, backend=None, seed=None, gallocr=False):
    """Build, fill, compute on ``backend`` (default: CPU) and compare with the oracle.

    Returns ``"ok"``, ``"unsupported"`` (the backend rejects a node, as GGML's test skips it) or
    raises AssertionError with the seed. On the CPU backend the graph is built in a context with
    host memory; another backend gets a ``no_alloc`` context allocated with ``alloc_ctx_tensors``.
    With ``gallocr`` the inputs are INPUT, the outputs OUTPUT, and ``Gallocr`` plans every tensor's
    memory (reusing it by lifetime and in place), as a real graph runs.
    """
    backend = backend or backend_cpu_init()
    seed = SEED if seed is None else seed
    rng = np.random.default_rng(seed + zlib.crc32(case.name.encode()))
    on_host = isinstance(backend, CPUBackend) and not gallocr
    ctx = Context(no_alloc=not on_host)
    inputs, outs = case.build(ctx)
    out = outs[-1]
    if gallocr:
        for t in inputs:
            set_input(t)
        for t in outs:
            set_output(t)
    g = Graph()
    for t in outs:
        g.build_forward_expand(t)
    if not all(backend.device.supports_op(n) for n in g.nodes):
        return "unsupported"
    if gallocr:
        assert Gallocr(backend.get_default_buffer_type()).alloc_graph(g)
    elif not on_host:
        alloc_ctx_tensors(ctx, backend)
    values, before = [], []
    for i, t in enumerate(inputs):
        shape = tuple(reversed(t.ne))
        gen = case.fill.get(i)
        tensor_set(t, _encode(t, np.asarray(gen(rng, shape) if gen else rng.uniform(-1.0, 1.0, shape))))
        before.append(tensor_get_bytes(t))
        values.append(decode(t, tensor_get(t)))  # what the kernel will see, before any in-place write
    backend_graph_compute(backend, g)   # compute and wait, as ggml_backend_graph_compute
    for t, raw in zip(inputs, before):  # GGML's sentinel idea: nothing but the outputs is written
        written = any(t is o or t is o.view_src for o in outs)
        if not written and not gallocr:  # (the planner may reuse inputs)
            assert np.array_equal(tensor_get_bytes(t), raw), f"{case.name}: input {t.name} was modified"
    got = decode(out, tensor_get(out))
    ref = np.asarray(case.ref(*values), np.float64)
    if out.type in (F16, BF16):
        ref = q_round(out.type, ref)
    if out.type in (I32, I64):
        msg = None if np.array_equal(got, ref) else f"{got.ravel()[:8]} != {ref.ravel()[:8]}"
    else:
        msg = compare(got, ref, case.max_nmse)
    assert msg is None, f"{case.name}: {msg} (seed {seed}: LAZYGGML_TEST_SEED={seed})"
    return "ok"


# =================================================================================================
# The cases
# =================================================================================================

# -- binary ops with broadcasting (b smaller than a in each dim), views, in place ----------------
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
_A = (10, 5, 4, 3)
for _name, _f in _BINARY.items():
    _op, _op_inplace = getattr(ops, _name), getattr(ops, _name + "_inplace")
    _fill = {1: uniform_in(0.5, 1.5)} if _name == "div" else None   # no division by ~0
    for _b in [_A, (1, 1, 1, 1), (10, 1, 1, 1), (10, 5, 1, 1), (10, 1, 4, 1), (10, 5, 4, 1), (5, 5, 2, 3),
               (2, 1, 1, 3)]:
        case(_name if _b == _A else f"{_name}(broadcast b{list(_b)})", "binary", [f32(*_A), f32(*_b)], _op,
             lambda a, b, f=_f: f(a, tile_to(b, a.shape)), _fill)
    case(f"{_name}_inplace", "binary", [f32(16, 3, 2), f32(16, 1, 2)], _op_inplace,
         lambda a, b, f=_f: f(a, tile_to(b, a.shape)), _fill)
    case(f"{_name}(permuted a, transposed b)", "binary", [f32(6, 5, 4, 2), f32(6, 5, 4, 1)],
         lambda a, b, op=_op: op(ops.permute(a, 1, 0, 2, 3), ops.transpose(b)),
         lambda a, b, f=_f: f(np_permute(a, 1, 0, 2, 3), tile_to(np_transpose(b), (2, 4, 6, 5))), _fill)
case("add(view with row gaps)", "binary", [f32(12, 6, 2), f32(8, 1, 2)],
     lambda a, b: ops.add(ops.view_3d(a, 8, 6, 2, a.nb[1], a.nb[2], 2 * 4), b),
     lambda a, b: a[..., 2:10] + tile_to(b, (1, 2, 6, 8)))
case("add(large)", "binary", [f32(4096, 16), f32(4096, 16)], ops.add, np.add)   # the threaded path
case("add1", "binary", [f32(9, 4, 3), f32(1)], ops.add1, lambda a, b: a + b.reshape(()))
case("add1_inplace", "binary", [f32(9, 4, 3), f32(1)], ops.add1_inplace, lambda a, b: a + b.reshape(()))

# -- element-wise unary ops ------------------------------------------------------------------------
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_erf = np.vectorize(math.erf)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _hardsigmoid(x):
    return np.clip((x + 3) / 6, 0, 1)


UNARY_REFS = {
    "abs": np.abs, "sgn": np.sign, "neg": np.negative, "step": lambda x: (x > 0).astype(np.float64),
    "tanh": np.tanh, "elu": lambda x: np.where(x > 0, x, np.expm1(x)), "relu": lambda x: np.maximum(x, 0),
    "sigmoid": _sigmoid,
    "gelu": lambda x: 0.5 * x * (1 + np.tanh(_SQRT_2_OVER_PI * x * (1 + 0.044715 * x * x))),
    "gelu_erf": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2.0))),
    "gelu_quick": lambda x: x * _sigmoid(1.702 * x), "silu": lambda x: x * _sigmoid(x),
    "hardswish": lambda x: x * _hardsigmoid(x), "hardsigmoid": _hardsigmoid,
    "exp": np.exp, "sqr": np.square, "sqrt": np.sqrt, "log": np.log, "sin": np.sin, "cos": np.cos,
}
#: GGML's CPU reads GELU and GELU_QUICK from tables of fp16 values (backends/cpu/elementwise.py):
#: input and result rounded to fp16 put them up to 1.8e-7 (NMSE, 80 values in [-4, 4], worst of
#: 3,000 draws) off the float64 formula, which the other backends compute
FP16_TABLE_NMSE = 1e-6
_TABLED = ("gelu", "gelu_quick", "geglu")

for _name, _f in UNARY_REFS.items():
    _op = getattr(ops, _name)
    _tol = FP16_TABLE_NMSE if _name in _TABLED else MAX_NMSE
    if _name in ("sqrt", "log"):
        _fill = {0: positive}
    elif _name in ("exp", "sqr", "sin", "cos"):
        _fill = None
    else:
        _fill = {0: uniform_in(-4, 4)}   # the activations are interesting over [-4, 4]
    case(_name, "unary", [f32(33, 4, 3, 2)], _op, _f, _fill, max_nmse=_tol)
    case(f"{_name}(view with row gaps)", "unary", [f32(40, 6, 3)],                # contiguous_1 rows
         lambda a, op=_op: op(ops.view_3d(a, 30, 6, 3, a.nb[1], a.nb[2], 5 * 4)),
         lambda a, f=_f: f(a[..., 5:35]), _fill, max_nmse=_tol)
    if hasattr(ops, _name + "_inplace"):
        case(f"{_name}_inplace", "unary", [f32(16, 5)], getattr(ops, _name + "_inplace"), _f, _fill, max_nmse=_tol)
    if _name in ("sqr", "sqrt", "log", "sin", "cos"):                        # plain ops: any strides
        case(f"{_name}(transposed)", "unary", [f32(7, 9, 3)], lambda a, op=_op: op(ops.transpose(a)),
             lambda a, f=_f: f(np_transpose(a)), _fill)
case("silu(large)", "unary", [f32(4096, 16)], ops.silu, UNARY_REFS["silu"])    # the threaded path
case("scale", "unary", [f32(20, 3, 2)], lambda a: ops.scale(a, 2.5), lambda a: 2.5 * a)
case("scale_bias", "unary", [f32(20, 3, 2)], lambda a: ops.scale_bias(a, -0.5, 0.25), lambda a: -0.5 * a + 0.25)
case("scale_inplace", "unary", [f32(20, 3)], lambda a: ops.scale_inplace(a, 3.0), lambda a: 3 * a)
case("clamp", "unary", [f32(20, 3, 2)], lambda a: ops.clamp(a, -0.3, 0.6), lambda a: np.clip(a, -0.3, 0.6))

# -- GLU: halves and split forms, swapped ----------------------------------------------------------
_GLU = {"swiglu": UNARY_REFS["silu"], "geglu": UNARY_REFS["gelu"], "reglu": UNARY_REFS["relu"]}
for _name, _f in _GLU.items():
    _tol = FP16_TABLE_NMSE if _name in _TABLED else MAX_NMSE
    case(_name, "glu", [f32(24, 5, 3)], getattr(ops, _name), lambda a, f=_f: f(a[..., :12]) * a[..., 12:],
         {0: uniform_in(-4, 4)}, max_nmse=_tol)
    case(f"{_name}_split", "glu", [f32(17, 5, 3), f32(17, 5, 3)], getattr(ops, _name + "_split"),
         lambda a, b, f=_f: f(a) * b, {0: uniform_in(-4, 4)}, max_nmse=_tol)
case("swiglu_swapped", "glu", [f32(24, 5)], ops.swiglu_swapped,
     lambda a: UNARY_REFS["silu"](a[..., 12:]) * a[..., :12], {0: uniform_in(-4, 4)})
case("swiglu(view with row gaps)", "glu", [f32(30, 4, 2)],
     lambda a: ops.swiglu(ops.view_3d(a, 20, 4, 2, a.nb[1], a.nb[2], 6 * 4)),
     lambda a: UNARY_REFS["silu"](a[..., 6:16]) * a[..., 16:26])
case("swiglu_split(large)", "glu", [f32(4096, 16), f32(4096, 16)], ops.swiglu_split,   # the threaded path
     lambda a, b: UNARY_REFS["silu"](a) * b)

# -- reductions ------------------------------------------------------------------------------------
for _ne, _suffix in [((33, 5, 3, 2), ""), ((17, 1), "(one row)")]:
    case(f"sum{_suffix}", "reduce", [f32(*_ne)], ops.sum, lambda a: np.sum(a).reshape(1, 1, 1, 1))
    case(f"sum_rows{_suffix}", "reduce", [f32(*_ne)], ops.sum_rows, lambda a: np.sum(a, axis=-1, keepdims=True))
    case(f"mean{_suffix}", "reduce", [f32(*_ne)], ops.mean, lambda a: np.mean(a, axis=-1, keepdims=True))
case("sum_rows(permuted)", "reduce", [f32(6, 7, 3, 2)], lambda a: ops.sum_rows(ops.permute(a, 2, 1, 0, 3)),
     lambda a: np.sum(np_permute(a, 2, 1, 0, 3), axis=-1, keepdims=True))
case("argmax", "reduce", [f32(100, 12)], ops.argmax, lambda a: np.argmax(a, axis=-1).reshape(1, 1, 1, -1))
case("argmax(transposed)", "reduce", [f32(12, 50)], lambda a: ops.argmax(ops.transpose(a)),
     lambda a: np.argmax(np_transpose(a), axis=-1).reshape(1, 1, 1, -1))
for _order in ops.SortOrder:
    _sign = 1 if _order == ops.SortOrder.ASC else -1
    case(f"argsort({_order.name.lower()})", "reduce", [f32(33, 7, 2)], lambda a, o=_order: ops.argsort(a, o),
         lambda a, s=_sign: np.argsort(s * a, axis=-1, kind="stable"))
    case(f"argsort({_order.name.lower()}, transposed)", "reduce", [f32(5, 40)],
         lambda a, o=_order: ops.argsort(ops.transpose(a), o),
         lambda a, s=_sign: np.argsort(s * np_transpose(a), axis=-1, kind="stable"))
case("argsort_top_k(k=4)", "reduce", [f32(16, 6)], lambda a: ops.argsort_top_k(a, 4),
     lambda a: np.argsort(-a, axis=-1, kind="stable")[..., :4])


# -- norms -----------------------------------------------------------------------------------------
def norm_ref(x, eps):
    xc = x - x.mean(axis=-1, keepdims=True)
    return xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps)


def rms_norm_ref(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


for _name, _f in [("norm", norm_ref), ("rms_norm", rms_norm_ref)]:
    _op = getattr(ops, _name)
    for _eps, _suffix in [(1e-6, ""), (1e-1, "(eps=0.1)")]:
        case(f"{_name}{_suffix}", "norm", [f32(64, 5, 3, 2)], lambda a, op=_op, e=_eps: op(a, e),
             lambda a, f=_f, e=_eps: f(a, e))
    case(f"{_name}_inplace", "norm", [f32(32, 4)], lambda a, n=_name: getattr(ops, n + "_inplace")(a, 1e-5),
         lambda a, f=_f: f(a, 1e-5))
    case(f"{_name}(permuted)", "norm", [f32(6, 20, 3)], lambda a, op=_op: op(ops.permute(a, 1, 0, 2, 3), 1e-5),
         lambda a, f=_f: f(np_permute(a, 1, 0, 2, 3), 1e-5))
    for _ne0 in (300, 2600):   # rows longer than the 8 values per thread that CUDA keeps in registers
        case(f"{_name}(rows of {_ne0})", "norm", [f32(_ne0, 2)], lambda a, op=_op: op(a, 1e-5),
             lambda a, f=_f: f(a, 1e-5))


# -- soft_max, diag_mask_inf -----------------------------------------------------------------------
def alibi_slopes_ref(n_head, max_bias):
    if max_bias <= 0:
        return np.ones(n_head)
    n_head_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0, m1 = 2.0 ** (-max_bias / n_head_log2), 2.0 ** (-(max_bias / 2.0) / n_head_log2)
    return np.array([m0 ** (h + 1) if h < n_head_log2 else m1 ** (2 * (h - n_head_log2) + 1)
                     for h in range(n_head)])


def soft_max_ref(a, mask=None, scale=1.0, max_bias=0.0):
    w = a * scale
    if mask is not None:  # mask row i1 for row i1, broadcast over dims 2 and 3
        n3, n2, n1, n0 = a.shape
        w = w + alibi_slopes_ref(n2, max_bias).reshape(1, -1, 1, 1) * tile_to(mask[:, :, :n1], a.shape)
    e = np.exp(w - np.max(w, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def diag_mask_ref(a, n_past):
    i0 = np.arange(a.shape[3]).reshape(1, 1, 1, -1)
    i1 = np.arange(a.shape[2]).reshape(1, 1, -1, 1)
    return np.where(i0 > n_past + i1, -np.inf, a)


case("soft_max", "soft_max", [f32(37, 5, 3)], ops.soft_max, soft_max_ref, {0: uniform_in(-5, 5)})
case("soft_max_inplace", "soft_max", [f32(37, 5)], ops.soft_max_inplace, soft_max_ref)
for _mt in (F32, F16):
    for _na, _nm, _scale, _bias in [((32, 7, 4, 2), (32, 7, 1, 1), 0.5, 0.0),
                                    ((32, 7, 4, 2), (32, 9, 4, 2), 2.0, 0.0),    # mask rows > ne1
                                    ((16, 3, 6, 2), (16, 4, 2, 1), 0.125, 8.0),  # ALiBi, 6 heads
                                    ((16, 3, 5, 1), (16, 3, 1, 1), 1.0, 4.0)]:
        case(f"soft_max_ext(a{list(_na)}, mask {type_name(_mt)}{list(_nm)}, scale={_scale}, max_bias={_bias})",
             "soft_max", [f32(*_na), (_mt, _nm)], lambda a, m, s=_scale, mb=_bias: ops.soft_max_ext(a, m, s, mb),
             lambda a, m, s=_scale, mb=_bias: soft_max_ref(a, m, s, mb), {0: uniform_in(-3, 3)})
case("soft_max_ext(scale only)", "soft_max", [f32(16, 4)], lambda a: ops.soft_max_ext(a, None, 0.3),
     lambda a: soft_max_ref(a, None, 0.3))
case("soft_max_ext_inplace(scale only)", "soft_max", [f32(16, 4)], lambda a: ops.soft_max_ext_inplace(a, None, 0.3),
     lambda a: soft_max_ref(a, None, 0.3))
for _n_past in (0, 3):
    case(f"diag_mask_inf(n_past={_n_past})", "soft_max", [f32(10, 7, 3)],
         lambda a, n=_n_past: ops.diag_mask_inf(a, n), lambda a, n=_n_past: diag_mask_ref(a, n))
case("diag_mask_inf_inplace", "soft_max", [f32(8, 8, 2)], lambda a: ops.diag_mask_inf_inplace(a, 1),
     lambda a: diag_mask_ref(a, 1))
case("soft_max(diag_mask_inf)", "soft_max", [f32(8, 8, 2)], lambda a: ops.soft_max(ops.diag_mask_inf(a, 0)),
     lambda a: soft_max_ref(diag_mask_ref(a, 0)))


# -- rope ------------------------------------------------------------------------------------------
def rope_ref(x, pos, ff, n_dims, mode, n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0,
             attn_factor=1.0, beta_fast=32.0, beta_slow=1.0):
    """An independent float64 rope with GGML's YaRN (rope_yarn, rope_yarn_corr_dims)."""
    half = n_dims // 2
    k = np.arange(half)
    theta_extrap = pos.reshape(-1, 1) * freq_base ** (-2.0 * k / n_dims)  # (n_pos, half)
    if ff is not None:
        theta_extrap = theta_extrap / ff.reshape(-1)[:half]
    theta_interp = freq_scale * theta_extrap
    theta, mscale = theta_interp, attn_factor
    if ext_factor != 0:
        def corr_dim(n_rot):
            return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))
        low = max(0.0, math.floor(corr_dim(beta_fast)))
        high = min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))
        mix = (1 - np.clip((k - low) / max(0.001, high - low), 0, 1)) * ext_factor
        theta = theta_interp * (1 - mix) + theta_extrap * mix
        mscale = attn_factor * (1 + 0.1 * math.log(1 / freq_scale))
    cos = (np.cos(theta) * mscale)[None, :, None, :]    # over (ne3, ne2 = positions, ne1, half)
    sin = (np.sin(theta) * mscale)[None, :, None, :]
    i0, i1 = (k, k + half) if mode == NEOX else (2 * k, 2 * k + 1)
    y = x.copy()
    y[..., i0] = x[..., i0] * cos - x[..., i1] * sin
    y[..., i1] = x[..., i0] * sin + x[..., i1] * cos
    return y


_ROPE_CONFIGS = [  # (ne, n_dims, rope_ext's YaRN arguments, with freq factors)
    ((64, 4, 5, 1), 64, {}, False),
    ((64, 4, 5, 1), 32, {}, False),                       # dims beyond n_dims copied unchanged
    ((32, 3, 6, 2), 32, dict(n_ctx_orig=512, freq_base=10000.0, freq_scale=0.25, ext_factor=1.0,
                             attn_factor=1.0, beta_fast=32.0, beta_slow=1.0), False),
    ((48, 2, 4, 1), 32, dict(n_ctx_orig=4096, freq_base=500000.0, freq_scale=0.5, ext_factor=0.5,
                             attn_factor=0.8, beta_fast=16.0, beta_slow=2.0), True),
    ((40, 3, 4, 1), 40, dict(freq_base=1e6, freq_scale=1.0, attn_factor=1.2), True),
]
for _mode in (ops.ROPE_TYPE_NORMAL, NEOX):
    for _ne, _nd, _kw, _ff in _ROPE_CONFIGS:
        case(f"rope_ext(mode={_mode}, a{list(_ne)}, n_dims={_nd}, {_kw}, ff={_ff})", "rope",
             [f32(*_ne), (I32, (_ne[2],))] + ([f32(_nd // 2)] if _ff else []),
             lambda a, pos, ff=None, nd=_nd, mode=_mode, kw=_kw: ops.rope_ext(a, pos, ff, nd, mode, **kw),
             lambda a, pos, ff=None, nd=_nd, mode=_mode, kw=_kw: rope_ref(a, pos, ff, nd, mode, **kw),
             {1: indices(40), 2: uniform_in(0.9, 1.1)})
    # the K part of a fused QKV row: 2 heads of 16 at offset 64, rows spaced apart
    for _inplace in (False, True):
        case(f"rope{'_inplace' if _inplace else ''}(view of fused qkv, mode={_mode})", "rope",
             [f32(96, 5), (I32, (5,))],
             lambda qkv, pos, m=_mode, i=_inplace: (ops.rope_ext_inplace if i else ops.rope_ext)(
                 ops.view_3d(qkv, 16, 2, 5, 16 * 4, qkv.nb[1], 64 * 4), pos, None, 16, m),
             lambda qkv, pos, m=_mode: rope_ref(qkv[..., 64:96].reshape(1, 5, 2, 16), pos, None, 16, m),
             {1: indices(100)})
case("rope", "rope", [f32(16, 2, 3), (I32, (3,))], lambda a, p: ops.rope(a, p, 16, 0),
     lambda a, p: rope_ref(a, p, None, 16, 0), {1: indices(10)})


# -- get_rows / set_rows ----------------------------------------------------------------------------
def get_rows_ref(a, idx):
    """a (ne03, ne02, ne01, ne00), idx (1, ne03, ne02, n) -> (ne03, ne02, n, ne00)."""
    out = np.empty(a.shape[:2] + (idx.shape[3], a.shape[3]))
    for i3, i2 in np.ndindex(*a.shape[:2]):
        out[i3, i2] = a[i3, i2, idx[0, i3, i2]]
    return out


def set_rows_ref(a, b, c):
    """a (n3, n2, n_rows, n0) <- rows of b (n3, n2, n, n0) at c (1, m3, m2, n), broadcast over dims 2, 3."""
    out = a.copy()
    for i3, i2 in np.ndindex(*b.shape[:2]):
        out[i3, i2, c[0, i3 % c.shape[1], i2 % c.shape[2]]] = b[i3, i2]
    return out


_ROW = 2 * QK_K   # a row of every weight type: two blocks of the largest block size
for _type in WEIGHT_TYPES:   # every weight type at a model's row length, both index types
    for _it in (I32, I64):
        _label = f"{type_name(_type)}, idx {type_name(_it)}"
        case(f"get_rows({_label})", "rows", [(_type, (_ROW, 6, 2)), (_it, (3, 2))], ops.get_rows, get_rows_ref,
             {1: indices(6)}, types=(_type,))
        case(f"set_rows({_label})", "rows", [(_type, (_ROW, 6, 2)), f32(_ROW, 3, 2), (_it, (3, 2))], ops.set_rows,
             lambda a, b, c, t=_type: set_rows_ref(a, q_round(t, b), c), {2: distinct_indices(6)},
             max_nmse=write_nmse(_type), types=(_type,))
for _type in (F32, F16, BF16, I32):   # short rows, 4-D
    for _it in (I32, I64):
        case(f"get_rows({type_name(_type)}, idx {type_name(_it)}, short rows)", "rows",
             [(_type, (12, 10, 3, 2)), (_it, (7, 3, 2))], ops.get_rows, get_rows_ref,
             {0: indices(1000) if _type == I32 else None, 1: indices(10)})
case("get_rows(permuted rows)", "rows", [f32(6, 8, 4), (I32, (3, 6))],
     lambda a, b: ops.get_rows(ops.permute(a, 2, 1, 0, 3), b),
     lambda a, b: get_rows_ref(np_permute(a, 2, 1, 0, 3), b), {1: indices(8)})
for _type, _it in [(F32, I32), (F32, I64), (F16, I32), (F16, I64), (BF16, I32), (BF16, I64), (Q8_0, I32),
                   (Q4_K, I32)]:   # indices broadcast over dim 2
    _n0 = max(32, blck_size(_type))
    case(f"set_rows({type_name(_type)}, idx {type_name(_it)}, broadcast idx)", "rows",
         [(_type, (_n0, 10, 4, 2)), f32(_n0, 3, 4, 2), (_it, (3, 2, 1))],
         ops.set_rows, lambda a, b, c, t=_type: set_rows_ref(a, q_round(t, b), c), {2: distinct_indices(10)},
         max_nmse=write_nmse(_type))

# -- copies: dup, cont, cpy ------------------------------------------------------------------------
case("dup", "copy", [f32(10, 4, 3)], ops.dup, lambda a: a)
case("dup_inplace", "copy", [f32(10, 4, 3)], ops.dup_inplace, lambda a: a)
case("dup(transposed)", "copy", [f32(10, 4, 3)], lambda a: ops.dup(ops.transpose(a)), np_transpose)
case("cont(permuted)", "copy", [f32(5, 4, 3, 2)], lambda a: ops.cont(ops.permute(a, 3, 1, 0, 2)),
     lambda a: np_permute(a, 3, 1, 0, 2))
case("cont_2d(transposed)", "copy", [f32(6, 4)], lambda a: ops.cont_2d(ops.transpose(a), 8, 3),
     lambda a: np_transpose(a).reshape(1, 1, 3, 8))
case("cont(f16 permuted)", "copy", [(F16, (6, 4, 3))], lambda a: ops.cont(ops.permute(a, 1, 2, 0, 3)),
     lambda a: np_permute(a, 1, 2, 0, 3))
case("cont(f16 permuted, rows of 64)", "copy", [(F16, (32, 2, 64))], lambda a: ops.cont(ops.permute(a, 1, 2, 0, 3)),
     lambda a: np_permute(a, 1, 2, 0, 3))   # a V cache [hd, n_head_kv, n_kv] made [n_kv, hd, n_head_kv]
for _type in WEIGHT_TYPES[1:]:   # every weight type at a model's row length
    case(f"cpy(f32 -> {type_name(_type)})", "copy", [f32(_ROW, 3, 2)],
         lambda a, t=_type: ops.cpy(a, new(t, _ROW, 3, 2)), lambda a, t=_type: q_round(t, a),
         max_nmse=write_nmse(_type))
    case(f"cpy({type_name(_type)} -> f32)", "copy", [(_type, (_ROW, 3, 2))],
         lambda a: ops.cpy(a, new(F32, _ROW, 3, 2)), lambda a: a)
for _src, _dst in [(F32, F16), (F16, F32), (F32, BF16), (BF16, F32), (F16, BF16), (BF16, F16), (F32, F32),
                   (F16, F16), (F32, I32), (I32, F32)]:
    _fill = {0: uniform_in(-1000, 1000)} if _src == I32 else None
    _ref = np.trunc if _dst == I32 else (lambda a: a)
    _label = f"{type_name(_src)} -> {type_name(_dst)}"
    case(f"cpy({_label}, short rows)", "copy", [(_src, (10, 6, 2))], lambda a, d=_dst: ops.cpy(a, new(d, 10, 6, 2)),
         _ref, _fill)
    case(f"cpy({_label}, reshaped)", "copy", [(_src, (10, 6, 2))],
         lambda a, d=_dst: ops.cpy(a, new(d, 4, 5, 3, 2)), lambda a, r=_ref: r(a).reshape(2, 3, 5, 4), _fill)
case("cpy(f32 permuted -> f16 transposed)", "copy", [f32(5, 6, 3)],
     lambda a: ops.cpy(ops.permute(a, 1, 0, 2, 3), ops.transpose(new(F16, 5, 6, 3))),
     lambda a: np_permute(a, 1, 0, 2, 3))
for _type in (F32, F16, BF16):
    case(f"cpy({type_name(_type)} permuted -> f32)", "copy", [(_type, (8, 6, 4))],
         lambda a: ops.cpy(ops.permute(a, 1, 0, 2, 3), new(F32, 6, 8, 4)), lambda a: np_permute(a, 1, 0, 2, 3),
         types=(_type,))
    case(f"cpy(f32 -> view of {type_name(_type)} with gaps)", "copy", [f32(6, 4)],
         lambda a, t=_type: ops.cpy(a, ops.view_2d(b := new(t, 10, 4), 6, 4, b.nb[1], 2 * b.nb[0])), lambda a: a,
         types=(_type,))
case("cpy(f16 -> q8_0)", "copy", [(F16, (64, 3))], lambda a: ops.cpy(a, new(Q8_0, 64, 3)), lambda a: q_round(Q8_0, a),
     max_nmse=Q8_WRITE_NMSE)
case("cpy(q8_0 -> f32, reshaped)", "copy", [(Q8_0, (64, 3))], lambda a: ops.cpy(a, new(F32, 32, 6)),
     lambda a: a.reshape(1, 1, 6, 32))
case("cpy(q4_0 -> q4_0)", "copy", [(Q4_0, (64, 3))], lambda a: ops.cpy(a, new(Q4_0, 64, 3)), lambda a: a)

# -- concat, pad, repeat ---------------------------------------------------------------------------
for _dim in range(4):
    _nb = [6, 5, 4, 3]
    _nb[_dim] = 2
    for _type in (F32, F16):
        case(f"concat(dim={_dim}, {type_name(_type)})", "shape", [(_type, (6, 5, 4, 3)), (_type, tuple(_nb))],
             lambda a, b, dim=_dim: ops.concat(a, b, dim),
             lambda a, b, dim=_dim: np.concatenate([a, b], axis=3 - dim))
    case(f"concat(dim={_dim}, transposed a)", "shape", [f32(5, 6, 4, 3), f32(6, 5, 4, 3)],
         lambda a, b, dim=_dim: ops.concat(ops.transpose(a), b, dim),
         lambda a, b, dim=_dim: np.concatenate([np_transpose(a), b], axis=3 - dim))
case("concat(dim=1, q8_0)", "shape", [(Q8_0, (64, 2)), (Q8_0, (64, 3))], lambda a, b: ops.concat(a, b, 1),
     lambda a, b: np.concatenate([a, b], axis=2))
case("concat(dim=0, i32)", "shape", [(I32, (4, 2)), (I32, (3, 2))], lambda a, b: ops.concat(a, b, 0),
     lambda a, b: np.concatenate([a, b], axis=3), {0: indices(100), 1: indices(100)})


def pad_ref(a, *p):
    """p = (lp0, rp0, lp1, rp1, lp2, rp2, lp3, rp3) in GGML's dim order."""
    return np.pad(a, [(p[2 * d], p[2 * d + 1]) for d in (3, 2, 1, 0)])


case("pad", "shape", [f32(8, 4, 3)], lambda a: ops.pad(a, 2, 1, 1), lambda a: pad_ref(a, 0, 2, 0, 1, 0, 1, 0, 0))
for _p in [(1, 2, 0, 0, 0, 0, 0, 0), (0, 0, 2, 1, 0, 0, 0, 0), (2, 0, 1, 3, 1, 1, 0, 2),
           (0, 1, 0, 1, 2, 0, 1, 0)]:
    case(f"pad_ext{list(_p)}", "shape", [f32(5, 4, 3, 2)], lambda a, p=_p: ops.pad_ext(a, *p),
         lambda a, p=_p: pad_ref(a, *p))
case("pad_ext(f16, transposed)", "shape", [(F16, (4, 5, 2))], lambda a: ops.pad_ext(ops.transpose(a), 1, 1, 2, 0),
     lambda a: pad_ref(np_transpose(a), 1, 1, 2, 0, 0, 0, 0, 0))
for _na, _nb in [((3, 2, 1, 1), (9, 4, 2, 2)), ((1, 1, 1, 1), (5, 3, 2, 1)), ((4, 1, 3, 1), (4, 5, 6, 2))]:
    case(f"repeat({list(_na)} -> {list(_nb)})", "shape", [f32(*_na)],
         lambda a, nb=_nb: ops.repeat(a, new(F32, *nb)), lambda a, nb=_nb: tile_to(a, tuple(reversed(nb))))
case("repeat(transposed)", "shape", [f32(2, 3)], lambda a: ops.repeat(ops.transpose(a), new(F32, 6, 4)),
     lambda a: tile_to(np_transpose(a), (1, 1, 4, 6)))


# -- mul_mat: every weight type, mat-vec and matrix, single-threaded and threaded sizes --------------
def mul_mat_ref(a, b):
    """GGML's mul_mat: out[i3, i2] = b[i3, i2] @ a[i3 / r3, i2 / r2].T, a broadcast over b's dims 2, 3."""
    a = np.repeat(np.repeat(a, b.shape[0] // a.shape[0], axis=0), b.shape[1] // a.shape[1], axis=1)
    return b @ np.swapaxes(a, 2, 3)


for _type in WEIGHT_TYPES:
    for _m, _n in ((16, 1), (16, 4), (16, 32), (4096, 1), (512, 32)):
        case(f"mul_mat({type_name(_type)}, m={_m}, n={_n})", "mul_mat", [(_type, (256, _m)), f32(256, _n)],
             ops.mul_mat, mul_mat_ref, max_nmse=MUL_MAT_NMSE, types=(_type,))
    case(f"mul_mat({type_name(_type)}, permuted activations)", "mul_mat",   # as attention passes them
         [(_type, (256, 16)), f32(256, 1, 8)], lambda w, x: ops.mul_mat(w, ops.permute(x, 0, 2, 1, 3)),
         lambda w, x: mul_mat_ref(w, np_permute(x, 0, 2, 1, 3)), max_nmse=MUL_MAT_NMSE, types=(_type,))
case("mul_mat(f32, broadcast over batch)", "mul_mat", [f32(32, 16, 2), f32(32, 8, 4)], ops.mul_mat, mul_mat_ref,
     max_nmse=MUL_MAT_NMSE)
for _k in (40, 36):   # rows of 5 (a k-step's tail) and of 4.5 16-byte pieces; 70 columns: two tiles of 64
    case(f"mul_mat(f16, k={_k}, 70 columns, broadcast over batch)", "mul_mat", [(F16, (_k, 20, 2)), f32(_k, 70, 4)],
         ops.mul_mat, mul_mat_ref, max_nmse=MUL_MAT_NMSE)


# -- mul_mat_id: a mixture of experts' products, every weight type --------------------------------------
def mul_mat_id_ref(a, b, ids):
    """out[0, t, e] = a[0, ids[t, e]] @ b[0, t, e % n_b] (NumPy order, see ops.mul_mat_id)."""
    n_tokens, n_used = ids.shape[2], ids.shape[3]
    out = np.empty((1, n_tokens, n_used, a.shape[2]))
    for t in range(n_tokens):
        for e in range(n_used):
            out[0, t, e] = a[0, int(ids[0, 0, t, e])] @ b[0, t, e % b.shape[2]]
    return out


for _type in WEIGHT_TYPES:
    for _n_b, _n in ((1, 1), (1, 6), (3, 6)):    # a token's row broadcast to its experts, or a row each
        case(f"mul_mat_id({type_name(_type)}, 5 experts, 3 used, n_b={_n_b}, n={_n})", "mul_mat",
             [(_type, (256, 16, 5)), f32(256, _n_b, _n), (I32, (3, _n))], ops.mul_mat_id, mul_mat_id_ref,
             fill={2: distinct_indices(5)}, max_nmse=MUL_MAT_NMSE, types=(_type,))
case("mul_mat_id(q4_K, 4096 rows, 8 experts, 2 used, permuted activations)", "mul_mat",
     [(Q4_K, (256, 4096, 8)), f32(256, 2, 1), (I32, (2, 2))],
     lambda w, x, i: ops.mul_mat_id(w, ops.permute(x, 0, 2, 1, 3), i),
     lambda w, x, i: mul_mat_id_ref(w, np_permute(x, 0, 2, 1, 3), i),
     fill={2: distinct_indices(8)}, max_nmse=MUL_MAT_NMSE, types=(Q4_K,))


# -- attention as the model runner builds it (models/llama.py) -------------------------------------
def _v_rows(n_kv, n_embd_v):
    """Row indices into the transposed V cache: element j of token t goes to row j * n_kv + cell_t,
    the cells distinct."""
    def fill(rng, shape):
        cells = rng.permutation(n_kv)[:shape[-1] // n_embd_v]
        return (np.arange(n_embd_v)[None, :] * n_kv + cells[:, None]).reshape(shape)
    return fill


def _attention(n_tokens, n_kv=64, hd=32, n_head=4, n_head_kv=2):
    """One layer's attention: rope, K and V written into F16 caches by set_rows (V transposed, one
    element a row), K read through a permuted view, masked soft_max_ext. (op, ref, fill)"""
    n_embd_kv = hd * n_head_kv

    def op(q, k, v, pos, kv_idxs, v_idxs, mask, kc, vc):
        q = ops.rope_ext(q, pos, None, hd, ops.ROPE_TYPE_NORMAL)
        k = ops.rope_ext(k, pos, None, hd, ops.ROPE_TYPE_NORMAL)
        k_write = ops.set_rows(kc, ops.reshape_2d(k, n_embd_kv, n_tokens), kv_idxs)
        v_write = ops.set_rows(ops.reshape_2d(vc, 1, n_kv * n_embd_kv), ops.reshape_2d(v, 1, n_embd_kv * n_tokens),
                               v_idxs)
        kv = ops.view_3d(kc, hd, n_head_kv, n_kv, kc.nb[1] // n_head_kv, kc.nb[1], 0)
        vt = ops.view_3d(vc, n_kv, hd, n_head_kv, vc.nb[1], vc.nb[1] * hd, 0)   # [n_kv, hd, n_head_kv]
        kq = ops.mul_mat(ops.permute(kv, 0, 2, 1, 3), ops.permute(q, 0, 2, 1, 3))
        kq = ops.soft_max_ext(kq, mask, 1.0 / math.sqrt(hd), 0.0)
        kqv = ops.mul_mat(vt, kq)                                                 # [hd, n_tokens, n_head]
        return k_write, v_write, ops.cont_2d(ops.permute(kqv, 0, 2, 1, 3), hd * n_head, n_tokens)

    def ref(q, k, v, pos, kv_idxs, v_idxs, mask, kc, vc):
        q = rope_ref(q, pos, None, hd, ops.ROPE_TYPE_NORMAL)[0]                # (n_tokens, n_head, hd)
        k = rope_ref(k, pos, None, hd, ops.ROPE_TYPE_NORMAL)
        keys, values = kc[0, 0].copy(), vc.ravel().copy()
        keys[kv_idxs.ravel()] = q_round(F16, k.reshape(n_tokens, n_embd_kv))
        values[v_idxs.ravel()] = q_round(F16, v.ravel())
        keys, values = keys.reshape(n_kv, n_head_kv, hd), values.reshape(n_head_kv, hd, n_kv)
        out = np.empty((n_tokens, n_head, hd))
        for h in range(n_head):
            kv_head = h // (n_head // n_head_kv)
            kq = soft_max_ref((q[:, h] @ keys[:, kv_head].T)[None, None], mask, 1.0 / math.sqrt(hd))[0, 0]
            out[:, h] = kq @ values[kv_head].T
        return out.reshape(1, 1, n_tokens, n_head * hd)

    inputs = [f32(hd, n_head, n_tokens), f32(hd, n_head_kv, n_tokens), f32(n_embd_kv, n_tokens), (I32, (n_tokens,)),
              (I64, (n_tokens,)), (I64, (n_embd_kv * n_tokens,)), f32(n_kv, n_tokens), (F16, (n_embd_kv, n_kv)),
              (F16, (n_kv, n_embd_kv))]
    return inputs, op, ref, {3: indices(1000), 4: distinct_indices(n_kv), 5: _v_rows(n_kv, n_embd_kv)}


for _n in (1, 8, 64):
    _inputs, _op, _ref, _fill = _attention(_n)
    case(f"attention(n_tokens={_n})", "attention", _inputs, _op, _ref, _fill, max_nmse=MUL_MAT_NMSE)


# -- flash_attn_ext: fused attention -----------------------------------------------------------------
def flash_attn_ext_ref(q, k, v, mask=None, scale=1.0, max_bias=0.0, softcap=0.0):
    """GGML's flash_attn_ext in float64: q (ne3, n_head, n_q, D), k (ne3k, n_head_kv, n_kv, D),
    v (ne3k, n_head_kv, n_kv, Dv), mask (m3, m2, >= n_q, n_kv) -> (ne3, n_q, n_head, Dv) (heads and
    queries swapped, GGML's result layout). Query head h reads kv head h // (n_head / n_head_kv), and
    dim 3 likewise; the score is scale·q·k, soft-capped to softcap·tanh(score/softcap), plus the ALiBi
    slope times the mask row of the query (dims 2, 3 by modulo); a query that sees no cell gets 0."""
    ne3, n_head, n_q, _ = q.shape
    ne3k, n_head_kv = k.shape[:2]
    slopes = alibi_slopes_ref(n_head, max_bias)
    out = np.zeros((ne3, n_q, n_head, v.shape[3]))
    for i3, h in np.ndindex(ne3, n_head):
        kv3, kvh = i3 // (ne3 // ne3k), h // (n_head // n_head_kv)
        s = scale * (q[i3, h] @ k[kv3, kvh].T)                        # (n_q, n_kv)
        if softcap:
            s = softcap * np.tanh(s / softcap)
        if mask is not None:
            s = s + slopes[h] * mask[i3 % mask.shape[0], h % mask.shape[1], :n_q]
        top = np.max(s, axis=-1, keepdims=True)
        seen = np.isfinite(top)                                        # a cell is not masked
        e = np.exp(s - np.where(seen, top, 0.0))
        total = np.sum(e, axis=-1, keepdims=True)
        out[i3, :, h] = np.where(seen, (e @ v[kv3, kvh]) / np.where(seen, total, 1.0), 0.0)
    return out


def _fa_mask(n_q, causal=True, masked_row=None, seqs=0):
    """A flash-attention mask (m3, m2, m1, n_kv): uniform [-1, 0] values (ALiBi's positions, or any
    additive bias); with ``causal``, -inf where query iq1 may not see cell ic (ic > n_kv - n_q + iq1:
    the batch is the last n_q cells of the cache); query ``masked_row`` sees nothing. With ``seqs``,
    a step of that many sequences in one cache instead: query iq1 and cell ic belong to sequences
    iq1 % seqs and ic % seqs, and a query sees the cells of its own."""
    def fill(rng, shape):
        m = rng.uniform(-1.0, 0.0, shape)
        if seqs:
            ic, iq = np.arange(shape[-1]), np.arange(shape[-2])
            m = np.where(ic[None, :] % seqs == iq[:, None] % seqs, m, -np.inf)
        elif causal:
            ic, iq = np.arange(shape[-1]), np.arange(shape[-2])
            m = np.where(ic[None, :] <= shape[-1] - n_q + iq[:, None], m, -np.inf)
        if masked_row is not None:
            m[..., masked_row, :] = -np.inf
        return m
    return fill


_SIM_HEAVY = set()   # the names of the flash_attn cases over hundreds of KV cells: minutes under the CUDA simulator


def _fa_case(d, n_kv, n_q, n_head, n_head_kv, kv, masked=True, ne3=1, ne3k=1, m=None, max_bias=0.0, softcap=0.0,
             scale=None, dv=None, causal=True, masked_row=None, seqs=0):
    """A flash_attn_ext case: q F32 [d, n_q, n_head, ne3], k/v of type ``kv`` [d or dv, n_kv, n_head_kv,
    ne3k], with ``masked`` an F16 mask (the op's only mask type) of shape ``m`` (default [n_kv, n_q, 1, 1])."""
    dv = dv or d
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    m = m or (n_kv, n_q, 1, 1)
    inputs = [f32(d, n_q, n_head, ne3), (kv, (d, n_kv, n_head_kv, ne3k)), (kv, (dv, n_kv, n_head_kv, ne3k))]
    fill = {}
    if masked:
        inputs.append((F16, m))
        fill[3] = _fa_mask(n_q, causal, masked_row, seqs)
    label = (f"d={d}{'' if dv == d else f', dv={dv}'}, n_kv={n_kv}, n_q={n_q}, heads={n_head}/{n_head_kv}"
             f"{f', ne3={ne3}/{ne3k}' if ne3 > 1 else ''}, kv {type_name(kv)}, "
             f"mask {'F16' + str(list(m)) if masked else None}"
             f"{f', {seqs} sequences' if masked and seqs else ', causal' if masked and causal else ''}"
             f"{f', query {masked_row} masked' if masked_row is not None else ''}"
             f"{f', max_bias={max_bias}' if max_bias else ''}{f', softcap={softcap}' if softcap else ''}"
             f"{f', scale={scale:.3g}' if scale != 1.0 / math.sqrt(d) else ''}")
    name = f"flash_attn_ext({label})"
    if n_kv > 64:
        _SIM_HEAVY.add(name)
    case(name, "flash_attn", inputs,
         lambda q, k, v, mask=None: ops.flash_attn_ext(q, k, v, mask, scale, max_bias, softcap),
         lambda q, k, v, mask=None: flash_attn_ext_ref(q, k, v, mask, scale, max_bias, softcap), fill,
         max_nmse=FLASH_ATTN_NMSE if kv == F16 else MAX_NMSE)


_fa_case(64, 7, 5, 4, 4, F16)
_fa_case(64, 7, 5, 4, 4, F32)
_fa_case(64, 7, 5, 4, 4, F16, masked_row=2)                   # a query that sees nothing: zeros
_fa_case(64, 7, 5, 4, 2, F32, masked_row=0)
_fa_case(128, 259, 1, 8, 2, F16)                              # decode: one query, GQA 4
_fa_case(128, 259, 1, 8, 2, F32, masked=False)
_fa_case(64, 259, 32, 4, 1, F16)                              # a prompt batch, GQA 4
_fa_case(128, 7, 32, 2, 2, F32, causal=False)
_fa_case(128, 1, 1, 4, 4, F16, masked=False)                  # one cell
_fa_case(128, 1, 5, 4, 1, F32, causal=False)
_fa_case(40, 7, 5, 4, 4, F16)                                 # a head size of no SIMD width
_fa_case(40, 259, 5, 4, 4, F32, masked=False)
_fa_case(64, 7, 5, 4, 4, F32, masked=False, dv=40)            # V rows shorter than K's
_fa_case(64, 7, 5, 6, 6, F16, m=(7, 5, 2, 1), max_bias=8.0)   # ALiBi, 6 heads: both slope bases
_fa_case(64, 7, 5, 6, 3, F32, max_bias=8.0)
# soft cap: a larger scale so that scores reach where tanh bends
_fa_case(128, 259, 5, 4, 4, F16, softcap=50.0, scale=8.0 / math.sqrt(128))
_fa_case(64, 7, 5, 4, 2, F32, softcap=50.0, scale=8.0 / math.sqrt(64))
_fa_case(64, 7, 5, 2, 2, F16, ne3=2, ne3k=1, m=(7, 5, 2, 2))  # dim 3: k, v broadcast, mask per ne3
_fa_case(64, 7, 5, 2, 1, F32, ne3=2, ne3k=2, m=(7, 8, 1, 1))  # mask rows beyond n_q (padding)
# the shapes that take CUDA's other paths: 9 queries without a mask (blocks of 8, the second mostly
# empty), a soft-capped batch of 20, a prompt of 64 (the unfused kernels) with a query that sees nothing;
# with a mask and fewer than 64 queries each query walks its own list of visible cells: a step of 4
# and of 3 interleaved sequences (slices of the lists), 20 queries of them, one seeing nothing
_fa_case(64, 7, 9, 4, 2, F16, masked=False)
_fa_case(64, 7, 20, 4, 4, F16, softcap=50.0, scale=8.0 / math.sqrt(64))
_fa_case(64, 7, 64, 2, 1, F32, masked_row=3)
_fa_case(64, 37, 20, 4, 2, F16, seqs=4, masked_row=5)
_fa_case(64, 37, 3, 4, 2, F32, seqs=3)
# the CPU's other paths (GGML's): one query over >= 512 cells (split between threads), >= 64 queries (tiled:
# a full tile of queries and a partial one, over a full window of cells and a partial one)
_fa_case(64, 600, 1, 4, 2, F16)
_fa_case(64, 600, 1, 4, 2, F32)
_fa_case(64, 100, 70, 4, 2, F16)


def _fa_cache_case(d, n_head, n_head_kv, n_q, n_kv, n_ctx, kv):
    """flash_attn_ext as the model runner calls it: k and v are views of the first n_kv cells of
    [d * n_head_kv, n_ctx] caches (view_3d to [d, n_head_kv, n_kv], then permuted to [d, n_kv,
    n_head_kv]), q a permuted [d, n_head, n_q] tensor, an F16 causal mask."""
    n_embd = d * n_head_kv
    scale = 1.0 / math.sqrt(d)

    def kv_view(c):
        return ops.permute(ops.view_3d(c, d, n_head_kv, n_kv, c.nb[0] * d, c.nb[1], 0), 0, 2, 1, 3)

    def kv_ref(c):   # (1, 1, n_ctx, n_embd) -> (1, n_head_kv, n_kv, d)
        return np_permute(c[:, :, :n_kv].reshape(1, n_kv, n_head_kv, d), 0, 2, 1, 3)

    name = (f"flash_attn_ext(views of a {type_name(kv)} cache [{n_embd}, {n_ctx}], n_kv={n_kv}, permuted q "
            f"[{d}, {n_head}, {n_q}], heads={n_head}/{n_head_kv}, mask F16, causal)")
    if n_kv > 64:
        _SIM_HEAVY.add(name)
    case(name, "flash_attn",
         [f32(d, n_head, n_q), (kv, (n_embd, n_ctx)), (kv, (n_embd, n_ctx)), (F16, (n_kv, n_q))],
         lambda q, kc, vc, mask: ops.flash_attn_ext(ops.permute(q, 0, 2, 1, 3), kv_view(kc), kv_view(vc), mask,
                                                    scale),
         lambda q, kc, vc, mask: flash_attn_ext_ref(np_permute(q, 0, 2, 1, 3), kv_ref(kc), kv_ref(vc), mask,
                                                    scale),
         {3: _fa_mask(n_q)}, max_nmse=FLASH_ATTN_NMSE if kv == F16 else MAX_NMSE)


_fa_cache_case(128, 8, 2, 5, 259, 320, F16)
_fa_cache_case(64, 4, 2, 5, 7, 16, F32)


# -- a small chain, as a model would use them --------------------------------------------------------
def _chain(x, w, pos):
    h = ops.rope_ext(ops.mul(ops.rms_norm(x, 1e-5), w), pos, None, 32, NEOX)
    return ops.soft_max_ext(ops.scale(h, 0.5), None, 1.0)


def _chain_ref(x, w, pos):
    return soft_max_ref(0.5 * rope_ref(rms_norm_ref(x, 1e-5) * w.reshape(1, 1, 1, -1), pos, None, 32, NEOX))


case("chain(rms_norm, mul, rope, scale, soft_max)", "chain", [f32(32, 4, 3), f32(32), (I32, (3,))], _chain,
     _chain_ref, {2: indices(20)})

assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"

# the cases without products: what a GPU simulator runs in a minute (numba-cuda's runs every GPU thread
# as a Python thread; a product takes it seconds, attention a minute, flash attention over 259 cells two)
LIGHT_CASES = [c for c in CASES if c.family not in ("mul_mat", "attention") and c.name not in _SIM_HEAVY]


# =================================================================================================
# Row indices out of range: what the GPU backends promise
# =================================================================================================
# GGML leaves an index outside the rows of the tensor it indexes undefined. lazyggml's CPU raises
# IndexError (tests/test_backend_ops.py), so no catalogue case holds one (every case runs on the
# CPU and warms it up). A GPU kernel makes such an index harmless instead (ops.get_rows,
# ops.set_rows): GET_ROWS writes a row of zeros, SET_ROWS writes nothing, and no memory outside the
# tensor is touched. A server computing other people's graphs relies on that; these checks say it.
OOR_ROWS = 6   # rows of the indexed tensor


def out_of_range_indices(itype):
    """Indices [2 planes, 8] into a tensor of ``OOR_ROWS`` rows: in each plane 4 distinct good ones
    and 4 bad ones. -1 and ``OOR_ROWS`` are the rows just before and after a plane (another plane's
    row, or a canary); the extremes would have a kernel read or write far out of its buffer (2^20
    read and 2^26 crashed an H200 once); as I64, ``2^32 + 1`` is row 1 if cut to 32 bits."""
    n = OOR_ROWS
    x = (2**26, -2**31, 2**31 - 1, 2**20) if itype == I32 else (2**40, -2**63, 2**63 - 1, 2**32 + 1)
    return np.array([[0, -1, 1, n, 2, x[0], 3, x[1]],
                     [x[3], 2, -1, 3, n, 4, x[2], 5]], np.int64)


def run_rows_out_of_range(backend, op, type_, itype):
    """GET_ROWS (``op`` "get_rows") or SET_ROWS ("set_rows") of ``type_`` rows on ``backend`` with
    ``out_of_range_indices(itype)``: ``"ok"``, ``"unsupported"``, or AssertionError.

    The indexed tensor ``a`` [n0, OOR_ROWS, 2] is the middle two planes of ``big`` [n0, OOR_ROWS,
    4] in the same buffer, whose outer planes are canaries: index -1 of a's first plane is the row
    of ``big`` just before ``a``, index ``OOR_ROWS`` of its second plane the row just after; the
    same indices in the other plane name a row of ``a``'s other plane, one no good index targets.
    Checked: the good rows' values (NMSE, as ``run_case``); GET_ROWS' other rows are zeros and no
    byte of ``big`` changed; SET_ROWS changed no byte of ``big`` but the rows its good indices name.
    """
    n0 = max(32, blck_size(type_))
    idx_v = out_of_range_indices(itype)
    good = (idx_v >= 0) & (idx_v < OOR_ROWS)
    rng = np.random.default_rng(zlib.crc32(f"{op} {type_name(type_)} {type_name(itype)}".encode()))
    ctx = Context(no_alloc=True)
    with ctx:
        big = ctx.new_tensor(type_, (n0, OOR_ROWS, 4))
        a = ops.view_3d(big, n0, OOR_ROWS, 2, big.nb[1], big.nb[2], big.nb[2])
        idx = ctx.new_tensor(itype, (8, 2))
        b = ctx.new_tensor(F32, (n0, 8, 2)) if op == "set_rows" else None
        out = ops.get_rows(a, idx) if b is None else ops.set_rows(a, b, idx)
    g = Graph()
    g.build_forward_expand(out)
    if not all(backend.device.supports_op(n) for n in g.nodes):
        return "unsupported"
    alloc_ctx_tensors(ctx, backend)
    tensor_set(big, _encode(big, rng.uniform(-1.0, 1.0, (1, 4, OOR_ROWS, n0))))
    tensor_set(idx, _encode(idx, idx_v))
    b_v = rng.uniform(-1.0, 1.0, (2, 8, n0))
    if b is not None:
        tensor_set(b, b_v.astype(np.float32))
    before = tensor_get_bytes(big).reshape(4, OOR_ROWS, -1)   # bytes per (plane, row)
    big_v = decode(big, tensor_get(big))[0]
    backend_graph_compute(backend, g)
    after = tensor_get_bytes(big).reshape(4, OOR_ROWS, -1)
    what = f"{op}({type_name(type_)}, idx {type_name(itype)}) out of range"
    p, j = np.nonzero(good)              # the good indices: plane of a, position in the plane
    rows = (p + 1, idx_v[p, j])          # the rows of big they name
    if b is None:
        assert np.array_equal(after, before), f"{what}: the source was written"
        got = decode(out, tensor_get(out))[0]
        assert not got[~good].any(), f"{what}: the rows of bad indices are not zeros"
        msg = compare(got[p, j], big_v[rows], MAX_NMSE)
    else:
        untouched = np.ones((4, OOR_ROWS), bool)
        untouched[rows] = False
        written = np.argwhere(np.any(after != before, axis=-1) & untouched).tolist()
        assert not written, f"{what}: rows [plane of big, row] that no good index names were written: {written}"
        got = decode(big, tensor_get(big))[0]
        msg = compare(got[rows], q_round(type_, b_v[p, j]), MAX_NMSE)
    assert msg is None, f"{what}: good rows: {msg}"
    return "ok"
