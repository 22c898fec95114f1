"""FLASH_ATTN_EXT on the CPU: fused attention with an online softmax, with the arithmetic of GGML's
CPU kernel (``ggml_compute_forward_flash_attn_ext_f16``), so that a model run with flash attention
gives llama.cpp's numbers.

Shapes, in GGML's order: ``q`` F32 [D, n_q, n_head, ne3]; ``k`` [D, n_kv, n_head_kv, ne3k] and ``v``
[Dv, n_kv, n_head_kv, ne3k], F16 (read through their bits) or F32, any strides with packed rows;
``mask`` optional, F16 (GGML's contract), [n_kv, >= n_q, m2, m3]; the result F32 [Dv, n_head, n_q, ne3]. Query
row (iq1, iq2, iq3) attends to head ``ik2 = iq2 // (n_head / n_head_kv)`` of batch ``ik3 = iq3 //
(ne3 / ne3k)`` (GQA's broadcast). Per cell ``ic``: ``mv = slope * mask[iq3 % m3, iq2 % m2, iq1, ic]``
(0 without a mask; ``slope`` is ALiBi's, ``softmax.alibi_slopes``, 1 without ALiBi); a cell with
``mv == -inf`` is left out; ``s = scale' * q·k[ic]``, with a soft cap ``s = softcap * tanh(s)`` where
``scale' = scale / softcap`` (a float32 division, as GGML's kernels do; ``op_params`` keep the
caller's scale); then ``s += mv``. The result row is ``sum_ic exp(s_ic - M) v[ic] / S``, zeros when
every cell is masked (``S == 0``).

GGML has three paths, and so do we, chosen from the shapes as GGML chooses:

* **tiled** (``n_q >= 64``, K and V both F16 or both F32: a prompt): float32 throughout. Cells go
  in windows of 64 (``GGML_FA_TILE_KV``), queries in tiles of up to 64 rows of one head sharing a
  window of K converted and transposed once (``_tile``). A score is a float32 FMA chain over D (its
  ``simd_gemm``), then ``* scale'``, the soft cap, ``+ mv``; per window and row, the largest score
  ``top`` (window skipped if -inf); a new maximum rescales the row's sums by ``expf(M - M_new)``;
  the weights are ``ggml_v_expf(s - M)`` (``elementwise.v_expf``) summed as
  ``ggml_vec_soft_max_f32`` (8-lane groups, each ``hsum``'ed, added in double) into the float32
  ``S``, and the V rows are added with FMAs in cell order.
* **row by row** (everything else, decode above all: GGML's ``_one_chunk``): q is rounded to K's
  ``vec_dot_type`` (F16 for F16 K), the dot product is ``ggml_vec_dot_f16`` / ``_f32`` (four
  FMA chains, reduced pairwise, then across lanes; the last products added in double), and each cell updates the row at once: a new maximum scales the accumulator by
  ``ms = expf(M_old - s)``, otherwise the cell's weight is ``vs = expf(s - M)``; ``acc = acc*ms``
  then ``acc += v*vs`` and ``S = S*ms + vs``. With F16 V the accumulator is GGML's ``VKQ16``: F16,
  so rounded to F16 after every step (``simd.round_f16x8``).
  Its (query row, chunk of cells) items run as a job on the CPU backend's pool (``pool.py``):
  a decode step's attention is a few heads of a few µs each, too little for an OpenMP region.
* **split cells** (one query, ``ne3 == 1``, K and V both F16 or both F32, ``n_kv >= 512``):
  the cells are cut into ``n_threads`` chunks of ``ceil(n_kv / n_threads)``; each (head, chunk) runs
  row by row into a partial (M, S, acc), and ``_reduce_chunks`` combines them in chunk order in
  float32 (``acc = acc*exp(M - M') + acc_c*exp(M_c - M')``). GGML's thread count is part of its
  result here: ours is the plan's.

A GGML built for the machine sums float lanes 8 wide with AVX2 and 16 wide with AVX-512; the row-by-row
dot product follows the width of the target (``simd.HAVE_AVX512``, or 8 with ``LAZYGGML_GGML_AVX512=0``,
for a GGML built for AVX2 on an AVX-512 CPU), so the row-by-row path gives the
bits of such a build (measured: identical to llama.cpp 0.3.36's logits on the embedded model with
GGML's reference matmuls). The tiled path follows GGML's AVX2 code (its soft_max sums and
``ggml_v_expf``): against an AVX-512 build, last bits differ. Where GGML calls ``expf`` and
``tanhf``, so do we; ``op_params``' precision (``PREC_F32``) changes nothing on the CPU, as in GGML.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ...cache import tie_cache
from ...ops import Op, flash_attn_params
from ...types import Type
from . import common, elementwise, pool, simd, type_common
from .table import forward
from .common import (KIND, KIND_F16, KIND_F32, as_bits, chunk, parallel_kernel, to_f32, from_f32,
                     unravel_row)
from .elementwise import v_expf
from .simd import (HAVE_AVX512, f16x8_to_f32, fma, hadd_f32x8_cols, hsum_f32x8, lane, load_f32x8, load_i16x8, round_f16x8, splat_f32x8,
                   store_f32x8, vadd, vmax, vmul)
from .softmax import alibi_slopes

_kernel = njit(cache=True, error_model="numpy")
# a cell's dot product, inlined into its loop: called, its ~15 arguments went through the stack
# and its result through memory, which took as long as the products themselves
_inline = njit(cache=True, error_model="numpy", inline="always")

_F32 = np.float32
_NEG_INF = -np.float32(np.inf)
_NO_MASK = np.zeros((1, 1, 1, 1), np.uint32)
_NO_PARTS = np.zeros((1, 1, 1), np.float32)
_BLOCK = 8            # cells whose dot products the row-by-row path takes together
_TILE = 64            # GGML_FA_TILE_Q = GGML_FA_TILE_KV: batches of >= 64 queries take the tiled path
#: every query in the one-query order (cell by cell, VKQ16), whatever its batch: no tiles of queries
#: for prompts, no KV window split over threads for one query (``cpu.set_column_order``)
ONE_QUERY_ORDER = False
_SPLIT_MIN_KV = 512   # one query over at least this many cells: the cells are split between threads
ROW_CHUNKS_PER_THREAD = 2   # the row-by-row path's chunks on the pool, per thread


@_kernel
def _stored(x, kind):
    """``x`` as an element of the given kind holds it (F16: rounded to nearest even)."""
    return to_f32(from_f32(x, kind), kind) if kind == KIND_F16 else x


@_kernel
def _load8(a, i, kind):
    """Elements i..i+8 of the F16 or F32 bits ``a``, as float32 lanes."""
    if kind == KIND_F16:
        return f16x8_to_f32(load_i16x8(a, 2 * i))
    return load_f32x8(a, 4 * i)


@_kernel
def _to_f32_row(a, i, kind, out, o, n):
    """out[o:o + n] = elements i..i+n of the F16 or F32 bits ``a``, as float32."""
    j = 0
    while j + 8 <= n:
        store_f32x8(out, 4 * (o + j), _load8(a, i + j, kind))
        j += 8
    for j in range(j, n):
        out[o + j] = to_f32(a[i + j], kind)


@_kernel
def _score8(a, sc, mr, c, mkind, has_mask, slope):
    """Eight cells' scores from their dot products ``a``: ``a * scale``, plus ``slope * mask``
    where there is a mask (a multiply, then an add: the scalar path's roundings)."""
    s = vmul(a, sc)
    if has_mask:
        s = vadd(s, vmul(splat_f32x8(slope), _load8(mr, c, mkind)))
    return s


@_kernel
def _store8x8(a, v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight 8-lane vectors into a[0:64]."""
    store_f32x8(a, 0, v0)
    store_f32x8(a, 32, v1)
    store_f32x8(a, 64, v2)
    store_f32x8(a, 96, v3)
    store_f32x8(a, 128, v4)
    store_f32x8(a, 160, v5)
    store_f32x8(a, 192, v6)
    store_f32x8(a, 224, v7)


@_kernel
def _r16(x, round16):
    return round_f16x8(x) if round16 else x


@_kernel
def _accumulate(acc, v, vkind, rows, fac, wts, nb, round16):
    """For i < nb, in order: ``acc = acc * fac[i]`` (skipped when 1), then ``acc += wts[i] * v[rows[i]:]``
    (skipped when the weight is 0: it adds exactly nothing), each result rounded to F16 when
    ``round16`` (GGML's ``VKQ16``: ``ggml_vec_scale_f16``, ``ggml_vec_mad_f16``). Eight 8-lane chunks
    of ``acc`` at a time stay in registers over all the cells: independent FMA chains."""
    dv = acc.shape[0]
    j = 0
    while j + 64 <= dv:
        a0, a1 = load_f32x8(acc, 4 * j), load_f32x8(acc, 4 * j + 32)
        a2, a3 = load_f32x8(acc, 4 * j + 64), load_f32x8(acc, 4 * j + 96)
        a4, a5 = load_f32x8(acc, 4 * j + 128), load_f32x8(acc, 4 * j + 160)
        a6, a7 = load_f32x8(acc, 4 * j + 192), load_f32x8(acc, 4 * j + 224)
        for i in range(nb):
            if fac[i] != 1:
                f = splat_f32x8(fac[i])
                a0, a1, a2, a3 = _r16(vmul(a0, f), round16), _r16(vmul(a1, f), round16), \
                    _r16(vmul(a2, f), round16), _r16(vmul(a3, f), round16)
                a4, a5, a6, a7 = _r16(vmul(a4, f), round16), _r16(vmul(a5, f), round16), \
                    _r16(vmul(a6, f), round16), _r16(vmul(a7, f), round16)
            if wts[i] != 0:
                w = splat_f32x8(wts[i])
                r = rows[i] + j
                a0 = _r16(fma(_load8(v, r, vkind), w, a0), round16)
                a1 = _r16(fma(_load8(v, r + 8, vkind), w, a1), round16)
                a2 = _r16(fma(_load8(v, r + 16, vkind), w, a2), round16)
                a3 = _r16(fma(_load8(v, r + 24, vkind), w, a3), round16)
                a4 = _r16(fma(_load8(v, r + 32, vkind), w, a4), round16)
                a5 = _r16(fma(_load8(v, r + 40, vkind), w, a5), round16)
                a6 = _r16(fma(_load8(v, r + 48, vkind), w, a6), round16)
                a7 = _r16(fma(_load8(v, r + 56, vkind), w, a7), round16)
        store_f32x8(acc, 4 * j, a0)
        store_f32x8(acc, 4 * j + 32, a1)
        store_f32x8(acc, 4 * j + 64, a2)
        store_f32x8(acc, 4 * j + 96, a3)
        store_f32x8(acc, 4 * j + 128, a4)
        store_f32x8(acc, 4 * j + 160, a5)
        store_f32x8(acc, 4 * j + 192, a6)
        store_f32x8(acc, 4 * j + 224, a7)
        j += 64
    while j + 8 <= dv:
        a = load_f32x8(acc, 4 * j)
        for i in range(nb):
            if fac[i] != 1:
                a = _r16(vmul(a, splat_f32x8(fac[i])), round16)
            if wts[i] != 0:
                a = _r16(fma(_load8(v, rows[i] + j, vkind), splat_f32x8(wts[i]), a), round16)
        store_f32x8(acc, 4 * j, a)
        j += 8
    for jj in range(j, dv):
        kind = KIND_F16 if round16 else KIND_F32
        for i in range(nb):
            if fac[i] != 1:
                acc[jj] = _stored(acc[jj] * fac[i], kind)
            if wts[i] != 0:
                acc[jj] = _stored(fma(to_f32(v[rows[i] + jj], vkind), wts[i], acc[jj]), kind)


@_inline
def _dot_vec8(qh, k, kr, kkind, n):
    """The first ``n`` (a multiple of 32) products of ``ggml_vec_dot_f16`` / ``_f32`` as built for
    AVX2, before the final reduction: four 8-lane FMA chains over 32-element steps, added pairwise."""
    a0 = a1 = a2 = a3 = splat_f32x8(0.0)
    for i in range(0, n, 32):
        a0 = fma(load_f32x8(qh, 4 * i), _load8(k, kr + i, kkind), a0)
        a1 = fma(load_f32x8(qh, 4 * i + 32), _load8(k, kr + i + 8, kkind), a1)
        a2 = fma(load_f32x8(qh, 4 * i + 64), _load8(k, kr + i + 16, kkind), a2)
        a3 = fma(load_f32x8(qh, 4 * i + 96), _load8(k, kr + i + 24, kkind), a3)
    return vadd(vadd(a0, a2), vadd(a1, a3))


@_inline
def _dot_lanes8(qh, k, kr, kkind, n):
    """``_dot_vec8`` reduced as GGML_F32x8_REDUCE does (hadd'ed), in double."""
    t = _dot_vec8(qh, k, kr, kkind, n)
    return np.float64(((lane(t, 0) + lane(t, 4)) + (lane(t, 1) + lane(t, 5)))
                      + ((lane(t, 2) + lane(t, 6)) + (lane(t, 3) + lane(t, 7))))


@_inline
def _dot_lanes16(qh, k, kr, kkind, n):
    """The same as built for AVX-512 (16-lane vectors, each as two 8-lane halves here): four chains
    over 64-element steps, added pairwise, then ``_mm512_reduce_add_ps`` (GCC's: the 256-bit halves
    added, then the 128-bit ones, then lanes 0+2 and 1+3, then those two)."""
    l0 = h0 = l1 = h1 = l2 = h2 = l3 = h3 = splat_f32x8(0.0)
    for i in range(0, n, 64):
        l0 = fma(load_f32x8(qh, 4 * i), _load8(k, kr + i, kkind), l0)
        h0 = fma(load_f32x8(qh, 4 * i + 32), _load8(k, kr + i + 8, kkind), h0)
        l1 = fma(load_f32x8(qh, 4 * i + 64), _load8(k, kr + i + 16, kkind), l1)
        h1 = fma(load_f32x8(qh, 4 * i + 96), _load8(k, kr + i + 24, kkind), h1)
        l2 = fma(load_f32x8(qh, 4 * i + 128), _load8(k, kr + i + 32, kkind), l2)
        h2 = fma(load_f32x8(qh, 4 * i + 160), _load8(k, kr + i + 40, kkind), h2)
        l3 = fma(load_f32x8(qh, 4 * i + 192), _load8(k, kr + i + 48, kkind), l3)
        h3 = fma(load_f32x8(qh, 4 * i + 224), _load8(k, kr + i + 56, kkind), h3)
    t = vadd(vadd(vadd(h0, h2), vadd(h1, h3)), vadd(vadd(l0, l2), vadd(l1, l3)))   # high half + low half
    u0, u1 = lane(t, 4) + lane(t, 0), lane(t, 5) + lane(t, 1)
    u2, u3 = lane(t, 6) + lane(t, 2), lane(t, 7) + lane(t, 3)
    return np.float64((u0 + u2) + (u1 + u3))


@_kernel
def _row_vec(qh, k, kr0, kst1, kkind, d, v, vr0, vst1, vkind, mr, mkind, has_mask, slope, scale32,
             softcap32, c0, c1, acc):
    """The row-by-row path for one query row (``qh``: q in K's vec_dot_type) over cells c0..c1: adds
    the weighted V rows into ``acc`` (zeroed by the caller) and returns (M, S), not yet divided.
    Cells go by blocks of ``_BLOCK`` that are not masked: their dot products first (independent;
    a full block's final reductions done together), then the online softmax cell by cell, then their V rows, cell by cell (``_accumulate``): the
    same operations in the same order as GGML's cell-at-a-time loop."""
    dstep = d - d % (64 if HAVE_AVX512 else 32)   # what the dot product's vector steps cover
    big, total = _NEG_INF, np.float32(0.0)
    wts = np.empty(_BLOCK, np.float32)    # a block's scores, then their weights vs
    fac = np.empty(_BLOCK, np.float32)    # and the factor ms each applies first
    rows = np.empty(_BLOCK, np.int64)     # and the offsets of their V rows
    kro = np.empty(_BLOCK, np.int64)      # and of their K rows
    mvs = np.empty(_BLOCK, np.float32)    # and their slope * mask
    cell = c0
    while cell < c1:
        nb = 0
        while nb < _BLOCK and cell < c1:
            ic = cell
            cell += 1
            mv = np.float32(0.0)
            if has_mask:
                mv = slope * to_f32(mr[ic], mkind)
                if mv == _NEG_INF:
                    continue
            kro[nb], rows[nb], mvs[nb] = kr0 + ic * kst1, vr0 + ic * vst1, mv
            nb += 1
        if nb == _BLOCK and dstep == d and not HAVE_AVX512:
            # a full block's eight sums in one transposed reduction: the same additions, so the same
            # bits, where a cell's own reduction was a chain of ~8 dependent instructions
            store_f32x8(wts, 0, hadd_f32x8_cols(
                _dot_vec8(qh, k, kro[0], kkind, d), _dot_vec8(qh, k, kro[1], kkind, d),
                _dot_vec8(qh, k, kro[2], kkind, d), _dot_vec8(qh, k, kro[3], kkind, d),
                _dot_vec8(qh, k, kro[4], kkind, d), _dot_vec8(qh, k, kro[5], kkind, d),
                _dot_vec8(qh, k, kro[6], kkind, d), _dot_vec8(qh, k, kro[7], kkind, d)))
        else:
            for i in range(nb):
                if HAVE_AVX512:
                    sd = _dot_lanes16(qh, k, kro[i], kkind, dstep)
                else:
                    sd = _dot_lanes8(qh, k, kro[i], kkind, dstep)
                for j in range(dstep, d):   # the last products in double
                    sd += np.float64(qh[j] * to_f32(k[kro[i] + j], kkind))
                wts[i] = np.float32(sd)
        for i in range(nb):
            s = wts[i] * scale32
            if softcap32 != 0:
                s = softcap32 * np.float32(math.tanh(s))
            wts[i] = s + mvs[i]
        for i in range(nb):
            s = wts[i]
            if s > big:   # a new maximum: what is summed so far is scaled by ms = exp(M_old - s)
                fac[i] = np.float32(math.exp(big - s))
                wts[i] = np.float32(1.0)
                big = s
            else:
                fac[i] = np.float32(1.0)
                wts[i] = np.float32(math.exp(s - big))
            total = fma(total, fac[i], wts[i])
        _accumulate(acc, v, vkind, rows, fac, wts, nb, vkind == KIND_F16)
    return big, total


@_kernel
def _tile(q, iq3, iq2, i0, i1, k, kr0, kst1, kkind, v, vr0, vst1, vkind, mask, mkind, has_mask, slope,
          scale32, softcap32, n_kv, dst):
    """The tiled path for query rows i0..i1 of head iq2: writes their result rows."""
    d, dv = q.shape[3], dst.shape[3]
    nr = i1 - i0
    mk = mask[iq3 % mask.shape[0], iq2 % mask.shape[1]]
    kt = np.empty(d * _TILE, np.float32)   # a window of K, transposed: kt[dk * _TILE + c]
    vt = np.empty(_TILE * dv, np.float32)  # the window's V rows in float32: vt[c * dv + j]
    vbits = vt.view(np.uint32)             # ... as F32 element bits, for _accumulate
    kq = np.empty(_TILE, np.float32)       # one row's scores in the window, then its weights
    wts = np.empty(_TILE, np.float32)      # the weights of the cells that are not masked
    fac = np.ones(_TILE, np.float32)       # fac[0]: the window's rescale of the row, if any
    rows = np.empty(_TILE, np.int64)       # the offsets of their V rows
    big = np.full(nr, _NEG_INF, np.float32)
    total = np.zeros(nr, np.float32)
    for r in range(nr):
        dst[iq3, i0 + r, iq2, :] = 0.0
    for t0 in range(0, n_kv, _TILE):
        nc = min(_TILE, n_kv - t0)
        if has_mask:   # skip a window masked for every row of the tile
            live = False
            for r in range(nr):
                for c in range(nc):
                    if slope * to_f32(mk[i0 + r, t0 + c], mkind) != _NEG_INF:
                        live = True
                        break
                if live:
                    break
            if not live:
                continue
        for c in range(nc):
            kr = kr0 + (t0 + c) * kst1
            for dk in range(d):
                kt[dk * _TILE + c] = to_f32(k[kr + dk], kkind)
        for c in range(nc, _TILE):   # the last window's missing cells: zeros, as GGML pads
            for dk in range(d):
                kt[dk * _TILE + c] = np.float32(0.0)
        # V converted once per window, not once per row and cell (F16 -> F32 is exact: the same
        # sums; the conversions had cost as much as the window's scores)
        for c in range(nc):
            _to_f32_row(v, vr0 + (t0 + c) * vst1, vkind, vt, c * dv, dv)
        for r in range(nr):
            qr = q[iq3, iq2, i0 + r]
            # the scores: a cell a lane, a float32 FMA chain over D each (GGML's simd_gemm), 64 at once
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = splat_f32x8(0.0)
            for dk in range(d):
                x, o = splat_f32x8(qr[dk]), 4 * dk * _TILE
                a0, a1 = fma(load_f32x8(kt, o), x, a0), fma(load_f32x8(kt, o + 32), x, a1)
                a2, a3 = fma(load_f32x8(kt, o + 64), x, a2), fma(load_f32x8(kt, o + 96), x, a3)
                a4, a5 = fma(load_f32x8(kt, o + 128), x, a4), fma(load_f32x8(kt, o + 160), x, a5)
                a6, a7 = fma(load_f32x8(kt, o + 192), x, a6), fma(load_f32x8(kt, o + 224), x, a7)
            if softcap32 == 0 and nc == _TILE:   # the usual window: 8 lanes at a time, the same sums
                mr = mk[i0 + r if has_mask else 0]
                sc = splat_f32x8(scale32)
                a0, a1 = _score8(a0, sc, mr, t0, mkind, has_mask, slope), _score8(a1, sc, mr, t0 + 8, mkind, has_mask, slope)
                a2, a3 = _score8(a2, sc, mr, t0 + 16, mkind, has_mask, slope), _score8(a3, sc, mr, t0 + 24, mkind, has_mask, slope)
                a4, a5 = _score8(a4, sc, mr, t0 + 32, mkind, has_mask, slope), _score8(a5, sc, mr, t0 + 40, mkind, has_mask, slope)
                a6, a7 = _score8(a6, sc, mr, t0 + 48, mkind, has_mask, slope), _score8(a7, sc, mr, t0 + 56, mkind, has_mask, slope)
            _store8x8(kq, a0, a1, a2, a3, a4, a5, a6, a7)
            if softcap32 == 0 and nc == _TILE:
                m = vmax(vmax(vmax(a0, a1), vmax(a2, a3)), vmax(vmax(a4, a5), vmax(a6, a7)))
                top = max(max(max(lane(m, 0), lane(m, 1)), max(lane(m, 2), lane(m, 3))),
                          max(max(lane(m, 4), lane(m, 5)), max(lane(m, 6), lane(m, 7))))
            else:
                top = _NEG_INF
                for c in range(_TILE):
                    s = kq[c] * scale32
                    if softcap32 != 0:
                        s = np.float32(math.tanh(s)) * softcap32
                    if c >= nc:
                        s = _NEG_INF
                    elif has_mask:
                        s = s + slope * to_f32(mk[i0 + r, t0 + c], mkind)
                    kq[c] = s
                    top = max(top, s)
            if top == _NEG_INF:
                continue
            new = max(big[r], top)
            fac[0] = np.float32(1.0)
            if new > big[r]:
                fac[0] = np.float32(math.exp(big[r] - new))
                total[r] *= fac[0]
            big[r] = new
            for c in range(_TILE):
                kq[c] = v_expf(kq[c] - new)
            sd = 0.0
            for c8 in range(0, _TILE, 8):
                sd += np.float64(hsum_f32x8(load_f32x8(kq, 4 * c8)))
            total[r] = np.float32(np.float64(total[r]) + sd)
            nb = 0
            for c in range(nc):
                if kq[c] != 0 or (nb == 0 and fac[0] != 1):   # the rescale travels with the first cell
                    wts[nb] = kq[c]
                    rows[nb] = c * dv
                    nb += 1
            _accumulate(dst[iq3, i0 + r, iq2], vbits, KIND_F32, rows, fac, wts, nb, False)
    for r in range(nr):
        inv = np.float32(0.0) if total[r] == 0 else np.float32(1.0) / total[r]
        out = dst[iq3, i0 + r, iq2]
        for j in range(dv):
            out[j] *= inv


@parallel_kernel
def flash_attn_tiled(ch, nch, q, k, kshape, kst, kkind, v, vst, vkind, mask, mkind, has_mask, slopes, scale, softcap,
                     dst):
    """The tiled path (module docstring): chunk ch of nch of a prompt's query tiles."""
    nq3, nq2, nq1, d = q.shape
    nk3, nk2, n_kv = kshape
    r2, r3 = nq2 // nk2, nq3 // nk3
    scale32, softcap32 = np.float32(scale), np.float32(softcap)
    ntile = (nq1 + _TILE - 1) // _TILE
    for item in chunk(nq3 * nq2 * ntile, ch, nch):
        iq3, iq2, it = unravel_row(item, ntile, nq2)
        ik2, ik3 = iq2 // r2, iq3 // r3
        _tile(q, iq3, iq2, it * _TILE, min(nq1, it * _TILE + _TILE), k, ik3 * kst[0] + ik2 * kst[1], kst[2],
              kkind, v, ik3 * vst[0] + ik2 * vst[1], vst[2], vkind, mask, mkind, has_mask, slopes[iq2],
              scale32, softcap32, n_kv, dst)


@parallel_kernel
def flash_attn_rows(ch, nch, q, k, kshape, kst, kkind, v, vst, vkind, mask, mkind, has_mask, slopes, scale, softcap,
                    nchunk, parts, stats, dst):
    """Chunk ``ch`` of ``nch`` of the row-by-row path: its share of the items
    (query row, chunk of cells), each written to ``dst`` (``nchunk`` 1) or to ``parts`` and
    ``stats`` (more, for ``_reduce_chunks``)."""
    nq3, nq2, nq1, d = q.shape
    nk3, nk2, n_kv = kshape
    dv = dst.shape[3]
    r2, r3 = nq2 // nk2, nq3 // nk3
    scale32, softcap32 = np.float32(scale), np.float32(softcap)
    n_items = nq3 * nq2 * nq1 * nchunk
    clen = (n_kv + nchunk - 1) // nchunk
    qh = np.empty(d, np.float32)
    for item in chunk(n_items, ch, nch):
        r, c = item // nchunk, item % nchunk
        iq3, iq2, iq1 = unravel_row(r, nq1, nq2)
        ik2, ik3 = iq2 // r2, iq3 // r3
        qr = q[iq3, iq2, iq1]
        for i in range(d):
            qh[i] = _stored(qr[i], kkind)
        acc = dst[iq3, iq1, iq2] if nchunk == 1 else parts[r, c]
        for j in range(dv):
            acc[j] = np.float32(0.0)
        mr = mask[iq3 % mask.shape[0], iq2 % mask.shape[1], iq1 if has_mask else 0]
        big, total = _row_vec(qh, k, ik3 * kst[0] + ik2 * kst[1], kst[2], kkind, d, v,
                              ik3 * vst[0] + ik2 * vst[1], vst[2], vkind, mr, mkind, has_mask, slopes[iq2],
                              scale32, softcap32, min(n_kv, c * clen), min(n_kv, c * clen + clen), acc)
        if nchunk == 1:
            inv = np.float32(0.0) if total == 0 else np.float32(1.0) / total
            for j in range(dv):
                acc[j] *= inv
        else:
            stats[r, c, 0] = big
            stats[r, c, 1] = total


@_kernel
def _reduce_chunks(parts, stats, dst):
    """GGML's ``ggml_flash_attn_ext_reduce_partials``: each head's chunks combined in chunk order."""
    n_head, nchunk, dv = parts.shape
    for h in range(n_head):
        out = dst[0, 0, h]
        for j in range(dv):
            out[j] = np.float32(0.0)
        big, total = _NEG_INF, np.float32(0.0)
        for c in range(nchunk):
            mc, sc = stats[h, c, 0], stats[h, c, 1]
            if sc == 0:
                continue
            new = max(big, mc)
            f_old, f_new = np.float32(math.exp(big - new)), np.float32(math.exp(mc - new))
            for j in range(dv):
                out[j] = fma(out[j], f_old, parts[h, c, j] * f_new)
            total = fma(total, f_old, sc * f_new)
            big = new
        if total != 0:
            inv = np.float32(1.0) / total
            for j in range(dv):
                out[j] *= inv


def _supported(node):
    q, k, v, mask = node.src[0], node.src[1], node.src[2], node.src[3]
    return (node.type == Type.F32 and q.type == Type.F32 and k.type in (Type.F16, Type.F32)
            and v.type in (Type.F16, Type.F32) and (mask is None or mask.type == Type.F16)
            and node.src[4] is None)   # no attention sinks (ggml_flash_attn_ext_add_sinks)


@forward(Op.FLASH_ATTN_EXT, supports=_supported)
def flash_attn_forward(node, dst, srcs, params):
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
    n_q, n_kv = q_t.ne[1], k_t.ne[1]
    same_kv = k_t.type == v_t.type
    tiled = same_kv and n_q >= _TILE and not ONE_QUERY_ORDER
    nth = params.nth
    nchunk = nth if (same_kv and n_q == 1 and q_t.ne[3] == 1 and n_kv >= _SPLIT_MIN_KV
                     and not ONE_QUERY_ORDER) else 1
    parts, stats = _NO_PARTS, _NO_PARTS
    if nchunk > 1:
        parts = np.empty((q_t.ne[2], nchunk, v_t.ne[0]), np.float32)
        stats = np.empty((q_t.ne[2], nchunk, 2), np.float32)
    work = q_t.ne[1] * q_t.ne[2] * q_t.ne[3] * n_kv * (k_t.ne[0] + v_t.ne[0])
    args = (srcs[0], k, srcs[1].shape[:3], kst, KIND[k_t.type], v, vst, KIND[v_t.type], mask, mkind,
            mask_t is not None, alibi_slopes(node.ne[1], max_bias), float(scale), float(softcap))
    if tiled:
        return [params.launch(flash_attn_tiled, work, *args, dst)]
    n_items = q_t.ne[1] * q_t.ne[2] * q_t.ne[3] * nchunk
    nch = 1 if work < params.thresholds.elements else min(n_items, ROW_CHUNKS_PER_THREAD * nth)
    steps = [params.step(flash_attn_rows, nch, *args, nchunk, parts, stats, dst)]
    if nchunk > 1:
        steps.append((_reduce_chunks, (parts, stats, dst)))
    return steps


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
tie_cache(globals(), simd.ISA, simd.__file__, type_common.__file__, common.__file__, elementwise.__file__, pool.__file__,
          __file__)
