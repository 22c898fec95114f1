"""GGML's ``type_traits_cpu``: what the CPU backend needs to know about each tensor type, in one table.

For a weight type ``t``, a matmul ``W(t) · x`` runs as (``matmul.py``):

    y   = from_float[vec_dot_type](x)          once per matmul, row by row
    dst = vec_dot[t](n, W_row, y_col)          for every (row, column)

and ``to_float`` turns a row of ``t`` back into float32 (GET_ROWS, copies, the slow paths).

Fields of ``TypeTraitsCpu`` (rows are raw bytes: ``uint8`` 1-D arrays in GGML's block layout):

* ``vec_dot_type``: the type activations are converted to before the dot products (Q8_K for the
  K-quants and IQ4_XS, Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL, Q8_1 for Q4_1/Q5_1, the type itself for
  F32/F16/BF16);
* ``from_float(x: float32[n], y: uint8[row_size])``: quantize one row to this type, as GGML's CPU
  backend does (for Q8_0/Q8_1 that is the x86 AVX2 code, not the ``_ref`` quantizer);
* ``to_float(x: uint8[row_size], y: float32[n])``: dequantize one row;
* ``vec_dot(n, x, y) -> float32``: dot product of one row of this type with one row of
  ``vec_dot_type``; the SIMD kernel where ``vec_dot.py`` has one, else the reference;
* ``vec_dot_ref(n, x, y) -> float32``: the plain reference (GGML's ``*_generic`` order);
* ``fast``: whether ``vec_dot`` is a SIMD kernel.

All functions are ``@njit`` and can be called from Python or from other jitted code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from numba import njit

from ...types import Type, as_type
from . import quant as Q
from . import vec_dot as V


@njit(cache=True)
def from_float_f32(x, y):
    """F32 'quantization' is a copy of the bytes."""
    y[:] = x.view(np.uint8)


@njit(cache=True)
def to_float_f32(x, y):
    y[:] = x.view(np.float32)


@dataclass(frozen=True)
class TypeTraitsCpu:
    type: Type
    vec_dot_type: Type
    from_float: Optional[Callable]
    to_float: Optional[Callable]
    vec_dot: Optional[Callable]
    vec_dot_ref: Optional[Callable]
    fast: bool


def _t(t, vdt, from_float, to_float, vec_dot, vec_dot_ref, fast):
    return t, TypeTraitsCpu(t, vdt, from_float, to_float, vec_dot, vec_dot_ref, fast)


TYPE_TRAITS_CPU = dict([
    _t(Type.F32, Type.F32, from_float_f32, to_float_f32, V.vec_dot_f32, V.vec_dot_f32_ref, True),
    _t(Type.F16, Type.F16, Q.quantize_row_f16, Q.dequantize_row_f16, V.vec_dot_f16,
       V.vec_dot_f16_ref, True),
    _t(Type.BF16, Type.BF16, Q.quantize_row_bf16, Q.dequantize_row_bf16, V.vec_dot_bf16,
       V.vec_dot_bf16_ref, True),
    _t(Type.Q4_0, Type.Q8_0, Q.quantize_row_q4_0, Q.dequantize_row_q4_0, V.vec_dot_q4_0_q8_0,
       V.vec_dot_q4_0_q8_0_ref, True),
    _t(Type.Q4_1, Type.Q8_1, Q.quantize_row_q4_1, Q.dequantize_row_q4_1, V.vec_dot_q4_1_q8_1,
       V.vec_dot_q4_1_q8_1_ref, True),
    _t(Type.Q5_0, Type.Q8_0, Q.quantize_row_q5_0, Q.dequantize_row_q5_0, V.vec_dot_q5_0_q8_0,
       V.vec_dot_q5_0_q8_0_ref, True),
    _t(Type.Q5_1, Type.Q8_1, Q.quantize_row_q5_1, Q.dequantize_row_q5_1, V.vec_dot_q5_1_q8_1,
       V.vec_dot_q5_1_q8_1_ref, True),
    _t(Type.Q8_0, Type.Q8_0, V.quantize_row_q8_0_cpu, Q.dequantize_row_q8_0, V.vec_dot_q8_0_q8_0,
       V.vec_dot_q8_0_q8_0_ref, True),
    _t(Type.Q8_1, Type.Q8_1, V.quantize_row_q8_1_cpu, Q.dequantize_row_q8_1, None, None, False),
    _t(Type.Q2_K, Type.Q8_K, Q.quantize_row_q2_K, Q.dequantize_row_q2_K, V.vec_dot_q2_K_q8_K,
       V.vec_dot_q2_K_q8_K_ref, True),
    _t(Type.Q3_K, Type.Q8_K, Q.quantize_row_q3_K, Q.dequantize_row_q3_K, V.vec_dot_q3_K_q8_K,
       V.vec_dot_q3_K_q8_K_ref, True),
    _t(Type.Q4_K, Type.Q8_K, Q.quantize_row_q4_K, Q.dequantize_row_q4_K, V.vec_dot_q4_K_q8_K,
       V.vec_dot_q4_K_q8_K_ref, True),
    _t(Type.Q5_K, Type.Q8_K, Q.quantize_row_q5_K, Q.dequantize_row_q5_K, V.vec_dot_q5_K_q8_K,
       V.vec_dot_q5_K_q8_K_ref, True),
    _t(Type.Q6_K, Type.Q8_K, Q.quantize_row_q6_K, Q.dequantize_row_q6_K, V.vec_dot_q6_K_q8_K,
       V.vec_dot_q6_K_q8_K_ref, True),
    _t(Type.Q8_K, Type.Q8_K, Q.quantize_row_q8_K, Q.dequantize_row_q8_K, None, None, False),
    _t(Type.IQ4_NL, Type.Q8_0, Q.quantize_row_iq4_nl, Q.dequantize_row_iq4_nl, V.vec_dot_iq4_nl_q8_0,
       V.vec_dot_iq4_nl_q8_0_ref, True),
    _t(Type.IQ4_XS, Type.Q8_K, Q.quantize_row_iq4_xs, Q.dequantize_row_iq4_xs, V.vec_dot_iq4_xs_q8_K,
       V.vec_dot_iq4_xs_q8_K_ref, True),
])


def get_type_traits_cpu(t) -> TypeTraitsCpu:
    """The CPU traits of type ``t`` (a Type, id or name); KeyError if the CPU has none."""
    return TYPE_TRAITS_CPU[as_type(t)]
