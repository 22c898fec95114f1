"""Every op against a float64 NumPy oracle, in the style of GGML's test-backend-ops.

``CASES`` is a module-level table of op configurations (op x types x shapes: broadcasting, strided
and permuted views, the ``_inplace`` twins, YaRN rope, ALiBi soft_max, ...). A case builds its graph
in a context (``case.build(ctx) -> (inputs, out)``); ``run_case(case, backend)`` fills the inputs
with fresh uniform [-1, 1] data (or what the case asks for: positive values, indices), computes
``out`` on the backend and compares it with ``case.ref`` (NumPy, float64) by GGML's normalized
mean squared error ``sum((a - b)^2) / sum(b^2) <= 1e-7``, after checking that NaN and Inf
agree and that no input other than ``out``'s own memory was written. Other backends reuse the
table: ``run_case(case, their_backend)``.

The seed is random per session unless ``LAZYGGML_TEST_SEED`` is set; a failure prints it.

A case is ``(name, inputs, op, ref)``: ``inputs`` lists the leaf tensors as (type, ne); ``op(*leafs)``
builds the output (views, permutes and extra tensors made inside it, with ``new``); ``ref(*values)``
is the oracle. It gets each input's *values* as a 4-D float64 array in NumPy order
(``reversed(ne)``; indices as int64; quantized inputs dequantized) and returns the expected values
of ``out`` in the same layout. Outputs stored as F16 / BF16 / quantized are compared with the
oracle rounded to that type (``q_round``) as the kernel must round too: F16 and BF16 by
``run_case``, quantized outputs by the case's oracle (re-quantizing already quantized values is
not the identity, so only the oracle knows which values were written).
"""
from __future__ import annotations

import math
import os
import random
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest

import lazyggml as lg
from lazyggml import quants
from lazyggml.backend import backend_graph_compute, tensor_get, tensor_get_bytes, tensor_set
from lazyggml.backends.cpu import CPUBackend, backend_cpu_init
from lazyggml.tensor import current_context
from lazyggml.types import is_quantized

F32, F16, BF16, I32, I64 = lg.F32, lg.F16, lg.BF16, lg.I32, lg.I64
Q4_0, Q8_0, Q4_K, Q6_K = lg.Q4_0, lg.Q8_0, lg.Q4_K, lg.Q6_K
MAX_NMSE = 1e-7
SEED = int(os.environ.get("LAZYGGML_TEST_SEED", random.randrange(2**31)))


# -- the case table --------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    inputs: list           # [(type, ne), ...]: the leafs that run_case fills
    op: Callable           # (*leafs) -> out
    ref: Callable          # (*input values) -> expected values of out
    fill: dict = field(default_factory=dict)   # input index -> (rng, numpy shape) -> values
    max_nmse: float = MAX_NMSE

    def build(self, ctx):
        """(inputs, out), built in ``ctx``."""
        with ctx:
            leafs = [ctx.new_tensor(t, ne) for t, ne in self.inputs]
            return leafs, self.op(*leafs)

    def __repr__(self):
        return self.name


CASES: list[Case] = []


def case(name, inputs, op, ref, fill=None, max_nmse=MAX_NMSE):
    CASES.append(Case(name, inputs, op, ref, fill or {}, max_nmse))


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


# -- NumPy helpers for the oracles -----------------------------------------------------------------
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


