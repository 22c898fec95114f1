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
Q4_K rows in multiples of 8 (``q4_K_8x8_q8_K``). Its kernels (arch/x86/repack.cpp) keep, per
(row, column), two float32 chains, over the super-blocks in order, and return their difference:

    gemv (one column):   A = fma(float(s1),    d·d8, A)     M = fma(float(s2),    dmin·d8, M)
    gemm (4 columns):    the same per 64 values: s1_u, s2_u for sub-block pairs u = 0..3
    result = A − M

with s1 = Σ_s scale_s · Σ q·q8 and s2 = Σ_s min_s · bsum_s exact integers (vec_dot's, whose
``_k4_sumi_parts`` are the pairs). A product of ``ne11`` columns runs its first ``ne11 − ne11 % 4``
through the gemm when ``ne11 > 3`` and the rest through the gemv (``forward_mul_mat_one_chunk``).
Q4_0, IQ4_NL and MXFP4 also have AVX2 kernels in GGML; lazyggml does not follow them yet, so it
leaves those weights in plain buffers (their products then differ from llama.cpp's in the last
bits, as Q4_K's did).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ...buffer import BufferType
from ...cache import tie_cache
from ...ops import Op
from ...types import Type
from . import simd
from . import vec_dot as V
from .simd import bcast_half, hsum_i32, lane, load_f32, vadd
from .vec_dot import QK_K, Q4_K_SIZE, Q8_K_SIZE, _fmaf

_fast = njit(cache=True)

#: the weight types whose repacked kernels lazyggml follows, and the row multiple each needs
REPACK_ROWS = {Type.Q4_K: 8}


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
        """GGML's ``extra_buffer_type::supports_op``: a MUL_MAT of a 2-D weight that ``repack_type``
        takes, with F32 activations in host memory."""
        if op.op != Op.MUL_MAT:
            return False
        w, x = op.src[0], op.src[1]
        return (w.n_dims() == 2 and repack_type(w) and x.type == Type.F32
                and (x.buffer is None or x.buffer.is_host()))


def is_repacked(t):
    """Whether weight ``t`` lives in a CPU_REPACK buffer (its products then run the repacked order)."""
    buf = t.data_buffer() if t.view_src is not None else t.buffer
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
        xd, xdmin, ms, mins = V._k4_head(x, xb)
        l0, h0, l1, h1, l2, h2, l3, h3 = V._q4_K_unpack(x, xb)
        d8 = load_f32(y, yb)
        parts = V._k4_sumi_parts(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, bcast_half(ms, 0))
        a, m = _gemv_block(a, m, xd * d8, xdmin * d8, parts, V._k4_min_prod(mins, y, yb))
    return a - m


@_fast
def repack_cols_q4_K_q8_K(n, x, y, yo, ycs, ybs, nc, ngemm, acc, out):
    """A repacked Q4_K row against nc columns (``dot_cols``' layout): the first ``ngemm`` in
    ``ggml_gemm_q4_K_8x8_q8_K``'s order, the rest in the gemv's. acc: 2 floats a column."""
    acc[:2 * nc] = 0
    for i in range(n // QK_K):
        xb = i * Q4_K_SIZE
        xd, xdmin, ms, mins = V._k4_head(x, xb)
        l0, h0, l1, h1, l2, h2, l3, h3 = V._q4_K_unpack(x, xb)
        sc = bcast_half(ms, 0)
        for c in range(nc):
            yb = yo + c * ycs + i * ybs
            d8 = load_f32(y, yb)
            parts = V._k4_sumi_parts(y, yb, l0, h0, l1, h1, l2, h2, l3, h3, sc)
            mp = V._k4_min_prod(mins, y, yb)
            if c < ngemm:
                a, m = _gemm_block(acc[2 * c], acc[2 * c + 1], xd * d8, xdmin * d8, parts, mp)
            else:
                a, m = _gemv_block(acc[2 * c], acc[2 * c + 1], xd * d8, xdmin * d8, parts, mp)
            acc[2 * c], acc[2 * c + 1] = a, m
    for c in range(nc):
        out[c] = acc[2 * c] - acc[2 * c + 1]


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, V.__file__, __file__)
