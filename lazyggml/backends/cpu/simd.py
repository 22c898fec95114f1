"""A tiny SIMD vocabulary for Numba: LLVM vector values as first-class Numba variables.

Why this module exists
----------------------
Numba compiles a plain loop over bytes into scalar code: it does not turn "unpack nibbles, multiply
unsigned by signed bytes, add neighbours, scale, add" into the eight AVX2 instructions GGML's
``ggml_vec_dot_q4_K_q8_K`` uses, and the quantized dot products are 4 to 6 times slower for it.
LLVM, however, *can* emit those instructions when it is handed vector IR. So this module gives Numba
a handful of LLVM vector types (``<32 x i8>``, ``<16 x i16>``, ``<8 x i32>``, ``<8 x float>``, their
128-bit halves and their 512-bit doubles, two rows side by side) and about thirty ``@intrinsic``
operations on them. A kernel written with them
reads like C written with ``<immintrin.h>`` (see ``type_k.py``), yet it is ordinary ``@njit`` code:
the vectors live in Numba local variables, which LLVM keeps in registers.

How it works
------------
* ``Vec`` is a Numba type whose data model is an LLVM vector (``PrimitiveModel``). It never crosses
  the Python boundary: vectors are made by loads/splats inside jitted code and reduced to scalars
  before returning to Python.
* Each operation is an ``@intrinsic``: a Python function that runs at compile time, checks the
  argument types and emits a few lines of LLVM IR with llvmlite's IRBuilder. Numba inlines that IR
  into the caller, so an operation costs exactly its instructions.
* Loads are unaligned (``align 1``) from a byte offset into any 1-D array (a row of a strided
  tensor is fine as long as the bytes read are contiguous): block structures are read straight
  from the weight bytes, without views or copies. No bounds checks: callers stay in range.

Two instruction sets, one source
--------------------------------
A few x86 instructions have no single LLVM IR equivalent: ``maddubs`` (``pmaddubsw``: unsigned
bytes x signed bytes, adjacent pairs added into int16 with saturation), ``madd`` (``pmaddwd``:
int16 x int16, adjacent pairs added into int32) and ``vsign`` (``psignb``). With AVX2 in the Numba
target they call ``llvm.x86.avx2.*`` directly (one instruction each); with AVX-512 VNNI,
``madd_acc`` and ``dot4_acc`` become one ``vpdpwssd`` / ``vpdpbusd``. Otherwise they are written as
portable IR (widen, multiply, pick even/odd lanes with ``shufflevector``, add; ``select``) that
LLVM compiles for any target, and often pattern-matches back into ``pmaddwd`` on SSE2. fp16 lanes
are decoded with F16C's ``vcvtph2ps`` or a portable bit trick. Everything else is plain portable
IR (``and``, ``lshr``, ``sitofp``, ``llvm.fmuladd``...).

The choice is made once, at import, from the features of Numba's *target* (not just the host), so
``NUMBA_CPU_FEATURES`` / ``NUMBA_ENABLE_AVX=0`` are honoured. ``LAZYGGML_SIMD=portable`` forces the
portable IR even on an AVX2 machine (the tests use it). Numba's on-disk cache key holds the target
CPU and its features but not this choice, nor the other source files a kernel inlines:
``cache.tie_cache`` adds both (each kernel module passes it ``ISA``).

Floating-point contract: ``fma`` is ``llvm.fmuladd``, a fused multiply-add where the target has FMA
(bit-identical to GGML's ``_mm256_fmadd_ps``) and a multiply then an add elsewhere.
"""
from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic, models, register_model

from ... import debug

# ---------------------------------------------------------------------------------------------------
# Which instruction set: decided once, at import.
# ---------------------------------------------------------------------------------------------------


def _target_features() -> str:
    """The feature string Numba compiles for (what ``JITCPUCodegen`` passes to LLVM)."""
    if config.CPU_FEATURES is not None:
        return config.CPU_FEATURES
    return get_host_cpu_features()


_FEATURES = set(f[1:] for f in _target_features().split(",") if f.startswith("+"))
_REQUEST = debug.value("LAZYGGML_SIMD").strip().lower()
if _REQUEST not in ("auto", "portable"):
    raise ValueError(f"LAZYGGML_SIMD={_REQUEST!r}: expected 'auto' or 'portable'")

#: True when ``maddubs``/``madd`` use the AVX2 instructions directly.
HAVE_AVX2 = _REQUEST == "auto" and "avx2" in _FEATURES
#: True when fp16 -> fp32 lanes can use F16C's ``vcvtph2ps`` (``fpext <8 x half>``).
HAVE_F16C = _REQUEST == "auto" and "f16c" in _FEATURES and "avx" in _FEATURES
#: True when float sums follow a GGML built with AVX-512F, which adds float lanes 16 wide
#: (``GGML_F32_EPR`` 16): the target has AVX-512F and ``LAZYGGML_GGML_AVX512`` is not 0. With 0, they
#: follow GGML built for AVX2 (8 lanes) on any x86 CPU, as the tests' oracles are built
#: (``tests/oracle_cflags.sh``). Kernels that follow GGML's lane order for floats read it.
HAVE_AVX512 = _REQUEST == "auto" and "avx512f" in _FEATURES and debug.flag("LAZYGGML_GGML_AVX512")
#: True when the 512-bit forms of ``maddubs``, ``madd`` and ``pick16`` are one AVX-512BW instruction
#: each (the kernels of two weight rows at once, ``dot2_*``, run on 512-bit registers then).
HAVE_AVX512BW = HAVE_AVX2 and "avx512bw" in _FEATURES
#: True when ``madd_acc`` can use AVX-512 VNNI's ``vpdpwssd`` on 256-bit registers.
HAVE_VNNI = HAVE_AVX2 and "avx512vnni" in _FEATURES and "avx512vl" in _FEATURES
#: True when ``crumb`` can use GFNI's ``vgf2p8affineqb`` (a shift and a mask of bytes in one instruction).
HAVE_GFNI = HAVE_AVX2 and "gfni" in _FEATURES
#: "avx2", "avx2+avx512bw", "avx2+avx512bw+vnni" or "portable", then "+f32x16" where float sums
#: follow AVX-512's: printed by benchmarks and tests, and a salt of the cached kernels (the generated
#: switches branch on HAVE_AVX512BW, attention on HAVE_AVX512).
ISA = (("avx2" + ("+avx512bw" if HAVE_AVX512BW else "") + ("+vnni" if HAVE_VNNI else "")) if HAVE_AVX2 else "portable") \
    + ("+f32x16" if HAVE_AVX512 else "")
