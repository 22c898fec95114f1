"""The glue between graph nodes and kernel launches: one ``@forward`` function per op family.

Each function reads the node's sources, shapes and op params (through ``ops``' typed accessors),
turns byte strides into element strides and launches on ``be.stream``. ``supports`` functions are
honest: what they accept is what the kernels compute.

MUL_MAT picks its kernel as below: Q4_K as GGML's ``ggml_cuda_mul_mat`` does for an H200
(docs/quant-formats.md §6.5); the other paths are lazyggml's choice:

* src0 Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS
  (``mmvq.VEC_DOT``), at most 8 columns: quantize src1 to q8_1, then **mmvq**;
  the quantized src1 stays in the backend's work area, and the next product of the same src1
  (a layer's q, k and v; gate and up) uses it as is (``CUDABackend.q8_of`` says whose it is);
* src0 Q4_K, more columns: quantize src1 to q8_1 in the DS4 mmq layout, then **mmq** (K split
  over more blocks when the tiles are too few to fill the GPU);
* the other types of ``mmvq.VEC_DOT``, 9 to ``MMVQ_GROUPED_MAX_COLS`` (64) columns, a 2-D product:
  quantize src1 to q8_1 once (shared as above), then **mmvq on groups of 8 columns**, the last
  group narrower; each group reads the weights again, which up to 64 columns costs less than the
  dequantization below (GGML takes its mmq here, which lazyggml has for Q4_K only);
* any other quantized src0 with more columns, 3-D or 4-D products (or a view that mmvq cannot
  read, below): dequantize src0 to F16 scratch (F32 without tensor cores), then the float kernels
  (GGML's dequantize + cuBLAS path);
* src0 F32/F16/BF16 (BF16 read through a uint16 view): the mat-vec kernels up to 8 columns, else
  the tensor-core ``mul_mat_f_mma`` for F16 and BF16 with packed rows (src1 rounded to the weights'
  type, as GGML's cuBLAS path does), the tiled ``mul_mat_f`` otherwise, for which a BF16 src0 is
  copied to F32 scratch first.

Fusion (``fuse``, applied once per graph by the backend): RMS_NORM or NORM followed by the MUL
of its result by a weight row is one launch, and so is an ADD whose sum that norm normalises
(the residual stream: the sum is still written, for the next residual add).

MUL_MAT_ID (a mixture of experts' products; GGML's ``ggml_cuda_mul_mat_id``): quantized weights of
``mmvq.VEC_DOT`` take **mmvq with ids** (``launch_mmvq_id``: src1 quantized to q8_1 as for
MUL_MAT, shared with the other products of the same src1, then one kernel over every (token,
slot) pair, the expert read from ``ids`` on the device: no host sync, so a decode step stays one
CUDA graph); float weights the ``mul_mat_vec_f`` kernel with ids; other quantized weights (or
views mmvq cannot read) are dequantized whole to F32 first. GGML takes mmvq up to 8 tokens, then
mmq (quantized) or ``mul_mat_f`` (float) with ids, which group a prompt's tokens by expert so
that each expert's rows are read once per tile of tokens; here every pair reads its expert's
rows, whatever the number of tokens. An id outside [0, n_expert) skips its pair (its result is
left as it was; GGML asserts, the CPU raises).

ARGSORT sorts rows of up to ``reduce.ARGSORT_MAX`` values (bitonic, in shared memory).

mmvq needs its tensor at a 4-byte aligned offset (int32 views, flat for Q3_K and Q6_K),
16-byte for Q4_K and Q5_K, 8-byte for IQ4_XS (their wide loads: ``mmvq.ALIGN``); a view
elsewhere takes the dequantize path.

FLASH_ATTN_EXT runs ``fattn.py``'s kernel for head sizes up to 256 with equal K and V head sizes.
"""
from __future__ import annotations

import numpy as np

from ...ops import (Op, SortOrder, clamp_params, concat_dim, diag_mask_n_past, flash_attn_params, glu_params,
                    norm_eps, pad_params, rope_params, scale_params, soft_max_alibi, soft_max_params, sort_order,
                    unary_op)
