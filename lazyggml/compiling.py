"""One stream of compile events: which kernel, on which backend, for which signature, loaded from a
cache (a *hit*) or compiled (a *miss*), and how long it took.

A first run compiles every kernel it needs (``cache.py``); later runs load them from the cache in
milliseconds. Two listeners care: the CLI's first-run notice (``CompileWatch``: say that kernels
compile, and keep their time out of the speeds) and ``lazyggml warmup`` (a line per kernel, hits
and misses). Each compiler lazyggml drives reports here, once, and each listener subscribes
(``listen``); nothing else patches a compiler.

The sources, one per compiler:

* **Numba dispatchers**: a backend hands its dispatcher class to ``watch_dispatcher`` (the CPU
  backend Numba's, the CUDA backend numba-cuda's). Its ``compile``, called once per new
  signature, then reports a hit or a miss (Numba's own ``cache_hits`` / ``cache_misses`` counters
  decide which) with its own seconds, without the kernels compiled inside it: a kernel compiles its
  callees first, each an event of its own (``outer`` False). Numba's ``numba:compile`` event
  marks when a real compilation begins, so a listener hears of it before it waits.
* **Compilations Numba does not see** (an OpenCL program build) are wrapped in ``compiling(name)``,
  and a binary loaded from a cache is reported with ``loaded``.
* **Events timed by their source** (an OpenCL kernel's first launch, where the driver compiles it)
  go through ``report``; a backend makes them only while a listener asked for them
  (``listen(..., launches=True)``: timing a launch means waiting for it).

``refusing()`` turns every compilation into a ``WouldCompile`` error while signatures found in a
cache still load: ``lazyggml warmup --check``.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass

__all__ = ["CompileEvent", "CompileWatch", "WouldCompile", "compiling", "listen", "loaded", "refusing", "report",
           "watch_dispatcher", "watching_launches"]


@dataclass(frozen=True)
class CompileEvent:
    backend: str        # "cpu", "cuda", or an OpenCL device's name
    kernel: str         # a Numba kernel's module.qualname; an OpenCL kernel's name, or "<device> program"
    signature: str      # "(argument types)", an OpenCL launch's "(local size ...)", or ""
    status: str         # "hit": loaded from a cache; "miss": compiled
    seconds: float      # its own time, without the kernels compiled inside it
    outer: bool = True  # not inside another kernel's compilation


class WouldCompile(Exception):
    """Raised inside ``refusing()`` where a kernel would have to be compiled."""


_listeners = []     # (listener, wants launches), innermost last
_launch_listeners = 0   # how many of them want first launches (asked at every OpenCL launch)
_stack = []         # one [seconds of the compilations inside it, announced] per compilation under way
_refusing = False


@contextlib.contextmanager
def listen(listener, launches=False):
    """Deliver the stream to ``listener`` while the block runs: ``compile_started(name)`` when an
    outermost compilation begins (where its compiler says so before it is done), and
    ``compile_event(event)`` after each hit or miss. ``launches``: also each kernel's first launch on
    the backends that time them (see ``watching_launches``)."""
    global _launch_listeners
    _listen_to_numba()
    entry = (listener, launches)
    _listeners.append(entry)
    _launch_listeners += launches
    try:
        yield listener
    finally:
        _listeners.remove(entry)
        _launch_listeners -= launches


def watching_launches():
    """Whether a listener wants first launches timed (a backend asks at each launch: cheap)."""
    return _launch_listeners > 0


def _announce(name):
    """An outermost compilation has begun: tell the listeners, once."""
    if len(_stack) == 1 and not _stack[0][1]:
        _stack[0][1] = True
        for listener, _ in list(_listeners):
            listener.compile_started(name)


def report(event):
    """Deliver an event its source timed itself."""
    for listener, _ in list(_listeners):
        listener.compile_event(event)


@contextlib.contextmanager
def _timed(backend, kernel, signature, status_of):
    """Time the block as one compilation, nested in any under way; ``status_of()``, asked after the
    block, says "hit", "miss" or None (nothing was loaded or compiled: no event)."""
    _stack.append([0.0, False])
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        inner, _ = _stack.pop()
        status = status_of()
        if status is not None:
            if _stack:
                _stack[-1][0] += dt
            report(CompileEvent(backend, kernel, signature, status, dt - inner, not _stack))


@contextlib.contextmanager
def compiling(name, backend=""):
    """Mark a compilation Numba does not see (an OpenCL program build): a miss."""
    with _timed(backend, name, "", lambda: "miss"):
        _announce(name)
        yield


def loaded(name, seconds, backend=""):
    """A compiled binary was loaded from a cache (an OpenCL program): a hit."""
    report(CompileEvent(backend, name, "", "hit", seconds, not _stack))


def watch_dispatcher(cls, backend):
    """Make ``cls.compile`` (Numba's ``Dispatcher``, numba-cuda's ``CUDADispatcher``) report to the
    stream. It runs once per new signature of a kernel; with nobody listening it only calls through."""
    compile_ = cls.compile
    if getattr(compile_, "_lazyggml_watched", False):
        return

    @functools.wraps(compile_)
    def compile(disp, sig):
        func = disp.py_func
        if not _listeners and not _refusing or func.__module__.startswith("numba"):
            return compile_(disp, sig)   # nobody listens, or one of Numba's own helpers inside a kernel
        from numba.core import sigutils
        args = tuple(sigutils.normalize_signature(sig)[0])
        if args in disp.overloads:
            return compile_(disp, sig)
        hits, misses = sum(disp._cache_hits.values()), sum(disp._cache_misses.values())

        def status():
            return ("hit" if sum(disp._cache_hits.values()) > hits else
                    "miss" if sum(disp._cache_misses.values()) > misses else None)

        with _timed(backend, f"{func.__module__}.{func.__qualname__}", "(" + ", ".join(map(str, args)) + ")",
                    status):
            if _refusing and backend == "cuda":   # numba-cuda checks this after its cache lookup
                return _without_compiling(compile_, disp, sig)
            return compile_(disp, sig)

    compile._lazyggml_watched = True
    cls.compile = compile


def _without_compiling(compile_, disp, sig):
    """numba-cuda's compile with compiling disabled: a hit loads, a miss raises ``WouldCompile``."""
    disp._can_compile = False
    try:
        return compile_(disp, sig)
    except RuntimeError as e:
        raise WouldCompile(str(e)) from e
    finally:
        disp._can_compile = True


