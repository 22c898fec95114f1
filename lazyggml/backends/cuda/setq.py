"""Float rows into quantized tensors on the GPU: SET_ROWS into a quantized KV cache and CPY of F32
or F16 into Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1, with GGML's reference quantizers (the CPU's
``type_legacy.py`` states them; GGML's CUDA ``cpy`` kernels do the same per block).

``QUANTIZE[type](x, xo, u8, h, B)`` quantizes the 32 values ``x[xo], .., x[xo + 31]`` into the block
at byte ``B`` of the destination, written through its ``uint8`` view and, for the fp16 fields, its
``float16`` view (every block starts at an even byte). The float operations are the reference's,
in its order, so the bytes are the CPU's: C's float-to-int conversion truncates (``np.int64`` of a
float32 does too), fp16 fields round to nearest even. ``rows_kernel(type)`` walks the source as
rows (``elementwise.grid_rows`` over blocks), one thread per block.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ...types import Type
from .common import device, jit_kernel, plane, roundf, wrap

F32_MAX = np.float32(3.4028234663852886e38)


@device
def _i8(v):
    """The low byte of ``v`` as int8 (C's conversion to int8_t)."""
    return ((np.int64(v) + 128) & 0xFF) - 128


@device
def _signed_absmax(x, xo):
    """The signed value of largest magnitude of the block (the first one wins a tie)."""
    amax = np.float32(0)
    vmax = np.float32(0)
    for j in range(32):
        v = np.float32(x[xo + j])
        if abs(v) > amax:
            amax = abs(v)
            vmax = v
    return vmax


@device
def _min_max(x, xo):
    vmin = F32_MAX
    vmax = -F32_MAX
    for j in range(32):
        v = np.float32(x[xo + j])
        if v < vmin:
            vmin = v
        if v > vmax:
            vmax = v
    return vmin, vmax


@device
def _inverse(d):
    return np.float32(1) / d if d != np.float32(0) else np.float32(0)


@device
def _store_u32(u8, o, v):
    for k in range(4):
        u8[o + k] = (v >> np.uint32(8 * k)) & np.uint32(0xFF)


@device
def _q8_0(x, xo, u8, h, B):
    amax = np.float32(0)
    for j in range(32):
        v = abs(np.float32(x[xo + j]))
        amax = amax if amax > v else v          # C's MAX(amax, fabsf(v))
    d = amax / np.float32(127)
    id_ = _inverse(d)
    h[B // 2] = d
    for j in range(32):
        u8[B + 2 + j] = _i8(np.int64(roundf(np.float32(x[xo + j]) * id_))) & 0xFF


@device
def _q4_0(x, xo, u8, h, B):
    d = _signed_absmax(x, xo) / np.float32(-8)
    id_ = _inverse(d)
    h[B // 2] = d
    for j in range(16):
        q0 = min(15, _i8(np.int64(np.float32(x[xo + j]) * id_ + np.float32(8.5))))
        q1 = min(15, _i8(np.int64(np.float32(x[xo + j + 16]) * id_ + np.float32(8.5))))
        u8[B + 2 + j] = (q0 & 0xFF) | ((q1 << 4) & 0xFF)


@device
def _q4_1(x, xo, u8, h, B):
    vmin, vmax = _min_max(x, xo)
    d = (vmax - vmin) / np.float32(15)
    id_ = _inverse(d)
    h[B // 2] = d
    h[B // 2 + 1] = vmin
    for j in range(16):
        q0 = min(15, _i8(np.int64((np.float32(x[xo + j]) - vmin) * id_ + np.float32(0.5))))
        q1 = min(15, _i8(np.int64((np.float32(x[xo + j + 16]) - vmin) * id_ + np.float32(0.5))))
        u8[B + 4 + j] = (q0 & 0xFF) | ((q1 << 4) & 0xFF)


@device
def _q5_0(x, xo, u8, h, B):
    d = _signed_absmax(x, xo) / np.float32(-16)
    id_ = _inverse(d)
    h[B // 2] = d
    qh = np.uint32(0)
    for j in range(16):
        q0 = min(31, _i8(np.int64(np.float32(x[xo + j]) * id_ + np.float32(16.5)))) & 0xFF
        q1 = min(31, _i8(np.int64(np.float32(x[xo + j + 16]) * id_ + np.float32(16.5)))) & 0xFF
        u8[B + 6 + j] = (q0 & 0xF) | ((q1 & 0xF) << 4)
        qh |= np.uint32(((q0 & 0x10) >> 4) << j)
        qh |= np.uint32(((q1 & 0x10) >> 4) << (j + 16))
    _store_u32(u8, B + 2, qh)


@device
def _q5_1(x, xo, u8, h, B):
    vmin, vmax = _min_max(x, xo)
    d = (vmax - vmin) / np.float32(31)
    id_ = _inverse(d)
    h[B // 2] = d
    h[B // 2 + 1] = vmin
    qh = np.uint32(0)
    for j in range(16):
        q0 = np.int64((np.float32(x[xo + j]) - vmin) * id_ + np.float32(0.5)) & 0xFF    # no clamp in GGML
        q1 = np.int64((np.float32(x[xo + j + 16]) - vmin) * id_ + np.float32(0.5)) & 0xFF
        u8[B + 8 + j] = (q0 & 0xF) | ((q1 & 0xF) << 4)
        qh |= np.uint32(((q0 & 0x10) >> 4) << j)
        qh |= np.uint32(((q1 & 0x10) >> 4) << (j + 16))
    _store_u32(u8, B + 4, qh)


QUANTIZE = {Type.Q8_0: _q8_0, Type.Q4_0: _q4_0, Type.Q4_1: _q4_1, Type.Q5_0: _q5_0, Type.Q5_1: _q5_1}


def _make_rows_kernel(quant):
    @jit_kernel()
    def quantize_rows(x, idx, has_idx, u8, h, bs, ne0, ne1, ne2, ne3, s1, s2, s3, ni1, ni2, si0, si1, si2,
                      nd1, nb1, nb2, nb3):
        """Row ``(i1, i2, i3)`` of the float ``x`` (rows contiguous) into row ``r`` of the quantized
        destination (``nd1`` rows, byte strides nb1..nb3): ``r = idx[i1, i2 % ni1, i3 % ni2]``
        (SET_ROWS), or ``r = i1`` without an index (CPY). An index outside ``[0, nd1)`` writes
        nothing (``rows.py``)."""
        x0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        dx = cuda.gridDim.x * cuda.blockDim.x
        nblocks = ne0 // 32
        i23 = cuda.blockIdx.z
        while i23 < ne2 * ne3:
            i2, i3 = plane(i23, ne2)
            i1 = cuda.blockIdx.y
            while i1 < ne1:
                r = idx[i1 * si0 + wrap(i2, ni1) * si1 + wrap(i3, ni2) * si2] if has_idx else i1
                if r >= 0 and r < nd1:      # an index out of range writes nothing
                    xb = i1 * s1 + i2 * s2 + i3 * s3
                    B0 = r * nb1 + i2 * nb2 + i3 * nb3
                    kb = x0
                    while kb < nblocks:
                        quant(x, xb + 32 * kb, u8, h, B0 + kb * bs)
                        kb += dx
                i1 += cuda.gridDim.y
            i23 += cuda.gridDim.z

    return quantize_rows


@functools.cache
def rows_kernel(type_):
    """The quantizing rows kernel of ``type_`` (compiled at its first launch)."""
    return _make_rows_kernel(QUANTIZE[type_])
