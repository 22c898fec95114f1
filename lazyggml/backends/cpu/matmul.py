"""GGML's MUL_MAT on the CPU: ``dst = W · x`` batch by batch, with broadcasting.

Shapes are NumPy's view of GGML's (reversed ``ne``)::

    w    (ne03, ne02, ne01, row)   weights: ``row`` = bytes of a quantized row (uint8), or the
                                   ne00 elements of a float32 / float16 / uint16 (F16, BF16) row
    x    (ne13, ne12, ne11, ne10)  float32 activations, any strides (a permuted view is fine)
    dst  (ne13, ne12, ne11, ne01)  float32, C-contiguous

    dst[i3, i2, i1, i0] = Σ_k W[i3 // r3, i2 // r2, i0, k] · x[i3, i2, i1, k],
    r2 = ne12 / ne02,  r3 = ne13 / ne03           (GGML's broadcast of src0 over src1)

How it runs (GGML's ``ggml_compute_forward_mul_mat``, reorganised):

1. **Activations are converted once** to the weight type's ``vec_dot_type`` (traits.py): Q8_K for
   the K-quants and IQ4_XS, Q8_0 for Q4_0/Q8_0/Q5_0/IQ4_NL, Q8_1 for Q4_1/Q5_1, fp16- or
   bf16-rounded floats for F16/BF16 weights. From then on a dot product is integer multiply-adds
   on both sides. For the SIMD types the quantized columns are stored block-major (block i of all
   columns together), so a tile of columns is read as one contiguous stream.
2. **The output is cut into tasks**: a tile of ``RT`` weight rows × ``CT`` activation columns of
   one batch. The tasks run as one job of the CPU backend's pool (``pool.py``), in chunks of
   consecutive tasks that free threads take (``PREFILL_CHUNKS_PER_THREAD`` a thread), so a core
   slowed down by something else just does fewer of them.
3. **A task** walks its weight rows; each row is dotted with all ``CT`` columns at once by
   the type's ``dot_cols_*`` (``type_<family>.py``), which unpacks every weight block once for all the columns (a weight
   byte is read from memory once per column tile, and unpacked once per column tile). With a
   single column, the register-only ``dot_*`` is used. Where the type has them and the
   CPU has AVX-512BW, rows go two at a time through ``dot2_*`` / ``dot_cols2_*`` (512-bit
   vectors, the same results; on AVX2 alone they are 1.3-2.3x slower, see dispatch.py). The
   kernels of the weight type are the traits table's ``dot`` / ``dot_cols`` (``dot2`` /
   ``dot_cols2``), picked by the switches generated from it (``dispatch.py``).

Decode (``ne11 <= 8``) is then a matrix-vector product parallel over weight rows: memory-bound,
it reads the weights once. A single column runs on the CPU backend's own pool (``pool.py``: a
job's chunks of rows, ~0.5 µs a job, where an OpenMP region costs ~3 µs and took the small
products of a decode step off the second thread). Prefill (many columns) is compute-bound and gains from the per-block
unpacking being shared by ``CT`` columns. No weight repacking is needed (repack.py follows the
arithmetic of GGML's repacked weights, not their layout).

Numerics: per (row, column), the arithmetic is exactly that of GGML's AVX2 ``vec_dot`` (same
activation quantizer or rounding, same integer lanes, same FMA order): on an FMA machine every
weight type, F32, F16 and BF16 included, matches GGML's CPU backend bit for bit, whatever the
number of columns or threads (GGML computes each (row, column) with one ``vec_dot`` call;
type_float.py says how). Where llama.cpp's build of GGML leaves vec_dot, so do these
(``quant_path`` picks per product): float products of 2 columns or more follow llamafile's sgemm
(``LLAMAFILE``), K-quant products of 8 columns or more its tiled matmul's order (``tiled.py``), and
weights in a CPU_REPACK buffer its repacked gemv/gemm's (``repack.py``).

Entry points: ``mul_mat(w, wtype, x, dst)``, and ``mul_mat_steps`` (the same as kernel calls
for the CPU backend's plans: argument checks and scratch buffers once per graph, not per step).
"""
from __future__ import annotations

import threading

import numba
import numpy as np
from numba import njit

