"""The CPU backend's thread pool (``backends/cpu/pool.py``): every chunk of a job runs exactly once,
on any number of active workers, with workers asleep, from several Python threads at once, and in
a forked child; the workers stop at exit."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from numba import njit

from lazyggml.backends.cpu import pool as P


@njit(cache=True)
def _body(c, n, out, runs, a, s):
    """Chunk c of n: its share of out = a * s, and a tally of the chunk's runs."""
    for i in range(c * out.size // n, (c + 1) * out.size // n):
        out[i] = a[i] * s
    runs[c] += 1


@njit(cache=True)
def _job(state, n, out, runs, a, s):
    P.parallel_for(state, _body, n, (out, runs, a, s))


@njit(cache=True)
def _any_body(c, n, *args):
    pass


@njit(cache=True)
def _big_job(state, a):
    P.parallel_for(state, _any_body, 2, (a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a,
                                      a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a,
                                      a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a))


@pytest.fixture
def pool():
    p = P.get_pool()
    yield p
    p.set_threads(len(p.threads) + 1)


def _check(state, n, scale=2.0, size=1000):
    rng = np.random.default_rng(n)
    a = rng.standard_normal(size).astype(np.float32)
    out, runs = np.zeros(size, np.float32), np.zeros(n, np.int64)
    _job(state, n, out, runs, a, scale)
    assert (runs == 1).all(), runs
    assert np.array_equal(out, a * np.float32(scale) if n else np.zeros(size, np.float32))


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 1000])
def test_every_chunk_runs_once(pool, threads, n):
    pool.set_threads(threads)
    _check(pool.state, n)


def test_jobs_in_a_row_and_with_the_workers_asleep(pool):
    """Many jobs back to back (a worker that wakes late must not take a chunk of a newer job with
    an older job's arguments), then one after the workers went to sleep (the caller does not wait
    for them)."""
    for i in range(2000):
        _check(pool.state, 1 + i % 5, scale=float(i), size=37)
    time.sleep(P.NAPS * P.NAP_US * 1e-6 + 0.2)
    _check(pool.state, 8)


def test_caller_finishes_a_job_alone(pool):
    """Without active workers every chunk runs on the caller; so it does when the workers exist but
    none may take a chunk (a busy machine)."""
    pool.set_threads(1)
    _check(pool.state, 16)
    assert pool.state[P.OWNER] == 0


def test_callers_on_several_python_threads(pool):
    """Two Python threads post jobs at once: one holds the pool, the other runs its job alone;
    every result is right."""
    errors = []

    def hammer(scale):
        try:
            for i in range(3000):
                _check(pool.state, 1 + i % 8, scale=scale, size=64)
        except AssertionError as e:   # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=hammer, args=(s,)) for s in (3.0, 5.0, 7.0)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_arguments_too_big_for_a_job_are_a_compile_error(pool):
    with pytest.raises(Exception, match="pool: the arguments of a job take"):
        _big_job(pool.state, np.zeros(4, np.float32))


_CHILD = """
import os, sys, numpy as np
sys.path.insert(0, {tests!r})
from test_cpu_pool import _check
from lazyggml.backends.cpu import pool as P
p = P.get_pool()
_check(p.state, 8)
pid = os.fork()
if pid == 0:                     # the child: none of the parent's threads, a pool of its own
    _check(P.get_pool().state, 8)
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert status == 0, status
_check(p.state, 8)
print("done")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this OS")
def test_fork_and_exit():
    """A forked child runs jobs on its own pool; the process exits at once, with status 0, while
    its workers spin (they are stopped and joined at exit)."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _CHILD.format(tests=os.path.dirname(__file__))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr
    assert time.monotonic() - t0 < 120
