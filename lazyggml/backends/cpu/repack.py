"""GGML's CPU_REPACK buffer type: which weights llama.cpp repacks, and the order its kernels add them.

llama.cpp places a weight in the CPU's extra buffer type CPU_REPACK when that type runs the node the
graph makes of it (``ggml-cpu/repack.cpp``: ``extra_buffer_type::supports_op``): a 2-D weight of a
MUL_MAT with F32 activations, of a type and shape that ``ggml_repack_get_optimal_repack_type`` has
a kernel for. There its blocks are interleaved 8 rows at a time and its products run through
``ggml_gemv_*`` / ``ggml_gemm_*`` instead of vec_dot, which add a (row, column) product in their
own order. ``llama_model_params.use_extra_bufts`` (``--no-repack`` off) decides; ggml-python's
GGML, which places tensors in plain CPU buffers, never repacks.

Here a CPU_REPACK buffer is host memory in GGML's block layout (a mapped file's in place): only the
arithmetic follows the repacked kernels, which is what the numbers depend on. The matmul
(``matmul.py``) sees the weight's buffer type and calls the kernels below.

GGML's choice on x86 with AVX2 and without AVX-512 (this module's; others, see ``repack_type``):
Q4_0, Q4_K and IQ4_NL rows in multiples of 8 (``q4_0_8x8_q8_0``, ``q4_K_8x8_q8_K``,
``iq4_nl_8x8_q8_0``; Q4_0 and IQ4_NL below). Q4_K's kernels (arch/x86/repack.cpp) keep, per
(row, column), two float32 chains, over the super-blocks in order, and return their difference:

    gemv (one column):   A = fma(float(s1),    d·d8, A)     M = fma(float(s2),    dmin·d8, M)
    gemm (4 columns):    the same per 64 values: s1_u, s2_u for sub-block pairs u = 0..3
    result = A − M

with s1 = Σ_s scale_s · Σ q·q8 and s2 = Σ_s min_s · bsum_s exact integers (vec_dot's, whose
``_k4_sumi_parts`` are the pairs). A product of ``ne11`` columns runs its first ``ne11 − ne11 % 4``
through the gemm when ``ne11 > 3`` and the rest through the gemv (``forward_mul_mat_one_chunk``).
Here the gemm's columns go 8 or 4 at a time, a vector lane per column, their integer part sums
reduced four at once (``simd.hsum_i32x8_4``): at 4 columns (a decode step of 4 sequences) that is
4 FMAs a block for all 4 chains where one column at a time took 16 lane sums and 32 scalar FMAs.
MXFP4 also has AVX2 kernels in GGML; lazyggml has no MXFP4 type. The experts of a MUL_MAT_ID are
repacked by the same rule (3-D, rows per expert in multiples of 8); GGML multiplies them routed row
by routed row, through the gemv (``forward_mul_mat_id``), and so does ``matmul_id.py``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ...buffer import BufferType
from ... import types
from ...cache import tie_cache
from ...ops import Op
from ...types import QK_K, Type
from . import simd, type_common, type_iq, type_k, type_legacy
from .simd import (bcast_half, bcast_pair, concat, dot4_acc, fma, hsum_i32, hsum_i32x8_4, lane, load_f32,
                   load_f32x4, load_f32x8, load_i8x32, load_i16x16, load_u16, madd, splat_f32x4, splat_f32x8,
                   splat_i32x8, store_f32x4, store_f32x8, to_f32, transpose_i32x4, vabs, vadd, vmul, vsign)
from .type_common import TABLE_F32_F16 as _F16
from .type_common import _fmaf
from .type_k import Q4_K_SIZE, Q8_K_SIZE
from .type_legacy import Q4_0_SIZE, Q8_0_SIZE

_fast = njit(cache=True)

#: the weight types whose repacked kernels lazyggml follows, and the row multiple each needs
REPACK_ROWS = {Type.Q4_0: 8, Type.Q4_K: 8, Type.IQ4_NL: 8}


def repack_type(t):
    """Whether GGML (x86, AVX2) would repack weight ``t``: its type has a repacked kernel here and its
    rows are a multiple of that kernel's interleave (``ggml_repack_get_optimal_repack_type``)."""
    rows = REPACK_ROWS.get(t.type)
    return rows is not None and simd.HAVE_AVX2 and t.ne[1] % rows == 0


class RepackBufferType(BufferType):
    """CPU_REPACK, the CPU device's extra buffer type: host memory, for the weights whose MUL_MAT it
    runs (``supports_op``)."""

    def __init__(self, device):
        super().__init__("CPU_REPACK", device, alignment=32, host=True)

    def supports_op(self, op):
        """GGML's ``extra_buffer_type::supports_op``: a MUL_MAT of a 2-D weight, or a MUL_MAT_ID of
        3-D experts, that ``repack_type`` takes, with F32 activations in host memory."""
        dims = {Op.MUL_MAT: 2, Op.MUL_MAT_ID: 3}.get(op.op)
        if dims is None:
            return False
        w, x = op.src[0], op.src[1]
        return (w.n_dims() == dims and repack_type(w) and x.type == Type.F32
                and (x.buffer is None or x.buffer.is_host()))


