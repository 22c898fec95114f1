"""GGML's ``type_traits_cpu`` (and the CPU half of ``type_traits``): what the CPU backend needs to
know about each tensor type, in one table that the CPU code reads.

For a weight type ``t``, a matmul ``W(t) · x`` runs as (``matmul.py``):

    y   = from_float[vec_dot_type](x)          once per matmul, row by row
    dst = vec_dot[t](n, W_row, y_col)          for every (row, column)

and ``to_float`` turns a row of ``t`` back into float32 (GET_ROWS, copies, ``lazyggml.dequantize``),
``from_float_ref`` makes a row of ``t`` from float32 as ``ggml_quantize_chunk`` does (copies,
SET_ROWS, ``lazyggml.quantize``).

Fields of ``TypeTraitsCpu`` (rows are raw bytes: ``uint8`` 1-D arrays in GGML's block layout):

* ``vec_dot_type``: the type activations are converted to before the dot products (Q8_K for the
  K-quants and IQ4_XS, Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL, Q8_1 for Q4_1/Q5_1, the type itself for
  F32/F16/BF16);
* ``from_float_ref(x: float32[n], y: uint8[row_size])``: GGML's reference quantizer
  (``type_traits[t].from_float_ref``, what ``ggml_quantize_chunk`` runs); None for F32, whose rows
  are copied;
* ``from_float(x, y)``: quantize one row as GGML's CPU backend does for activations
  (``type_traits_cpu[t].from_float``): the reference quantizer, except for Q8_0/Q8_1, where it is
  the x86 AVX2 code (``type_legacy.quantize_row_q8_*_cpu``);
* ``to_float(x: uint8[row_size], y: float32[n])``: dequantize one row;
* ``vec_dot(n, x, y) -> float32``: dot product of one row of this type with one row of
  ``vec_dot_type``; the SIMD kernel where the type's module has one, else the reference;
* ``vec_dot_ref(n, x, y) -> float32``: the plain reference (GGML's ``*_generic`` order);
* ``dot(n, x, y, yo) -> float32`` and ``dot_cols(n, x, y, yo, ycs, ybs, nc, acc, out)``: the
  quantized matmul's kernels (one column, many columns; ``type_common.py`` says how), for the
  quantized weight types; None for the float types, which the matmul runs by element kind
  (``type_float.dot_pair_f32/f16/bf16``, ``dot_tile_f32/f16/bf16``);
* ``dot2(n, x, x2, y, yo) -> (float32, float32)`` and ``dot_cols2(n, x, x2, y, yo, ycs, ybs, nc,
  acc, out)``: the same for two weight rows at once, on 512-bit vectors (the same results, bit for
  bit); optional: the matmul pairs rows of the types that have them on CPUs with AVX-512BW.
* ``tile(n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, acc, out, dst, i3, i2, c0)``: a whole tile of
  the matmul (``dispatch.dot_tile``'s parameters), for a type that does work once per tile rather
  than once per row (Q4_K: its columns' min table); optional: other types call ``dot_cols`` row by
  row. Where a type has both, ``dot_cols2`` wins on CPUs with AVX-512BW.
* ``tiled_cols(n, x, y, yo, ycs, ybs, nc, acc, out)``: ``dot_cols`` in the order of GGML's tiled
  matmul (``tiled.py``), for the types it takes: products of 8 columns or more;
* ``repack_dot(n, x, y, yo)`` and ``repack_cols(n, x, y, yo, ycs, ybs, nc, ngemm, acc, out)``: ``dot``
  and ``dot_cols`` in the order of GGML's repacked gemv / gemm (``repack.py``: the first ``ngemm``
  columns the gemm's), for the types whose weights it repacks;
* ``tile_tiled(...)`` / ``tile_repack(...)``: a whole tile in those orders (``dispatch.tiled_tile`` /
  ``repack_tile``'s parameters), for a type that does work once per tile (Q4_K/Q5_K: the min table);
  optional, as ``tile``.

Derived, not stored: ``blck_size`` and ``type_size`` (``types.py`` holds them, for every backend),
``fast`` (whether ``vec_dot`` is a SIMD kernel).

All functions are ``@njit`` and can be called from Python or from other jitted code. Jitted code
cannot index this table by a run-time type id, so the type switches of the jitted drivers
(``quantize_chunk``, ``dequantize_chunk``, ``from_float``, ``dot``, ``dot_cols``) are generated
from it into ``dispatch.py`` by ``scripts/generate_cpu_dispatch.py``: after changing a row, run
that script (``tests/test_mul_mat_cpu.py`` fails until the committed file matches). Everything
else reads the table at import time: the matmul's weight types and ``vec_dot_type``, the types
``quantize`` / ``dequantize`` (``convert.py``) accept.

Adding a type: its kernels in its family's module (``type_<family>.py``, whose kernel names
``type_common.py`` lists), its row here, regenerate ``dispatch.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ...types import Type, as_type, blck_size, type_size
from . import repack as R
from . import tiled as T
from . import type_float as F
from . import type_iq as IQ
from . import type_k as K
from . import type_legacy as L


@dataclass(frozen=True)
class TypeTraitsCpu:
    """One row of ``TYPE_TRAITS_CPU`` (the module docstring says what each field is)."""
    type: Type
    vec_dot_type: Type
    from_float_ref: Optional[Callable]
    from_float: Optional[Callable]
    to_float: Optional[Callable]
    vec_dot: Optional[Callable]
    vec_dot_ref: Optional[Callable]
    dot: Optional[Callable] = None
    dot_cols: Optional[Callable] = None
    dot2: Optional[Callable] = None
    dot_cols2: Optional[Callable] = None
    tile: Optional[Callable] = None
    tiled_cols: Optional[Callable] = None
    repack_dot: Optional[Callable] = None
    repack_cols: Optional[Callable] = None
    tile_tiled: Optional[Callable] = None
    tile_repack: Optional[Callable] = None

    @property
    def blck_size(self) -> int:
        """Elements per block (``types.blck_size``)."""
        return blck_size(self.type)

    @property
    def type_size(self) -> int:
        """Bytes per block (``types.type_size``)."""
        return type_size(self.type)

    @property
    def fast(self) -> bool:
        """Whether ``vec_dot`` is a SIMD kernel (not the reference)."""
        return self.vec_dot is not None and self.vec_dot is not self.vec_dot_ref


def _float(t, from_float, to_float, vec_dot, vec_dot_ref):
    """A float type's row: it is its own vec_dot_type, and its reference conversion is the CPU's one
    (F32 has none: its rows are copied)."""
    return TypeTraitsCpu(t, t, None if t == Type.F32 else from_float, from_float, to_float, vec_dot, vec_dot_ref)


def _quant(t, vdt, from_float_ref, to_float, vec_dot=None, vec_dot_ref=None, dot=None, dot_cols=None,
           from_float=None, dot2=None, dot_cols2=None, tile=None, tiled_cols=None, repack_dot=None,
           repack_cols=None, tile_tiled=None, tile_repack=None):
    """A quantized type's row; ``from_float`` is the reference quantizer unless given."""
    return TypeTraitsCpu(t, vdt, from_float_ref, from_float or from_float_ref, to_float, vec_dot, vec_dot_ref,
                         dot, dot_cols, dot2, dot_cols2, tile, tiled_cols, repack_dot, repack_cols, tile_tiled,
                         tile_repack)


