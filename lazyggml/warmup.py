"""``lazyggml warmup``: compile every kernel ahead of time, into the on-disk cache (``cache.py``).

A Numba kernel is compiled the first time it is called with a new *signature*: the argument types,
which for an array means its dtype, number of dimensions, layout (C-contiguous or any strides),
alignment and whether it is writeable. A first run of a model therefore pays 0.1 to 2 s for each
of a hundred-odd kernels. With ``cache=True`` the machine code is written to the cache and later
processes load it in a few milliseconds; this module makes that first run happen up front.

What runs
---------
Signatures are decided by the glue that calls the kernels, so the only reliable way to produce
the signatures a real graph needs is to run real graphs. ``CASES`` is a table of tiny graphs, one
per op configuration that changes signatures: each op on contiguous tensors, on strided and
permuted views, in place, with each tensor type it accepts (``mul_mat`` and ``get_rows`` over
every weight type, copies and ``set_rows`` into every type), large enough to take the threaded
paths as well as the single-threaded ones; an attention block shaped like the model runner's (an
F16 KV cache written with ``set_rows``, permuted views, masked ``soft_max_ext``); the quantizers
and dequantizers of every type; and a small LLaMA model run end to end (the embedded default
model when it is there, else a random one from ``lazyggml.testing``), prompt then decode. Each
case runs on every selected backend that supports all its nodes.

Counting hits and misses
------------------------
While the cases run, ``Dispatcher.compile`` (Numba's, and numba-cuda's for CUDA kernels) is
wrapped: each call that loads a signature from the cache counts a **hit**, each that compiles one
counts a **miss** (Numba's own ``cache_hits`` / ``cache_misses`` counters decide which), with the
time spent in it, minus the time of kernels compiled inside it (a kernel that calls another
compiles the callee first). A second warm-up finds every entry point in the cache, so it reports
only hits; callees are inside their callers' machine code and are not loaded at all.

OpenCL kernels are compiled by the driver: once per program (``clBuildProgram``) and, with PoCL,
again per kernel and work-group size at the first launch. The program build and each kernel's
first launch are timed, and counted as a miss when the driver's cache (``POCL_CACHE_DIR``) gained a
file, or, for other drivers, when they took longer than ``OPENCL_MISS_S``.

``--check``
-----------
Runs the same cases without compiling: Numba's compiler is swapped for a function that raises, so
a signature missing from the cache counts as a miss and stops its case there (signatures found in
the cache are loaded and run, as in a real run). The exit status is 1 when anything would have
compiled. Every miss reported is real, but a case stopped early may hide more. An OpenCL driver
compiles inside the driver and cannot be stopped: ``--check`` runs the OpenCL cases and reports a
miss wherever the driver's cache grew.

``--jobs N``
------------
N worker processes take the case families (all cases sharing kernels, e.g. every ``mul_mat``
case) one at a time and warm them into the shared cache. Numba writes an index entry by reading
the index, adding the entry and writing it back, which loses entries (or pairs a key with another
signature's code) when two processes save signatures of one kernel at once; workers therefore save
under a file lock, writing the code before the index entry that names it.
"""
from __future__ import annotations

import contextlib
import fnmatch
import math
import os
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from numba.core.errors import NumbaPerformanceWarning

from . import cache
from . import ops as O
from .backend import DeviceType, tensor_set
from .registry import dev_count, dev_get
from .graph import Graph
from .ops import EMPTY_OPS
from .tensor import Context
from .types import Type, as_type, is_quantized, type_name

OPENCL_MISS_S = 0.1   # without a driver cache to look at: a first launch this slow compiled
_OPENCL_LAUNCHED = set()   # (device, kernel, work-group size) launched in this process

# every type with CPU kernels, as ``--types`` names them
ALL_TYPES = (Type.F32, Type.F16, Type.BF16, Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0,
             Type.Q8_1, Type.Q2_K, Type.Q3_K, Type.Q4_K, Type.Q5_K, Type.Q6_K, Type.Q8_K)
WEIGHT_TYPES = tuple(t for t in ALL_TYPES if t not in (Type.Q8_1, Type.Q8_K))  # mul_mat / get_rows


# =================================================================================================
# The cases
# =================================================================================================

@dataclass
class Case:
    """One tiny workload. ``run(backend)`` returns False when the backend cannot run it."""
    name: str
    family: str                 # cases of a family share kernels (a --jobs worker takes a family)
    run: Callable
    types: tuple = ()           # the types it exercises; () = float32 only, always selected