from ... import debug
from ...cache import tie_cache
from ...ops import Op
from ...types import Type, as_type, row_size, type_size
from . import common
from .params import ComputeParams, address
from .table import forward
from . import dispatch as D
from . import pool, repack, simd, tiled, type_common, type_float
from .common import (FLOAT_TYPES, KIND, KIND_F16, KIND_F32, chunk, from_f32, parallel_kernel, to_f32,
                     unravel_row)
from .traits import TYPE_TRAITS_CPU, types_with

_kernel = njit(cache=True)

# weight types by path: the quantized ones are those with the matmul's kernels in the traits table
# (their GGML type ids go to the generated switches of dispatch.py), the float ones run by element
# kind (common.KIND)
QUANT_TYPES = types_with("dot_cols")
SUPPORTED_TYPES = QUANT_TYPES + FLOAT_TYPES

# Tile sizes. CT columns share each unpacked weight block; 16 columns of a k=14336 Q8_K row are
# 256 KiB, which stays in a core's L2 while RT weight rows stream past. Measured on the dev
# machine (bench/bench_mul_mat.py); any value is correct.
PREFILL_CT = 16
PREFILL_RT = 64
DECODE_MAX_COLS = 8
# Decode rows per task: about DECODE_TASKS_PER_THREAD tasks per thread, within [DECODE_RT_MIN,
# DECODE_RT_MAX]. Taking a task costs ~100 ns (the counter's cache line moves between cores) and
# a long run of rows keeps the prefetchers streaming: 16 rows a task made a 768x768 Q4_K mat-vec
# 40 µs where 96 to 128 make it 33-34 (2 threads, weights streaming from memory), 2048x768
# 92 -> 76 µs; more, fewer tasks lose the balance between threads.
DECODE_TASKS_PER_THREAD = 4
DECODE_RT_MIN, DECODE_RT_MAX = 16, 128
# A single column's product on the pool (decode): one thread below ``Thresholds.pool_macs``
# multiply-adds (params.py); chunks per thread (two: a late thread's share is taken by the other;
# more cost a compare-and-swap each and shorten the prefetched row runs) of at least POOL_MIN_ROWS
# rows. Several columns: one thread below ``Thresholds.macs`` (``float_macs`` for float weights).
POOL_CHUNKS_PER_THREAD = 2
POOL_MIN_ROWS = 32
# Many columns (prompts): chunks per thread, each a run of consecutive tasks (which share their
# column tile): a thread that starts late, or is descheduled, leaves its later chunks to the others.
PREFILL_CHUNKS_PER_THREAD = 4
#: Float products of 2 columns or more in the order of llamafile's sgemm (tinyBLAS), as GGML adds
#: them when built with GGML_LLAMAFILE, which llama.cpp turns on by default (so its F16 KV cache's
#: attention without flash attention, and its F32/F16/BF16 weights' prompts, give these bits); off
#: (``LAZYGGML_LLAMAFILE=0``), every product is GGML's vec_dot order, as GGML built alone
#: (ggml-python) computes. Read when a graph's plan is made.
LLAMAFILE = debug.flag("LAZYGGML_LLAMAFILE")


# =================================================================================================
# njit drivers
# =================================================================================================