def is_repacked(t):
    """Whether weight ``t`` lives in a CPU_REPACK buffer (its products then run the repacked order)."""
    buf = t.data_buffer()
    return buf is not None and isinstance(buf.buft, RepackBufferType)


@njit(inline="always")
def _gemv_block(a, m, dd, dm, parts, mp):
    """One super-block in the gemv's order: its whole s1 and s2."""
    s0, s1, s2, s3 = parts
    a = _fmaf(np.float32(hsum_i32(vadd(vadd(s0, s1), vadd(s2, s3)))), dd, a)
    return a, _fmaf(np.float32(hsum_i32(mp)), dm, m)


@njit(inline="always")
def _gemm_block(a, m, dd, dm, parts, mp):
    """One super-block in the gemm's order: 64 values (a sub-block pair) at a time."""
    s0, s1, s2, s3 = parts
    a = _fmaf(np.float32(hsum_i32(s0)), dd, a)
    m = _fmaf(np.float32(lane(mp, 0)), dm, m)
    a = _fmaf(np.float32(hsum_i32(s1)), dd, a)
    m = _fmaf(np.float32(lane(mp, 1)), dm, m)
    a = _fmaf(np.float32(hsum_i32(s2)), dd, a)
    m = _fmaf(np.float32(lane(mp, 2)), dm, m)
    a = _fmaf(np.float32(hsum_i32(s3)), dd, a)
    return a, _fmaf(np.float32(lane(mp, 3)), dm, m)


