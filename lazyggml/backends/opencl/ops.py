"""The OpenCL glue: one ``@forward`` function per op family, enqueuing the ``.cl`` kernels.

Each function passes its tensors as ``targ(t)`` pairs (buffer and ``tensor_t``), reads the node's
op params (through ``ops``' typed accessors) and picks the kernel and work sizes; each ``supports``
claims exactly what the kernels compute. Host-derived constants (ROPE's correction dims, ALiBi's
m0, m1) come from ``ops``, the same bits every backend gets.
"""
from __future__ import annotations

import numpy as np

from ...ops import (ROPE_TYPE_NEOX, ROPE_TYPE_NORMAL, Op, clamp_params, concat_dim, diag_mask_n_past,
                    flash_attn_params, glu_params, norm_eps, pad_params, rope_params, rope_theta_scale,
                    rope_yarn_corr_dims, scale_params, soft_max_alibi, soft_max_params, unary_op)
from ...types import Type, type_size
from .backend import targ
from .program import BINARY_OPS, EW_CODES, MAX_LANES, lanes_for
from .table import forward

_SIMPLE_EW = {Op.SQR: "EW_SQR", Op.SQRT: "EW_SQRT", Op.LOG: "EW_LOG", Op.SIN: "EW_SIN", Op.COS: "EW_COS"}

# weight types of get_rows and mul_mat -> the kernels' name suffix
_WEIGHT_TYPES = {Type.F32: "f32", Type.F16: "f16", Type.BF16: "bf16", Type.Q8_0: "q8_0", Type.Q4_K: "q4_K", Type.Q6_K: "q6_K",
                 Type.Q4_0: "q4_0", Type.Q4_1: "q4_1", Type.Q5_0: "q5_0", Type.Q5_1: "q5_1", Type.Q5_K: "q5_K",
                 Type.Q2_K: "q2_K", Type.Q3_K: "q3_K", Type.IQ4_NL: "iq4_nl", Type.IQ4_XS: "iq4_xs"}

# mul_mat (mul_mat.cl says why there are two layouts of each kernel)
MV_MAX_COLS = 8     # columns of src1 up to which the mat-vec kernels run
MV_TILES = ((1, 2, 1), (2, 2, 2), (4, 2, 4), (8, 2, 8))  # CPU mat-vec: (up to n columns, R rows, NC columns)
MV_GROUP = 16       # CPU mat-vec: work-items per work-group
MV_ROWS = 4         # GPU mat-vec: rows per work-group
MM_BM = 32          # rows per tile
MM_CPU_COLS = 60    # CPU tiled kernel: columns per work-item (MM_CB * MM_TC)
MM_NC, MM_NW = 8, 8  # GPU tiled kernel: columns per work-item, work-items per group


def _f32(*ts):
    return all(t is not None and t.type == Type.F32 for t in ts)


def _all_f32(node):
    return _f32(node, *[s for s in node.src if s is not None])


def _index(t):
    return t.type in (Type.I32, Type.I64)


@forward(Op.SQR, Op.SQRT, Op.LOG, Op.SIN, Op.COS, Op.UNARY, Op.SCALE, Op.CLAMP, supports=_all_f32)
def _unary(be, node):
    p0 = p1 = 0.0
    if node.op == Op.UNARY:
        code = EW_CODES[f"EW_{unary_op(node).name}"]
    elif node.op in (Op.SCALE, Op.CLAMP):
        code = EW_CODES[f"EW_{node.op.name}"]
        p0, p1 = scale_params(node) if node.op == Op.SCALE else clamp_params(node)
    else:
        code = EW_CODES[_SIMPLE_EW[node.op]]
    be.launch_rows("kernel_unary", node, *targ(node.src[0]), *targ(node), np.int32(code), np.float32(p0),
                   np.float32(p1))


@forward(*BINARY_OPS, Op.ADD1, supports=_all_f32)
def _binary(be, node):
    op = Op.ADD if node.op == Op.ADD1 else node.op  # ADD1 adds a scalar: ADD with broadcasting
    be.launch_rows("kernel_binary", node, *targ(node.src[0]), *targ(node.src[1]), *targ(node), np.int32(op))


@forward(Op.GLU, supports=_all_f32)
def _glu(be, node):
    a, b = node.src[0], node.src[1]
    gop, swapped = glu_params(node)
    if b is None:  # value and gate are the two halves of each row of a
        half = node.ne[0] * a.nb[0]
        x, g = targ(a, half if swapped else 0), targ(a, 0 if swapped else half)
    else:
        x, g = targ(a), targ(b)
    be.launch_rows("kernel_glu", node, *x, *g, *targ(node), np.int32(gop))


@forward(Op.DIAG_MASK_INF, supports=_all_f32)
def _diag_mask_inf(be, node):
    be.launch_rows("kernel_diag_mask_inf", node, *targ(node.src[0]), *targ(node),
                   np.int32(diag_mask_n_past(node)))


