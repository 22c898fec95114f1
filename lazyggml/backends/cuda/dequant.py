"""Quantized blocks to floats, one value at a time (docs/quant-formats.md §1 and §3), and the kernel that does a tensor.

``dequantize(type, vx, vx_h, B, j)`` returns value ``j`` of the block whose first byte is ``B``,
reading quants through a ``uint8`` view and fp16 scales through a ``float16`` view of the same
bytes (every block starts at an even byte, so ``B/2`` indexes its first half). These serve
``get_rows`` on quantized tables and the dequantize-then-GEMM path that mul_mat takes for
quantized types without an mmq kernel (GGML's cuBLAS fallback, ``dequantize_block_*``).
The float order is GGML's CPU one: ``(d·sc)·q − dmin·m`` for Q4_K, ``(d·sc)·(q−32)`` for Q6_K.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...types import Type, blck_size, type_size
from .common import device, jit_kernel
from .elementwise import BLOCK, grid_for

T_Q4_K, T_Q6_K = int(Type.Q4_K), int(Type.Q6_K)
QUANT_TYPES = (Type.Q4_K, Type.Q6_K, Type.Q8_0)


@device
def _q4_K(u8, h, B, j):
    c = j // 64
    l = j % 64
    s = 2 * c + l // 32
    b = np.int32(u8[B + 16 + 32 * c + l % 32])
    q = (b & 0xF) if l < 32 else (b >> 4)
    # get_scale_min_k4 (docs/quant-formats.md §2): 6-bit scale and min of sub-block s from the 12 bytes at B+4
    if s < 4:
        sc = np.int32(u8[B + 4 + s]) & 63
        m = np.int32(u8[B + 8 + s]) & 63
    else:
        sc = (np.int32(u8[B + 8 + s]) & 0xF) | ((np.int32(u8[B + s]) >> 6) << 4)
        m = (np.int32(u8[B + 8 + s]) >> 4) | ((np.int32(u8[B + 4 + s]) >> 6) << 4)
    d = np.float32(h[B // 2]) * np.float32(sc)
    dm = np.float32(h[B // 2 + 1]) * np.float32(m)
    return d * np.float32(q) - dm


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
def dequantize(ty, u8, h, B, j):
    """Value ``j`` of the block at byte ``B`` of type id ``ty`` (Q4_K, Q6_K, else Q8_0)."""
    if ty == T_Q4_K:
        return _q4_K(u8, h, B, j)
    if ty == T_Q6_K:
        return _q6_K(u8, h, B, j)
    return _q8_0(u8, h, B, j)


@jit_kernel()
def dequantize_rows(ty, qk, bs, u8, h, dst, n, ne0, ne1, ne2, nb1, nb2, nb3):
    """A quantized tensor (rows at byte strides nb1..nb3) to a contiguous F32 one; grid-stride loop."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    while i < n:
        i0 = i % ne0
        r = i // ne0
        B = (r // (ne1 * ne2)) * nb3 + ((r // ne1) % ne2) * nb2 + (r % ne1) * nb1 + (i0 // qk) * bs
        dst[i] = dequantize(ty, u8, h, B, i0 % qk)
        i += cuda.gridDim.x * cuda.blockDim.x


def launch_dequantize(stream, u8, h, dst, t):
    """Dequantize tensor ``t`` (viewed as ``u8``/``h``) into the contiguous F32 array ``dst``."""
    n = t.nelements()
    dequantize_rows[grid_for(n), BLOCK, stream](int(t.type), blck_size(t.type), type_size(t.type), u8, h, dst, n,
                                                t.ne[0], t.ne[1], t.ne[2], t.nb[1], t.nb[2], t.nb[3])
