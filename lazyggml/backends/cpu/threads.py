"""How many threads a graph runs on: the backend's count, fewer while other programs keep CPUs busy.

The parallel kernels are jobs of the backend's own pool (``pool.py``), which wait only for chunks
a worker has taken; but a worker that spins beside another program still takes half a CPU from it,
and when the kernels were OpenMP fork-join regions (Numba's default threading layer), each of which
ends only when every worker has arrived, the OS shared a busy CPU between the other program and
one of our workers and every region waited for that worker's next turn: measured on the 2-core
dev machine with one busy process beside it, the 125M model decoded at 35-40 tok/s on 2 threads
against 74 on one (140 idle on 2), and llama.cpp, whose threads spin the same way, collapses too.
So each graph runs on ``min(n_threads, CPUs not busy with other programs)`` (the pool's active
workers, and Numba's thread count), decided just before it starts:

* **how busy**: the kernel's count of runnable tasks, system-wide (``/proc/loadavg``'s fourth
  field, read with one ``pread``: under a microsecond), minus our own threads, which the count
  includes (the threads of our last graph, assumed still running: the pool's workers spin for a
  while after a job, so this errs towards using every thread);
* **steadily**: the lower median of the last ``WINDOW`` readings (a majority must see a CPU taken;
  all threads until there are that many), so that a process that runs for an instant moves nothing
  (on an idle machine about one reading in ten counts one task too many), and a program that keeps
  running takes a CPU within a few steps (a decode step is a graph) and gives it back as quickly
  when it stops;
* **cheaply**: at most one reading per ``INTERVAL_NS`` (1 ms); a graph that starts sooner keeps the
  last decision. A reading and its bookkeeping cost ~6 µs, and the embedded model's decode steps
  (~0.5 ms each) took one each: a reaction time of a few steps is kept by the clock instead.

Other mechanisms were measured and lost (125M decode, 2 threads, idle / one busy process):
OpenMP's ``OMP_WAIT_POLICY=passive`` 62 / 73 tok/s (its sleeping workers are slow to wake for
every region); ``GOMP_SPINCOUNT`` 10^4 or 10^5 no help under load (22 and 6); Intel TBB as Numba's
layer, whose work stealing does not wait for a descheduled worker, 117 / 91, but its workers sleep
between regions and waking them costs 6-12 µs a region against OpenMP's 2: the embedded model
decoded at 1,171 tok/s against 1,688 under OpenMP. Where ``/proc/loadavg`` does not exist the
backend's count is used as given.
"""
from __future__ import annotations

import os
import time

WINDOW = 8               # readings the decision looks at
INTERVAL_NS = 1_000_000  # ... taken at least this far apart


class ThreadGovernor:
    """Picks each graph's thread count (``threads``) from the machine's runnable tasks."""

    def __init__(self):
        self.n_cpus = os.cpu_count() or 1
        self.ours = None               # threads the last graph ran on (none yet: assume all)
        self.busy = []                 # other programs' runnable tasks, last WINDOW readings
        self.interval_ns = INTERVAL_NS
        self.last_ns = None            # when the last reading was taken
        try:
            self.fd = os.open("/proc/loadavg", os.O_RDONLY)
        except OSError:
            self.fd = None

    def runnable(self):
        """Runnable tasks on the whole machine, ours included (None where the OS does not say)."""
        if self.fd is None:
            return None
        return int(os.pread(self.fd, 128, 0).split()[3].split(b"/")[0])

    def threads(self, n_max):
        """The thread count for the next graph: at most ``n_max``, at least 1."""
        now = time.monotonic_ns()
        if self.ours is not None and self.ours <= n_max and now - self.last_ns < self.interval_ns:
            return self.ours
        self.last_ns = now
        r = self.runnable()
        if r is None:
            return n_max
        self.busy.append(max(0, r - (n_max if self.ours is None else self.ours)))
        del self.busy[:-WINDOW]
        if len(self.busy) < WINDOW:     # too few readings to tell a busy CPU from an instant
            self.ours = n_max
            return n_max
        others = sorted(self.busy)[(WINDOW - 1) // 2]   # a majority of the readings must agree
        self.ours = max(1, min(n_max, self.n_cpus - others))
        return self.ours

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
