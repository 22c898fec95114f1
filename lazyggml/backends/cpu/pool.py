"""The CPU backend's own thread pool: a parallel kernel as GGML runs one, without an OpenMP region.

Why: a Numba ``prange`` loop is an OpenMP fork-join region, and one costs ~1.5 µs more than a
serial call even while libgomp's workers still spin from the last one (~3 µs inside a model's
step, where the other core's caches must hand the data back). A decode step of the embedded 3.7M
model is ~80 kernels of 2-20 µs: its mat-vecs ran on one thread because two cost more than they
saved, while llama.cpp splits every one of them over both threads. Here a job costs the caller a
few atomic operations on one array, and the workers are always ready during a generation.
Prompts run on it too: in a VM, waking a thread whose virtual CPU went idle took ~0.25 ms, and
after an idle spell libgomp's workers and its barrier's waiting caller fell asleep at every region,
each of a prompt's ~100 regions paying two such wakes (measured: 500 µs regions, the embedded
model's cold 128-token prompt 9.4 ms against 8.4 warm). A pool job never sleeps in its caller, and
a worker that wakes late costs it at most the chunk it then takes.

How a job runs (``parallel_for(state, body, n, args)``, called from jitted code):

* the caller writes the job into ``state`` (one int64 array, every hot slot on its own cache
  line): the address of an *entry*, a function compiled with the caller that unpacks the argument
  tuple and calls ``body(c, n, *args)`` (``_entry``), the tuple itself as Numba's native struct
  (``_store_args``: the arrays' data pointers, shapes and strides; no copy of their data), and
  ``n``, the chunk count;
* chunks are taken by compare-and-swap on ``WORD`` = job generation << 32 | next chunk: a worker
  that wakes late can never take a chunk of a newer job with an older job's arguments (the
  generation would not match), and while the caller writes a job ``WORD``'s chunk is ``CLOSED``;
* the caller takes chunks too, then waits for the chunks others took (``DONE``). A worker that
  is asleep, inactive or descheduled by a busy machine therefore delays the job by at most the one
  chunk it holds, and a job never waits for a worker that has not started one: the caller alone
  finishes any job. That is also the fallback when another Python thread holds the pool (``OWNER``):
  the job runs on its caller's thread, correct and serial.

Workers (``NUMBA_NUM_THREADS - 1`` of them, started with the first plan that uses the pool) spin
on ``WORD`` for ``SPINS`` rounds (~0.3 ms on the dev machine: a decode step's jobs come every few
µs and its tokens every ~0.3 ms), then nap ``NAP_US`` at a time for ``NAPS`` naps (~10 ms), then
sleep on a futex until the next job (Linux; elsewhere they keep napping). ``ACTIVE`` says how many
may take chunks: the backend sets it before each graph from its thread governor (``threads.py``),
so on a busy machine the others sleep instead of competing with their own caller. An inactive
worker sleeps on the futex at once; the next job posted wakes it.

A body gets its chunk ``c`` of ``n`` and the arguments; it must not raise (its exceptions are
dropped on a worker) and its chunks must be independent. Numba's native structs of the arguments
are read in place by the workers, with their reference counts left alone (the caller's references
keep the arrays alive until every chunk is done).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import platform
import re
import threading

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ...cache import tie_cache
from . import simd
from .simd import compare_exchange, fetch_add, load_acquire, spin_pause, store_release

# OpenMP regions (Numba's prange) remain in convert.quantize (model loading, a quantized KV cache's
# Python steps), and libgomp's workers spin ~300,000 polls (~8 ms here) after each region before
# they sleep: a decode step right after one then has two threads spinning for the second core,
# ours and libgomp's, each getting it half the time (when the prompts' kernels were OpenMP regions,
# the embedded model decoded at 3,410 tok/s after its prompts against 4,164 with a spin of 10,000
# polls, ~0.25 ms, as long as our workers spin). libgomp reads its variables once, when it is
# loaded: unless the user set them, this loads Numba's threading layer now with the spin count set,
# then takes the variable out of the environment again, so that child processes (another program's
# OpenMP, llama.cpp in the benchmarks) do not inherit it.
GOMP_SPINCOUNT = "10000"
if not ({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ)):
    os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT
    try:
        numba.get_num_threads()
    finally:
        del os.environ["GOMP_SPINCOUNT"]

# slots of the state array (int64 indices); the hot ones 8 apart: a 64-byte cache line each
WORD, NCHUNKS, ENTRY = 0, 1, 2          # read together by a worker looking for a chunk
DONE = 8                                # chunks finished
OWNER = 16                              # 1 while a caller thread holds the pool
ACTIVE, STOP = 24, 25                   # workers that may take chunks; 1: workers return
SLEEPERS, WAKE = 32, 40                 # workers asleep on the futex; its 32-bit word
ARGS = 48                               # the job's arguments from here ...
ARGS_BYTES = 4096                       # ... this many bytes
N_SLOTS = ARGS + ARGS_BYTES // 8
CLOSED = 0xFFFFFFFF                     # WORD's chunk while a job is written

SPINS = 10_000      # empty polls (each a ``pause``) before a worker naps
NAPS = 100          # naps before it sleeps until woken
NAP_US = 100

# ---------------------------------------------------------------------------------------------------
# The OS calls a worker makes from jitted code (ctypes functions, which Numba can call directly)
# ---------------------------------------------------------------------------------------------------

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower(), 0)
HAVE_NAP = os.name == "posix"                            # libc's usleep
HAVE_FUTEX = platform.system() == "Linux" and _SYS_FUTEX != 0


def _libc_call(context, builder, name, sig, llargs):
    """Call the C library's ``long name(long, ...)``: declared in the caller's module and bound by
    the JIT to the process's libc (a ctypes function instead would make every caller uncacheable).
    Where the OS lacks it (HAVE_NAP / HAVE_FUTEX false) it is never called."""
    i64 = ir.IntType(64)
    mod = builder.module
    fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(i64, [i64] * len(llargs)), name=name)
    return builder.call(fn, [context.cast(builder, v, t, types.int64) for v, t in zip(llargs, sig.args)])


@intrinsic
def _usleep(typingctx, us):
    def codegen(context, builder, sig, llargs):
        return _libc_call(context, builder, "usleep", sig, llargs)
    return types.int64(us), codegen


@intrinsic
def _syscall(typingctx, nr, a, b, c, d, e):
    """``syscall(nr, a, b, c, d, e)`` (the futex calls)."""
    def codegen(context, builder, sig, llargs):
        return _libc_call(context, builder, "syscall", sig, llargs)
    return types.int64(nr, a, b, c, d, e), codegen


_FUTEX_WAIT, _FUTEX_WAKE = 128, 129     # FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE

# ---------------------------------------------------------------------------------------------------
# A job's arguments in the state array, and its entry function
# ---------------------------------------------------------------------------------------------------


def _args_ptr(context, builder, arrty, arr, lt):
    """The state array's argument area as a pointer to the LLVM type ``lt``."""
    ary = context.make_array(arrty)(context, builder, arr)
    p = builder.gep(ary.data, [ir.Constant(ir.IntType(64), ARGS)])
    return builder.bitcast(p, lt.as_pointer())


