"""lazyggml's quantizers and dequantizers against GGML itself, byte for byte.

Oracles:
* quantize: ggml-python's ``ggml_quantize_chunk(type, src, dst, 0, nrows, n_per_row, NULL)``, i.e.
  the reference quantizers of libggml-base. ``ggml_quantize_chunk`` rejects Q8_K and Q8_1, so for
  those the exported ``quantize_row_q8_K_ref`` / ``quantize_row_q8_1_ref`` are called through ctypes.
* dequantize: ``gguf.quants.dequantize`` for every type gguf supports, and libggml's exported
  ``dequantize_row_*`` as well (Q8_K has no gguf dequantizer). GGML has no Q8_1 dequantizer at all;
  Q8_1 is checked against gguf's Q8_0 dequantizer on the same (d, qs) bytes, since both are d*q.

The data are fresh every run. The seed is drawn at import, printed in every failure message and
can be replayed with ``LAZYGGML_TEST_SEED=<seed> pytest tests/test_quants.py``.
"""
from __future__ import annotations

import ctypes
import os
import platform
import secrets
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lazyggml.backends.cpu import type_common
from lazyggml.backends.cpu.traits import TYPE_TRAITS_CPU
from lazyggml.quants import dequantize, quantize
from lazyggml.types import Type, blck_size, is_quantized, row_size

import ggml  # noqa: E402  (ggml-python, the GGML oracle: the test extra installs it)

SEED = int(os.environ.get("LAZYGGML_TEST_SEED", secrets.randbits(32)))
WHERE = f"seed {SEED} (replay: LAZYGGML_TEST_SEED={SEED})"

#: every quantized type of the CPU's table, so that a new one is checked here from its first day
QUANT_TYPES = [t for t in TYPE_TRAITS_CPU if is_quantized(t)]
ALL_TYPES = QUANT_TYPES + [Type.F16, Type.BF16]
ON_X86 = platform.machine().lower() in ("x86_64", "amd64")


def rng_for(*key) -> np.random.Generator:
    """A generator per test case: the module seed mixed with the case's name."""
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


# ---------------------------------------------------------------------------------------------
# GGML oracles through ctypes
# ---------------------------------------------------------------------------------------------

def _c_fn(name):
    f = getattr(ggml.lib, name)
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    f.restype = None
    return f


