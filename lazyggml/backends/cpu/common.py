"""What the CPU kernel modules share: element kinds and their conversions (rows, shape, softmax's
mask, matmul's activations), ``unravel_row``, and ``parallel_kernel`` (a kernel whose rows can be
split over the pool's threads; ``ComputeParams.launch`` in ``params.py`` decides how many chunks).

Element types travel as their raw bits: a tensor's NumPy view is reinterpreted as an unsigned
integer array of the same width (``as_bits``), and a small integer *kind* says how to read and
write those bits (``to_f32`` / ``from_f32``). One compiled kernel thus covers F32, F16, BF16 and I32
in any combination (numba has no float16 on the CPU), and plain same-type copies move the bits
untouched (KIND_RAW), which is also how I8/I16/I64/F64 and same-type quantized copies go.

Conversions go through float32, exactly as GGML's ``type_conversion_table``: F16 rounds to
nearest even (``GGML_CPU_FP32_TO_FP16``, F16C on x86), BF16 as ``ggml_compute_fp32_to_bf16``, I32
by C's truncating cast.
"""
from __future__ import annotations

import types

import numpy as np
from numba import njit

from ...cache import tie_cache
from ...types import Type
from . import convert as _convert
from . import type_common
from . import pool, simd

_kernel = njit(cache=True, error_model="numpy")

# -- element kinds -------------------------------------------------------------------------------
KIND_RAW = -1   # same type on both sides: copy the bits
KIND_F32 = 0
KIND_F16 = 1
KIND_BF16 = 2
KIND_I32 = 3

KIND = {Type.F32: KIND_F32, Type.F16: KIND_F16, Type.BF16: KIND_BF16, Type.I32: KIND_I32}
FLOAT_TYPES = (Type.F32, Type.F16, Type.BF16)

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def as_bits(a):
    """``a`` reinterpreted as unsigned integers of its own width (a view; any strides)."""
    return a.view(_UINT[a.dtype.itemsize])


def quant_ready(t):
    """True when ``convert.quantize`` / ``convert.dequantize`` handle rows of type ``t``."""
    return t in _convert.SUPPORTED_TYPES


@_kernel
def to_f32(b, kind):
    """The float32 value of the element bits ``b`` of the given kind."""
    if kind == KIND_F16:
        return type_common.fp16_to_fp32(b)
    if kind == KIND_BF16:
        return type_common.bf16_to_fp32(b)
    if kind == KIND_I32:
        return np.float32(np.uint32(b).view(np.int32))
    return np.uint32(b).view(np.float32)


@_kernel
def from_f32(x, kind):
    """The bits (as uint32) of the float32 ``x`` stored as the given kind."""
    if kind == KIND_F16:
        return np.uint32(type_common.fp32_to_fp16(x))
    if kind == KIND_BF16:
        return np.uint32(type_common.fp32_to_bf16(x))
    if kind == KIND_I32:
        return np.int32(x).view(np.uint32)
    return np.float32(x).view(np.uint32)


@_kernel
def convert_row(s, skind, d, dkind):
    """``d[:] = s[:]`` element by element, converting between kinds (KIND_RAW: the same bits).
    F32 to F16 between packed rows (the KV cache's writes) goes 8 at a time (``vcvtps2ph``): a
    call per element and kind cost ~5 ns an element, 40 µs for a 64-token batch's keys."""
    if skind == dkind or skind == KIND_RAW:
        for i in range(s.shape[0]):
            d[i] = s[i]
        return
    i = 0
    if skind == KIND_F32 and dkind == KIND_F16 and s.strides[0] == 4 and d.strides[0] == 2:
        while i + 8 <= s.shape[0]:
            simd.store_i16x8(d, 2 * i, simd.f32x8_to_f16(simd.load_f32x8(s, 4 * i)))
            i += 8
    for j in range(i, s.shape[0]):
        d[j] = from_f32(to_f32(s[j], skind), dkind)


@njit(cache=True, inline="always")
def chunk(n, c, nc):
    """Chunk ``c`` of ``nc`` of ``range(n)``: the rows (or tiles) a parallel kernel's call does."""
    return range(c * n // nc, (c + 1) * n // nc)


_body = None   # the kernel a driver runs: each driver is _pool_run with its own globals


def _pool_run(state, nc, *args):
    pool.parallel_for(state, _body, nc, args)


def parallel_kernel(fn):
    """A kernel whose rows can be split over threads: ``fn(ch, nch, *args)`` does chunk ch of nch
    of them (``for r in chunk(n, ch, nch)``), so ``kernel(0, 1, *args)`` does them all on this
    thread and ``kernel.run(state, nch, *args)`` posts the chunks as one job of the CPU backend's pool
    (``pool.parallel_for``; ``state`` is the pool's; ``ComputeParams.step`` makes either the plan's
    step). The pool, not OpenMP: a prompt's ~15 parallel
    kernels a layer then keep the workers spinning between them, and a worker that the machine
    woke late (in a VM ~0.25 ms after an idle spell, where libgomp's barrier made both threads
    sleep and wake at every region) costs the job its own chunk at most. ``run`` has its own
    qualified name, hence its own cache files (``tie_cache`` ties it with the kernel's module)."""
    flags = dict(cache=True, error_model="numpy")
    kernel = njit(**flags)(fn)
    run = types.FunctionType(_pool_run.__code__, dict(_pool_run.__globals__, _body=kernel), fn.__name__ + "_run")
    # cached beside this file (the template's): the kernel's module in the name keeps drivers of
    # kernels of the same name in two modules apart
    run.__qualname__ = f"{fn.__module__.rpartition('.')[2]}.{fn.__qualname__}.run"
    kernel.run = njit(**flags)(run)
    return kernel


@_kernel
def unravel_row(r, n1, n2):
    """Row number ``r`` of a (n3, n2, n1, n0) array as its (i3, i2, i1)."""
    i1 = r % n1
    q = r // n1
    return q // n2, q % n2, i1


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, type_common.__file__, pool.__file__, __file__)
