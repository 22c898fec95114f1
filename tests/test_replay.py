"""The CPU plan's native replay (backends/cpu/replay.py): a run of kernel calls made from native code
must do exactly what the same calls from Python do, in order, with their errors."""
import gc
import warnings

import numpy as np
import pytest
from numba import njit

from lazyggml.backends.cpu import common, replay
from lazyggml.backends.cpu.table import Checked


@njit
def _axpy(a, x, y, out, flag, dims, none):
    """out = a*x + y over a 2-D strided view; the int, bool, tuple and None arguments all travel."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = a * x[i, j] + y[i, j] + (dims[0] - dims[1] if flag else 0.0)


@njit
def _double(x):
    for i in range(x.size):
        x[i] *= 2


@njit
def _gather(src, idx, out):
    """out[i] = src[idx[i]] for the good indices; returns how many were out of range (Checked)."""
    bad = 0
    for i in range(idx.size):
        if 0 <= idx[i] < src.size:
            out[i] = src[idx[i]]
        else:
            bad += 1
    return bad


@njit
def _check_positive(x):
    for i in range(x.size):
        if x[i] < 0:
            raise ValueError("negative element")


@common.parallel_kernel
def _rows_plus(ch, nch, x, c, out):
    for r in common.chunk(x.shape[0], ch, nch):
        for j in range(x.shape[1]):
            out[r, j] = x[r, j] + c


def _run(steps):
    for kernel, args in steps:
        kernel(*args)


def _bound(steps):
    """Run ``steps`` once from Python (compiling every kernel, as a plan's first run does), then bind."""
    _run(steps)
    return replay.bind(steps)


def test_replay_matches_python_calls_in_order():
    rng = np.random.default_rng(0)
    big = rng.standard_normal((6, 10)).astype(np.float32)
    x, y = big[::2, 1:8], rng.standard_normal((3, 7)).astype(np.float32)   # strided and contiguous
    axpy = np.full((3, 7), np.nan, np.float32)
    v = rng.standard_normal(16)
    rows = rng.standard_normal((40, 5)).astype(np.float32)
    w = np.full((40, 5), np.nan, np.float32)
    state = common.pool.get_pool().state
    bound = _bound([(_axpy, (np.float32(1.5), x, y, axpy, True, (7, 2), None)),
                    (np.copyto, (v, 3.0)),                         # a Python step between native runs
                    (_double, (v,)),                               # must see the copy's 3.0
                    (_rows_plus.run, (state, 4, rows, 0.25, w)),   # a pool job (a ``*args`` driver)
                    (_rows_plus, (0, 1, w, -1.0, w))])             # after it: order matters
    assert len(bound) == 3 and bound[1][0] is np.copyto   # native, Python, native
    for a in (axpy, v, w):
        a[...] = np.nan
    _run(bound)
    np.testing.assert_array_equal(axpy, np.float32(1.5) * x + y + np.float32(5.0))
    np.testing.assert_array_equal(v, 6.0)
    np.testing.assert_array_equal(w, rows + np.float32(0.25) - np.float32(1.0))


def test_replay_keeps_its_arrays_alive():
    src = np.arange(32, dtype=np.float64)
    out = np.zeros(32)
    bound = _bound([(_rows_plus, (0, 1, src.reshape(8, 4).copy(), 1.0, out.reshape(8, 4)))])
    gc.collect()
    out[:] = 0
    for _ in range(3):
        _run(bound)
        np.testing.assert_array_equal(out, src + 1.0)


def test_replay_checked_step_raises_on_bad_indices_and_stops():
    src = np.arange(10, dtype=np.float32) * 2
    idx = np.array([1, 3, 5], np.int64)
    out = np.zeros(3, np.float32)
    after = np.ones(4)
    bound = _bound([(Checked("get_rows", _gather, (src, idx, out), 10), ()), (_double, (after,))])
    assert len(bound) == 1
    _run(bound)
    np.testing.assert_array_equal(out, [2, 6, 10])
    np.testing.assert_array_equal(after, 4.0)   # two runs: the Python one and the replay
    idx[1] = 10
    with pytest.raises(IndexError, match=r"get_rows: 1 indices out of range \[0, 10\)"):
        _run(bound)
    np.testing.assert_array_equal(after, 4.0)   # the run stopped at the failing step
    idx[1] = -1
    idx[2] = 99
    with pytest.raises(IndexError, match=r"get_rows: 2 indices"):
        _run(bound)
    idx[:] = [0, 0, 9]
    _run(bound)   # good again: the bad state does not stick
    np.testing.assert_array_equal(out, [0, 0, 18])


def test_replay_propagates_a_kernel_exception():
    x = np.ones(5)
    bound = _bound([(_check_positive, (x,)), (_double, (x,))])
    np.testing.assert_array_equal(x, 2.0)
    x[3] = -1.0
    with pytest.raises(ValueError, match="negative element"):
        _run(bound)
    assert x[0] == 2.0   # the step after the failing one did not run


def test_replay_off_calls_each_kernel_from_python(monkeypatch):
    """``LAZYGGML_CPU_REPLAY=0``: a plan step per kernel (what a per-kernel profile times)."""
    monkeypatch.setattr(replay, "ENABLED", False)
    x = np.ones(4)
    bound = _bound([(_double, (x,)), (_double, (x,))])
    assert len(bound) == 2 and not any(isinstance(k, replay._Run) for k, _ in bound)
    _run(bound)
    np.testing.assert_array_equal(x, 16.0)


@njit
def _sum_list(xs, out):
    out[0] = 0.0
    for x in xs:
        out[0] += x


def test_replay_leaves_steps_with_python_objects_to_python():
    """A list argument's native form refers to its Python object: such a step stays a Python call."""
    out, x = np.zeros(1), np.ones(3)
    with warnings.catch_warnings():   # Numba's reflected-list deprecation
        warnings.simplefilter("ignore")
        bound = _bound([(_double, (x,)), (_sum_list, ([1.0, 2.5], out)), (_double, (x,))])
    assert len(bound) == 3 and isinstance(bound[0][0], replay._Run) and not isinstance(bound[1][0], replay._Run)
    _run(bound)
    assert out[0] == 3.5
    np.testing.assert_array_equal(x, 16.0)
