"""GGML's op contracts on the wire: every computed op rebuilt by lazyggml's own constructor.

GGML's RPC server rebuilds a client's graph tensor by tensor without calling the op constructors,
so nothing there checks what those constructors assert (``ggml_flash_attn_ext``'s F16 mask, a
``mul_mat``'s shapes, ...): its kernels read whatever arrives, and a node that breaks its op's
contract computes a wrong answer or reads outside its tensors. Both ends here run the node through
the constructor that ``ops.py`` declares for its op (``REBUILD``: its ``OpDef.rebuild``), whose checks
are GGML's:

* the server (``server.py``) rebuilds every computed tensor a peer sends and refuses the graph when
  a constructor raises or gives another type, shape or strides;
* the client (``client.py``) checks each node of a graph before sending it (``check_node``), since
  the other end may be GGML's server, which would not: a node built by hand, or changed after its
  constructor ran (say, an F32 mask swapped in), is refused with an error naming it.
"""
from __future__ import annotations

from ... import ops
from ...errors import LazyGGMLError, UnsupportedOpError
from ...ops import EMPTY_OPS, OP_DEFS
from ...tensor import Context
from ...types import type_name
from .protocol import params_from_wire, params_to_wire

__all__ = ["REBUILD", "INPLACE", "check_node"]


# How each computed op is rebuilt (its ``OpDef.rebuild``, next to its constructor in ``ops.py``), and
# the ops whose result may be a view of their first source, as GGML's ``*_inplace`` constructors make
# it: the same node, written over that source.
REBUILD = {op: d.rebuild for op, d in OP_DEFS.items() if d.rebuild is not None}
INPLACE = frozenset(op for op, d in OP_DEFS.items() if d.inplace)


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
