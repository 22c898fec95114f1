"""GGML's enums (ggml.h): the tensor types with their table of ids, block sizes and bytes per block
(GGML's ``type_traits``), and the op enums a tensor records (``Op``, ``UnaryOp``, ``GluOp``; what
each op means is declared with its constructor in ``ops.py``).

The ids are GGML's and GGUF's (``enum ggml_type``), so a type read from a GGUF file is
``Type(raw_id)``. A quantized type stores ``blck_size`` elements in ``type_size`` bytes; a
row of ``ne0`` elements takes ``row_size(t, ne0)`` bytes and ``ne0`` must be a multiple of
the block size.
"""
from __future__ import annotations

import enum

import numpy as np

__all__ = ["QK_K", "Type", "Op", "UnaryOp", "GluOp", "as_type", "blck_size", "type_size", "is_quantized",
           "row_size", "np_dtype", "type_name", "block_fields", "field_offset"]

QK_K = 256  # elements in a K-quant super-block


class Type(enum.IntEnum):
    """GGML's ``enum ggml_type``: a tensor's element type, plain or block-quantized. The values are GGML's and
    GGUF's ids, so ``Type(raw_id)`` reads a type from a GGUF file."""
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ4_NL = 20
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30


# Each quantized type's block, field by field in GGML's order (docs/quant-formats.md §1): (name, NumPy
# dtype, count). Its bytes (``type_size``) and each field's offset (``field_offset``) follow from it; the
# Numba kernels and the OpenCL program read them from here.
_u8, _i8, _f16, _u16, _i16, _f32 = np.uint8, np.int8, np.float16, np.uint16, np.int16, np.float32
_BLOCKS = {
    Type.Q4_0: (32, (("d", _f16, 1), ("qs", _u8, 16))),
    Type.Q4_1: (32, (("d", _f16, 1), ("m", _f16, 1), ("qs", _u8, 16))),
    Type.Q5_0: (32, (("d", _f16, 1), ("qh", _u8, 4), ("qs", _u8, 16))),
    Type.Q5_1: (32, (("d", _f16, 1), ("m", _f16, 1), ("qh", _u8, 4), ("qs", _u8, 16))),
    Type.Q8_0: (32, (("d", _f16, 1), ("qs", _i8, 32))),
    Type.Q8_1: (32, (("d", _f16, 1), ("s", _f16, 1), ("qs", _i8, 32))),
    Type.Q2_K: (QK_K, (("scales", _u8, 16), ("qs", _u8, 64), ("d", _f16, 1), ("dmin", _f16, 1))),
    Type.Q3_K: (QK_K, (("hmask", _u8, 32), ("qs", _u8, 64), ("scales", _u8, 12), ("d", _f16, 1))),
    Type.Q4_K: (QK_K, (("d", _f16, 1), ("dmin", _f16, 1), ("scales", _u8, 12), ("qs", _u8, 128))),
    Type.Q5_K: (QK_K, (("d", _f16, 1), ("dmin", _f16, 1), ("scales", _u8, 12), ("qh", _u8, 32), ("qs", _u8, 128))),
    Type.Q6_K: (QK_K, (("ql", _u8, 128), ("qh", _u8, 64), ("scales", _i8, 16), ("d", _f16, 1))),
    Type.Q8_K: (QK_K, (("d", _f32, 1), ("qs", _i8, 256), ("bsums", _i16, 16))),
    Type.IQ4_NL: (32, (("d", _f16, 1), ("qs", _u8, 16))),
    Type.IQ4_XS: (QK_K, (("d", _f16, 1), ("scales_h", _u16, 1), ("scales_l", _u8, 4), ("qs", _u8, 128))),
}


def _block_bytes(fields):
    return sum(np.dtype(dt).itemsize * n for _, dt, n in fields)


# type -> (elements per block, bytes per block)
_TRAITS = {
    Type.F32: (1, 4),
    Type.F16: (1, 2),
    **{t: (bs, _block_bytes(fields)) for t, (bs, fields) in _BLOCKS.items()},
    Type.I8: (1, 1),
    Type.I16: (1, 2),
    Type.I32: (1, 4),
    Type.I64: (1, 8),
    Type.F64: (1, 8),
    Type.BF16: (1, 2),
}


def block_fields(t) -> tuple:
    """A quantized type's block as ``(name, NumPy dtype, count)`` fields in GGML's order."""
    return _BLOCKS[as_type(t)][1]


def field_offset(t, name) -> int:
    """The byte offset of field ``name`` in a block of quantized type ``t``."""
    off = 0
    for f, dt, n in block_fields(t):
        if f == name:
            return off
        off += np.dtype(dt).itemsize * n
    raise KeyError(f"{type_name(t)} blocks have no field {name!r}")


# NumPy dtype of the plain (non-block) types; BF16 is kept as its raw 16 bits
_NP_DTYPE = {
    Type.F32: np.float32,
    Type.F16: np.float16,
    Type.BF16: np.uint16,
    Type.I8: np.int8,
    Type.I16: np.int16,
    Type.I32: np.int32,
    Type.I64: np.int64,
    Type.F64: np.float64,
}


