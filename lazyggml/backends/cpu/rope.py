"""ROPE on the CPU: rotary position embedding with YaRN scaling, normal and NeoX modes
(GGML's ``ggml_compute_forward_rope_flt``, ``rope_yarn``, ``ggml_rope_yarn_corr_dims``).

``a`` is [ne0 = head_dim, ne1 = n_head, ne2 = n_tokens, ne3]; ``b`` holds one I32 position per
``i2``; ``c`` optional F32 frequency factors (one per rotated pair). For a token at position ``p``
the pair ``k = i0/2`` (``i0 = 0, 2, .., n_dims-2``) is rotated by an angle built, all in float32 as
GGML does, from ``theta_extrap = p * theta_scale^k / ff[k]`` (``theta_scale = freq_base^(-2/n_dims)``,
the power taken by repeated multiplication, like GGML's cache loop):

* ``theta_interp = freq_scale * theta_extrap``; without YaRN (``ext_factor == 0``) ``theta =
  theta_interp`` and the magnitude is ``mscale = attn_factor``;
* with YaRN, ``ramp = 1 - clamp((k - low) / max(0.001, high - low), 0, 1)`` (``rope_yarn_ramp``,
  ``low``/``high`` the correction dims from ``n_ctx_orig``, ``beta_fast``, ``beta_slow``),
  ``mix = ramp * ext_factor``, ``theta = theta_interp (1 - mix) + theta_extrap mix`` and
  ``mscale = attn_factor * (1 + 0.1 ln(1/freq_scale))``.

The pair is ``(x[i0], x[i0+1])`` in normal mode and ``(x[k], x[k + n_dims/2])`` in NeoX mode;
``y0 = x0 cos - x1 sin``, ``y1 = x0 sin + x1 cos`` with ``cos``/``sin`` scaled by ``mscale``.
Dims from ``n_dims`` to ``ne0`` are copied unchanged.

The float32 arithmetic is GGML's compiled C to the bit: ``theta_scale`` and the correction dims
come from the host (``ops.rope_theta_scale``, ``ops.rope_yarn_corr_dims``, shared by every
backend), and the fused multiply-adds that GCC contracts in the kernel (the YaRN mix, its
magnitude, the rotation) are explicit ``fmaf``; checked against libggml through ggml-python,
positions up to 3000.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit

from ...cache import tie_cache
from ...ops import (ROPE_TYPE_NEOX, ROPE_TYPE_NORMAL, Op, rope_params, rope_theta_scale,
                    rope_yarn_corr_dims)
from ...types import Type
from . import common, pool, simd
from .params import address
from .table import forward
from .common import chunk, parallel_kernel, unravel_row
from .simd import fma as fmaf  # fused where the target has FMA, as GCC contracts GGML's C

_kernel = njit(cache=True, error_model="numpy")
_pkernel = parallel_kernel

_F32 = np.float32
_NO_FF = np.ones(1, np.float32)


@_kernel
def _yarn_ramp(low, high, i0):
    y = (np.float32(i0 // 2) - low) / max(np.float32(0.001), high - low)
    return np.float32(1.0) - min(np.float32(1.0), max(np.float32(0.0), y))


@_kernel
def rope_cache(pos, ff, has_ff, n_dims, consts, cache):
    """Fill ``cache`` (n_pos, n_dims/2, 2) with the cos/sin (scaled) of every rotated pair for
    every position. ``consts``: ``rope_constants``, used as float32."""
    theta_scale, corr0, corr1 = np.float32(consts[0]), np.float32(consts[1]), np.float32(consts[2])
    freq_scale, ext_factor = np.float32(consts[3]), np.float32(consts[4])
    attn_factor = np.float32(consts[5])
    half = n_dims // 2
    for ip in range(pos.shape[0]):
        theta_base = np.float32(pos[ip])
        for k in range(half):
            f = ff[k] if has_ff else np.float32(1.0)
            theta_extrap = theta_base / f
            theta_interp = freq_scale * theta_extrap
            theta = theta_interp
            mscale = attn_factor
            if ext_factor != 0:
                mix = _yarn_ramp(corr0, corr1, 2 * k) * ext_factor
                theta = fmaf(theta_interp, np.float32(1.0) - mix, theta_extrap * mix)
                mscale *= fmaf(np.float32(0.1), math.log(np.float32(1.0) / freq_scale), np.float32(1.0))
            cache[ip, k, 0] = math.cos(theta) * mscale
            cache[ip, k, 1] = math.sin(theta) * mscale
            theta_base *= theta_scale


@_pkernel
def rope(ch, nch, x, cache, n_dims, neox, dst):
    n3, n2, n1, n0 = x.shape
    half = n_dims // 2
    for r in chunk(n3 * n2 * n1, ch, nch):
        i3, i2, i1 = unravel_row(r, n1, n2)
        xr, yr = x[i3, i2, i1], dst[i3, i2, i1]
        c = cache[i2]
        # the pass-through dims first: the rotation may overwrite its own input (in place)
        for i in range(n_dims, n0):
            yr[i] = xr[i]
        for k in range(half):
            j0, j1 = (k, k + half) if neox else (2 * k, 2 * k + 1)
            x0, x1 = xr[j0], xr[j1]
            cos_t, sin_t = c[k, 0], c[k, 1]
            yr[j0] = fmaf(x0, cos_t, -(x1 * sin_t))
            yr[j1] = fmaf(x0, sin_t, x1 * cos_t)


def _supports(node):
    a, pos, ff = node.src[0], node.src[1], node.src[2]
    return (node.type == Type.F32 and a.type == Type.F32 and pos.type == Type.I32
            and (ff is None or ff.type == Type.F32)
            and rope_params(node).mode in (ROPE_TYPE_NORMAL, ROPE_TYPE_NEOX))


@functools.lru_cache(maxsize=256)
def rope_constants(p):
    """``rope_cache``'s (theta_scale, corr_dims[0], corr_dims[1], freq_scale, ext_factor, attn_factor)
    for the ``RopeParams`` ``p``: float32 values (as Python floats), computed once per parameter set."""
    corr0, corr1 = rope_yarn_corr_dims(p.n_dims, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow)
    theta_scale = rope_theta_scale(p.freq_base, p.n_dims)
    consts = (theta_scale, corr0, corr1, p.freq_scale, p.ext_factor, p.attn_factor)
    return tuple(float(_F32(v)) for v in consts)


@forward(Op.ROPE, supports=_supports)
def rope_forward(node, dst, srcs, params):
    p = rope_params(node)
    pos, has_ff = srcs[1].reshape(-1), srcs[2] is not None
    ff = srcs[2].reshape(-1) if has_ff else _NO_FF
    consts = rope_constants(p)
    # the ropes of a plan with the same positions, factors and parameters (Q and K, in every
    # layer) share one cos/sin cache, made by the first (GGML remakes it in each)
    key = ("rope", address(pos), pos.shape, address(ff), has_ff, p.n_dims, consts)
    cache = params.scope.get(key, key)
    steps = []
    if cache is None:
        cache = np.empty((pos.shape[0], p.n_dims // 2, 2), np.float32)   # the plan's own scratch
        steps.append((rope_cache, (pos, ff, has_ff, p.n_dims, consts, cache)))
        params.scope.put(key, key, (pos, ff), cache)
    return steps + [params.launch(rope, dst.size, srcs[0], cache, p.n_dims, p.mode == ROPE_TYPE_NEOX, dst)]


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, common.__file__, pool.__file__, __file__)
