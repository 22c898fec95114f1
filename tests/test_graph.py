"""Graph building (docs/graph-alloc-sched.md §2): GGML's post-order DFS, leafs and nodes, automatic
names, use counts, the COMPUTE flag and ``build_forward_select``."""
from __future__ import annotations

import numpy as np
import pytest

import lazyggml as lg
from lazyggml.backend import tensor_get, tensor_set
from lazyggml.backends.cpu import backend_cpu_init

F32 = lg.F32


def _graph(*outs):
    g = lg.Graph()
    for t in outs:
        lg.build_forward_expand(g, t)
    return g


def test_t01_post_order_leafs_nodes_names_use_counts_flags():
    ctx = lg.Context()
    a, b = ctx.new_tensor_1d(F32, 4), ctx.new_tensor_1d(F32, 4)
    c = lg.add(a, b)
    d = lg.mul(c, a)
    e = lg.scale(d, 2)
    g = _graph(e)
    assert g.leafs == [a, b] and [t.name for t in g.leafs] == ["leaf_0", "leaf_1"]
    assert g.nodes == [c, d, e] and [t.name for t in g.nodes] == ["node_0", "node_1", "node_2"]
    assert (g.n_leafs, g.n_nodes) == (2, 3)
    assert [g.use_count(t) for t in (a, b, c, d, e)] == [2, 1, 1, 1, 0]
    assert a.flags == 0 and b.flags == 0
    assert c.flags == lg.FLAG_COMPUTE and d.flags == lg.FLAG_COMPUTE and e.flags == lg.FLAG_COMPUTE


def test_names_count_the_list_they_join_and_keep_given_names():
    ctx = lg.Context()
    x = lg.set_name(ctx.new_tensor_1d(F32, 4), "x")
    y = ctx.new_tensor_1d(F32, 4)
    s = lg.set_name(lg.add(x, y), "s")
    r = lg.relu(s)
    g = _graph(r)
    assert [t.name for t in g.leafs] == ["x", "leaf_1"]   # leaf_<n_leafs before the append>
    assert [t.name for t in g.nodes] == ["s", "node_1"]


def test_param_tensors_are_nodes():
    ctx = lg.Context()
    w, x = ctx.new_tensor_1d(F32, 4), ctx.new_tensor_1d(F32, 4)
    lg.set_param(w)
    y = lg.mul(w, x)
    g = _graph(y)
    assert g.nodes == [w, y] and g.leafs == [x]
    assert w.name == "node_0" and x.name == "leaf_0"
    assert w.flags & lg.FLAG_PARAM and not w.flags & lg.FLAG_COMPUTE  # op NONE: never COMPUTE


def test_a_source_in_two_slots_counts_twice():
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 4)
    sq = lg.mul(a, a)
    g = _graph(sq)
    assert g.use_count(a) == 2 and g.leafs == [a] and g.nodes == [sq]


def test_expanding_an_existing_tensor_adds_nothing():
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 4)
    b = lg.exp(a)
    c = lg.add(b, a)
    g = _graph(c)
    before = (list(g.nodes), list(g.leafs), [g.use_count(t) for t in (a, b, c)])
    lg.build_forward_expand(g, c)
    lg.build_forward_expand(g, b)
    assert (g.nodes, g.leafs, [g.use_count(t) for t in (a, b, c)]) == before
    assert before[2] == [2, 1, 0]


def test_expanding_a_leaf_appends_only_a_leaf_and_pins_leaf_order():
    ctx = lg.Context()
    a, b = ctx.new_tensor_1d(F32, 4), ctx.new_tensor_1d(F32, 4)
    g = lg.Graph()
    lg.build_forward_expand(g, b)
    assert g.leafs == [b] and g.nodes == []
    lg.build_forward_expand(g, lg.add(a, b))
    assert g.leafs == [b, a]  # b first: it was expanded first


def test_several_expands_append_in_call_order():
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 4)
    x, y = lg.exp(a), lg.neg(a)
    g = _graph(y, x)
    assert g.nodes == [y, x]
    assert g.use_count(a) == 2


def test_views_are_nodes_and_count_their_source():
    ctx = lg.Context()
    a = ctx.new_tensor_2d(F32, 4, 3)
    v = lg.view_1d(a, 3, 16)
    t = lg.transpose(a)
    out = lg.add(lg.cont(t), lg.reshape_2d(v, 3, 1))
    g = _graph(out)
    assert g.leafs == [a]
    assert v in g.nodes and t in g.nodes
    assert g.use_count(a) == 2