from ...tensor import FLAG_OUTPUT
from ...types import Type, blck_size, is_quantized, type_size
from .table import forward
from .common import Q8_1_INTS, tensor_cores
from .dequant import QUANT_TYPES, launch_dequantize, rows_grid, rows_kernel
from .fattn import MAX_D, launch_fattn
from .elementwise import (BINARY_CODE, BLOCK, GLU_OPS, UNARY_CODE, UNARY_OPS, binary, copy, glu, grid_rows, scale,
                          unary)
from .matmul import MMVF_MAX_COLS, launch_mul_mat_f, launch_mul_mat_vec_f_id, use_mma
from .mmq import launch_mmq
from .mmvq import ALIGN, MMVQ_GROUPED_MAX_COLS, MMVQ_MAX_BATCH_SIZE, VEC_DOT, launch_mmvq, launch_mmvq_id
from .norm import launch_norm
from .quantize import launch_quantize_mmq_q8_1, launch_quantize_q8_1, mmq_q8_1_bytes, q8_1_bytes
from .rope import launch_rope
from .rows import get_rows_f, set_rows
from .reduce import ARGSORT_MAX, R_MEAN, R_SUM, R_SUM_ROWS, launch_argmax, launch_argsort, launch_reduce
from .setq import QUANTIZE, rows_kernel as quantize_rows_kernel
from .shape import BITS, concat, pad, repeat
from .softmax import diag_mask_inf, launch_soft_max

F32, F16, BF16 = Type.F32, Type.F16, Type.BF16
FLOAT_TYPES = (F32, F16)
STORE_TYPES = (F32, F16, BF16)   # what copies, rows and float products read and write
# numba has no bfloat16: BF16 tensors are read and written through uint16 views (common.bf16_to_float)
DTYPE = {F32: np.float32, F16: np.float16, BF16: np.uint16, Type.I32: np.int32, Type.I64: np.int64}