CASES: list[Case] = []


def _graph_case(name, family, build, types=()):
    """A case from ``build(ctx) -> output tensor(s)``: allocated on the backend, leafs filled with
    uniform [-1, 1] values (integer tensors with zeros: always valid row indices), computed."""
    CASES.append(Case(name, family, lambda backend: _run_graph(backend, build), tuple(types)))


def _fill(t, rng):
    shape = tuple(reversed(t.ne))
    if t.type in (Type.I32, Type.I64):
        return np.zeros(shape, np.int32 if t.type == Type.I32 else np.int64)
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    if t.type == Type.F16:
        return x.astype(np.float16)
    if t.type == Type.BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    if is_quantized(t.type):
        from .quants import quantize
        return quantize(t.type, x.reshape(-1, t.ne[0]))
    return x


def _run_graph(backend, build):
    from .alloc import alloc_ctx_tensors
    from .backends.cpu import common as cpu_common
    ctx = Context()
    with ctx:
        outs = build(ctx)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]

    def graph():
        g = Graph()
        for out in outs:
            g.build_forward_expand(out)
        return g

    g = graph()
    if not all(n.op in EMPTY_OPS or backend.device.supports_op(n) for n in g.nodes):
        return False
    buf = alloc_ctx_tensors(ctx, backend)
    try:
        rng = np.random.default_rng(0)
        for t in ctx.tensors():
            if t.op == O.Op.NONE and t.view_src is None:
                tensor_set(t, _fill(t, rng))
        backend.graph_compute(g)
        if backend.device.type == DeviceType.CPU:
            # small work runs the serial twins of common.parallel_kernel: compile the parallel kernels
            # too, in a new graph (a new plan) where every launch takes them
            small, cpu_common.PARALLEL_MIN_ELEMENTS = cpu_common.PARALLEL_MIN_ELEMENTS, 0
            try:
                backend.graph_compute(graph())
            finally:
                cpu_common.PARALLEL_MIN_ELEMENTS = small
        backend.synchronize()
    finally:
        buf.free()
    return True


def _new(ctx, t, *ne):
    return ctx.new_tensor(t, ne)


# -- element-wise: every op once on contiguous rows; strided, permuted and in-place variants ---------
_UNARY = ("abs", "sgn", "neg", "step", "tanh", "elu", "relu", "sigmoid", "gelu", "gelu_erf",
          "gelu_quick", "silu", "hardswish", "hardsigmoid", "exp", "sqr", "sqrt", "log", "sin", "cos")
for _op in _UNARY:
    _graph_case(_op, "unary", lambda ctx, f=getattr(O, _op): f(_new(ctx, Type.F32, 64, 4, 3)))
    _graph_case(f"{_op}(view with row gaps)", "unary", lambda ctx, f=getattr(O, _op):
                f(O.view_3d(a := _new(ctx, Type.F32, 40, 6, 3), 30, 6, 3, a.nb[1], a.nb[2], 5 * 4)))
_graph_case("sqr(transposed)", "unary", lambda ctx: O.sqr(O.transpose(_new(ctx, Type.F32, 7, 9, 3))))
_graph_case("silu_inplace", "unary", lambda ctx: O.silu_inplace(_new(ctx, Type.F32, 64, 4)))
_graph_case("scale", "unary", lambda ctx: O.scale(_new(ctx, Type.F32, 64, 4), 0.5))
_graph_case("scale_inplace", "unary", lambda ctx: O.scale_inplace(_new(ctx, Type.F32, 64, 4), 0.5))
_graph_case("scale_bias", "unary", lambda ctx: O.scale_bias(_new(ctx, Type.F32, 64, 4), 0.5, 0.25))
_graph_case("clamp", "unary", lambda ctx: O.clamp(_new(ctx, Type.F32, 64, 4), -0.5, 0.5))
_graph_case("silu(large)", "unary", lambda ctx: O.silu(_new(ctx, Type.F32, 4096, 16)))

for _op in ("add", "sub", "mul", "div"):
    _f = getattr(O, _op)
    _graph_case(_op, "binary", lambda ctx, f=_f: f(_new(ctx, Type.F32, 64, 4, 3), _new(ctx, Type.F32, 64, 4, 3)))
    _graph_case(f"{_op}(broadcast)", "binary", lambda ctx, f=_f:
                f(_new(ctx, Type.F32, 64, 4, 3), _new(ctx, Type.F32, 64, 1, 3)))
    _graph_case(f"{_op}_inplace", "binary", lambda ctx, f=getattr(O, _op + "_inplace"):
                f(_new(ctx, Type.F32, 64, 4), _new(ctx, Type.F32, 64, 1)))
    _graph_case(f"{_op}(permuted, transposed)", "binary", lambda ctx, f=_f:
                f(O.permute(_new(ctx, Type.F32, 6, 5, 4, 2), 1, 0, 2, 3),
                  O.transpose(_new(ctx, Type.F32, 6, 5, 4, 1))))