@_fast
def repack_dot_q4_K_q8_K(n, x, y, yo):
    """A repacked Q4_K row against one column: ``ggml_gemv_q4_K_8x8_q8_K``'s order."""
    a = m = np.float32(0.0)
    for i in range(n // QK_K):
        xb = i * Q4_K_SIZE
        yb = yo + i * Q8_K_SIZE
        xd, xdmin, ms, mins = type_k._k4_head(x, xb)
        l0, h0, l1, h1, l2, h2, l3, h3 = type_k._q4_K_unpack(x, xb)
        d8 = load_f32(y, yb)
        parts = type_k._k4_sumi_parts(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, bcast_half(ms, 0))
        a, m = _gemv_block(a, m, xd * d8, xdmin * d8, parts, type_k._k4_min_prod(mins, y, yb))
    return a - m


@njit(inline="always")
def _sums4(y, yb, ycs, l0, h0, l1, h1, l2, h2, l3, h3, sc):
    """The part sums (``type_k._k4_sumi_parts``) of one Q4_K block against 4 columns (``ycs`` bytes
    apart from ``yb``), reduced and turned: part u of the 4 columns side by side, for u = 0..3."""
    a0, a1, a2, a3 = type_k._k4_sumi_parts(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, sc)
    s0 = hsum_i32x8_4(a0, a1, a2, a3)
    a0, a1, a2, a3 = type_k._k4_sumi_parts(y, yb + ycs, l0, h0, l1, h1, l2, h2, l3, h3, sc)
    s1 = hsum_i32x8_4(a0, a1, a2, a3)
    a0, a1, a2, a3 = type_k._k4_sumi_parts(y, yb + 2 * ycs, l0, h0, l1, h1, l2, h2, l3, h3, sc)
    s2 = hsum_i32x8_4(a0, a1, a2, a3)
    a0, a1, a2, a3 = type_k._k4_sumi_parts(y, yb + 3 * ycs, l0, h0, l1, h1, l2, h2, l3, h3, sc)
    s3 = hsum_i32x8_4(a0, a1, a2, a3)
    return (transpose_i32x4(0, s0, s1, s2, s3), transpose_i32x4(1, s0, s1, s2, s3),
            transpose_i32x4(2, s0, s1, s2, s3), transpose_i32x4(3, s0, s1, s2, s3))


@njit(inline="always")
def _mins4(mins, y, yb, ycs):
    """``type_k._k4_min_prod`` of 4 columns, turned like ``_sums4``: pair u's min products side by side."""
    m0, m1 = type_k._k4_min_prod(mins, y, yb), type_k._k4_min_prod(mins, y, yb + ycs)
    m2, m3 = type_k._k4_min_prod(mins, y, yb + 2 * ycs), type_k._k4_min_prod(mins, y, yb + 3 * ycs)
    return (transpose_i32x4(0, m0, m1, m2, m3), transpose_i32x4(1, m0, m1, m2, m3),
            transpose_i32x4(2, m0, m1, m2, m3), transpose_i32x4(3, m0, m1, m2, m3))


@njit(inline="always")
def _q4_K_row(n, x, y, yo, ycs, ybs, nc, ngemm, acc, out):
    """A repacked Q4_K row against nc columns, the columns' min table (``type_k._k4_min_table``) in
    acc: the first ``ngemm`` in ``ggml_gemm_q4_K_8x8_q8_K``'s order, the rest in the gemv's. The
    gemm's columns go 8 at a time, then 4, a vector lane per column as GGML's kernel does them: their
    64-value parts' sums (``_sums4``), their min parts (from the table, or ``_mins4`` for the 4),
    then one FMA per chain for all of them. A column's chains A and M wait in acc[c] and acc[nc + c]."""
    ng = nc // 8                      # the table's groups
    nq = min(ngemm, nc) // 4          # the gemm's columns by fours: the table's groups twice, maybe one more
    tb = 4 * type_common.ACC_PER_COL * nc
    sp = 2 * nc                       # scratch: the 4 columns' d8
    acc[:2 * nc] = 0
    for i in range(n // QK_K):
        xb = i * Q4_K_SIZE
        xd, xdmin, ms, mins = type_k._k4_head(x, xb)
        l0, h0, l1, h1, l2, h2, l3, h3 = type_k._q4_K_unpack(x, xb)
        sc = bcast_half(ms, 0)
        for g in range(nq // 2):
            yb = yo + 8 * g * ycs + i * ybs
            u0, u1, u2, u3 = _sums4(y, yb, ycs, l0, h0, l1, h1, l2, h2, l3, h3, sc)
            v0, v1, v2, v3 = _sums4(y, yb + 4 * ycs, ycs, l0, h0, l1, h1, l2, h2, l3, h3, sc)
            t = tb + type_common.K4_TABLE_BYTES * (i * ng + g)
            d8 = load_f32x8(acc, t + 128)
            dd, dm = vmul(splat_f32x8(xd), d8), vmul(splat_f32x8(xdmin), d8)
            a, m = load_f32x8(acc, 32 * g), load_f32x8(acc, 4 * nc + 32 * g)
            a = fma(to_f32(concat(u0, v0)), dd, a)
            m = fma(to_f32(madd(bcast_pair(mins, 0), load_i16x16(acc, t))), dm, m)
            a = fma(to_f32(concat(u1, v1)), dd, a)
            m = fma(to_f32(madd(bcast_pair(mins, 1), load_i16x16(acc, t + 32))), dm, m)
            a = fma(to_f32(concat(u2, v2)), dd, a)
            m = fma(to_f32(madd(bcast_pair(mins, 2), load_i16x16(acc, t + 64))), dm, m)
            a = fma(to_f32(concat(u3, v3)), dd, a)
            m = fma(to_f32(madd(bcast_pair(mins, 3), load_i16x16(acc, t + 96))), dm, m)
            store_f32x8(acc, 32 * g, a)
            store_f32x8(acc, 4 * nc + 32 * g, m)
        if nq % 2:
            c0 = 4 * (nq - 1)
            yb = yo + c0 * ycs + i * ybs
            u0, u1, u2, u3 = _sums4(y, yb, ycs, l0, h0, l1, h1, l2, h2, l3, h3, sc)
            m0, m1, m2, m3 = _mins4(mins, y, yb, ycs)
            for k in range(4):
                acc[sp + k] = load_f32(y, yb + k * ycs)
            d8 = load_f32x4(acc, 4 * sp)
            dd, dm = vmul(splat_f32x4(xd), d8), vmul(splat_f32x4(xdmin), d8)
            a, m = load_f32x4(acc, 4 * c0), load_f32x4(acc, 4 * (nc + c0))
            a = fma(to_f32(u0), dd, a)
            m = fma(to_f32(m0), dm, m)
            a = fma(to_f32(u1), dd, a)
            m = fma(to_f32(m1), dm, m)
            a = fma(to_f32(u2), dd, a)
            m = fma(to_f32(m2), dm, m)
            a = fma(to_f32(u3), dd, a)
            m = fma(to_f32(m3), dm, m)
            store_f32x4(acc, 4 * c0, a)
            store_f32x4(acc, 4 * (nc + c0), m)
        for c in range(4 * nq, nc):
            yb = yo + c * ycs + i * ybs
            d8 = load_f32(y, yb)
            parts = type_k._k4_sumi_parts(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, sc)
            mp = type_k._k4_min_prod(mins, y, yb)
            if c < ngemm:
                a, m = _gemm_block(acc[c], acc[nc + c], xd * d8, xdmin * d8, parts, mp)
            else:
                a, m = _gemv_block(acc[c], acc[nc + c], xd * d8, xdmin * d8, parts, mp)
            acc[c], acc[nc + c] = a, m
    for c in range(nc):
        out[c] = acc[c] - acc[nc + c]


@_fast
def repack_cols_q4_K_q8_K(n, x, y, yo, ycs, ybs, nc, ngemm, acc, out):
    """A repacked Q4_K row against nc columns (``dot_cols``' layout; acc: ``acc_floats(n, nc)``):
    the columns' min table, then the row (``tile_repack_q4_K_q8_K`` makes the table once a tile)."""
    type_k._k4_min_table(n, y, yo, ycs, ybs, nc, acc)
    _q4_K_row(n, x, y, yo, ycs, ybs, nc, ngemm, acc, out)


@_fast
def tile_repack_q4_K_q8_K(n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, ngemm, acc, out, dst, i3, i2, c0):
    """Weight rows r0..r1 of w4[j3, j2] against nc columns into dst[i3, i2, c0:c0 + nc] (the
    ``repack_tile`` switch's parameters): the columns' min table once, then row by row."""
    type_k._k4_min_table(n, y, yo, ycs, ybs, nc, acc)
    for r in range(r0, r1):
        _q4_K_row(n, w4[j3, j2, r], y, yo, ycs, ybs, nc, ngemm, acc, out)
        for k in range(nc):
            dst[i3, i2, c0 + k, r] = out[k]


# ------------------------------------------------------------------------------------------------
# Q4_0 and IQ4_NL (``q4_0_8x8_q8_0``, ``iq4_nl_8x8_q8_0``: ``gemv/gemm_q4_b32_8x8_q8_0_lut_avx``):
# per 32-value block the exact Σ q·q8 (Q4_0: q − 8; IQ4_NL: its level), one float32 chain
# A = fma(float(s), d·d8, A); the gemm's order is the gemv's (one FMA a block either way).
# ------------------------------------------------------------------------------------------------

@njit(inline="always")
def _b32_quants(x, xb, iq4):
    """Block xb of a Q4_0 (``iq4`` False) or IQ4_NL row: its 32 signed quants, their magnitudes, d."""
    q = type_iq._iq4_levels(x, xb + 2) if iq4 else type_legacy._q4_0_unpack(x, xb)
    return q, vabs(q), _F16[load_u16(x, xb)]


@njit(inline="always")
def _b32_step(a, q, aq, xd, y, yb):
    """The chain ``a`` after one block against the Q8_0 block at y[yb]: fma(float(Σ q·q8), d·d8, a)."""
    s = hsum_i32(dot4_acc(splat_i32x8(0), aq, vsign(load_i8x32(y, yb + 2), q)))
    return _fmaf(np.float32(s), xd * _F16[load_u16(y, yb)], a)


@njit(inline="always")
def _b32_dot(n, x, y, yo, iq4):
    a = np.float32(0.0)
    for i in range(n // 32):
        q, aq, xd = _b32_quants(x, i * Q4_0_SIZE, iq4)   # (IQ4_NL's blocks are as long)
        a = _b32_step(a, q, aq, xd, y, yo + i * Q8_0_SIZE)
    return a


@njit(inline="always")
def _b32_cols(n, x, y, yo, ycs, ybs, nc, acc, out, iq4):
    """Against nc columns: each block unpacked once for all of them, column c's chain in acc[c]."""
    acc[:nc] = 0
    for i in range(n // 32):
        q, aq, xd = _b32_quants(x, i * Q4_0_SIZE, iq4)   # (IQ4_NL's blocks are as long)
        for c in range(nc):
            acc[c] = _b32_step(acc[c], q, aq, xd, y, yo + c * ycs + i * ybs)
    out[:nc] = acc[:nc]


@_fast
def repack_dot_q4_0_q8_0(n, x, y, yo):
    """A repacked Q4_0 row against one column (``ggml_gemv_q4_0_8x8_q8_0``'s order)."""
    return _b32_dot(n, x, y, yo, False)


@_fast
def repack_cols_q4_0_q8_0(n, x, y, yo, ycs, ybs, nc, ngemm, acc, out):
    """A repacked Q4_0 row against nc columns: gemm and gemv alike."""
    _b32_cols(n, x, y, yo, ycs, ybs, nc, acc, out, False)


@_fast
def repack_dot_iq4_nl_q8_0(n, x, y, yo):
    """A repacked IQ4_NL row against one column (``ggml_gemv_iq4_nl_8x8_q8_0``'s order)."""
    return _b32_dot(n, x, y, yo, True)


@_fast
def repack_cols_iq4_nl_q8_0(n, x, y, yo, ycs, ybs, nc, ngemm, acc, out):
    """A repacked IQ4_NL row against nc columns: gemm and gemv alike."""
    _b32_cols(n, x, y, yo, ycs, ybs, nc, acc, out, True)


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, type_common.__file__, type_legacy.__file__, type_k.__file__, type_iq.__file__, types.__file__, __file__)