# -- running a case ---------------------------------------------------------------------------------
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
    raise ValueError(f"no encoder for {t.type.name}")


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
    With ``gallocr`` the inputs are INPUT, the result OUTPUT, and ``Gallocr`` plans every tensor's
    memory (reusing it by lifetime and in place), as a real graph runs.
    """
    backend = backend or backend_cpu_init()
    seed = SEED if seed is None else seed
    rng = np.random.default_rng(seed + zlib.crc32(case.name.encode()))
    on_host = isinstance(backend, CPUBackend) and not gallocr
    ctx = lg.Context(no_alloc=not on_host)
    inputs, out = case.build(ctx)
    if gallocr:
        for t in inputs:
            lg.set_input(t)
        lg.set_output(out)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    if not all(backend.device.supports_op(n) for n in g.nodes):
        return "unsupported"
    if gallocr:
        assert lg.Gallocr(backend.get_default_buffer_type()).alloc_graph(g)
    elif not on_host:
        lg.alloc_ctx_tensors(ctx, backend)
    values, before = [], []
    for i, t in enumerate(inputs):
        shape = tuple(reversed(t.ne))
        gen = case.fill.get(i)
        tensor_set(t, _encode(t, np.asarray(gen(rng, shape) if gen else rng.uniform(-1.0, 1.0, shape))))
        before.append(tensor_get_bytes(t))
        values.append(decode(t, tensor_get(t)))  # what the kernel will see, before any in-place write
    backend_graph_compute(backend, g)   # compute and wait, as ggml_backend_graph_compute
    for t, raw in zip(inputs, before):  # GGML's sentinel idea: nothing but the result is written
        if t is not out and t is not out.view_src and not gallocr:  # (the planner may reuse inputs)
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


# ===================================================================================================
# the cases
# ===================================================================================================

# -- binary ops with broadcasting (b smaller than a in each dim), views, in place ---------------------
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
_A = (10, 5, 4, 3)
for _name, _f in _BINARY.items():
    _op, _op_inplace = getattr(lg, _name), getattr(lg, _name + "_inplace")
    _fill = {1: uniform_in(0.5, 1.5)} if _name == "div" else None   # no division by ~0
    for _b in [_A, (1, 1, 1, 1), (10, 1, 1, 1), (10, 5, 1, 1), (10, 1, 4, 1), (10, 5, 4, 1), (5, 5, 2, 3),
               (2, 1, 1, 3)]:
        case(f"{_name}(a{list(_A)}, b{list(_b)})", [f32(*_A), f32(*_b)], _op,
             lambda a, b, f=_f: f(a, tile_to(b, a.shape)), _fill)
    case(f"{_name}_inplace", [f32(16, 3, 2), f32(16, 1, 2)], _op_inplace,
         lambda a, b, f=_f: f(a, tile_to(b, a.shape)), _fill)
    case(f"{_name}(permuted a, transposed b)", [f32(6, 5, 4, 2), f32(6, 5, 4, 1)],
         lambda a, b, op=_op: op(lg.permute(a, 1, 0, 2, 3), lg.transpose(b)),
         lambda a, b, f=_f: f(np_permute(a, 1, 0, 2, 3), tile_to(np_transpose(b), (2, 4, 6, 5))), _fill)
case("add(view with row gaps, b)", [f32(12, 6, 2), f32(8, 1, 2)],
     lambda a, b: lg.add(lg.view_3d(a, 8, 6, 2, a.nb[1], a.nb[2], 2 * 4), b),
     lambda a, b: a[..., 2:10] + tile_to(b, (1, 2, 6, 8)))
case("add1", [f32(9, 4, 3), f32(1)], lg.add1, lambda a, b: a + b.reshape(()))
case("add1_inplace", [f32(9, 4, 3), f32(1)], lg.add1_inplace, lambda a, b: a + b.reshape(()))

# -- element-wise unary ops -------------------------------------------------------------------------
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_erf = np.vectorize(math.erf)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _hardsigmoid(x):
    return np.clip((x + 3) / 6, 0, 1)


_UNARY = {
    "abs": np.abs, "sgn": np.sign, "neg": np.negative, "step": lambda x: (x > 0).astype(np.float64),
    "tanh": np.tanh, "elu": lambda x: np.where(x > 0, x, np.expm1(x)), "relu": lambda x: np.maximum(x, 0),
    "sigmoid": _sigmoid,
    "gelu": lambda x: 0.5 * x * (1 + np.tanh(_SQRT_2_OVER_PI * x * (1 + 0.044715 * x * x))),
    "gelu_erf": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2.0))),
    "gelu_quick": lambda x: x * _sigmoid(1.702 * x), "silu": lambda x: x * _sigmoid(x),
    "hardswish": lambda x: x * _hardsigmoid(x), "hardsigmoid": _hardsigmoid,
    "exp": np.exp, "sqr": np.square, "sqrt": np.sqrt, "log": np.log, "sin": np.sin, "cos": np.cos,
}
for _name, _f in _UNARY.items():
    _op = getattr(lg, _name)
    if _name in ("sqrt", "log"):
        _fill = {0: positive}
    elif _name in ("exp", "sqr", "sin", "cos"):
        _fill = None
    else:
        _fill = {0: uniform_in(-4, 4)}   # the activations are interesting over [-4, 4]
    case(_name, [f32(33, 4, 3, 2)], _op, _f, _fill)
    case(f"{_name}(view with row gaps)", [f32(40, 6, 3)],                     # contiguous_1 rows
         lambda a, op=_op: op(lg.view_3d(a, 30, 6, 3, a.nb[1], a.nb[2], 5 * 4)),
         lambda a, f=_f: f(a[..., 5:35]), _fill)
    if hasattr(lg, _name + "_inplace"):
        case(f"{_name}_inplace", [f32(16, 5)], getattr(lg, _name + "_inplace"), _f, _fill)
    if _name in ("sqr", "sqrt", "log", "sin", "cos"):                        # plain ops: any strides
        case(f"{_name}(transposed)", [f32(7, 9, 3)], lambda a, op=_op: op(lg.transpose(a)),
             lambda a, f=_f: f(np_transpose(a)), _fill)
for _s, _b in [(2.5, 0.0), (-0.5, 0.25)]:
    case(f"scale(s={_s}, b={_b})", [f32(20, 3, 2)], lambda a, s=_s, b=_b: lg.scale_bias(a, s, b),
         lambda a, s=_s, b=_b: a * s + b)
case("scale_inplace", [f32(20, 3)], lambda a: lg.scale_inplace(a, 3.0), lambda a: 3 * a)
case("clamp", [f32(20, 3, 2)], lambda a: lg.clamp(a, -0.3, 0.6), lambda a: np.clip(a, -0.3, 0.6))

# -- GLU: halves and split forms, swapped ------------------------------------------------------------
_GLU = {"swiglu": _UNARY["silu"], "geglu": _UNARY["gelu"], "reglu": _UNARY["relu"]}
for _name, _f in _GLU.items():
    case(_name, [f32(24, 5, 3)], getattr(lg, _name), lambda a, f=_f: f(a[..., :12]) * a[..., 12:],
         {0: uniform_in(-4, 4)})
    case(f"{_name}_split", [f32(17, 5, 3), f32(17, 5, 3)], getattr(lg, _name + "_split"),
         lambda a, b, f=_f: f(a) * b, {0: uniform_in(-4, 4)})
case("swiglu_swapped", [f32(24, 5)], lg.swiglu_swapped, lambda a: _UNARY["silu"](a[..., 12:]) * a[..., :12],
     {0: uniform_in(-4, 4)})
case("swiglu(view with row gaps)", [f32(30, 4, 2)],
     lambda a: lg.swiglu(lg.view_3d(a, 20, 4, 2, a.nb[1], a.nb[2], 6 * 4)),
     lambda a: _UNARY["silu"](a[..., 6:16]) * a[..., 16:26])

# -- reductions --------------------------------------------------------------------------------------
for _ne in [(17, 1), (33, 5, 3, 2)]:
    case(f"sum{list(_ne)}", [f32(*_ne)], lg.sum, lambda a: np.sum(a).reshape(1, 1, 1, 1))
    case(f"sum_rows{list(_ne)}", [f32(*_ne)], lg.sum_rows, lambda a: np.sum(a, axis=-1, keepdims=True))
    case(f"mean{list(_ne)}", [f32(*_ne)], lg.mean, lambda a: np.mean(a, axis=-1, keepdims=True))
case("sum_rows(permuted)", [f32(6, 7, 3, 2)], lambda a: lg.sum_rows(lg.permute(a, 2, 1, 0, 3)),
     lambda a: np.sum(np_permute(a, 2, 1, 0, 3), axis=-1, keepdims=True))
case("argmax", [f32(100, 12)], lg.argmax, lambda a: np.argmax(a, axis=-1).reshape(1, 1, 1, -1))
case("argmax(transposed)", [f32(12, 50)], lambda a: lg.argmax(lg.transpose(a)),
     lambda a: np.argmax(np_transpose(a), axis=-1).reshape(1, 1, 1, -1))

# -- norms ---------------------------------------------------------------------------------------------


def norm_ref(x, eps):
    xc = x - x.mean(axis=-1, keepdims=True)
    return xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps)


def rms_norm_ref(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


for _name, _f in [("norm", norm_ref), ("rms_norm", rms_norm_ref)]:
    _op = getattr(lg, _name)
    for _eps in (1e-6, 1e-1):
        case(f"{_name}(eps={_eps})", [f32(64, 5, 3, 2)], lambda a, op=_op, e=_eps: op(a, e),
             lambda a, f=_f, e=_eps: f(a, e))
    case(f"{_name}_inplace", [f32(32, 4)], lambda a, n=_name: getattr(lg, n + "_inplace")(a, 1e-5),
         lambda a, f=_f: f(a, 1e-5))
    case(f"{_name}(permuted)", [f32(6, 20, 3)], lambda a, op=_op: op(lg.permute(a, 1, 0, 2, 3), 1e-5),
         lambda a, f=_f: f(np_permute(a, 1, 0, 2, 3), 1e-5))

# -- soft_max, diag_mask_inf -------------------------------------------------------------------------


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


case("soft_max", [f32(37, 5, 3)], lg.soft_max, soft_max_ref, {0: uniform_in(-5, 5)})
case("soft_max_inplace", [f32(37, 5)], lg.soft_max_inplace, soft_max_ref)
for _mt in (F32, F16):
    for _na, _nm, _scale, _bias in [((32, 7, 4, 2), (32, 7, 1, 1), 0.5, 0.0),
                                    ((32, 7, 4, 2), (32, 9, 4, 2), 2.0, 0.0),    # mask rows > ne1
                                    ((16, 3, 6, 2), (16, 4, 2, 1), 0.125, 8.0),  # ALiBi, 6 heads
                                    ((16, 3, 5, 1), (16, 3, 1, 1), 1.0, 4.0)]:
        case(f"soft_max_ext(a{list(_na)}, mask {_mt.name}{list(_nm)}, scale={_scale}, max_bias={_bias})",
             [f32(*_na), (_mt, _nm)], lambda a, m, s=_scale, mb=_bias: lg.soft_max_ext(a, m, s, mb),
             lambda a, m, s=_scale, mb=_bias: soft_max_ref(a, m, s, mb), {0: uniform_in(-3, 3)})
case("soft_max_ext_inplace(scale only)", [f32(16, 4)], lambda a: lg.soft_max_ext_inplace(a, None, 0.3),
     lambda a: soft_max_ref(a, None, 0.3))
for _n_past in (0, 3):
    case(f"diag_mask_inf(n_past={_n_past})", [f32(10, 7, 3)], lambda a, n=_n_past: lg.diag_mask_inf(a, n),
         lambda a, n=_n_past: diag_mask_ref(a, n))
case("diag_mask_inf_inplace", [f32(8, 8, 2)], lambda a: lg.diag_mask_inf_inplace(a, 1),
     lambda a: diag_mask_ref(a, 1))
case("soft_max(diag_mask_inf)", [f32(8, 8, 2)], lambda a: lg.soft_max(lg.diag_mask_inf(a, 0)),
     lambda a: soft_max_ref(diag_mask_ref(a, 0)))

# -- rope ----------------------------------------------------------------------------------------------


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
    i0, i1 = (k, k + half) if mode == lg.ROPE_TYPE_NEOX else (2 * k, 2 * k + 1)
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
for _mode in (lg.ROPE_TYPE_NORMAL, lg.ROPE_TYPE_NEOX):
    for _ne, _nd, _kw, _ff in _ROPE_CONFIGS:
        case(f"rope_ext(mode={_mode}, a{list(_ne)}, n_dims={_nd}, {_kw}, ff={_ff})",
             [f32(*_ne), (I32, (_ne[2],))] + ([f32(_nd // 2)] if _ff else []),
             lambda a, pos, ff=None, nd=_nd, mode=_mode, kw=_kw: lg.rope_ext(a, pos, ff, nd, mode, **kw),
             lambda a, pos, ff=None, nd=_nd, mode=_mode, kw=_kw: rope_ref(a, pos, ff, nd, mode, **kw),
             {1: indices(40), 2: uniform_in(0.9, 1.1)})


def _rope_qkv(qkv, pos, inplace=False):
    """The K part of a fused QKV row: 2 heads of 16 at offset 64, rows spaced apart."""
    k = lg.view_3d(qkv, 16, 2, 5, 16 * 4, qkv.nb[1], 64 * 4)
    return (lg.rope_ext_inplace if inplace else lg.rope_ext)(k, pos, None, 16, lg.ROPE_TYPE_NEOX)


def _rope_qkv_ref(qkv, pos):
    return rope_ref(qkv[..., 64:96].reshape(1, 5, 2, 16), pos, None, 16, lg.ROPE_TYPE_NEOX)


case("rope(view of fused qkv)", [f32(96, 5), (I32, (5,))], _rope_qkv, _rope_qkv_ref, {1: indices(100)})
case("rope_inplace(view of fused qkv)", [f32(96, 5), (I32, (5,))], lambda q, p: _rope_qkv(q, p, True),
     _rope_qkv_ref, {1: indices(100)})
case("rope", [f32(16, 2, 3), (I32, (3,))], lambda a, p: lg.rope(a, p, 16, 0),
     lambda a, p: rope_ref(a, p, None, 16, 0), {1: indices(10)})

# -- get_rows / set_rows --------------------------------------------------------------------------------


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


for _type in (F32, F16, BF16, I32):
    for _it in (I32, I64):
        case(f"get_rows({_type.name}, idx {_it.name})", [(_type, (12, 10, 3, 2)), (_it, (7, 3, 2))],
             lg.get_rows,
             get_rows_ref, {0: indices(1000) if _type == I32 else None, 1: indices(10)})
for _type in (Q4_0, Q8_0, Q4_K, Q6_K):
    case(f"get_rows({_type.name})", [(_type, (lg.blck_size(_type) * 2, 9, 2)), (I32, (5, 2))], lg.get_rows,
         get_rows_ref, {1: indices(9)})
case("get_rows(permuted rows)", [f32(6, 8, 4), (I32, (3, 6))],
     lambda a, b: lg.get_rows(lg.permute(a, 2, 1, 0, 3), b),
     lambda a, b: get_rows_ref(np_permute(a, 2, 1, 0, 3), b), {1: indices(8)})
for _type in (F32, F16, BF16, Q8_0, Q4_K):
    for _it in (I32, I64) if not is_quantized(_type) else (I32,):
        _n0 = 256 if _type == Q4_K else 32
        case(f"set_rows({_type.name}, idx {_it.name})",
             [(_type, (_n0, 10, 4, 2)), f32(_n0, 3, 4, 2), (_it, (3, 2, 1))],
             lg.set_rows, lambda a, b, c, t=_type: set_rows_ref(a, q_round(t, b), c), {2: distinct_indices(10)})

# -- copies: dup, cont, cpy ---------------------------------------------------------------------------
case("dup", [f32(10, 4, 3)], lg.dup, lambda a: a)
case("dup_inplace", [f32(10, 4, 3)], lg.dup_inplace, lambda a: a)
case("dup(transposed)", [f32(10, 4, 3)], lambda a: lg.dup(lg.transpose(a)), np_transpose)
case("cont(permuted)", [f32(5, 4, 3, 2)], lambda a: lg.cont(lg.permute(a, 3, 1, 0, 2)),
     lambda a: np_permute(a, 3, 1, 0, 2))
case("cont_2d(transposed)", [f32(6, 4)], lambda a: lg.cont_2d(lg.transpose(a), 8, 3),
     lambda a: np_transpose(a).reshape(1, 1, 3, 8))
case("cont(F16 permuted)", [(F16, (6, 4, 3))], lambda a: lg.cont(lg.permute(a, 1, 2, 0, 3)),
     lambda a: np_permute(a, 1, 2, 0, 3))
for _src, _dst in [(F32, F16), (F16, F32), (F32, BF16), (BF16, F32), (F16, BF16), (BF16, F16), (F32, F32),
                   (F16, F16), (F32, I32), (I32, F32)]:
    _fill = {0: uniform_in(-1000, 1000)} if _src == I32 else None
    _ref = np.trunc if _dst == I32 else (lambda a: a)
    case(f"cpy({_src.name} -> {_dst.name})", [(_src, (10, 6, 2))],
         lambda a, d=_dst: lg.cpy(a, new(d, 10, 6, 2)),
         _ref, _fill)
    case(f"cpy({_src.name} -> {_dst.name}, reshaped)", [(_src, (10, 6, 2))],
         lambda a, d=_dst: lg.cpy(a, new(d, 4, 5, 3, 2)), lambda a, r=_ref: r(a).reshape(2, 3, 5, 4), _fill)
case("cpy(F32 permuted -> F16 transposed)", [f32(5, 6, 3)],
     lambda a: lg.cpy(lg.permute(a, 1, 0, 2, 3), lg.transpose(new(F16, 5, 6, 3))),
     lambda a: np_permute(a, 1, 0, 2, 3))
case("cpy(F32 -> view of F16 with gaps)", [f32(6, 4)],
     lambda a: lg.cpy(a, lg.view_2d(b := new(F16, 10, 4), 6, 4, b.nb[1], 2 * 2)), lambda a: a)
for _q in (Q8_0, Q4_0, Q4_K, Q6_K):
    _n = lg.blck_size(_q) * 2
    case(f"cpy(F32 -> {_q.name})", [f32(_n, 3, 2)], lambda a, q=_q, n=_n: lg.cpy(a, new(q, n, 3, 2)),
         lambda a, q=_q: q_round(q, a))
    case(f"cpy({_q.name} -> F32)", [(_q, (_n, 3, 2))], lambda a, n=_n: lg.cpy(a, new(F32, n, 3, 2)),
         lambda a: a)
case("cpy(F16 -> Q8_0)", [(F16, (64, 3))], lambda a: lg.cpy(a, new(Q8_0, 64, 3)), lambda a: q_round(Q8_0, a))
case("cpy(Q8_0 -> F32 reshaped)", [(Q8_0, (64, 3))], lambda a: lg.cpy(a, new(F32, 32, 6)),
     lambda a: a.reshape(1, 1, 6, 32))
case("cpy(Q4_0 -> Q4_0)", [(Q4_0, (64, 3))], lambda a: lg.cpy(a, new(Q4_0, 64, 3)), lambda a: a)

# -- concat, pad, repeat --------------------------------------------------------------------------------
for _dim in range(4):
    _nb = [6, 5, 4, 3]
    _nb[_dim] = 2
    for _type in (F32, F16):
        case(f"concat(dim={_dim}, {_type.name})", [(_type, (6, 5, 4, 3)), (_type, tuple(_nb))],
             lambda a, b, dim=_dim: lg.concat(a, b, dim),
             lambda a, b, dim=_dim: np.concatenate([a, b], axis=3 - dim))
    case(f"concat(dim={_dim}, transposed a)", [f32(5, 6, 4, 3), f32(6, 5, 4, 3)],
         lambda a, b, dim=_dim: lg.concat(lg.transpose(a), b, dim),
         lambda a, b, dim=_dim: np.concatenate([np_transpose(a), b], axis=3 - dim))
case("concat(dim=1, Q8_0)", [(Q8_0, (64, 2)), (Q8_0, (64, 3))], lambda a, b: lg.concat(a, b, 1),
     lambda a, b: np.concatenate([a, b], axis=2))
case("concat(dim=0, I32)", [(I32, (4, 2)), (I32, (3, 2))], lambda a, b: lg.concat(a, b, 0),
     lambda a, b: np.concatenate([a, b], axis=3), {0: indices(100), 1: indices(100)})


def pad_ref(a, *p):
    """p = (lp0, rp0, lp1, rp1, lp2, rp2, lp3, rp3) in GGML's dim order."""
    return np.pad(a, [(p[2 * d], p[2 * d + 1]) for d in (3, 2, 1, 0)])


