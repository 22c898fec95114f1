"""The CPU backend: host buffers backed by NumPy, and a ``graph_compute`` that runs Numba kernels.

Memory: a CPU buffer is one ``uint8`` array (new, or a mapped file used in place:
``buffer_from_host_ptr``); a tensor is a strided NumPy view at its offset
(``backend.host_view``), so kernels see ordinary arrays and never allocate.

Compute: nodes run in order; empty ops (NONE and the four view ops), nodes without the COMPUTE
flag (unselected branches of ``build_forward_select``) and empty tensors are skipped, as in GGML.

A graph is first turned into a *plan*: each node's forward function (``table.py``) returns its
kernel calls with their arguments already built (views, scratch, constants), and the plan is the
list of them all. It is kept in the graph's ``GraphPlan`` (``backends.KernelTable.plan``: the reuse
contract, O(1) while the graph and the placement of tensors are unchanged), made for the backend's
thread count, and replayed. After its first run, when Numba has compiled every kernel for these
arguments, the plan's kernel calls are made from native code (``replay.py``): a decode step is
then one Python call, where a call per kernel cost ~1 µs each in argument conversions alone.

The forwards are told the backend's thread count, thresholds and pool in a ``ComputeParams``
(``params.py``), never through a process global, so two CPU backends plan independently.
Parallel kernels are jobs of the backend's own thread pool (``pool.py``), a prompt's as a decode
step's. Each run sets the pool's active workers once, to what ``threads.py`` picks for that graph:
fewer threads while other programs keep CPUs busy (and Numba's thread count with them, for the
OpenMP regions left in Python steps: ``convert.quantize``; setting or reading it costs ~2 µs from
Python). The plan stays the one made for the backend's count: its jobs then share their chunks
among fewer threads, with the same results, bit for bit. A plan per thread count would need
kernels that no run had loaded yet, and loading one from the cache mid-generation took 10-30 ms,
compiling one seconds (a decode benchmark run at 33 tok/s instead of 1,400).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import numba
from numba.core.dispatcher import Dispatcher

from ... import compiling
from ...backend import Backend, Device, DeviceType, Registry, host_view
from ...buffer import BufferType, HostBuffer, Status
from ...ops import EMPTY_OPS
from .params import ComputeParams, Thresholds
from .table import FORWARD
from . import pool, replay
from .repack import RepackBufferType
from .threads import ThreadGovernor

FORWARD.load()   # the kernels register themselves; the CPU backend is always there
compiling.watch_dispatcher(Dispatcher, "cpu")   # its kernels' compiles and cache loads, in one stream


class CPUDevice(Device):
    def __init__(self):
        super().__init__("CPU", _cpu_description(), DeviceType.CPU)
        self._buft = BufferType("CPU", self, alignment=32, host=True)   # host memory (HostBuffer)
        self._repack_buft = RepackBufferType(self)

    def memory(self):
        """(free, total) bytes of host memory. Free is Linux's MemAvailable (free pages plus the page
        cache the kernel can drop, such as a model file's mapped pages) where there is one."""
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            free, total = os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (ValueError, OSError):
            return (0, 0)
        try:
            with open("/proc/meminfo") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
            free = kib * 1024
        except (OSError, StopIteration, ValueError, IndexError):
            pass
        return free, total

    def get_buffer_type(self):
        return self._buft

    def get_extra_buffer_types(self):
        """GGML's ``ggml_backend_dev_get_extra_bufts``: the buffer types a loader offers a weight
        before the default one; the CPU's is CPU_REPACK (``repack.py``)."""
        return [self._repack_buft]

    def supports_buft(self, buft):
        return buft.is_host()

    def buffer_from_host_ptr(self, data, buft=None):
        """Host memory that exists already (a mapped file), used in place, as a buffer of ``buft``
        (the CPU's or its CPU_REPACK type; default the CPU's)."""
        return HostBuffer(buft or self.get_buffer_type(), data.size, data)

    def supports_op(self, t):
        if t.op in EMPTY_OPS:
            return True
        return FORWARD.supports(t)

    def init_backend(self):
        return CPUBackend(self)