_graph_case("add(view with row gaps)", "binary", lambda ctx:
            O.add(O.view_3d(a := _new(ctx, Type.F32, 12, 6, 2), 8, 6, 2, a.nb[1], a.nb[2], 8),
                  _new(ctx, Type.F32, 8, 1, 2)))
_graph_case("add1", "binary", lambda ctx: O.add1(_new(ctx, Type.F32, 64, 4), _new(ctx, Type.F32, 1)))
_graph_case("add(large)", "binary", lambda ctx: O.add(_new(ctx, Type.F32, 4096, 16), _new(ctx, Type.F32, 4096, 16)))

for _op in ("swiglu", "geglu", "reglu"):
    _graph_case(_op, "glu", lambda ctx, f=getattr(O, _op): f(_new(ctx, Type.F32, 64, 4)))
    _graph_case(f"{_op}_split", "glu", lambda ctx, f=getattr(O, _op + "_split"):
                f(_new(ctx, Type.F32, 64, 4), _new(ctx, Type.F32, 64, 4)))
_graph_case("swiglu_swapped", "glu", lambda ctx: O.swiglu_swapped(_new(ctx, Type.F32, 64, 4)))
_graph_case("swiglu(view with row gaps)", "glu", lambda ctx:
            O.swiglu(O.view_3d(a := _new(ctx, Type.F32, 30, 4, 2), 20, 4, 2, a.nb[1], a.nb[2], 6 * 4)))
_graph_case("swiglu_split(large)", "glu", lambda ctx:
            O.swiglu_split(_new(ctx, Type.F32, 4096, 16), _new(ctx, Type.F32, 4096, 16)))

# -- reductions, norms, soft_max, rope ---------------------------------------------------------------
for _op in ("sum", "sum_rows", "mean"):
    _graph_case(_op, "reduce", lambda ctx, f=getattr(O, _op): f(_new(ctx, Type.F32, 33, 5, 3)))
_graph_case("argmax", "reduce", lambda ctx: O.argmax(_new(ctx, Type.F32, 100, 12)))
_graph_case("sum_rows(permuted)", "reduce", lambda ctx:
            O.sum_rows(O.permute(_new(ctx, Type.F32, 6, 7, 3, 2), 2, 1, 0, 3)))
_graph_case("argmax(transposed)", "reduce", lambda ctx: O.argmax(O.transpose(_new(ctx, Type.F32, 12, 50))))

for _op in ("norm", "rms_norm"):
    _graph_case(_op, "norm", lambda ctx, f=getattr(O, _op): f(_new(ctx, Type.F32, 64, 5, 3), 1e-5))
    _graph_case(f"{_op}_inplace", "norm", lambda ctx, f=getattr(O, _op + "_inplace"):
                f(_new(ctx, Type.F32, 64, 4), 1e-5))
    _graph_case(f"{_op}(permuted)", "norm", lambda ctx, f=getattr(O, _op):
                f(O.permute(_new(ctx, Type.F32, 6, 20, 3), 1, 0, 2, 3), 1e-5))

_graph_case("soft_max", "soft_max", lambda ctx: O.soft_max(_new(ctx, Type.F32, 37, 5, 3)))
_graph_case("soft_max_inplace", "soft_max", lambda ctx: O.soft_max_inplace(_new(ctx, Type.F32, 37, 5)))
for _mt in (Type.F32, Type.F16):
    _graph_case(f"soft_max_ext(mask {type_name(_mt)})", "soft_max", lambda ctx, mt=_mt:
                O.soft_max_ext(_new(ctx, Type.F32, 32, 7, 4), _new(ctx, mt, 32, 7), 0.125, 0.0))
    _graph_case(f"soft_max_ext(mask {type_name(_mt)}, alibi)", "soft_max", lambda ctx, mt=_mt:
                O.soft_max_ext(_new(ctx, Type.F32, 16, 3, 6), _new(ctx, mt, 16, 4), 1.0, 8.0))