def test_build_forward_select_marks_compute_only_on_the_selected_branch():
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 4)
    s = lg.scale(a, 2.0)            # shared by both branches
    b0 = lg.relu(s)
    only0 = lg.exp(b0)              # exclusive to branch 0
    b1 = lg.neg(s)
    g = lg.Graph()
    assert lg.build_forward_select(g, [only0, b1], 1) is b1
    assert g.nodes == [s, b0, only0, b1]           # everything is in the graph
    assert s.flags & lg.FLAG_COMPUTE and b1.flags & lg.FLAG_COMPUTE
    assert not b0.flags & lg.FLAG_COMPUTE and not only0.flags & lg.FLAG_COMPUTE
    assert not a.flags & lg.FLAG_COMPUTE           # leafs never compute
    assert g.use_count(s) == 2                     # propagation adds no uses


def test_cpu_backend_skips_unselected_branches():
    ctx = lg.Context(no_alloc=False)
    a = ctx.new_tensor_1d(F32, 4)
    b0, b1 = lg.exp(a), lg.neg(a)
    g = lg.Graph()
    lg.build_forward_select(g, [b0, b1], 1)
    tensor_set(a, np.arange(4, dtype=np.float32))
    backend_cpu_init().graph_compute(g)
    assert tensor_get(b1).ravel().tolist() == [0.0, -1.0, -2.0, -3.0]
    assert tensor_get(b0).ravel().tolist() == [0.0] * 4  # never computed: still zero


def test_select_then_expand_propagates_compute():
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 4)
    x = lg.exp(lg.relu(a))
    y = lg.neg(a)
    g = lg.Graph()
    lg.build_forward_select(g, [x, y], 1)
    assert not x.flags & lg.FLAG_COMPUTE and not x.src[0].flags & lg.FLAG_COMPUTE
    n = g.n_nodes
    lg.build_forward_expand(g, x)   # already there: nothing appended, COMPUTE propagated
    assert g.n_nodes == n
    assert x.flags & lg.FLAG_COMPUTE and x.src[0].flags & lg.FLAG_COMPUTE


def test_graph_size_bounds_nodes_and_leafs():
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 4)
    t = a
    for _ in range(3):
        t = lg.neg(t)
    g = lg.Graph(size=2)
    with pytest.raises(ValueError, match="graph is full"):
        lg.build_forward_expand(g, t)
    with pytest.raises(ValueError):
        lg.Graph(size=0)


def test_deep_chains_do_not_recurse():
    ctx = lg.Context()
    t = ctx.new_tensor_1d(F32, 4)
    for _ in range(5000):
        t = lg.neg(t)
    g = lg.Graph(size=8192)
    lg.build_forward_expand(g, t)
    assert g.n_nodes == 5000 and g.nodes[-1] is t


def test_graph_view_shares_use_counts():
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 4)
    b = lg.exp(a)
    c = lg.add(b, b)
    g = _graph(c)
    v = lg.graph_view(g, 1, 2)
    assert v.nodes == [c] and v.leafs == [] and v.use_count(b) == 2


def test_new_graph_is_ggmls_spelling_and_refuses_gradients():
    ctx = lg.Context()
    g = ctx.new_graph(16)
    assert isinstance(g, lg.Graph) and g.size == 16 and g.n_nodes == 0
    with pytest.raises(ValueError, match="gradients are not supported"):
        ctx.new_graph(16, grads=True)


def test_reuse_contract_keeps_a_plan_until_the_graph_changes():
    """A graph computed again keeps its plan (two comparisons); adding a node, clearing or
    re-splitting gives a new version and so a new plan; a view is a graph of its own."""
    from lazyggml.backends.cpu.table import FORWARD
    cpu = backend_cpu_init()
    ctx = lg.Context(no_alloc=False)
    a = ctx.new_tensor_1d(lg.F32, 8)
    tensor_set(a, np.arange(8, dtype=np.float32))
    g = lg.Graph()
    lg.build_forward_expand(g, lg.scale(a, 2.0))
    cpu.graph_compute(g)
    plan, v = FORWARD.plan(g), g.version
    cpu.graph_compute(g)
    assert FORWARD.plan(g) is plan and g.version == v
    out = lg.add(g.nodes[-1], a)
    lg.build_forward_expand(g, out)
    assert g.version != v
    cpu.graph_compute(g)
    assert FORWARD.plan(g) is not plan and len(FORWARD.plan(g).nodes) == 2
    assert np.array_equal(tensor_get(out).ravel(), np.arange(8) * 3.0)
    view = g.view(0, 1)
    assert view.version not in (g.version, v)
    v = g.version
    g.clear()
    assert g.version != v and FORWARD.plan(g).nodes == []