def elem_strides(t):
    """Byte strides to element strides (plain types only)."""
    e = type_size(t.type)
    return tuple(nb // e for nb in t.nb)


def _packed(t):
    """Rows of whole elements (whole blocks, for a quantized type) at strides of whole elements: what
    a typed view of the buffer can index."""
    size = type_size(t.type)
    return t.nb[0] == size and all(nb % size == 0 for nb in t.nb)


def _all(node, types):
    return all(s.type in types for s in node.src if s is not None) and node.type in types


# -- MUL_MAT ---------------------------------------------------------------------------------------
def _supports_mul_mat(node):
    a, b = node.src[0], node.src[1]
    if b.type != F32 or node.type != F32:
        return False
    if a.type in STORE_TYPES:
        return True
    return a.type in QUANT_TYPES and _packed(a)


@forward(Op.MUL_MAT, supports=_supports_mul_mat)
def mul_mat(be, node):
    a, b = node.src[0], node.src[1]
    s = be.stream
    dst = be.view(node, np.float32)
    y = be.view(b, np.float32)
    sb = elem_strides(b)[1:]
    ncols = b.ne[1]
    if ncols <= MMVQ_MAX_BATCH_SIZE and _mmvq_reads(a):
        launch_mmvq(s, a.type, *_mmvq_operands(be, a, b), dst, a, node)
    elif a.type == Type.Q4_K:
        n = mmq_q8_1_bytes(b.ne[0], ncols, b.ne[2] * b.ne[3])
        vy, vy_h = be.scratch("q8", n, np.int32), be.scratch("q8", n, np.float16)
        if be.q8_of != ("mmq", b, n):
            launch_quantize_mmq_q8_1(s, y, vy, vy_h, b.ne, sb)
            be.q8_of = ("mmq", b, n)
        launch_mmq(be, be.view(a, np.int32), vy, dst, a, node)
    elif ncols <= MMVQ_GROUPED_MAX_COLS and _mmvq_reads(a) and a.ne[2] == a.ne[3] == b.ne[2] == b.ne[3] == 1:
        # mmvq on groups of 8 columns (a 2-D product: a group's q8_1 blocks and results are runs)
        operands = _mmvq_operands(be, a, b)
        for c0 in range(0, ncols, MMVQ_MAX_BATCH_SIZE):
            launch_mmvq(s, a.type, *operands, dst, a, node, (c0, min(c0 + MMVQ_MAX_BATCH_SIZE, ncols)))
    elif is_quantized(a.type):       # to F16 for the tensor cores where there are some, else F32
        dt = np.float16 if tensor_cores() and a.ne[0] % 8 == 0 else np.float32
        x = be.scratch("dequant", np.dtype(dt).itemsize * a.nelements(), dt)
        launch_dequantize(s, be.view(a, np.uint8), be.view(a, np.float16), x, a)
        ne = a.ne
        launch_mul_mat_f(s, x, (1, ne[0], ne[0] * ne[1], ne[0] * ne[1] * ne[2]), ne, y, b, dst)
    elif a.type == BF16 and ncols > MMVF_MAX_COLS and not use_mma(be.view(a, np.uint16), elem_strides(a), a.ne):
        # to F32 for the tiled product
        x = be.scratch("dequant", 4 * a.nelements(), np.float32)
        ne = a.ne
        s0 = (1, ne[0], ne[0] * ne[1], ne[0] * ne[1] * ne[2])
        copy[grid_rows(ne), BLOCK, s](be.view(a, np.uint16), True, x, False, *ne, *elem_strides(a), True,
                                      ne[0], ne[1], ne[2], *s0)
        launch_mul_mat_f(s, x, s0, ne, y, b, dst)
    else:
        launch_mul_mat_f(s, be.view(a, DTYPE[a.type]), elem_strides(a), a.ne, y, b, dst)


def _mmvq_reads(a):
    """Can mmvq read the weights ``a`` (a type it has, at the offset its loads need)?"""
    return a.type in VEC_DOT and a.offset % ALIGN.get(a.type, 4) == 0


def _mmvq_operands(be, a, b):
    """mmvq's views of the weights ``a`` and of the F32 ``b`` quantized to q8_1 in the "q8" work
    area: quantized here unless the last product did it for the same ``b`` (a layer's q, k and v,
    or gate and up, multiply the same activations)."""
    n = q8_1_bytes(b.ne[0], b.ne[1] * b.ne[2] * b.ne[3])
    if be.q8_of != ("vec", b, n):
        launch_quantize_q8_1(be.stream, be.view(b, np.float32), be.scratch("q8", n, np.int8),
                             be.scratch("q8", n, np.float16), b.ne, elem_strides(b)[1:])
        be.q8_of = ("vec", b, n)
    dt, bs = VEC_DOT[a.type][4], type_size(a.type)    # weights and q8_1: one row per block
    isz = np.dtype(dt).itemsize                       # (flat when a block is not whole words)
    return (be.view(a, dt, cols=bs // isz if bs % isz == 0 else None), be.view(a, np.float16, cols=bs // 2),
            be.scratch("q8", n, np.int32, Q8_1_INTS), be.scratch("q8", n, np.float16, 2 * Q8_1_INTS))


# -- MUL_MAT_ID --------------------------------------------------------------------------------------
def _supports_mul_mat_id(node):
    a, b, ids = node.src[0], node.src[1], node.src[2]
    return (b.type == F32 and b.nb[0] == 4 and node.type == F32 and ids.type == Type.I32
            and all(nb % 4 == 0 for nb in ids.nb) and ids.ne[0] <= 65535 and ids.ne[1] <= 65535   # grid y, z
            and (a.type in STORE_TYPES or a.type in QUANT_TYPES) and _packed(a))


@forward(Op.MUL_MAT_ID, supports=_supports_mul_mat_id)
def mul_mat_id(be, node):
    a, b, ids = node.src[0], node.src[1], node.src[2]
    s = be.stream
    dst, vids = be.view(node, np.float32), be.view(ids, np.int32)
    if _mmvq_reads(a):
        launch_mmvq_id(s, a.type, *_mmvq_operands(be, a, b), dst, a, b, vids, ids)
        return
    ne = a.ne
    if is_quantized(a.type):    # every expert to F32 (rare: mmvq reads all but misaligned views)
        x = be.scratch("dequant", 4 * a.nelements(), np.float32)
        launch_dequantize(s, be.view(a, np.uint8), be.view(a, np.float16), x, a)
        s0 = (1, ne[0], ne[0] * ne[1], ne[0] * ne[1] * ne[2])
    else:
        x, s0 = be.view(a, DTYPE[a.type]), elem_strides(a)
    launch_mul_mat_vec_f_id(s, x, s0, ne, be.view(b, np.float32), b, vids, ids, dst)


# -- element-wise ----------------------------------------------------------------------------------
@forward(Op.ADD, Op.ADD1, Op.SUB, Op.MUL, Op.DIV, supports=lambda n: _all(n, (F32,)))
def binary_op(be, node):
    a, b = node.src[0], node.src[1]
    ne = node.ne
    binary[grid_rows(ne), BLOCK, be.stream](
        BINARY_CODE[node.op], be.view(a, np.float32), be.view(b, np.float32), be.view(node, np.float32),
        *ne, *elem_strides(a), *b.ne, *elem_strides(b), *elem_strides(node))


@forward(Op.UNARY, *UNARY_CODE,
         supports=lambda n: _all(n, (F32,)) and (n.op != Op.UNARY or unary_op(n) in UNARY_OPS))
def unary_forward(be, node):
    a = node.src[0]
    ne = node.ne
    p0, p1 = clamp_params(node) if node.op == Op.CLAMP else (0.0, 0.0)
    code = int(unary_op(node)) if node.op == Op.UNARY else UNARY_CODE[node.op]
    unary[grid_rows(ne), BLOCK, be.stream](
        code, np.float32(p0), np.float32(p1), be.view(a, np.float32), be.view(node, np.float32), *ne,
        *elem_strides(a), *elem_strides(node))


@forward(Op.SCALE, supports=lambda n: _all(n, (F32,)))
def scale_op(be, node):
    a = node.src[0]
    ne = node.ne
    s, bias = scale_params(node)
    scale[grid_rows(ne), BLOCK, be.stream](
        be.view(a, np.float32), be.view(node, np.float32), np.float32(s), np.float32(bias), *ne,
        *elem_strides(a), *elem_strides(node))


@forward(Op.GLU, supports=lambda n: _all(n, (F32,)) and glu_params(n).op in GLU_OPS)
def glu_op(be, node):
    a, g = node.src[0], node.src[1]
    gop, swapped = glu_params(node)
    ne = node.ne
    if g is None:     # one tensor: value and gate are the two halves of each row
        va = be.view(a, np.float32)
        vg = be.view(a, np.float32, 4 * ne[0])
        sa = sg = elem_strides(a)
    else:
        va, vg = be.view(a, np.float32), be.view(g, np.float32)
        sa, sg = elem_strides(a), elem_strides(g)
    if swapped:
        va, vg, sa, sg = vg, va, sg, sa
    glu[grid_rows(ne), BLOCK, be.stream](
        int(gop), va, vg, be.view(node, np.float32), *ne, *sa[1:], *sg[1:], *elem_strides(node)[1:])


def _quantizes_rows(node, src):
    """Can ``setq`` write the float rows ``src`` into ``node``'s quantized rows?"""
    return (node.type in QUANTIZE and src.type in (F32, F16) and src.nb[0] == type_size(src.type)
            and src.ne[0] % 32 == 0 and node.nb[0] == type_size(node.type))


def _supports_copy(node):
    """Float to float (F32, F16, BF16); a quantized tensor of whole-block rows (a weight) to a
    contiguous F32 one, dequantized by ``dequant.rows_kernel``; float rows into a tensor of the
    same shape in a type of ``setq.QUANTIZE``."""
    a = node.src[0]
    if node.type in QUANTIZE:
        return _quantizes_rows(node, a) and a.ne == node.ne
    if a.type in QUANT_TYPES:
        return node.type == F32 and node.is_contiguous() and _packed(a)
    return _all(node, STORE_TYPES)


@forward(Op.DUP, Op.CONT, Op.CPY, supports=_supports_copy)
def copy_op(be, node):
    a = node.src[0]
    ne, me = a.ne, node.ne
    if a.type in QUANT_TYPES:   # dst is contiguous: a's rows in order, whatever dst's shape
        launch_dequantize(be.stream, be.view(a, np.uint8), be.view(a, np.float16), be.view(node, np.float32), a)
        return
    if node.type in QUANTIZE:   # row i1 of a into row i1 of dst
        _launch_quantize_rows(be, a, None, node)
        return
    copy[grid_rows(ne), BLOCK, be.stream](
        be.view(a, DTYPE[a.type]), a.type == BF16, be.view(node, DTYPE[node.type]), node.type == BF16, *ne,
        *elem_strides(a), ne == me,
        me[0], me[1], me[2], *elem_strides(node))


# -- shape: REPEAT, PAD, CONCAT (raw bits), DIAG_MASK_INF ------------------------------------------
def _bits(node):
    """The view that moves a node's elements (``shape.BITS``), or None: plain types only."""
    return BITS.get(type_size(node.type)) if node.type in (*STORE_TYPES, Type.I32) else None


@forward(Op.REPEAT, Op.PAD, supports=lambda n: n.src[0].type == n.type and _bits(n) is not None)
def repeat_pad_op(be, node):
    a = node.src[0]
    dt = _bits(node)
    args = (be.view(a, dt), be.view(node, dt), *node.ne, *a.ne, *elem_strides(a), *elem_strides(node))
    if node.op == Op.REPEAT:
        repeat[grid_rows(node.ne), BLOCK, be.stream](*args)
    else:
        p = pad_params(node)
        pad[grid_rows(node.ne), BLOCK, be.stream](*args, p.lp0, p.lp1, p.lp2, p.lp3)


@forward(Op.CONCAT, supports=lambda n: n.src[0].type == n.src[1].type == n.type and _bits(n) is not None)
def concat_op(be, node):
    a, b = node.src[0], node.src[1]
    dt, dim = _bits(node), concat_dim(node)
    concat[grid_rows(node.ne), BLOCK, be.stream](
        be.view(a, dt), be.view(b, dt), be.view(node, dt), dim, a.ne[dim], *node.ne, *elem_strides(a),
        *elem_strides(b), *elem_strides(node))


@forward(Op.DIAG_MASK_INF, supports=lambda n: _all(n, (F32,)) and n.src[0].nb[0] == 4 and n.nb[0] == 4)
def diag_mask_op(be, node):
    a = node.src[0]
    diag_mask_inf[grid_rows(node.ne), BLOCK, be.stream](
        be.view(a, np.float32), be.view(node, np.float32), diag_mask_n_past(node), *node.ne,
        *elem_strides(a)[1:], *elem_strides(node)[1:])


# -- rows ------------------------------------------------------------------------------------------
def _supports_get_rows(node):
    a, idx = node.src[0], node.src[1]
    return node.type == F32 and idx.type in (Type.I32, Type.I64) and (
        a.type in STORE_TYPES or (a.type in QUANT_TYPES and _packed(a)))


@forward(Op.GET_ROWS, supports=_supports_get_rows)
def get_rows_op(be, node):
    a, idx = node.src[0], node.src[1]
    ne = node.ne
    si = elem_strides(idx)[:3]
    sd = elem_strides(node)[1:]
    vi = be.view(idx, DTYPE[idx.type])
    if a.type in STORE_TYPES:
        get_rows_f[grid_rows(ne), BLOCK, be.stream](
            be.view(a, DTYPE[a.type]), a.type == BF16, vi, be.view(node, np.float32), ne[0], a.ne[1], *ne[1:],
            *elem_strides(a), *si, *sd)
    else:
        rows_kernel(a.type)[rows_grid(ne), BLOCK, be.stream](
            blck_size(a.type).bit_length() - 1, type_size(a.type), be.view(a, np.uint8), be.view(a, np.float16),
            vi, True, be.view(node, np.float32), ne[0], a.ne[1], *ne[1:], *a.nb[1:], *si, *sd)


def _launch_quantize_rows(be, x, idx, node):
    """``setq``'s kernel: rows of the float ``x`` into the quantized ``node``, at the rows ``idx``
    names (SET_ROWS) or at the same rows (CPY)."""
    ne = x.ne
    vi = be.view(x, np.uint8) if idx is None else be.view(idx, DTYPE[idx.type])
    ni, si = (1, 1), (0, 0, 0)
    if idx is not None:
        ni, si = idx.ne[1:3], elem_strides(idx)[:3]
    quantize_rows_kernel(node.type)[grid_rows((ne[0] // 32, *ne[1:])), BLOCK, be.stream](
        be.view(x, DTYPE[x.type]), vi, idx is not None, be.view(node, np.uint8), be.view(node, np.float16),
        type_size(node.type), *ne, *elem_strides(x)[1:], *ni, *si, node.ne[1], *node.nb[1:])


@forward(Op.SET_ROWS, supports=lambda n: (n.src[0].type == F32 and n.src[1].type in (Type.I32, Type.I64)
                                            and (n.type in STORE_TYPES or _quantizes_rows(n, n.src[0]))))
def set_rows_op(be, node):
    b, idx = node.src[0], node.src[1]
    if node.type in QUANTIZE:
        _launch_quantize_rows(be, b, idx, node)
        return
    set_rows[grid_rows(b.ne), BLOCK, be.stream](
        be.view(b, np.float32), be.view(idx, DTYPE[idx.type]), be.view(node, DTYPE[node.type]), node.type == BF16,
        *b.ne,
        *elem_strides(b)[1:], idx.ne[1], idx.ne[2], *elem_strides(idx)[:3], node.ne[1], *elem_strides(node)[1:])


# -- reductions ------------------------------------------------------------------------------------
@forward(Op.SUM, Op.SUM_ROWS, Op.MEAN, supports=lambda n: _all(n, (F32,)))
def reduce_op(be, node):
    a = node.src[0]
    mode = {Op.SUM: R_SUM, Op.SUM_ROWS: R_SUM_ROWS, Op.MEAN: R_MEAN}[node.op]
    launch_reduce(be.stream, mode, be.view(a, np.float32), be.view(node, np.float32), a, node)


@forward(Op.ARGMAX, supports=lambda n: (n.type == Type.I32 and n.src[0].type == F32
                                        and n.src[0].ne[2] == n.src[0].ne[3] == 1))
def argmax_op(be, node):
    a = node.src[0]
    launch_argmax(be.stream, be.view(a, np.float32), be.view(node, np.int32), a)


@forward(Op.ARGSORT, supports=lambda n: (n.type == Type.I32 and n.src[0].type == F32
                                         and n.src[0].ne[0] <= ARGSORT_MAX))
def argsort_op(be, node):
    a = node.src[0]
    launch_argsort(be.stream, be.view(a, np.float32), be.view(node, np.int32), sort_order(node) == SortOrder.DESC,
                   a, node)


# -- norms, soft_max, rope -------------------------------------------------------------------------
@forward(Op.RMS_NORM, Op.NORM, supports=lambda n: _all(n, (F32,)) and n.src[0].nb[0] == 4)
def norm_op(be, node):
    a = node.src[0]
    launch_norm(be.stream, node.op == Op.RMS_NORM, be.view(a, np.float32), be.view(node, np.float32), a, node,
                norm_eps(node))


def _norm_mul(norm, mul, g):
    """Can ``mul`` (the node run after ``norm``) be fused into it: ``mul(norm, w)`` with ``w`` one
    F32 row of the norm's width, the norm read by nothing else and not an output?"""
    if norm.op not in (Op.RMS_NORM, Op.NORM) or mul.op != Op.MUL or mul.src[0] is not norm:
        return False
    w = mul.src[1]
    return (g.use_count(norm) == 1 and not norm.flags & FLAG_OUTPUT and w.type == F32 and w.nb[0] == 4
            and w.ne[0] == norm.ne[0] and w.ne[1] == w.ne[2] == w.ne[3] == 1)


def _add_norm(add, norm):
    """Can ``add`` (run just before ``norm``) be fused into it: ``norm(add(x, y))`` with x, y and
    the sum all F32 and laid out alike (the residual stream: no broadcast)?"""
    if add.op != Op.ADD or norm.src[0] is not add:
        return False
    x, y = add.src[0], add.src[1]
    return (all(t.type == F32 for t in (x, y, add)) and x.ne == y.ne == add.ne
            and x.nb == y.nb == add.nb and x.nb[0] == 4)


def norm_mul_op(be, mul):
    """``mul(rms_norm(x), w)`` (or NORM) in one kernel, written to ``mul``'s memory."""
    norm, w = mul.src[0], mul.src[1]
    a = norm.src[0]
    launch_norm(be.stream, norm.op == Op.RMS_NORM, be.view(a, np.float32), be.view(mul, np.float32), a, mul,
                norm_eps(norm), be.view(w, np.float32))


def add_norm_mul_op(be, mul):
    """``mul(rms_norm(add(x, y)), w)`` (or NORM) in one kernel: the sum is written to the add's
    memory (the residual stream reads it again) and the result to ``mul``'s."""
    norm, w = mul.src[0], mul.src[1]
    add = norm.src[0]
    x, y = add.src[0], add.src[1]
    be.writes(add)
    launch_norm(be.stream, norm.op == Op.RMS_NORM, be.view(x, np.float32), be.view(mul, np.float32), x, mul,
                norm_eps(norm), be.view(w, np.float32), be.view(y, np.float32), be.view(add, np.float32))


def fuse(nodes, g):
    """The run list of a graph: ``nodes`` (``(fn, node)`` pairs of its ``GraphPlan``) with each norm
    followed by its weight multiplication (every layer's ``rms_norm(x) * attn_norm``) as one
    launch, and with the residual add before such a norm in the same launch, as GGML's CUDA
    backend fuses them. The norm's own result is never written."""
    out, i = [], 0
    while i < len(nodes):
        node = nodes[i][1]
        if i + 2 < len(nodes) and _add_norm(node, nodes[i + 1][1]) and _norm_mul(nodes[i + 1][1], nodes[i + 2][1], g):
            out.append((add_norm_mul_op, nodes[i + 2][1]))
            i += 3
        elif i + 1 < len(nodes) and _norm_mul(node, nodes[i + 1][1], g):
            out.append((norm_mul_op, nodes[i + 1][1]))
            i += 2
        else:
            out.append(nodes[i])
            i += 1
    return out


def _supports_soft_max(node):
    a, mask = node.src[0], node.src[1]
    return (a.type == F32 and node.type == F32 and a.is_contiguous() and node.is_contiguous()
            and (mask is None or mask.type in FLOAT_TYPES))


@forward(Op.SOFT_MAX, supports=_supports_soft_max)
def soft_max_op(be, node):
    a, mask = node.src[0], node.src[1]
    x = be.view(a, np.float32)
    mv = x if mask is None else be.view(mask, DTYPE[mask.type])
    scale_, max_bias = soft_max_params(node)
    launch_soft_max(be.stream, x, mv, be.view(node, np.float32), a, mask, scale_, max_bias,
                    soft_max_alibi(a.ne[2], max_bias))


@forward(Op.ROPE, supports=lambda n: n.type == F32 and n.src[0].type == F32 and n.src[0].nb[0] == 4)
def rope_op(be, node):
    a, pos, ff = node.src[0], node.src[1], node.src[2]
    launch_rope(be.stream, be.view(a, np.float32), be.view(pos, np.int32),
                None if ff is None else be.view(ff, np.float32), be.view(node, np.float32), a, node,
                rope_params(node))


# -- flash attention -------------------------------------------------------------------------------
def _supports_fattn(node):
    q, k, v, mask = node.src[:4]
    packed = all(_packed(t) for t in (q, k, v))
    return (node.src[4] is None and q.type == F32 and node.type == F32 and k.type in FLOAT_TYPES
            and v.type == k.type and v.ne[0] == q.ne[0] <= MAX_D and packed and node.is_contiguous()
            and (mask is None or mask.type == F16 and mask.is_contiguous()))


@forward(Op.FLASH_ATTN_EXT, supports=_supports_fattn)
def flash_attn_op(be, node):
    q, k, v, mask = node.src[:4]
    p = flash_attn_params(node)
    qv = be.view(q, np.float32)
    views = (qv, be.view(k, DTYPE[k.type]), be.view(v, DTYPE[v.type]),
             qv if mask is None else be.view(mask, DTYPE[mask.type]), be.view(node, np.float32))
    launch_fattn(be, q, k, v, mask, node, p.scale, p.max_bias, p.logit_softcap, soft_max_alibi(q.ne[2], p.max_bias),
                 views)