_graph_case("soft_max_ext(scale only)", "soft_max", lambda ctx:
            O.soft_max_ext(_new(ctx, Type.F32, 16, 4), None, 0.3))
_graph_case("diag_mask_inf", "soft_max", lambda ctx: O.diag_mask_inf(_new(ctx, Type.F32, 10, 7, 3), 2))
_graph_case("diag_mask_inf_inplace", "soft_max", lambda ctx: O.diag_mask_inf_inplace(_new(ctx, Type.F32, 8, 8, 2), 1))

for _mode in (O.ROPE_TYPE_NORMAL, O.ROPE_TYPE_NEOX):
    _graph_case(f"rope_ext(mode={_mode})", "rope", lambda ctx, m=_mode:
                O.rope_ext(_new(ctx, Type.F32, 64, 4, 5), _new(ctx, Type.I32, 5), None, 64, m))
    _graph_case(f"rope_ext(mode={_mode}, freq factors, yarn)", "rope", lambda ctx, m=_mode:
                O.rope_ext(_new(ctx, Type.F32, 48, 2, 4), _new(ctx, Type.I32, 4), _new(ctx, Type.F32, 16), 32, m,
                           4096, 500000.0, 0.5, 0.5, 0.8, 16.0, 2.0))
    _graph_case(f"rope_ext_inplace(mode={_mode}, view)", "rope", lambda ctx, m=_mode:
                O.rope_ext_inplace(O.view_3d(qkv := _new(ctx, Type.F32, 96, 5), 16, 2, 5, 16 * 4, qkv.nb[1], 64 * 4),
                                   _new(ctx, Type.I32, 5), None, 16, m))

# -- rows and copies: every type -------------------------------------------------------------------
for _t in WEIGHT_TYPES:
    for _it in (Type.I32, Type.I64):
        _graph_case(f"get_rows({type_name(_t)}, {type_name(_it)} ids)", "rows", lambda ctx, t=_t, it=_it:
                    O.get_rows(_new(ctx, t, 256, 6, 2), _new(ctx, it, 3, 2)), (_t,))
        _graph_case(f"set_rows({type_name(_t)}, {type_name(_it)} ids)", "rows", lambda ctx, t=_t, it=_it:
                    O.set_rows(_new(ctx, t, 256, 6, 2), _new(ctx, Type.F32, 256, 3, 2), _new(ctx, it, 3, 2)), (_t,))
for _t in WEIGHT_TYPES[1:]:
    _graph_case(f"cpy(f32 -> {type_name(_t)})", "copy", lambda ctx, t=_t:
                O.cpy(_new(ctx, Type.F32, 256, 4), _new(ctx, t, 256, 4)), (_t,))
    _graph_case(f"cpy({type_name(_t)} -> f32)", "copy", lambda ctx, t=_t:
                O.cpy(_new(ctx, t, 256, 4), _new(ctx, Type.F32, 256, 4)), (_t,))
_graph_case("get_rows(i32)", "rows", lambda ctx: O.get_rows(_new(ctx, Type.I32, 8, 6), _new(ctx, Type.I32, 3)))
for _t in (Type.F32, Type.F16, Type.BF16):
    _graph_case(f"cpy(permuted {type_name(_t)} -> f32)", "copy", lambda ctx, t=_t:
                O.cpy(O.permute(_new(ctx, t, 8, 6, 4), 1, 0, 2, 3), _new(ctx, Type.F32, 6, 8, 4)), (_t,))
    _graph_case(f"cpy(f32 -> view of {type_name(_t)})", "copy", lambda ctx, t=_t:
                O.cpy(_new(ctx, Type.F32, 8, 4), O.view_2d(d := _new(ctx, t, 12, 4), 8, 4, d.nb[1], 0)), (_t,))
_graph_case("cpy(f32 -> i32)", "copy", lambda ctx: O.cpy(_new(ctx, Type.F32, 8, 4), _new(ctx, Type.I32, 8, 4)))
_graph_case("cpy(i32 -> f32)", "copy", lambda ctx: O.cpy(_new(ctx, Type.I32, 8, 4), _new(ctx, Type.F32, 8, 4)))
_graph_case("dup", "copy", lambda ctx: O.dup(_new(ctx, Type.F32, 16, 4)))
_graph_case("cont(permuted)", "copy", lambda ctx: O.cont(O.permute(_new(ctx, Type.F32, 8, 6, 4, 2), 1, 2, 0, 3)))
_graph_case("cont(transposed)", "copy", lambda ctx: O.cont(O.transpose(_new(ctx, Type.F32, 8, 6))))
_graph_case("concat", "shape", lambda ctx: [O.concat(_new(ctx, Type.F32, 8, 4, 3), _new(ctx, Type.F32, 8, 4, 3), d)
                                             for d in range(3)])
