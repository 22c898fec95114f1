"""The OpenCL program: its sources, the -D options that give them lazyggml's op codes, and the
layout facts that Python and the kernels must agree on.

The source rule: the weight types' block sizes (``block_defines``, from ``types.py``), every header
(``*.h``: helpers, no kernels) of this package in name order, then every ``*.cl`` file in name order,
joined into one program that each device builds once. A new kernel file is picked up by being there.
"""
from __future__ import annotations

import importlib.resources

import numpy as np

from ...ops import GluOp, Op, UnaryOp
from ...types import WEIGHT_TYPES, blck_size, is_quantized, type_name, type_size

# common.h's tensor_t, field for field
TENSOR_T = np.dtype([("off", "<u8"), ("ne", "<i4", 4), ("nb", "<u8", 4)], align=True)

# Element-wise function codes of kernel_unary: GGML's unary ops keep their UnaryOp values, the
# simple math ops and SCALE/CLAMP get codes of their own. Passed to the compiler as -D options.
EW_CODES = {**{f"EW_{u.name}": int(u) for u in UnaryOp},
            "EW_SQR": 100, "EW_SQRT": 101, "EW_LOG": 102, "EW_SIN": 103, "EW_COS": 104,
            "EW_SCALE": 105, "EW_CLAMP": 106}
BINARY_OPS = (Op.ADD, Op.SUB, Op.MUL, Op.DIV)

MAX_LANES = 256     # common.h's MAX_LANES
ROW_LANES = 64      # lanes per row for the row kernels, at most


def lanes_for(n, most=ROW_LANES):
    """The smallest power of two >= n, capped at ``most``."""
    return min(most, 1 << max(0, int(n) - 1).bit_length())


def build_options():
    """The -D options that give the kernels lazyggml's op codes."""
    defs = dict(EW_CODES)
    defs.update({f"OP_{o.name}": int(o) for o in BINARY_OPS})
    defs.update({f"GLU_{g.name}": int(g) for g in GluOp})
    return [f"-D{k}={v}" for k, v in sorted(defs.items())]


def source_files():
    """The package's headers, then its kernel files, each in name order."""
    files = [f.name for f in importlib.resources.files(__package__).iterdir()]
    return sorted(f for f in files if f.endswith(".h")) + sorted(f for f in files if f.endswith(".cl"))


def block_defines():
    """Each weight type's block as quants.h reads it, from ``types.py``: ``QK_<type>`` elements in
    ``TS_<type>`` bytes, ``GPB_<type>`` groups of 16; F32, F16 and BF16 in virtual blocks of 16."""
    lines = []
    for t in WEIGHT_TYPES:
        qk = blck_size(t) if is_quantized(t) else 16
        ts = type_size(t) * (1 if is_quantized(t) else 16)
        n = type_name(t)
        lines += [f"#define QK_{n} {qk}", f"#define TS_{n} {ts}", f"#define GPB_{n} {qk // 16}"]
    return "\n".join(lines)


def program_source():
    root = importlib.resources.files(__package__)
    return "\n".join([f"// ---- block sizes (types.py) ----\n{block_defines()}"] +
                     [f"// ---- {name} ----\n{(root / name).read_text()}" for name in source_files()])
