"""GGML's op contracts on the wire: every computed op rebuilt by lazyggml's own constructor.

GGML's RPC server rebuilds a client's graph tensor by tensor without calling the op constructors,
so nothing there checks what those constructors assert (``ggml_flash_attn_ext``'s F16 mask, a
``mul_mat``'s shapes, ...): its kernels read whatever arrives, and a node that breaks its op's
contract computes a wrong answer or reads outside its tensors. Both ends here run the node through
the constructor that ``ops.py`` declares for its op (``REBUILD``), whose checks are GGML's:

* the server (``server.py``) rebuilds every computed tensor a peer sends and refuses the graph when
  a constructor raises or gives another type, shape or strides;
* the client (``client.py``) checks each node of a graph before sending it (``check_node``), since
  the other end may be GGML's server, which would not: a node built by hand, or changed after its
  constructor ran (say, an F32 mask swapped in), is refused with an error naming it.
"""
from __future__ import annotations

from ... import ops
from ...errors import LazyGGMLError, UnsupportedOpError
from ...ops import EMPTY_OPS, GluOp
from ...tensor import Context
from ...types import Op, type_name
from .protocol import params_from_wire, params_to_wire

__all__ = ["REBUILD", "INPLACE", "check_node"]


def _flash_attn(s, p, t):
    r = ops.flash_attn_ext(s[0], s[1], s[2], s[3], p[0], p[1], p[2])
    ops.flash_attn_ext_set_prec(r, p[3])
    return r


# How each computed op is rebuilt from its decoded sources ``s`` (GGML's slots), its params ``p``
# (``params_from_wire``) and ``t``, the tensor as the wire describes it, which CONT and REPEAT take
# their result shape from. NONE and the view ops are not here: nothing computes them.
REBUILD = {
    Op.DUP: lambda s, p, t: ops.dup(s[0]),
    Op.ADD: lambda s, p, t: ops.add(s[0], s[1]),
    Op.ADD1: lambda s, p, t: ops.add1(s[0], s[1]),
    Op.SUB: lambda s, p, t: ops.sub(s[0], s[1]),
    Op.MUL: lambda s, p, t: ops.mul(s[0], s[1]),
    Op.DIV: lambda s, p, t: ops.div(s[0], s[1]),
    Op.SQR: lambda s, p, t: ops.sqr(s[0]),
    Op.SQRT: lambda s, p, t: ops.sqrt(s[0]),
    Op.LOG: lambda s, p, t: ops.log(s[0]),
    Op.SIN: lambda s, p, t: ops.sin(s[0]),
    Op.COS: lambda s, p, t: ops.cos(s[0]),
    Op.SUM: lambda s, p, t: ops.sum(s[0]),
    Op.SUM_ROWS: lambda s, p, t: ops.sum_rows(s[0]),
    Op.MEAN: lambda s, p, t: ops.mean(s[0]),
    Op.ARGMAX: lambda s, p, t: ops.argmax(s[0]),
    Op.REPEAT: lambda s, p, t: ops.repeat(s[0], t),
    Op.CONCAT: lambda s, p, t: ops.concat(s[0], s[1], p[0]),
    Op.NORM: lambda s, p, t: ops.norm(s[0], p[0]),
    Op.RMS_NORM: lambda s, p, t: ops.rms_norm(s[0], p[0]),
    Op.MUL_MAT: lambda s, p, t: ops.mul_mat(s[0], s[1]),
    Op.MUL_MAT_ID: lambda s, p, t: ops.mul_mat_id(s[0], s[1], s[2]),
    Op.SCALE: lambda s, p, t: ops.scale_bias(s[0], p[0], p[1]),
    Op.CPY: lambda s, p, t: ops.cpy(s[0], s[1]),
    Op.CONT: lambda s, p, t: ops.cont_4d(s[0], *t.ne),
    Op.GET_ROWS: lambda s, p, t: ops.get_rows(s[0], s[1]),
    Op.SET_ROWS: lambda s, p, t: ops.set_rows(s[2], s[0], s[1]),   # GGML's slots: rows, indices, destination
    Op.DIAG_MASK_INF: lambda s, p, t: ops.diag_mask_inf(s[0], p[0]),
    Op.SOFT_MAX: lambda s, p, t: ops.soft_max_ext(s[0], s[1], p[0], p[1]),
    Op.ROPE: lambda s, p, t: ops.rope_ext(s[0], s[1], s[2], p[1], p[2], p[4], *p[5:]),  # p[0], p[3]: unused slots
    Op.CLAMP: lambda s, p, t: ops.clamp(s[0], p[0], p[1]),
    Op.PAD: lambda s, p, t: ops.pad_ext(s[0], *p),
    Op.ARGSORT: lambda s, p, t: ops.argsort(s[0], p[0]),
    Op.FLASH_ATTN_EXT: _flash_attn,
    Op.UNARY: lambda s, p, t: ops.unary(s[0], p[0]),
    # GGML's ggml_glu_impl: the public wrappers (swiglu, geglu_split, ...) name only some pairs
    Op.GLU: lambda s, p, t: ops._glu_impl(s[0], s[1], GluOp(p[0]), p[1], None),
}
assert set(REBUILD) == set(Op) - EMPTY_OPS, "every computed op needs its rebuild"

# The ops whose result may be a view of their first source, as GGML's ``*_inplace`` constructors
# (and ops.py's ``_impl(..., inplace)``) make it: the same node, written over that source.
INPLACE = frozenset({Op.DUP, Op.ADD, Op.ADD1, Op.SUB, Op.MUL, Op.DIV, Op.SQR, Op.SQRT, Op.LOG, Op.SIN,
                      Op.COS, Op.UNARY, Op.SCALE, Op.NORM, Op.RMS_NORM, Op.DIAG_MASK_INF, Op.SOFT_MAX,
                      Op.ROPE})


def check_node(node):
    """Raise ``UnsupportedOpError`` naming ``node`` unless its op's constructor, given its sources
    and its ``op_params`` as the wire carries them, accepts them and gives its type and shape."""
    if node.op in EMPTY_OPS:
        return
    params = params_from_wire(node.op, params_to_wire(node.op, node.op_params))
    try:
        with Context():
            r = REBUILD[node.op](node.src, params, node)
    except LazyGGMLError as e:
        raise UnsupportedOpError(f"RPC: {ops.node_desc(node)} breaks GGML's contract for {node.op.name}, which "
                                 f"GGML's RPC server does not check (it would compute a wrong answer): {e}") from e
    if (r.type, r.ne) != (node.type, node.ne):
        raise UnsupportedOpError(f"RPC: {ops.node_desc(node)} is {type_name(node.type)}{list(node.ne)}, but "
                                 f"{node.op.name} of its sources gives {type_name(r.type)}{list(r.ne)}")
