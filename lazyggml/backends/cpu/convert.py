"""Whole arrays to and from a tensor type, bit-identical to GGML: the drivers behind
``lazyggml.quants`` (its docstring says what they guarantee), CPY and SET_ROWS.

``quantize(t, x)`` runs GGML's ``ggml_quantize_chunk(t, x, ..., imatrix=NULL)``: each type's
reference quantizer (``from_float_ref`` in ``traits.TYPE_TRAITS_CPU``) over the rows;
``quantize(t, x, cpu=True)`` runs the CPU backend's quantizer instead (``type_traits_cpu[t].from_float``,
what GGML's CPY and SET_ROWS run), which is the reference one but for Q8_0/Q8_1, whose x86 code rounds
a half to even where the reference rounds it away from zero (``dispatch.from_float``);
``dequantize(t, data, n_per_row)`` its ``to_float``. Both go through the type switches
``dispatch.quantize_chunk`` / ``dispatch.dequantize_chunk``: serially, or with the rows spread over
threads (``quantize_rows_parallel`` / ``dequantize_rows_parallel``) when there is enough work. F32
rows are copied.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...cache import tie_cache
from ...types import Type, as_type, blck_size, row_size, type_name
from . import dispatch, simd
from .traits import TYPE_TRAITS_CPU, types_with

#: the types ``quantize`` and ``dequantize`` take: F32, and those with a reference quantizer
SUPPORTED_TYPES = (Type.F32,) + types_with("from_float_ref")

#: the types whose CPU quantizer is not the reference one
CPU_QUANTIZER_TYPES = frozenset(t for t in types_with("from_float_ref")
                                if TYPE_TRAITS_CPU[t].from_float not in (None, TYPE_TRAITS_CPU[t].from_float_ref))

# below this many elements one thread is quicker than starting the parallel loop
_PARALLEL_MIN_ELEMENTS = 1 << 16


@njit(cache=True, parallel=True)
def quantize_rows_parallel(tid, x2d, y2d):
    """``dispatch.quantize_chunk`` with the rows of x2d (n_rows, n_per_row) spread over threads."""
    for r in prange(x2d.shape[0]):
        dispatch.quantize_chunk(tid, x2d[r], y2d[r])


@njit(cache=True)
def from_float_rows(tid, x2d, y2d):
    """``dispatch.from_float`` (the CPU's quantizer) over the rows of x2d, on one thread: a plan's
    CPY or SET_ROWS (a KV cache's rows) is small, and a plan runs no OpenMP region."""
    for r in range(x2d.shape[0]):
        dispatch.from_float(tid, x2d[r], y2d[r])


@njit(cache=True, parallel=True)
def dequantize_rows_parallel(tid, x2d, y2d):
    """``dispatch.dequantize_chunk`` with the rows of x2d (n_rows, row bytes) spread over threads."""
    for r in prange(x2d.shape[0]):
        dispatch.dequantize_chunk(tid, x2d[r], y2d[r])


def _check_type(t) -> Type:
    t = as_type(t)
    if t not in SUPPORTED_TYPES:
        raise ValueError(f"quantization to/from {type_name(t)} is not supported; "
                         f"supported: {', '.join(type_name(s) for s in SUPPORTED_TYPES)}")
    return t


def _check_row(t: Type, n_per_row: int, what: str) -> None:
    bs = blck_size(t)
    if n_per_row <= 0 or n_per_row % bs:
        raise ValueError(f"{type_name(t)}: {what} has rows of {n_per_row} elements, which is not a "
                         f"positive multiple of the block size {bs}")


def quantize(t, x, cpu=False) -> np.ndarray:
    """Quantize float rows to type ``t`` (with ``cpu``, as the CPU backend's CPY and SET_ROWS do).

    ``x``: a float array of shape (n_rows, n_per_row), or 1-D (one row); leading dimensions beyond
    two are folded into the rows. Any float dtype is accepted and converted to float32 first
    (GGML quantizes float32). Returns uint8 of shape (n_rows, row_size(t, n_per_row)).
    """
    t = _check_type(t)
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating) or x.ndim == 0:
        raise ValueError(f"{type_name(t)}: quantize needs a float array with at least one "
                         f"dimension, got dtype {x.dtype} and shape {x.shape}")
    n_per_row = x.shape[-1]
    _check_row(t, n_per_row, f"input of shape {x.shape}")
    x2 = np.ascontiguousarray(x.reshape(-1, n_per_row), dtype=np.float32)
    n_rows = x2.shape[0]
    if t == Type.F32:
        return x2.view(np.uint8).copy()
    y = np.empty((n_rows, row_size(t, n_per_row)), dtype=np.uint8)
    if cpu and t in CPU_QUANTIZER_TYPES:
        from_float_rows(int(t), x2, y)
    elif n_rows > 1 and x2.size >= _PARALLEL_MIN_ELEMENTS:
        quantize_rows_parallel(int(t), x2, y)
    else:
        dispatch.quantize_chunk(int(t), x2.reshape(-1), y.reshape(-1))
    return y


def dequantize(t, data, n_per_row: int) -> np.ndarray:
    """Dequantize rows of type ``t`` back to float32.

    ``data``: the packed rows as bytes-like or any NumPy array (its raw bytes are used, so a
    float16 array is fine for F16); the byte count must be a whole number of rows of
    ``n_per_row`` elements. Returns float32 of shape (n_rows, n_per_row), bit-identical to GGML's
    ``dequantize_row_*`` except for NaN payloads where two NaN fields meet (IEEE leaves open which
    payload survives ``NaN + NaN``; the result is a NaN either way).
    """
    t = _check_type(t)
    n_per_row = int(n_per_row)
    _check_row(t, n_per_row, "dequantize")
    if isinstance(data, np.ndarray):
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        raw = np.frombuffer(data, dtype=np.uint8)
    # always hand the kernels a read-only view (like GGML's const block *): numba compiles a
    # separate copy of every kernel per writeable flag, and mmap'd GGUF data is read-only anyway
    raw = raw.view()
    raw.flags.writeable = False
    rs = row_size(t, n_per_row)
    if raw.size % rs:
        raise ValueError(f"{type_name(t)}: {raw.size} bytes is not a whole number of rows of "
                         f"{n_per_row} elements ({rs} bytes each)")
    n_rows = raw.size // rs
    if t == Type.F32:
        return raw.view(np.float32).reshape(n_rows, n_per_row).copy()
    y = np.empty((n_rows, n_per_row), dtype=np.float32)
    x2 = raw.reshape(n_rows, rs)
    if n_rows > 1 and y.size >= _PARALLEL_MIN_ELEMENTS:
        dequantize_rows_parallel(int(t), x2, y)
    else:
        dispatch.dequantize_chunk(int(t), raw, y.reshape(-1))
    return y


# the cache of the parallel drivers also depends on the switches and the kernels they call
# (from_float_rows reaches type_legacy's x86 quantizers, written with simd's intrinsics)
tie_cache(globals(), simd.ISA, *dispatch.KERNEL_FILES, dispatch.__file__, __file__)