class CPUBackend(Backend):
    """``n_threads``: what plans are made for (at most; see threads.py); ``thresholds``: the work
    below which a step runs on one thread (``params.Thresholds``; tests set ``params.ALWAYS_PARALLEL``
    to run the parallel kernels on small cases, warm-up its ``warmup_variants``)."""

    def __init__(self, device, n_threads=None, thresholds=Thresholds()):
        super().__init__(device)
        self.n_threads = n_threads or numba.config.NUMBA_NUM_THREADS
        self.thresholds = thresholds
        self.governor = ThreadGovernor()

    def warmup_variants(self):
        """As it is, then with every row kernel on the pool (``Thresholds.elements`` at 0): small
        work takes the serial twin of a ``common.parallel_kernel``, the warm-up's cases too; the
        products' thresholds are passed by the cases large enough for them."""
        return [contextlib.nullcontext(), self._thresholds(replace(self.thresholds, elements=0))]

    @contextlib.contextmanager
    def _thresholds(self, thresholds):
        saved, self.thresholds = self.thresholds, thresholds
        try:
            yield
        finally:
            self.thresholds = saved

    def graph_compute(self, g):
        n = self.governor.threads(self.n_threads)
        plan = self._plan(g)
        if numba.get_num_threads() != n:   # reading it costs a third of setting it (~1 vs 3 µs)
            numba.set_num_threads(n)
        pool.set_threads(n)
        for kernel, args in plan.steps:
            kernel(*args)
        if not plan.direct:
            plan.steps = replay.bind(plan.steps)
            plan.direct = True
        return Status.SUCCESS

    def _plan(self, g):
        """The bound kernel calls of ``g``, kept in its ``GraphPlan`` (the reuse contract), one per
        thread count and thresholds asked for (``set_n_threads`` may change them); the forwards make
        them with a fresh ``ComputeParams`` (``params.py``)."""
        gp = FORWARD.plan(g)
        plans = gp.state.setdefault(self, {})
        key = (self.n_threads, self.thresholds)
        plan = plans.get(key)
        if plan is None:
            params = ComputeParams(self.n_threads, self.thresholds)
            steps = []
            for fn, node in gp.nodes:
                dst = host_view(node)
                params.scope.written(dst)
                steps += fn(node, dst, [None if s is None else host_view(s) for s in node.src], params)
            plan = plans[key] = _Plan(steps)
        return plan


class _Plan:
    """A graph's kernel calls as its forwards made them (``calls``), what a run calls (``steps``:
    the same until the first run ends, then ``replay.bind``'s), and whether they are bound."""

    __slots__ = ("calls", "steps", "direct")

    def __init__(self, steps):
        self.calls, self.steps, self.direct = steps, steps, False


def set_n_threads(backend, n):
    """GGML's ``ggml_backend_cpu_set_n_threads``; capped at Numba's thread pool size."""
    if not isinstance(backend, CPUBackend):
        raise ValueError(f"set_n_threads: {backend.name} is not a CPU backend")
    if n < 1:
        raise ValueError(f"set_n_threads: need at least one thread, got {n}")
    backend.n_threads = min(int(n), numba.config.NUMBA_NUM_THREADS)


def _cpu_description():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


_device = None


def cpu_device():
    global _device
    if _device is None:
        _device = CPUDevice()
    return _device


def cpu_buffer_type():
    return cpu_device().get_buffer_type()


class CPURegistry(Registry):
    """The CPU's registry; its one extra function is GGML's ``ggml_backend_set_n_threads`` (what
    llama.cpp's RPC server and lazyggml's look up to set a served CPU's threads)."""

    def get_proc_address(self, name):
        return set_n_threads if name == "ggml_backend_set_n_threads" else None


def registry():
    dev = cpu_device()
    return dev.reg or CPURegistry("CPU", [dev])


def backend_cpu_init():
    """A new backend on the machine's one CPU device, running on all of Numba's threads
    (``ggml_backend_cpu_init``)."""
    return cpu_device().init_backend()
