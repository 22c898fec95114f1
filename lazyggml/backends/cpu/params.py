"""What a CPU forward is told when it makes its steps: GGML's ``ggml_compute_params``, at plan time.

GGML hands each forward a ``ggml_compute_params`` (the thread's index ``ith`` of ``nth``, the work
buffer, the threadpool) every time the graph runs. lazyggml's forwards run once, when a graph's
plan is made (``table.py``), and return the kernel calls each run replays, so what they need is
known then and travels in a ``ComputeParams``:

* ``nth``: the threads the plan is made for (the backend's ``n_threads``; its governor may run
  fewer, and the pool's chunks are taken by whichever threads are active),
* ``pool``: the thread pool the parallel steps post their jobs to (``pool.py``),
* ``scope``: what earlier steps of the same plan left in place (``PlanScope``),
* ``thresholds``: the work below which a kernel runs on the calling thread alone (``Thresholds``).

Nothing here is process-wide: two CPU backends with different thread counts or thresholds in one
process (an RPC server beside a local model, say) make their plans independently, and no forward
reads Numba's thread count. (Scratch memory, ``matmul.scratch``, is per Python thread, as GGML's
work buffer is per graph compute.)
"""
from __future__ import annotations

from dataclasses import dataclass

from .pool import get_pool

# chunks per thread of a row kernel's job: a late or descheduled thread's chunks are taken by the
# others (pool.py), at the price of one compare-and-swap a chunk
CHUNKS_PER_THREAD = 2


@dataclass(frozen=True)
class Thresholds:
    """Below these amounts of work a step runs on one thread: waking the pool costs more."""

    #: elements of a row kernel's result (``ComputeParams.launch``: norms, element-wise, rope, softmax)
    #: and multiply-adds of the row-by-row flash attention
    elements: int = 1 << 15
    #: multiply-adds of a quantized product of several columns (and of MUL_MAT_ID). Measured when the
    #: tiles ran in OpenMP regions, ~3 µs each even while libgomp's workers still spun from the last
    #: one, and more when their tasks landed on the other core's cache (2 threads, weights in cache,
    #: best of 9): Q4_K 256x256 4.5 µs on one thread, 7.1 on two; 768x256 11.0 / 10.0-12.5; 256x768
    #: 8.6 / 9.4-9.7; Q6_K 1024x256 12.8 / 12.4-13.6; 768x768 21.9 / 16.5-22.3; 2048x768 57-74 / 38-44.
    macs: int = 1 << 18
    #: ... of a product of float weights, which at decode are the attention's KQ and KQV products:
    #: rows of a head's 64 values, each with its own horizontal sum, ~6.5 GMAC/s a thread. Measured
    #: (F16 KQ of one token over 256 cells): 4 heads (the embedded model's, 65536 multiply-adds) take
    #: 10.3 µs on one thread and 14.4 µs on two; 12 heads 32.0 and 30.6 µs; 12 heads over 512 cells
    #: 58.2 and 45.0.
    float_macs: int = 1 << 17
    #: ... of a single column's quantized product (decode), on the pool: a 128x256 product gained
    #: nothing from two threads
    pool_macs: int = 1 << 16


#: every parallel step takes its pool job, whatever its size (tests and warm-up: the parallel kernels)
ALWAYS_PARALLEL = Thresholds(0, 0, 0, 0)
#: every step runs on the calling thread
NEVER_PARALLEL = Thresholds(1 << 62, 1 << 62, 1 << 62, 1 << 62)


class PlanScope:
    """What the forwards of one plan know of the steps before theirs, in node order: ``slot`` (a
    scratch buffer, say) holds ``value``, the result of a step identified by ``key``, computed from
    the memory of the arrays ``srcs``. The backend calls ``written(dst)`` before each node's
    forward: a node that writes any of that memory clears the slot (an in-place op, say), so a
    forward that finds its key in the slot can leave its step out and use the value, and gets the
    same numbers (the matmuls of Q, K and V quantize their one input once)."""

    def __init__(self):
        self._slots = {}   # slot -> (key, value, [(first byte, end byte) of each src])

    def get(self, slot, key):
        """The value ``slot`` holds for ``key``, or None."""
        entry = self._slots.get(slot)
        return entry[1] if entry is not None and entry[0] == key else None

    def put(self, slot, key, srcs, value=True):
        """``slot`` now holds ``value``, the result ``key`` computed from the arrays ``srcs``."""
        self._slots[slot] = (key, value, [_span(a) for a in srcs])

    def written(self, dst):
        lo, hi = _span(dst)
        for slot, (_, _, spans) in list(self._slots.items()):
            if any(a < hi and lo < b for a, b in spans):
                del self._slots[slot]


class ComputeParams:
    """The parameters of one plan (see the module docstring). A fresh one per plan: its scope
    starts empty."""

    __slots__ = ("nth", "thresholds", "scope")

    def __init__(self, nth, thresholds=Thresholds()):
        self.nth, self.thresholds, self.scope = int(nth), thresholds, PlanScope()

    @property
    def pool(self):
        """The pool the plan's jobs go to: the process's, started on first use (its callers take
        turns; ``pool.py``)."""
        return get_pool()

    def step(self, kernel, nch, *args):
        """The plan step ``(kernel, args)`` of a ``common.parallel_kernel`` in ``nch`` chunks: a job
        of the pool, or the kernel itself on this thread for one chunk."""
        if nch > 1:
            return kernel.run, (self.pool.state, nch) + args
        return kernel, (0, 1) + args

    def launch(self, kernel, n_elements, *args):
        """``step`` of a row kernel: all of it on this thread when the work is below
        ``thresholds.elements``, else CHUNKS_PER_THREAD chunks a thread."""
        small = n_elements < self.thresholds.elements
        return self.step(kernel, 1 if small else CHUNKS_PER_THREAD * self.nth, *args)


def address(a):
    """The address of an array's first element (what plan keys name an array by)."""
    return a.__array_interface__["data"][0]


def _span(a):
    """[first byte, end byte) of the memory an array's elements occupy."""
    lo = hi = address(a)
    for n, st in zip(a.shape, a.strides):
        if n == 0:
            return lo, lo
        lo, hi = lo + min(0, (n - 1) * st), hi + max(0, (n - 1) * st)
    return lo, hi + a.itemsize
