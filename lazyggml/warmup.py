"""``lazyggml warmup``: compile every kernel ahead of time, into the on-disk cache (``cache.py``).

A Numba kernel is compiled the first time it is called with a new *signature*: the argument types,
which for an array means its dtype, number of dimensions, layout (C-contiguous or any strides),
alignment and whether it is writeable. A first run of a model therefore pays 0.1 to 2 s for each
of a hundred-odd kernels. With ``cache=True`` the machine code is written to the cache and later
processes load it in a few milliseconds; this module makes that first run happen up front.

What runs
---------
Signatures are decided by the glue that calls the kernels, so the only reliable way to produce
the signatures a real graph needs is to run real graphs. ``CASES`` holds:

* every case of the op-case catalogue (``op_cases.CASES``, which the backend tests check against
  their NumPy oracles): each op on contiguous tensors, on strided and permuted views, in place,
  with each tensor type it accepts (``mul_mat`` and ``get_rows`` over every weight type, copies and
  ``set_rows`` into every type), large enough to take the threaded paths as well as the
  single-threaded ones, and an attention block shaped like the model runner's (F16 KV caches
  written with ``set_rows``, permuted views, masked ``soft_max_ext``). Each runs through
  ``op_cases.run_case``, so its result is checked too; on the CPU it runs a second time with every
  ``common.parallel_kernel`` row kernel taking its pool job (``Thresholds.elements`` at 0: small
  work takes the serial twin);
* what is not an op case: the quantizers and dequantizers of every type, and a small LLaMA model
  run end to end (the embedded default model when it is there, else a random one from
  ``lazyggml.testing``), prompt then decode.

Each case runs on every selected backend that supports all its nodes. ``--cases`` selects cases by
``fnmatch`` patterns of their names (``'add*,mul_mat(q4_K*'``), ``--types`` those exercising a
tensor type (a case of float32 only is always selected).

Counting hits and misses
------------------------
While the cases run, ``Dispatcher.compile`` (Numba's, and numba-cuda's for CUDA kernels) is
wrapped: each call that loads a signature from the cache counts a **hit**, each that compiles one
counts a **miss** (Numba's own ``cache_hits`` / ``cache_misses`` counters decide which), with the
time spent in it, minus the time of kernels compiled inside it (a kernel that calls another
compiles the callee first). A second warm-up finds every entry point in the cache, so it reports
only hits; callees are inside their callers' machine code and are not loaded at all.

OpenCL kernels are compiled by the driver: once per program and, with PoCL, again per kernel and
work-group size at the first launch. The program counts a hit when its binary was in lazyggml's
cache (``backends/opencl/backend.py``), a miss when it was built from source. Each kernel's first
launch per work-group size (per global size where the driver picks the work-group size) is timed,
its arguments passed on unchanged, and counted as a miss when the driver's cache
(``POCL_CACHE_DIR``) gained a file, or, for other drivers, when it took longer than ``OPENCL_MISS_S``.

``--check``
-----------
Compiles nothing and writes nothing: it reports what a warm-up would compile. Numba's compiler is
swapped for a function that raises, so a signature missing from the cache counts as a miss and
stops its case there (signatures found in the cache are loaded and run, as in a real run). Every
miss reported is real, but a case stopped early may hide more.

An OpenCL driver cannot be stopped from compiling once asked to build or launch, so ``--check``
runs no OpenCL case: for each OpenCL device it reports the program alone, a hit when its binary is
in the cache and intact, a miss when it is not. The kernels' first launches are not checked (PoCL
compiles each per work-group size then, into a cache whose names only PoCL can compute), so an
OpenCL hit means "no program build", not "no driver compile at all". PoCL writes a file into its
cache folder when it starts, even to list devices; ``--check`` gives it a temporary folder.

The exit status is 1 when anything would have compiled.

``--jobs N``
------------
N worker processes take the case families (all cases sharing kernels, e.g. every ``mul_mat``
case) one at a time and warm them into the shared cache. Their saves are safe between processes,
as every lazyggml process's are (``cache.py``), so two warm-ups may also run at once.
"""
from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
from numba.core.errors import NumbaPerformanceWarning

from . import cache, op_cases
from .backend import DeviceType
from .backends.cpu import convert as cpu_convert
from .registry import dev_count, dev_get
from .types import as_type, type_name

OPENCL_MISS_S = 0.1   # without a driver cache to look at: a first launch this slow compiled
_OPENCL_LAUNCHED = set()   # (device, kernel, work-group or global size) launched in this process

WEIGHT_TYPES = op_cases.WEIGHT_TYPES   # the types mul_mat, get_rows, set_rows and cpy take
ALL_TYPES = cpu_convert.SUPPORTED_TYPES   # every type the CPU quantizes, F32 first


# =================================================================================================
# The cases
# =================================================================================================

@dataclass
class Case:
    """One workload. ``run(backend)`` returns False when the backend cannot run it."""
    name: str
    family: str                 # cases of a family share kernels (a --jobs worker takes a family)
    run: Callable
    types: tuple = ()           # the types it exercises; () = float32 only, always selected


# -- the op-case catalogue ---------------------------------------------------------------------------
def _run_op_case(case, backend):
    """Run an op case (checked against its oracle); on the CPU again, through the parallel kernels."""
    if op_cases.run_case(case, backend, seed=0) == "unsupported":
        return False
    if backend.device.type == DeviceType.CPU:
        # small work runs the serial twins of common.parallel_kernel: compile the parallel kernels
        # too, in a new graph (a new plan) where every row kernel takes them (the products' own
        # thresholds are passed by the cases large enough for them)
        thresholds = backend.thresholds
        backend.thresholds = replace(thresholds, elements=0)
        try:
            op_cases.run_case(case, backend, seed=0)
        finally:
            backend.thresholds = thresholds
    return True


