"""ROPE (rotary position embedding) in GGML's two layouts, with YaRN scaling; one thread per pair.

``src0`` is ``[head_dim, n_head, n_tokens, 1]`` (any strides), ``pos`` the I32 position of each
token. Within the first ``n_dims`` values of a head, pair ``p`` is rotated by
``theta = pos · theta_scale^p`` with ``theta_scale = freq_base^(−2/n_dims)``:

* normal mode (``mode = 0``): the pair is ``(x[2p], x[2p+1])`` (interleaved);
* NeoX mode (``mode = 2``): the pair is ``(x[p], x[p + n_dims/2])`` (two halves).

Values past ``n_dims`` are copied. YaRN (GGML's ``rope_yarn``): divide by the optional frequency
factor, ``theta_interp = freq_scale · theta_extrap``; with ``ext_factor != 0`` the two are mixed by
a ramp between the correction dims ``corr0 .. corr1`` and the magnitude gets
``1 + 0.1·ln(1/freq_scale)``; ``attn_factor`` scales the result. ``theta_scale`` and the correction
dims come from the host in float32, as GGML computes them (``ops.rope_theta_scale``,
``ops.rope_yarn_corr_dims``, shared by every backend).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ...ops import ROPE_TYPE_NEOX, rope_theta_scale, rope_yarn_corr_dims
from .common import device, jit_kernel, plane, F32_ONE, F32_ZERO
from .elementwise import BLOCK, grid_rows

F32_001 = np.float32(0.001)
F32_01 = np.float32(0.1)


@device
def _yarn_ramp(low, high, i0):
    y = (np.float32(i0 // 2) - low) / max(F32_001, high - low)
    return F32_ONE - min(F32_ONE, max(F32_ZERO, y))


@device
def _yarn_mscale(freq_scale):
    return F32_ONE + F32_01 * np.float32(math.log(F32_ONE / freq_scale))


@jit_kernel()
def rope(x, pos, ff, has_ff, dst, neox, ne0, ne1, ne2, ne3, n_dims, s1, s2, s3, sd1, sd2, sd3,
         theta_scale, freq_scale, ext_factor, attn_factor, corr0, corr1):
    """One thread per pair of values, walking rows (``elementwise.grid_rows`` over ``ne0 / 2``)."""
    t0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dt = cuda.gridDim.x * cuda.blockDim.x
    half = ne0 // 2
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        pos_f = np.float32(pos[i2])
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            xb = i1 * s1 + i2 * s2 + i3 * s3
            db = i1 * sd1 + i2 * sd2 + i3 * sd3
            ip = t0
            while ip < half:
                i0 = 2 * ip
                if i0 >= n_dims:
                    dst[db + i0] = x[xb + i0]
                    dst[db + i0 + 1] = x[xb + i0 + 1]
                else:
                    a = ip if neox else i0
                    b = ip + n_dims // 2 if neox else i0 + 1
                    theta_extrap = pos_f * np.float32(math.pow(theta_scale, np.float32(ip)))
                    if has_ff:
                        theta_extrap = theta_extrap / ff[ip]
                    theta = freq_scale * theta_extrap
                    mscale = attn_factor
                    if ext_factor != F32_ZERO:
                        mix = _yarn_ramp(corr0, corr1, i0) * ext_factor
                        theta = theta * (F32_ONE - mix) + theta_extrap * mix
                        mscale *= _yarn_mscale(freq_scale)
                    c = np.float32(math.cos(theta)) * mscale
                    s = np.float32(math.sin(theta)) * mscale
                    x0 = x[xb + a]
                    x1 = x[xb + b]
                    dst[db + a] = x0 * c - x1 * s
                    dst[db + b] = x0 * s + x1 * c
                ip += dt
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z


def launch_rope(stream, x, pos, ff, dst, src, dst_t, p):
    """``p``: the node's ``RopeParams``."""
    ne = src.ne
    s = [nb // 4 for nb in src.nb]
    sd = [nb // 4 for nb in dst_t.nb]
    corr0, corr1 = rope_yarn_corr_dims(p.n_dims, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow)
    f32 = np.float32
    rope[grid_rows((ne[0] // 2, *ne[1:])), BLOCK, stream](
        x, pos, x if ff is None else ff, ff is not None, dst, p.mode == ROPE_TYPE_NEOX, *ne, p.n_dims, s[1], s[2], s[3], sd[1], sd[2], sd[3], rope_theta_scale(p.freq_base, p.n_dims),
        f32(p.freq_scale), f32(p.ext_factor), f32(p.attn_factor), corr0, corr1)