_graph_case("pad", "shape", lambda ctx: O.pad(_new(ctx, Type.F32, 8, 4, 3), 2, 1, 1))
_graph_case("repeat", "shape", lambda ctx: O.repeat(_new(ctx, Type.F32, 8, 1, 3), _new(ctx, Type.F32, 8, 4, 3)))


# -- mul_mat: every weight type, mat-vec and matrix, single-threaded and threaded sizes --------------
def _mul_mat(t, k, m, n, permuted=False):
    def build(ctx):
        w = _new(ctx, t, k, m)
        if permuted:  # activations as a permuted view, as attention passes them
            return O.mul_mat(w, O.permute(_new(ctx, Type.F32, k, 1, n), 0, 2, 1, 3))
        return O.mul_mat(w, _new(ctx, Type.F32, k, n))
    return build


for _t in WEIGHT_TYPES:
    for _m, _n in ((16, 1), (16, 4), (16, 32), (4096, 1), (512, 32)):
        _graph_case(f"mul_mat({type_name(_t)}, m={_m}, n={_n})", "mul_mat", _mul_mat(_t, 256, _m, _n), (_t,))
    _graph_case(f"mul_mat({type_name(_t)}, permuted activations)", "mul_mat", _mul_mat(_t, 256, 16, 8, True), (_t,))
_graph_case("mul_mat(f32, broadcast over batch)", "mul_mat", lambda ctx:
            O.mul_mat(_new(ctx, Type.F32, 32, 16, 2), _new(ctx, Type.F32, 32, 8, 4)))