case("pad", [f32(5, 4, 3)], lambda a: lg.pad(a, 3, 2, 1), lambda a: pad_ref(a, 0, 3, 0, 2, 0, 1, 0, 0))
for _p in [(1, 2, 0, 0, 0, 0, 0, 0), (0, 0, 2, 1, 0, 0, 0, 0), (2, 0, 1, 3, 1, 1, 0, 2),
           (0, 1, 0, 1, 2, 0, 1, 0)]:
    case(f"pad_ext{list(_p)}", [f32(5, 4, 3, 2)], lambda a, p=_p: lg.pad_ext(a, *p),
         lambda a, p=_p: pad_ref(a, *p))
case("pad_ext(F16, transposed)", [(F16, (4, 5, 2))], lambda a: lg.pad_ext(lg.transpose(a), 1, 1, 2, 0),
     lambda a: pad_ref(np_transpose(a), 1, 1, 2, 0, 0, 0, 0, 0))
for _na, _nb in [((3, 2, 1, 1), (9, 4, 2, 2)), ((1, 1, 1, 1), (5, 3, 2, 1)), ((4, 1, 3, 1), (4, 5, 6, 2))]:
    case(f"repeat({list(_na)} -> {list(_nb)})", [f32(*_na)], lambda a, nb=_nb: lg.repeat(a, new(F32, *nb)),
         lambda a, nb=_nb: tile_to(a, tuple(reversed(nb))))
