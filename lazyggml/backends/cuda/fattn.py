"""FLASH_ATTN_EXT: attention in one pass over the KV cells, never writing the n_q × n_kv scores
(the idea of GGML's ``fattn-vec`` kernels, in our own arrangement).

**Blocks.** A block of ``NWARPS`` warps takes ``R = GB · QN`` *rows*: ``GB`` heads that share one
K/V head (grouped-query attention) times ``QN`` consecutive queries, and one *slice* of the KV
cells. Each K and V row read from memory serves all R rows (``pick_rows``: as many as the lanes'
registers hold). Decode has one query and few heads, so the window is cut into ``n_split``
slices to give the GPU enough blocks (``pick_split``); a prompt has enough blocks with one slice.

**A warp's walk.** Warp ``w`` takes the slice's cells ``w, w + NWARPS, ...``, ``CU`` of them per
step (``cells_per_step``: as many as the lanes' registers allow). Lane ``l`` holds elements
``l, l + 32, ...`` (``DJ = ceil(D/32)`` of them) of each row's query, already multiplied by the
scale, and of each row's accumulator. A step first loads its cells' K rows, V rows and mask
values, all at once (one cell at a time would be a chain of waits), then computes the ``CU·R``
partial dot products and one warp reduction each: the scores ``s`` (``softcap·tanh(s)`` with a
logit soft-cap, then plus ``slope·mask``; −inf where the mask is −inf or past the slice). The
online softmax keeps a running maximum ``m`` and sum ``l`` per row: when the step's largest score
raises the maximum, the sum and the accumulator are scaled by ``exp(m_old − m_new)`` once, then
each cell's ``p = exp(s − m)`` is added to the sum and ``p·v`` to the accumulator. Masked cells
(the unused ones of a padded window) add nothing.

**Merging.** The warps' ``(m, l, acc)`` meet in shared memory and are merged by rescaling to the
largest maximum. With one slice the block writes ``acc / l`` (0 when ``l`` is 0: every cell
masked, as GGML); with several it writes its partial ``(acc, m, l)`` to a work area and
``fattn_combine`` merges each row's slices the same way, its warps taking the slices in parallel.

**Lists of visible cells** (a mask shared by all heads and fewer than ``LIST_MAX_Q`` queries): a
step of many sequences in one cache shows each query only its own sequence's cells, a small part
of the window (a decode step of 32 sequences at 640 tokens each: 1/32 of 17,408 cells). Walking
the window, the kernel spent a millisecond per layer (on an H100, 8B, 32 sequences) on cells it
then masked out. So ``visible_cells`` first lists each query's cells whose mask is above −inf, in
order (once per graph run: every layer's attention shares the mask, ``be.cells_of``), and the
blocks (one query each, ``QN = 1``) walk their query's list, sliced as the window would be; K and
V rows are read through the list. Fewer than ``PROMPT_MIN_Q`` queries took the one-pass kernel
before; from there to ``LIST_MAX_Q`` this replaces the prompt path below, which computes every
query against every cell: at 32 sequences that is 32 times the work of the lists. The cost of
the choice: a short prompt chunk deep in one sequence's context (16 to 63 queries over the same
long list) reads each K/V row once per query where the prompt path would read it once.

**Prompts** (``LIST_MAX_Q`` queries or more, or a mask per head, no soft-cap): the one-pass kernel reads every K
and V row once per query, so a prompt of 512 tokens is faster through the unfused kernels
(``launch_prompt``): the scores of all queries at once by the tiled product, soft_max, the
product with V. GGML's tensor-core flash-attention kernels are the next step here (issue 17).

Grouped-query attention reads K/V head ``h // (n_head / n_head_kv)``; dims 3 broadcast the same
way; the mask row is the query's, its dims 2 and 3 broadcast by modulo; ALiBi's slope is the
per-head slope ``ops.soft_max_alibi`` gives (``common.alibi_slope``). K and V may be F16 or
F32, read through strided views of the KV cache.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np
from numba import cuda

from .common import alibi_slope, cdiv, jit_kernel, plane, warp_reduce_max, warp_reduce_sum, F32_ZERO, SIM
from .elementwise import BLOCK, grid_rows
from .matmul import launch_mul_mat_f
from .softmax import launch_soft_max

NWARPS = 1 if SIM else 8   # one warp under the simulator (threads are costly there)
LANE_REGS = 32             # R · DJ: query (and accumulator) values a lane holds for its block's rows
STEP_SCORES = 4            # scores (cells × rows) a warp works on per step (measured: 16 was slower)
MAX_GB = 8                 # heads per block, at most
QN_BATCH = 8               # from this many queries on, a block takes several (prompts with a soft-cap)
PROMPT_MIN_Q = 16          # from this many queries on, the prompt path (``launch_prompt``)
MAX_D = 256                # head sizes up to 256 (8 elements per lane)
# two blocks of 8 warps per multiprocessor of an H200-class GPU (measured on an 8B decode step's
# attention, 2304 cells: 23.6 µs, against 26-57 µs with 2-8 warps, 1-16 blocks per multiprocessor
# and 1-4 cells per step); a slice shorter than MIN_SPLIT_CELLS is not worth its partial (small
# under the simulator, so that its tests take the split path too)
TARGET_BLOCKS = 4 if SIM else 2 * 132
MIN_SPLIT_CELLS = 8 if SIM else 32
COMBINE_WARPS = 1 if SIM else 8
COMBINE_LANES = 32 * COMBINE_WARPS   # shared sizes must be literal constants, not expressions
LIST_MAX_Q = 64            # below this many queries, each walks its own list of visible cells
LIST_THREADS = 32 if SIM else 256
LIST_SHARED = LIST_THREADS + 1

_kernels = {}


def _make_kernel(DJ, GB, QN):
    R = GB * QN
    NQ = R * DJ
    CU = cells_per_step(DJ, R)
    NC = CU * R
    NK = CU * DJ
    NS = NWARPS * R                 # shared sizes must be constants of the closure
    NSA = NWARPS * R * 32 * DJ
    nthreads = 32 * NWARPS

    @jit_kernel()
    def fattn(q, k, v, mask, has_mask, dst, part, D, n_kv, n_q, n_head, gqa, r3,
              qs1, qs2, qs3, ks1, ks2, ks3, vs1, vs2, vs3, ms1, ms2, ms3, mne2, mne3,
              scale, softcap, max_bias, m0, m1, n_head_log2, slice_cells, n_split, cells, counts, use_list):
        lane = cuda.threadIdx.x
        w = cuda.threadIdx.y
        sp = cuda.blockIdx.x
        iq0 = cuda.blockIdx.y * QN
        ngrp = n_head // GB
        h0 = (cuda.blockIdx.z % ngrp) * GB
        i3 = cuda.blockIdx.z // ngrp
        kb = (i3 // r3) * ks3 + (h0 // gqa) * ks2
        vb = (i3 // r3) * vs3 + (h0 // gqa) * vs2

        qr = cuda.local.array(NQ, numba.float32)
        acc = cuda.local.array(NQ, numba.float32)
        mx = cuda.local.array(R, numba.float32)
        sm = cuda.local.array(R, numba.float32)
        slope = cuda.local.array(R, numba.float32)
        mrow = cuda.local.array(R, numba.int64)
        sc = cuda.local.array(NC, numba.float32)     # [cell u][row r]
        mk = cuda.local.array(NC, numba.float32)
        kr = cuda.local.array(NK, numba.float32)     # [cell u][j]
        vr = cuda.local.array(NK, numba.float32)
        for r in range(R):
            iq1 = min(iq0 + r // GB, n_q - 1)
            h = h0 + r % GB
            slope[r] = alibi_slope(h, max_bias, m0, m1, n_head_log2)
            mrow[r] = (i3 % mne3) * ms3 + (h % mne2) * ms2 + iq1 * ms1
            for j in range(DJ):
                d = lane + 32 * j
                qr[r * DJ + j] = q[i3 * qs3 + h * qs2 + iq1 * qs1 + d] * scale if d < D else F32_ZERO
                acc[r * DJ + j] = F32_ZERO
            mx[r] = np.float32(-np.inf)
            sm[r] = F32_ZERO

        # the slice: of the window's cells, or of the query's list of visible cells (QN = 1)
        n_c = n_kv
        if use_list:
            n_c = counts[iq0]
            slice_cells = (n_c + n_split - 1) // n_split
        lb = iq0 * n_kv
        p1 = min((sp + 1) * slice_cells, n_c)
        for p0 in range(sp * slice_cells + w, p1, NWARPS * CU):
            # CU cells' K rows, V rows and mask values: all their loads in flight at once
            for u in range(CU):
                p = p0 + u * NWARPS
                c = cells[lb + p] if use_list and p < p1 else p
                for j in range(DJ):
                    d = lane + 32 * j
                    kr[u * DJ + j] = np.float32(k[kb + c * ks1 + d]) if p < p1 and d < D else F32_ZERO
                    vr[u * DJ + j] = np.float32(v[vb + c * vs1 + d]) if p < p1 and d < D else F32_ZERO
                for r in range(R):
                    if p >= p1:
                        mk[u * R + r] = np.float32(-np.inf)
                    elif has_mask:
                        mk[u * R + r] = np.float32(mask[mrow[r] + c])
                    else:
                        mk[u * R + r] = F32_ZERO
            for u in range(CU):
                for r in range(R):
                    t = F32_ZERO
                    for j in range(DJ):
                        t += qr[r * DJ + j] * kr[u * DJ + j]
                    sc[u * R + r] = t
            for e in range(NC):
                sc[e] = warp_reduce_sum(sc[e], 32)
            for r in range(R):
                m_new = mx[r]
                for u in range(CU):
                    e = u * R + r
                    if mk[e] == -np.inf:
                        sc[e] = np.float32(-np.inf)
                    else:
                        t = sc[e]
                        if softcap != F32_ZERO:
                            t = softcap * np.float32(math.tanh(t))
                        t += slope[r] * mk[e]
                        sc[e] = t
                        m_new = max(m_new, t)
                if m_new == -np.inf:       # no cell seen yet for this row
                    continue
                if m_new > mx[r]:         # rescale what was summed to the new maximum
                    alpha = np.float32(math.exp(mx[r] - m_new))
                    mx[r] = m_new
                    sm[r] *= alpha
                    for j in range(DJ):
                        acc[r * DJ + j] *= alpha
                for u in range(CU):
                    e = u * R + r
                    if sc[e] != -np.inf:
                        p = np.float32(math.exp(sc[e] - m_new))
                        sm[r] += p
                        for j in range(DJ):
                            acc[r * DJ + j] += p * vr[u * DJ + j]

        # merge the warps: each warp's (m, l, acc) to shared memory, then one output per thread
        wm = cuda.shared.array(NS, numba.float32)
        wl = cuda.shared.array(NS, numba.float32)
        wacc = cuda.shared.array(NSA, numba.float32)
        for r in range(R):
            if lane == 0:
                wm[w * R + r] = mx[r]
                wl[w * R + r] = sm[r]
            for j in range(DJ):
                wacc[((w * R + r) * DJ + j) * 32 + lane] = acc[r * DJ + j]
        cuda.syncthreads()
        for e in range(32 * w + lane, R * D, nthreads):
            r = e // D
            d = e % D
            iq1 = iq0 + r // GB
            if iq1 >= n_q:
                continue
            m = np.float32(-np.inf)
            for ww in range(NWARPS):
                m = max(m, wm[ww * R + r])
            lsum = F32_ZERO
            o = F32_ZERO
            if m != -np.inf:
                for ww in range(NWARPS):
                    f = np.float32(math.exp(wm[ww * R + r] - m))
                    lsum += f * wl[ww * R + r]
                    o += f * wacc[((ww * R + r) * DJ + d // 32) * 32 + d % 32]
            row = (i3 * n_q + iq1) * n_head + h0 + r % GB
            if n_split == 1:
                dst[row * D + d] = o / lsum if lsum > F32_ZERO else F32_ZERO
            else:
                pb = (row * n_split + sp) * (D + 2)
                part[pb + d] = o
                if d == 0:
                    part[pb + D] = m
                    part[pb + D + 1] = lsum

    return fattn


@jit_kernel()
def transpose_v(v, vt, n_kv, D, n_head_kv, ne3, vs1, vs2, vs3):
    """``vt`` = V with cells along dim 0: [n_kv, D, n_head_kv, ne3] contiguous (writes coalesced);
    walked as rows (``elementwise.grid_rows``)."""
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < n_head_kv * ne3:
        h, i3 = plane(i23, n_head_kv)
        vb = i3 * vs3 + h * vs2
        d = cuda.blockIdx.y
        while d < D:
            rd = (i23 * D + d) * n_kv
            c = x0
            while c < n_kv:
                vt[rd + c] = v[vb + c * vs1 + d]
                c += dx
            d += cuda.gridDim.y
        i23 += cuda.gridDim.z


@jit_kernel()
def heads_to_dim1(o, dst, D, n_head, n_q, ne3):
    """[D, n_q, n_head, ne3] (the product's layout) to FLASH_ATTN_EXT's [D, n_head, n_q, ne3]; walked
    as rows of dst."""
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    i23 = cuda.blockIdx.z
    while i23 < n_q * ne3:
        iq, i3 = plane(i23, n_q)
        h = cuda.blockIdx.y
        while h < n_head:
            rd = (i23 * n_head + h) * D
            ro = ((i3 * n_head + h) * n_q + iq) * D
            d = x0
            while d < D:
                dst[rd + d] = o[ro + d]
                d += dx
            h += cuda.gridDim.y
        i23 += cuda.gridDim.z


class _Layout(NamedTuple):
    """What the product and soft_max launchers read of a tensor: its shape and byte strides."""
    ne: tuple
    nb: tuple


def _contiguous(ne, size):
    return _Layout(ne, (size, size * ne[0], size * ne[0] * ne[1], size * ne[0] * ne[1] * ne[2]))


def launch_prompt(be, q, k, v, mask, scale, max_bias, alibi, views):
    """A prompt's attention as three kernels of the unfused path, inside the one node: scores
    ``S = Kᵀ·Q`` (``mul_mat_f``, grouped-query broadcast), soft_max over each query's cells in
    place (with the mask, ALiBi and zeros for a query that sees no cell), ``O = Vᵀ·S`` from V
    transposed into a work area; then O to the heads-in-dim-1 layout."""
    qv, kv, vv, mv, dv = views
    D, n_q, n_head, ne3 = q.ne
    n_kv, n_head_kv, ne3k = k.ne[1], k.ne[2], k.ne[3]
    ek, ev = k.nb[0], v.nb[0]
    st = be.stream
    s_ne = (n_kv, n_q, n_head, ne3)
    sv = be.scratch("fattn_kq", 4 * math.prod(s_ne), np.float32)
    launch_mul_mat_f(st, kv, tuple(nb // ek for nb in k.nb), k.ne, qv, q, sv)
    launch_soft_max(st, sv, mv if mask is not None else sv, sv, _contiguous(s_ne, 4), mask, scale, max_bias,
                    alibi, empty_zero=True)
    vt_ne = (n_kv, D, n_head_kv, ne3k)
    vt = be.scratch("fattn_vt", ev * math.prod(vt_ne), vv.dtype)
    transpose_v[grid_rows(vt_ne), BLOCK, st](vv, vt, *vt_ne, v.nb[1] // ev, v.nb[2] // ev, v.nb[3] // ev)
    no = D * n_q * n_head * ne3
    ov = be.scratch("fattn_o", 4 * no, np.float32)
    launch_mul_mat_f(st, vt, (1, n_kv, n_kv * D, n_kv * D * n_head_kv), (n_kv, D, n_head_kv, ne3k), sv,
                     _contiguous(s_ne, 4), ov)
    heads_to_dim1[grid_rows((D, n_head, n_q, ne3)), BLOCK, st](ov, dv, D, n_head, n_q, ne3)


@jit_kernel()
def fattn_combine(part, dst, D, n_split):
    """Merge each output row's ``n_split`` partials ``(acc, m, l)``: a block per row and 32 of its
    elements; its warps take the slices ``w, w + COMBINE_WARPS, ...`` and meet in shared memory."""
    row = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    w = cuda.threadIdx.y
    d = cuda.blockIdx.y * 32 + lane
    m = np.float32(-np.inf)
    for sp in range(lane, n_split, 32):
        m = max(m, part[(row * n_split + sp) * (D + 2) + D])
    m = warp_reduce_max(m, 32)
    lsum = F32_ZERO
    o = F32_ZERO
    if m != -np.inf:
        for sp in range(w, n_split, COMBINE_WARPS):
            pb = (row * n_split + sp) * (D + 2)
            f = np.float32(math.exp(part[pb + D] - m))
            lsum += f * part[pb + D + 1]
            if d < D:
                o += f * part[pb + d]
    so = cuda.shared.array(COMBINE_LANES, numba.float32)
    sl = cuda.shared.array(COMBINE_WARPS, numba.float32)
    so[w * 32 + lane] = o
    if lane == 0:
        sl[w] = lsum
    cuda.syncthreads()
    if w == 0 and d < D:
        for ww in range(1, COMBINE_WARPS):
            o += so[ww * 32 + lane]
            lsum += sl[ww]
        dst[row * D + d] = o / lsum if lsum > F32_ZERO else F32_ZERO


@jit_kernel()
def visible_cells(mask, ms1, n_kv, cells, counts):
    """List each query's visible cells (mask above −inf) in order: ``counts[q]`` of them in
    ``cells[q·n_kv ...]``. Block ``q`` takes mask row ``q``: each thread counts its stretch of
    cells, thread 0 turns the counts into offsets, then each thread writes its stretch."""
    q = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    stretch = (n_kv + nt - 1) // nt
    c0 = t * stretch
    c1 = min(c0 + stretch, n_kv)
    mb = q * ms1
    n = 0
    for c in range(c0, c1):
        if np.float32(mask[mb + c]) != -np.inf:
            n += 1
    off = cuda.shared.array(LIST_SHARED, numba.int32)
    off[t + 1] = n
    cuda.syncthreads()
    if t == 0:
        off[0] = 0
        for i in range(nt):
            off[i + 1] += off[i]
        counts[q] = off[nt]
    cuda.syncthreads()
    o = q * n_kv + off[t]
    for c in range(c0, c1):
        if np.float32(mask[mb + c]) != -np.inf:
            cells[o] = c
            o += 1


def launch_visible_cells(be, mask, mv, n_kv, n_q):
    """The lists of ``visible_cells`` for the mask ``mask`` (device view ``mv``) in work areas,
    made once per graph run: the layers' attention nodes share one mask (``be.cells_of``)."""
    cells = be.scratch("fattn_cells", 4 * n_q * n_kv, np.int32)
    counts = be.scratch("fattn_counts", 4 * n_q, np.int32)
    if be.cells_of is not mask:
        ms1 = mask.nb[1] // mask.nb[0]
        visible_cells[n_q, LIST_THREADS, be.stream](mv, ms1, n_kv, cells, counts)
        be.cells_of = mask
    return cells, counts


def cells_per_step(DJ, R):
    """Cells a warp loads at once: enough bytes in flight to hide the memory's latency (one cell
    at a time left a decode step's attention latency-bound), within the lanes' registers."""
    return max(1, min(LANE_REGS // (2 * DJ), STEP_SCORES // R))


def get_kernel(DJ, GB, QN):
    kern = _kernels.get((DJ, GB, QN))
    if kern is None:
        kern = _kernels[(DJ, GB, QN)] = _make_kernel(DJ, GB, QN)
    return kern


def pick_rows(DJ, gqa, n_q):
    """A block's rows: ``GB`` heads of one K/V group (the largest divisor of ``gqa`` the lanes'
    registers allow) times ``QN`` queries (1 for decode-sized batches)."""
    GB = max(g for g in range(1, min(gqa, MAX_GB, LANE_REGS // DJ) + 1) if gqa % g == 0)
    QN = 1 if n_q < QN_BATCH else max(1, min(QN_BATCH, LANE_REGS // (DJ * GB)))
    return GB, QN


def pick_split(n_kv, n_blocks):
    """How many slices to cut the window into so that ``n_blocks`` blocks become enough."""
    if n_blocks >= TARGET_BLOCKS:
        return 1
    return max(1, min(cdiv(TARGET_BLOCKS, n_blocks), n_kv // MIN_SPLIT_CELLS))


def launch_fattn(be, q, k, v, mask, dst_t, scale, max_bias, softcap, alibi, views):
    """Queue ``dst_t = flash_attn_ext(q, k, v, mask)`` on ``be``'s stream; ``views``: the device
    views of q, k, v, the mask (or any array) and dst."""
    qv, kv, vv, mv, dv = views
    D, n_q, n_head, ne3 = q.ne
    n_kv, n_head_kv, ne3k = k.ne[1], k.ne[2], k.ne[3]
    eq, ek, ev = q.nb[0], k.nb[0], v.nb[0]
    if mask is None:
        ms, mne, has_mask = (0, 0, 0), (1, 1), False
    else:
        em = mask.nb[0]
        ms, mne, has_mask = (mask.nb[1] // em, mask.nb[2] // em, mask.nb[3] // em), mask.ne[2:], True
    args = (n_kv, n_q, n_head, n_head // n_head_kv, ne3 // ne3k,
            q.nb[1] // eq, q.nb[2] // eq, q.nb[3] // eq, k.nb[1] // ek, k.nb[2] // ek, k.nb[3] // ek,
            v.nb[1] // ev, v.nb[2] // ev, v.nb[3] // ev, ms[0], ms[1], ms[2], mne[0], mne[1])
    s = np.float32(scale) / np.float32(softcap) if softcap else np.float32(scale)   # GGML divides in float32
    params = (s, np.float32(softcap), np.float32(max_bias), alibi.m0, alibi.m1, alibi.n_head_log2)
    use_list = mask is not None and n_q < LIST_MAX_Q and tuple(mne) == (1, 1)
    if n_q >= PROMPT_MIN_Q and not softcap and not use_list:
        launch_prompt(be, q, k, v, mask, scale, max_bias, alibi, views)
        return
    DJ = cdiv(D, 32)
    GB, QN = pick_rows(DJ, n_head // n_head_kv, 1 if use_list else n_q)
    cells, counts = launch_visible_cells(be, mask, mv, n_kv, n_q) if use_list else (dv, dv)
    n_blocks = cdiv(n_q, QN) * (n_head // GB) * ne3
    n_split = pick_split(n_kv, n_blocks)
    slice_cells = cdiv(n_kv, n_split)
    n_split = cdiv(n_kv, slice_cells)
    part = dv
    if n_split > 1:
        part = be.scratch("fattn", 4 * n_q * n_head * ne3 * n_split * (D + 2), np.float32)
    get_kernel(DJ, GB, QN)[(n_split, cdiv(n_q, QN), (n_head // GB) * ne3), (32, NWARPS), be.stream](
        qv, kv, vv, mv, has_mask, dv, part, D, *args, *params, slice_cells, n_split, cells, counts, use_list)
    if n_split > 1:
        fattn_combine[(n_q * n_head * ne3, cdiv(D, 32)), (32, COMBINE_WARPS), be.stream](part, dv, D, n_split)
