"""SOFT_MAX (with soft_max_ext's mask, scale and ALiBi) and DIAG_MASK_INF on the CPU
(GGML's ``ggml_compute_forward_soft_max_f32`` / ``diag_mask_f32``).

SOFT_MAX, per row (i1, i2, i3) of ``ne0`` elements: ``w = x*scale + slope*mask[i1, i2 % ne12,
i3 % ne13]`` (the mask row is ``i1`` itself: ``mask.ne[1] >= ne1`` rows, broadcast over dims 2, 3),
then ``y = exp(w - max(w)) / sum``, the sum accumulated in double and its inverse applied as a
float32 factor, in the order of GGML's AVX2 ``ggml_vec_soft_max_f32``: each run of 8 elements is
``ggml_v_expf`` (see elementwise.py) summed in float32 as ``hsum`` adds (lo4 + hi4, then (0 + 2) +
(1 + 3)) before it joins the double sum; the last ``ne0 % 8`` take libm's ``expf`` and join one by
one (GGML's AVX-512 build sums runs of 16, so its last bits differ). The mask may be F32 or F16
(read through its bits).

ALiBi (``max_bias > 0``): head ``h = i2`` of ``n_head = ne02`` gets the slope ``m0^(h+1)`` if
``h < n_head_log2`` else ``m1^(2(h - n_head_log2) + 1)``, where ``n_head_log2`` is the largest power
of two <= n_head, ``m0 = 2^(-max_bias/n_head_log2)`` and ``m1 = 2^(-max_bias/2/n_head_log2)``
(``ops.soft_max_alibi``, shared by every backend); all float32 with ``powf``, as GGML computes them.
Without ALiBi the slope is 1.

DIAG_MASK_INF: ``y[i1, i0] = -inf`` where ``i0 > n_past + i1``, else ``x``.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit

from ...cache import tie_cache
from ...ops import Op, diag_mask_n_past, powf, soft_max_alibi, soft_max_params
from ...types import Type
from . import common, elementwise, pool, simd, type_common
from .table import forward
from .common import KIND, as_bits, chunk, parallel_kernel, to_f32, unravel_row
from .elementwise import fmaf, v_expf

_kernel = njit(cache=True, error_model="numpy")
_pkernel = parallel_kernel

_NO_MASK = np.zeros((1, 1, 1, 1), np.uint32)
_NEG_INF = -np.float32(np.inf)


@_pkernel
def soft_max(ch, nch, x, mask, mkind, has_mask, slopes, scale, dst):
    n3, n2, n1, n0 = x.shape
    scale32 = np.float32(scale)
    m3, m2 = mask.shape[0], mask.shape[1]
    for r in chunk(n3 * n2 * n1, ch, nch):
        i3, i2, i1 = unravel_row(r, n1, n2)
        xr, yr = x[i3, i2, i1], dst[i3, i2, i1]
        for i in range(n0):
            yr[i] = xr[i] * scale32
        if has_mask:
            mr = mask[i3 % m3, i2 % m2, i1]
            slope = slopes[i2]
            for i in range(n0):
                yr[i] = fmaf(slope, to_f32(mr[i], mkind), yr[i])  # GGML's C, contracted
        vmax = -np.float32(np.inf)
        for i in range(n0):
            vmax = vmax if vmax > yr[i] else yr[i]
        n8 = n0 - n0 % 8
        for i in range(n8):   # apart from the sum, so that LLVM vectorizes it
            yr[i] = v_expf(yr[i] - vmax)
        s = 0.0
        for i in range(0, n8, 8):   # GGML's AVX2 loop: each 8 summed in float32 (hsum's order)
            h0, h1 = yr[i] + yr[i + 4], yr[i + 1] + yr[i + 5]
            h2, h3 = yr[i + 2] + yr[i + 6], yr[i + 3] + yr[i + 7]
            s += np.float64((h0 + h2) + (h1 + h3))
        for i in range(n8, n0):     # ... and the last n0 % 8 with libm's expf
            yr[i] = np.float32(math.exp(yr[i] - vmax))
            s += np.float64(yr[i])
        inv = np.float32(1.0 / s)
        for i in range(n0):
            yr[i] *= inv


@_kernel
def diag_mask(x, n_past, value, dst):
    n3, n2, n1, n0 = x.shape
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = unravel_row(r, n1, n2)
        xr, yr = x[i3, i2, i1], dst[i3, i2, i1]
        for i in range(n0):
            yr[i] = value if i > n_past + i1 else xr[i]


@functools.lru_cache(maxsize=64)
def alibi_slopes(n_head, max_bias):
    """The float32 ALiBi slope of each head, computed as GGML does (1 when ``max_bias`` is 0).
    Cached: treat the array as read-only."""
    if max_bias <= 0:
        return np.ones(n_head, np.float32)
    m0, m1, n_head_log2 = soft_max_alibi(n_head, max_bias)
    return np.array([powf(m0, h + 1) if h < n_head_log2 else powf(m1, 2 * (h - n_head_log2) + 1)
                     for h in range(n_head)], np.float32)


def _soft_max_supported(node):
    mask = node.src[1]
    return (node.type == Type.F32 and node.src[0].type == Type.F32 and node.src[2] is None
            and (mask is None or mask.type in (Type.F32, Type.F16)))


@forward(Op.SOFT_MAX, supports=_soft_max_supported)
def soft_max_forward(node, dst, srcs, params):
    scale, max_bias = soft_max_params(node)
    mask_t = node.src[1]
    if mask_t is None:
        mask, mkind = _NO_MASK, KIND[Type.F32]
    else:
        mask, mkind = as_bits(srcs[1]), KIND[mask_t.type]
    return [params.launch(soft_max, dst.size, srcs[0], mask, mkind, mask_t is not None,
                   alibi_slopes(node.ne[2], max_bias), float(scale), dst)]


def _diag_mask_supported(node):
    return node.type == Type.F32 and node.src[0].type == Type.F32


@forward(Op.DIAG_MASK_INF, supports=_diag_mask_supported)
def diag_mask_inf_forward(node, dst, srcs, params):
    return [(diag_mask, (srcs[0], diag_mask_n_past(node), _NEG_INF, dst))]


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, type_common.__file__, common.__file__, pool.__file__, elementwise.__file__,
               __file__)
