"""Watching kernels compile: how many, for how long, and telling the user when it starts.

A first run compiles every kernel it needs (``cache.py``: a minute or so on two cores); later runs
load them from the cache in milliseconds. A user should hear about the first, and timings should
not blame the model for it. Numba fires a ``numba:compile`` event around each real compilation (a
cache hit loads without one), nested when a kernel compiles its callees first; the CUDA backend
times numba-cuda's compiles itself and reports them with ``record``; the OpenCL backend wraps its
program builds in ``compiling(name)``. While a ``CompileWatch`` is active it counts the
outermost of these and adds up their seconds, and calls ``on_start`` / ``on_end`` around each.
"""
from __future__ import annotations

import contextlib
import time

__all__ = ["CompileWatch", "compiling"]

_watches = []          # active CompileWatch objects, innermost last
_depth = 0             # nesting of the compilation under way (callees compile inside callers)
_t0 = 0.0


def _start(name):
    global _depth, _t0
    _depth += 1
    if _depth == 1:
        _t0 = time.perf_counter()
        for w in _watches:
            w.on_start(name)


def _end(name):
    global _depth
    _depth -= 1
    if _depth == 0:
        dt = time.perf_counter() - _t0
        for w in _watches:
            w.count += 1
            w.seconds += dt
            w.on_end(name)


@contextlib.contextmanager
def compiling(name):
    """Mark a compilation that Numba does not see (an OpenCL program build)."""
    _start(name)
    try:
        yield
    finally:
        _end(name)


def record(name, seconds):
    """Count a compilation its caller timed itself, after the fact (numba-cuda's CUDA kernels: their
    dispatcher announces none, and only knows afterwards whether it compiled or loaded)."""
    if _depth:          # inside a compilation already counted
        return
    for w in _watches:
        w.on_start(name)
        w.count += 1
        w.seconds += seconds
        w.on_end(name)


_listener = None


def _listen_to_numba():
    """Register, once, a listener for Numba's compile events (numba is imported only now, after
    ``cache.py`` has configured it)."""
    global _listener
    if _listener is not None:
        return
    from numba.core import event

    class Listener(event.Listener):
        def on_start(self, ev):
            _start(_kernel_name(ev))

        def on_end(self, ev):
            _end(_kernel_name(ev))

    _listener = Listener()
    event.register("numba:compile", _listener)


def _kernel_name(ev):
    func = getattr(ev.data.get("dispatcher"), "py_func", None) if isinstance(ev.data, dict) else None
    return getattr(func, "__qualname__", "kernel")


class CompileWatch:
    """A context manager that counts the kernels compiled while it is active (``count``) and the
    seconds spent on them (``seconds``); subclasses (or callers setting the attributes) get
    ``on_start(name)`` before and ``on_end(name)`` after each."""

    def __init__(self, on_start=None, on_end=None):
        self.count = 0
        self.seconds = 0.0
        if on_start is not None:
            self.on_start = on_start
        if on_end is not None:
            self.on_end = on_end

    def on_start(self, name):
        """Called when a compilation begins (a no-op unless replaced)."""

    def on_end(self, name):
        """Called when a compilation has ended (a no-op unless replaced)."""

    def __enter__(self):
        _listen_to_numba()
        _watches.append(self)
        return self

    def __exit__(self, *exc):
        _watches.remove(self)