def _borrowed(context, builder, ty, val):
    """``val`` with the memory owners of its arrays cleared, so that using it on a worker changes
    no reference count (atomics on a cache line every thread would share)."""
    if isinstance(ty, types.Array):
        ary = context.make_array(ty)(context, builder, val)
        ary.meminfo = context.get_constant_null(types.MemInfoPointer(types.voidptr))
        ary.parent = context.get_constant_null(types.pyobject)
        return ary._getvalue()
    if isinstance(ty, types.BaseTuple):
        for i, t in enumerate(ty):
            val = builder.insert_value(val, _borrowed(context, builder, t, builder.extract_value(val, i)), i)
    return val


_ENTRY_ARGS = (types.CPointer(types.int64), types.int64, types.int64)   # (state, chunk, n)


@intrinsic
def _entry(typingctx, body, args):
    """The address of a function (Numba's calling convention, arguments ``_ENTRY_ARGS``) that
    reads an ``args`` tuple from a state array's argument area and calls ``body(c, n, *args)``.
    It is compiled into the caller's library, so Numba's cache keeps it with the caller."""
    if not isinstance(body, types.Dispatcher) or not isinstance(args, types.BaseTuple):
        return None
    disp = body.dispatcher

    def call(c, n, a):
        disp(c, n, *a)

    def codegen(context, builder, sig, llargs):
        mod = builder.module
        name = re.sub(r"\W", "_", f"lazyggml_pool_entry_{disp.py_func.__module__}_{disp.py_func.__qualname__}_{args}")
        fn = mod.globals.get(name)
        if fn is None:
            fn = ir.Function(mod, context.call_conv.get_function_type(types.none, _ENTRY_ARGS), name=name)
            context.call_conv.decorate_function(fn, ("state", "c", "n"), _ENTRY_ARGS)
            fn.linkage = "internal"
            b = ir.IRBuilder(fn.append_basic_block())
            state, c, n = context.call_conv.get_arguments(fn)
            lt = context.get_value_type(args)
            p = b.gep(state, [ir.Constant(ir.IntType(64), ARGS)])
            val = _borrowed(context, b, args, b.load(b.bitcast(p, lt.as_pointer())))
            context.compile_internal(b, call, types.none(types.int64, types.int64, args), [c, n, val])
            context.call_conv.return_value(b, context.get_dummy_value())
        return builder.ptrtoint(fn, ir.IntType(64))

    return types.int64(body, args), codegen