# ---------------------------------------------------------------------------------------------------
# The vector types
# ---------------------------------------------------------------------------------------------------


class Vec(types.Type):
    """An LLVM vector ``<count x elem>`` held in a Numba variable (e.g. ``i8x32`` = ``<32 x i8>``)."""

    def __init__(self, kind: str, bits: int, count: int):
        self.kind, self.bits, self.count = kind, bits, count  # kind: 'i' (integer) or 'f' (float32)
        super().__init__(name=f"{kind}{bits}x{count}")

    def llvm_type(self):
        elem = ir.IntType(self.bits) if self.kind == "i" else ir.FloatType()
        return ir.VectorType(elem, self.count)


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, fe_type.llvm_type())


i8x32, i8x16 = Vec("i", 8, 32), Vec("i", 8, 16)
i16x16, i16x8 = Vec("i", 16, 16), Vec("i", 16, 8)
i32x8, i32x4 = Vec("i", 32, 8), Vec("i", 32, 4)
f32x8, f32x4 = Vec("f", 32, 8), Vec("f", 32, 4)
# 512 bits: two 256-bit vectors side by side (``concat``), for the kernels of two weight rows at once
i8x64, i16x32, i32x16, f32x16 = Vec("i", 8, 64), Vec("i", 16, 32), Vec("i", 32, 16), Vec("f", 32, 16)
_BY_SHAPE = {(v.kind, v.bits, v.count): v for v in (i8x64, i8x32, i8x16, i16x32, i16x16, i16x8, i32x16, i32x8,
                                                    i32x4, f32x16, f32x8, f32x4)}

_I32 = ir.IntType(32)


def _const_mask(indices):
    return ir.Constant(ir.VectorType(_I32, len(indices)), [ir.Constant(_I32, i) for i in indices])


def _call(builder, name, ret, args):
    """Call the LLVM intrinsic ``name`` (declared on first use in this module)."""
    mod = builder.module
    fnty = ir.FunctionType(ret, [a.type for a in args])
    fn = mod.globals.get(name) or ir.Function(mod, fnty, name=name)
    return builder.call(fn, args)


def _vname(v):
    """LLVM's overload suffix for a vector type, e.g. ``v8f32``."""
    return f"v{v.count}{'f' if v.kind == 'f' else 'i'}{v.bits}"


def _data_ptr(context, builder, arrty, arr, byte_off):
    """``(i8*) arr.data + byte_off``: the address of a byte inside a C-contiguous array."""
    ary = context.make_array(arrty)(context, builder, arr)
    base = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
    return builder.gep(base, [byte_off])


def _is_array(t):
    return isinstance(t, types.Array) and t.ndim == 1


# ---------------------------------------------------------------------------------------------------
# Loads and scalar reads at a byte offset (unaligned, no bounds check: callers stay in range)
# ---------------------------------------------------------------------------------------------------


