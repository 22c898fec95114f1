"""DUP, CONT and CPY on the CPU (GGML's ``ggml_compute_forward_dup``), and what the other kernel
modules share: the element kinds and conversions (rows, shape, softmax's mask), ``unravel_row``,
``parallel_kernel`` and ``launch`` (a parallel kernel on one thread when the work is small).

GGML's copy semantics: the elements of ``src`` are taken in its row-major *logical* order (i0
fastest, then i1, i2, i3, whatever the strides) and written to ``dst`` in *its* logical order. The
shapes may differ as long as the element counts agree, and either side may be strided (a permuted
view, a transposed one, a view with gaps between rows). So one kernel serves DUP (same shape),
CONT (a packed copy, maybe reshaped) and CPY (into a view of another tensor, converting the type).

Element types travel as their raw bits: a tensor's NumPy view is reinterpreted as an unsigned
integer array of the same width (``as_bits``), and a small integer *kind* says how to read and
write those bits (``to_f32`` / ``from_f32``). One compiled kernel thus covers F32, F16, BF16 and I32
in any combination (numba has no float16 on the CPU), and plain same-type copies move the bits
untouched (KIND_RAW), which is also how I8/I16/I64/F64 and same-type quantized copies go.

Conversions go through float32, exactly as GGML's ``type_conversion_table``: F16 rounds to
nearest even (``GGML_CPU_FP32_TO_FP16``, F16C on x86), BF16 as ``ggml_compute_fp32_to_bf16``, I32
by C's truncating cast.

Quantized copies follow GGML's two special cases: quantized -> float (``dup_from_q``) dequantizes
each source row and scatters it in logical order; float -> quantized (``dup_to_q``) needs a
contiguous destination and quantizes each source row into the next ``row_size`` bytes. The rows go
through ``lazyggml.quants`` (the quantizers' own compiled drivers, threaded for large inputs)
rather than being compiled into these kernels a second time.

The kernels here are serial: copies are memory bound, and a ``parallel=True`` kernel costs about
2 s more to compile per signature than these do.
"""
from __future__ import annotations

import types

import numba
import numpy as np
from numba import njit

from ... import quants
from ...ops import Op
from ...types import Type, blck_size, is_quantized, type_size
from . import forward, simd
from . import quant as _quant

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
    """True when ``lazyggml.quants`` can (de)quantize rows of type ``t``."""
    return t in quants.SUPPORTED_TYPES


@_kernel
def to_f32(b, kind):
    """The float32 value of the element bits ``b`` of the given kind."""
    if kind == KIND_F16:
        return _quant.fp16_to_fp32(b)
    if kind == KIND_BF16:
        return _quant.bf16_to_fp32(b)
    if kind == KIND_I32:
        return np.float32(np.uint32(b).view(np.int32))
    return np.uint32(b).view(np.float32)


@_kernel
def from_f32(x, kind):
    """The bits (as uint32) of the float32 ``x`` stored as the given kind."""
    if kind == KIND_F16:
        return np.uint32(_quant.fp32_to_fp16(x))
    if kind == KIND_BF16:
        return np.uint32(_quant.fp32_to_bf16(x))
    if kind == KIND_I32:
        return np.int32(x).view(np.uint32)
    return np.float32(x).view(np.uint32)


@_kernel
def convert_row(s, skind, d, dkind):
    """``d[:] = s[:]`` element by element, converting between kinds (KIND_RAW: the same bits)."""
    if skind == dkind or skind == KIND_RAW:
        for i in range(s.shape[0]):
            d[i] = s[i]
    else:
        for i in range(s.shape[0]):
            d[i] = from_f32(to_f32(s[i], skind), dkind)


# below this many elements a parallel kernel runs on one thread: waking the pool costs more
PARALLEL_MIN_ELEMENTS = 1 << 15


def parallel_kernel(fn):
    """``@njit(parallel=True)``, plus a serial twin as ``kernel.serial``: the same function compiled
    without ``parallel=True`` (its ``prange`` is then a plain ``range``). A parallel region costs
    ~3 µs even on one thread, several times a decode step's small kernels; the twin costs nothing.
    The twin has its own qualified name, hence its own cache files."""
    flags = dict(cache=True, error_model="numpy")
    kernel = njit(parallel=True, **flags)(fn)
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + ".serial"
    kernel.serial = njit(**flags)(twin)
    return kernel


def launch(kernel, n_elements, *args):
    """The plan step ``(kernel, args)`` of a ``parallel_kernel``: its serial twin when the work is
    small or Numba has one thread (read when the plan is made: the CPU backend sets it first)."""
    if n_elements < PARALLEL_MIN_ELEMENTS or numba.get_num_threads() == 1:
        kernel = kernel.serial
    return kernel, args