@forward(Op.SUM_ROWS, Op.MEAN, supports=_all_f32)
def _sum_rows(be, node):
    a = node.src[0]
    be.launch_rows("kernel_sum_rows", a, *targ(a), *targ(node), np.int32(node.op == Op.MEAN))


@forward(Op.SUM, supports=_all_f32)
def _sum(be, node):
    be.launch("kernel_sum", (MAX_LANES,), (MAX_LANES,), *targ(node.src[0]), *targ(node))


@forward(Op.ARGMAX, supports=lambda n: _f32(n.src[0]) and n.type == Type.I32)
def _argmax(be, node):
    a = node.src[0]
    be.launch_rows("kernel_argmax", a, *targ(a), *targ(node))


@forward(Op.NORM, Op.RMS_NORM, supports=_all_f32)
def _norm(be, node):
    a = node.src[0]
    be.launch_rows("kernel_norm", a, *targ(a), *targ(node), np.float32(norm_eps(node)),
                   np.int32(node.op == Op.RMS_NORM))


def _soft_max_ok(node):
    m = node.src[1]
    return _f32(node, node.src[0]) and (m is None or m.type in (Type.F32, Type.F16))


@forward(Op.SOFT_MAX, supports=_soft_max_ok)
def _soft_max(be, node):
    a, mask = node.src[0], node.src[1]
    scale, max_bias = soft_max_params(node)
    # ALiBi (GGML's soft_max): heads below the largest power of two <= n_head get m0^(h+1),
    # the others m1^(2(h - n_head_log2) + 1)
    m0, m1, n_head_log2 = soft_max_alibi(a.ne[2], max_bias)
    mask_type = 0 if mask is None else (1 if mask.type == Type.F32 else 2)
    be.launch_rows("kernel_soft_max", a, *targ(a), *targ(mask if mask is not None else a), *targ(node),
                   np.int32(mask_type), np.float32(scale), np.float32(max_bias), m0, m1,
                   np.int32(n_head_log2), lanes=lanes_for(a.ne[0], MAX_LANES))


FA_LANES, FA_DV_PER_LANE = 64, 4   # flash_attn.cl's work-group and output elements per lane


def _flash_attn_ok(node):
    q, k, v, mask = node.src[:4]
    return (node.src[4] is None and _f32(node, q) and k.type in (Type.F32, Type.F16) and v.type == k.type
            and v.ne[0] <= FA_LANES * FA_DV_PER_LANE and (mask is None or mask.type == Type.F16))


@forward(Op.FLASH_ATTN_EXT, supports=_flash_attn_ok)
def _flash_attn(be, node):
    q, k, v, mask = node.src[:4]
    p = flash_attn_params(node)
    m0, m1, n_head_log2 = soft_max_alibi(q.ne[2], p.max_bias)
    scale = np.float32(p.scale) / np.float32(p.logit_softcap) if p.logit_softcap else np.float32(p.scale)
    be.launch_rows("kernel_flash_attn_ext", node, *targ(q), *targ(k), *targ(v), *targ(mask if mask is not None else q),
                   *targ(node), np.int32(k.type == Type.F16), np.int32(mask is not None), scale,
                   np.float32(p.logit_softcap), np.float32(p.max_bias), m0, m1, np.int32(n_head_log2),
                   lanes=FA_LANES)


def _rope_ok(node):
    a, pos, ff = node.src[0], node.src[1], node.src[2]
    return (_f32(node, a) and pos.type == Type.I32 and (ff is None or ff.type == Type.F32)
            and rope_params(node).mode in (ROPE_TYPE_NORMAL, ROPE_TYPE_NEOX))


