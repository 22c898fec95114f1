"""GET_ROWS and SET_ROWS on the CPU (GGML's ``ggml_compute_forward_get_rows`` / ``set_rows``).

GET_ROWS: ``a`` [ne00, ne01, ne02, ne03], indices ``b`` [n, ne02, ne03] (I32 or I64) ->
``dst[i12, i11, i10] = a[i12, i11, b[i12, i11, i10]]`` (NumPy order). F32 and I32 rows are copied,
F16 and BF16 rows converted to F32, quantized rows dequantized (``dispatch.dequantize_chunk``).

SET_ROWS: ``dst`` (a view of ``a``) gets ``dst[i03, i02, c[i03 % ne12, i02 % ne11, i]] = b[i03, i02,
i]`` for every row ``i`` of the F32 ``b``; the indices broadcast over ``b``'s dims 2 and 3. The rows
are converted to ``a``'s type: F32, F16, BF16, or quantized (``lazyggml.quants``, GGML's
``from_float``).

Rows move through small serial kernels (memory bound; see copy.py on compile costs); GET_ROWS
dequantizes each quantized row in its kernel (a decode step's token embedding: one row), while
SET_ROWS scatters the bytes of rows quantized by the quantizers' own compiled drivers.

An index outside ``[0, n_rows)`` is an error (GGML asserts): the kernels skip such rows, count
them, and the forward raises ``IndexError``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ...cache import tie_cache
from ...ops import Op
from ...types import Type, is_quantized, type_size
from . import common, convert, dispatch, simd
from .table import Checked, check_indices, forward
from .common import (FLOAT_TYPES, KIND, KIND_F32, KIND_RAW, as_bits, convert_row, from_f32, quant_ready, to_f32,
                   unravel_row)

_kernel = njit(cache=True, error_model="numpy")

_INDEX_TYPES = (Type.I32, Type.I64)


@_kernel
def _row_index(idx, i3, i2, i1, n_rows):
    """The I32/I64 index at [i3, i2, i1] of ``idx`` (1, n3, n2, n1), or -1 when out of range."""
    i = np.int64(idx[0, i3, i2, i1])
    return i if 0 <= i < n_rows else -1


@_kernel
def get_rows(src, skind, idx, dst, dkind):
    n3, n2, n1, _ = dst.shape
    bad = 0
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = unravel_row(r, n1, n2)
        i01 = _row_index(idx, i3, i2, i1, src.shape[2])
        if i01 < 0:
            bad += 1
        else:
            convert_row(src[i3, i2, i01], skind, dst[i3, i2, i1], dkind)
    return bad


@_kernel
def get_rows_q(tid, src, idx, dst):
    """GET_ROWS of quantized rows (type id ``tid``, rows of bytes) into float32 ``dst``."""
    n3, n2, n1, _ = dst.shape
    bad = 0
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = unravel_row(r, n1, n2)
        i01 = _row_index(idx, i3, i2, i1, src.shape[2])
        if i01 < 0:
            bad += 1
        else:
            dispatch.dequantize_chunk(tid, src[i3, i2, i01], dst[i3, i2, i1])
    return bad


@_kernel
def set_rows(src, idx, dst, dkind):
    n3, n2, n1, _ = src.shape
    bad = 0
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = unravel_row(r, n1, n2)
        i = _row_index(idx, i3 % idx.shape[1], i2 % idx.shape[2], i1, dst.shape[2])
        if i < 0:
            bad += 1
        elif src.shape[3] == 1:   # rows of one element (a transposed V cache): no row views
            dst[i3, i2, i, 0] = from_f32(to_f32(src[i3, i2, i1, 0], KIND_F32), dkind)
        else:
            convert_row(src[i3, i2, i1], KIND_F32, dst[i3, i2, i], dkind)
    return bad


def _batch_indices(idx, n3, n2, n_rows, what):
    """NumPy index arrays addressing row ``idx[i3 % m3, i2 % m2, i]`` of each batch (i3, i2),
    for ``idx`` (1, m3, m2, n); checked."""
    i = idx[0][np.arange(n3) % idx.shape[1]][:, np.arange(n2) % idx.shape[2]].astype(np.int64)
    check_indices(what, np.count_nonzero((i < 0) | (i >= n_rows)), n_rows)
    return np.arange(n3)[:, None, None], np.arange(n2)[None, :, None], i


def _get_rows_supported(node):
    a, b = node.src[0], node.src[1]
    if b.type not in _INDEX_TYPES or node.type != (Type.I32 if a.type == Type.I32 else Type.F32):
        return False
    if is_quantized(a.type):
        return quant_ready(a.type) and a.nb[0] == type_size(a.type)
    return a.type in FLOAT_TYPES or a.type == Type.I32


def _set_rows_q(qtype, b, idx, n_rows, dst):
    """Quantize b's rows with the CPU's quantizer (GGML's from_float), scatter their bytes."""
    n3, n2, n, _ = b.shape
    i3, i2, i = _batch_indices(idx, n3, n2, n_rows, "set_rows")
    dst[i3, i2, i] = convert.quantize(qtype, b, cpu=True).reshape(n3, n2, n, -1)


@forward(Op.GET_ROWS, supports=_get_rows_supported)
def get_rows_forward(node, dst, srcs, params):
    a = node.src[0]
    if is_quantized(a.type):
        return [(Checked("get_rows", get_rows_q, (int(a.type), srcs[0], srcs[1], dst), a.ne[1]), ())]
    # F32 and I32 rows are copied as they are; F16, BF16 converted to F32
    skind = KIND_RAW if a.type in (Type.F32, Type.I32) else KIND[a.type]
    return [(Checked("get_rows", get_rows, (as_bits(srcs[0]), skind, srcs[1], as_bits(dst), KIND_F32), a.ne[1]),
             ())]


def _set_rows_supported(node):
    b, c = node.src[0], node.src[1]
    if b.type != Type.F32 or c.type not in _INDEX_TYPES:
        return False
    if is_quantized(node.type):
        return quant_ready(node.type) and node.nb[0] == type_size(node.type)
    return node.type in FLOAT_TYPES


@forward(Op.SET_ROWS, supports=_set_rows_supported)
def set_rows_forward(node, dst, srcs, params):
    if is_quantized(node.type):
        return [(_set_rows_q, (node.type, srcs[0], srcs[1], node.ne[1], dst))]
    return [(Checked("set_rows", set_rows, (as_bits(srcs[0]), srcs[1], as_bits(dst), KIND[node.type]), node.ne[1]),
             ())]


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, *dispatch.KERNEL_FILES, dispatch.__file__, common.__file__, __file__)