@_kernel
def unravel_row(r, n1, n2):
    """Row number ``r`` of a (n3, n2, n1, n0) array as its (i3, i2, i1)."""
    i1 = r % n1
    q = r // n1
    return q // n2, q % n2, i1


@_kernel
def _scatter(s, skind, dst, dkind, k):
    """Write the row ``s`` to ``dst`` starting at logical (flat) element ``k`` of ``dst``."""
    n3, n2, n1, n0 = dst.shape
    i0 = k % n0
    i3, i2, i1 = unravel_row(k // n0, n1, n2)
    if i0 == 0 and s.shape[0] == n0:  # rows line up: a plain row copy
        convert_row(s, skind, dst[i3, i2, i1], dkind)
        return
    same = skind == dkind or skind == KIND_RAW
    for j in range(s.shape[0]):
        if same:
            dst[i3, i2, i1, i0] = s[j]
        else:
            dst[i3, i2, i1, i0] = from_f32(to_f32(s[j], skind), dkind)
        i0 += 1
        if i0 == n0:
            i0 = 0
            i1 += 1
            if i1 == n1:
                i1 = 0
                i2 += 1
                if i2 == n2:
                    i2 = 0
                    i3 += 1


@_kernel
def copy_flat(src, skind, dst, dkind):
    """GGML's dup between plain types: src's elements in logical order into dst's logical order."""
    n3, n2, n1, n0 = src.shape
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = unravel_row(r, n1, n2)
        _scatter(src[i3, i2, i1], skind, dst, dkind, r * n0)


# -- forward --------------------------------------------------------------------------------------
def _copy_plan(node):
    """How to copy ``node.src[0]`` into ``node``: 'raw', 'convert', 'from_q', 'to_q', or None."""
    s, d = node.src[0].type, node.type
    if node.src[0].nelements() != node.nelements():
        return None
    if s == d:
        if is_quantized(s):  # bytes in block order: rows must be packed blocks on both sides
            ok = node.src[0].nb[0] == type_size(s) and node.nb[0] == type_size(d)
            return "raw" if ok else None
        return "raw"
    if s in KIND and d in KIND and (s in FLOAT_TYPES or d in FLOAT_TYPES):
        if (s == Type.I32 or d == Type.I32) and Type.F32 not in (s, d):
            return None  # GGML converts I32 only to and from F32
        return "convert"
    if is_quantized(s) and d in FLOAT_TYPES and quant_ready(s):
        return "from_q" if node.src[0].nb[0] == type_size(s) else None
    if s in FLOAT_TYPES and is_quantized(d) and quant_ready(d):
        ok = node.is_contiguous() and node.src[0].ne[0] % blck_size(d) == 0
        return "to_q" if ok and node.src[0].nb[0] == type_size(s) else None
    return None


def _supports(node):
    return _copy_plan(node) is not None


def _copy_from_q(qtype, s, n0, dst, dkind):
    """Dequantize the rows of ``s``, then scatter them in logical order."""
    rows = quants.dequantize(qtype, np.ascontiguousarray(s), n0)
    copy_flat(rows.reshape(s.shape[:3] + (-1,)).view(np.uint32), KIND_F32, as_bits(dst), dkind)


def _copy_to_q(s, skind, n0, dst, qtype):
    """Quantize float32 rows (``s`` converted first if it is F16/BF16) into the packed ``dst``."""
    rows = s
    if skind != KIND_F32:
        rows = np.empty(s.shape, np.float32)
        copy_flat(as_bits(s), skind, rows.view(np.uint32), KIND_F32)
    dst.reshape(-1)[:] = quants.quantize(qtype, rows.reshape(-1, n0)).reshape(-1)


@forward(Op.DUP, Op.CONT, Op.CPY, supports=_supports)
def copy_forward(node, dst, srcs):
    src_t, s = node.src[0], srcs[0]
    plan = _copy_plan(node)
    if plan == "raw":
        return [(copy_flat, (as_bits(s), KIND_RAW, as_bits(dst), KIND_RAW))]
    if plan == "convert":
        return [(copy_flat, (as_bits(s), KIND[src_t.type], as_bits(dst), KIND[node.type]))]
    if plan == "from_q":
        return [(_copy_from_q, (src_t.type, s, src_t.ne[0], dst, KIND[node.type]))]
    return [(_copy_to_q, (s, KIND[src_t.type], src_t.ne[0], dst, node.type))]


# the cache of every kernel above also depends on these files (see simd.tie_cache)
simd.tie_cache(globals(), simd.__file__, _quant.__file__, __file__)