def ggml_quantize(t: Type, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_rows, n = x.shape
    # zeroed: GGML's Q8_K leaves the bsums of an all-zero block unwritten, ours zeroes them
    out = np.zeros((n_rows, row_size(t, n)), np.uint8)
    if t in (Type.Q8_K, Type.Q8_1):
        _c_fn(f"quantize_row_{t.name.lower().replace('_k', '_K')}_ref")(x.ctypes.data, out.ctypes.data, x.size)
    else:
        ggml.ggml_quantize_chunk(int(t), x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                 out.ctypes.data, 0, n_rows, n, None)
    return out


def ggml_dequantize(t: Type, data: np.ndarray, n: int) -> np.ndarray:
    data = np.ascontiguousarray(data)
    out = np.empty((data.size // row_size(t, n), n), np.float32)
    _c_fn(f"dequantize_row_{t.name.lower().replace('_k', '_K')}")(data.ctypes.data, out.ctypes.data, out.size)
    return out


def assert_same_bytes(ours, ref, t, what):
    if np.array_equal(ours, ref):
        return
    ours = np.asarray(ours).reshape(ref.shape[0], -1)
    ref = np.asarray(ref).reshape(ref.shape[0], -1)
    bad = np.argwhere(ours != ref)
    r, c = bad[0]
    ts = row_size(t, blck_size(t))
    pytest.fail(f"{t.name} {what}: {len(bad)} bytes differ from GGML; first at row {r}, block "
                f"{c // ts}, byte {c % ts}: ours {ours[r, c]} ggml {ref[r, c]}; {WHERE}")


def assert_same_floats(ours, ref, t, what, nan_payloads=True):
    """Bit-for-bit float32 equality; NaN payloads too unless nan_payloads=False. Where two NaNs meet
    (random bytes: NaN d and NaN m in one block) IEEE leaves open whose payload survives, and LLVM
    may commute an fadd, so dequantized NaNs are compared as NaNs only."""
    ours = np.ascontiguousarray(ours, np.float32)
    ref = np.ascontiguousarray(ref, np.float32)
    differ = ours.view(np.uint32) != ref.view(np.uint32)
    if not nan_payloads:
        differ &= ~(np.isnan(ours) & np.isnan(ref))
    if not differ.any():
        return
    bad = np.argwhere(differ)
    i = tuple(bad[0])
    pytest.fail(f"{t.name} {what}: {len(bad)} values differ; first at {i}: ours {ours[i]!r} "
                f"ref {ref[i]!r}; {WHERE}")


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------

def make_data(kind: str, rng: np.random.Generator, shape=(4, 512)) -> np.ndarray:
    n_rows, n = shape
    if kind == "uniform":
        x = rng.uniform(-1, 1, shape)
    elif kind == "normal":
        x = rng.normal(rng.uniform(-0.5, 0.5), rng.uniform(0.1, 3), shape)
    elif kind == "student_t":
        x = rng.standard_t(2.0, shape) * 0.02
    elif kind == "cauchy":
        x = rng.standard_cauchy(shape) * 1e-3
    elif kind == "sparse":
        x = rng.normal(size=shape) * (rng.random(shape) < 0.05)
    elif kind == "zero_blocks":           # whole 32- and 256-blocks of zeros among normal data
        x = rng.normal(size=shape)
        blocks = x.reshape(n_rows, -1, 32)
        blocks[rng.random(blocks.shape[:2]) < 0.3] = 0
        x.reshape(n_rows, -1, 256)[:, ::2] = 0
    elif kind == "constant_blocks":       # every 32-block one value, sign varies
        v = rng.normal(size=(n_rows, n // 32, 1)) * rng.choice([0, 1, 1e3], size=(n_rows, n // 32, 1))
        x = np.broadcast_to(v, (n_rows, n // 32, 32)).reshape(shape)
    elif kind == "positive":              # min > 0: the K-quant fits must pin min to 0
        x = rng.uniform(0.5, 2.0, shape)
    elif kind == "ties":                  # multiples of 1/2 on q8 grids: roundf vs round-half-even
        x = rng.integers(-254, 255, shape) / 2.0
        x[:, ::32] = 127.0
    elif kind == "tiny":                  # fp16 scales underflow to subnormals or zero
        x = rng.normal(size=shape) * 10.0 ** rng.uniform(-44, -30)
    elif kind == "small":
        x = rng.normal(size=shape) * 1e-6
    elif kind == "huge":                  # fp16 scales overflow to inf, x*x overflows
        x = rng.normal(size=shape) * 10.0 ** rng.uniform(6, 37)
    elif kind == "mixed_scales":          # each 16-group its own magnitude
        x = rng.normal(size=(n_rows, n // 16, 16)) * 10.0 ** rng.uniform(-8, 8, (n_rows, n // 16, 1))
        x = x.reshape(shape)
    else:
        raise KeyError(kind)
    return np.ascontiguousarray(x, dtype=np.float32)


KINDS = ["uniform", "normal", "student_t", "cauchy", "sparse", "zero_blocks", "constant_blocks",
         "positive", "ties", "tiny", "small", "huge", "mixed_scales"]


# ---------------------------------------------------------------------------------------------
# quantizers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_quantize_matches_ggml(t, kind):
    x = make_data(kind, rng_for("quantize", t, kind))
    assert_same_bytes(quantize(t, x), ggml_quantize(t, x), t, f"quantize({kind})")


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_quantize_parallel_driver_matches_ggml(t):
    """Enough rows and elements to take the prange driver."""
    x = make_data("normal", rng_for("parallel", t), shape=(64, 1024))
    assert_same_bytes(quantize(t, x), ggml_quantize(t, x), t, "quantize(64x1024, parallel)")


@pytest.mark.skipif(not ON_X86, reason="GGML's NaN/Inf handling rests on x86 float->int conversions")
@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_quantize_non_finite_like_x86_ggml(t):
    """Not promised (undefined in C), but we reproduce x86 GGML for NaN and +-Inf inputs too."""
    rng = rng_for("non_finite", t)
    x = make_data("normal", rng, shape=(6, 512))
    x[0, rng.integers(0, 512, 9)] = np.nan
    x[1, rng.integers(0, 512, 9)] = np.inf
    x[2, rng.integers(0, 512, 9)] = -np.inf
    x[3] = np.nan
    x[4, ::3] = np.inf
    x[4, 1::3] = -np.inf
    x[5, rng.integers(0, 512, 20)] = rng.choice([np.nan, np.inf, -np.inf], 20)
    assert_same_bytes(quantize(t, x), ggml_quantize(t, x), t, "quantize(non-finite)")


FINITE_F32 = st.one_of(st.floats(-1e4, 1e4, width=32),
                       st.floats(width=32, allow_nan=False, allow_infinity=False))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=st.sampled_from(ALL_TYPES), n_rows=st.integers(1, 3), data=st.data())
def test_quantize_property(t, n_rows, data):
    """Hypothesis: any finite float32 rows (subnormal to FLT_MAX) quantize to GGML's bytes."""
    x = data.draw(hnp.arrays(np.float32, (n_rows, 256), elements=FINITE_F32))
    assert_same_bytes(quantize(t, x), ggml_quantize(t, x), t, f"quantize(hypothesis, x={x.tolist()})")


def test_q8_K_layout_and_signed_scale():
    """d is float32 and negative when the largest |x| is positive; bsums sum the int8 qs."""
    x = make_data("normal", rng_for("q8_K"), shape=(1, 512))
    x[0, 7] = 50.0                        # positive largest value in block 0 -> d < 0
    y = quantize(Type.Q8_K, x).reshape(2, 292)
    d = y[:, 0:4].copy().view(np.float32)[:, 0]
    qs = y[:, 4:260].view(np.int8).astype(np.int32)
    bsums = y[:, 260:292].copy().view(np.int16)
    assert d[0] < 0 and qs[0, 7] == -127, WHERE
    np.testing.assert_array_equal(bsums, qs.reshape(2, 16, 16).sum(-1), err_msg=WHERE)


def test_q8_K_zero_block_has_zero_bsums():
    y = quantize(Type.Q8_K, np.zeros((1, 256), np.float32))
    assert not y.any()


# ---------------------------------------------------------------------------------------------
# dequantizers
# ---------------------------------------------------------------------------------------------

def random_blocks(t: Type, rng, n_rows=3, n_per_row=512) -> np.ndarray:
    """Arbitrary bytes: every field pattern, NaN/Inf fp16 scales included."""
    return rng.integers(0, 256, (n_rows, row_size(t, n_per_row)), dtype=np.uint8)


GGUF_TYPES = [t for t in ALL_TYPES if t not in (Type.Q8_1, Type.Q8_K)]
GGML_DEQUANT_TYPES = [t for t in QUANT_TYPES if t != Type.Q8_1]


# random bytes hold NaN/Inf scales, and gguf's NumPy code warns about them
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("t", GGUF_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(t):
    rng = rng_for("dequant_gguf", t)
    for data in (random_blocks(t, rng), quantize(t, make_data("normal", rng, (3, 512)))):
        ref = gguf_dequantize(data, GGMLQuantizationType(int(t)))
        assert_same_floats(dequantize(t, data, 512), ref, t, "dequantize vs gguf", nan_payloads=False)


@pytest.mark.parametrize("t", GGML_DEQUANT_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_ggml(t):
    rng = rng_for("dequant_ggml", t)
    for data in (random_blocks(t, rng), quantize(t, make_data("normal", rng, (3, 512)))):
        assert_same_floats(dequantize(t, data, 512), ggml_dequantize(t, data, 512), t,
                           "dequantize vs ggml", nan_payloads=False)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_dequantize_q8_1_is_q8_0_of_d_and_qs():
    """GGML has no q8_1 dequantizer: d*q is checked with gguf's q8_0 on the same d and qs."""
    data = random_blocks(Type.Q8_1, rng_for("q8_1"))
    blocks = data.reshape(-1, 36)
    as_q8_0 = np.concatenate([blocks[:, 0:2], blocks[:, 4:36]], axis=1).reshape(3, -1)
    ref = gguf_dequantize(as_q8_0, GGMLQuantizationType.Q8_0)
    assert_same_floats(dequantize(Type.Q8_1, data, 512), ref, Type.Q8_1, "dequantize vs q8_0",
                       nan_payloads=False)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("t", GGUF_TYPES, ids=lambda t: t.name)
def test_dequantize_parallel_driver(t):
    data = random_blocks(t, rng_for("dequant_parallel", t), n_rows=64, n_per_row=1024)
    ref = gguf_dequantize(data, GGMLQuantizationType(int(t)))
    assert_same_floats(dequantize(t, data, 1024), ref, t, "dequantize(64x1024, parallel)",
                       nan_payloads=False)


def test_dequantize_accepts_bytes_and_readonly():
    x = make_data("normal", rng_for("bytes"), (2, 256))
    y = quantize(Type.Q4_K, x)
    ro = np.frombuffer(y.tobytes(), np.uint8)          # read-only, like an mmap'd GGUF
    assert_same_floats(dequantize(Type.Q4_K, y.tobytes(), 256), dequantize(Type.Q4_K, ro, 256),
                       Type.Q4_K, "bytes vs read-only array")


# ---------------------------------------------------------------------------------------------
# fp16 / bf16 scalars
# ---------------------------------------------------------------------------------------------

SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.996, 65520.0, -65520.0, 1e6, np.inf,
                     -np.inf, np.nan, -np.nan, 6.1035156e-05, 6.0975552e-05, 5.9604645e-08,
                     2.9802322e-08, 2.9802326e-08, 1e-45, 3.4028235e38, 0.33333334], np.float32)


def ggml_fp32_to_fp16_row(x):
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty(x.size, np.uint16)
    ggml.ggml_fp32_to_fp16_row(x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                               out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint16)), x.size)
    return out


def test_fp32_to_fp16_matches_ggml():
    bits = rng_for("fp16").integers(0, 2**32, 1 << 20, dtype=np.uint32)
    x = np.concatenate([SPECIALS, bits.view(np.float32)])
    x = np.concatenate([x, -x])
    ours = quantize(Type.F16, x).view(np.uint16).reshape(-1)
    ref = ggml_fp32_to_fp16_row(x)
    bad = np.flatnonzero(ours != ref)
    assert bad.size == 0, f"{bad.size} differ, e.g. x bits {x[bad[:5]].view(np.uint32)}; {WHERE}"


def test_fp16_table_is_exact():
    h = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, np.float32)
    ggml.ggml_fp16_to_fp32_row(h.ctypes.data_as(ctypes.POINTER(ctypes.c_uint16)),
                               out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 65536)
    assert_same_floats(type_common.TABLE_F32_F16, out, Type.F16, "fp16 table")
    assert type_common.fp16_to_fp32(0x3C00) == 1.0 and type_common.fp32_to_fp16(np.float32(-2.0)) == 0xC000


def test_bf16_specials():
    x = np.array([1.0, np.inf, -np.inf, np.nan, 1e-40, 3.4028235e38, 1.00390625, 1.01171875],
                 np.float32)
    bits = quantize(Type.BF16, x).view(np.uint16).reshape(-1)
    assert bits[0] == 0x3F80 and bits[1] == 0x7F80 and bits[2] == 0xFF80
    assert bits[3] & 0x7FC0 == 0x7FC0                     # NaN stays a (quiet) NaN
    assert bits[4] != 0                                   # subnormals are kept
    assert bits[5] == 0x7F80                              # rounds up to inf
    assert bits[6] == 0x3F80 and bits[7] == 0x3F82        # ties to even
    assert_same_bytes(quantize(Type.BF16, x), ggml_quantize(Type.BF16, x[None]), Type.BF16, "specials")


# ---------------------------------------------------------------------------------------------
# the public API: shapes and errors
# ---------------------------------------------------------------------------------------------

def test_shapes_and_f32():
    x = make_data("normal", rng_for("shapes"), (2, 768)).reshape(2, 3, 256)
    y = quantize("q4_K", x)
    assert y.shape == (6, 144) and y.dtype == np.uint8
    assert quantize(Type.Q8_0, x[0, 0]).shape == (1, 272)          # 1-D input is one row
    assert_same_bytes(quantize(Type.Q4_K, x.astype(np.float64)), y, Type.Q4_K, "float64 input")
    assert dequantize(Type.Q4_K, y, 256).shape == (6, 256)
    np.testing.assert_array_equal(dequantize(Type.F32, quantize(Type.F32, x), 256), x.reshape(6, 256))


@pytest.mark.parametrize("call, match", [
    (lambda: quantize(Type.Q4_K, np.zeros((2, 100), np.float32)), r"q4_K.*100.*block size 256"),
    (lambda: quantize(Type.Q8_0, np.zeros((2, 48), np.float32)), r"q8_0.*48.*block size 32"),
    (lambda: quantize(Type.Q4_0, np.zeros((2, 64), np.int32)), r"q4_0.*float.*int32"),
    (lambda: quantize(Type.Q4_0, np.float32(1.0)), r"q4_0.*float array"),
    (lambda: quantize(Type.I32, np.zeros((1, 32), np.float32)), r"i32.*not supported"),
    (lambda: quantize("q9_K", np.zeros((1, 32), np.float32)), r"unknown tensor type"),
    (lambda: dequantize(Type.Q6_K, np.zeros(211, np.uint8), 256), r"q6_K.*211 bytes.*210"),
    (lambda: dequantize(Type.Q4_K, np.zeros(144, np.uint8), 100), r"q4_K.*100.*block size 256"),
    (lambda: dequantize(Type.Q4_K, np.zeros(144, np.uint8), 0), r"q4_K.*0 elements"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_block_layouts_are_libggml_s():
    """types.py's layout table, which the kernels and the OpenCL program read their block sizes from:
    each quantized type's elements and bytes per block are libggml's (``ggml_blck_size``,
    ``ggml_type_size``), its fields tile the block with no gap (offsets in order), and the OpenCL
    program defines the same sizes."""
    from lazyggml.backends.opencl.program import block_defines
    from lazyggml.types import _BLOCKS, block_fields, field_offset, type_name, type_size
    defines = block_defines()
    for t in _BLOCKS:
        gt = getattr(ggml, f"GGML_TYPE_{t.name}")
        assert (blck_size(t), type_size(t)) == (ggml.ggml_blck_size(gt), ggml.ggml_type_size(gt)), t.name
        end = 0
        for name, dt, n in block_fields(t):
            assert field_offset(t, name) == end, (t.name, name)
            end += np.dtype(dt).itemsize * n
        assert end == type_size(t)
        if f"QK_{type_name(t)} " in defines:
            assert f"#define TS_{type_name(t)} {type_size(t)}\n" in defines + "\n", t.name
    with pytest.raises(KeyError, match="no field 'qs'"):
        field_offset(Type.Q6_K, "qs")
