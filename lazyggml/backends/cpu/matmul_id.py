"""GGML's MUL_MAT_ID on the CPU: each token's rows times the weight matrices of the experts it was
routed to (the expert FFNs of a mixture-of-experts model).

Shapes are NumPy's view of GGML's (reversed ``ne``)::

    as   (1, n_expert, m, row)    one weight matrix per expert, rows as mul_mat's (matmul.py)
    b    (1, n_tokens, n_b, k)    float32 activations; n_b is 1 (broadcast) or n_used
    ids  (1, 1, n_tokens, n_used) int32 expert ids
    dst  (1, n_tokens, n_used, m)

    dst[0, t, e, :] = as[0, ids[t, e]] @ b[0, t, e % n_b]

How it runs: the activation rows are converted once to the weights' ``vec_dot_type`` (quantized,
or rounded to F16/BF16), each row's bytes in one run; then every (token, slot) pair is a
mat-vec of its expert's rows by the mul_mat kernels (``dispatch.dot_rows``; two rows at a time
through ``type_float.dot_pair_*`` for float weights), so each result element has the arithmetic of
``mul_mat``'s, hence GGML's bits: vec_dot's, or as llama.cpp's GGML, repacked experts' (CPU_REPACK)
in its gemv's order and the pairs of an expert with 8 routed pairs or more in its tiled matmul's. The work is cut into tasks of (pair, ``RT`` rows) that run
as chunks of consecutive tasks on the CPU backend's pool (``pool.py``), as its other products. A
decode step routes a token to a few experts of many: only their rows are read. GGML groups a
prompt's pairs by expert to reuse its rows over columns (tiles, as mul_mat's prefill); not done
here yet: a prompt reads each used expert's rows once per token.

An id outside [0, n_expert) skips its pair and makes the step raise ``IndexError`` (ids are
computed by the graph, so they are checked at every run: ``table.Checked``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ...cache import tie_cache
from ...ops import Op
from ...types import Type, row_size, type_size
from . import common, matmul, pool, repack, simd, tiled, type_common, type_k
from . import dispatch as D
from .common import FLOAT_TYPES, KIND, KIND_F32, chunk
from .matmul import (POOL_CHUNKS_PER_THREAD, PREFILL_CHUNKS_PER_THREAD, SUPPORTED_TYPES,
                     dot_rows_float, round_acts, scratch, thread_scratch)
from .table import Checked, forward
from .traits import TYPE_TRAITS_CPU

_kernel = njit(cache=True)

RT = 64        # weight rows per task


@_kernel
def _quantize_rows(vtid, x4, xflat, yq, rs):
    """Every activation row into ``yq``, ``rs`` bytes each, row after row: a contiguous x in one
    call (rows are whole blocks), else row by row through a contiguous copy."""
    if xflat.size:
        D.from_float(vtid, xflat, yq)
        return
    tmp = np.empty(x4.shape[3], np.float32)
    r = 0
    for i2 in range(x4.shape[1]):
        for i1 in range(x4.shape[2]):
            tmp[:] = x4[0, i2, i1, :]
            D.from_float(vtid, tmp, yq[r * rs:(r + 1) * rs])
            r += 1


@_kernel
def _pair(ids, dst, t, rt):
    """Task t -> (token, slot, expert id, r0, r1): rows r0..r1 of one (token, slot) pair, ``rt``
    rows a task."""
    m = dst.shape[3]
    n_rt = (m + rt - 1) // rt
    p, r0 = t // n_rt, (t % n_rt) * rt
    tok, e = p // dst.shape[2], p % dst.shape[2]
    return tok, e, ids[0, 0, tok, e], r0, min(m, r0 + rt)


@_kernel
def _task(kid, kind, path, n, aq, af, ids, y, yf, rs, n_b, dst, t, counts, acc):
    """Task t: quantized weights ``aq`` (type id ``kid``; ``y``: n_b quantized rows of ``rs``
    bytes per token) when ``kind`` < 0, else float weights ``af`` of element kind ``kind`` (``yf``:
    n_b float32 rows per token, ``rs`` = their bytes); the other pair is an empty stand-in.
    ``path``: the order of llama.cpp's GGML (module docstring); ``counts``: the pairs routed to each
    expert; ``acc``: scratch. Returns 1 if its expert id is out of range (nothing computed; counted
    by the pair's first task), else 0."""
    tok, e, x, r0, r1 = _pair(ids, dst, t, RT)
    if x < 0 or x >= (aq.shape[1] if kind < 0 else af.shape[1]):
        return 1 if r0 == 0 else 0     # counted once per pair
    yo = (tok * n_b + e % n_b) * rs
    if kind < 0:
        if path == matmul.PATH_TILED and counts[x] >= tiled.TILED_MIN_COLS:
            D.tiled_tile(kid, n, aq, 0, x, r0, r1, y, yo, rs, type_k.Q8_K_SIZE, 1, acc, acc[acc.size - 2:],
                         dst, 0, tok, e)
        else:
            matmul.dot_rows_path(kid, path, n, aq, 0, x, r0, r1, y, yo, dst, 0, tok, e)
    else:
        dot_rows_float(kind, n, af[0, x], r0, r1, yf, yo, dst[0, tok, e])
    return 0


@_kernel
def _chunk(c, nc, kid, kind, path, n, aq, af, ids, y, yf, rs, n_b, dst, counts, acc, bad):
    """Chunk c of nc of the tasks, a contiguous run of them (a pool job's body), in row c of
    ``acc``; its count of bad ids in ``bad[c]``."""
    ntasks = dst.shape[1] * dst.shape[2] * -(-dst.shape[3] // RT)
    b = 0
    for t in chunk(ntasks, c, nc):
        b += _task(kid, kind, path, n, aq, af, ids, y, yf, rs, n_b, dst, t, counts, acc[c])
    bad[c] = b


@_kernel
def _run(vtid, x4, xflat, kid, kind, path, n, aq, af, ids, y, yf, rs, dst, counts, acc, state, nc, bad):
    """Quantize the activations (quantized weights), count the pairs routed to each expert, then
    every task, in ``nc`` chunks on the CPU backend's pool (``pool.py``; one chunk: on this
    thread); returns the count of bad ids."""
    if kind < 0:
        _quantize_rows(vtid, x4, xflat, y, rs)
    counts[:] = 0
    for tok in range(ids.shape[2]):
        for e in range(dst.shape[2]):
            x = ids[0, 0, tok, e]
            if 0 <= x < counts.size:
                counts[x] += 1
    pool.parallel_for(state, _chunk, nc, (kid, kind, path, n, aq, af, ids, y, yf, rs, x4.shape[2], dst, counts,
                                          acc, bad))
    return bad[:nc].sum()


# the cache of every driver above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, *D.KERNEL_FILES, D.__file__, common.__file__, matmul.__file__, pool.__file__,
          __file__)


def mul_mat_id_steps(as4, wtype, b, ids, dst, params, repacked=False):
    """The plan steps that compute ``dst = mul_mat_id(as, b, ids)`` for a plan's ``params``; ``repacked``:
    the experts are in a CPU_REPACK buffer (``repack.py``)."""
    n_expert, m = as4.shape[1], as4.shape[2]
    n_tokens, n_b, k = b.shape[1], b.shape[2], b.shape[3]
    n_used = dst.shape[2]
    if dst.size == 0:
        return []
    nth = params.nth
    parallel = nth > 1 and n_tokens * n_used * m * k >= params.thresholds.macs
    nc = 1   # on the pool (pool.py), as the other products: chunks of consecutive tasks
    if parallel:
        nc = min(n_tokens * n_used * -(-m // RT), (POOL_CHUNKS_PER_THREAD if n_tokens == 1 else PREFILL_CHUNKS_PER_THREAD) * nth)
    counts = scratch("counts_id", 8 * n_expert).view(np.int64)
    acc = thread_scratch("acc_id", nc, type_common.acc_floats(k, 1) + 2, np.float32)
    par = (counts, acc, params.pool.state, nc, thread_scratch("bad", nc, 1, np.int64)[:, 0])
    what = "mul_mat_id: expert ids"
    if wtype in FLOAT_TYPES:
        kind = KIND[wtype]
        yf = b if wtype == Type.F32 and b.flags.c_contiguous else scratch("xf_id", 4 * b.size).view(np.float32).reshape(b.shape)
        steps = [] if yf is b else [(np.copyto, (yf, b)) if kind == KIND_F32 else (round_acts, (kind, b, yf))]
        af = as4.view(np.uint16) if as4.dtype == np.float16 else as4
        args = (0, b, _NO_F32, int(wtype), kind, matmul.PATH_VEC_DOT, k, _NO_Q, af, ids, _NO_U8, yf.reshape(-1), 4 * k,
                dst)
    else:
        vt = TYPE_TRAITS_CPU[wtype].vec_dot_type
        rs = row_size(vt, k)
        yq = scratch("yq_id", rs * n_tokens * n_b)   # not mul_mat's "yq": that one may hold a row a later product reuses
        xflat = b.reshape(-1) if b.flags.c_contiguous else _NO_F32
        steps = []
        # as llama.cpp's GGML: repacked experts through its gemv, row by row; otherwise an expert with
        # 8 routed rows or more through its tiled matmul (ggml_compute_forward_mul_mat_id_tiled)
        path = matmul.quant_path(wtype, tiled.TILED_MIN_COLS, repacked)
        args = (int(vt), b, xflat, int(wtype), -1, path, k, as4, _NO_F4, ids, yq, _NO_F32, rs, dst)
    return steps + [(Checked(what, _run, args + par, n_expert), ())]


# stand-ins for the arrays of the other path (the quantized or the float one): typed, empty
_NO_U8, _NO_F32 = np.empty(0, np.uint8), np.empty(0, np.float32)
_NO_Q, _NO_F4 = np.empty((1, 1, 1, 1), np.uint8), np.empty((1, 1, 1, 1), np.float32)


def _supported(node):
    a, b, ids = node.src[0], node.src[1], node.src[2]
    return (a.type in SUPPORTED_TYPES and b.type == Type.F32 and ids.type == Type.I32 and node.type == Type.F32
            and a.nb[0] == type_size(a.type))


@forward(Op.MUL_MAT_ID, supports=_supported)
def _forward_mul_mat_id(node, dst, srcs, params):
    return mul_mat_id_steps(srcs[0], node.src[0].type, srcs[1], srcs[2], dst, params,
                            repack.is_repacked(node.src[0]))