_ROWS = [
    _float(Type.F32, F.quantize_row_f32, F.dequantize_row_f32, F.vec_dot_f32, F.vec_dot_f32_ref),
    _float(Type.F16, F.quantize_row_f16, F.dequantize_row_f16, F.vec_dot_f16, F.vec_dot_f16_ref),
    _float(Type.BF16, F.quantize_row_bf16, F.dequantize_row_bf16, F.vec_dot_bf16, F.vec_dot_bf16_ref),
    _quant(Type.Q4_0, Type.Q8_0, L.quantize_row_q4_0, L.dequantize_row_q4_0,
           L.vec_dot_q4_0_q8_0, L.vec_dot_q4_0_q8_0_ref, L.dot_q4_0_q8_0, L.dot_cols_q4_0_q8_0,
           repack_dot=R.repack_dot_q4_0_q8_0, repack_cols=R.repack_cols_q4_0_q8_0),
    _quant(Type.Q4_1, Type.Q8_1, L.quantize_row_q4_1, L.dequantize_row_q4_1,
           L.vec_dot_q4_1_q8_1, L.vec_dot_q4_1_q8_1_ref, L.dot_q4_1_q8_1, L.dot_cols_q4_1_q8_1),
    _quant(Type.Q5_0, Type.Q8_0, L.quantize_row_q5_0, L.dequantize_row_q5_0,
           L.vec_dot_q5_0_q8_0, L.vec_dot_q5_0_q8_0_ref, L.dot_q5_0_q8_0, L.dot_cols_q5_0_q8_0),
    _quant(Type.Q5_1, Type.Q8_1, L.quantize_row_q5_1, L.dequantize_row_q5_1,
           L.vec_dot_q5_1_q8_1, L.vec_dot_q5_1_q8_1_ref, L.dot_q5_1_q8_1, L.dot_cols_q5_1_q8_1),
    _quant(Type.Q8_0, Type.Q8_0, L.quantize_row_q8_0, L.dequantize_row_q8_0,
           L.vec_dot_q8_0_q8_0, L.vec_dot_q8_0_q8_0_ref, L.dot_q8_0_q8_0, L.dot_cols_q8_0_q8_0,
           from_float=L.quantize_row_q8_0_cpu),
    _quant(Type.Q8_1, Type.Q8_1, L.quantize_row_q8_1, L.dequantize_row_q8_1,
           from_float=L.quantize_row_q8_1_cpu),
    _quant(Type.Q2_K, Type.Q8_K, K.quantize_row_q2_K, K.dequantize_row_q2_K,
           K.vec_dot_q2_K_q8_K, K.vec_dot_q2_K_q8_K_ref, K.dot_q2_K_q8_K, K.dot_cols_q2_K_q8_K,
           tiled_cols=T.tiled_cols_q2_K_q8_K),
    _quant(Type.Q3_K, Type.Q8_K, K.quantize_row_q3_K, K.dequantize_row_q3_K,
           K.vec_dot_q3_K_q8_K, K.vec_dot_q3_K_q8_K_ref, K.dot_q3_K_q8_K, K.dot_cols_q3_K_q8_K,
           tiled_cols=T.tiled_cols_q3_K_q8_K),
    _quant(Type.Q4_K, Type.Q8_K, K.quantize_row_q4_K, K.dequantize_row_q4_K,
           K.vec_dot_q4_K_q8_K, K.vec_dot_q4_K_q8_K_ref, K.dot_q4_K_q8_K, K.dot_cols_q4_K_q8_K,
           dot_cols2=K.dot_cols2_q4_K_q8_K, tile=K.tile_q4_K_q8_K, tiled_cols=T.tiled_cols_q4_K_q8_K,
           tile_tiled=T.tile_tiled_q4_K_q8_K, repack_dot=R.repack_dot_q4_K_q8_K, repack_cols=R.repack_cols_q4_K_q8_K,
           tile_repack=R.tile_repack_q4_K_q8_K),
    _quant(Type.Q5_K, Type.Q8_K, K.quantize_row_q5_K, K.dequantize_row_q5_K,
           K.vec_dot_q5_K_q8_K, K.vec_dot_q5_K_q8_K_ref, K.dot_q5_K_q8_K, K.dot_cols_q5_K_q8_K,
           tiled_cols=T.tiled_cols_q5_K_q8_K, tile_tiled=T.tile_tiled_q5_K_q8_K),
    _quant(Type.Q6_K, Type.Q8_K, K.quantize_row_q6_K, K.dequantize_row_q6_K,
           K.vec_dot_q6_K_q8_K, K.vec_dot_q6_K_q8_K_ref, K.dot_q6_K_q8_K, K.dot_cols_q6_K_q8_K,
           dot2=K.dot2_q6_K_q8_K, dot_cols2=K.dot_cols2_q6_K_q8_K, tiled_cols=T.tiled_cols_q6_K_q8_K),
    _quant(Type.Q8_K, Type.Q8_K, K.quantize_row_q8_K, K.dequantize_row_q8_K),
    _quant(Type.IQ4_NL, Type.Q8_0, IQ.quantize_row_iq4_nl, IQ.dequantize_row_iq4_nl,
           IQ.vec_dot_iq4_nl_q8_0, IQ.vec_dot_iq4_nl_q8_0_ref, IQ.dot_iq4_nl_q8_0, IQ.dot_cols_iq4_nl_q8_0,
           repack_dot=R.repack_dot_iq4_nl_q8_0, repack_cols=R.repack_cols_iq4_nl_q8_0),
    _quant(Type.IQ4_XS, Type.Q8_K, IQ.quantize_row_iq4_xs, IQ.dequantize_row_iq4_xs,
           IQ.vec_dot_iq4_xs_q8_K, IQ.vec_dot_iq4_xs_q8_K_ref, IQ.dot_iq4_xs_q8_K, IQ.dot_cols_iq4_xs_q8_K,
           tiled_cols=T.tiled_cols_iq4_xs_q8_K),
]

#: type -> its ``TypeTraitsCpu``, in GGML's type-id order
TYPE_TRAITS_CPU = {tr.type: tr for tr in sorted(_ROWS, key=lambda tr: int(tr.type))}


def get_type_traits_cpu(t) -> TypeTraitsCpu:
    """The CPU traits of type ``t`` (a Type, id or name); KeyError if the CPU has none."""
    return TYPE_TRAITS_CPU[as_type(t)]


def types_with(field: str) -> tuple:
    """The types whose traits have ``field`` (a kernel), in GGML's type-id order."""
    return tuple(t for t, tr in TYPE_TRAITS_CPU.items() if getattr(tr, field) is not None)