case("repeat(transposed)", [f32(2, 3)], lambda a: lg.repeat(lg.transpose(a), new(F32, 6, 4)),
     lambda a: tile_to(np_transpose(a), (1, 1, 4, 6)))

# -- a small chain, as a model would use them ----------------------------------------------------------


def _chain(x, w, pos):
    h = lg.rope_ext(lg.mul(lg.rms_norm(x, 1e-5), w), pos, None, 32, lg.ROPE_TYPE_NEOX)
    return lg.soft_max_ext(lg.scale(h, 0.5), None, 1.0)


def _chain_ref(x, w, pos):
    return soft_max_ref(0.5 * rope_ref(rms_norm_ref(x, 1e-5) * w.reshape(1, 1, 1, -1), pos, None, 32, 2))


case("chain(rms_norm, mul, rope, scale, soft_max)", [f32(32, 4, 3), f32(32), (I32, (3,))], _chain, _chain_ref,
     {2: indices(20)})


# ===================================================================================================
# the tests
# ===================================================================================================
_names = [c.name for c in CASES]
assert len(set(_names)) == len(_names), "case names must be unique"


@pytest.fixture(scope="module")
def cpu():
    return backend_cpu_init()


@pytest.mark.parametrize("case", CASES, ids=_names)
def test_cpu(case, cpu):
    assert run_case(case, cpu) == "ok", f"{case.name}: the CPU backend does not support it"