def as_type(t) -> Type:
    """Coerce an int, a name (``"q4_K"``) or a Type to a Type, with a clear error."""
    if isinstance(t, Type):
        return t
    if isinstance(t, str):
        try:
            return Type[t.upper()]
        except KeyError:
            raise ValueError(f"unknown tensor type {t!r}") from None
    try:
        return Type(int(t))
    except (ValueError, TypeError):
        raise ValueError(f"unknown tensor type {t!r}") from None


def blck_size(t) -> int:
    """Elements per block (1 for plain types)."""
    return _TRAITS[as_type(t)][0]


def type_size(t) -> int:
    """Bytes per block."""
    return _TRAITS[as_type(t)][1]


#: IQ4_NL's and IQ4_XS's 16 levels (GGML's kvalues_iq4nl): a 4-bit index selects one, times the scale
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)

#: the types that can hold a weight, in GGML's order (Q8_1 and Q8_K are activation formats; ints
#: and F64 are not weights): what a model file may use, and what mul_mat, get_rows, set_rows and
#: cpy take as weights (the op cases cover every one)
WEIGHT_TYPES = (Type.F32, Type.F16, Type.BF16, Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0, Type.Q2_K,
                Type.Q3_K, Type.Q4_K, Type.Q5_K, Type.Q6_K, Type.IQ4_NL, Type.IQ4_XS)


def is_quantized(t) -> bool:
    """True for the block-quantized types (more than one element per block)."""
    return blck_size(t) > 1


def row_size(t, ne0: int) -> int:
    """Bytes of a row of ``ne0`` elements (GGML's ``ggml_row_size``)."""
    bs = blck_size(t)
    if ne0 % bs:
        raise ValueError(f"row of {ne0} elements is not a multiple of {as_type(t).name}'s block size {bs}")
    return type_size(t) * (ne0 // bs)


def np_dtype(t):
    """NumPy dtype of one element of a plain type; quantized types have none (their rows are bytes)."""
    return _NP_DTYPE.get(as_type(t))


def type_name(t) -> str:
    """GGML's lower-case name, e.g. ``q4_K``, ``f32``."""
    n = as_type(t).name.lower()
    return n[:-2] + "_K" if n.endswith("_k") else n


# -- ops --------------------------------------------------------------------------------------------
class Op(enum.IntEnum):
    """GGML's ``enum ggml_op``, the ops lazyggml has (values are ours, not GGML's): ``ops.py``
    declares each one's constructor, shape rule and ``op_params``."""

    NONE = 0
    DUP = enum.auto()
    ADD = enum.auto()
    ADD1 = enum.auto()
    SUB = enum.auto()
    MUL = enum.auto()
    DIV = enum.auto()
    SQR = enum.auto()
    SQRT = enum.auto()
    LOG = enum.auto()
    SIN = enum.auto()
    COS = enum.auto()
    SUM = enum.auto()
    SUM_ROWS = enum.auto()
    MEAN = enum.auto()
    ARGMAX = enum.auto()
    REPEAT = enum.auto()
    CONCAT = enum.auto()
    NORM = enum.auto()
    RMS_NORM = enum.auto()
    MUL_MAT = enum.auto()
    MUL_MAT_ID = enum.auto()       # mixture-of-experts: each token's rows times its experts' matrices
    SCALE = enum.auto()
    CPY = enum.auto()
    CONT = enum.auto()
    RESHAPE = enum.auto()
    VIEW = enum.auto()
    PERMUTE = enum.auto()
    TRANSPOSE = enum.auto()
    GET_ROWS = enum.auto()
    SET_ROWS = enum.auto()
    DIAG_MASK_INF = enum.auto()
    SOFT_MAX = enum.auto()
    ROPE = enum.auto()
    CLAMP = enum.auto()
    PAD = enum.auto()
    FLASH_ATTN_EXT = enum.auto()   # fused attention (ops.flash_attn_ext)
    UNARY = enum.auto()
    GLU = enum.auto()
    ARGSORT = enum.auto()


class SortOrder(enum.IntEnum):
    """GGML's ``enum ggml_sort_order``: ``op_params[0]`` of an ``Op.ARGSORT`` node."""

    ASC = 0
    DESC = enum.auto()


class UnaryOp(enum.IntEnum):
    """GGML's ``enum ggml_unary_op``: ``op_params[0]`` of an ``Op.UNARY`` node."""

    ABS = 0
    SGN = enum.auto()
    NEG = enum.auto()
    STEP = enum.auto()
    TANH = enum.auto()
    ELU = enum.auto()
    RELU = enum.auto()
    SIGMOID = enum.auto()
    GELU = enum.auto()
    GELU_QUICK = enum.auto()
    SILU = enum.auto()
    HARDSWISH = enum.auto()
    HARDSIGMOID = enum.auto()
    EXP = enum.auto()
    # GGML's 14 and 15 (EXPM1, SOFTPLUS) are not here; the values are GGML's, since they travel as
    # ints (GGUF-free, but in GGML's RPC protocol's op_params)
    GELU_ERF = 16


class GluOp(enum.IntEnum):
    """GGML's ``enum ggml_glu_op``: ``op_params[0]`` of an ``Op.GLU`` node."""

    REGLU = 0
    GEGLU = enum.auto()
    SWIGLU = enum.auto()
