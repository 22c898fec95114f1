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
from .simd import (bcast_half, bcast_pair, dot4_acc, fma, hsum_i32, lane, load_f32, load_f32x8,
                   load_i8x32, load_i16x16, load_u16, madd, splat_f32x8, splat_i32x8, store_f32x8, to_f32, vabs,
                   vadd, vmul, vsign)
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
def _q4_K_row(n, x, y, yo, ycs, ybs, nc, ngemm, acc, out):
    """A repacked Q4_K row against nc columns, the columns' min table (``type_k._k4_min_table``) in
    acc: the first ``ngemm`` in ``ggml_gemm_q4_K_8x8_q8_K``'s order, the rest in the gemv's. The
    gemm's columns go 8 at a time as GGML's kernel does them (a vector lane per column): their 64-value
    parts' sums (each summed and converted on its own, then side by side in scratch), their min parts
    from the table, then one FMA per chain for all 8. A column's chains A and M wait in acc[c] and
    acc[nc + c]."""
    ng = nc // 8                      # the table's groups
    gemm_groups = min(ngemm, nc) // 8
    tb = 4 * type_common.ACC_PER_COL * nc
    sp = 2 * nc                       # scratch: 4 x 8 part sums of a group
    acc[:2 * nc] = 0
    for i in range(n // QK_K):
        xb = i * Q4_K_SIZE
        xd, xdmin, ms, mins = type_k._k4_head(x, xb)
        l0, h0, l1, h1, l2, h2, l3, h3 = type_k._q4_K_unpack(x, xb)
        sc = bcast_half(ms, 0)
        for g in range(gemm_groups):
            yb = yo + 8 * g * ycs + i * ybs
            for k in range(8):   # each column's 4 part sums, as float32, side by side in scratch at acc[2nc:]
                p0, p1, p2, p3 = type_k._k4_sumi_parts(y, yb + k * ycs, l0, h0, l1, h1, l2, h2, l3, h3, sc)
                acc[sp + k] = np.float32(hsum_i32(p0))
                acc[sp + 8 + k] = np.float32(hsum_i32(p1))
                acc[sp + 16 + k] = np.float32(hsum_i32(p2))
                acc[sp + 24 + k] = np.float32(hsum_i32(p3))
            t = tb + type_common.K4_TABLE_BYTES * (i * ng + g)
            d8 = load_f32x8(acc, t + 128)
            dd, dm = vmul(splat_f32x8(xd), d8), vmul(splat_f32x8(xdmin), d8)
            a, m = load_f32x8(acc, 32 * g), load_f32x8(acc, 4 * nc + 32 * g)
            a = fma(load_f32x8(acc, 4 * sp), dd, a)
            m = fma(to_f32(madd(bcast_pair(mins, 0), load_i16x16(acc, t))), dm, m)
            a = fma(load_f32x8(acc, 4 * sp + 32), dd, a)
            m = fma(to_f32(madd(bcast_pair(mins, 1), load_i16x16(acc, t + 32))), dm, m)
            a = fma(load_f32x8(acc, 4 * sp + 64), dd, a)
            m = fma(to_f32(madd(bcast_pair(mins, 2), load_i16x16(acc, t + 64))), dm, m)
            a = fma(load_f32x8(acc, 4 * sp + 96), dd, a)
            m = fma(to_f32(madd(bcast_pair(mins, 3), load_i16x16(acc, t + 96))), dm, m)
            store_f32x8(acc, 32 * g, a)
            store_f32x8(acc, 4 * nc + 32 * g, m)
        for c in range(8 * gemm_groups, nc):
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