@pytest.mark.parametrize("case", CASES, ids=_names)
def test_cpu_through_gallocr(case, cpu):
    """The same cases with every intermediate placed by the static allocator."""
    assert run_case(case, cpu, gallocr=True) == "ok", f"{case.name}: the CPU backend does not support it"


def compute(cpu, build, *datas):
    """Build ``build(*leafs)`` over F32/F16/I32 leafs made from ``datas`` (NumPy order), compute it
    on the CPU and return the result's NumPy array."""
    ctx = lg.Context(no_alloc=False)
    with ctx:
        types = {np.dtype(np.float32): F32, np.dtype(np.float16): F16, np.dtype(np.int32): I32}
        leafs = [ctx.new_tensor(types[d.dtype], tuple(reversed(d.shape))) for d in datas]
        out = build(*leafs)
    for t, d in zip(leafs, datas):
        tensor_set(t, d)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    cpu.graph_compute(g)
    return tensor_get(out)


def test_argmax_ties_keep_the_last_maximum(cpu):
    """GGML's CPU loop (``max = MAX(max, x); if (max == x) idx = i``) returns the LAST of equal
    maxima; checked against libggml: [1, 3, 3, 2] -> 2 and [5, 5, 0, 5] -> 3."""
    got = compute(cpu, lg.argmax, np.array([[1, 3, 3, 2], [5, 5, 0, 5]], np.float32))
    assert got.ravel().tolist() == [2, 3]


def test_get_rows_index_out_of_range_raises(cpu):
    with pytest.raises(IndexError, match="out of range"):
        compute(cpu, lg.get_rows, np.zeros((3, 4), np.float32), np.array([1, 3], np.int32))
    with pytest.raises(IndexError, match="out of range"):
        compute(cpu, lambda a, b, c: lg.set_rows(a, b, c), np.zeros((3, 4), np.float32),
                np.ones((2, 4), np.float32), np.array([0, -1], np.int32))


def test_unsupported_types_are_refused(cpu):
    """supports_op is honest: F16 arithmetic is not implemented, and compute says so."""
    ctx = lg.Context(no_alloc=False)
    a, b = ctx.new_tensor_2d(F16, 4, 3), ctx.new_tensor_2d(F16, 4, 3)
    for out in (lg.add(a, b), lg.rms_norm(a), lg.soft_max(a), lg.silu(a), lg.sum_rows(a), lg.argmax(a)):
        assert not cpu.device.supports_op(out)
    g = lg.Graph()
    lg.build_forward_expand(g, lg.add(a, b))
    with pytest.raises(ValueError, match="not supported"):
        cpu.graph_compute(g)