@forward(Op.ROPE, supports=_rope_ok)
def _rope(be, node):
    a, pos, ff = node.src[0], node.src[1], node.src[2]
    p = rope_params(node)
    corr0, corr1 = rope_yarn_corr_dims(p.n_dims, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow)
    be.launch_rows("kernel_rope", node, *targ(a), *targ(pos), *targ(ff if ff is not None else pos),
                   np.int32(ff is not None), *targ(node), np.int32(p.n_dims),
                   np.int32(p.mode == ROPE_TYPE_NEOX), np.float32(rope_theta_scale(p.freq_base, p.n_dims)),
                   np.float32(p.freq_scale),
                   np.float32(p.ext_factor), np.float32(p.attn_factor), corr0, corr1,
                   lanes=lanes_for(max(p.n_dims // 2, a.ne[0] - p.n_dims)))


def _get_rows_ok(node):
    a, idx = node.src[0], node.src[1]
    return (a.type in _WEIGHT_TYPES and a.nb[0] == type_size(a.type) and _blocks_aligned(a) and _index(idx)
            and _f32(node))


@forward(Op.GET_ROWS, supports=_get_rows_ok)
def _get_rows(be, node):
    a, idx = node.src[0], node.src[1]
    be.launch_rows(f"kernel_get_rows_{_WEIGHT_TYPES[a.type]}", node, *targ(a), *targ(idx),
                   np.int32(idx.type == Type.I64), *targ(node))


def _set_rows_ok(node):
    b, idx = node.src[0], node.src[1]
    return _f32(b) and _index(idx) and node.type in (Type.F32, Type.F16)


@forward(Op.SET_ROWS, supports=_set_rows_ok)
def _set_rows(be, node):
    b, idx = node.src[0], node.src[1]
    be.launch_rows(f"kernel_set_rows_{_WEIGHT_TYPES[node.type]}", b, *targ(b), *targ(idx),
                   np.int32(idx.type == Type.I64), *targ(node))


def _cpy_ok(node):
    return node.src[0].type in (Type.F32, Type.F16) and node.type in (Type.F32, Type.F16)


@forward(Op.CPY, Op.DUP, Op.CONT, supports=_cpy_ok)
def _cpy(be, node):
    a = node.src[0]
    name = f"kernel_cpy_{_WEIGHT_TYPES[a.type]}_{_WEIGHT_TYPES[node.type]}"
    be.launch_rows(name, a, *targ(a), *targ(node))


_MOVE_SIZES = {Type.F32: 4, Type.I32: 4, Type.F16: 2, Type.BF16: 2}


def _moves_ok(node):
    return node.type in _MOVE_SIZES and all(s.type == node.type for s in node.src if s is not None)


@forward(Op.CONCAT, supports=_moves_ok)
def _concat(be, node):
    be.launch_rows(f"kernel_concat_{_MOVE_SIZES[node.type]}", node, *targ(node.src[0]), *targ(node.src[1]),
                   *targ(node), np.int32(concat_dim(node)))


@forward(Op.PAD, supports=_moves_ok)
def _pad(be, node):
    p = pad_params(node)   # the left paddings: the result's shape implies the right ones
    be.launch_rows(f"kernel_pad_{_MOVE_SIZES[node.type]}", node, *targ(node.src[0]), *targ(node),
                   np.int32(p.lp0), np.int32(p.lp1), np.int32(p.lp2), np.int32(p.lp3))


@forward(Op.REPEAT, supports=_moves_ok)
def _repeat(be, node):
    be.launch_rows(f"kernel_repeat_{_MOVE_SIZES[node.type]}", node, *targ(node.src[0]), *targ(node))


def _blocks_aligned(t):
    """Q4_K and Q5_K blocks are read with 16-byte loads (quants.h): they must start 16-byte aligned.
    Buffers and tensors are allocated at least 32-byte aligned, so the view offset and strides decide."""
    return (t.type not in (Type.Q4_K, Type.Q5_K)
            or (t.view_offs % 16 == 0 and all(nb % 16 == 0 for nb in t.nb[1:])))


def _mul_mat_ok(node):
    a, b = node.src[0], node.src[1]
    return (a.type in _WEIGHT_TYPES and a.nb[0] == type_size(a.type) and _blocks_aligned(a) and _f32(node, b)
            and b.nb[0] == 4 and all(nb % 4 == 0 for nb in b.nb))


@forward(Op.MUL_MAT, supports=_mul_mat_ok)
def _mul_mat(be, node):
    """The mat-vec kernels up to MV_MAX_COLS columns, the tiled ones above, in the device's layout."""
    a, b = node.src[0], node.src[1]
    suffix = _WEIGHT_TYPES[a.type]
    m, n, batch = a.ne[1], b.ne[1], b.ne[2] * b.ne[3]
    args = (*targ(a), *targ(b), *targ(node))
    if a.type in (Type.F32, Type.F16, Type.BF16) and a.ne[0] % 16:
        be.launch(f"kernel_mul_mat_{suffix}_f32_naive", (m, n, batch), None, *args)
    elif n <= MV_MAX_COLS and be.cpu_layout:
        _, r, nc = next(t for t in MV_TILES if n <= t[0])
        be.launch(f"kernel_mul_mv_{suffix}_f32_{r}x{nc}", (_round_up(-(-m // r), MV_GROUP), batch), (MV_GROUP, 1),
                  *args)
    elif n <= MV_MAX_COLS:
        lanes = be.mv_lanes
        be.launch(f"kernel_mul_mv_{suffix}_f32_lanes", (lanes, _round_up(m, MV_ROWS), batch), (lanes, MV_ROWS, 1),
                  *args)
    elif be.cpu_layout:
        be.launch(f"kernel_mul_mm_{suffix}_f32", (-(-m // MM_BM), -(-n // MM_CPU_COLS), batch), (1, 1, 1), *args)
    else:
        col_groups = -(-n // MM_NC)
        nw = min(MM_NW, col_groups)
        be.launch(f"kernel_mul_mm_{suffix}_f32_lanes", (-(-m // MM_BM) * nw, -(-col_groups // nw), batch),
                  (nw, 1, 1), *args)


def _round_up(n, k):
    return -(-n // k) * k