def _make_load(vt):
    @intrinsic
    def load(typingctx, arr, off):
        if not (_is_array(arr) and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            p = _data_ptr(context, builder, sig.args[0], args[0], args[1])
            return builder.load(builder.bitcast(p, vt.llvm_type().as_pointer()), align=1)

        return vt(arr, off), codegen

    return load


#: ``load_i8x32(a, off)``: 32 bytes of ``a`` starting at byte ``off``, as ``<32 x i8>``.
load_i8x32 = _make_load(i8x32)
load_i8x16 = _make_load(i8x16)
load_i16x16 = _make_load(i16x16)
load_i16x8 = _make_load(i16x8)
load_f32x4 = _make_load(f32x4)
load_f32x8 = _make_load(f32x8)
load_f32x16 = _make_load(f32x16)


def _make_scalar_load(nty, lty):
    @intrinsic
    def load(typingctx, arr, off):
        if not (_is_array(arr) and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            p = _data_ptr(context, builder, sig.args[0], args[0], args[1])
            return builder.load(builder.bitcast(p, lty.as_pointer()), align=1)

        return nty(arr, off), codegen

    return load


#: ``load_u16(a, off)`` etc.: a little-endian scalar at byte ``off`` of any 1-D array.
load_u16 = _make_scalar_load(types.uint16, ir.IntType(16))
load_u32 = _make_scalar_load(types.uint32, ir.IntType(32))
load_f32 = _make_scalar_load(types.float32, ir.FloatType())


def _make_store(vt):
    @intrinsic
    def store(typingctx, arr, off, v):
        if not (_is_array(arr) and isinstance(off, types.Integer) and v == vt):
            return None

        def codegen(context, builder, sig, args):
            p = _data_ptr(context, builder, sig.args[0], args[0], args[1])
            builder.store(args[2], builder.bitcast(p, vt.llvm_type().as_pointer()), align=1)
            return context.get_dummy_value()

        return types.none(arr, off, v), codegen

    return store


#: ``store_f32x8(a, off, v)``: the 8 floats of ``v`` at byte ``off`` of ``a`` (unaligned).
store_f32x4 = _make_store(f32x4)
store_f32x8 = _make_store(f32x8)
store_f32x16 = _make_store(f32x16)
store_i16x8 = _make_store(i16x8)
store_i16x16 = _make_store(i16x16)


# ---------------------------------------------------------------------------------------------------
# Building vectors from scalars
# ---------------------------------------------------------------------------------------------------


def _make_splat(vt):
    @intrinsic
    def splat(typingctx, x):
        if not isinstance(x, (types.Integer, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            lt = vt.llvm_type()
            s = context.cast(builder, args[0], sig.args[0], types.float32 if vt.kind == "f" else
                             types.int64)
            if vt.kind == "i":
                s = builder.trunc(s, lt.element)
            v = builder.insert_element(ir.Constant(lt, ir.Undefined), s, ir.Constant(_I32, 0))
            return builder.shuffle_vector(v, v, _const_mask([0] * vt.count))

        return vt(x), codegen

    return splat


#: ``splat_i8x32(c)``: all 32 lanes = c (wrapped to 8 bits). Zero vectors are ``splat_*(0)``.
splat_i8x32 = _make_splat(i8x32)
splat_i8x16 = _make_splat(i8x16)
splat_i16x16 = _make_splat(i16x16)
splat_i32x8 = _make_splat(i32x8)
splat_f32x8 = _make_splat(f32x8)
splat_f32x4 = _make_splat(f32x4)
splat_f32x16 = _make_splat(f32x16)


@intrinsic
def u32x4_to_i8x16(typingctx, a, b, c, d):
    """Four uint32 words, little-endian, as 16 bytes (GGML's ``_mm_set_epi32(d, c, b, a)``)."""
    if not all(isinstance(t, types.Integer) for t in (a, b, c, d)):
        return None

    def codegen(context, builder, sig, args):
        vt = ir.VectorType(_I32, 4)
        v = ir.Constant(vt, ir.Undefined)
        for i, (x, t) in enumerate(zip(args, sig.args)):
            x = builder.trunc(context.cast(builder, x, t, types.uint64), _I32)
            v = builder.insert_element(v, x, ir.Constant(_I32, i))
        return builder.bitcast(v, i8x16.llvm_type())

    return i8x16(a, b, c, d), codegen


@intrinsic
def lookup16(typingctx, table, idx):
    """``<32 x i8>``: byte j is ``table[idx[j]]`` for the 16-byte ``table`` and indices 0..15
    (GGML's ``_mm_shuffle_epi8(values128, nibbles)`` on each half: the IQ4 levels)."""
    if not (table == i8x16 and idx == i8x32):
        return None

    def codegen(context, builder, sig, args):
        t, ix = args
        if HAVE_AVX2:
            t2 = builder.shuffle_vector(t, t, _const_mask(list(range(16)) * 2))
            return _call(builder, "llvm.x86.avx2.pshuf.b", ix.type, [t2, ix])
        out = ir.Constant(ix.type, ir.Undefined)
        for j in range(32):
            k = builder.extract_element(ix, ir.Constant(_I32, j))
            out = builder.insert_element(out, builder.extract_element(t, k), ir.Constant(_I32, j))
        return out

    return i8x32(table, idx), codegen


@intrinsic
def bits_to_bytes(typingctx, x, val):
    """``<32 x i8>`` whose byte j is ``val`` where bit j of the 32-bit ``x`` is set, else 0 (GGML's
    ``bytes_from_bits_32``: the fifth bits of Q5_0/Q5_1). Byte k of ``x`` is broadcast to bytes
    8k..8k+7, each tested against its own bit (a byte shuffle, an and, a compare)."""
    if not (isinstance(x, types.Integer) and isinstance(val, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        i8 = ir.IntType(8)
        w = builder.trunc(context.cast(builder, args[0], sig.args[0], types.uint64), _I32)
        b4 = builder.bitcast(w, ir.VectorType(i8, 4))
        spread = builder.shuffle_vector(b4, b4, _const_mask([k // 8 for k in range(32)]))
        bits = ir.Constant(ir.VectorType(i8, 32), [1 << (k % 8) for k in range(32)])
        on = builder.icmp_unsigned("!=", builder.and_(spread, bits), ir.Constant(ir.VectorType(i8, 32), [0] * 32))
        v = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), i8)
        vv = builder.insert_element(ir.Constant(ir.VectorType(i8, 32), ir.Undefined), v, ir.Constant(_I32, 0))
        vv = builder.shuffle_vector(vv, vv, _const_mask([0] * 32))
        return builder.select(on, vv, ir.Constant(ir.VectorType(i8, 32), [0] * 32))

    return i8x32(x, val), codegen


# ---------------------------------------------------------------------------------------------------
# Lane-wise arithmetic and logic on two vectors of the same type
# ---------------------------------------------------------------------------------------------------


def _make_binop(int_op, float_op=None):
    @intrinsic
    def op(typingctx, a, b):
        if not (isinstance(a, Vec) and a == b) or (a.kind == "f" and float_op is None):
            return None

        def codegen(context, builder, sig, args):
            name = float_op if sig.args[0].kind == "f" else int_op
            return getattr(builder, name)(args[0], args[1])

        return a(a, b), codegen

    return op


vadd = _make_binop("add", "fadd")  #: lane-wise a + b (integers wrap)
vsub = _make_binop("sub", "fsub")  #: lane-wise a - b
vmul = _make_binop("mul", "fmul")  #: lane-wise a * b (integers: low half of the product)
vand = _make_binop("and_")  #: bitwise and


@intrinsic
def vmax(typingctx, a, b):
    """Lane-wise ``a if a > b else b`` of two float vectors (``maxps``; a NaN in ``a`` gives ``b``)."""
    if not (isinstance(a, Vec) and a == b and a.kind == "f"):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])

    return a(a, b), codegen


vor = _make_binop("or_")  #: bitwise or


def _make_shift(op_name):
    @intrinsic
    def shift(typingctx, a, k):
        if not (isinstance(a, Vec) and a.kind == "i" and isinstance(k, types.IntegerLiteral)):
            return None
        n = k.literal_value

        def codegen(context, builder, sig, args):
            lt = sig.args[0].llvm_type()
            return getattr(builder, op_name)(args[0], ir.Constant(lt, [n] * lt.count))

        return a(a, k), codegen

    return shift


#: ``vsrl(a, 4)``: logical right shift of every lane by a constant (``>>`` on unsigned lanes).
#: On bytes LLVM emits ``vpsrlw`` plus a mask, exactly GGML's ``_mm256_srli_epi16`` + ``and``.
vsrl = _make_shift("lshr")
#: ``vsll(a, 4)``: left shift of every lane by a constant.
vsll = _make_shift("shl")


# ---------------------------------------------------------------------------------------------------
# Widening, halves, shuffles
# ---------------------------------------------------------------------------------------------------


def _make_ext(signed):
    @intrinsic
    def ext(typingctx, a):
        if not (isinstance(a, Vec) and a.kind == "i"):
            return None
        out = _BY_SHAPE[("i", 2 * a.bits, a.count)]

        def codegen(context, builder, sig, args):
            f = builder.sext if signed else builder.zext
            return f(args[0], out.llvm_type())

        return out(a), codegen

    return ext


#: ``zext(v)``: zero-extend every lane to twice its width (``<16 x i8>`` -> ``<16 x i16>``),
#: x86 ``vpmovzxbw`` (GGML's ``_mm256_cvtepu8_epi16``).
zext = _make_ext(False)
#: ``sext(v)``: sign-extend every lane to twice its width (``_mm256_cvtepi8_epi16``).
sext = _make_ext(True)


def _make_half(hi):
    @intrinsic
    def half(typingctx, a):
        if not isinstance(a, Vec) or a.count % 2:
            return None
        out = _BY_SHAPE[(a.kind, a.bits, a.count // 2)]

        def codegen(context, builder, sig, args):
            h = out.count
            return builder.shuffle_vector(args[0], args[0], _const_mask(range(h * hi, h * hi + h)))

        return out(a), codegen

    return half


lo_half = _make_half(0)  #: lanes [0, n/2): ``_mm256_castsi256_si128``
hi_half = _make_half(1)  #: lanes [n/2, n): ``_mm256_extracti128_si256(v, 1)``


@intrinsic
def concat(typingctx, lo, hi):
    """Two halves into one vector (``MM256_SET_M128I(hi, lo)``)."""
    if not (isinstance(lo, Vec) and lo == hi):
        return None
    out = _BY_SHAPE[(lo.kind, lo.bits, lo.count * 2)]

    def codegen(context, builder, sig, args):
        return builder.shuffle_vector(args[0], args[1], _const_mask(range(out.count)))

    return out(lo, hi), codegen


@intrinsic
def widen_as(typingctx, a, like):
    """``a`` as wide as ``like``: ``a`` itself when they have as many lanes, ``concat(a, a)`` when
    ``like`` has twice as many. The kernels of one weight row and of two rows at once
    (``dot2_*``: row r in the low 256 bits, row r + 1 in the high) then share their
    helpers: the activations, the same for both rows, are widened to the weights' width (from
    memory, one ``vbroadcasti64x4``)."""
    if not (isinstance(a, Vec) and isinstance(like, Vec) and like.count in (a.count, 2 * a.count)):
        return None
    out = _BY_SHAPE[(a.kind, a.bits, like.count)]

    def codegen(context, builder, sig, args):
        if out == sig.args[0]:
            return args[0]
        return builder.shuffle_vector(args[0], args[0], _const_mask(list(range(a.count)) * 2))

    return out(a, like), codegen


@intrinsic
def bcast_half(typingctx, a, h):
    """``<16 x i16>`` whose two 128-bit halves are both half ``h`` (a literal 0 or 1) of ``a``
    (``vpermq``; GGML's ``_mm256_broadcastsi128_si256(_mm256_extracti128_si256(a, h))``)."""
    if not (a in (i16x16, i16x32) and isinstance(h, types.IntegerLiteral)):
        return None
    first = 8 * h.literal_value

    def codegen(context, builder, sig, args):   # <32 x i16>: the same in each 256-bit half
        lanes = [16 * half + first + i for half in range(a.count // 16) for i in list(range(8)) * 2]
        return builder.shuffle_vector(args[0], args[0], _const_mask(lanes))

    return a(a, h), codegen


@intrinsic
def pick16(typingctx, a, j, k):
    """``<16 x i16>`` whose low 8 lanes are lane ``j`` of ``a`` and whose high 8 are lane ``8 + k``
    (``j``, ``k`` literals 0..7): one ``vpshufb`` within 128-bit lanes. With ``a = bcast_half(s, h)``
    (both halves hold scales ``8h .. 8h+7``), ``pick16(a, j, j + 1)`` gives sub-block scales
    ``8h + j`` and ``8h + j + 1`` (GGML's ``get_scale_shuffle_q3k``) and ``pick16(a, j, j)`` scale
    ``8h + j`` in every lane (``get_scale_shuffle_k4``). Written as a plain shuffle of the 16
    scales, LLVM combined it with the scales' widening into a byte permute per use (``vpermt2b``,
    or ``vpshufb`` + ``vpmovzxbw``: 76 instructions per Q2_K super-block where GGML's AVX2 code
    has about 66); the AVX2 instruction is called directly so that it stays one ``vpshufb``."""
    if not (a in (i16x16, i16x32) and isinstance(j, types.IntegerLiteral) and isinstance(k, types.IntegerLiteral)):
        return None
    jj, kk = j.literal_value, k.literal_value
    n256 = a.count // 16   # on <32 x i16>: the same in each 256-bit half

    def codegen(context, builder, sig, args):
        if not (HAVE_AVX512BW if n256 == 2 else HAVE_AVX2):
            lanes = ([jj] * 8 + [8 + kk] * 8) * n256
            return builder.shuffle_vector(args[0], args[0], _const_mask([16 * (i // 16) + x for i, x in enumerate(lanes)]))
        bytes_ = _BY_SHAPE[("i", 8, 2 * a.count)].llvm_type()
        mask = ir.Constant(bytes_, ([2 * jj, 2 * jj + 1] * 8 + [2 * kk, 2 * kk + 1] * 8) * n256)
        name = "llvm.x86.avx512.pshuf.b.512" if n256 == 2 else "llvm.x86.avx2.pshuf.b"
        b = _call(builder, name, bytes_, [builder.bitcast(args[0], bytes_), mask])
        return builder.bitcast(b, a.llvm_type())

    return a(a, j, k), codegen


@intrinsic
def crumb(typingctx, a, k):
    """Bits ``k`` and ``k + 1`` (``k`` a literal 0..6) of every byte of ``<32 x i8>`` ``a``, as 0..3:
    ``(a >> k) & 3``, GGML's ``_mm256_srli_epi16`` + ``and`` for 2-bit quants. With GFNI one
    ``vgf2p8affineqb``: output bit i of a byte is the parity of (its matrix row 7 - i AND the
    byte), so rows 7 and 6 pick bits k and k + 1 and the other rows are zero."""
    if not (a == i8x32 and isinstance(k, types.IntegerLiteral)):
        return None
    kk = k.literal_value

    def codegen(context, builder, sig, args):
        lt = i8x32.llvm_type()
        if not HAVE_GFNI:
            return builder.and_(builder.lshr(args[0], ir.Constant(lt, [kk] * 32)), ir.Constant(lt, [3] * 32))
        rows = [0] * 6 + [1 << (kk + 1), 1 << kk]    # matrix bytes 0..7 of each qword
        return _call(builder, "llvm.x86.vgf2p8affineqb.256", lt,
                     [args[0], ir.Constant(lt, rows * 4), ir.Constant(ir.IntType(8), 0)])

    return a(a, k), codegen


@intrinsic
def hadd_pairs(typingctx, a):
    """Adjacent lanes added: ``<16 x i16>`` -> ``<8 x i16>`` with r[i] = a[2i] + a[2i+1]
    (GGML's ``_mm_hadd_epi16(lo, hi)`` on the Q8_K ``bsums``)."""
    if not (isinstance(a, Vec) and a.kind == "i" and a.count % 2 == 0):
        return None
    out = _BY_SHAPE[("i", a.bits, a.count // 2)]

    def codegen(context, builder, sig, args):
        n = out.count
        ev = builder.shuffle_vector(args[0], args[0], _const_mask(range(0, 2 * n, 2)))
        od = builder.shuffle_vector(args[0], args[0], _const_mask(range(1, 2 * n, 2)))
        return builder.add(ev, od)

    return out(a), codegen


# ---------------------------------------------------------------------------------------------------
# The two integer multiply-adds (the heart of every quantized dot product)
# ---------------------------------------------------------------------------------------------------


def _even_odd_add(builder, p, n, sat=False):
    ev = builder.shuffle_vector(p, p, _const_mask(range(0, 2 * n, 2)))
    od = builder.shuffle_vector(p, p, _const_mask(range(1, 2 * n, 2)))
    if sat:
        return _call(builder, f"llvm.sadd.sat.v{n}i16", ev.type, [ev, od])
    return builder.add(ev, od)


@intrinsic
def maddubs(typingctx, a, b):
    """x86 ``pmaddubsw``: ``a`` as UNSIGNED bytes times ``b`` as SIGNED bytes, adjacent products
    added (saturating) into int16: ``<32 x i8>`` x ``<32 x i8>`` -> ``<16 x i16>`` (or the 128-bit
    ``<16 x i8>`` -> ``<8 x i16>``, the 512-bit ``<64 x i8>`` -> ``<32 x i16>``). With 4-bit/6-bit
    weights in ``a`` the sum never saturates."""
    if not (a == b and a in (i8x64, i8x32, i8x16)):
        return None
    out = _BY_SHAPE[("i", 16, a.count // 2)]

    def codegen(context, builder, sig, args):
        x, y = args
        name = {i16x32: "llvm.x86.avx512.pmaddubs.w.512" if HAVE_AVX512BW else None,
                i16x16: "llvm.x86.avx2.pmadd.ub.sw" if HAVE_AVX2 else None,
                i16x8: "llvm.x86.ssse3.pmadd.ub.sw.128" if HAVE_AVX2 else None}[out]
        if name:
            return _call(builder, name, out.llvm_type(), [x, y])
        n = out.count
        wide = ir.VectorType(ir.IntType(16), 2 * n)
        p = builder.mul(builder.zext(x, wide), builder.sext(y, wide))
        return _even_odd_add(builder, p, n, sat=True)

    return out(a, b), codegen


def _madd_ir(builder, x, y, n):
    name = {16: "llvm.x86.avx512.pmaddw.d.512" if HAVE_AVX512BW else None,
            8: "llvm.x86.avx2.pmadd.wd" if HAVE_AVX2 else None,
            4: "llvm.x86.sse2.pmadd.wd" if HAVE_AVX2 else None}[n]
    if name:
        return _call(builder, name, ir.VectorType(_I32, n), [x, y])
    wide = ir.VectorType(_I32, 2 * n)
    p = builder.mul(builder.sext(x, wide), builder.sext(y, wide))
    return _even_odd_add(builder, p, n)


@intrinsic
def madd(typingctx, a, b):
    """x86 ``pmaddwd``: int16 x int16, adjacent products added into int32:
    ``<16 x i16>`` x ``<16 x i16>`` -> ``<8 x i32>`` (or ``<8 x i16>`` -> ``<4 x i32>``, ``<32 x i16>``
    -> ``<16 x i32>``)."""
    if not (a == b and a in (i16x32, i16x16, i16x8)):
        return None
    out = _BY_SHAPE[("i", 32, a.count // 2)]

    def codegen(context, builder, sig, args):
        return _madd_ir(builder, args[0], args[1], out.count)

    return out(a, b), codegen


@intrinsic
def madd_acc(typingctx, acc, a, b):
    """``acc + madd(a, b)`` on 8 (or 16) int32 lanes: a single ``vpdpwssd`` with AVX-512 VNNI (+VL),
    ``pmaddwd`` + ``paddd`` otherwise. Exact integer arithmetic either way (no saturation)."""
    if not (acc in (i32x8, i32x16) and a == b and a.count == 2 * acc.count and a.bits == 16):
        return None

    def codegen(context, builder, sig, args):
        s, x, y = args
        n = sig.args[0].count
        if HAVE_VNNI:
            # vpdpwssd takes its int16 operands as <n x i32> in LLVM's signature
            vt = ir.VectorType(_I32, n)
            return _call(builder, f"llvm.x86.avx512.vpdpwssd.{32 * n}", vt,
                         [s, builder.bitcast(x, vt), builder.bitcast(y, vt)])
        return builder.add(s, _madd_ir(builder, x, y, n))

    return acc(acc, a, b), codegen


@intrinsic
def vabs(typingctx, a):
    """Lane-wise absolute value of signed integers (``vpabsb``); abs(-128) stays -128 (0x80),
    which ``maddubs`` then reads as the unsigned 128, so sign tricks stay exact."""
    if not (isinstance(a, Vec) and a.kind == "i"):
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, f"llvm.abs.{_vname(sig.args[0])}", args[0].type,
                     [args[0], ir.Constant(ir.IntType(1), 0)])

    return a(a), codegen


@intrinsic
def vsign(typingctx, a, b):
    """x86 ``psignb``: per byte, ``a`` if b > 0, ``-a`` if b < 0, 0 if b == 0. With
    ``vabs`` it turns a signed x signed byte product into the unsigned x signed one ``maddubs``
    wants: x*y = |x| * sign(y, x)."""
    if not (a == b and a in (i8x32, i8x16)):
        return None

    def codegen(context, builder, sig, args):
        x, s = args
        if HAVE_AVX2:
            name = "llvm.x86.avx2.psign.b" if a == i8x32 else "llvm.x86.ssse3.psign.b.128"
            return _call(builder, name, x.type, [x, s])
        zero = ir.Constant(x.type, None)
        neg = builder.select(builder.icmp_signed("<", s, zero), builder.sub(zero, x), x)
        return builder.select(builder.icmp_signed("==", s, zero), zero, neg)

    return a(a, b), codegen


@intrinsic
def dot4_acc(typingctx, acc, a, b):
    """``acc + madd(splat_i16(1), maddubs(a, b))``: unsigned x signed bytes, 4 neighbours summed
    into each int32 lane. One ``vpdpbusd`` with AVX-512 VNNI, otherwise the two-step form.
    Equal as long as ``maddubs`` does not saturate (true for |a| <= 128, |b| <= 127)."""
    if not (acc == i32x8 and a == i8x32 and b == i8x32):
        return None

    def codegen(context, builder, sig, args):
        s, x, y = args
        v8 = ir.VectorType(_I32, 8)
        if HAVE_VNNI:
            return _call(builder, "llvm.x86.avx512.vpdpbusd.256", v8,
                         [s, builder.bitcast(x, v8), builder.bitcast(y, v8)])
        if HAVE_AVX2:
            p16 = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", i16x16.llvm_type(), [x, y])
        else:
            wide = ir.VectorType(ir.IntType(16), 32)
            p = builder.mul(builder.zext(x, wide), builder.sext(y, wide))
            p16 = _even_odd_add(builder, p, 16, sat=True)
        ones = ir.Constant(i16x16.llvm_type(), [1] * 16)
        return builder.add(s, _madd_ir(builder, ones, p16, 8))

    return i32x8(acc, a, b), codegen


# ---------------------------------------------------------------------------------------------------
# Float lanes
# ---------------------------------------------------------------------------------------------------


def _v8(c):
    return ir.Constant(ir.VectorType(_I32, 8), [c] * 8)


def _f16_bits_to_f32(builder, h):
    """``<8 x i32>`` holding fp16 bits -> ``<8 x float>``, exactly, without F16C: move exponent and
    mantissa into float32 position and rescale by 2**112 with one float multiply (exact, and it
    also normalises fp16 subnormals); Inf/NaN get the all-ones exponent."""
    f8 = f32x8.llvm_type()
    em = builder.and_(h, _v8(0x7FFF))
    sign = builder.shl(builder.and_(h, _v8(0x8000)), _v8(16))
    mag = builder.fmul(builder.bitcast(builder.shl(em, _v8(13)), f8), ir.Constant(f8, [float(2.0 ** 112)] * 8))
    infnan = builder.bitcast(builder.or_(builder.shl(em, _v8(13)), _v8(0x7F800000)), f8)
    mag = builder.select(builder.icmp_unsigned(">=", em, _v8(0x7C00)), infnan, mag)
    return builder.bitcast(builder.or_(builder.bitcast(mag, ir.VectorType(_I32, 8)), sign), f8)


def _f32_to_f16_bits(builder, x):
    """``<8 x float>`` -> ``<8 x i32>`` holding fp16 bits, rounded to nearest even (GGML's
    ``GGML_CPU_FP32_TO_FP16``), without F16C: the float arithmetic trick of GGML's portable
    ``ggml_compute_fp32_to_fp16`` (scaled by 2**112 and 2**-110 so that the FPU's own rounding
    drops the extra mantissa bits), NaN -> sign | 0x7E00."""
    f8, v8 = f32x8.llvm_type(), ir.VectorType(_I32, 8)
    w = builder.bitcast(x, v8)
    mag = builder.bitcast(builder.and_(w, _v8(0x7FFFFFFF)), f8)
    base = builder.fmul(builder.fmul(mag, ir.Constant(f8, [float(2.0 ** 112)] * 8)),
                        ir.Constant(f8, [float(2.0 ** -110)] * 8))
    shl1 = builder.add(w, w)
    bias = builder.and_(shl1, _v8(0xFF000000))
    bias = builder.select(builder.icmp_unsigned("<", bias, _v8(0x71000000)), _v8(0x71000000), bias)
    base = builder.fadd(builder.bitcast(builder.add(builder.lshr(bias, _v8(1)), _v8(0x07800000)), f8), base)
    bits = builder.bitcast(base, v8)
    nonsign = builder.add(builder.and_(builder.lshr(bits, _v8(13)), _v8(0x7C00)), builder.and_(bits, _v8(0x0FFF)))
    nonsign = builder.select(builder.icmp_unsigned(">", shl1, _v8(0xFF000000)), _v8(0x7E00), nonsign)
    return builder.or_(builder.lshr(builder.and_(w, _v8(0x80000000)), _v8(16)), nonsign)


@intrinsic
def f16x8_to_f32(typingctx, a):
    """8 fp16 bit patterns (``<8 x i16>``) to 8 float32, exactly. F16C: ``vcvtph2ps``."""
    if a != i16x8:
        return None

    def codegen(context, builder, sig, args):
        if HAVE_F16C:
            return builder.fpext(builder.bitcast(args[0], ir.VectorType(ir.HalfType(), 8)), f32x8.llvm_type())
        return _f16_bits_to_f32(builder, builder.zext(args[0], ir.VectorType(_I32, 8)))

    return f32x8(a), codegen


@intrinsic
def f32x8_to_f16(typingctx, a):
    """8 float32 to their fp16 bit patterns (``<8 x i16>``), rounded to nearest even (GGML's
    ``GGML_CPU_FP32_TO_FP16``). F16C: ``vcvtps2ph``."""
    if a != f32x8:
        return None

    def codegen(context, builder, sig, args):
        if HAVE_F16C:
            return builder.bitcast(builder.fptrunc(args[0], ir.VectorType(ir.HalfType(), 8)), i16x8.llvm_type())
        return builder.trunc(_f32_to_f16_bits(builder, args[0]), i16x8.llvm_type())

    return i16x8(a), codegen


@intrinsic
def round_f16x8(typingctx, a):
    """8 float32 rounded to the nearest fp16 value, as float32: what storing them in an F16 tensor
    and reading them back gives (GGML's F16 accumulators, such as flash attention's ``VKQ16``).
    F16C: ``vcvtps2ph`` (round to nearest even) and ``vcvtph2ps``."""
    if a != f32x8:
        return None

    def codegen(context, builder, sig, args):
        if HAVE_F16C:
            h = builder.fptrunc(args[0], ir.VectorType(ir.HalfType(), 8))
            return builder.fpext(h, f32x8.llvm_type())
        return _f16_bits_to_f32(builder, _f32_to_f16_bits(builder, args[0]))

    return f32x8(a), codegen


@intrinsic
def bf16x8_to_f32(typingctx, a):
    """8 bf16 bit patterns to 8 float32: bf16 is the top half of a float32."""
    if a != i16x8:
        return None

    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(_I32, 8)
        h = builder.shl(builder.zext(args[0], v8), ir.Constant(v8, [16] * 8))
        return builder.bitcast(h, f32x8.llvm_type())

    return f32x8(a), codegen


@intrinsic
def to_f32(typingctx, a):
    """int32 lanes to float32 lanes (``vcvtdq2ps``; exact below 2**24)."""
    if not (isinstance(a, Vec) and a.kind == "i" and a.bits == 32):
        return None
    out = _BY_SHAPE[("f", 32, a.count)]

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], out.llvm_type())

    return out(a), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` per lane, or on float32 scalars: fused (one rounding, ``vfmadd``) where the
    target has FMA, as GCC contracts GGML's C. (A ``fastmath={'contract'}`` helper would not do:
    its flags are lost when Numba inlines it into a caller compiled without them.)"""
    if a == b == c == types.float32:
        def codegen(context, builder, sig, args):
            return _call(builder, "llvm.fmuladd.f32", args[0].type, list(args))

        return types.float32(a, b, c), codegen
    if not (isinstance(a, Vec) and a.kind == "f" and a == b == c):
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, f"llvm.fmuladd.{_vname(sig.args[0])}", args[0].type, list(args))

    return a(a, b, c), codegen


@intrinsic
def hsum_f32x8(typingctx, a):
    """Sum of 8 float lanes in GGML's ``hsum_float_8`` order:
    r = lo4 + hi4; then (r0 + r2) + (r1 + r3)."""
    if a != f32x8:
        return None

    def codegen(context, builder, sig, args):
        return _hsum4(builder, _halves_added(builder, args[0]))

    return types.float32(a), codegen


def _halves_added(builder, v):
    """The low four lanes of ``<8 x float>`` ``v`` plus its high four (GGML's first reduction step)."""
    return builder.fadd(builder.shuffle_vector(v, v, _const_mask([0, 1, 2, 3])),
                        builder.shuffle_vector(v, v, _const_mask([4, 5, 6, 7])))


def _hsum4(builder, r):
    e = [builder.extract_element(r, ir.Constant(_I32, i)) for i in range(4)]
    return builder.fadd(builder.fadd(e[0], e[2]), builder.fadd(e[1], e[3]))


def _transpose_cols(builder, rs):
    """Eight 4-lane vectors ``r_c`` -> four 8-lane vectors ``T_u`` whose lane c is ``r_c[u]``: columns
    c and c + 4 share a 256-bit register, then a 4x4 transpose in each 128-bit half (unpacklo/hi,
    movelh/hl)."""
    q = [builder.shuffle_vector(rs[c], rs[c + 4], _const_mask(range(8))) for c in range(4)]
    lo, hi = _const_mask([0, 8, 1, 9, 4, 12, 5, 13]), _const_mask([2, 10, 3, 11, 6, 14, 7, 15])
    t0, t1 = builder.shuffle_vector(q[0], q[1], lo), builder.shuffle_vector(q[0], q[1], hi)
    t2, t3 = builder.shuffle_vector(q[2], q[3], lo), builder.shuffle_vector(q[2], q[3], hi)
    lh, hl = _const_mask([0, 1, 8, 9, 4, 5, 12, 13]), _const_mask([2, 3, 10, 11, 6, 7, 14, 15])
    return (builder.shuffle_vector(t0, t2, lh), builder.shuffle_vector(t0, t2, hl),
            builder.shuffle_vector(t1, t3, lh), builder.shuffle_vector(t1, t3, hl))


def _hsum4_cols(builder, rs):
    """Eight ``<4 x float>`` -> ``<8 x float>`` whose lane c is ``(r_c0 + r_c2) + (r_c1 + r_c3)``:
    the vectors transposed (``_transpose_cols``), the lane sums done 8 columns at a time."""
    T0, T1, T2, T3 = _transpose_cols(builder, rs)
    return builder.fadd(builder.fadd(T0, T2), builder.fadd(T1, T3))


@intrinsic
def transpose_pairs(typingctx, u, a0, a1, a2, a3, a4, a5, a6, a7):
    """Eight ``<8 x i16>`` ``a_c`` seen as four pairs of int16 each -> ``<16 x i16>`` whose 32-bit
    lane c is pair ``u`` (a literal 0..3) of ``a_c``: ``_transpose_cols`` on 32-bit elements. The four calls on the same vectors share their shuffles once LLVM has seen them."""
    if not (isinstance(u, types.IntegerLiteral) and all(a == i16x8 for a in (a0, a1, a2, a3, a4, a5, a6, a7))):
        return None
    k = u.literal_value

    def codegen(context, builder, sig, args):
        rs = [builder.bitcast(a, ir.VectorType(_I32, 4)) for a in args[1:]]
        return builder.bitcast(_transpose_cols(builder, rs)[k], i16x16.llvm_type())

    return i16x16(u, a0, a1, a2, a3, a4, a5, a6, a7), codegen


@intrinsic
def bcast_pair(typingctx, a, u):
    """``<16 x i16>`` whose eight 32-bit lanes all hold pair ``u`` (a literal 0..3: lanes 2u and
    2u + 1) of ``<8 x i16>`` ``a``: the mins pair of a sub-block pair, against 8 columns' sums."""
    if not (a == i16x8 and isinstance(u, types.IntegerLiteral)):
        return None
    k = u.literal_value

    def codegen(context, builder, sig, args):
        return builder.shuffle_vector(args[0], args[0], _const_mask([2 * k, 2 * k + 1] * 8))

    return i16x16(a, u), codegen


@intrinsic
def hsum_f32x8_cols(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):
    """``hsum_f32x8`` of eight vectors at once, lane c the sum of ``a_c`` (the same additions in the
    same order, so the same bits): a tile's row against 8 columns ends in ~4 instructions a column
    instead of ~8."""
    if any(a != f32x8 for a in (a0, a1, a2, a3, a4, a5, a6, a7)):
        return None

    def codegen(context, builder, sig, args):
        rs = [_halves_added(builder, v) for v in args]
        return _hsum4_cols(builder, rs)

    return f32x8(a0, a1, a2, a3, a4, a5, a6, a7), codegen


@intrinsic
def hadd_f32x8_cols(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):
    """Eight vectors' sums at once in the order of GGML's ``GGML_F32x8_REDUCE`` (``_mm_hadd_ps``
    twice): lane c is ``(r0 + r1) + (r2 + r3)`` with ``r = lo4(a_c) + hi4(a_c)``."""
    if any(a != f32x8 for a in (a0, a1, a2, a3, a4, a5, a6, a7)):
        return None

    def codegen(context, builder, sig, args):
        rs = [_halves_added(builder, v) for v in args]
        T0, T1, T2, T3 = _transpose_cols(builder, rs)
        return builder.fadd(builder.fadd(T0, T1), builder.fadd(T2, T3))

    return f32x8(a0, a1, a2, a3, a4, a5, a6, a7), codegen


@intrinsic
def hsum_f32x4_cols(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):
    """``hsum_f32x4`` of eight vectors at once, lane c the sum of ``a_c`` (same order, same bits)."""
    if any(a != f32x4 for a in (a0, a1, a2, a3, a4, a5, a6, a7)):
        return None

    def codegen(context, builder, sig, args):
        return _hsum4_cols(builder, list(args))

    return f32x8(a0, a1, a2, a3, a4, a5, a6, a7), codegen


@intrinsic
def hsum_f32x4(typingctx, a):
    """Sum of 4 float lanes as ``(a0 + a2) + (a1 + a3)`` (GGML's movehl / movehdup reduction)."""
    if a != f32x4:
        return None

    def codegen(context, builder, sig, args):
        return _hsum4(builder, args[0])

    return types.float32(a), codegen


@intrinsic
def hsum_i32(typingctx, a):
    """Sum of all int32 lanes (order is irrelevant for integers)."""
    if not (isinstance(a, Vec) and a.kind == "i" and a.bits == 32):
        return None

    def codegen(context, builder, sig, args):
        v, n = args[0], sig.args[0].count
        while n > 1:
            n //= 2
            v = builder.add(builder.shuffle_vector(v, v, _const_mask(range(n))),
                            builder.shuffle_vector(v, v, _const_mask(range(n, 2 * n))))
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.int32(a), codegen


def _transpose4_row(builder, a, u):
    """Lane ``u`` of four 4-lane vectors ``a``, side by side: ``[a0[u], a1[u], a2[u], a3[u]]``."""
    p01 = builder.shuffle_vector(a[0], a[1], _const_mask([u, 4 + u]))
    p23 = builder.shuffle_vector(a[2], a[3], _const_mask([u, 4 + u]))
    return builder.shuffle_vector(p01, p23, _const_mask([0, 1, 2, 3]))


@intrinsic
def hsum_i32x8_4(typingctx, a0, a1, a2, a3):
    """Four ``<8 x i32>`` -> ``<4 x i32>`` whose lane u is the sum of ``a_u`` (integers: any order
    gives the same sums): the halves added, then the four transposed and added, ~3 instructions a
    vector where four ``hsum_i32`` take ~6 each."""
    if any(a != i32x8 for a in (a0, a1, a2, a3)):
        return None

    def codegen(context, builder, sig, args):
        rs = [builder.add(builder.shuffle_vector(v, v, _const_mask([0, 1, 2, 3])),
                          builder.shuffle_vector(v, v, _const_mask([4, 5, 6, 7]))) for v in args]
        t = [_transpose4_row(builder, rs, u) for u in range(4)]
        return builder.add(builder.add(t[0], t[1]), builder.add(t[2], t[3]))

    return i32x4(a0, a1, a2, a3), codegen


@intrinsic
def transpose_i32x4(typingctx, u, a0, a1, a2, a3):
    """Lane ``u`` (a literal 0..3) of four ``<4 x i32>``, side by side: ``[a0[u], a1[u], a2[u], a3[u]]``
    (a 4x4 transpose, one row of it; the four calls on the same vectors share their shuffles)."""
    if not (isinstance(u, types.IntegerLiteral) and all(a == i32x4 for a in (a0, a1, a2, a3))):
        return None

    def codegen(context, builder, sig, args):
        return _transpose4_row(builder, args[1:], u.literal_value)

    return i32x4(u, a0, a1, a2, a3), codegen


@intrinsic
def lane(typingctx, a, i):
    """Lane ``i`` of a vector as a scalar."""
    if not (isinstance(a, Vec) and isinstance(i, types.Integer)):
        return None
    rt = types.float32 if a.kind == "f" else {8: types.int8, 16: types.int16, 32: types.int32}[a.bits]

    def codegen(context, builder, sig, args):
        idx = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), _I32)
        return builder.extract_element(args[0], idx)

    return rt(a, i), codegen


# ---------------------------------------------------------------------------------------------------
# Not SIMD either: software prefetch
# ---------------------------------------------------------------------------------------------------


@intrinsic
def prefetch(typingctx, arr, off):
    """Ask for the cache line at byte ``off`` of ``arr`` ahead of its use (``llvm.prefetch``: a read,
    kept in every level; ``prefetcht0``). It never faults, so ``off`` may lie past the array's end."""
    if not (_is_array(arr) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _data_ptr(context, builder, sig.args[0], args[0], args[1])
        _call(builder, "llvm.prefetch.p0", ir.VoidType(), [p, _I32(0), _I32(3), _I32(1)])
        return context.get_dummy_value()

    return types.none(arr, off), codegen


# ---------------------------------------------------------------------------------------------------
# Not SIMD, but the same escape hatch: atomics on int64 array slots, for dynamic scheduling and for
# the CPU backend's thread pool (pool.py)
# ---------------------------------------------------------------------------------------------------


def _slot_ptr(context, builder, sig, args):
    """``&arr[i]`` of a 1-D int64 array: the address an atomic works on."""
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    return builder.gep(ary.data, [context.cast(builder, args[1], sig.args[1], types.int64)])


def _int64_slot(arr, i):
    return _is_array(arr) and arr.dtype == types.int64 and isinstance(i, types.Integer)


@intrinsic
def load_acquire(typingctx, arr, i):
    """``arr[i]`` read atomically with acquire order: what another thread wrote before its
    ``store_release`` of this slot is visible after this read."""
    if not _int64_slot(arr, i):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_slot_ptr(context, builder, sig, args), "acquire", 8)

    return types.int64(arr, i), codegen


@intrinsic
def store_release(typingctx, arr, i, v):
    """``arr[i] = v`` atomically with release order (see ``load_acquire``)."""
    if not (_int64_slot(arr, i) and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(val, _slot_ptr(context, builder, sig, args), "release", 8)
        return context.get_dummy_value()

    return types.none(arr, i, v), codegen


@intrinsic
def compare_exchange(typingctx, arr, i, expected, new):
    """Atomically: if ``arr[i] == expected``, set it to ``new`` and return True; else False."""
    if not (_int64_slot(arr, i) and isinstance(expected, types.Integer) and isinstance(new, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        old = context.cast(builder, args[2], sig.args[2], types.int64)
        val = context.cast(builder, args[3], sig.args[3], types.int64)
        pair = builder.cmpxchg(_slot_ptr(context, builder, sig, args), old, val, "acq_rel", "acquire")
        return builder.extract_value(pair, 1)

    return types.boolean(arr, i, expected, new), codegen


@intrinsic
def spin_pause(typingctx):
    """The x86 ``pause`` hint inside a spin loop (the core waits a few dozen cycles and gives its
    pipeline to its sibling); nothing on other architectures."""
    def codegen(context, builder, sig, args):
        if _X86:
            _call(builder, "llvm.x86.sse2.pause", ir.VoidType(), [])
        return context.get_dummy_value()

    return types.none(), codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def fetch_add(typingctx, arr, i, v):
    """Atomically ``old = arr[i]; arr[i] += v; return old`` on an int64 array (LLVM ``atomicrmw
    add``, sequentially consistent): a counter that threads share (the pool's job generation and
    finished chunks, ``pool.py``)."""
    if not (_is_array(arr) and arr.dtype == types.int64 and isinstance(i, types.Integer)
            and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        idx = context.cast(builder, args[1], sig.args[1], types.int64)
        ptr = builder.gep(ary.data, [idx])
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return types.int64(arr, i, v), codegen
