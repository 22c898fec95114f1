"""FLASH_ATTN_EXT on the CPU: fused attention with an online softmax (GGML's
``ggml_compute_forward_flash_attn_ext``, its one-row-at-a-time path).

Shapes, in GGML's order: ``q`` F32 [D, n_q, n_head, ne3]; ``k`` [D, n_kv, n_head_kv, ne3k] and ``v``
[Dv, n_kv, n_head_kv, ne3k], F16 (read through their bits, ``common.to_f32``) or F32, any strides
with packed rows; ``mask`` optional, F16 or F32, [n_kv, >= n_q, m2, m3]; the result F32
[Dv, n_head, n_q, ne3]. The kernel is parallel over the (query, head, ne3) rows; for each one,
with ``ik2 = iq2 // (n_head / n_head_kv)`` and ``ik3 = iq3 // (ne3 / ne3k)`` (GQA's broadcast):

* ``slope`` is ALiBi's slope of head ``iq2`` when ``max_bias > 0`` (``softmax.alibi_slopes``,
  GGML's float32 formula, as SOFT_MAX), else 1;
* for each cell ``ic``: ``mv = slope * mask[iq3 % m3, iq2 % m2, iq1, ic]`` (0 without a mask); a
  cell with ``mv == -inf`` is skipped; ``s = scale' * q·k[ic]``, the dot product summed in
  float32 over four interleaved partial sums (``_dot``, as SIMD lanes would); with a soft cap
  ``s = softcap * tanh(s)``, where ``scale' = scale / softcap`` (divided in float32 when the plan
  is made, as GGML's kernels divide it; ``op_params`` keep the caller's scale), else
  ``scale' = scale``; then ``s += mv``;
* online softmax: a running maximum ``M`` (from -inf) and sum ``S`` (from 0); a new maximum
  rescales the accumulator by ``ms = exp(M_old - M)`` and adds the cell's row of ``v`` with
  weight ``vs = 1``, otherwise the row is added with weight ``vs = exp(s - M)``; ``S = S*ms + vs``;
* the result row is ``acc / S``, and zeros when ``S == 0`` (every cell masked).

The accumulator is the result row itself (a fresh F32 tensor, never a source's memory), so the
kernel needs no scratch. Everything is float32: GGML's CPU kernel rounds ``q`` to F16 for the dot
product and accumulates the weighted ``v`` rows in F16 when K/V are F16 (``VKQ16``); we keep ``q``
and the accumulator in float32 instead, which is closer to the exact result (the F16 op cases allow
GGML's flash-attention NMSE, 5e-4). ``exp`` and ``tanh`` are taken in float32, where GGML calls
``expf`` and ``tanhf``. ``op_params``' precision (``PREC_F32``) changes nothing here.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ...cache import tie_cache
from ...ops import Op, flash_attn_params
from ...types import Type
from . import common, quant, simd
from .table import forward
from .common import KIND, as_bits, launch, parallel_kernel, to_f32, unravel_row
from .softmax import alibi_slopes

_kernel = njit(cache=True, error_model="numpy")
_pkernel = parallel_kernel

_F32 = np.float32
_NO_MASK = np.zeros((1, 1, 1, 1), np.uint32)


@_kernel
def _dot(x, y, ykind, n):
    """``x·y`` in float32 over four interleaved partial sums (independent chains, as SIMD lanes)."""
    s0 = s1 = s2 = s3 = np.float32(0.0)
    n4 = n - n % 4
    for i in range(0, n4, 4):
        s0 += x[i] * to_f32(y[i], ykind)
        s1 += x[i + 1] * to_f32(y[i + 1], ykind)
        s2 += x[i + 2] * to_f32(y[i + 2], ykind)
        s3 += x[i + 3] * to_f32(y[i + 3], ykind)
    for i in range(n4, n):
        s0 += x[i] * to_f32(y[i], ykind)
    return (s0 + s1) + (s2 + s3)


@_pkernel
def flash_attn(q, k, kkind, v, vkind, mask, mkind, has_mask, slopes, scale, softcap, dst):
    nq3, nq2, nq1, d = q.shape          # (ne3, n_head, n_q, D)
    nk3, nk2, n_kv = k.shape[0], k.shape[1], k.shape[2]
    dv = v.shape[3]
    m3, m2 = mask.shape[0], mask.shape[1]
    r2, r3 = nq2 // nk2, nq3 // nk3
    scale32, softcap32 = np.float32(scale), np.float32(softcap)
    neg_inf = -np.float32(np.inf)
    for r in prange(nq3 * nq2 * nq1):
        iq3, iq2, iq1 = unravel_row(r, nq1, nq2)
        ik2, ik3 = iq2 // r2, iq3 // r3
        qr = q[iq3, iq2, iq1]
        out = dst[iq3, iq1, iq2]
        for j in range(dv):
            out[j] = np.float32(0.0)
        slope = slopes[iq2]
        mr = mask[iq3 % m3, iq2 % m2, iq1 if has_mask else 0]
        big = neg_inf                    # the running maximum M
        total = np.float32(0.0)          # the running sum S
        for ic in range(n_kv):
            mv = np.float32(0.0)
            if has_mask:
                mv = slope * to_f32(mr[ic], mkind)
                if mv == neg_inf:
                    continue
            s = _dot(qr, k[ik3, ik2, ic], kkind, d) * scale32
            if softcap32 != 0:
                s = softcap32 * np.float32(math.tanh(s))
            s += mv
            ms = np.float32(1.0)
            vs = np.float32(1.0)
            if s > big:
                ms = np.float32(math.exp(big - s))
                big = s
                for j in range(dv):
                    out[j] *= ms
            else:
                vs = np.float32(math.exp(s - big))
            vr = v[ik3, ik2, ic]
            for j in range(dv):
                out[j] += vs * to_f32(vr[j], vkind)
            total = total * ms + vs
        inv = np.float32(0.0) if total == 0 else np.float32(1.0) / total
        for j in range(dv):
            out[j] *= inv


def _supported(node):
    q, k, v, mask = node.src[0], node.src[1], node.src[2], node.src[3]
    return (node.type == Type.F32 and q.type == Type.F32 and k.type in (Type.F16, Type.F32)
            and v.type in (Type.F16, Type.F32) and (mask is None or mask.type in (Type.F16, Type.F32))
            and node.src[4] is None)   # no attention sinks (ggml_flash_attn_ext_add_sinks)


@forward(Op.FLASH_ATTN_EXT, supports=_supported)
def flash_attn_forward(node, dst, srcs):
    scale, max_bias, softcap, _prec = flash_attn_params(node)
    q_t, k_t, v_t, mask_t = node.src[0], node.src[1], node.src[2], node.src[3]
    if softcap != 0:
        scale = _F32(scale) / _F32(softcap)   # C float division, as GGML's kernels do it
    if mask_t is None:
        mask, mkind = _NO_MASK, KIND[Type.F32]
    else:
        mask, mkind = as_bits(srcs[3]), KIND[mask_t.type]
    work = q_t.ne[1] * q_t.ne[2] * q_t.ne[3] * k_t.ne[1] * (k_t.ne[0] + v_t.ne[0])
    return [launch(flash_attn, work, srcs[0], as_bits(srcs[1]), KIND[k_t.type], as_bits(srcs[2]),
                   KIND[v_t.type], mask, mkind, mask_t is not None, alibi_slopes(node.ne[1], max_bias),
                   float(scale), float(softcap), dst)]


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, quant.__file__, common.__file__, __file__)
