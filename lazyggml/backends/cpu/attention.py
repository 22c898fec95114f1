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
  float32: with F16 K and D a multiple of 8 as 8-lane FMAs (two chains, added, ``hsum_f32x8``),
  else over four interleaved partial sums (``_dot``); with a soft cap ``s = softcap * tanh(s)``,
  where ``scale' = scale / softcap`` (divided in float32 when the plan is made, as GGML's kernels
  divide it; ``op_params`` keep the caller's scale), else ``scale' = scale``; then ``s += mv``;
* online softmax over blocks of ``_BLOCK`` (8) cells that are not skipped, in order: a running
  maximum ``M`` (from -inf) and sum ``S`` (from 0); when the block's largest ``s`` exceeds ``M``,
  it becomes ``M`` and the accumulator and ``S`` are rescaled by ``ms = exp(M_old - M)``; then
  each cell of the block adds its row of ``v`` with weight ``w = exp(s - M)`` to the accumulator
  (with F16 V and Dv a multiple of 8 as 8-lane FMAs, one pass over the accumulator per block) and
  ``w`` to ``S``;
* the result row is ``acc / S``, and zeros when ``S == 0`` (every cell masked).

The accumulator is the result row itself (a fresh F32 tensor, never a source's memory); the only
scratch is a block's scores and V offsets. K and V are read through 1-D views of their bits at
element offsets (``_flat``). Everything is float32: GGML's CPU kernel rounds ``q`` to F16 for the dot
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
from .common import KIND, KIND_F16, as_bits, launch, parallel_kernel, to_f32, unravel_row
from .simd import (f16x8_to_f32, fma, hsum_f32x8, load_f32x8, load_i16x8, splat_f32x8, store_f32x8,
                   vadd, vmul)
from .softmax import alibi_slopes

_kernel = njit(cache=True, error_model="numpy")
_pkernel = parallel_kernel

_F32 = np.float32
_NO_MASK = np.zeros((1, 1, 1, 1), np.uint32)
_BLOCK = 8     # cells per softmax step: one rescale, and one pass over the output row, per block


@_kernel
def _dot(x, y, yo, ykind, n):
    """``x·y[yo:yo+n]`` in float32 over four interleaved partial sums (independent chains, as SIMD
    lanes)."""
    s0 = s1 = s2 = s3 = np.float32(0.0)
    n4 = n - n % 4
    for i in range(0, n4, 4):
        s0 += x[i] * to_f32(y[yo + i], ykind)
        s1 += x[i + 1] * to_f32(y[yo + i + 1], ykind)
        s2 += x[i + 2] * to_f32(y[yo + i + 2], ykind)
        s3 += x[i + 3] * to_f32(y[yo + i + 3], ykind)
    for i in range(n4, n):
        s0 += x[i] * to_f32(y[yo + i], ykind)
    return (s0 + s1) + (s2 + s3)


@_pkernel
def flash_attn(q, k, kshape, kst, kkind, v, vst, vkind, mask, mkind, has_mask, slopes, scale, softcap, dst):
    nq3, nq2, nq1, d = q.shape          # (ne3, n_head, n_q, D)
    nk3, nk2, n_kv = kshape
    dv = dst.shape[3]
    m3, m2 = mask.shape[0], mask.shape[1]
    r2, r3 = nq2 // nk2, nq3 // nk3
    scale32, softcap32 = np.float32(scale), np.float32(softcap)
    neg_inf = -np.float32(np.inf)
    # F16 rows of whole 8-lane vectors take the SIMD loops, written out here rather than in helpers:
    # an inlined helper's array arguments cost an atomic reference count per call (per cell)
    kvec = kkind == KIND_F16 and d % 8 == 0
    vvec = vkind == KIND_F16 and dv % 8 == 0
    d16 = d - d % 16
    for r in prange(nq3 * nq2 * nq1):
        iq3, iq2, iq1 = unravel_row(r, nq1, nq2)
        ik2, ik3 = iq2 // r2, iq3 // r3
        ko, vo = ik3 * kst[0] + ik2 * kst[1], ik3 * vst[0] + ik2 * vst[1]
        qr = q[iq3, iq2, iq1]
        out = dst[iq3, iq1, iq2]
        for j in range(dv):
            out[j] = np.float32(0.0)
        slope = slopes[iq2]
        mr = mask[iq3 % m3, iq2 % m2, iq1 if has_mask else 0]
        sc = np.empty(_BLOCK, np.float32)   # a block's scores, then their weights
        rows = np.empty(_BLOCK, np.int64)   # and the offsets of their V rows
        big = neg_inf                    # the running maximum M
        total = np.float32(0.0)          # the running sum S
        ic = 0
        while ic < n_kv:
            # gather the scores of the next _BLOCK cells that are not masked (independent dot products)
            nb = 0
            while nb < _BLOCK and ic < n_kv:
                cell = ic
                ic += 1
                mv = np.float32(0.0)
                if has_mask:
                    mv = slope * to_f32(mr[cell], mkind)
                    if mv == neg_inf:
                        continue
                kr = ko + cell * kst[2]
                if kvec:    # two chains of 8-lane FMAs, so that one FMA's latency does not stall the next
                    a = splat_f32x8(0.0)
                    b = splat_f32x8(0.0)
                    for i in range(0, d16, 16):
                        a = fma(load_f32x8(qr, 4 * i), f16x8_to_f32(load_i16x8(k, 2 * (kr + i))), a)
                        b = fma(load_f32x8(qr, 4 * i + 32), f16x8_to_f32(load_i16x8(k, 2 * (kr + i) + 16)), b)
                    if d16 < d:
                        a = fma(load_f32x8(qr, 4 * d16), f16x8_to_f32(load_i16x8(k, 2 * (kr + d16))), a)
                    s = hsum_f32x8(vadd(a, b)) * scale32
                else:
                    s = _dot(qr, k, kr, kkind, d) * scale32
                if softcap32 != 0:
                    s = softcap32 * np.float32(math.tanh(s))
                sc[nb] = s + mv
                rows[nb] = vo + cell * vst[2]
                nb += 1
            if nb == 0:
                break
            top = sc[0]
            for i in range(1, nb):
                top = max(top, sc[i])
            if top > big:   # a new maximum: out and S are rescaled by ms = exp(M_old - M)
                ms = np.float32(math.exp(big - top))
                big = top
                total *= ms
                if vvec:
                    msv = splat_f32x8(ms)
                    for j in range(0, dv, 8):
                        store_f32x8(out, 4 * j, vmul(load_f32x8(out, 4 * j), msv))
                else:
                    for j in range(dv):
                        out[j] *= ms
            for i in range(nb):
                sc[i] = np.float32(math.exp(sc[i] - big))
                total += sc[i]
            # out += sum of weight * V row over the block: each 8-lane chunk of out loaded and stored once
            if vvec:
                for j in range(0, dv, 8):
                    acc = load_f32x8(out, 4 * j)
                    for i in range(nb):
                        acc = fma(splat_f32x8(sc[i]), f16x8_to_f32(load_i16x8(v, 2 * (rows[i] + j))), acc)
                    store_f32x8(out, 4 * j, acc)
            else:
                for i in range(nb):
                    for j in range(dv):
                        out[j] += sc[i] * to_f32(v[rows[i] + j], vkind)
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
    k, kst = _flat(srcs[1])
    v, vst = _flat(srcs[2])
    work = q_t.ne[1] * q_t.ne[2] * q_t.ne[3] * k_t.ne[1] * (k_t.ne[0] + v_t.ne[0])
    return [launch(flash_attn, work, srcs[0], k, srcs[1].shape[:3], kst, KIND[k_t.type], v, vst,
                   KIND[v_t.type], mask, mkind, mask_t is not None, alibi_slopes(node.ne[1], max_bias),
                   float(scale), float(softcap), dst)]


def _flat(a):
    """The bits of ``a`` (4-D, packed rows) as a 1-D array from its first element to its last, and
    its strides (dims 3, 2, 1) in elements: the kernel then reads a cell's row at an offset instead
    of slicing a view per cell, whose reference count (an atomic, shared by the threads) costs more
    than the row's arithmetic."""
    b = as_bits(a)
    size = b.itemsize
    span = 1 + sum((n - 1) * s for n, s in zip(b.shape, b.strides)) // size if b.size else 0
    return (np.lib.stride_tricks.as_strided(b, (span,), (size,)),
            tuple(s // size for s in b.strides[:3]))


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, quant.__file__, common.__file__, __file__)
