"""GGML's quantization formats as Numba kernels, bit for bit.

Every kernel works on whole ROWS of one type, the way GGML's ``quantize_row_*_ref`` and
``dequantize_row_*`` do: ``quantize_row_<t>(x, y)`` turns ``float32[n]`` into the packed blocks
``uint8[row_size(t, n)]``, ``dequantize_row_<t>(x, y)`` goes back. ``n`` may span several tensor
rows (blocks never straddle a row, so a C-contiguous 2-D array can be passed flattened). They are
plain ``@njit`` functions, so matmul and get_rows kernels can call them from their own njit code.

Block layouts are in docs/quant-formats.md §1. The quantizers are GGML's *reference* quantizers
(no importance matrix): what ``ggml_quantize_chunk(..., imatrix=NULL)`` runs, and what the CPU
backend runs for Q8_K activations. Bit-exactness rules, all measured against libggml:

* every intermediate is a float32 (``np.float32`` scalars; beware NumPy promotion: float32 times an
  int64 or a Python float is a float64, so ints are converted with ``np.float32(i)`` first);
* C's left-to-right evaluation is kept (``w*l*x`` is ``(w*l)*x``), sums run sequentially in index
  order, divisions stay divisions;
* plain ``@njit`` never fuses ``a*b+c`` into an FMA (x86 libggml-base has no FMA either);
* ``error_model="numpy"``: a float division by zero gives inf/NaN as in C instead of raising.

Numba has no float16 on the CPU: fp16 fields are read as two bytes and decoded through
``TABLE_F32_F16`` (GGML's own ``ggml_table_f32_f16`` trick); ``fp32_to_fp16`` is a bit-level
round-to-nearest-even encoder equal to ``GGML_FP32_TO_FP16``.

What to import from here:
  fp16: ``TABLE_F32_F16``, ``fp16_to_fp32``, ``fp32_to_fp16``, ``load_f16``, ``store_f16``
  bf16: ``bf16_to_fp32``, ``fp32_to_bf16``
  rows: ``quantize_row_<t>`` / ``dequantize_row_<t>`` for t in q4_0 q4_1 q5_0 q5_1 q8_0 q8_1
        q2_K q3_K q4_K q5_K q6_K q8_K iq4_nl iq4_xs f16 bf16
  helpers: ``nearest_int``, ``get_scale_min_k4``

Which kernel serves which type is ``traits.TYPE_TRAITS_CPU`` (``from_float_ref``, ``to_float``);
the type-id switches over them are generated into ``dispatch.py`` (``quantize_chunk`` /
``dequantize_chunk``), and whole arrays go through ``convert.py`` (``quantize`` / ``dequantize``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ... import types
from ...cache import tie_cache
from ...types import KVALUES_IQ4NL, QK_K

_kernel = njit(cache=True, error_model="numpy")
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
def _load_u32(b, o):
    return (np.uint32(b[o]) | (np.uint32(b[o + 1]) << 8)
            | (np.uint32(b[o + 2]) << 16) | (np.uint32(b[o + 3]) << 24))


@_kernel
def _store_u32(b, o, v):
    b[o] = v & 0xFF
    b[o + 1] = (v >> 8) & 0xFF
    b[o + 2] = (v >> 16) & 0xFF
    b[o + 3] = (v >> 24) & 0xFF


@_kernel
def _i8(v):
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


# ----------------------------------------------------------------------------------------------
# 32-element formats: q4_0 q4_1 q5_0 q5_1 q8_0 q8_1
#   element j (0..15) sits in the low nibble of qs[j], element j+16 in the high nibble;
#   for the 5-bit ones bit 4 of element j is bit j of the 32-bit qh.
# ----------------------------------------------------------------------------------------------

QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = QK8_1 = 32
# bytes per block, from types.py's layout table (compile-time constants in the kernels)
(Q4_0_SIZE, Q4_1_SIZE, Q5_0_SIZE, Q5_1_SIZE, Q8_0_SIZE, Q8_1_SIZE, Q2_K_SIZE, Q3_K_SIZE, Q4_K_SIZE, Q5_K_SIZE,
 Q6_K_SIZE, Q8_K_SIZE, IQ4_NL_SIZE, IQ4_XS_SIZE) = (types.type_size(t) for t in (
    types.Type.Q4_0, types.Type.Q4_1, types.Type.Q5_0, types.Type.Q5_1, types.Type.Q8_0, types.Type.Q8_1,
    types.Type.Q2_K, types.Type.Q3_K, types.Type.Q4_K, types.Type.Q5_K, types.Type.Q6_K, types.Type.Q8_K,
    types.Type.IQ4_NL, types.Type.IQ4_XS))


@_kernel
def quantize_row_q4_0(x, y):
    """block_q4_0 (18 B): d fp16 @0, qs[16] @2. d = max/-8 with max the signed largest value,
    so that value lands on level 0 (= -8*d); levels are (int8_t)(x/d + 8.5), at most 15."""
    for i in range(x.shape[0] // QK4_0):
        xb = x[i * QK4_0:(i + 1) * QK4_0]
        yb = y[i * Q4_0_SIZE:(i + 1) * Q4_0_SIZE]
        _, vmax = _signed_absmax(xb)
        d = vmax / np.float32(-8.0)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        store_f16(yb, 0, d)
        for j in range(16):
            xi0 = min(15, _i8(_c_int(xb[j] * id_ + np.float32(8.5))))
            xi1 = min(15, _i8(_c_int(xb[j + 16] * id_ + np.float32(8.5))))
            yb[2 + j] = (xi0 & 0xFF) | ((xi1 << 4) & 0xFF)


@_kernel
def dequantize_row_q4_0(x, y):
    for i in range(y.shape[0] // QK4_0):
        xb = x[i * Q4_0_SIZE:(i + 1) * Q4_0_SIZE]
        d = load_f16(xb, 0)
        for j in range(16):
            y[i * 32 + j] = np.float32((xb[2 + j] & 0xF) - 8) * d
            y[i * 32 + j + 16] = np.float32((xb[2 + j] >> 4) - 8) * d


@_kernel
def quantize_row_q4_1(x, y):
    """block_q4_1 (20 B): d fp16 @0, m fp16 @2, qs[16] @4. x = d*q + m with m = min(x),
    d = (max-min)/15, levels (int8_t)((x-min)/d + 0.5), at most 15."""
    for i in range(x.shape[0] // QK4_1):
        xb = x[i * QK4_1:(i + 1) * QK4_1]
        yb = y[i * Q4_1_SIZE:(i + 1) * Q4_1_SIZE]
        vmin, vmax = _min_max(xb)
        d = (vmax - vmin) / np.float32(15.0)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        store_f16(yb, 0, d)
        store_f16(yb, 2, vmin)
        for j in range(16):
            xi0 = min(15, _i8(_c_int((xb[j] - vmin) * id_ + np.float32(0.5))))
            xi1 = min(15, _i8(_c_int((xb[j + 16] - vmin) * id_ + np.float32(0.5))))
            yb[4 + j] = (xi0 & 0xFF) | ((xi1 << 4) & 0xFF)


@_kernel
def dequantize_row_q4_1(x, y):
    for i in range(y.shape[0] // QK4_1):
        xb = x[i * Q4_1_SIZE:(i + 1) * Q4_1_SIZE]
        d = load_f16(xb, 0)
        m = load_f16(xb, 2)
        for j in range(16):
            y[i * 32 + j] = np.float32(xb[4 + j] & 0xF) * d + m
            y[i * 32 + j + 16] = np.float32(xb[4 + j] >> 4) * d + m


@_kernel
def quantize_row_q5_0(x, y):
    """block_q5_0 (22 B): d fp16 @0, qh u32 @2, qs[16] @6. Like q4_0 with 32 levels:
    d = max/-16, levels (int8_t)(x/d + 16.5), at most 31; bit 4 of each level goes to qh."""
    for i in range(x.shape[0] // QK5_0):
        xb = x[i * QK5_0:(i + 1) * QK5_0]
        yb = y[i * Q5_0_SIZE:(i + 1) * Q5_0_SIZE]
        _, vmax = _signed_absmax(xb)
        d = vmax / np.float32(-16.0)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        store_f16(yb, 0, d)
        qh = np.uint32(0)
        for j in range(16):
            xi0 = min(31, _i8(_c_int(xb[j] * id_ + np.float32(16.5)))) & 0xFF
            xi1 = min(31, _i8(_c_int(xb[j + 16] * id_ + np.float32(16.5)))) & 0xFF
            yb[6 + j] = (xi0 & 0xF) | ((xi1 & 0xF) << 4)
            qh |= np.uint32(((xi0 & 0x10) >> 4) << j)
            qh |= np.uint32(((xi1 & 0x10) >> 4) << (j + 16))
        _store_u32(yb, 2, qh)


@_kernel
def dequantize_row_q5_0(x, y):
    for i in range(y.shape[0] // QK5_0):
        xb = x[i * Q5_0_SIZE:(i + 1) * Q5_0_SIZE]
        d = load_f16(xb, 0)
        qh = _load_u32(xb, 2)
        for j in range(16):
            h0 = ((qh >> j) << 4) & 0x10
            h1 = (qh >> (j + 12)) & 0x10
            y[i * 32 + j] = np.float32(np.int64((xb[6 + j] & 0xF) | h0) - 16) * d
            y[i * 32 + j + 16] = np.float32(np.int64((xb[6 + j] >> 4) | h1) - 16) * d


@_kernel
def quantize_row_q5_1(x, y):
    """block_q5_1 (24 B): d fp16 @0, m fp16 @2, qh u32 @4, qs[16] @8. Like q4_1 with
    d = (max-min)/31 and levels (uint8_t)((x-min)/d + 0.5) (no clamp in GGML)."""
    for i in range(x.shape[0] // QK5_1):
        xb = x[i * QK5_1:(i + 1) * QK5_1]
        yb = y[i * Q5_1_SIZE:(i + 1) * Q5_1_SIZE]
        vmin, vmax = _min_max(xb)
        d = (vmax - vmin) / np.float32(31.0)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        store_f16(yb, 0, d)
        store_f16(yb, 2, vmin)
        qh = np.uint32(0)
        for j in range(16):
            xi0 = _c_int((xb[j] - vmin) * id_ + np.float32(0.5)) & 0xFF
            xi1 = _c_int((xb[j + 16] - vmin) * id_ + np.float32(0.5)) & 0xFF
            yb[8 + j] = (xi0 & 0xF) | ((xi1 & 0xF) << 4)
            qh |= np.uint32(((xi0 & 0x10) >> 4) << j)
            qh |= np.uint32(((xi1 & 0x10) >> 4) << (j + 16))
        _store_u32(yb, 4, qh)


@_kernel
def dequantize_row_q5_1(x, y):
    for i in range(y.shape[0] // QK5_1):
        xb = x[i * Q5_1_SIZE:(i + 1) * Q5_1_SIZE]
        d = load_f16(xb, 0)
        m = load_f16(xb, 2)
        qh = _load_u32(xb, 4)
        for j in range(16):
            h0 = ((qh >> j) << 4) & 0x10
            h1 = (qh >> (j + 12)) & 0x10
            y[i * 32 + j] = np.float32((xb[8 + j] & 0xF) | h0) * d + m
            y[i * 32 + j + 16] = np.float32((xb[8 + j] >> 4) | h1) * d + m


@_kernel
def _quantize_block_q8(xb, qs):
    """The q8_0/q8_1 reference block: d = amax/127, q = roundf(x/d) (computed as x*(1/d), half
    away from zero). Writes qs (32 bytes, int8 bits); returns (d, sum of the q)."""
    amax = np.float32(0.0)
    for v in xb:
        amax = amax if amax > abs(v) else abs(v)       # C's MAX(amax, fabsf(v))
    d = amax / np.float32(127.0)
    id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    qsum = 0
    for j in range(32):
        q = _i8(_c_int(_roundf(xb[j] * id_)))
        qs[j] = q & 0xFF
        qsum += q
    return d, qsum


@_kernel
def quantize_row_q8_0(x, y):
    """block_q8_0 (34 B): d fp16 @0, qs[32] int8 @2 (quantize_row_q8_0_ref)."""
    for i in range(x.shape[0] // QK8_0):
        yb = y[i * Q8_0_SIZE:(i + 1) * Q8_0_SIZE]
        d, _ = _quantize_block_q8(x[i * 32:(i + 1) * 32], yb[2:34])
        store_f16(yb, 0, d)


@_kernel
def dequantize_row_q8_0(x, y):
    for i in range(y.shape[0] // QK8_0):
        xb = x[i * Q8_0_SIZE:(i + 1) * Q8_0_SIZE]
        d = load_f16(xb, 0)
        for j in range(32):
            y[i * 32 + j] = np.float32(_i8(xb[2 + j])) * d


@_kernel
def quantize_row_q8_1(x, y):
    """block_q8_1 (36 B): d fp16 @0, s fp16 @2, qs[32] int8 @4. The reference stores
    s = d * (sum of the integer q), not the sum of the floats (CUDA's q8_1 does that)."""
    for i in range(x.shape[0] // QK8_1):
        yb = y[i * Q8_1_SIZE:(i + 1) * Q8_1_SIZE]
        d, qsum = _quantize_block_q8(x[i * 32:(i + 1) * 32], yb[4:36])
        store_f16(yb, 0, d)
        store_f16(yb, 2, np.float32(qsum) * d)


@_kernel
def dequantize_row_q8_1(x, y):
    """GGML has no q8_1 dequantizer; this is the obvious d*q (s is redundant)."""
    for i in range(y.shape[0] // QK8_1):
        xb = x[i * Q8_1_SIZE:(i + 1) * Q8_1_SIZE]
        d = load_f16(xb, 0)
        for j in range(32):
            y[i * 32 + j] = np.float32(_i8(xb[4 + j])) * d


# ----------------------------------------------------------------------------------------------
# K-quant helpers (super-blocks of QK_K = 256)
# ----------------------------------------------------------------------------------------------

GROUP_MAX_EPS = np.float32(1e-15)   # below this a group counts as all zero


@_kernel
def make_qkx2_quants(nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """Fit x ~ scale*L + min (L in 0..nmax, min <= 0) by weighted least squares over a grid of
    nstep+1 trial inverse scales (rmin + rdelta*is + nmax)/(max - min); keep the best by weighted
    squared (or, with use_mad, absolute) error. Writes L, returns (scale, the_min = -min).
    Used by q2_K (n=16), q4_K and q5_K (n=32). Every caller has nstep >= 1."""
    n = x.shape[0]
    vmin = x[0]
    vmax = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < vmin:
            vmin = x[i]
        if x[i] > vmax:
            vmax = x[i]
        w = weights[i]
        sum_w += w
        sum_x += w * x[i]
    if vmin > 0:
        vmin = np.float32(0.0)
    if vmax == vmin:
        L.fill(0)
        return np.float32(0.0), -vmin
    fnmax = np.float32(nmax)
    iscale = fnmax / (vmax - vmin)
    scale = np.float32(1.0) / iscale
    best_error = np.float32(0.0)
    for i in range(n):
        l = max(0, min(nmax, nearest_int(iscale * (x[i] - vmin))))
        L[i] = l
        diff = scale * np.float32(l) + vmin - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += weights[i] * diff
    for is_ in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(is_) + fnmax) / (vmax - vmin)
        sum_l = np.float32(0.0)
        sum_l2 = np.float32(0.0)
        sum_xl = np.float32(0.0)
        for i in range(n):
            l = max(0, min(nmax, nearest_int(iscale * (x[i] - vmin))))
            Laux[i] = l
            wl = weights[i] * np.float32(l)
            sum_l += wl
            sum_l2 += wl * np.float32(l)
            sum_xl += wl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = np.float32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = np.float32(0.0)
            for i in range(n):
                diff = this_scale * np.float32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                vmin = this_min
    return scale, -vmin


@_kernel
def make_qx_quants(nmax, x, L):
    """Symmetric fit x ~ scale*(L - nmax), L - nmax in -nmax..nmax-1, weights x^2 (GGML's
    make_qx_quants with rmse_type=1 and no quant weights, the only form the q6_K reference uses).
    Starts from iscale = -nmax/max and tries 18 nearby iscales, keeping the least-squares scale
    with the largest sumlx^2/suml2. Writes L (0..2*nmax-1), returns scale."""
    n = x.shape[0]
    amax, vmax = _signed_absmax(x)
    if amax < GROUP_MAX_EPS:
        L.fill(0)
        return np.float32(0.0)
    fnmax = np.float32(nmax)
    iscale = -fnmax / vmax
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l + nmax
        w = x[i] * x[i]
        sumlx += w * x[i] * np.float32(l)
        suml2 += w * np.float32(l) * np.float32(l)
    scale = sumlx / suml2 if suml2 != 0 else np.float32(0.0)
    best = scale * sumlx
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = -(fnmax + np.float32(0.1) * np.float32(is_)) / vmax
        sumlx = np.float32(0.0)
        suml2 = np.float32(0.0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            w = x[i] * x[i]
            sumlx += w * x[i] * np.float32(l)
            suml2 += w * np.float32(l) * np.float32(l)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@_kernel
def make_q3_quants(nmax, x, L):
    """Symmetric fit for q3_K (do_rmse form): start from iscale = -nmax/max, then up to 5 greedy
    passes that move single L values when that raises sumlx^2/suml2 (weights x^2).
    Writes L (0..2*nmax-1; all 0 for an all-zero group), returns scale."""
    n = x.shape[0]
    amax, vmax = _signed_absmax(x)
    if amax < GROUP_MAX_EPS:
        L.fill(0)
        return np.float32(0.0)
    iscale = -np.float32(nmax) / vmax
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l
        w = x[i] * x[i]
        sumlx += w * x[i] * np.float32(l)
        suml2 += w * np.float32(l) * np.float32(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            li = np.float32(L[i])
            slx = sumlx - w * x[i] * li
            if slx > 0:
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, nearest_int(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    slx += w * x[i] * np.float32(new_l)
                    sl2 += w * np.float32(new_l) * np.float32(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else np.float32(0.0)


@_kernel
def get_scale_min_k4(j, q):
    """Sub-block j's 6-bit (scale, min) from the 12 packed bytes q of q4_K/q5_K (docs/quant-formats.md §2):
    bytes 0-3 / 4-7 hold sc0..3 / m0..3 in bits 0-5 and the top 2 bits of sc4..7 / m4..7 in
    bits 6-7; bytes 8-11 hold the low 4 bits of sc4..7 (low nibble) and m4..7 (high nibble)."""
    if j < 4:
        return np.int64(q[j] & 63), np.int64(q[j + 4] & 63)
    return (np.int64((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)),
            np.int64((q[j + 4] >> 4) | ((q[j] >> 6) << 4)))


@_kernel
def _quantize_superblock_k4(xb, yb, nmax, rmin, rdelta, nstep, L, Laux, weights, scales, mins):
    """Everything q4_K and q5_K share (docs/quant-formats.md §4.2): per 32-element sub-block an affine fit by
    make_qkx2_quants with weights av_x + |x|; the 8 scales and 8 mins quantized to 6 bits against
    their maxima and packed into yb[4:16]; d, dmin as fp16 at yb[0:4]; then every level
    recomputed with the rounded scales. Leaves the final levels (0..nmax) in L."""
    max_scale = np.float32(0.0)
    max_min = np.float32(0.0)
    for j in range(QK_K // 32):
        xs = xb[32 * j:32 * j + 32]
        sum_x2 = np.float32(0.0)
        for l in range(32):
            sum_x2 += xs[l] * xs[l]
        av_x = np.sqrt(sum_x2 / np.float32(32.0))
        for l in range(32):
            weights[l] = av_x + abs(xs[l])
        scales[j], mins[j] = make_qkx2_quants(nmax, xs, weights, L[32 * j:32 * j + 32], Laux,
                                              rmin, rdelta, nstep, np.bool_(False))
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]

    inv_scale = np.float32(63.0) / max_scale if max_scale > 0 else np.float32(0.0)
    inv_min = np.float32(63.0) / max_min if max_min > 0 else np.float32(0.0)
    q = yb[4:16]
    for j in range(QK_K // 32):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)   # C stores to uint8 first
        lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        if j < 4:
            q[j] = ls
            q[j + 4] = lm
        else:
            q[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            q[j - 4] |= (ls >> 4) << 6
            q[j] |= (lm >> 4) << 6
    store_f16(yb, 0, max_scale / np.float32(63.0))
    store_f16(yb, 2, max_min / np.float32(63.0))

    d_all = load_f16(yb, 0)
    dmin_all = load_f16(yb, 2)
    for j in range(QK_K // 32):
        sc, m = get_scale_min_k4(j, q)
        d = d_all * np.float32(sc)
        if d == 0:
            continue                      # keep make_qkx2_quants' levels
        dm = dmin_all * np.float32(m)
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int((xb[32 * j + ii] + dm) / d)))


@_kernel
def _pack_2bit_128(L, qs):
    """Four 2-bit levels per byte: for each 128 elements, byte l holds elements l, l+32, l+64,
    l+96 in bits 0-1, 2-3, 4-5, 6-7 (q2_K and q3_K qs)."""
    for j in range(0, QK_K, 128):
        for l in range(32):
            qs[j // 4 + l] = (L[j + l] | (L[j + l + 32] << 2)
                              | (L[j + l + 64] << 4) | (L[j + l + 96] << 6))


# ----------------------------------------------------------------------------------------------
# q2_K: 16 sub-blocks of 16, x = d*sc*q - dmin*m with 4-bit sc, m and 2-bit q
#   block_q2_K (84 B): scales[16] @0 (sc low nibble, m high nibble), qs[64] @16, d @80, dmin @82
# ----------------------------------------------------------------------------------------------

@_kernel
def quantize_row_q2_K(x, y):
    L = np.empty(QK_K, np.uint8)
    Laux = np.empty(16, np.uint8)
    weights = np.empty(16, np.float32)
    scales = np.empty(QK_K // 16, np.float32)
    mins = np.empty(QK_K // 16, np.float32)
    q4scale = np.float32(15.0)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K:(i + 1) * QK_K]
        yb = y[i * Q2_K_SIZE:(i + 1) * Q2_K_SIZE]
        max_scale = np.float32(0.0)
        max_min = np.float32(0.0)
        for j in range(QK_K // 16):
            xs = xb[16 * j:16 * j + 16]
            for l in range(16):
                weights[l] = abs(xs[l])
            scales[j], mins[j] = make_qkx2_quants(np.int64(3), xs, weights, L[16 * j:16 * j + 16],
                                                  Laux, np.float32(-0.5), np.float32(0.1),
                                                  np.int64(15), np.bool_(True))
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]

        if max_scale > 0:
            iscale = q4scale / max_scale
            for j in range(QK_K // 16):
                yb[j] = nearest_int(iscale * scales[j]) & 0xFF
            store_f16(yb, 80, max_scale / q4scale)
        else:
            for j in range(QK_K // 16):
                yb[j] = 0
            store_f16(yb, 80, np.float32(0.0))
        if max_min > 0:
            iscale = q4scale / max_min
            for j in range(QK_K // 16):
                yb[j] = (yb[j] | (nearest_int(iscale * mins[j]) << 4)) & 0xFF
            store_f16(yb, 82, max_min / q4scale)
        else:
            store_f16(yb, 82, np.float32(0.0))

        d_all = load_f16(yb, 80)
        dmin_all = load_f16(yb, 82)
        for j in range(QK_K // 16):
            d = d_all * np.float32(yb[j] & 0xF)
            if d == 0:
                continue
            dm = dmin_all * np.float32(yb[j] >> 4)
            for ii in range(16):
                L[16 * j + ii] = max(0, min(3, nearest_int((xb[16 * j + ii] + dm) / d)))

        _pack_2bit_128(L, yb[16:80])


@_kernel
def dequantize_row_q2_K(x, y):
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q2_K_SIZE:(i + 1) * Q2_K_SIZE]
        d = load_f16(xb, 80)
        dmin = load_f16(xb, 82)
        for e in range(QK_K):
            n, r = divmod(e, 128)          # 128-element half, element inside it
            shift = 2 * (r // 32)
            sc = xb[8 * n + r // 16]       # one scale byte per 16 elements
            q = (xb[16 + 32 * n + (r % 32)] >> shift) & 3
            dl = d * np.float32(sc & 0xF)
            ml = dmin * np.float32(sc >> 4)
            y[i * QK_K + e] = dl * np.float32(q) - ml


# ----------------------------------------------------------------------------------------------
# q3_K: 16 sub-blocks of 16, symmetric, x = d*(sc-32)*(q-4) with 6-bit sc and 3-bit q
#   block_q3_K (110 B): hmask[32] @0 (bit 2 of q: element e -> byte e%32, bit e//32),
#   qs[64] @32 (low 2 bits, as q2_K), scales[12] @96 (low nibbles of sc0..7 in bytes 0-7, of
#   sc8..15 in their high nibbles; bits 4-5 of sc j in byte 8+j%4 at bit 2*(j//4)), d @108
# ----------------------------------------------------------------------------------------------

@_kernel
def _scale_q3_K(j, s):
    """6-bit scale j (0..15) of a q3_K block from its 12 scale bytes s, minus 32."""
    lo = np.int64(s[j] & 0xF) if j < 8 else np.int64(s[j - 8] >> 4)
    hi = np.int64(s[8 + j % 4] >> (2 * (j // 4))) & 3
    return (lo | (hi << 4)) - 32


@_kernel
def quantize_row_q3_K(x, y):
    L = np.empty(QK_K, np.int8)
    scales = np.empty(QK_K // 16, np.float32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K:(i + 1) * QK_K]
        yb = y[i * Q3_K_SIZE:(i + 1) * Q3_K_SIZE]
        amax = np.float32(0.0)
        max_scale = np.float32(0.0)
        for j in range(QK_K // 16):
            scales[j] = make_q3_quants(4, xb[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
            if abs(scales[j]) > amax:
                amax = abs(scales[j])
                max_scale = scales[j]

        s = yb[96:108]
        s.fill(0)
        if max_scale != 0:
            iscale = np.float32(-32.0) / max_scale
            for j in range(QK_K // 16):
                l = max(-32, min(31, _i8(nearest_int(iscale * scales[j])))) + 32
                if j < 8:
                    s[j] = l & 0xF
                else:
                    s[j - 8] |= (l & 0xF) << 4
                s[j % 4 + 8] |= (l >> 4) << (2 * (j // 4))
            store_f16(yb, 108, np.float32(1.0) / iscale)
        else:
            store_f16(yb, 108, np.float32(0.0))

        d_all = load_f16(yb, 108)
        for j in range(QK_K // 16):
            d = d_all * np.float32(_scale_q3_K(j, s))
            if d == 0:
                continue
            for ii in range(16):
                L[16 * j + ii] = max(-4, min(3, nearest_int(xb[16 * j + ii] / d))) + 4

        hmask = yb[0:32]
        hmask.fill(0)
        for j in range(QK_K):
            if L[j] > 3:
                hmask[j % 32] |= 1 << (j // 32)
                L[j] -= 4
        _pack_2bit_128(L, yb[32:96])


@_kernel
def dequantize_row_q3_K(x, y):
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q3_K_SIZE:(i + 1) * Q3_K_SIZE]
        d_all = load_f16(xb, 108)
        s = xb[96:108]
        for e in range(QK_K):
            n, r = divmod(e, 128)
            shift = 2 * (r // 32)
            q = np.int64((xb[32 + 32 * n + (r % 32)] >> shift) & 3)
            if not (xb[e % 32] >> (e // 32)) & 1:
                q -= 4
            dl = d_all * np.float32(_scale_q3_K(8 * n + r // 16, s))
            y[i * QK_K + e] = dl * np.float32(q)


# ----------------------------------------------------------------------------------------------
# q4_K / q5_K: 8 sub-blocks of 32, x = d*sc*q - dmin*m with 6-bit sc, m (get_scale_min_k4)
#   block_q4_K (144 B): d @0, dmin @2, scales[12] @4, qs[128] @16
#   block_q5_K (176 B): d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48
#   qs: for each 64 elements, byte l holds element l (low nibble) and l+32 (high nibble);
#   q5_K's bit 4 of element e is bit e//32 of qh[e%32].
# ----------------------------------------------------------------------------------------------

@_kernel
def quantize_row_q4_K(x, y):
    """quantize_row_q4_K_ref (docs/quant-formats.md §4.2)."""
    L = np.empty(QK_K, np.uint8)
    Laux = np.empty(32, np.uint8)
    weights = np.empty(32, np.float32)
    scales = np.empty(QK_K // 32, np.float32)
    mins = np.empty(QK_K // 32, np.float32)
    for i in range(x.shape[0] // QK_K):
        yb = y[i * Q4_K_SIZE:(i + 1) * Q4_K_SIZE]
        _quantize_superblock_k4(x[i * QK_K:(i + 1) * QK_K], yb, np.int64(15), np.float32(-1.0),
                                np.float32(0.1), np.int64(20), L, Laux, weights, scales, mins)
        for j in range(0, QK_K, 64):
            for l in range(32):
                yb[16 + j // 2 + l] = L[j + l] | (L[j + l + 32] << 4)


@_kernel
def dequantize_row_q4_K(x, y):
    """dequantize_row_q4_K (docs/quant-formats.md §3): y = (d*sc)*q - dmin*m, each product rounded."""
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q4_K_SIZE:(i + 1) * Q4_K_SIZE]
        d = load_f16(xb, 0)
        dmin = load_f16(xb, 2)
        q = xb[4:16]
        for c in range(4):                 # 64 elements = sub-blocks 2c (low nibbles), 2c+1
            sc, m = get_scale_min_k4(2 * c, q)
            d1 = d * np.float32(sc)
            m1 = dmin * np.float32(m)
            sc, m = get_scale_min_k4(2 * c + 1, q)
            d2 = d * np.float32(sc)
            m2 = dmin * np.float32(m)
            o = i * QK_K + 64 * c
            for l in range(32):
                b = xb[16 + 32 * c + l]
                y[o + l] = d1 * np.float32(b & 0xF) - m1
                y[o + 32 + l] = d2 * np.float32(b >> 4) - m2


@_kernel
def quantize_row_q5_K(x, y):
    """quantize_row_q5_K_ref: q4_K's algorithm with 32 levels and search (-0.5, 0.1, 15)."""
    L = np.empty(QK_K, np.uint8)
    Laux = np.empty(32, np.uint8)
    weights = np.empty(32, np.float32)
    scales = np.empty(QK_K // 32, np.float32)
    mins = np.empty(QK_K // 32, np.float32)
    for i in range(x.shape[0] // QK_K):
        yb = y[i * Q5_K_SIZE:(i + 1) * Q5_K_SIZE]
        _quantize_superblock_k4(x[i * QK_K:(i + 1) * QK_K], yb, np.int64(31), np.float32(-0.5),
                                np.float32(0.1), np.int64(15), L, Laux, weights, scales, mins)
        qh = yb[16:48]
        qh.fill(0)
        for j in range(0, QK_K, 64):
            for l in range(32):
                l1 = L[j + l]
                l2 = L[j + l + 32]
                qh[l] |= ((l1 >> 4) << (j // 32)) | ((l2 >> 4) << (j // 32 + 1))
                yb[48 + j // 2 + l] = (l1 & 0xF) | ((l2 & 0xF) << 4)


@_kernel
def dequantize_row_q5_K(x, y):
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q5_K_SIZE:(i + 1) * Q5_K_SIZE]
        d = load_f16(xb, 0)
        dmin = load_f16(xb, 2)
        q = xb[4:16]
        for c in range(4):
            sc, m = get_scale_min_k4(2 * c, q)
            d1 = d * np.float32(sc)
            m1 = dmin * np.float32(m)
            sc, m = get_scale_min_k4(2 * c + 1, q)
            d2 = d * np.float32(sc)
            m2 = dmin * np.float32(m)
            o = i * QK_K + 64 * c
            for l in range(32):
                b = xb[48 + 32 * c + l]
                h = xb[16 + l] >> (2 * c)
                y[o + l] = d1 * np.float32((b & 0xF) + ((h & 1) << 4)) - m1
                y[o + 32 + l] = d2 * np.float32((b >> 4) + ((h & 2) << 3)) - m2


# ----------------------------------------------------------------------------------------------
# q6_K: 16 sub-blocks of 16, symmetric, x = d*sc*(q-32) with int8 sc and 6-bit q
#   block_q6_K (210 B): ql[128] @0, qh[64] @128, scales[16] int8 @192, d @208 (docs/quant-formats.md §1.8)
# ----------------------------------------------------------------------------------------------

@_kernel
def quantize_row_q6_K(x, y):
    """quantize_row_q6_K_ref: make_qx_quants per 16, scales to int8 against the signed largest."""
    L = np.empty(QK_K, np.uint8)
    scales = np.empty(QK_K // 16, np.float32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K:(i + 1) * QK_K]
        yb = y[i * Q6_K_SIZE:(i + 1) * Q6_K_SIZE]
        max_scale = np.float32(0.0)
        max_abs_scale = np.float32(0.0)
        for ib in range(QK_K // 16):
            scales[ib] = make_qx_quants(32, xb[16 * ib:16 * ib + 16], L[16 * ib:16 * ib + 16])
            if abs(scales[ib]) > max_abs_scale:
                max_abs_scale = abs(scales[ib])
                max_scale = scales[ib]
        if max_abs_scale < GROUP_MAX_EPS:
            yb.fill(0)
            continue

        iscale = np.float32(-128.0) / max_scale
        store_f16(yb, 208, np.float32(1.0) / iscale)
        for ib in range(QK_K // 16):
            yb[192 + ib] = min(127, nearest_int(iscale * scales[ib])) & 0xFF

        d_all = load_f16(yb, 208)
        for j in range(QK_K // 16):
            d = d_all * np.float32(_i8(yb[192 + j]))
            if d == 0:
                continue
            for ii in range(16):
                L[16 * j + ii] = max(-32, min(31, nearest_int(xb[16 * j + ii] / d))) + 32

        for j in range(0, QK_K, 128):
            ql = yb[j // 2:j // 2 + 64]
            qh = yb[128 + j // 4:128 + j // 4 + 32]
            for l in range(32):
                q1 = L[j + l]
                q2 = L[j + l + 32]
                q3 = L[j + l + 64]
                q4 = L[j + l + 96]
                ql[l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
                ql[l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
                qh[l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)


@_kernel
def dequantize_row_q6_K(x, y):
    """dequantize_row_q6_K: y = (d*sc)*(q-32), left to right."""
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q6_K_SIZE:(i + 1) * Q6_K_SIZE]
        d = load_f16(xb, 208)
        for n in range(2):                 # 128-element halves
            ql = xb[64 * n:64 * n + 64]
            qh = xb[128 + 32 * n:128 + 32 * n + 32]
            sc = xb[192 + 8 * n:192 + 8 * n + 8]
            o = i * QK_K + 128 * n
            for l in range(32):
                is_ = l // 16
                q1 = np.int64((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
                q2 = np.int64((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
                q3 = np.int64((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
                q4 = np.int64((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
                y[o + l] = d * np.float32(_i8(sc[is_])) * np.float32(q1)
                y[o + l + 32] = d * np.float32(_i8(sc[is_ + 2])) * np.float32(q2)
                y[o + l + 64] = d * np.float32(_i8(sc[is_ + 4])) * np.float32(q3)
                y[o + l + 96] = d * np.float32(_i8(sc[is_ + 6])) * np.float32(q4)


# ----------------------------------------------------------------------------------------------
# q8_K: the CPU's activation format for the K-quants (docs/quant-formats.md §1.2, §4.3)
#   block_q8_K (292 B): d float32 @0, qs[256] int8 @4, bsums[16] int16 @260
# ----------------------------------------------------------------------------------------------

@_kernel
def quantize_row_q8_K(x, y):
    """quantize_row_q8_K_ref: iscale = -127/max with max the SIGNED largest value, so d = 1/iscale
    is negative when that value is positive; q = min(127, nearest_int(iscale*x));
    bsums[g] = sum of qs[16g..16g+15]. An all-zero block gets d = 0, qs = 0 and (unlike GGML,
    which leaves them untouched) bsums = 0. This is every activation row of a K-quant matmul, so
    each pass is a loop without branches that LLVM vectorizes: the largest |x| and the first
    index that has it in one pass, as the max of the 64-bit key (|x|'s bits << 9 | 511 - j),
    ~2x the speed of a max then a scan for it (8.9 against 16.9 µs for 128 blocks), ~10x that of
    one float pass that tracks both."""
    q = np.empty(QK_K, np.int32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K:(i + 1) * QK_K]
        yb = y[i * Q8_K_SIZE:(i + 1) * Q8_K_SIZE]
        # |x| as the bits of |x| (ordered as the values; NaN's bits count as 0): integers, which
        # vectorize where a float max (NaN's order) does not
        xi = xb.view(np.int32)
        key = np.int64(0)
        for j in range(QK_K):
            a = xi[j] & np.int32(0x7FFFFFFF)
            a = a if a <= np.int32(0x7F800000) else np.int32(0)
            key = max(key, (np.int64(a) << 9) | np.int64(511 - j))
        if key >> 9 == 0:
            yb.fill(0)
            continue
        j = 511 - (key & 511)
        iscale = np.float32(-127.0) / xb[j]
        for j in range(QK_K):   # nearest_int, in int32 lanes
            bits = np.float32(iscale * xb[j] + np.float32(12582912.0)).view(np.int32)
            q[j] = min(np.int32(127), np.int32((bits & np.int32(0x7FFFFF)) - np.int32(0x400000)))
            yb[4 + j] = np.uint8(q[j] & 0xFF)
        for g in range(QK_K // 16):
            bsum = np.int32(0)
            for j in range(16 * g, 16 * g + 16):
                bsum += q[j]
            yb[260 + 2 * g] = bsum & 0xFF
            yb[261 + 2 * g] = (bsum >> 8) & 0xFF
        _store_u32(yb, 0, np.float32(np.float32(1.0) / iscale).view(np.uint32))


@_kernel
def dequantize_row_q8_K(x, y):
    for i in range(y.shape[0] // QK_K):
        xb = x[i * Q8_K_SIZE:(i + 1) * Q8_K_SIZE]
        d = np.uint32(_load_u32(xb, 0)).view(np.float32)
        for j in range(QK_K):
            y[i * QK_K + j] = d * np.float32(_i8(xb[4 + j]))


# ----------------------------------------------------------------------------------------------
# f16 / bf16 rows (2 bytes per element, little-endian)
# ----------------------------------------------------------------------------------------------

@_kernel
def quantize_row_f16(x, y):
    for i in range(x.shape[0]):
        h = fp32_to_fp16(x[i])
        y[2 * i] = h & 0xFF
        y[2 * i + 1] = h >> 8


@_kernel
def dequantize_row_f16(x, y):
    for i in range(y.shape[0]):
        y[i] = load_f16(x, 2 * i)


@_kernel
def quantize_row_bf16(x, y):
    for i in range(x.shape[0]):
        h = fp32_to_bf16(x[i])
        y[2 * i] = h & 0xFF
        y[2 * i + 1] = h >> 8


@_kernel
def dequantize_row_bf16(x, y):
    for i in range(y.shape[0]):
        y[i] = bf16_to_fp32(np.uint32(x[2 * i]) | (np.uint32(x[2 * i + 1]) << 8))


# ----------------------------------------------------------------------------------------------
# IQ4_NL and IQ4_XS: 4-bit indices into one non-linear table of 16 levels (kvalues_iq4nl).
#   block_iq4_nl (18 B, 32 values): d fp16 @0, qs[16] @2 (element j in the low nibble of qs[j],
#     j+16 in the high one); x = d * KVALUES[index].
#   block_iq4_xs (136 B, 256 values): d fp16 @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8;
#     eight sub-blocks of 32, each with a 6-bit scale ls (low 4 bits: nibble ib%2 of
#     scales_l[ib/2]; high 2 bits: bits 2*ib of scales_h): x = d*(ls - 32) * KVALUES[index].
# ----------------------------------------------------------------------------------------------

IQ4_NTRY = 7   # scale candidates either side of the first guess (ggml_quantize_chunk's choice)


@_kernel
def _best_index_iq4(x):
    """The level of KVALUES_IQ4NL nearest to x (GGML's best_index_int8: a binary search, ties to
    the upper level)."""
    v = KVALUES_IQ4NL
    if x <= np.float32(v[0]):
        return 0
    if x >= np.float32(v[15]):
        return 15
    lo, hi = 0, 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < np.float32(v[mid]):
            hi = mid
        else:
            lo = mid
    return hi - 1 if x - np.float32(v[hi - 1]) < np.float32(v[hi]) - x else hi


@_kernel
def _iq4_sums(xb, w, id_, L):
    """Σ w·q·x and Σ w·q² with q the level nearest id_·x (levels written to L when given)."""
    sumqx = np.float32(0.0)
    sumq2 = np.float32(0.0)
    for j in range(32):
        l = _best_index_iq4(id_ * xb[j])
        if L is not None:
            L[j] = l
        q = np.float32(KVALUES_IQ4NL[l])
        sumqx += w[j] * q * xb[j]
        sumq2 += w[j] * q * q
    return sumqx, sumq2


@_kernel
def _iq4_block_scale(xb, w, L):
    """One block of 32: the scale that minimises Σ x²·(x − d·q)² over the first guess max/127 and
    the 2·IQ4_NTRY + 1 candidates (itry − 127)/max (GGML's quantize_row_iq4_nl_impl without an
    importance matrix; float32 throughout, unfused, in GGML's order). 0 for an all-zero block."""
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for j in range(32):
        w[j] = xb[j] * xb[j]
        ax = abs(xb[j])
        if ax > amax:
            amax = ax
            vmax = xb[j]
    if amax < GROUP_MAX_EPS:
        return np.float32(0.0)
    d = -vmax / np.float32(KVALUES_IQ4NL[0])
    sumqx, sumq2 = _iq4_sums(xb, w, np.float32(1.0) / d, L)
    d = sumqx / sumq2 if sumq2 > 0 else np.float32(0.0)
    best = d * sumqx
    for itry in range(-IQ4_NTRY, IQ4_NTRY + 1):
        id_ = np.float32(itry + KVALUES_IQ4NL[0]) / vmax
        sumqx, sumq2 = _iq4_sums(xb, w, id_, None)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@_kernel
def _iq4_pack(L, y, o, n):
    """Levels of n values (n/32 blocks) as nibbles at y[o:]: element j of a block low, j+16 high."""
    for i in range(n // 32):
        for j in range(16):
            y[o + 16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4)


@_kernel
def quantize_row_iq4_nl(x, y):
    w = np.empty(32, np.float32)
    L = np.empty(32, np.uint8)
    for i in range(x.shape[0] // 32):
        xb = x[32 * i:32 * (i + 1)]
        d = _iq4_block_scale(xb, w, L)
        store_f16(y, IQ4_NL_SIZE * i, d)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        for j in range(32):
            L[j] = _best_index_iq4(id_ * xb[j])
        _iq4_pack(L, y, IQ4_NL_SIZE * i + 2, 32)


@_kernel
def quantize_row_iq4_xs(x, y):
    """Per sub-block scales as IQ4_NL's, then one super-block scale d = −(the scale largest in
    magnitude)/32 and 6-bit sub-block scales l = nearest_int(scale/d), clamped to −32..31; the
    levels are chosen again for the rounded scales d·l."""
    w = np.empty(32, np.float32)
    L = np.empty(QK_K, np.uint8)
    scales = np.empty(8, np.float32)
    for i in range(x.shape[0] // QK_K):
        xs = x[QK_K * i:QK_K * (i + 1)]
        o = IQ4_XS_SIZE * i
        amax_scale = np.float32(0.0)
        max_scale = np.float32(0.0)
        for ib in range(8):
            scales[ib] = _iq4_block_scale(xs[32 * ib:32 * (ib + 1)], w, L[32 * ib:32 * (ib + 1)])
            if abs(scales[ib]) > amax_scale:
                amax_scale = abs(scales[ib])
                max_scale = scales[ib]
        d = -max_scale / np.float32(32.0)
        store_f16(y, o, d)
        id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        sh = 0
        for k in range(4):
            y[o + 4 + k] = 0
        for ib in range(8):
            l = min(31, max(-32, nearest_int(id_ * scales[ib])))
            dl = d * np.float32(l)
            idl = np.float32(1.0) / dl if dl != 0 else np.float32(0.0)
            for j in range(32):
                L[32 * ib + j] = _best_index_iq4(idl * xs[32 * ib + j])
            l += 32
            y[o + 4 + ib // 2] |= (l & 0xF) << (4 * (ib % 2))
            sh |= (l >> 4) << (2 * ib)
        y[o + 2] = sh & 0xFF
        y[o + 3] = sh >> 8
        _iq4_pack(L, y, o + 8, QK_K)


@_kernel
def dequantize_row_iq4_nl(x, y):
    for i in range(y.shape[0] // 32):
        d = load_f16(x, IQ4_NL_SIZE * i)
        for j in range(16):
            q = x[IQ4_NL_SIZE * i + 2 + j]
            y[32 * i + j] = d * np.float32(KVALUES_IQ4NL[q & 0xF])
            y[32 * i + j + 16] = d * np.float32(KVALUES_IQ4NL[q >> 4])


@_kernel
def dequantize_row_iq4_xs(x, y):
    for i in range(y.shape[0] // QK_K):
        o = IQ4_XS_SIZE * i
        d = load_f16(x, o)
        sh = np.int64(x[o + 2]) | (np.int64(x[o + 3]) << 8)
        for ib in range(8):
            ls = ((np.int64(x[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
            dl = d * np.float32(ls - 32)
            for j in range(16):
                q = x[o + 8 + 16 * ib + j]
                y[QK_K * i + 32 * ib + j] = dl * np.float32(KVALUES_IQ4NL[q & 0xF])
                y[QK_K * i + 32 * ib + j + 16] = dl * np.float32(KVALUES_IQ4NL[q >> 4])


# the cache of every kernel above also depends on types.py (its block sizes and tables)
tie_cache(globals(), "", types.__file__, __file__)
