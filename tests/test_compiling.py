"""compiling.py's one stream of compile events, as its listeners (warm-up, the first-run notice) see it."""
from __future__ import annotations

import numba
import pytest

import lazyggml  # noqa: F401  (the CPU backend hands Numba's dispatcher to the stream)
from lazyggml import compiling
from lazyggml.backends.cpu import backend_cpu_init
from lazyggml.backends.cpu.params import Thresholds


class Events:
    def __init__(self):
        self.started, self.events = [], []

    def compile_started(self, name):
        self.started.append(name)

    def compile_event(self, event):
        self.events.append(event)


def test_a_kernel_and_its_callee_are_misses_with_their_own_seconds_and_one_compilation_watched():
    @numba.njit
    def callee(x):
        return x * 3 + 1

    @numba.njit
    def kernel(x):
        return callee(x) - 2

    started = []
    with compiling.listen(Events()) as heard, compiling.CompileWatch(on_start=started.append) as watch:
        assert kernel(4) == 11
        assert kernel(5) == 14          # in memory now: no event
    inner, outer = heard.events
    assert (inner.kernel.endswith("<locals>.callee"), inner.outer, inner.status) == (True, False, "miss")
    assert (outer.kernel.endswith("<locals>.kernel"), outer.outer, outer.status) == (True, True, "miss")
    assert outer.signature == "(int64)" and outer.backend == "cpu"
    assert len(heard.started) == 1 and outer.kernel.endswith("." + heard.started[0])   # announced before
    assert inner.seconds > 0 and outer.seconds > 0
    # the first-run notice's watch: one compilation (the callee inside it), announced before it ran
    assert watch.count == 1 and started == heard.started
    assert watch.seconds == inner.seconds + outer.seconds
    kernel(2.5)                          # nobody listening: nothing delivered
    assert len(heard.events) == 2 and watch.count == 1


def test_refusing_raises_where_a_kernel_would_compile_and_reports_the_miss():
    @numba.njit
    def never_compiled(x):
        return x + 1

    with compiling.listen(Events()) as heard, compiling.refusing():
        with pytest.raises(compiling.WouldCompile, match="never_compiled"):
            never_compiled(1)
    assert [(e.status, e.outer) for e in heard.events] == [("miss", True)]
    assert never_compiled(1) == 2        # compiles again once the block has ended


def test_a_compilation_numba_does_not_see_and_a_cached_load():
    with compiling.listen(Events()) as heard:
        with compiling.compiling("program", backend="OpenCL9"):
            pass
        compiling.loaded("program", 0.25, backend="OpenCL9")
    assert heard.started == ["program"]
    assert [(e.backend, e.kernel, e.status, e.outer) for e in heard.events] == [
        ("OpenCL9", "program", "miss", True), ("OpenCL9", "program", "hit", True)]
    assert heard.events[1].seconds == 0.25


def test_only_a_listener_that_asks_gets_first_launches_timed():
    assert not compiling.watching_launches()
    with compiling.listen(Events()):
        assert not compiling.watching_launches()
        with compiling.listen(Events(), launches=True):
            assert compiling.watching_launches()
    assert not compiling.watching_launches()


def test_the_cpu_backend_offers_its_row_kernels_pooled_as_a_warmup_variant():
    cpu = backend_cpu_init()
    plain, pooled = cpu.warmup_variants()
    with plain:
        assert cpu.thresholds == Thresholds()
    with pooled:
        assert cpu.thresholds.elements == 0 and cpu.thresholds.macs == Thresholds().macs
    assert cpu.thresholds == Thresholds()