def test_replayed_plan_reads_new_data_and_follows_moved_tensors(cpu):
    """The CPU backend replays a graph's plan: new input values must be read, and tensors placed
    elsewhere (a new buffer, as after a re-allocation) must be used where they are now."""
    from lazyggml.alloc import alloc_ctx_tensors_from_buft
    from lazyggml.backends.cpu import cpu_buffer_type
    ctx = lg.Context(no_alloc=True)
    with ctx:
        a, w = ctx.new_tensor_2d(F32, 64, 3), ctx.new_tensor_2d(F16, 64, 5)
        out = lg.rms_norm(lg.mul_mat(w, lg.add(a, a)), 1e-6)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    rng = np.random.default_rng(SEED)
    wv = rng.standard_normal((5, 64)).astype(np.float16)
    for placement in range(2):
        buf = alloc_ctx_tensors_from_buft(ctx, cpu_buffer_type())
        tensor_set(w, wv)
        for _ in range(2):
            av = rng.standard_normal((3, 64)).astype(np.float32)
            tensor_set(a, av)
            cpu.graph_compute(g)
            y = (2.0 * av) @ wv.T.astype(np.float64)
            want = y / np.sqrt((y * y).mean(axis=1, keepdims=True) + 1e-6)
            assert np.allclose(tensor_get(out), want, rtol=1e-2, atol=1e-2)
        buf.free()
        for t in (a, w, out) + tuple(n for n in g.nodes):
            t.buffer = t.offset = None


def test_plan_survives_other_graphs_allocations(cpu):
    """Allocating other tensors (another graph, as a prompt batch between decode steps) keeps a
    graph's plan; moving one of its own tensors rebuilds it."""
    from lazyggml.alloc import alloc_ctx_tensors_from_buft
    from lazyggml.backends.cpu import cpu_buffer_type
    ctx = lg.Context(no_alloc=True)
    with ctx:
        a = ctx.new_tensor_1d(F32, 16)
        out = lg.scale(a, 3.0)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    alloc_ctx_tensors_from_buft(ctx, cpu_buffer_type())
    tensor_set(a, np.arange(16, dtype=np.float32))
    cpu.graph_compute(g)
    plan = cpu._plans[g]
    other = lg.Context(no_alloc=True)
    other.new_tensor_1d(F32, 8)
    alloc_ctx_tensors_from_buft(other, cpu_buffer_type())      # moves the epoch, not our tensors
    cpu.graph_compute(g)
    assert cpu._plans[g] is plan
    a.buffer, a.offset = out.buffer, out.offset                 # a now lives where out does
    tensor_set(a, np.ones(16, np.float32))
    cpu.graph_compute(g)
    assert cpu._plans[g] is not plan and np.array_equal(tensor_get(out).ravel(), np.full(16, 3.0))


def test_float16_rounding_matches_numpy(cpu):
    """F32 -> F16 rounds to nearest even, overflows to inf, keeps NaN and subnormals (F16C's)."""
    special = np.array([0.0, -0.0, 65504.0, 65519.0, 65520.0, -1e9, np.inf, -np.inf, np.nan, 1e-8,
                        5.96e-8, 2.98e-8, 3e-8, 6.1e-5, 1 + 2**-11, 1 + 3 * 2**-11], np.float32)
    x = np.concatenate([special, np.random.default_rng(SEED).standard_normal(1008).astype(np.float32) * 1e3])
    got = compute(cpu, lambda a: lg.cpy(a, new(F16, x.size)), x).ravel()
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(want)
    assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(got[nan]).all()


def test_bf16_rounding(cpu):
    x = np.random.default_rng(SEED).standard_normal(512).astype(np.float32)
    got = compute(cpu, lambda a: lg.cpy(a, new(BF16, x.size)), x)
    assert np.array_equal(got.ravel(), to_bf16_bits(x))


# ===================================================================================================
# graph-building errors: every op checks its operands where GGML asserts, raising ValueError that
# names the op
# ===================================================================================================
def _t(*ne, type_=F32):
    return lg.Context().new_tensor(type_, ne)


