"""Compute graphs: GGML's post-order DFS, use counts and the COMPUTE flag (docs/graph-alloc-sched.md §2).

``build_forward_expand(g, t)`` walks ``t``'s sources depth first, in source-slot order, and
appends each tensor after its sources: leafs (op NONE, not PARAM) to ``g.leafs``, everything
else to ``g.nodes``. The node order is the execution order. Identity, not name, decides whether
a tensor was seen before.

**The reuse contract.** Every graph carries a ``version``, new whenever nodes are added, replaced
or cleared (``changed()``; the DFS, ``add_node`` and ``clear`` call it). A backend keeps what it
derives from a graph (kernel plans, a captured CUDA graph) while the version and the tensors'
placement (``buffer.placement_epoch``) are the same: deciding that a decode step can replay the
last one is two comparisons, never a pass over the nodes. Code that edits ``nodes`` in place
calls ``changed()``; a node's sources, shape or parameters are never edited once it is in a graph
that ran.
"""
from __future__ import annotations

import itertools

from .dot import graph_to_dot
from .ops import op_desc
from .tensor import FLAG_COMPUTE, FLAG_PARAM, MAX_SRC, Context
from .types import Op, type_name

__all__ = ["Graph", "new_graph", "build_forward_expand", "build_forward_select", "graph_view"]

_versions = itertools.count(1)


