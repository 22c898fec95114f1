"""The CPU backend's thread count per graph (``backends/cpu/threads.py``): fewer threads while other
programs keep CPUs busy, all of them again when they stop, and the same results on any count."""
import numpy as np
import pytest

import lazyggml as lg
from lazyggml.backends.cpu.threads import WINDOW, ThreadGovernor
from lazyggml.testing import make_tiny_llama


def _governor(monkeypatch, n_cpus, others):
    """A governor on ``n_cpus`` CPUs whose readings are our last graph's threads (the kernel counts
    them, still spinning) plus ``others``, the other programs' runnable tasks, one per reading."""
    g = ThreadGovernor()
    g.n_cpus, g.interval_ns = n_cpus, 0   # a reading at every graph
    it = iter(others)
    monkeypatch.setattr(g, "runnable", lambda: (g.ours or 1) + next(it))   # before any graph: the caller
    return g


def test_threads_follow_the_cpus_other_programs_leave(monkeypatch):
    g = _governor(monkeypatch, 8, [0] * WINDOW + [3] * WINDOW + [0] * WINDOW)
    assert [g.threads(6) for _ in range(WINDOW)] == [6] * WINDOW          # idle: every thread
    busy = [g.threads(6) for _ in range(WINDOW)]                          # 3 other programs start
    assert busy[0] == 6 and busy[-1] == 5                                 # not at their first reading
    assert [g.threads(6) for _ in range(WINDOW)][-1] == 6                 # they stop: all back


def test_one_busy_instant_changes_nothing(monkeypatch):
    g = _governor(monkeypatch, 2, [0, 0, 0, 3, 0, 0, 2, 0, 0, 0])
    assert [g.threads(2) for _ in range(10)] == [2] * 10


def test_never_below_one_nor_above_the_backends_count(monkeypatch):
    g = _governor(monkeypatch, 4, [40] * WINDOW + [0] * WINDOW)
    assert [g.threads(3) for _ in range(WINDOW)][-1] == 1
    assert [g.threads(3) for _ in range(WINDOW)][-1] == 3


def test_readings_are_at_least_an_interval_apart(monkeypatch):
    """Graphs that start within ``INTERVAL_NS`` of the last reading keep its decision (no reading);
    once the interval has passed, readings come again and see the CPU another program took."""
    g = _governor(monkeypatch, 2, [0] * WINDOW + [2] * WINDOW)
    assert [g.threads(2) for _ in range(WINDOW)] == [2] * WINDOW
    g.interval_ns = 10**12                       # every later graph starts "soon"
    read = g.runnable
    monkeypatch.setattr(g, "runnable", lambda: pytest.fail("a reading within the interval"))
    assert [g.threads(2) for _ in range(3 * WINDOW)] == [2] * (3 * WINDOW)
    g.runnable = read
    g.interval_ns = 0
    assert [g.threads(2) for _ in range(WINDOW)][-1] == 1


def test_without_a_runnable_count_the_backends_count_is_used(monkeypatch):
    g = ThreadGovernor()
    monkeypatch.setattr(g, "runnable", lambda: None)
    assert [g.threads(2) for _ in range(3)] == [2, 2, 2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("threads") / "tiny.gguf", n_layer=2, n_embd=256, n_head=4,
                           n_head_kv=2, n_ff=512, n_vocab=500, seed=3)


def test_logits_are_the_same_on_any_thread_count(tiny, monkeypatch):
    """A graph may run on fewer threads from one step to the next: each output element is still
    computed by one thread in one order, so the bits do not change."""
    toks = np.random.default_rng(0).integers(0, 500, 70).tolist()   # a prompt of two micro-batches
    out = {}
    for n in (1, 2):
        monkeypatch.setattr(ThreadGovernor, "threads", lambda self, n_max, n=n: min(n, n_max))
        model = lg.load_model(tiny, n_threads=2)
        out[n] = np.concatenate([model.eval(toks[:-3]), model.eval(toks[-3:-2]), model.eval(toks[-2:-1])])
    np.testing.assert_array_equal(out[1], out[2])