_BAD = [  # (the op named in the message, a thunk that must raise)
    ("add", lambda: lg.add(_t(4, 3), _t(3))),
    ("add", lambda: lg.add(_t(4, 3), _t(4, 2))),
    ("sub", lambda: lg.sub(_t(4, 3, 2), _t(4, 3, 4))),
    ("mul", lambda: lg.mul(_t(6), 2.0)),
    ("div", lambda: lg.div_inplace(_t(4), _t(8))),
    ("add1", lambda: lg.add1(_t(4), _t(2))),
    ("concat", lambda: lg.concat(_t(4, 3), _t(4, 3, type_=F16), 0)),
    ("concat", lambda: lg.concat(_t(4, 3), _t(4, 3), 4)),
    ("concat", lambda: lg.concat(_t(4, 3), _t(5, 2), 1)),
    ("repeat", lambda: lg.repeat(_t(3), _t(4))),
    ("silu", lambda: lg.silu(lg.transpose(_t(4, 3)))),
    ("gelu", lambda: lg.gelu(np.zeros(4, np.float32))),
    ("scale", lambda: lg.scale(lg.transpose(_t(4, 3)), 2.0)),
    ("clamp", lambda: lg.clamp(_t(4), 1.0, -1.0)),
    ("argmax", lambda: lg.argmax(_t(4, 3, 2))),
    ("norm", lambda: lg.norm(_t(4), -1e-5)),
    ("rms_norm", lambda: lg.rms_norm(_t(4), -1.0)),
    ("mul_mat", lambda: lg.mul_mat(_t(4, 3), _t(5, 2))),
    ("mul_mat", lambda: lg.mul_mat(_t(4, 3, 2), _t(4, 2, 3))),
    ("get_rows", lambda: lg.get_rows(_t(4, 3), _t(2))),
    ("get_rows", lambda: lg.get_rows(_t(4, 3, 2), _t(2, 3, type_=I32))),
    ("get_rows", lambda: lg.get_rows(_t(4, 3), [0, 1])),
    ("set_rows", lambda: lg.set_rows(_t(4, 5), _t(4, 2, type_=F16), _t(2, type_=I32))),
    ("set_rows", lambda: lg.set_rows(_t(4, 5), _t(4, 2), _t(2))),
    ("set_rows", lambda: lg.set_rows(_t(4, 5), _t(3, 2), _t(2, type_=I32))),
    ("set_rows", lambda: lg.set_rows(_t(4, 5), _t(4, 2), _t(3, type_=I32))),
    ("soft_max", lambda: lg.soft_max(lg.transpose(_t(4, 3)))),
    ("soft_max", lambda: lg.soft_max_ext(_t(4, 3), _t(4, 3, type_=I32))),
    ("soft_max", lambda: lg.soft_max_ext(_t(4, 3), _t(5, 3))),
    ("soft_max", lambda: lg.soft_max_ext(_t(4, 3), _t(4, 2))),
    ("soft_max", lambda: lg.soft_max_ext(_t(4, 3, 4), _t(4, 3, 3))),
    ("soft_max", lambda: lg.soft_max_ext(_t(4, 3), None, 1.0, 8.0)),
    ("rope", lambda: lg.rope(_t(8, 2, 3), _t(3, type_=I32), 8, 1)),
    ("rope", lambda: lg.rope(_t(8, 2, 3), _t(3), 8, 0)),
    ("rope", lambda: lg.rope(_t(8, 2, 3), _t(4, type_=I32), 8, 0)),
    ("rope", lambda: lg.rope(_t(8, 2, 3), _t(3, type_=I32), 7, 0)),
    ("rope", lambda: lg.rope(_t(8, 2, 3), _t(3, type_=I32), 10, 0)),
    ("rope", lambda: lg.rope_ext(_t(8, 2, 3), _t(3, type_=I32), _t(2), 8, 0)),
    ("swiglu", lambda: lg.swiglu(_t(5, 2))),
    ("geglu", lambda: lg.geglu_split(_t(4, 2), _t(4, 3))),
    ("reglu", lambda: lg.reglu_split(_t(4, 2), _t(4, 2, type_=F16))),
    ("pad", lambda: lg.pad_ext(_t(4, 2), -1, 0)),
    ("pad", lambda: lg.pad(_t(4, 2), 1.5)),
    ("reshape", lambda: lg.reshape_2d(lg.transpose(_t(4, 3)), 4, 3)),
    ("reshape", lambda: lg.reshape(_t(4, 3), _t(5, 2))),
    ("view", lambda: lg.view_1d(_t(4, 3), 4, 36)),
    ("view", lambda: lg.view_2d(_t(4, 3), 4, 3, 20, 0)),
    ("view", lambda: lg.view_1d(_t(4), 2, -4)),
    ("permute", lambda: lg.permute(_t(4, 3), 0, 1, 1, 3)),
    ("cpy", lambda: lg.cpy(_t(4, 3), _t(4, 4))),
    ("cont", lambda: lg.cont_2d(_t(4, 3), 5, 2)),
    ("dup", lambda: lg.dup(None)),
    ("sum_rows", lambda: lg.sum_rows("a")),
    ("diag_mask_inf", lambda: lg.diag_mask_inf(3, 0)),
    ("new_tensor", lambda: lg.Context().new_tensor(F32, [1, 2, 3, 4, 5])),
    ("new_tensor", lambda: lg.Context().new_tensor_2d(F32, 4, -1)),
]


@pytest.mark.parametrize("op, thunk", _BAD, ids=[f"{op}-{i}" for i, (op, _) in enumerate(_BAD)])
def test_graph_building_errors(op, thunk):
    with pytest.raises(ValueError) as e:
        thunk()
    assert op in str(e.value), str(e.value)


# ===================================================================================================
# parity with libggml itself (ggml-python, a test dependency): the same inputs through GGML's CPU
# backend. Most ops are bit-identical; the exceptions are GGML's lookup-table GELU (not compared),
# its exp (SILU, SWIGLU, SOFT_MAX: the AVX-512 build's ggml_v_expf rounds differently from the
# AVX2 one that lazyggml follows) and NORM's variance (summed in SIMD lanes, in an order that
# depends on the build), compared by NMSE instead.
# ===================================================================================================
def _ggml():
    return pytest.importorskip("ggml")


def run_libggml(specs, datas, build):
    """Build ``build(ggml, ctx, *inputs)`` with libggml, fill, compute, return the raw result."""
    import ctypes
    gg = _ggml()
    gtype = {F32: gg.GGML_TYPE_F32, F16: gg.GGML_TYPE_F16, BF16: gg.GGML_TYPE_BF16, I32: gg.GGML_TYPE_I32,
             Q4_0: gg.GGML_TYPE_Q4_0, Q8_0: gg.GGML_TYPE_Q8_0, Q4_K: gg.GGML_TYPE_Q4_K}
    ctx = gg.ggml_init(gg.ggml_init_params(mem_size=64 << 20, mem_buffer=None, no_alloc=False))
    try:
        ins = []
        for (t, ne), d in zip(specs, datas):
            x = gg.ggml_new_tensor_4d(ctx, gtype[t], *(list(ne) + [1] * (4 - len(ne))))
            ctypes.memmove(gg.ggml_get_data(x), np.ascontiguousarray(d).ctypes.data, gg.ggml_nbytes(x))
            ins.append(x)
        out = build(gg, ctx, *ins)
        gf = gg.ggml_new_graph(ctx)
        gg.ggml_build_forward_expand(gf, out)
        gg.ggml_graph_compute_with_ctx(ctx, gf, 1)
        return np.frombuffer(ctypes.string_at(gg.ggml_get_data(out), gg.ggml_nbytes(out)), np.uint8).copy()
    finally:
        gg.ggml_free(ctx)


def run_lazyggml(specs, datas, build, backend):
    ctx = lg.Context(no_alloc=False)
    ins = [ctx.new_tensor(t, ne) for t, ne in specs]
    for t, d in zip(ins, datas):
        tensor_set(t, d)
    out = build(*ins)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    backend_graph_compute(backend, g)   # compute and wait, as ggml_backend_graph_compute
    return lg.tensor_get_bytes(out)


def _rand(*shape, lo=-1.0, hi=1.0):
    return lambda rng: rng.uniform(lo, hi, shape).astype(np.float32)


def _positions(n, hi):
    return lambda rng: rng.integers(0, hi, n).astype(np.int32)