@intrinsic
def _store_args(typingctx, state, args):
    """Write the native struct of the tuple ``args`` into the state array's argument area."""
    if not isinstance(args, types.BaseTuple):
        return None

    def codegen(context, builder, sig, llargs):
        lt = context.get_value_type(sig.args[1])
        size = context.get_abi_sizeof(lt)
        if size > ARGS_BYTES:
            raise TypingError(f"pool: the arguments of a job take {size} bytes, more than {ARGS_BYTES}")
        builder.store(llargs[1], _args_ptr(context, builder, sig.args[0], llargs[0], lt))
        return context.get_dummy_value()

    return types.none(state, args), codegen


@intrinsic
def _call_entry(typingctx, fn, state, c, n):
    """Call the entry at address ``fn`` for chunk ``c`` of ``n`` (the worker's side of ``_entry``)."""
    def codegen(context, builder, sig, llargs):
        fnty = context.call_conv.get_function_type(types.none, _ENTRY_ARGS)
        ary = context.make_array(sig.args[1])(context, builder, llargs[1])
        context.call_conv.call_function(builder, builder.inttoptr(llargs[0], fnty.as_pointer()), types.none,
                                        _ENTRY_ARGS, [ary.data, llargs[2], llargs[3]])
        return context.get_dummy_value()

    return types.none(fn, state, c, n), codegen


# ---------------------------------------------------------------------------------------------------
# The caller's side
# ---------------------------------------------------------------------------------------------------


@njit(inline="always")
def parallel_for(state, body, n, args):
    """Run ``body(c, n, *args)`` for every chunk c in 0..n-1, on this thread and the pool's active
    workers; returns when all are done. Serial (no job) for one chunk, without active workers, or
    while another thread holds the pool."""
    if n <= 1 or load_acquire(state, ACTIVE) == 0 or not compare_exchange(state, OWNER, 0, 1):
        for c in range(n):
            body(c, n, *args)
        return
    w = load_acquire(state, WORD)
    store_release(state, WORD, w | CLOSED)      # chunks of the old job (if any were left) can't be taken now
    state[ENTRY] = _entry(body, args)
    _store_args(state, args)
    state[NCHUNKS] = n
    state[DONE] = 0
    fetch_add(state, WORD, 1)                   # generation + 1, chunk 0: published (a full barrier)
    if HAVE_FUTEX and load_acquire(state, SLEEPERS) > 0:
        _wake(state)
    while True:
        w = load_acquire(state, WORD)
        c = w & CLOSED
        if c >= n:
            break
        if compare_exchange(state, WORD, w, w + 1):
            body(c, n, *args)
            fetch_add(state, DONE, 1)
    while load_acquire(state, DONE) < n:
        spin_pause()
    store_release(state, OWNER, 0)


@njit(cache=True)
def _wake(state):
    fetch_add(state, WAKE, 1)
    _syscall(_SYS_FUTEX, state.ctypes.data + 8 * WAKE, _FUTEX_WAKE, 1 << 30, 0, 0)


# ---------------------------------------------------------------------------------------------------
# The workers' side
# ---------------------------------------------------------------------------------------------------