class Graph:
    """GGML's ``cgraph``: ``size`` bounds both the nodes and the leafs."""

    def __init__(self, size=2048):
        if size < 1:
            raise ValueError(f"Graph: size must be positive, got {size}")
        self.size = size
        self.nodes = []
        self.leafs = []
        self._use = {}       # tensor -> consumer slots (GGML's use_counts, keyed by identity)
        self._visited = self._use  # a tensor is visited exactly when it has a use count
        self.right_to_left = False
        self.version = next(_versions)

    def changed(self):
        """Say that the node list changed: backends derive their plans for this graph anew."""
        self.version = next(_versions)

    @property
    def n_nodes(self):
        """How many nodes (computed tensors) the graph holds."""
        return len(self.nodes)

    @property
    def n_leafs(self):
        """How many leafs (tensors no op computes: weights, inputs, constants) the graph holds."""
        return len(self.leafs)

    def use_count(self, t):
        """How many source slots of this graph's nodes hold ``t`` (0 for a tensor the graph has not seen)."""
        return self._use.get(t, 0)

    def node(self, i):
        """GGML's ``ggml_graph_node``: a negative ``i`` counts from the end."""
        return self.nodes[i]

    def get_tensor(self, name):
        """The tensor named ``name``, leafs searched before nodes, or None (``ggml_graph_get_tensor``)."""
        for t in self.leafs + self.nodes:
            if t.name == name:
                return t
        return None

    def __contains__(self, t):
        return t in self._visited

    def clear(self):
        """Forget every node, leaf and use count, keeping the size."""
        self.nodes.clear()
        self.leafs.clear()
        self._use.clear()
        self.changed()

    def view(self, i0, i1):
        """GGML's ``graph_view``: nodes ``[i0, i1)``, no leafs, shared use counts."""
        g = Graph.__new__(Graph)
        g.size, g.nodes, g.leafs = i1 - i0, self.nodes[i0:i1], []
        g._use = g._visited = self._use
        g.right_to_left = self.right_to_left
        g.version = next(_versions)
        return g

    def add_node(self, t):
        """Append without visiting (GGML's ``ggml_graph_add_node``)."""
        if len(self.nodes) >= self.size:
            raise ValueError(f"graph is full: {self.size} nodes")
        self.nodes.append(t)
        self.changed()

    # -- the DFS ----------------------------------------------------------------------------------
    def _visit(self, node, compute):
        # GGML recurses; deep graphs would overflow Python's stack, so each visit is a generator
        # that yields the child visits it wants, driven here in the same order.
        stack = [self._visit_steps(node, compute)]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                stack.pop()
            else:
                stack.append(self._visit_steps(*child))
        self.changed()   # nodes or COMPUTE flags may be new

    def _visit_steps(self, node, compute):
        if compute and node.op != Op.NONE:
            node.flags |= FLAG_COMPUTE
        if node in self._visited:
            if compute:  # a later selected branch: propagate COMPUTE, add nothing
                for s in node.src:
                    if s is not None and not s.flags & FLAG_COMPUTE:
                        yield s, True
            return
        self._use[node] = 0
        slots = range(MAX_SRC - 1, -1, -1) if self.right_to_left else range(MAX_SRC)
        for k in slots:
            s = node.src[k]
            if s is not None:
                yield s, compute
                self._use[s] += 1
        if node.op == Op.NONE and not node.flags & FLAG_PARAM:
            if len(self.leafs) >= self.size:
                raise ValueError(f"graph is full: {self.size} leafs")
            if not node.name:
                node.name = f"leaf_{len(self.leafs)}"
            self.leafs.append(node)
        else:
            if len(self.nodes) >= self.size:
                raise ValueError(f"graph is full: {self.size} nodes")
            if not node.name:
                node.name = f"node_{len(self.nodes)}"
            self.nodes.append(node)

    def build_forward_expand(self, t):
        """Append ``t`` and every source it needs that the graph does not hold yet, each after its sources,
        and mark them COMPUTE; ``t`` is the last node appended."""
        n0 = len(self.nodes)
        self._visit(t, True)
        assert len(self.nodes) == n0 or self.nodes[-1] is t, "the last node appended must be the tensor"

    # -- display ----------------------------------------------------------------------------------
    def print(self, file=None):
        """GGML's ``ggml_graph_print`` layout, with names and types added; returns the text."""
        lines = ["=== GRAPH ===", f"n_nodes = {self.n_nodes}"]
        for i, t in enumerate(self.nodes):
            flag = "x" if t.flags & FLAG_PARAM else " "
            lines.append(f" - {i:3d}: [ {t.ne[0]:5d}, {t.ne[1]:5d}, {t.ne[2]:5d}] {op_desc(t):>16s} {flag}"
                         f" {type_name(t.type):>5s} {t.name}")
        lines.append(f"n_leafs = {self.n_leafs}")
        for i, t in enumerate(self.leafs):
            lines.append(f" - {i:3d}: [ {t.ne[0]:5d}, {t.ne[1]:5d}] {op_desc(t):>8s} {t.name:>16s}"
                         f" {type_name(t.type)}")
        lines.append("=" * 40)
        text = "\n".join(lines)
        print(text, file=file)
        return text

    def to_dot(self, path=None, sched=None):
        """Graphviz text of the graph; with a scheduler, nodes are coloured by backend and its
        splits drawn as boxes. Writes ``path`` when given and returns the text."""
        text = graph_to_dot(self, sched)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text


def new_graph(ctx, size=2048, grads=False):
    """GGML's ``ggml_new_graph``. A graph takes no memory from the context here, so ``ctx`` only
    keeps GGML's spelling (``ctx.new_graph(size)`` works too); gradients are not supported."""
    if grads:
        raise ValueError("new_graph: graphs with gradients are not supported")
    return Graph(size)


Context.new_graph = new_graph   # the method lives here: tensor.py sits below graphs


def build_forward_expand(g, t):
    """Add ``t`` and everything it depends on to the graph ``g``, sources first, in GGML's depth-first order
    (``ggml_build_forward_expand``)."""
    g.build_forward_expand(t)


def build_forward_select(g, tensors, idx):
    """Expand every tensor but mark COMPUTE only along ``tensors[idx]`` (docs/graph-alloc-sched.md §2.3)."""
    for i, t in enumerate(tensors):
        g._visit(t, i == idx)
    return tensors[idx]


def graph_view(g, i0, i1):
    """``g.view(i0, i1)``: a graph of ``g``'s nodes ``i0`` to ``i1 - 1``, without leafs, sharing ``g``'s use
    counts."""
    return g.view(i0, i1)