_PARITY = []


def parity(name, specs, makers, build_lg, gg_op, *gg_args, exact=True):
    """libggml's side is ``ggml_<gg_op>(ctx, *inputs, *gg_args)``."""
    def build_gg(g, c, *xs):
        return getattr(g, "ggml_" + gg_op)(c, *xs, *gg_args)
    _PARITY.append((name, specs, makers, build_lg, build_gg, exact))


_YARN = (512, 10000.0, 0.25, 1.0, 0.9, 32.0, 1.0)   # n_ctx_orig .. beta_slow
parity("rope normal yarn ff", [f32(64, 3, 7, 2), (I32, (7,)), f32(24)],
       [_rand(2, 7, 3, 64), _positions(7, 3000), _rand(24, lo=0.9, hi=1.1)],
       lambda x, p, f: lg.rope_ext(x, p, f, 48, 0, *_YARN), "rope_ext", 48, 0, *_YARN)
parity("rope neox yarn", [f32(64, 3, 7, 2), (I32, (7,))], [_rand(2, 7, 3, 64), _positions(7, 3000)],
       lambda x, p: lg.rope_ext(x, p, None, 64, 2, *_YARN), "rope_ext", None, 64, 2, *_YARN)
parity("rope neox", [f32(128, 4, 9), (I32, (9,))], [_rand(9, 4, 128), _positions(9, 5000)],
       lambda x, p: lg.rope_ext(x, p, None, 128, 2, 0, 500000.0),
       "rope_ext", None, 128, 2, 0, 500000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
parity("rms_norm", [f32(100, 4, 3)], [_rand(3, 4, 100)], lambda x: lg.rms_norm(x, 1e-6), "rms_norm", 1e-6)
parity("scale_bias", [f32(100, 4)], [_rand(4, 100)], lambda x: lg.scale_bias(x, 0.7, 0.2),
       "scale_bias", 0.7, 0.2)
parity("clamp", [f32(100, 4)], [_rand(4, 100)], lambda x: lg.clamp(x, -0.7, 0.2), "clamp", -0.7, 0.2)
parity("sum_rows", [f32(100, 4, 3)], [_rand(3, 4, 100)], lg.sum_rows, "sum_rows")
parity("mean", [f32(100, 4, 3)], [_rand(3, 4, 100)], lg.mean, "mean")
parity("argmax ties", [f32(4, 2)], [lambda r: np.array([[1, 3, 3, 2], [5, 5, 0, 5]], np.float32)],
       lg.argmax, "argmax")
parity("div broadcast", [f32(100, 4, 3), f32(100, 1, 3)], [_rand(3, 4, 100), _rand(3, 1, 100, lo=0.5, hi=2)],
       lg.div, "div")
parity("diag_mask_inf", [f32(10, 10, 2)], [_rand(2, 10, 10)], lambda x: lg.diag_mask_inf(x, 2),
       "diag_mask_inf", 2)
parity("get_rows q4_K", [(Q4_K, (256, 9)), (I32, (4,))],
       [lambda r: quants.quantize(Q4_K, r.uniform(-1, 1, (9, 256))),
        lambda r: np.array([3, 0, 8, 3], np.int32)],
       lg.get_rows, "get_rows")
parity("concat dim 1", [f32(6, 5, 4), f32(6, 2, 4)], [_rand(4, 5, 6), _rand(4, 2, 6)],
       lambda a, b: lg.concat(a, b, 1), "concat", 1)
for _type in (F16, BF16, Q4_0, Q8_0, Q4_K):
    parity(f"cpy f32 -> {_type.name}", [f32(256, 3), (_type, (256, 3))],
           [_rand(3, 256), lambda r, t=_type: np.zeros(3 * lg.row_size(t, 256), np.uint8)], lg.cpy, "cpy")
for _name in ("tanh", "elu", "sigmoid", "exp", "hardswish", "hardsigmoid", "sqr", "sin", "cos", "abs", "sgn",
              "step", "relu", "neg", "gelu_erf"):
    parity(_name, [f32(100, 4, 3)], [_rand(3, 4, 100, lo=-5, hi=5)], getattr(lg, _name), _name)
# not bit-identical: GGML's exp (AVX-512 build) and NORM's SIMD-lane variance sums differ in rounding
parity("norm", [f32(100, 4, 3)], [_rand(3, 4, 100)], lambda x: lg.norm(x, 1e-5), "norm", 1e-5, exact=False)
parity("silu", [f32(100, 4, 3)], [_rand(3, 4, 100, lo=-5, hi=5)], lg.silu, "silu", exact=False)
parity("swiglu", [f32(96, 4, 3)], [_rand(3, 4, 96, lo=-5, hi=5)], lg.swiglu, "swiglu", exact=False)
parity("soft_max_ext f16 mask alibi", [f32(32, 5, 6, 2), (F16, (32, 8, 2))],
       [_rand(2, 6, 5, 32, lo=-3, hi=3), lambda r: r.uniform(-1, 1, (2, 8, 32)).astype(np.float16)],
       lambda x, m: lg.soft_max_ext(x, m, 0.3, 8.0), "soft_max_ext", 0.3, 8.0, exact=False)


@pytest.mark.parametrize("name, specs, makers, build_lg, build_gg, exact", _PARITY, ids=[p[0] for p in _PARITY])
def test_parity_with_libggml(name, specs, makers, build_lg, build_gg, exact, cpu):
    _ggml()
    rng = np.random.default_rng(SEED)
    datas = [m(rng) for m in makers]
    got = run_lazyggml(specs, datas, build_lg, cpu)
    try:
        want = run_libggml(specs, datas, build_gg)
    except AttributeError as e:  # an older ggml-python without this op
        pytest.skip(str(e))
    if exact:
        assert np.array_equal(got, want), f"{name}: not bit-identical to libggml (seed {SEED})"
    else:
        a, b = got.view(np.float32).astype(np.float64), want.view(np.float32).astype(np.float64)
        assert nmse(a, b) < 1e-12, f"{name}: NMSE {nmse(a, b):.2e} vs libggml (seed {SEED})"
