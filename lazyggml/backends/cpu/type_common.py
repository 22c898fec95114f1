"""What the CPU kernels of every tensor type share. Those kernels live by family, one module each:

    type_float.py    F32, F16, BF16
    type_legacy.py   Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1: blocks of 32 (GGML's first formats)
    type_k.py        Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K: super-blocks of 256 (``QK_K``)
    type_iq.py       IQ4_NL, IQ4_XS: indices into a non-linear table of levels

A type's block is declared once, field by field, in ``types.py``; its module reads the block's
size from there; ``traits.py`` says which kernel serves which type. A new type is its kernels in
its family's module (or a new ``type_<family>.py``) and its row in ``traits.py``.

The kernels of a type ``t`` (rows are raw bytes: ``uint8`` 1-D arrays in GGML's block layout,
docs/quant-formats.md §1; ``n`` may span several tensor rows, since blocks never straddle one):

``quantize_row_<t>(x, y)`` / ``dequantize_row_<t>(x, y)``
    ``float32[n]`` to the packed blocks ``uint8[row_size(t, n)]`` and back, as GGML's
    ``quantize_row_*_ref`` and ``dequantize_row_*`` do: the *reference* quantizers (no importance
    matrix), what ``ggml_quantize_chunk(..., imatrix=NULL)`` runs.

``vec_dot_<w>_<a>_ref(n, x, y)``
    The dot product of a weight row with an activation row already converted to the weight's
    ``vec_dot_type`` (Q8_K for the K-quants and IQ4_XS, Q8_0 or Q8_1 for the 32-element formats):
    GGML's ``*_generic`` C code, transcribed: scalar loops, the same integer lanes, the same
    float32 accumulation order, unfused multiplies. The oracle of the fast kernels. Both sides hold
    small integers, so the inner loop is integer multiply-adds and floats appear once per block:

        Σ_blocks  d_w·d_a · Σ_sub-blocks scale_s · Σ_{e in s} q_w[e]·q_a[e]   (− the min/offset term)

``dot_<w>_<a>(n, x, y, yo)``  (``vec_dot_<w>_<a>(n, x, y)`` = the same with yo = 0)
    One row against one column with the SIMD vocabulary of ``simd.py``, following GGML's AVX2
    kernel lane for lane: per block 8 int32 lanes of exact integer sums, converted once and added
    into 8 float lanes with one FMA; the horizontal sum happens once, at the end of the row. With
    FMA hardware the result is bit-identical to GGML's AVX2 ``ggml_vec_dot_*`` (the tests check it).

``dot_cols_<w>_<a>(n, x, y, yo, ycs, ybs, nc, acc, out)``
    One weight row against ``nc`` columns at once (column c's block i is at byte
    ``yo + c*ycs + i*ybs`` of ``y``); ``out[c]`` receives each dot product; ``acc`` holds
    ``acc_floats(n, nc)`` floats. Each weight block is unpacked (nibbles split, scales broadcast)
    ONCE and then used for every column, while the per-column float lanes wait in the scratch array
    ``acc`` (``ACC_PER_COL`` float32 per column, in L1). Per (row, column) it does exactly the
    arithmetic of ``dot_*``, so the results are identical; it just skips redoing the unpacking for
    each column. This is what makes prefill faster than GGML's column-by-column ``vec_dot`` loop
    (see bench/results/mul_mat_cpu.md).

``tile_<w>_<a>(n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, acc, out, dst, i3, i2, c0)``
    A whole tile of the matmul (its rows against its columns), for a type with work that depends
    only on the columns (Q4_K: their min-term table), done once for all rows, then ``dot_cols``
    row by row.

``dot2_<w>_<a>(n, x, x2, y, yo)`` and ``dot_cols2_<w>_<a>(n, x, x2, y, yo, ycs, ybs, nc, acc, out)``
    ``dot_*`` and ``dot_cols_*`` of two weight rows at once, on 512-bit vectors: row x in the low
    256 bits, x2 in the high, the activations widened to both halves (``simd.widen_as``, one
    ``vbroadcasti64x4``), so each AVX-512 instruction does both rows' lanes. Per row, the lanes and
    operations of the one-row kernel: the same results, bit for bit. Measured on the dev machine
    (one thread, weights in cache, best of 15), 16 columns: Q4_K 5.2-6.2 -> 4.4-4.7 ns a block and
    column at 768 elements, 5.0-5.4 -> 3.7-3.9 at 2048; Q6_K 4.6-4.9 -> 3.6-3.7 at 768. One column:
    Q6_K 8.5 -> 6.6-7.4 ns a block, but Q4_K 8.6 -> 9.9 at 2048 elements (its two rows' scales are
    unpacked by scalar code and moved into vectors on the shuffle port that the 512-bit
    multiplies also need), so Q4_K has no ``dot2``. Types without them run row by row, and so
    does every type on a CPU without AVX-512BW, where LLVM splits 512-bit operations in two and
    emulates the byte multiply-adds (AMD Zen 3: Q6_K mat-vec 2.2x slower through ``dot2``).

Every quantized weight type has ``quantize_row``, ``dequantize_row``, ``vec_dot_*_ref``, ``dot``
and ``dot_cols``; the others are optional.

Bit-exactness rules of the reference code, all measured against libggml:

* every intermediate is a float32 (``np.float32`` scalars; beware NumPy promotion: float32 times an
  int64 or a Python float is a float64, so ints are converted with ``np.float32(i)`` first);
* C's left-to-right evaluation is kept (``w*l*x`` is ``(w*l)*x``), sums run sequentially in index
  order, divisions stay divisions;
* plain ``@njit`` never fuses ``a*b+c`` into an FMA (x86 libggml-base has no FMA either);
* ``error_model="numpy"`` (``_kernel``): a float division by zero gives inf/NaN as in C instead of
  raising.

Numba has no float16 on the CPU: fp16 fields are read as two bytes and decoded through
``TABLE_F32_F16`` (GGML's own ``ggml_table_f32_f16`` trick); ``fp32_to_fp16`` is a bit-level
round-to-nearest-even encoder equal to ``GGML_FP32_TO_FP16``. This module holds those
conversions, the byte readers and writers of block fields, GGML's rounding helpers and the
scratch layout of ``dot_cols_*``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ... import types
from ...cache import tie_cache
from ...types import QK_K
from . import simd
from .simd import (concat, dot4_acc, fma, hsum_f32x4, hsum_f32x4_cols, hsum_f32x8, hsum_f32x8_cols, lo_half,
                   load_f32x8, load_i8x16, load_i8x32, splat_f32x8, splat_i32x8, store_f32x8, to_f32, vadd, vand,
                   vsign, vsrl)


#: the decorators: ``_kernel`` for the reference quantizers (C's float division), ``_ref`` for the
#: reference dot products, ``_fast`` for the SIMD kernels
_kernel = njit(cache=True, error_model="numpy")
_ref = njit(cache=True)
_fast = njit(cache=True)
# Numba compiles a separate copy of a callee for every distinct *literal* argument; the big shared
# fits are therefore called with np.int64(...) / np.bool_(...) wrapped constants (one copy each).

# ----------------------------------------------------------------------------------------------
# fp16 / bf16 scalars
# ----------------------------------------------------------------------------------------------

# fp16 bits -> float32, all 65536 of them (GGML's ggml_table_f32_f16). A global array is frozen
# into the compiled code as a constant, so a lookup is one load. GGML's conversion goes through a
# float multiply, which quiets signalling NaNs; NumPy keeps them, so set the quiet bit like GGML.
TABLE_F32_F16 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
TABLE_F32_F16.view(np.uint32)[np.isnan(TABLE_F32_F16)] |= 0x00400000


@_kernel
def fp16_to_fp32(h):
    """fp16 bits (any int) -> float32, exact."""
    return TABLE_F32_F16[h]


@_kernel
def fp32_to_fp16(f):
    """float32 -> fp16 bits as GGML_FP32_TO_FP16: round to nearest even, too large -> inf,
    NaN -> sign | 0x7E00."""
    w = np.float32(f).view(np.uint32)
    sign = (w >> 16) & 0x8000
    a = w & 0x7FFFFFFF
    if a > 0x7F800000:                     # NaN
        return np.uint16(sign | 0x7E00)
    if a >= 0x477FF000:                    # >= 65520 rounds past 65504 (ties go to even = inf)
        return np.uint16(sign | 0x7C00)
    if a < 0x38800000:                     # below 2^-14: an fp16 subnormal, unit 2^-24
        # |f| * 2^24 is exact, np.rint rounds half to even
        return np.uint16(sign | int(np.rint(abs(np.float32(f)) * np.float32(16777216.0))))
    a -= 0x38000000                        # rebias the exponent from 127 to 15
    # drop 13 mantissa bits, rounding to nearest even; a carry correctly bumps the exponent
    return np.uint16(sign | ((a + 0xFFF + ((a >> 13) & 1)) >> 13))


@_kernel
def bf16_to_fp32(h):
    """bf16 bits -> float32: the bits are the top half of a float32."""
    return np.uint32(np.uint32(h) << 16).view(np.float32)


@_kernel
def fp32_to_bf16(f):
    """float32 -> bf16 bits as ggml_compute_fp32_to_bf16: NaN kept and made quiet, otherwise
    round to nearest even; subnormals kept."""
    u = np.int64(np.float32(f).view(np.uint32))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16((u >> 16) | 64)
    return np.uint16((u + (0x7FFF + ((u >> 16) & 1))) >> 16)


# ----------------------------------------------------------------------------------------------
# little-endian fields inside a uint8 block buffer
# ----------------------------------------------------------------------------------------------

@_kernel
def load_f16(b, o):
    """The fp16 field at byte offset o, as float32."""
    return TABLE_F32_F16[np.int64(b[o]) | (np.int64(b[o + 1]) << 8)]


@_kernel
def store_f16(b, o, f):
    """Store float32 f as an fp16 field at byte offset o."""
    h = fp32_to_fp16(f)
    b[o] = h & 0xFF
    b[o + 1] = h >> 8


@_kernel
def _store_u32(b, o, v):
    b[o] = v & 0xFF
    b[o + 1] = (v >> 8) & 0xFF
    b[o + 2] = (v >> 16) & 0xFF
    b[o + 3] = (v >> 24) & 0xFF


@_kernel
def _wrap_i8(v):
    """Reinterpret the low byte of v as int8 (C's conversion to int8_t)."""
    return ((np.int64(v) + 128) & 0xFF) - 128


# ----------------------------------------------------------------------------------------------
# GGML's rounding helpers
# ----------------------------------------------------------------------------------------------

@_kernel
def nearest_int(fval):
    """GGML's nearest_int: add 1.5*2^23 in float32 and read the low mantissa bits. Round half
    to even for |fval| < 2^22; NaN gives 0 (defined here for every input, like the C bit trick)."""
    bits = np.float32(np.float32(fval) + np.float32(12582912.0)).view(np.int32)
    return (np.int64(bits) & 0x7FFFFF) - 0x400000


@_kernel
def _c_int(f):
    """C's float -> int conversion as x86 does it (cvttss2si): truncate toward zero; NaN and
    out-of-range values give INT_MIN. GGML's 32-element quantizers rely on it."""
    if not (-2147483648.0 <= f < 2147483648.0):
        return np.int64(-2147483648)
    return np.int64(f)


@_kernel
def _roundf(f):
    """C's roundf: round half away from zero (used by q8_0/q8_1, unlike nearest_int)."""
    t = np.trunc(f)
    r = f - t                              # exact in float32
    if r >= np.float32(0.5):
        t += np.float32(1.0)
    elif r <= np.float32(-0.5):
        t -= np.float32(1.0)
    return t


@_kernel
def _signed_absmax(x):
    """(amax, max): the largest |x| and the signed value that has it; the first one wins a tie."""
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for v in x:
        if abs(v) > amax:
            amax = abs(v)
            vmax = v
    return amax, vmax


@_kernel
def _min_max(x):
    """(min, max) as the _1 formats scan them, from FLT_MAX / -FLT_MAX."""
    vmin = np.float32(3.4028234663852886e38)
    vmax = np.float32(-3.4028234663852886e38)
    for v in x:
        if v < vmin:
            vmin = v
        if v > vmax:
            vmax = v
    return vmin, vmax



GROUP_MAX_EPS = np.float32(1e-15)   # below this a group counts as all zero (the K and IQ quantizers)


# =================================================================================================
# Scalar byte readers for the reference kernels (plain code, no SIMD)
# =================================================================================================

@_ref
def _u8(b, o):
    return np.int32(b[o])


@_ref
def _i8(b, o):
    v = np.int32(b[o])
    return v - ((v & 0x80) << 1)


@_ref
def _i16(b, o):
    v = np.int32(b[o]) | (np.int32(b[o + 1]) << 8)
    return v - ((v & 0x8000) << 1)


@_ref
def _u32(b, o):
    return (np.uint32(b[o]) | (np.uint32(b[o + 1]) << 8) | (np.uint32(b[o + 2]) << 16)
            | (np.uint32(b[o + 3]) << 24))


@_ref
def _f32(b, o):
    return np.uint32(_u32(b, o)).view(np.float32)


@_ref
def _bf16(b, o):
    return np.uint32((np.uint32(b[o]) | (np.uint32(b[o + 1]) << 8)) << 16).view(np.float32)


@njit(inline="always")
def _rows2(x, x2, o):
    """The 32 bytes at ``o`` of row ``x`` and of row ``x2``, side by side in one 512-bit vector."""
    return concat(load_i8x32(x, o), load_i8x32(x2, o))


# ------------------------------------------------------------------------------------------------
# Pieces of the SIMD kernels of several families: the columns' scratch and sums, two rows in one
# vector, scalar FMA, 32-element blocks
# ------------------------------------------------------------------------------------------------

#: floats of per-column scratch that ``dot_cols_*`` (16) and ``dot_cols2_*`` (32) need in ``acc``
ACC_PER_COL = 32


@_fast
def _col_sums(acc, cst, mins, nc, out):
    """The end of a row's ``dot_cols_*``: ``out[c]`` = ``hsum_f32x8`` of the 8 float lanes at byte
    ``cst * c`` of ``acc``, plus, where ``mins >= 0``, ``hsum_f32x4`` of the 4 at byte ``cst * c + mins``
    (the K-quants' min term). Eight columns at a time through ``simd.hsum_*_cols``: the same sums in
    the same order, with ~half the instructions; with rows of one super-block (a 3.7M model's, whose
    n_embd is 256) that end is a fifth of a tile's work."""
    c = 0
    while c + 8 <= nc:
        s = hsum_f32x8_cols(load_f32x8(acc, cst * c), load_f32x8(acc, cst * (c + 1)), load_f32x8(acc, cst * (c + 2)),
                            load_f32x8(acc, cst * (c + 3)), load_f32x8(acc, cst * (c + 4)), load_f32x8(acc, cst * (c + 5)),
                            load_f32x8(acc, cst * (c + 6)), load_f32x8(acc, cst * (c + 7)))
        if mins >= 0:
            o = cst * c + mins
            s = vadd(s, hsum_f32x4_cols(lo_half(load_f32x8(acc, o)), lo_half(load_f32x8(acc, o + cst)),
                                        lo_half(load_f32x8(acc, o + 2 * cst)), lo_half(load_f32x8(acc, o + 3 * cst)),
                                        lo_half(load_f32x8(acc, o + 4 * cst)), lo_half(load_f32x8(acc, o + 5 * cst)),
                                        lo_half(load_f32x8(acc, o + 6 * cst)), lo_half(load_f32x8(acc, o + 7 * cst))))
        store_f32x8(out, 4 * c, s)
        c += 8
    for c in range(c, nc):
        s = hsum_f32x8(load_f32x8(acc, cst * c))
        if mins >= 0:
            s += hsum_f32x4(lo_half(load_f32x8(acc, cst * c + mins)))
        out[c] = s


#: bytes of Q4_K's min table (``type_k._k4_min_table``) per super-block and group of 8 columns: the
#: four pair vectors, 8 d's
K4_TABLE_BYTES = 160


@njit(cache=True)
def acc_floats(n, nc):
    """Floats of scratch ``acc`` that ``dot_cols_*`` / ``tile_*`` need for nc columns of n elements:
    ``ACC_PER_COL`` per column, then the Q4_K min table (``_k4_min_table``)."""
    return ACC_PER_COL * nc + (n // QK_K) * (nc // 8) * (K4_TABLE_BYTES // 4)


@njit(inline="always")
def _zero_cols(acc, nc, nvec):
    """Zero the first ``nvec`` 8-float lane vectors of each of nc columns' accumulators in ``acc``
    (``dot_cols_*``'s layout: 16 floats, 64 bytes, a column)."""
    zero = splat_f32x8(0.0)
    for c in range(nc):
        for v in range(nvec):
            store_f32x8(acc, 64 * c + 32 * v, zero)


@njit(inline="always")
def _fmaf(a, b, c):
    """a*b + c on float32 scalars, fused where the target has FMA: GCC contracts GGML's C
    ``summs += dmin * x`` the same way."""
    return fma(np.float32(a), np.float32(b), np.float32(c))


@njit(inline="always")
def _q8_block_f32(ax, sx, qy):
    """float(Σ_4 x·y) in 8 lanes: x·y = |x|·sign(y, x), an unsigned x signed product
    (GGML's mul_sum_i8_pairs_float; with VNNI one vpdpbusd)."""
    return to_f32(dot4_acc(splat_i32x8(0), ax, vsign(qy, sx)))


@njit(inline="always")
def _nibbles(x, o):
    """16 bytes at ``o`` -> 32 quants: low nibbles are elements 0-15, high ones 16-31."""
    raw = load_i8x16(x, o)
    m4 = simd.splat_i8x16(0xF)
    return concat(vand(raw, m4), vand(vsrl(raw, 4), m4))


# the cache of every kernel above also depends on these files (lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, types.__file__, __file__)