@contextlib.contextmanager
def refusing():
    """While the block runs, a kernel that is not in a cache raises ``WouldCompile`` instead of
    compiling (Numba's compiler swapped for one that raises; numba-cuda's dispatchers told not to
    compile); what is in a cache loads and runs."""
    global _refusing
    from numba.core import dispatcher
    compile_ = dispatcher._FunctionCompiler.compile

    def refuse(compiler, args, return_type):
        raise WouldCompile(f"{compiler.py_func.__module__}.{compiler.py_func.__qualname__}")

    dispatcher._FunctionCompiler.compile, _refusing = refuse, True
    try:
        yield
    finally:
        dispatcher._FunctionCompiler.compile, _refusing = compile_, False


_numba_listener = None


def _listen_to_numba():
    """Register, once, a listener for Numba's compile events, which mark when a real compilation
    begins (numba is imported only now, after ``cache.py`` has configured it)."""
    global _numba_listener
    if _numba_listener is not None:
        return
    from numba.core import event

    class Listener(event.Listener):
        def on_start(self, ev):
            func = getattr(ev.data.get("dispatcher"), "py_func", None) if isinstance(ev.data, dict) else None
            _announce(getattr(func, "__qualname__", "kernel"))

        def on_end(self, ev):
            pass

    _numba_listener = Listener()
    event.register("numba:compile", _numba_listener)


class CompileWatch:
    """A listener that counts the kernels compiled while it is active (``count``: outermost
    compilations) and the seconds spent on them (``seconds``); subclasses (or callers setting the
    attributes) get ``on_start(name)`` before and ``on_end(name)`` after each. A compilation whose
    compiler announces nothing before it is done (numba-cuda's) gets both at its end."""

    def __init__(self, on_start=None, on_end=None):
        self.count = 0
        self.seconds = 0.0
        self._started = False
        if on_start is not None:
            self.on_start = on_start
        if on_end is not None:
            self.on_end = on_end

    def on_start(self, name):
        """Called when a compilation begins (a no-op unless replaced)."""

    def on_end(self, name):
        """Called when a compilation has ended (a no-op unless replaced)."""

    def compile_started(self, name):
        self._started = True
        self.on_start(name)

    def compile_event(self, event):
        if event.status != "miss":
            return
        self.seconds += event.seconds   # own seconds: their sum is the outermost compilations' time
        if event.outer:
            if not self._started:
                self.on_start(event.kernel)
            self._started = False
            self.count += 1
            self.on_end(event.kernel)

    def __enter__(self):
        self._listening = listen(self)
        self._listening.__enter__()
        return self

    def __exit__(self, *exc):
        self._listening.__exit__(*exc)
