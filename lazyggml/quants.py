"""Quantize and dequantize whole tensors, bit-identical to GGML.

``quantize(t, x)`` gives exactly the bytes of GGML's ``ggml_quantize_chunk(t, x, ..., imatrix=NULL)``
(the reference quantizers, spec/quant-formats.md §4); ``dequantize(t, data, n_per_row)`` gives
exactly GGML's ``dequantize_row_*`` floats. The kernels live in ``kernels/cpu/quant.py``.

Supported types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K, Q8_K.

NaN and Inf inputs:

* F16 / BF16 conversions are fully defined and match GGML: Inf stays Inf, finite values too large
  for fp16 become Inf, NaN becomes ``sign | 0x7E00`` in F16 and a quiet NaN in BF16.
* For the quantized types GGML does not define the result (its C float-to-int conversions of NaN
  and out-of-range values are undefined behaviour). We reproduce what an x86-64 build of GGML
  does (``cvttss2si``: NaN or out of range -> INT_MIN, of which C keeps the low byte) and the
  ``nearest_int`` bit trick exactly; the tests find x86 GGML's bytes for NaN and +-Inf inputs in
  every type, but other platforms' GGML may differ there.
* One intentional difference: an all-zero Q8_K block gets zero ``bsums``; GGML leaves them as
  they were in the destination buffer.
"""
from __future__ import annotations

import numpy as np

from .kernels.cpu import quant as _k
from .types import Type, as_type, blck_size, row_size, type_name

SUPPORTED_TYPES = (Type.F32,) + tuple(_k.QUANTIZE_ROW)

# below this many elements one thread is quicker than starting the parallel loop
_PARALLEL_MIN_ELEMENTS = 1 << 16


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


def quantize(t, x) -> np.ndarray:
    """Quantize float rows to type ``t``.

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
    if n_rows > 1 and x2.size >= _PARALLEL_MIN_ELEMENTS:
        _k.quantize_rows_parallel(int(t), x2, y)
    else:
        _k.quantize_chunk(int(t), x2.reshape(-1), y.reshape(-1))
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
        _k.dequantize_rows_parallel(int(t), x2, y)
    else:
        _k.dequantize_chunk(int(t), raw, y.reshape(-1))
    return y
