"""A plan's kernel calls replayed from native code: one Python call for a whole run of them (the
CPU's counterpart of a CUDA graph).

Why: calling a compiled Numba kernel from Python costs more than many of a decode step's kernels
do. Its entry point converts every argument from its Python object (an array ~0.1-0.2 µs, whose
shape, strides and data pointer are read back from the object), and a decode step of the embedded
3.7M model is ~80 calls with ~6 arrays each: measured with empty kernels of the same signatures,
the calls alone took 67-74 µs a step, ~15% of the step. A plan's arguments never change between
replays (``table.py``), so they can be converted once.

How (``bind(steps)``, when a plan has run once and every kernel is compiled):

* each Numba step's arguments are written, as the native struct Numba passes them in (the arrays'
  data pointers, shapes and strides), into one ``area`` array, after the address of the kernel's
  compiled function (``_bind``: ``pool._store_args``'s idea);
* ``_bind`` also returns the address of an *entry* compiled for that signature: it reads the
  struct back and calls the kernel's function with Numba's calling convention, through the
  address; the kernel's own code is not linked in again, so an entry is small to compile (once per
  argument signature, then from the cache);
* ``replay(table, area, bad)`` calls the entries of the steps in order. A kernel's
  exception is raised from it; a step of ``table.Checked`` (whose kernel returns how many indices
  were out of range) that finds some stops the run, and Python raises its error.

``LAZYGGML_CPU_REPLAY=0`` turns it off: each kernel is then called from Python (its compiled entry
point, ``table.compiled``), one plan step each, which is what a per-kernel profile wants.

The arrays' memory owners are left out of the structs (``pool._borrowed``): no reference counts
change, and the plan's argument tuples keep the arrays alive as long as the replay can run. Steps
that are not Numba kernels (a NumPy call, a Python function) stay Python calls between the native
runs.
"""
from __future__ import annotations

import re

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba._dispatcher import compute_fingerprint
from numba.core import cgutils
from numba.extending import intrinsic

from ... import debug
from ...cache import tie_cache
from . import pool
from .pool import _borrowed
from .table import Checked, _arg_type, check_indices, compiled

ENABLED = debug.flag("LAZYGGML_CPU_REPLAY")
_HEAD = 8    # bytes before a step's arguments in the area: the kernel's address
_ENTRY_ARGS = (types.CPointer(types.int8),)   # an entry's argument: its step's place in the area
_I64 = ir.IntType(64)


def _step_struct(context, builder, area, off, lt):
    """(pointer to the kernel address, pointer to the arguments as ``lt``) of the step at byte
    ``off`` of the int64 array ``area``."""
    p = builder.gep(builder.bitcast(area, ir.IntType(8).as_pointer()), [off])
    head = builder.bitcast(p, _I64.as_pointer())
    args = builder.bitcast(builder.gep(p, [ir.Constant(_I64, _HEAD)]), lt.as_pointer())
    return head, args


def _entry(context, builder, args, ret):
    """The entry for arguments ``args`` (a tuple type) of a kernel returning ``ret`` (none or an
    integer): declared once per module, returns it as an address."""
    mod = builder.module
    name = re.sub(r"\W", "_", f"lazyggml_replay_entry_{args}_{ret}")
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, context.call_conv.get_function_type(types.int64, _ENTRY_ARGS), name=name)
        context.call_conv.decorate_function(fn, ("step",), _ENTRY_ARGS)
        fn.linkage = "internal"
        b = ir.IRBuilder(fn.append_basic_block())
        (step,) = context.call_conv.get_arguments(fn)
        lt = context.get_value_type(args)
        head, argp = _step_struct(context, b, step, ir.Constant(_I64, 0), lt)
        val = _borrowed(context, b, args, b.load(argp))
        argtys = tuple(args)
        fnty = context.call_conv.get_function_type(ret, argtys)
        kernel = b.inttoptr(b.load(head), fnty.as_pointer())
        status, res = context.call_conv.call_function(b, kernel, ret, argtys,
                                                      [b.extract_value(val, i) for i in range(len(argtys))])
        with cgutils.if_unlikely(b, status.is_error):   # the kernel raised: hand its status on
            b.store(status.excinfoptr, fn.args[1])
            b.ret(status.code)
        out = ir.Constant(_I64, 0) if ret == types.none else context.cast(b, res, ret, types.int64)
        context.call_conv.return_value(b, out)
    return builder.ptrtoint(fn, _I64)