@_kernel
def _quantize_rows(vtid, x4, xflat, yq, rs, bsz, r0, r1, tmp, rowbuf):
    """Quantize activation rows r0..r1 (flattened over i3, i2, i1) into yq, rs bytes per row.

    The blocks of a batch's ne11 columns are interleaved (block-major): column c's block i lands
    at batch_base + (i*ne11 + c)*bsz, so the kernels that walk block i of a tile of columns read
    one contiguous stretch of memory (hardware prefetchers follow it; 16 separate column streams
    they follow less well). The rows are quantized into ``rowbuf`` ((r1 - r0) * rs bytes) and
    their blocks moved into place: for a contiguous x (``xflat``, its elements in order) all of
    them in one call (rows are whole blocks: the bytes are those of row by row; a call per row
    took ~40% longer for rows of 256 to 768); for a strided x (``xflat`` empty) row by row, each
    first copied into the contiguous ``tmp``, so it costs one gather, not a recompile."""
    ne12, ne11, ne10 = x4.shape[1], x4.shape[2], x4.shape[3]
    if xflat.size and rs == bsz:
        # rows of one block: block-major is row-major, quantized in place (moving 128 rows of
        # 256 values cost ~15 µs on top of their ~26 µs quantization)
        D.from_float(vtid, xflat[r0 * ne10:r1 * ne10], yq[r0 * rs:r1 * rs])
        return
    if xflat.size:
        D.from_float(vtid, xflat[r0 * ne10:r1 * ne10], rowbuf[:(r1 - r0) * rs])
    for r in range(r0, r1):
        i1 = r % ne11
        src = (r - r0) * rs
        if not xflat.size:
            i2 = (r // ne11) % ne12
            i3 = r // (ne11 * ne12)
            tmp[:] = x4[i3, i2, i1, :]
            D.from_float(vtid, tmp, rowbuf[src:src + rs])
        base = (r - i1) * rs + i1 * bsz
        for i in range(rs // bsz):
            o = base + i * ne11 * bsz
            yq[o:o + bsz] = rowbuf[src + i * bsz:src + (i + 1) * bsz]


@parallel_kernel
def _quantize_acts_chunk(c, nc, vtid, x4, xflat, yq, rs, bsz, tmp, rowbuf):
    """Chunk c of nc of ``_quantize_acts``, in row c of ``tmp`` / ``rowbuf`` (room for ceil(rows /
    nc) quantized rows)."""
    nrows = x4.shape[0] * x4.shape[1] * x4.shape[2]
    _quantize_rows(vtid, x4, xflat, yq, rs, bsz, c * nrows // nc, (c + 1) * nrows // nc, tmp[c], rowbuf[c])


@_kernel
def _quantize_acts(vtid, x4, xflat, yq, rs, bsz):
    nrows = x4.shape[0] * x4.shape[1] * x4.shape[2]
    _quantize_rows(vtid, x4, xflat, yq, rs, bsz, 0, nrows, np.empty(x4.shape[3], np.float32),
                   np.empty(nrows * rs, np.uint8))


@_kernel
def _task_geometry(t, w4, dst, RT, CT):
    """Task t -> (weight batch indices, dst batch indices, rows r0..r1, columns c0..c0+nc).
    Row tiles vary fastest, so tasks taken in a row share a column tile (L2 reuse)."""
    ne03, ne02, ne01 = w4.shape[0], w4.shape[1], w4.shape[2]
    ne13, ne12, ne11 = dst.shape[0], dst.shape[1], dst.shape[2]
    nrt = (ne01 + RT - 1) // RT
    nct = (ne11 + CT - 1) // CT
    rt = t % nrt
    u = t // nrt
    c0 = (u % nct) * CT
    b = u // nct
    i2 = b % ne12
    i3 = b // ne12
    return (i3 // (ne13 // ne03), i2 // (ne12 // ne02), i3, i2, rt * RT, min(ne01, rt * RT + RT),
            c0, min(CT, ne11 - c0))


@_kernel
def _n_tasks(w4, dst, RT, CT):
    return (dst.shape[0] * dst.shape[1] * ((w4.shape[2] + RT - 1) // RT)
            * ((dst.shape[2] + CT - 1) // CT))


# ---- quantized weights with a SIMD kernel ---------------------------------------------------------

# The orders a quantized product can take (``mul_mat_steps`` picks one per product, as GGML would)
PATH_VEC_DOT, PATH_TILED, PATH_REPACK = 0, 1, 2


@njit(inline="always")
def dot_rows_path(kid, path, n, w4, j3, j2, r0, r1, y, yo, dst, i3, i2, c):
    """``dispatch.dot_rows`` in the order ``path`` (a repacked weight's: ``repack_rows``); mul_mat_id's too."""
    if path == PATH_REPACK:
        D.repack_rows(kid, n, w4, j3, j2, r0, r1, y, yo, dst, i3, i2, c)
    else:
        D.dot_rows(kid, n, w4, j3, j2, r0, r1, y, yo, dst, i3, i2, c)


@_kernel
def _task_fast(kid, path, n, w4, yq, rs, bsz, dst, t, RT, CT, acc, tmp):
    """One task of a SIMD type; yq is block-major (see _quantize_rows). ``kid`` is the weight's
    type id, for the generated switches of ``dispatch`` (inlined here); ``path`` the order."""
    j3, j2, i3, i2, r0, r1, c0, nc = _task_geometry(t, w4, dst, RT, CT)
    ne11 = dst.shape[2]
    yo = (i3 * dst.shape[1] + i2) * ne11 * rs + c0 * bsz
    if ne11 == 1:
        # a single column (decode): the register-only kernel, contiguous blocks, row by row
        dot_rows_path(kid, path, n, w4, j3, j2, r0, r1, yq, yo, dst, i3, i2, c0)
        return
    if path == PATH_TILED:
        D.tiled_tile(kid, n, w4, j3, j2, r0, r1, yq, yo, bsz, ne11 * bsz, nc, acc, tmp, dst, i3, i2, c0)
    elif path == PATH_REPACK:
        # the batch's first ne11 - ne11 % 4 columns go through GGML's gemm (none of 2 or 3)
        ngemm = min(max(ne11 - ne11 % 4 - c0, 0), nc)
        D.repack_tile(kid, n, w4, j3, j2, r0, r1, yq, yo, bsz, ne11 * bsz, nc, ngemm, acc, tmp, dst, i3, i2, c0)
    else:
        D.dot_tile(kid, n, w4, j3, j2, r0, r1, yq, yo, bsz, ne11 * bsz, nc, acc, tmp, dst, i3, i2, c0)


@parallel_kernel
def _tasks_chunk(c, nc, kid, path, n, w4, yq, rs, bsz, dst, RT, CT, acc, tmp):
    """Chunk c of nc of the tasks (a run of consecutive tasks, which share their column tile), in
    row c of ``acc`` / ``tmp``."""
    for t in chunk(_n_tasks(w4, dst, RT, CT), c, nc):
        _task_fast(kid, path, n, w4, yq, rs, bsz, dst, t, RT, CT, acc[c], tmp[c])


# A single activation column (decode) runs on the CPU backend's own thread pool (pool.py), its rows
# in chunks: a pool job costs ~0.5 µs where an OpenMP region costs ~3, so products of 256 rows
# gain from two threads too (3.7M model, 2 threads, weights in cache: 768x256 Q4_K 9.4 -> 5.9 µs,
# 256x768 8.4 -> 5.2, 256x256 3.6 -> 2.9, 128x256 2.0 -> 2.1: left on one thread, see Thresholds.pool_macs).
# The column is quantized by the product's own call: one call, and one set of arguments for
# Python to pass, per product instead of two (a call costs ~0.3 µs, each array argument ~0.1 µs
# more). The products after it with the same column (K then V and Q; FFN gate then up) find it
# quantized (the plan's scope) and run ``_rows_chunk.run`` alone.

@parallel_kernel
def _rows_chunk(c, nc, kid, path, n, w4, yq, rs, dst):
    """Chunk c of nc of a single column's product: its share of the rows of every batch, in one
    ``dispatch.dot_rows`` (``repack_rows``) call per batch."""
    ne13, ne12, ne01 = dst.shape[0], dst.shape[1], w4.shape[2]
    total = ne13 * ne12 * ne01
    lo, hi = c * total // nc, (c + 1) * total // nc
    while lo < hi:
        b, r0 = lo // ne01, lo % ne01
        r1 = min(ne01, r0 + hi - lo)
        i3, i2 = b // ne12, b % ne12
        dot_rows_path(kid, path, n, w4, i3 // (ne13 // w4.shape[0]), i2 // (ne12 // w4.shape[1]), r0, r1,
                      yq, (i3 * ne12 + i2) * rs, dst, i3, i2, 0)
        lo += r1 - r0


@_kernel
def _matvec(vtid, x4, xflat, kid, path, n, w4, yq, rs, bsz, dst, state, nc):
    """The column quantized, then its rows in ``nc`` chunks on the pool (one chunk: this thread)."""
    _quantize_acts(vtid, x4, xflat, yq, rs, bsz)
    pool.parallel_for(state, _rows_chunk, nc, (kid, path, n, w4, yq, rs, dst))


# ---- float weights --------------------------------------------------------------------------------

@_kernel
def dot_rows_float(kind, n, w, r0, r1, xf, yo, out):
    """Rows r0..r1 of the float weight matrix ``w`` (element kind ``kind``) each dotted with the
    float32 column at byte ``yo`` of ``xf`` into ``out[r]``, two rows at a time (``dot_pair_*``;
    an odd last row is paired with itself and the repeat dropped). mul_mat_id's too."""
    for r in range(r0, r1, 2):
        xa, xb = w[r], w[min(r + 1, r1 - 1)]
        if kind == KIND_F32:
            s = type_float.dot_pair_f32(n, xa, xb, xf, yo)
        elif kind == KIND_F16:
            s = type_float.dot_pair_f16(n, xa, xb, xf, yo)
        else:
            s = type_float.dot_pair_bf16(n, xa, xb, xf, yo)
        out[r] = s[0]
        if r + 1 < r1:
            out[r + 1] = s[3]


@_kernel
def _task_float(kind, n, w4, xf, dst, t, RT, CT, sgemm):
    """One task of float weights: a single column two rows at a time (``dot_rows_float``), more
    columns in tiles of 2 rows × 3 columns (``dot_tile_*``, or ``dot_sgemm_*`` in llamafile's
    order when ``sgemm``); at the edges a tile repeats its last row or column and drops the
    repeats."""
    j3, j2, i3, i2, r0, r1, c0, nc = _task_geometry(t, w4, dst, RT, CT)
    ycs = 4 * n
    yo = ((i3 * dst.shape[1] + i2) * dst.shape[2] + c0) * ycs
    if dst.shape[2] == 1:
        dot_rows_float(kind, n, w4[j3, j2], r0, r1, xf, yo, dst[i3, i2, c0])
        return
    for r in range(r0, r1, 2):
        xa, xb = w4[j3, j2, r], w4[j3, j2, min(r + 1, r1 - 1)]
        for c in range(0, nc, 3):
            ya, yb, yc = yo + c * ycs, yo + min(c + 1, nc - 1) * ycs, yo + min(c + 2, nc - 1) * ycs
            if sgemm:
                if kind == KIND_F32:
                    s = type_float.dot_sgemm_f32(n, xa, xb, xf, ya, yb, yc)
                elif kind == KIND_F16:
                    s = type_float.dot_sgemm_f16(n, xa, xb, xf, ya, yb, yc)
                else:
                    s = type_float.dot_sgemm_bf16(n, xa, xb, xf, ya, yb, yc)
            elif kind == KIND_F32:
                s = type_float.dot_tile_f32(n, xa, xb, xf, ya, yb, yc)
            elif kind == KIND_F16:
                s = type_float.dot_tile_f16(n, xa, xb, xf, ya, yb, yc)
            else:
                s = type_float.dot_tile_bf16(n, xa, xb, xf, ya, yb, yc)
            for k in range(min(3, nc - c)):
                dst[i3, i2, c0 + c + k, r] = s[k]
                if r + 1 < r1:
                    dst[i3, i2, c0 + c + k, r + 1] = s[3 + k]


@parallel_kernel
def _float_chunk(c, nc, kind, n, w4, xf, dst, RT, CT, sgemm):
    for t in chunk(_n_tasks(w4, dst, RT, CT), c, nc):
        _task_float(kind, n, w4, xf, dst, t, RT, CT, sgemm)


# =================================================================================================
# Python entry point
# =================================================================================================

_tls = threading.local()
_STRIDED = np.empty(0, np.float32)   # xflat of an x whose rows are not one contiguous run


def scratch(name, nbytes):
    """A reusable per-Python-thread byte buffer (fresh allocations would page-fault every call).
    A plan keeps the one it was made with, so a later, larger request never pulls it away."""
    buf = getattr(_tls, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 16), np.uint8)
        setattr(_tls, name, buf)
    return buf[:nbytes]


def thread_scratch(name, nth, n, dtype):
    """``scratch`` as ``nth`` rows of ``n`` elements, one per thread of a parallel kernel. Passed
    in rather than allocated inside the region: an allocation there cost ~1 µs a region (the
    task counter's alone), a tenth of a small mat-vec."""
    return scratch(name, nth * n * np.dtype(dtype).itemsize).view(dtype).reshape(nth, n)


@_kernel
def round_acts(kind, x4, xf):
    """xf = x4 rounded to F16 (kind 1) or BF16 (kind 2) and back: GGML's vec_dot_type for those
    weights is the weight type (F16 as GGML_CPU_FP32_TO_FP16, BF16 as ggml_compute_fp32_to_bf16)."""
    n3, n2, n1, n0 = x4.shape
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = unravel_row(r, n1, n2)
        for i0 in range(n0):
            xf[i3, i2, i1, i0] = to_f32(from_f32(x4[i3, i2, i1, i0], kind), kind)


def pool_chunks(macs, rows, params):
    """Chunks of a single column's product of ``rows`` weight rows on the pool: none to share
    below ``params.thresholds.pool_macs`` multiply-adds (one: the caller's thread), else
    POOL_CHUNKS_PER_THREAD per thread of at least POOL_MIN_ROWS rows."""
    if params.nth == 1 or macs < params.thresholds.pool_macs:
        return 1
    return max(1, min(POOL_CHUNKS_PER_THREAD * params.nth, rows // POOL_MIN_ROWS))


def tiles(ne01, ne11, nth):
    """(RT, CT) for a product with ne01 weight rows and ne11 columns on nth threads."""
    if ne11 <= DECODE_MAX_COLS:
        rt = -(-ne01 // (DECODE_TASKS_PER_THREAD * nth))
        return min(max(rt, DECODE_RT_MIN), DECODE_RT_MAX, ne01), ne11
    return min(PREFILL_RT, ne01), PREFILL_CT


def mul_mat(w, wtype, x, dst, repacked=False, params=None):
    """dst = GGML mul_mat(w, x); see the module docstring for shapes. Returns dst. Outside a plan
    (benchmarks, tests), ``params`` defaults to Numba's thread count, as a Numba user sets it."""
    params = params or ComputeParams(numba.get_num_threads())
    for kernel, args in mul_mat_steps(w, wtype, x, dst, params, repacked):
        kernel(*args)
    return dst


def quant_path(wtype, ne11, repacked):
    """The order GGML computes a product of ``ne11`` columns of ``wtype`` weights in: its repacked
    kernels' where the weight is in a CPU_REPACK buffer (``repacked``), its tiled matmul's for 8
    columns or more of the types it takes (``tiled.TILED``), else vec_dot's."""
    traits = TYPE_TRAITS_CPU[wtype]
    if repacked and traits.repack_dot is not None:
        return PATH_REPACK
    if tiled.TILED and ne11 >= tiled.TILED_MIN_COLS and traits.tiled_cols is not None:
        return PATH_TILED
    return PATH_VEC_DOT


def mul_mat_steps(w, wtype, x, dst, params, repacked=False):
    """The kernel calls ``[(kernel, args)]`` that compute ``mul_mat(w, x)`` into dst for a plan's
    ``params`` (``params.py``: its threads, pool, thresholds and scope): the arguments are checked
    and built here once, so that a plan can replay them.
    ``repacked``: the weight is in a CPU_REPACK buffer (``repack.py``)."""
    wtype = as_type(wtype)
    if wtype not in SUPPORTED_TYPES:
        raise NotImplementedError(f"mul_mat: no CPU kernel for {wtype.name} weights")
    if w.ndim != 4 or x.ndim != 4 or dst.ndim != 4:
        raise ValueError("mul_mat: w, x and dst must be 4-D")
    ne03, ne02, ne01 = w.shape[:3]
    ne13, ne12, ne11, ne10 = x.shape
    if dst.shape != (ne13, ne12, ne11, ne01):
        raise ValueError(f"mul_mat: dst has shape {dst.shape}, expected {(ne13, ne12, ne11, ne01)}")
    if ne12 % ne02 or ne13 % ne03:
        raise ValueError(f"mul_mat: batch dims {x.shape[:2]} are not multiples of {w.shape[:2]}")
    if dst.dtype != np.float32 or not dst.flags.c_contiguous:
        raise ValueError("mul_mat: dst must be C-contiguous float32")
    if x.dtype != np.float32:
        raise ValueError("mul_mat: x must be float32")
    if dst.size == 0:
        return []
    if ne10 == 0:
        return [(dst.fill, (0,))]

    nth = params.nth
    RT, CT = tiles(ne01, ne11, nth)
    macs = ne01 * ne10 * ne11 * ne12 * ne13
    limits = params.thresholds
    parallel = macs >= (limits.float_macs if wtype in FLOAT_TYPES else limits.macs) and nth > 1
    nrows_x = ne11 * ne12 * ne13

    if wtype in FLOAT_TYPES:
        steps = []
        # llamafile's sgemm, where GGML would call it (llamafile_sgemm: n >= 2, k % 8 == 0, m % 4 == 0;
        # F32 only on a contiguous src1, F16/BF16 on src1 converted to their type)
        sgemm = LLAMAFILE and ne11 >= 2 and ne10 % 8 == 0 and ne01 % 4 == 0 and (
            wtype != Type.F32 or x.flags.c_contiguous)
        if wtype == Type.F32:
            if w.dtype != np.float32:
                raise ValueError("mul_mat: F32 weights must be float32")
            xf = x
            if not x.flags.c_contiguous:
                xf = scratch("xf", 4 * x.size).view(np.float32).reshape(x.shape)
                steps.append((np.copyto, (xf, x)))
        else:
            if w.dtype == np.float16:
                w = w.view(np.uint16)
            if w.dtype != np.uint16:
                raise ValueError(f"mul_mat: {wtype.name} weights must be float16 or uint16")
            xf = scratch("xf", 4 * x.size).view(np.float32).reshape(x.shape)
            steps.append((round_acts, (KIND[wtype], x, xf)))
        if w.shape[3] != ne10 or w.strides[3] != w.itemsize:
            raise ValueError(f"mul_mat: weight rows must be {ne10} contiguous elements")
        nc = min(_n_tasks(w, dst, RT, CT), PREFILL_CHUNKS_PER_THREAD * nth) if parallel else 1
        steps.append(params.step(_float_chunk, nc, KIND[wtype], ne10, w, xf.reshape(-1), dst, RT, CT, sgemm))
        return steps

    if w.dtype != np.uint8 or w.shape[3] != row_size(wtype, ne10) or w.strides[3] != 1:
        raise ValueError(f"mul_mat: {wtype.name} weights must be uint8 rows of "
                         f"{row_size(wtype, ne10)} contiguous bytes")
    vt = TYPE_TRAITS_CPU[wtype].vec_dot_type
    rs = row_size(vt, ne10)
    bsz = type_size(vt)
    yq = scratch("yq", rs * nrows_x)
    xflat = x.reshape(-1) if x.flags.c_contiguous else _STRIDED   # see _quantize_rows
    scope = params.scope
    # products with the same input one after the other (Q, K and V; FFN gate and up) quantize it once
    key = (address(yq), yq.size, int(vt), address(x), x.shape, x.strides)
    done = scope.get("yq", key)
    path = quant_path(wtype, ne11, repacked)
    if nrows_x == 1:   # a single column (decode): on the pool, quantized by the product's own call
        rows = (int(wtype), path, ne10, w, yq, rs, dst, params.pool.state,
                pool_chunks(macs, ne01 * ne12 * ne13, params))
        if done:
            return [(_rows_chunk.run, rows[7:] + rows[:7])]
        scope.put("yq", key, (x,))
        return [(_matvec, (int(vt), x, xflat) + rows[:5] + (rs, bsz) + rows[6:])]
    # pool jobs (one chunk: on this thread), each chunk with its row of scratch
    nc = min(_n_tasks(w, dst, RT, CT), PREFILL_CHUNKS_PER_THREAD * nth) if parallel else 1
    qc = min(nrows_x, PREFILL_CHUNKS_PER_THREAD * nth) if parallel else 1
    steps = [] if done else [params.step(_quantize_acts_chunk, qc, int(vt), x, xflat, yq, rs, bsz,
                                         thread_scratch("qtmp", qc, ne10, np.float32),
                                         thread_scratch("qrow", qc, -(-nrows_x // qc) * rs, np.uint8))]
    if steps:
        scope.put("yq", key, (x,))
    steps.append(params.step(_tasks_chunk, nc, int(wtype), path, ne10, w, yq, rs, bsz, dst, RT, CT,
                             thread_scratch("acc", nc, type_common.acc_floats(ne10, CT), np.float32),
                             thread_scratch("tmp", nc, 2 * CT, np.float32)))
    return steps


# the cache of every driver above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, *D.KERNEL_FILES, D.__file__, common.__file__, pool.__file__, __file__)


def _mul_mat_supported(node):
    a, b = node.src[0], node.src[1]
    return (a.type in SUPPORTED_TYPES and b.type == Type.F32 and node.type == Type.F32
            and a.nb[0] == type_size(a.type))


@forward(Op.MUL_MAT, supports=_mul_mat_supported)
def _forward_mul_mat(node, dst, srcs, params):
    return mul_mat_steps(srcs[0], node.src[0].type, srcs[1], dst, params,
                         repack.is_repacked(node.src[0]))
