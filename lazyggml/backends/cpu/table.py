"""The CPU backend's kernel table: every module of this package that defines kernels registers them
here with ``@forward(Op.X, supports=...)`` (``KernelTable.load`` imports them all).

The forward function ``fn(node, dst, srcs, params)`` gets NumPy views of the result and of the
sources (``None`` where a source slot is empty, see ``backend.host_layout``) and the plan's
``ComputeParams`` (``params.py``: threads, pool, thresholds, scope), and returns the calls that
compute the node, a list of ``(kernel, args)``; ``supports(node)`` says which types and layouts it
handles (the CPU device's ``supports_op`` asks it). This is GGML's ``ggml_compute_forward``
switch, as a table.

Returning calls instead of making them lets the CPU backend plan a graph once (``backend.py``):
the arguments are checked, converted and packed when the plan is made, and a decode step replays
the plan, one call per kernel. So a forward must not read the *contents* of its tensors (they
change between replays): work that depends on them is a step of its own, a jitted kernel or a
plain Python function.

The forwards of one plan share its ``params.scope``: a forward can leave a step out when an
earlier step of the same plan already left its result in place, e.g. the matmuls of Q, K and V
quantize their one input once.
"""
from numba._dispatcher import compute_fingerprint

from .. import KernelTable

FORWARD = KernelTable("CPU", __package__)
forward = FORWARD.forward


def compiled(kernel, args):
    """The compiled entry point of a Numba kernel for the types of ``args``, or ``kernel`` itself
    (a Python step, or no exact overload). A plan's arguments never change type, so its calls can
    skip Numba's type dispatch: ~0.3 µs a call, ~10% of the 3.7M model's decode step."""
    overloads = getattr(kernel, "overloads", None)
    if overloads is None:
        return kernel
    compiled = overloads.get(tuple(_arg_type(kernel, a) for a in args))
    return kernel if compiled is None else compiled.entry_point


_ARG_TYPES = {}   # Numba's fingerprint of an argument -> its Numba type


def _arg_type(kernel, a):
    """``kernel.typeof_pyval(a)``, looked up by the fingerprint Numba's own dispatcher keys its
    type cache on (its C ``compute_fingerprint``, ~0.3 µs). Through ``typeof_pyval`` alone,
    binding the 3.7M model's plan took 4 ms, as much as it saves in 64 decode steps; this way 1 ms."""
    try:
        fingerprint = compute_fingerprint(a)
    except NotImplementedError:   # a value without one (a string...): Numba's slow path too
        return kernel.typeof_pyval(a)
    t = _ARG_TYPES.get(fingerprint)
    if t is None:
        t = _ARG_TYPES[fingerprint] = kernel.typeof_pyval(a)
    return t


def check_indices(what, bad, n_rows):
    """Raise for ``bad`` (a count) indices outside [0, n_rows) of op ``what``."""
    if bad:
        raise IndexError(f"{what}: {bad} indices out of range [0, {n_rows})")


class Checked:
    """A plan step (called without arguments) that runs a kernel returning how many of its indices
    were out of range (it skips those rows) and raises if any were: indices are data, computed by
    the graph, so they are checked at every run, not when the plan is made. Once a plan has run,
    the backend replays such a step from native code with the others (``replay.py``)."""

    __slots__ = ("what", "kernel", "args", "n_rows")

    def __init__(self, what, kernel, args, n_rows):
        self.what, self.kernel, self.args, self.n_rows = what, kernel, args, n_rows

    def __call__(self):
        check_indices(self.what, self.kernel(*self.args), self.n_rows)
