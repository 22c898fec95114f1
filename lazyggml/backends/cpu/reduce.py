"""Reductions on the CPU: SUM, SUM_ROWS, MEAN (GGML's ops.cpp), ARGMAX, and ARGSORT (a row's order).

Sums run in index order in double precision (GGML's ``ggml_float``) and are rounded to float32
once per row; SUM adds the row sums in double too. MEAN divides the float32 row sum by ``ne0`` in
float32, as GGML does.

ARGMAX is GGML's loop: ``max = MAX(max, x[i]); if (max == x[i]) idx = i``. With ties this keeps
the LAST of the equal maxima (checked against GGML's CPU backend: ``[1, 3, 3, 2] -> 2``); NumPy's
``argmax`` returns the first.

ARGSORT orders each row's indices by value, stably (equal values keep the lower index first;
GGML's sort promises no order for ties, and there is none to match on real data).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ...ops import Op, SortOrder, sort_order
from ...types import Type
from .table import forward

_kernel = njit(cache=True, error_model="numpy")

_SUM, _SUM_ROWS, _MEAN = 0, 1, 2


@_kernel
def reduce_rows(mode, x, dst):
    """SUM_ROWS / MEAN into ``dst`` (n3, n2, n1, 1), or SUM into ``dst`` (1, 1, 1, 1)."""
    n3, n2, n1, n0 = x.shape
    total = 0.0
    for i3 in range(n3):
        for i2 in range(n2):
            for i1 in range(n1):
                row = x[i3, i2, i1]
                s = 0.0
                for i0 in range(n0):
                    s += np.float64(row[i0])
                if mode == _SUM:
                    total += s
                elif mode == _SUM_ROWS:
                    dst[i3, i2, i1, 0] = np.float32(s)
                else:
                    dst[i3, i2, i1, 0] = np.float32(s) / np.float32(n0)
    if mode == _SUM:
        dst[0, 0, 0, 0] = np.float32(total)


@_kernel
def argmax(x, dst):
    """Per row of the matrix ``x`` (1, 1, n1, n0): the index of its largest value into
    ``dst`` (1, 1, 1, n1)."""
    for i1 in range(x.shape[2]):
        row = x[0, 0, i1]
        vmax = -np.float32(np.inf)
        idx = 0
        for i in range(row.shape[0]):
            vmax = vmax if vmax > row[i] else row[i]  # C's MAX(a, b)
            if vmax == row[i]:
                idx = i
        dst[0, 0, 0, i1] = idx


@_kernel
def argsort(x, desc, dst):
    """Per row of ``x`` (any 4-D float32 view): the indices of its values in ascending (or, with
    ``desc``, descending) order into the same row of ``dst`` (int32)."""
    n3, n2, n1, _ = x.shape
    for i3 in range(n3):
        for i2 in range(n2):
            for i1 in range(n1):
                row = x[i3, i2, i1]
                order = np.argsort(-row if desc else row.copy(), kind="mergesort")
                for i in range(order.shape[0]):
                    dst[i3, i2, i1, i] = order[i]


def _f32_src(node):
    return node.src[0].type == Type.F32 and node.type in (Type.F32, Type.I32)


@forward(Op.SUM, Op.SUM_ROWS, Op.MEAN, supports=_f32_src)
def reduce_forward(node, dst, srcs, params):
    return [(reduce_rows, ({Op.SUM: _SUM, Op.SUM_ROWS: _SUM_ROWS, Op.MEAN: _MEAN}[node.op], srcs[0], dst))]


@forward(Op.ARGMAX, supports=_f32_src)
def argmax_forward(node, dst, srcs, params):
    return [(argmax, (srcs[0], dst))]


@forward(Op.ARGSORT, supports=_f32_src)
def argsort_forward(node, dst, srcs, params):
    return [(argsort, (srcs[0], sort_order(node) == SortOrder.DESC, dst))]