CASES: list[Case] = [Case(c.name, c.family, lambda backend, c=c: _run_op_case(c, backend), c.types)
                     for c in op_cases.CASES]


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
    from .models.runner import load_model
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
        kernel's first launch per device and work-group size (or global size, when the driver picks
        the work-group size: ``lsize`` None)."""
        from .backends.opencl import OpenCLBackend, OpenCLDevice
        rec, seen = self, _OPENCL_LAUNCHED
        orig_kernels, orig_launch = OpenCLDevice.kernels, OpenCLBackend.launch

        def kernels(device):
            if device._kernels is not None:
                return orig_kernels(device)
            cached, t0 = device.program_cached(), time.perf_counter()
            result = orig_kernels(device)
            rec.kernels.append(Kernel(device.name, "program", "", "hit" if cached else "miss",
                                      time.perf_counter() - t0))
            return result

        def launch(backend, name, gsize, lsize, *args):
            # lsize None (mul_mat's naive kernels) leaves the work-group size to the driver, which
            # picks it by the global size
            size = f"local size {tuple(lsize)}" if lsize is not None else f"global size {tuple(gsize)}"
            key = (backend.device.name, name, size)
            if key in seen:
                return orig_launch(backend, name, gsize, lsize, *args)
            seen.add(key)
            backend.queue.finish()
            n0, t0 = _pocl_files() if backend.device.pocl else 0, time.perf_counter()
            result = orig_launch(backend, name, gsize, lsize, *args)
            backend.queue.finish()
            dt = time.perf_counter() - t0
            miss = _pocl_files() > n0 if backend.device.pocl else dt > OPENCL_MISS_S
            rec.kernels.append(Kernel(backend.device.name, name, f"({size})",
                                      "miss" if miss else "hit", dt))
            return result
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
def _throwaway_pocl_cache():
    """PoCL's cache in a temporary folder while the block runs: for ``--check``, which builds
    nothing, as PoCL writes into its cache folder when it starts."""
    old = os.environ.get("POCL_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="lazyggml-check-") as tmp:
        os.environ["POCL_CACHE_DIR"] = tmp
        try:
            yield
        finally:
            if old is None:
                del os.environ["POCL_CACHE_DIR"]
            else:
                os.environ["POCL_CACHE_DIR"] = old


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


def run_cases(device_names, case_names, check=False):
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


def _families(cases):
    fam = {}
    for c in cases:
        fam.setdefault(c.family, []).append(c.name)
    return sorted(fam.values(), key=len, reverse=True)


def warmup(kinds=None, types=None, patterns=None, jobs=1, check=False, out=sys.stdout):
    """Run the warm-up (the ``lazyggml warmup`` command); returns the exit status.

    ``kinds``: backend kinds (``"cpu"``, ``"opencl"``, ``"cuda"``), ``types``: tensor types or their
    names, ``patterns``: ``fnmatch`` patterns of case names; None selects everything."""
    with _throwaway_pocl_cache() if check else contextlib.nullcontext():
        return _warmup(kinds, types, patterns, jobs, check, out)


def _warmup(kinds, types, patterns, jobs, check, out):
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
    print(f"kernel cache: {cache.CACHE_DIR}", file=out)
    if any(_kind(d.name) == "opencl" for d in devices):
        from .backends.opencl import cache_dir
        driver_cache = os.environ.get("POCL_CACHE_DIR", "the driver's own")
        print(f"OpenCL program cache: {cache_dir('opencl')}" + ("" if check else f"; driver cache: {driver_cache}"),
              file=out)
    programs = []   # --check: each OpenCL device's program, looked up in the cache; no OpenCL case runs
    if check:
        programs = [Kernel(d.name, "program", "", "hit" if d.program_cached() else "miss", 0.0)
                    for d in devices if _kind(d.name) == "opencl"]
        devices = [d for d in devices if _kind(d.name) != "opencl"]
    names = [d.name for d in devices]
    print(f"{'checking' if check else 'warming'} {len(cases)} cases on {', '.join(names) or 'no device'}"
          + (f" in {jobs} processes" if jobs > 1 else "")
          + "".join(f"; {k.backend}: its program only" for k in programs), file=out)
    t0 = time.perf_counter()
    bar = tqdm(total=len(cases) * len(devices), unit="case", file=sys.stderr, disable=None)
    outcomes = []

    def write(k):
        verb = {"hit": "hit ", "miss": "would compile" if check else "miss"}[k.status]
        bar.write(f"  {verb}  {k.seconds:7.3f} s  {k.backend:8s} {k.name}{k.signature}", file=out)

    def report(batch):
        for o in batch:
            for k in o.kernels:
                write(k)
            if o.error:
                bar.write(f"  FAILED  {o.case} on {o.backend}: {o.error}", file=out)
        outcomes.extend(batch)
        bar.update(len(batch))

    for k in programs:
        write(k)
    if names and jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(run_cases, names, fam, check) for fam in _families(cases)]
            for f in as_completed(futures):
                report(f.result())
    elif names:
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
    kernels = programs + [k for o in outcomes for k in o.kernels]
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
