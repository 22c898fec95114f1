"""Quantized blocks to floats, one value at a time (docs/quant-formats.md §1 and §3), and the kernel that does a tensor.

``dequantize(type, vx, vx_h, B, j)`` returns value ``j`` of the block whose first byte is ``B``,
reading quants through a ``uint8`` view and fp16 scales through a ``float16`` view of the same
bytes (every block starts at an even byte, so ``B/2`` indexes its first half). These serve
``get_rows`` on quantized tables and the dequantize-then-GEMM path that mul_mat takes for
quantized types without an mmq kernel (GGML's cuBLAS fallback, ``dequantize_block_*``).
The float order is GGML's CPU one (``dequantize_row_*``): ``(d·sc)·q − dmin·m`` for Q4_K, Q5_K
and Q2_K, ``(d·sc)·(q−32)`` for Q6_K, ``(d·(sc−32))·q`` for Q3_K, ``q·d (+ m)`` for the
32-element types, ``d·level`` and ``(d·(ls−32))·level`` for IQ4_NL and IQ4_XS. Every quantized
type lazyggml reads has a function here, so every one runs mul_mat (dequantized, where mmvq/mmq
have no kernel for it) and get_rows on the GPU.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...types import KVALUES_IQ4NL, Type, blck_size, type_size
from .common import device, jit_kernel, plane
from .elementwise import BLOCK, grid_rows

T_Q4_K, T_Q6_K, T_Q4_0, T_Q4_1 = int(Type.Q4_K), int(Type.Q6_K), int(Type.Q4_0), int(Type.Q4_1)
T_Q5_0, T_Q5_1, T_Q5_K, T_Q2_K, T_Q3_K = (int(Type.Q5_0), int(Type.Q5_1), int(Type.Q5_K), int(Type.Q2_K),
                                          int(Type.Q3_K))
T_IQ4_NL, T_IQ4_XS = int(Type.IQ4_NL), int(Type.IQ4_XS)
QUANT_TYPES = (Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0, Type.Q2_K, Type.Q3_K, Type.Q4_K,
               Type.Q5_K, Type.Q6_K, Type.IQ4_NL, Type.IQ4_XS)
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


@device
def dequantize(ty, u8, h, B, j):
    """Value ``j`` of the block at byte ``B`` of type id ``ty`` (one of ``QUANT_TYPES``)."""
    if ty == T_Q4_K:
        return _q4_K(u8, h, B, j)
    if ty == T_Q6_K:
        return _q6_K(u8, h, B, j)
    if ty == T_Q5_K:
        return _q5_K(u8, h, B, j)
    if ty == T_Q4_0:
        return _q4_0(u8, h, B, j)
    if ty == T_Q4_1:
        return _q4_1(u8, h, B, j)
    if ty == T_Q5_0:
        return _q5_0(u8, h, B, j)
    if ty == T_Q5_1:
        return _q5_1(u8, h, B, j)
    if ty == T_Q2_K:
        return _q2_K(u8, h, B, j)
    if ty == T_Q3_K:
        return _q3_K(u8, h, B, j)
    if ty == T_IQ4_NL:
        return _iq4_nl(u8, h, B, j)
    if ty == T_IQ4_XS:
        return _iq4_xs(u8, h, B, j)
    return _q8_0(u8, h, B, j)


@jit_kernel()
def dequantize_rows(ty, qsh, bs, u8, h, dst, ne0, ne1, ne2, ne3, nb1, nb2, nb3):
    """A quantized tensor (rows at byte strides nb1..nb3) to a contiguous F32 or F16 one, walked as
    rows (``elementwise.grid_rows``); ``qsh`` is log2 of the block size, so a value's block is a shift."""
    x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    dx = cuda.gridDim.x * cuda.blockDim.x
    qm = (1 << qsh) - 1
    i23 = cuda.blockIdx.z
    while i23 < ne2 * ne3:
        i2, i3 = plane(i23, ne2)
        i1 = cuda.blockIdx.y
        while i1 < ne1:
            rb = i3 * nb3 + i2 * nb2 + i1 * nb1
            rd = (i23 * ne1 + i1) * ne0
            i0 = x0
            while i0 < ne0:
                dst[rd + i0] = dequantize(ty, u8, h, rb + (i0 >> qsh) * bs, i0 & qm)
                i0 += dx
            i1 += cuda.gridDim.y
        i23 += cuda.gridDim.z


def launch_dequantize(stream, u8, h, dst, t):
    """Dequantize tensor ``t`` (viewed as ``u8``/``h``) into the contiguous F32 or F16 array ``dst``."""
    dequantize_rows[grid_rows(t.ne), BLOCK, stream](
        int(t.type), blck_size(t.type).bit_length() - 1, type_size(t.type), u8, h, dst, *t.ne, *t.nb[1:])