# -- attention as the model runner builds it --------------------------------------------------------
def _attention(n_tokens, n_kv=64, hd=32, n_head=4, n_head_kv=2):
    """One layer's attention: rope, K/V written into an F16 cache by set_rows, masked soft_max."""
    def build(ctx):
        q = _new(ctx, Type.F32, hd, n_head, n_tokens)
        k = _new(ctx, Type.F32, hd, n_head_kv, n_tokens)
        v = _new(ctx, Type.F32, hd * n_head_kv, n_tokens)
        pos, idx = _new(ctx, Type.I32, n_tokens), _new(ctx, Type.I64, n_tokens)
        mask = _new(ctx, Type.F32, n_kv, n_tokens)
        kc, vc = _new(ctx, Type.F16, hd * n_head_kv, n_kv), _new(ctx, Type.F16, hd * n_head_kv, n_kv)
        q = O.rope_ext(q, pos, None, hd, O.ROPE_TYPE_NORMAL)
        k = O.rope_ext(k, pos, None, hd, O.ROPE_TYPE_NORMAL)
        kw = O.set_rows(kc, O.reshape_2d(k, hd * n_head_kv, n_tokens), idx)
        vw = O.set_rows(vc, v, idx)
        kv = O.view_3d(kc, hd, n_head_kv, n_kv, kc.nb[1] // n_head_kv, kc.nb[1], 0)
        vv = O.view_3d(vc, hd, n_head_kv, n_kv, vc.nb[1] // n_head_kv, vc.nb[1], 0)
        kq = O.soft_max_ext(O.mul_mat(O.permute(kv, 0, 2, 1, 3), O.permute(q, 0, 2, 1, 3)), mask,
                            1.0 / math.sqrt(hd), 0.0)
        kqv = O.mul_mat(O.cont(O.permute(vv, 1, 2, 0, 3)), kq)
        return [kw, vw, O.cont_2d(O.permute(kqv, 0, 2, 1, 3), hd * n_head, n_tokens)]
    return build


for _n in (1, 8, 64):
    _graph_case(f"attention(n_tokens={_n})", "attention", _attention(_n), (Type.F16,))


# -- quantize / dequantize of every type (threaded above 65536 elements) --------------------------------
def _quants(t):
    def run(backend):
        from .backends.cpu import CPUBackend
        from .quants import dequantize, quantize
        if not isinstance(backend, CPUBackend):
            return False
        rng = np.random.default_rng(0)
        for shape in ((1, 256), (64, 2048)):
            dequantize(t, quantize(t, rng.uniform(-1, 1, shape).astype(np.float32)), shape[1])
        return True
    return run


for _t in ALL_TYPES[1:]:
    CASES.append(Case(f"quantize/dequantize({type_name(_t)})", "quants", _quants(_t), (_t,)))


# -- a model, prompt then decode ------------------------------------------------------------------------
def _run_model(backend):
    from .backends.cpu import CPUBackend
    from .models import default_model_path
    from .models.llama import load_model
    path = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        if not path.exists():
            from .testing import make_tiny_llama
            path = make_tiny_llama(os.path.join(tmp, "tiny.gguf"), n_embd=256, n_ff=512, n_vocab=512,
                                   n_head=4, n_head_kv=2)
        on_cpu = isinstance(backend, CPUBackend)
        model = load_model(path, n_gpu_layers=0 if on_cpu else 10**6, device=None if on_cpu else backend.name)
        for _ in model.generate("The quick brown fox jumps over the lazy dog.", 3, seed=0):
            pass
    return True


CASES.append(Case("llama model: prompt and decode", "model", _run_model, ()))


# =================================================================================================
# Recording what compiles
# =================================================================================================

class WouldCompile(Exception):
    """Raised in ``--check`` mode where a kernel would have to be compiled."""


@dataclass
class Kernel:
    backend: str
    name: str
    signature: str
    status: str                 # "hit" or "miss"
    seconds: float


@dataclass
class Recorder:
    """Wraps the compile entry points while cases run and collects a ``Kernel`` per cache event."""
    check: bool = False
    kernels: list = field(default_factory=list)
    _stack: list = field(default_factory=list)

    def _wrap(self, cls, backend):
        orig = cls.compile
        rec = self

        def compile(disp, sig):
            from numba.core import sigutils
            args = tuple(sigutils.normalize_signature(sig)[0])
            if args in disp.overloads or not disp.py_func.__module__.startswith("lazyggml"):
                return orig(disp, sig)  # in memory already, or Numba's own helper inside a kernel
            hits, misses = sum(disp._cache_hits.values()), sum(disp._cache_misses.values())
            rec._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                with _no_compile(disp) if rec.check and backend == "cuda" else contextlib.nullcontext():
                    return orig(disp, sig)
            finally:
                dt = time.perf_counter() - t0
                inner = rec._stack.pop()
                if rec._stack:
                    rec._stack[-1] += dt
                status = ("hit" if sum(disp._cache_hits.values()) > hits else
                          "miss" if sum(disp._cache_misses.values()) > misses else None)
                if status:
                    f = disp.py_func
                    rec.kernels.append(Kernel(backend, f"{f.__module__}.{f.__qualname__}",
                                              "(" + ", ".join(map(str, args)) + ")", status, dt - inner))
        return orig, compile

    def _wrap_opencl(self):
        """Patches timing each OpenCL device's program build (its first ``kernels()`` call) and each
        kernel's first launch per device and work-group size."""
        from .backends.opencl import OpenCLBackend, OpenCLDevice
        rec, seen = self, _OPENCL_LAUNCHED
        orig_kernels, orig_launch = OpenCLDevice.kernels, OpenCLBackend.launch

        def timed(device, what, detail, run, queue=None):
            pocl = device.cl_device.platform.name == "Portable Computing Language"
            n0, t0 = _pocl_files() if pocl else 0, time.perf_counter()
            result = run()
            if queue is not None:
                queue.finish()
            dt = time.perf_counter() - t0
            miss = _pocl_files() > n0 if pocl else dt > OPENCL_MISS_S
            rec.kernels.append(Kernel(device.name, what, detail, "miss" if miss else "hit", dt))
            return result

        def kernels(device):
            if device._kernels is not None:
                return orig_kernels(device)
            return timed(device, "program", "", lambda: orig_kernels(device))

        def launch(backend, name, gsize, lsize, *args):
            key = (backend.device.name, name, tuple(lsize))
            if key in seen:
                return orig_launch(backend, name, gsize, lsize, *args)
            seen.add(key)
            backend.queue.finish()
            return timed(backend.device, name, f"(local size {tuple(lsize)})",
                         lambda: orig_launch(backend, name, gsize, lsize, *args), backend.queue)
        return [(OpenCLDevice, "kernels", orig_kernels, kernels), (OpenCLBackend, "launch", orig_launch, launch)]

    @contextlib.contextmanager
    def active(self, cuda=False, opencl=False):
        from numba.core import dispatcher
        patches = [(dispatcher.Dispatcher, "compile", *self._wrap(dispatcher.Dispatcher, "cpu"))]
        if cuda and not _cuda_simulated():        # the simulator interprets: nothing to compile
            from numba.cuda.dispatcher import CUDADispatcher
            patches.append((CUDADispatcher, "compile", *self._wrap(CUDADispatcher, "cuda")))
        if opencl:
            patches += self._wrap_opencl()
        if self.check:
            patches.append((dispatcher._FunctionCompiler, "compile", dispatcher._FunctionCompiler.compile, _refuse))
        for cls, attr, _, new in patches:
            setattr(cls, attr, new)
        try:
            yield self
        finally:
            for cls, attr, orig, _ in patches:
                setattr(cls, attr, orig)


def _cuda_simulated():
    from .backends.cuda import simulated
    return simulated()


def _refuse(compiler, args, return_type):
    raise WouldCompile(f"{compiler.py_func.__module__}.{compiler.py_func.__qualname__}")


@contextlib.contextmanager
def _no_compile(disp):
    """numba-cuda checks ``_can_compile`` after its cache lookup: a miss raises, a hit loads."""
    disp._can_compile = False
    try:
        yield
    except RuntimeError as e:
        raise WouldCompile(str(e)) from e
    finally:
        disp._can_compile = True


def _pocl_files():
    """The number of compiled programs and kernels in PoCL's cache (not its temporary files)."""
    root = os.environ.get("POCL_CACHE_DIR")
    if not root:
        return 0
    return sum(not f.startswith("tempfile") and f != "last_accessed" for _, _, files in os.walk(root) for f in files)


@contextlib.contextmanager
def _locked_cache_saves():
    """Make Numba's cache saves safe between processes (see the module docstring)."""
    import fcntl

    from numba.core.caching import IndexDataCacheFile
    orig = IndexDataCacheFile.save
    lock_path = os.path.join(cache.CACHE_DIR, ".warmup.lock")
    os.makedirs(cache.CACHE_DIR, exist_ok=True)

    def save(self, key, data):
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            overloads = self._load_index()
            name = overloads.get(key)
            if name is None:
                used = set(overloads.values())
                name = next(n for n in map(self._data_name, range(1, len(used) + 2)) if n not in used)
            self._save_data(name, data)
            overloads[key] = name
            self._save_index(overloads)
    IndexDataCacheFile.save = save
    try:
        yield
    finally:
        IndexDataCacheFile.save = orig


# =================================================================================================
# Running
# =================================================================================================

BACKEND_KINDS = ("cpu", "opencl", "cuda")


def _kind(dev_name):
    """"cpu", "opencl" or "cuda" for lazyggml's own devices (CPU, OpenCL0, CUDA0...), else None."""
    return next((k for k in BACKEND_KINDS if dev_name.lower().startswith(k)), None)


def select_devices(kinds=None):
    """The registered devices of the wanted kinds (all when None); ValueError if a kind is absent."""
    devs = [d for d in (dev_get(i) for i in range(dev_count())) if _kind(d.name)]
    if kinds is None:
        return devs
    missing = [k for k in kinds if not any(_kind(d.name) == k for d in devs)]
    if missing:
        raise ValueError(f"no {', '.join(missing)} device here; found {', '.join(d.name for d in devs)}")
    return [d for d in devs if _kind(d.name) in kinds]


def select_cases(types=None, patterns=None):
    """The cases for ``types`` (all when None) whose names match one of the ``fnmatch`` patterns."""
    return [c for c in CASES
            if (types is None or not c.types or any(t in types for t in c.types))
            and (patterns is None or any(fnmatch.fnmatchcase(c.name, p) for p in patterns))]


@dataclass
class Outcome:
    case: str
    backend: str
    ran: bool = False           # False: the backend does not support the case (or --check stopped it)
    kernels: list = field(default_factory=list)
    error: str = ""


def run_cases(device_names, case_names, check=False, locked=False):
    """Run the named cases on the named devices in this process; a list of ``Outcome``."""
    devices = [d for d in select_devices() if d.name in device_names]
    kinds = {_kind(d.name) for d in devices}
    recorder = Recorder(check)
    by_name = {c.name: c for c in CASES}
    outcomes = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", NumbaPerformanceWarning)   # tiny grids, strided views: on purpose
        stack.enter_context(recorder.active(cuda="cuda" in kinds, opencl="opencl" in kinds))
        if locked:
            stack.enter_context(_locked_cache_saves())
        backends = [d.init_backend() for d in devices]
        setup = {}                          # what compiled while the backends started (OpenCL programs)
        for k in recorder.kernels:
            setup.setdefault(k.backend, []).append(k)
        del recorder.kernels[:]
        for name in case_names:
            for b in backends:
                n0 = len(recorder.kernels)
                out = Outcome(name, b.name)
                try:
                    out.ran = bool(by_name[name].run(b))
                except WouldCompile:
                    pass
                except Exception as e:  # a broken case must not hide the others
                    out.error = f"{type(e).__name__}: {e}"
                out.kernels = setup.pop(b.name, []) + recorder.kernels[n0:]
                outcomes.append(out)
    return outcomes


def _run_family(device_names, case_names, check):
    """A ``--jobs`` worker's task: one family of cases, cache saves under the lock."""
    return run_cases(device_names, case_names, check, locked=True)


def _families(cases):
    fam = {}
    for c in cases:
        fam.setdefault(c.family, []).append(c.name)
    return sorted(fam.values(), key=len, reverse=True)


def warmup(kinds=None, types=None, patterns=None, jobs=1, check=False, out=sys.stdout):
    """Run the warm-up (the ``lazyggml warmup`` command); returns the exit status.

    ``kinds``: backend kinds (``"cpu"``, ``"opencl"``, ``"cuda"``), ``types``: tensor types or their
    names, ``patterns``: ``fnmatch`` patterns of case names; None selects everything."""
    from tqdm import tqdm

    try:
        if kinds is not None:
            kinds = [k.lower() for k in kinds]
            unknown = [k for k in kinds if k not in BACKEND_KINDS]
            if unknown:
                raise ValueError(f"unknown backend {unknown[0]!r}; choose from {', '.join(BACKEND_KINDS)}")
        types = None if types is None else [as_type(t) for t in types]
        devices = select_devices(kinds)
    except ValueError as e:
        print(f"lazyggml warmup: {e}", file=sys.stderr)
        return 2
    cases = select_cases(types, patterns)
    names = [d.name for d in devices]
    print(f"kernel cache: {cache.CACHE_DIR}", file=out)
    if any(_kind(n) == "opencl" for n in names):
        from .backends.opencl import cache_dir
        driver_cache = os.environ.get("POCL_CACHE_DIR", "the driver's own")
        print(f"OpenCL program cache: {cache_dir('opencl')}; driver cache: {driver_cache}", file=out)
    print(f"{'checking' if check else 'warming'} {len(cases)} cases on {', '.join(names)}"
          + (f" in {jobs} processes" if jobs > 1 else ""), file=out)
    t0 = time.perf_counter()
    bar = tqdm(total=len(cases) * len(devices), unit="case", file=sys.stderr, disable=None)
    outcomes = []

    def report(batch):
        for o in batch:
            for k in o.kernels:
                verb = {"hit": "hit ", "miss": "would compile" if check else "miss"}[k.status]
                bar.write(f"  {verb}  {k.seconds:7.3f} s  {k.backend:8s} {k.name}{k.signature}", file=out)
            if o.error:
                bar.write(f"  FAILED  {o.case} on {o.backend}: {o.error}", file=out)
        outcomes.extend(batch)
        bar.update(len(batch))

    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_run_family, names, fam, check) for fam in _families(cases)]
            for f in as_completed(futures):
                report(f.result())
    else:
        for c in cases:
            report(run_cases(names, [c.name], check))
    bar.close()

    family = {c.name: c.family for c in CASES}
    not_run = {}
    for o in outcomes:
        if not o.ran and not o.error:
            not_run.setdefault(o.backend, Counter())[family[o.case]] += 1
    for backend, counts in not_run.items():
        print(f"not run on {backend}{' (unsupported, or stopped by --check)' if check else ' (unsupported)'}: "
              + ", ".join(f"{f} x{n}" for f, n in counts.items()), file=out)
    kernels = [k for o in outcomes for k in o.kernels]
    hits = sum(k.status == "hit" for k in kernels)
    misses = len(kernels) - hits
    failed = [o for o in outcomes if o.error]
    skipped = sum(not o.ran and not o.error for o in outcomes)
    compile_s = sum(k.seconds for k in kernels if k.status == "miss")
    print(f"{len(outcomes) - skipped - len(failed)} case runs, {skipped} not run, {len(failed)} failed; "
          f"{time.perf_counter() - t0:.1f} s in all, {compile_s:.1f} s compiling", file=out)
    print(f"hits={hits} misses={misses}", file=out)
    if failed:
        return 2
    return 1 if check and misses else 0
