"""DUP, CONT and CPY on the CPU (GGML's ``ggml_compute_forward_dup``).

GGML's copy semantics: the elements of ``src`` are taken in its row-major *logical* order (i0
fastest, then i1, i2, i3, whatever the strides) and written to ``dst`` in *its* logical order. The
shapes may differ as long as the element counts agree, and either side may be strided (a permuted
view, a transposed one, a view with gaps between rows). So one kernel serves DUP (same shape),
CONT (a packed copy, maybe reshaped) and CPY (into a view of another tensor, converting the type).
Elements move as raw bits with a kind that says how to convert them (``common.py``).

Quantized copies follow GGML's two special cases: quantized -> float (``dup_from_q``) dequantizes
each source row and scatters it in logical order; float -> quantized (``dup_to_q``) needs a
contiguous destination and quantizes each source row into the next ``row_size`` bytes. The rows go
through ``convert.quantize`` / ``convert.dequantize`` (the quantizers' own compiled drivers, threaded
for large inputs) rather than being compiled into these kernels a second time.

The kernels here are serial: copies are memory bound, and a ``parallel=True`` kernel costs about
2 s more to compile per signature than these do.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ...cache import tie_cache
from ...ops import Op
from ...types import Type, blck_size, is_quantized, type_size
from . import type_common
from . import simd
from . import common, convert
from .common import (FLOAT_TYPES, KIND, KIND_F32, KIND_RAW, as_bits, convert_row, from_f32, quant_ready, to_f32,
                     unravel_row)
from .table import forward

_kernel = njit(cache=True, error_model="numpy")


@_kernel
def _scatter(s, skind, dst, dkind, k):
    """Write the row ``s`` to ``dst`` starting at logical (flat) element ``k`` of ``dst``."""
    n3, n2, n1, n0 = dst.shape
    i0 = k % n0
    i3, i2, i1 = unravel_row(k // n0, n1, n2)
    if i0 == 0 and s.shape[0] == n0:  # rows line up: a plain row copy
        convert_row(s, skind, dst[i3, i2, i1], dkind)
        return
    same = skind == dkind or skind == KIND_RAW
    for j in range(s.shape[0]):
        if same:
            dst[i3, i2, i1, i0] = s[j]
        else:
            dst[i3, i2, i1, i0] = from_f32(to_f32(s[j], skind), dkind)
        i0 += 1
        if i0 == n0:
            i0 = 0
            i1 += 1
            if i1 == n1:
                i1 = 0
                i2 += 1
                if i2 == n2:
                    i2 = 0
                    i3 += 1


@_kernel
def copy_flat(src, skind, dst, dkind):
    """GGML's dup between plain types: src's elements in logical order into dst's logical order."""
    n3, n2, n1, n0 = src.shape
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = unravel_row(r, n1, n2)
        _scatter(src[i3, i2, i1], skind, dst, dkind, r * n0)


# -- forward --------------------------------------------------------------------------------------
def _copy_plan(node):
    """How to copy ``node.src[0]`` into ``node``: 'raw', 'convert', 'from_q', 'to_q', or None."""
    s, d = node.src[0].type, node.type
    if node.src[0].nelements() != node.nelements():
        return None
    if s == d:
        if is_quantized(s):  # bytes in block order: rows must be packed blocks on both sides
            ok = node.src[0].nb[0] == type_size(s) and node.nb[0] == type_size(d)
            return "raw" if ok else None
        return "raw"
    if s in KIND and d in KIND and (s in FLOAT_TYPES or d in FLOAT_TYPES):
        if (s == Type.I32 or d == Type.I32) and Type.F32 not in (s, d):
            return None  # GGML converts I32 only to and from F32
        return "convert"
    if is_quantized(s) and d in FLOAT_TYPES and quant_ready(s):
        return "from_q" if node.src[0].nb[0] == type_size(s) else None
    if s in FLOAT_TYPES and is_quantized(d) and quant_ready(d):
        ok = node.is_contiguous() and node.src[0].ne[0] % blck_size(d) == 0
        return "to_q" if ok and node.src[0].nb[0] == type_size(s) else None
    return None


def _supports(node):
    return _copy_plan(node) is not None


def _copy_from_q(qtype, s, n0, dst, dkind):
    """Dequantize the rows of ``s``, then scatter them in logical order."""
    rows = convert.dequantize(qtype, np.ascontiguousarray(s), n0)
    copy_flat(rows.reshape(s.shape[:3] + (-1,)).view(np.uint32), KIND_F32, as_bits(dst), dkind)


def _copy_to_q(s, skind, n0, dst, qtype):
    """Quantize float32 rows (``s`` converted first if it is F16/BF16) into the packed ``dst``."""
    rows = s
    if skind != KIND_F32:
        rows = np.empty(s.shape, np.float32)
        copy_flat(as_bits(s), skind, rows.view(np.uint32), KIND_F32)
    dst.reshape(-1)[:] = convert.quantize(qtype, rows.reshape(-1, n0), cpu=True).reshape(-1)


@forward(Op.DUP, Op.CONT, Op.CPY, supports=_supports)
def copy_forward(node, dst, srcs, params):
    src_t, s = node.src[0], srcs[0]
    plan = _copy_plan(node)
    if plan == "raw":
        return [(copy_flat, (as_bits(s), KIND_RAW, as_bits(dst), KIND_RAW))]
    if plan == "convert":
        return [(copy_flat, (as_bits(s), KIND[src_t.type], as_bits(dst), KIND[node.type]))]
    if plan == "from_q":
        return [(_copy_from_q, (src_t.type, s, src_t.ne[0], dst, KIND[node.type]))]
    return [(_copy_to_q, (s, KIND[src_t.type], src_t.ne[0], dst, node.type))]


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, type_common.__file__, common.__file__, __file__)