@intrinsic
def _bind_step(typingctx, area, off, kernel, args, ret):
    """Write step (``kernel``'s address, ``args``) at byte ``off`` of ``area`` if it fits there;
    return (the entry's address, the bytes the step takes)."""
    if not isinstance(args, types.BaseTuple) or not (ret == types.none or isinstance(ret, types.Integer)):
        return None
    sig = types.UniTuple(types.int64, 2)(area, off, kernel, args, ret)

    def codegen(context, builder, sig, llargs):
        area_v, off_v, kernel_v, args_v, _ = llargs
        lt = context.get_value_type(args)
        size = _HEAD + -(-context.get_abi_sizeof(lt) // 8) * 8
        ary = context.make_array(sig.args[0])(context, builder, area_v)
        room = builder.mul(ary.nitems, ir.Constant(_I64, 8))
        with builder.if_then(builder.icmp_signed("<=", builder.add(off_v, ir.Constant(_I64, size)), room)):
            head, argp = _step_struct(context, builder, ary.data, off_v, lt)
            builder.store(kernel_v, head)
            builder.store(args_v, argp)
        entry = _entry(context, builder, args, ret)
        return cgutils.pack_array(builder, [entry, ir.Constant(_I64, size)])

    return sig, codegen


@njit(cache=True)
def _bind(area, off, kernel, args, ret):
    return _bind_step(area, off, kernel, args, ret)


@intrinsic
def _call(typingctx, entry, area, off):
    """Call the entry at address ``entry`` for the step at byte ``off`` of ``area``; its result."""
    def codegen(context, builder, sig, llargs):
        ary = context.make_array(sig.args[1])(context, builder, llargs[1])
        p = builder.gep(builder.bitcast(ary.data, ir.IntType(8).as_pointer()), [llargs[2]])
        fnty = context.call_conv.get_function_type(types.int64, _ENTRY_ARGS)
        status, res = context.call_conv.call_function(builder, builder.inttoptr(llargs[0], fnty.as_pointer()),
                                                      types.int64, _ENTRY_ARGS, [p])
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return res

    return types.int64(entry, area, off), codegen


@njit(cache=True)
def replay(table, area, bad):
    """Run the steps of ``table`` (a row each: entry address, byte offset in ``area``) in order; a
    step whose kernel returns non-zero (a count of bad indices) stops the run: ``bad`` gets (step,
    count)."""
    for i in range(table.shape[0]):
        r = _call(table[i, 0], area, table[i, 1])
        if r != 0:
            bad[0], bad[1] = i, r
            return


class _Run:
    """A run of native steps, called as one plan step: ``replay``'s compiled entry point, then the
    check of a step that found bad indices. It keeps the steps' argument tuples: the area's structs
    point into their arrays."""

    __slots__ = ("call", "args", "checks", "keep")

    def __init__(self, call, args, checks, keep):
        self.call, self.args, self.checks, self.keep = call, args, checks, keep

    def __call__(self):
        bad = self.args[2]
        bad[0] = -1
        self.call(*self.args)
        if bad[0] >= 0:
            what, n_rows = self.checks[bad[0]]
            check_indices(what, int(bad[1]), n_rows)


def _native(kernel, args):
    """(compiled function address, argument tuple, return type, check) of a plan step that can be
    replayed, or None: a Numba kernel (or a ``Checked`` one) whose exact overload for ``args`` is
    compiled and returns nothing (an integer: ``Checked``)."""
    check = None
    if isinstance(kernel, Checked):
        kernel, args, check = kernel.kernel, kernel.args, (kernel.what, kernel.n_rows)
    if getattr(kernel, "overloads", None) is None or not isinstance(args, tuple):
        return None
    try:   # Numba's own key for a value's type (see table._arg_type), as the key of _FUNCTIONS
        key = (kernel, tuple(compute_fingerprint(a) for a in args))
    except NotImplementedError:
        key = None
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = _function(kernel, args)
        if fn is None:
            return None
        if key is not None:
            _FUNCTIONS[key] = fn
    addr, n_fixed, ret = fn
    if (check is None) != (ret is None):
        return None
    if n_fixed >= 0:   # a ``*args`` kernel: the struct holds its extra arguments as one tuple
        args = args[:n_fixed] + (args[n_fixed:],)
    return addr, args, ret, check


_FUNCTIONS = {}   # (kernel, arguments' fingerprints) -> _function's answer


def _function(kernel, args):
    """(address of ``kernel``'s compiled function for ``args``, the number of fixed parameters
    before a ``*args`` one or -1, a value of its return type: None, or a NumPy integer), or None
    when that overload is not compiled or returns something else."""
    # the overloads are keyed as Numba folds the types: a ``*args`` parameter's as one tuple (a
    # plain one in those loaded from the cache)
    key = tuple(kernel.fold_argument_types(tuple(_arg_type(kernel, a) for a in args), {})[1])
    star = bool(key) and isinstance(key[-1], types.StarArgTuple)
    cres = kernel.overloads.get(key)
    if cres is None and star:
        cres = kernel.overloads.get(key[:-1] + (types.BaseTuple.from_types(tuple(key[-1])),))
    if cres is None or cres.objectmode or not all(_storable(t) for t in key):
        return None
    ret = cres.signature.return_type
    if ret != types.none and not isinstance(ret, types.Integer):
        return None
    addr = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    if not addr:
        return None
    return addr, len(key) - 1 if star else -1, None if ret == types.none else np.dtype(ret.name).type(0)


def _storable(t):
    """Whether a value of Numba type ``t`` can sit in the area as plain data: arrays, numbers,
    booleans, None and tuples of them (not a list, say, whose native form refers to a Python object)."""
    if isinstance(t, types.BaseTuple):
        return all(_storable(u) for u in t)
    return isinstance(t, (types.Array, types.Number, types.Boolean, types.NoneType))


def bind(steps):
    """The plan steps ``steps`` with each run of replayable ones made one ``_Run`` step (no
    arguments), the others calling their compiled code directly (``table.compiled``)."""
    natives = [_native(k, a) if ENABLED else None for k, a in steps]
    out, i = [], 0
    while i < len(steps):
        if natives[i] is None:
            out.append((compiled(*steps[i]), steps[i][1]))
            i += 1
            continue
        j = i
        while j < len(steps) and natives[j] is not None:
            j += 1
        out.append((_make_run(natives[i:j]), ()))
        i = j
    return out


def _make_run(natives):
    """One ``_Run`` of the replayable steps ``natives`` (``_native``'s tuples)."""
    sizes = [_bind(_NO_AREA, 0, addr, args, ret)[1] for addr, args, ret, _ in natives]
    offs = np.cumsum([0] + sizes)
    area = np.zeros(max(1, int(offs[-1]) // 8), np.int64)
    table = np.empty((len(natives), 2), np.int64)
    for i, (addr, args, ret, _) in enumerate(natives):
        table[i] = _bind(area, int(offs[i]), addr, args, ret)[0], offs[i]
    args = (table, area, np.zeros(2, np.int64))
    call = compiled(replay, args)
    if call is replay:   # not compiled in this process yet: compile (or load) it, then take its entry point
        replay(table[:0], area, args[2])
        call = compiled(replay, args)
    return _Run(call, args, [n[3] for n in natives], [n[1] for n in natives])


_NO_AREA = np.zeros(0, np.int64)   # _bind's first call only sizes a step


# the cache of every function above also depends on pool.py (its _borrowed) and this file
tie_cache(globals(), "", pool.__file__, __file__)