@njit(cache=True)
def _take(state):
    """Run one chunk of the current job if one is left: True if a chunk was there (taken by this
    thread or, in a race, by another), False if there was none."""
    w = load_acquire(state, WORD)
    n = load_acquire(state, NCHUNKS)
    c = w & CLOSED
    if c >= n:
        return False
    fn = load_acquire(state, ENTRY)
    if compare_exchange(state, WORD, w, w + 1):   # the job was still generation w's: fn and args are its
        _call_entry(fn, state, c, n)
        fetch_add(state, DONE, 1)
    return True


@njit(cache=True)
def _sleep(state, me):
    """Sleep on the futex until a caller posts a job (or the pool stops); at once if worker ``me``
    may take a chunk of a job already there."""
    seq = load_acquire(state, WAKE)
    fetch_add(state, SLEEPERS, 1)   # before the checks: a caller that posts after them sees a sleeper
    ready = me < load_acquire(state, ACTIVE) and (load_acquire(state, WORD) & CLOSED) < load_acquire(state, NCHUNKS)
    if not ready and load_acquire(state, STOP) == 0:
        _syscall(_SYS_FUTEX, state.ctypes.data + 8 * WAKE, _FUTEX_WAIT, seq & 0xFFFFFFFF, 0, 0)
    fetch_add(state, SLEEPERS, -1)


@njit(nogil=True, cache=True)
def _worker(state, me):
    """Worker ``me``'s loop (0-based), until ``STOP``. An inactive worker sleeps at once."""
    idle = 0
    while load_acquire(state, STOP) == 0:
        if me >= load_acquire(state, ACTIVE):
            if HAVE_FUTEX:
                _sleep(state, me)
            else:
                _usleep(NAP_US)
            idle = 0
        elif _take(state):
            idle = 0
        else:
            idle += 1
            if idle < SPINS:
                spin_pause()
            elif idle < SPINS + NAPS or not HAVE_FUTEX:
                _usleep(NAP_US)
            else:
                _sleep(state, me)
                idle = 0


# ---------------------------------------------------------------------------------------------------
# The process's pool
# ---------------------------------------------------------------------------------------------------


class Pool:
    """``n_workers`` threads running ``_worker`` on one state array (``state``)."""

    def __init__(self, n_workers):
        self.state = np.zeros(N_SLOTS, np.int64)
        self.threads = []
        if not HAVE_NAP:   # no libc to nap with (Windows): every job runs on its caller
            n_workers = 0
        if n_workers:
            # load (or compile) the workers' loop on this thread: with STOP set it returns at once.
            # A compile error (``lazyggml warmup --check``'s) is then the caller's, not a dead thread's.
            self.state[STOP] = 1
            _worker(self.state, 0)
            self.state[STOP] = 0
        self.state[ACTIVE] = n_workers
        for i in range(n_workers):
            t = threading.Thread(target=_worker, args=(self.state, i), name=f"lazyggml-cpu-{i + 1}", daemon=True)
            t.start()
            self.threads.append(t)

    def set_threads(self, n):
        """Let ``n - 1`` workers take chunks beside their caller (``n`` threads in all)."""
        self.state[ACTIVE] = max(0, min(n - 1, len(self.threads)))

    def close(self):
        """Stop the workers and wait for them (no jitted code: at exit nothing may compile)."""
        self.state[ACTIVE] = 0
        self.state[STOP] = 1
        if HAVE_FUTEX and self.threads:
            self.state[WAKE] += 1
            ctypes.CDLL(None).syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_long(self.state.ctypes.data + 8 * WAKE),
                                      ctypes.c_long(_FUTEX_WAKE), ctypes.c_long(1 << 30), ctypes.c_long(0),
                                      ctypes.c_long(0))
        for t in self.threads:
            t.join(timeout=5)
        self.threads = []


_pool = None


def get_pool():
    """The process's pool, started on first use with ``NUMBA_NUM_THREADS - 1`` workers."""
    global _pool
    if _pool is None:
        _pool = Pool(numba.config.NUMBA_NUM_THREADS - 1)
    return _pool


def set_threads(n):
    """``Pool.set_threads`` on the process's pool, if it was started."""
    if _pool is not None:
        _pool.set_threads(n)


def _shutdown():
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


def _after_fork():
    """A forked child has none of its parent's threads: it starts a pool of its own when it needs one."""
    global _pool
    _pool = None


atexit.register(_shutdown)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)

# the cache of every kernel above also depends on simd.py (its atomics) and this file
tie_cache(globals(), simd.ISA, simd.__file__, __file__)
