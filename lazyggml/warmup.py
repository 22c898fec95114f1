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
While the cases run, a ``Recorder`` listens to ``compiling.py``'s stream of compile events, which
every backend's compiler reports to: a Numba or numba-cuda kernel signature loaded from the cache
counts a **hit**, one compiled a **miss**, with the time spent in it, minus the time of kernels
compiled inside it (a kernel that calls another compiles the callee first). A second warm-up finds
every entry point in the cache, so it reports only hits; callees are inside their callers' machine
code and are not loaded at all.

OpenCL kernels are compiled by the driver: once per program and, with PoCL, again per kernel and
work-group size at the first launch. The program counts a hit when its binary was in lazyggml's
cache (``backends/opencl/backend.py``), a miss when it was built from source. While the recorder
listens with ``launches=True``, the OpenCL backend times each kernel's first launch per work-group
size (per global size where the driver picks the work-group size) and reports it, a miss when the
driver's cache (``POCL_CACHE_DIR``) gained a file, or, for other drivers, when it took longer than
``FIRST_LAUNCH_MISS_S``.

Each case runs under each of the backend's warm-up variants (``Backend.warmup_variants``): the CPU
runs it a second time with its row kernels on the pool, so that their parallel twins compile too.

``--check``
-----------
Compiles nothing and writes nothing: it reports what a warm-up would compile. Inside
``compiling.refusing()`` a signature missing from the cache raises ``WouldCompile``, counts as a
miss and stops its case there (signatures found in the cache are loaded and run, as in a real run).
Every miss reported is real, but a case stopped early may hide more.

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
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from numba.core.errors import NumbaPerformanceWarning

from . import cache, compiling, op_cases
from .compiling import CompileEvent
from .backends.cpu import convert as cpu_convert
from .registry import dev_count, dev_get
from .types import as_type, type_name


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
    """Run an op case (checked against its oracle) under each of the backend's warm-up variants
    (``Backend.warmup_variants``: on the CPU again with the row kernels on the pool)."""
    for variant in backend.warmup_variants():
        with variant:   # a new graph, hence a new plan, in each
            if op_cases.run_case(case, backend, seed=0) == "unsupported":
                return False
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

class Recorder:
    """Listens to ``compiling.py``'s stream while cases run: every ``CompileEvent``, in order."""

    def __init__(self):
        self.kernels = []

    def compile_started(self, name):
        pass

    def compile_event(self, event):
        self.kernels.append(event)


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
    recorder = Recorder()
    by_name = {c.name: c for c in CASES}
    outcomes = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", NumbaPerformanceWarning)   # tiny grids, strided views: on purpose
        stack.enter_context(compiling.listen(recorder, launches="opencl" in kinds))
        if check:
            stack.enter_context(compiling.refusing())
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
                except compiling.WouldCompile:
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
        programs = [CompileEvent(d.name, "program", "", "hit" if d.program_cached() else "miss", 0.0)
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
        bar.write(f"  {verb}  {k.seconds:7.3f} s  {k.backend:8s} {k.kernel}{k.signature}", file=out)

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
