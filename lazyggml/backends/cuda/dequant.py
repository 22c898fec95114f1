"""Quantized blocks to floats (docs/quant-formats.md §1 and §3), and the kernel that dequantizes rows.

Each type's function ``_q*(u8, h, B, j)`` (``DEQUANTIZE[type]``) returns value ``j`` of the block
whose first byte is ``B``, reading quants through a ``uint8`` view and fp16 scales through a
``float16`` view of the same bytes (every block starts at an even byte, so ``B/2`` indexes its
first half). ``rows_kernel(type)`` compiles, per type, the kernel that serves both ``get_rows`` on
quantized tables and the dequantize-then-GEMM path that mul_mat takes for quantized types without
an mmq kernel (GGML's cuBLAS fallback, ``dequantize_block_*``). A thread takes a run of
``DQ_RUN`` = 8 values of one block (every block size is a multiple of 8): the run's scales are
loaded once for its 8 values, and the thread's setup is paid once per 8 (one value per thread ran
at 0.36 TB/s on an H200).
The float order is GGML's CPU one (``dequantize_row_*``): ``(d·sc)·q − dmin·m`` for Q4_K, Q5_K
and Q2_K, ``(d·sc)·(q−32)`` for Q6_K, ``(d·(sc−32))·q`` for Q3_K, ``q·d (+ m)`` for the
32-element types, ``d·level`` and ``(d·(ls−32))·level`` for IQ4_NL and IQ4_XS. Every quantized
type lazyggml reads has a function here, so every one runs mul_mat (dequantized, where mmvq/mmq
have no kernel for it) and get_rows on the GPU.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ...types import KVALUES_IQ4NL, Type, blck_size, type_size
from .common import F32_ZERO, device, jit_kernel, plane
from .elementwise import BLOCK, grid_rows

DQ_RUN = 8
KVALUES = KVALUES_IQ4NL   # a global array: numba puts it in the kernels' constant memory


@device
def _scale_min_k4(u8, B, s):
    """get_scale_min_k4 (docs/quant-formats.md §2): 6-bit scale and min of sub-block s from the 12
    bytes at B+4 (Q4_K and Q5_K)."""
    if s < 4:
        return np.int32(u8[B + 4 + s]) & 63, np.int32(u8[B + 8 + s]) & 63
    return ((np.int32(u8[B + 8 + s]) & 0xF) | ((np.int32(u8[B + s]) >> 6) << 4),
            (np.int32(u8[B + 8 + s]) >> 4) | ((np.int32(u8[B + 4 + s]) >> 6) << 4))


@device
def _q4_K(u8, h, B, j):
    c = j // 64
    l = j % 64
    s = 2 * c + l // 32
    b = np.int32(u8[B + 16 + 32 * c + l % 32])
    q = (b & 0xF) if l < 32 else (b >> 4)
    sc, m = _scale_min_k4(u8, B, s)
    d = np.float32(h[B // 2]) * np.float32(sc)
    dm = np.float32(h[B // 2 + 1]) * np.float32(m)
    return d * np.float32(q) - dm


@device
def _q5_K(u8, h, B, j):
    """Q4_K's nibble (qs at B+48) plus 16 · bit s of qh[j % 32] (qh at B+16), s the sub-block."""
    c = j // 64
    l = j % 64
    s = 2 * c + l // 32
    b = np.int32(u8[B + 48 + 32 * c + l % 32])
    q = ((b & 0xF) if l < 32 else (b >> 4)) | (((np.int32(u8[B + 16 + l % 32]) >> s) & 1) << 4)
    sc, m = _scale_min_k4(u8, B, s)
    d = np.float32(h[B // 2]) * np.float32(sc)
    dm = np.float32(h[B // 2 + 1]) * np.float32(m)
    return d * np.float32(q) - dm


@device
def _nibble(u8, qs, j):
    """Element j of a 32-element block's 16 quant bytes at ``qs``: low nibbles first, then high."""
    b = np.int32(u8[qs + j % 16])
    return (b & 0xF) if j < 16 else (b >> 4)


@device
def _fifth_bit(u8, qh, j):
    """Bit j of the little-endian 32-bit ``qh`` at byte ``qh``, as 16 or 0."""
    return ((np.int32(u8[qh + j // 8]) >> (j % 8)) & 1) << 4


@device
def _q4_0(u8, h, B, j):
    return np.float32(_nibble(u8, B + 2, j) - 8) * np.float32(h[B // 2])


@device
def _q4_1(u8, h, B, j):
    return np.float32(_nibble(u8, B + 4, j)) * np.float32(h[B // 2]) + np.float32(h[B // 2 + 1])


@device
def _q5_0(u8, h, B, j):
    return np.float32((_nibble(u8, B + 6, j) | _fifth_bit(u8, B + 2, j)) - 16) * np.float32(h[B // 2])


@device
def _q5_1(u8, h, B, j):
    q = _nibble(u8, B + 8, j) | _fifth_bit(u8, B + 4, j)
    return np.float32(q) * np.float32(h[B // 2]) + np.float32(h[B // 2 + 1])


@device
def _q2_K(u8, h, B, j):
    """Half n = j/128, run k = (j%128)/32, position l = j%32: bits 2k of qs[32n + l] (qs at B+16),
    sub-block 8n + 2k + l/16, whose byte at B holds its scale (low nibble) and min (high)."""
    n = j // 128
    k = (j % 128) // 32
    l = j % 32
    q = (np.int32(u8[B + 16 + 32 * n + l]) >> (2 * k)) & 3
    sm = np.int32(u8[B + 8 * n + 2 * k + l // 16])
    dl = np.float32(h[B // 2 + 40]) * np.float32(sm & 0xF)
    ml = np.float32(h[B // 2 + 41]) * np.float32(sm >> 4)
    return dl * np.float32(q) - ml


@device
def _q3_K(u8, h, B, j):
    """As Q2_K's crumbs (qs at B+32), minus 4 where bit 4n + k of hmask[l] (at B) is clear; the
    sub-block's 6-bit scale minus 32: low 4 bits are nibble s%8 of bytes B+96.. (low nibbles of
    the 8 bytes first), the top 2 bits are bits 2·(s/4) of byte B+104 + s%4."""
    n = j // 128
    k = (j % 128) // 32
    l = j % 32
    q = (np.int32(u8[B + 32 + 32 * n + l]) >> (2 * k)) & 3
    if not (np.int32(u8[B + l]) >> (4 * n + k)) & 1:
        q -= 4
    s = 8 * n + 2 * k + l // 16
    lo = np.int32(u8[B + 96 + s % 8])
    lo = (lo & 0xF) if s < 8 else (lo >> 4)
    sc = lo | (((np.int32(u8[B + 104 + s % 4]) >> (2 * (s // 4))) & 3) << 4)
    return np.float32(h[B // 2 + 54]) * np.float32(sc - 32) * np.float32(q)


@device
def _q6_K(u8, h, B, j):
    n = j // 128
    part = (j % 128) // 32           # which of the four 32-value runs of this half
    l = j % 32
    ql = np.int32(u8[B + 64 * n + l + 32 * (part % 2)])
    nib = (ql & 0xF) if part < 2 else (ql >> 4)
    hi = (np.int32(u8[B + 128 + 32 * n + l]) >> (2 * part)) & 3
    sc = np.int32(u8[B + 192 + 8 * n + 2 * part + l // 16])
    sc = sc - 256 if sc > 127 else sc
    return np.float32(h[B // 2 + 104]) * np.float32(sc) * np.float32((nib | (hi << 4)) - 32)


@device
def _q8_0(u8, h, B, j):
    q = np.int32(u8[B + 2 + j])
    q = q - 256 if q > 127 else q
    return np.float32(h[B // 2]) * np.float32(q)


@device
def _iq4_nl(u8, h, B, j):
    """The level of index j (nibbles at B+2) times d."""
    return np.float32(h[B // 2]) * np.float32(KVALUES[_nibble(u8, B + 2, j)])


@device
def _iq4_xs(u8, h, B, j):
    """Sub-block ib = j/32: its 6-bit scale (low 4 bits: nibble ib%2 of byte B+4+ib/2; high 2:
    bits 2·ib of the 16-bit scales_h at B+2) minus 32, times d, times the level (nibbles at
    B+8+16·ib)."""
    ib = j // 32
    sh = np.int32(u8[B + 2]) | (np.int32(u8[B + 3]) << 8)
    ls = ((np.int32(u8[B + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
    dl = np.float32(h[B // 2]) * np.float32(ls - 32)
    return dl * np.float32(KVALUES[_nibble(u8, B + 8 + 16 * ib, j % 32)])


DEQUANTIZE = {Type.Q4_0: _q4_0, Type.Q4_1: _q4_1, Type.Q5_0: _q5_0, Type.Q5_1: _q5_1, Type.Q8_0: _q8_0,
              Type.Q2_K: _q2_K, Type.Q3_K: _q3_K, Type.Q4_K: _q4_K, Type.Q5_K: _q5_K, Type.Q6_K: _q6_K,
              Type.IQ4_NL: _iq4_nl, Type.IQ4_XS: _iq4_xs}
QUANT_TYPES = tuple(DEQUANTIZE)


def _make_rows_kernel(value):
    @jit_kernel()
    def dequantize_rows(qsh, bs, u8, h, idx, has_idx, dst, ne0, ne01, ne10, ne11, ne12, nb01, nb02, nb03,
                        si0, si1, si2, sd1, sd2, sd3):
        """Rows of the quantized ``a`` (``ne01`` rows, byte strides nb01..nb03) to F32 or F16
        ``dst`` (element strides sd1..sd3): ``dst[:, i10, i11, i12] = a[:, r, i11, i12]`` with
        ``r = idx[i10, i11, i12]``, or ``r = i10`` without an index; an index outside
        ``[0, ne01)`` gives a row of zeros and reads nothing (``rows.py``). Walked as rows
        (``elementwise.grid_rows`` over runs of 8); ``qsh`` is log2 of the block size, so a
        value's block is a shift."""
        x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        dx = cuda.gridDim.x * cuda.blockDim.x
        qm = (1 << qsh) - 1
        nrun = ne0 // DQ_RUN
        i23 = cuda.blockIdx.z
        while i23 < ne11 * ne12:
            i11, i12 = plane(i23, ne11)
            i10 = cuda.blockIdx.y
            while i10 < ne10:
                r = idx[i10 * si0 + i11 * si1 + i12 * si2] if has_idx else i10
                rd = i10 * sd1 + i11 * sd2 + i12 * sd3
                c = x0
                if r < 0 or r >= ne01:      # an index out of range: a row of zeros, nothing read
                    while c < nrun:
                        for t in range(DQ_RUN):
                            dst[rd + DQ_RUN * c + t] = F32_ZERO
                        c += dx
                else:
                    ra = r * nb01 + i11 * nb02 + i12 * nb03
                    while c < nrun:
                        i0 = DQ_RUN * c
                        B = ra + (i0 >> qsh) * bs
                        j = i0 & qm
                        for t in range(DQ_RUN):
                            dst[rd + i0 + t] = value(u8, h, B, j + t)
                        c += dx
                i10 += cuda.gridDim.y
            i23 += cuda.gridDim.z

    return dequantize_rows


@functools.cache
def rows_kernel(type_):
    """The dequantizing rows kernel of ``type_`` (compiled at its first launch)."""
    return _make_rows_kernel(DEQUANTIZE[type_])


def rows_grid(ne):
    """Blocks for ``rows_kernel`` over an output of shape ``ne``: one thread per run of 8 values."""
    return grid_rows((ne[0] // DQ_RUN, *ne[1:]))


def launch_dequantize(stream, u8, h, dst, t):
    """Dequantize tensor ``t`` (viewed as ``u8``/``h``) into the contiguous F32 or F16 array ``dst``."""
    ne = t.ne
    rows_kernel(t.type)[rows_grid(ne), BLOCK, stream](
        blck_size(t.type).bit_length() - 1, type_size(t.type), u8, h, u8, False, dst, ne[0], ne[1], *ne[1:],
        *t.nb[1:], 0, 0, 0, ne[0], ne[0] * ne[1], ne[0] * ne[1] * ne[2])
