"""The graph allocator (docs/graph-alloc-sched.md §4): the dynamic range allocator rule by rule,
the scenarios T06 and T07 exactly, one scenario per rule of §4 (expected offsets worked out
by hand from the rules), whole-context allocation, and property tests over random graphs.

Conventions (docs/graph-alloc-sched.md §8): F32 tensors, a host buffer type "CPUB" with alignment 32 and no maximum
size unless stated. ``at(t)`` is (chunk index, offset) of a tensor in its gallocr buffer.
"""
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lazyggml as lg
from lazyggml import alloc as A
from lazyggml.alloc import (DynTallocr, Gallocr, Tallocr, alloc_ctx_tensors, alloc_ctx_tensors_from_buft,
                            alloc_ctx_tensors_from_buft_size)
from lazyggml.buffer import SIZE_MAX, Buffer, BufferType, BufferUsage, MultiBuffer
from lazyggml.backend import Backend, Device
from lazyggml.ops import INPLACE_OPS

UNLIMITED = SIZE_MAX // 2


def cpub(max_size=SIZE_MAX, alignment=32, name="CPUB"):
    return BufferType(name, alignment=alignment, max_size=max_size, host=True)


class CountingBuft(BufferType):
    """Counts the allocations that reach the buffer type."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls = []

    def alloc_buffer(self, size):
        self.calls.append(size)
        return super().alloc_buffer(size)


def vec(ctx, n, name, flags=0):
    t = ctx.new_tensor_1d(lg.F32, n)
    t.name, t.flags = name, t.flags | flags
    return t


def graph(*outs):
    g = lg.Graph()
    for t in outs:
        lg.build_forward_expand(g, t)
    return g


def named(t, name):
    t.name = name
    return t


def at(ga, t):
    """(chunk index, offset) of ``t`` (or of its root) in the gallocr's buffers."""
    root = t.view_src or t
    for chunks in ga.buffers:
        for c, buf in enumerate(chunks or ()):
            if root.buffer is buf:
                return c, t.offset
    raise AssertionError(f"{t.name} is not in the gallocr's buffers")


def offsets(ga, *ts):
    return [at(ga, t)[1] for t in ts]


def places(ga, g):
    """Per position of ``g`` (leafs, then nodes): (chunk index, offset) in the gallocr's buffers,
    or (the buffer, offset) for memory of its own."""
    chunks = [b for bufs in ga.buffers for b in bufs or ()]
    out = []
    for t in g.leafs + g.nodes:
        buf = (t.view_src or t).buffer
        out.append((chunks.index(buf) if buf in chunks else buf, t.offset))
    return out


IN = lg.FLAG_INPUT


# -- the dynamic range allocator (docs/graph-alloc-sched.md §4.1) ---------------------------------------------------------
def test_dyn_alignment_rounding():
    d = DynTallocr(32)
    assert d.alloc(1) == (0, 0)
    assert d.alloc(33) == (0, 32)      # the first took 32
    assert d.alloc(0) == (0, 96)       # the second took 64
    assert d.max_size(0) == 96 and d.chunks[0].blocks == [[96, UNLIMITED - 96]]
    d.free(0, 32, 33)                  # freeing rounds the same way: [32, 96) comes back
    assert d.chunks[0].blocks == [[32, UNLIMITED - 32]]
    assert DynTallocr(8).alloc(12) == (0, 0) and DynTallocr(64).max_chunk_size == UNLIMITED


def fill(d, n, size=32):
    return [d.alloc(size) for _ in range(n)]


def test_dyn_best_fit_smallest_block_then_later_on_ties():
    d = DynTallocr(32)
    fill(d, 8)                          # 0, 32, ..., 224
    d.free(0, 0, 64)                    # hole of 64 at 0
    d.free(0, 96, 32)                   # hole of 32 at 96
    d.free(0, 160, 32)                  # hole of 32 at 160
    assert [b[0] for b in d.chunks[0].blocks] == [0, 96, 160, 256]
    assert d.alloc(32) == (0, 160)      # smallest fit; equal sizes: the later block wins
    assert d.alloc(32) == (0, 96)
    assert d.alloc(32) == (0, 0)        # only the 64 hole is left (the tail is never a best fit)
    assert d.chunks[0].blocks == [[32, 32], [256, UNLIMITED - 256]]


def test_dyn_best_fit_threshold_resets_per_chunk():
    d = DynTallocr(32, max_size=128)
    fill(d, 8)                          # chunk 0 and chunk 1, four blocks of 32 each
    assert len(d.chunks) == 2 and not d.chunks[0].blocks and not d.chunks[1].blocks
    d.free(0, 32, 32)
    d.free(0, 96, 32)                   # chunk 0: a 32 hole at 32 (and a tail at 96)
    d.free(1, 0, 32)
    d.free(1, 32, 32)
    d.free(1, 96, 32)                   # chunk 1: a 64 hole at 0 (and a tail at 96)
    assert d.chunks[0].blocks == [[32, 32], [96, 32]] and d.chunks[1].blocks == [[0, 64], [96, 32]]
    # a fit in the later chunk replaces the tighter fit of the earlier one
    assert d.alloc(32) == (1, 0)


def make_tails(max_size, spec):
    """A dyn allocator whose chunk k has high-water mark ``mark`` and only a tail block at ``tail``,
    for (mark, tail) in ``spec`` (chunk size ``max_size``)."""
    d = DynTallocr(32, max_size=max_size)
    for c, (mark, tail) in enumerate(spec):
        d.chunks.append(A.TallocrChunk(max_size))
        d.chunks[c].blocks = [[tail, max_size - tail]]
        d.chunks[c].max_size = mark
    return d


def test_dyn_tail_reuse_prefers_smallest_non_negative():
    # reuse = max_size - tail offset - 64: chunk 0: 128, chunk 1: 0, chunk 2: -64
    d = make_tails(1024, [(256, 64), (256, 192), (256, 256)])
    assert d.alloc(64) == (1, 192)
    d = make_tails(1024, [(256, 128), (256, 128)])   # equal reuse: the earlier chunk
    assert d.alloc(64) == (0, 128)


def test_dyn_tail_reuse_least_growth_when_all_negative():
    # reuse = mark - tail - 96: chunk 0: -64, chunk 1: -32, chunk 2: -32 (a tie: the earlier one)
    d = make_tails(1024, [(256, 224), (256, 192), (256, 192)])
    assert d.alloc(96) == (1, 192)
    assert d.chunks[1].max_size == 288


def test_dyn_tail_must_fit():
    d = make_tails(256, [(256, 224), (64, 64)])   # chunk 0's tail has 32 bytes, too few
    assert d.alloc(64) == (1, 64)


def test_dyn_new_chunk_sizes():
    d = DynTallocr(32, max_size=256)
    assert d.alloc(1000) == (0, 0)       # a tensor larger than the maximum gets its own chunk
    assert d.chunks[0].blocks == []
    assert d.alloc(64) == (1, 0) and d.chunks[1].blocks == [[64, 192]]
    assert [d.max_size(c) for c in range(3)] == [1024, 64, 0]


def test_dyn_16_chunk_limit():
    d = DynTallocr(32, max_size=32)
    assert fill(d, 17) == [(c, 0) for c in range(16)] + [(15, 32)]
    assert len(d.chunks) == 16 and d.chunks[15].blocks == [[64, UNLIMITED - 64]]
    assert d.alloc(4096) == (15, 64)    # the last chunk takes anything
    d.chunks[15].blocks = []            # (only by hand: its tail is unlimited)
    with pytest.raises(MemoryError, match="16 chunks"):
        d.alloc(32)


def test_dyn_free_merges():
    d = DynTallocr(32)
    fill(d, 8)
    d.free(0, 64, 32)                   # alone: inserted in order
    d.free(0, 192, 32)
    d.free(0, 0, 32)
    assert d.chunks[0].blocks == [[0, 32], [64, 32], [192, 32], [256, UNLIMITED - 256]]
    d.free(0, 32, 32)                   # ends block 0 and starts block 1: one block
    assert d.chunks[0].blocks == [[0, 96], [192, 32], [256, UNLIMITED - 256]]
    d.free(0, 160, 32)                  # ends where [192, 224) starts: joins it
    assert d.chunks[0].blocks == [[0, 96], [160, 64], [256, UNLIMITED - 256]]
    d.free(0, 128, 32)                  # starts where nothing ends, ends where [160..) starts
    assert d.chunks[0].blocks == [[0, 96], [128, 96], [256, UNLIMITED - 256]]
    d.free(0, 224, 32)                  # continues [128, 224) and meets the tail: all three merge
    assert d.chunks[0].blocks == [[0, 96], [128, UNLIMITED - 128]]
    d.free(0, 96, 32)
    assert d.chunks[0].blocks == [[0, UNLIMITED]]
    assert d.max_size(0) == 256         # freeing never lowers the high-water mark


def test_dyn_free_block_limit():
    d = DynTallocr(32)
    fill(d, 520)
    for k in range(255):                # 255 holes + the tail = 256 blocks
        d.free(0, 64 * k, 32)
    assert len(d.chunks[0].blocks) == A.MAX_FREE_BLOCKS
    with pytest.raises(MemoryError, match="free blocks"):
        d.free(0, 64 * 255, 32)


# -- the documented scenarios (docs/graph-alloc-sched.md §9) -------------------------------------------
def test_T06_fully_inplace_chain():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    a = lg.scale(x, 2.0)
    b = lg.exp(a)
    c = lg.soft_max(b)
    lg.set_output(c)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(c))
    assert ga.get_buffer_size() == 1024
    assert [at(ga, t) for t in (x, a, b, c)] == [(0, 0)] * 4


def test_T07_non_inplace_chain_with_freed_input_hole():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    a = lg.cont(x)
    b = lg.cont(a)
    c = lg.cont(b)
    lg.set_output(c)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(c))
    assert ga.get_buffer_size() == 2048
    assert [at(ga, t) for t in (x, a, b, c)] == [(0, 0), (0, 1024), (0, 0), (0, 1024)]
    assert all(t.buffer is ga.buffers[0][0] for t in (x, a, b, c))


# -- in place: when a result takes over its source (docs/graph-alloc-sched.md §4.3) -----------------------------------------
def test_inplace_refused_for_output_parent():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    a = lg.scale(x, 2.0)                 # takes x's bytes
    lg.set_output(a)
    b = lg.exp(a)                        # a is an output: fresh memory
    c = lg.soft_max(b)                   # takes b's bytes
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(c))
    assert offsets(ga, x, a, b, c) == [0, 0, 1024, 1024] and ga.get_buffer_size() == 2048


def test_inplace_refused_while_parent_has_another_consumer():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    a = lg.scale(x, 2.0)
    b = lg.exp(a)                        # a still has c to feed
    c = named(lg.add(a, b), "c")         # now c is a's last consumer: slot 0 wins
    lg.set_output(c)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(c))
    assert offsets(ga, x, a, b, c) == [0, 0, 1024, 0] and ga.get_buffer_size() == 2048


def test_inplace_refused_for_duplicate_src_slot():
    # T08-like: a parent in two slots of the same node has two pending children
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    a = lg.scale(x, 2.0)
    b = lg.add(a, a)
    lg.set_output(b)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(b))
    assert offsets(ga, x, a, b) == [0, 0, 1024] and ga.get_buffer_size() == 2048


@pytest.mark.parametrize("bias_rows, expect_c", [(1, 160), (4, 128)])
def test_inplace_refused_for_layout_mismatch(bias_rows, expect_c):
    ctx = lg.Context()
    x = ctx.new_tensor_2d(lg.F32, 8, 4)          # 128 B
    y = ctx.new_tensor_2d(lg.F32, 8, bias_rows)  # 32 B (broadcast) or 128 B
    lg.set_input(x)
    lg.set_input(y)
    a = lg.scale(x, 2.0)                 # takes x at 0
    lg.set_output(a)
    yb = lg.exp(y)                       # takes y
    c = lg.add(a, yb)                    # a: an output; yb: reused only when its layout is c's
    lg.set_output(c)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(c))
    assert offsets(ga, x, a, y, yb) == [0, 0, 128, 128]
    assert at(ga, c)[1] == expect_c


def test_inplace_only_for_inplace_ops():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    a = lg.cont(x)                       # CONT never runs in place
    b = lg.relu(a)                       # UNARY does
    lg.set_output(b)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(b))
    assert offsets(ga, x, a, b) == [0, 1024, 1024]
    assert A.Op.CONT not in INPLACE_OPS and A.Op.UNARY in INPLACE_OPS


class PaddedInputs(BufferType):
    """Gives INPUT tensors 64 extra bytes, as some devices pad tensors."""

    def get_alloc_size(self, t):
        return t.nbytes() + (64 if t.flags & lg.FLAG_INPUT else 0)


def test_inplace_frees_the_surplus_tail():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)           # 1088 B here
    a = lg.scale(x, 2.0)                 # 1024 B in x's place: [1024, 1088) goes back
    b = lg.cont(a)
    lg.set_output(b)
    ga = Gallocr(PaddedInputs("PAD", alignment=32, host=True))
    assert ga.alloc_graph(graph(b))
    assert offsets(ga, x, a, b) == [0, 0, 1024] and ga.get_buffer_size() == 2048
    assert ga.memory_report()[0]["no_reuse"] == 1088 + 1024 + 1024


def test_inplace_result_larger_than_parent_is_an_error():
    class PaddedScale(BufferType):
        def get_alloc_size(self, t):
            return t.nbytes() + (64 if t.op == A.Op.SCALE else 0)

    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    with pytest.raises(ValueError, match="more bytes than its parent"):
        Gallocr(PaddedScale("PAD", alignment=32, host=True)).alloc_graph(graph(lg.scale(x, 2.0)))


# -- views (docs/graph-alloc-sched.md §4.5) ---------------------------------------------------------------------------------
def test_views_never_reused_and_keep_their_root_alive():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    a = lg.cont(x)
    v = lg.view_1d(a, 128, 0)
    s = lg.scale(v, 2.0)                 # cannot take v's bytes (a view); a is still held by v
    t = lg.cont(s)
    lg.set_output(t)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(t))
    # a dies only after s, v's last consumer; then it merges into the tail, where t lands
    assert offsets(ga, x, a, s, t) == [0, 1024, 0, 512] and ga.get_buffer_size() == 2048
    assert v.buffer is a.buffer and v.offset == a.offset


def test_view_node_holds_its_root_until_consumed():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    a = lg.cont(x)
    v = lg.view_1d(a, 256, 0)
    b = lg.cont(a)                       # a's last direct consumer, but v still holds a
    s = lg.scale(v, 2.0)                 # v's consumer: a stays alive until here
    c = lg.cont(b)                       # after a is released: its bytes are a hole c fits
    lg.set_output(s)
    lg.set_output(c)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(v, b, s, c))
    assert offsets(ga, x, a, b, s, c) == [0, 1024, 0, 2048, 1024] and ga.get_buffer_size() == 3072


def test_unconsumed_view_keeps_its_root_forever():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    a = lg.cont(x)
    v1 = lg.view_1d(a, 128, 512)
    v2 = lg.view_1d(v1, 64, 256)         # flattened: a view of a at 768, whose src is v1
    assert v2.view_src is a and v2.view_offs == 768 and v2.src[0] is v1
    b = lg.cont(a)
    c = lg.cont(b)                       # a is never released: c cannot take its bytes
    lg.set_output(c)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(v2, b, c))
    assert offsets(ga, x, a, b, c) == [0, 1024, 0, 2048] and ga.get_buffer_size() == 3072
    assert at(ga, v1) == (0, 1024 + 512) and at(ga, v2) == (0, 1024 + 768)


def test_inplace_builder_is_a_view_that_keeps_its_root():
    # T17-like: add_inplace gets no memory of its own and holds its root until consumed
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    y = vec(ctx, 256, "y", IN)
    a = lg.cont(x)                       # x@0, y@1024, a@2048
    b = lg.add_inplace(a, y)             # a view of a
    c = lg.scale(b, 2.0)                 # b is a view: no reuse; the hole of x fits
    lg.set_output(c)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(c))
    assert offsets(ga, x, y, a, c) == [0, 1024, 2048, 0]
    assert b.view_src is a and at(ga, b) == (0, 2048)


# -- inputs, outputs, external tensors ------------------------------------------------------------------
def test_input_nodes_are_placed_first():
    ctx = lg.Context()
    x = vec(ctx, 256, "x")
    y = vec(ctx, 256, "y")
    a = lg.cont(x)
    b = lg.cont(y)
    lg.set_input(b)                      # an INPUT node: placed in the counting pass
    c = lg.add(a, b)
    lg.set_output(c)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(c))
    # leafs x@0, y@1024; b@2048 before a; a@3072; c takes a's place (slot 0)
    assert offsets(ga, x, y, b, a, c) == [0, 1024, 2048, 3072, 3072]


def test_input_src_outside_the_graph_is_placed_first_in_consumer_buffer():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)           # not in the graph: only a source
    y = vec(ctx, 256, "y")
    a, b = lg.cont(y), lg.cont(x)
    g = lg.Graph()
    g.add_node(a)
    g.add_node(b)
    ga = Gallocr(cpub())
    assert ga.reserve(g) and ga.alloc_graph(g)
    assert offsets(ga, x, y, a, b) == [0, 1024, 2048, 1024]
    # with two buffers, x goes where its consumer b is computed
    b0, b1 = cpub(name="B0"), cpub(name="B1")
    ctx = lg.Context()
    x, y = vec(ctx, 256, "x", IN), vec(ctx, 256, "y")
    a, b = lg.cont(y), lg.cont(x)
    g = lg.Graph()
    g.add_node(a)
    g.add_node(b)
    ga = Gallocr([b0, b1])
    assert ga.reserve_n(g, [0, 1], []) and ga.alloc_graph(g)
    assert x.buffer is ga.buffers[1][0] and y.buffer is ga.buffers[0][0]


def test_unconsumed_non_output_is_never_freed():
    # T16b-like: u has no consumer and no OUTPUT flag, and still keeps its bytes
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    u = lg.cont(x)
    v = lg.cont(x)
    w = lg.cont(v)
    y = lg.cont(w)
    lg.set_output(y)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(u, y))
    assert offsets(ga, x, u, v, w, y) == [0, 1024, 2048, 0, 2048] and ga.get_buffer_size() == 3072


def test_external_tensors_are_untouched():
    wctx = lg.Context()
    w = vec(wctx, 256, "w")
    wbuf = alloc_ctx_tensors_from_buft(wctx, cpub(name="W"))
    wbuf.usage = BufferUsage.WEIGHTS
    a = lg.scale(w, 2.0)                 # w is not the gallocr's: no reuse
    b = lg.exp(a)
    lg.set_output(b)
    ga = Gallocr(cpub())
    assert ga.alloc_graph(graph(b))
    assert w.buffer is wbuf and w.offset == 0 and wbuf.size == 1024 and wbuf.data.size == 1024
    assert offsets(ga, a, b) == [0, 0] and ga.get_buffer_size() == 1024


def test_view_of_external_tensor_and_zero_size_plan():
    wctx = lg.Context()
    w = vec(wctx, 256, "w")
    alloc_ctx_tensors_from_buft(wctx, cpub(name="W"))
    v = lg.view_1d(w, 64, 128)
    assert v.offset == 128 and v.buffer is None   # a view of allocated data: address, no buffer
    buft = CountingBuft("CPUB", alignment=32, host=True)
    ga = Gallocr(buft)
    assert ga.alloc_graph(graph(v))
    assert ga.buffers[0] == [] and ga.get_buffer_size() == 0 and buft.calls == []
    assert v.buffer is w.buffer and v.offset == 128


def test_zero_size_tensors_get_a_dummy_buffer():
    ctx = lg.Context()
    x = vec(ctx, 0, "x", IN)
    a = lg.cont(x)
    lg.set_output(a)
    buft = CountingBuft("CPUB", alignment=32, host=True)
    ga = Gallocr(buft)
    assert ga.alloc_graph(graph(a))
    assert len(ga.buffers[0]) == 1 and ga.buffers[0][0].size == 0 and buft.calls == []
    assert offsets(ga, x, a) == [0, 0] and ga.get_buffer_size() == 0


# -- buffers: chunks, growth, several buffer ids (docs/graph-alloc-sched.md §4.2, §4.6, §4.7) -------------------------------
def test_tail_reuse_across_chunks_with_max_size():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    y = vec(ctx, 256, "y", IN)
    a = lg.cont(x)                       # chunk 0 is full: a opens chunk 1
    b = lg.cont(a)                       # chunk 0's tail (x's bytes, inside its mark) beats chunk 1's
    c = lg.cont(y)                       # chunk 0 is full again; chunk 1's tail fits exactly
    d = lg.add(b, c)                     # in b's place
    lg.set_output(d)
    buft = cpub(max_size=2048)
    ga = Gallocr(buft)
    assert ga.alloc_graph(graph(d))
    assert [at(ga, t) for t in (x, y, a, b, c, d)] == [(0, 0), (0, 1024), (1, 0), (0, 0), (1, 0), (0, 0)]
    assert [buf.size for buf in ga.buffers[0]] == [2048, 1024] and ga.get_buffer_size() == 3072
    assert all(buf.usage == BufferUsage.COMPUTE for buf in ga.buffers[0])


def test_16_chunks_at_most():
    ctx = lg.Context()
    xs = [vec(ctx, 8, f"x{i}", IN) for i in range(20)]
    ys = [lg.cont(x) for x in xs]
    for t in xs + ys:
        lg.set_output(t)
    ga = Gallocr(cpub(max_size=32))
    assert ga.alloc_graph(graph(*ys))
    assert [buf.size for buf in ga.buffers[0]] == [32] * 15 + [25 * 32]
    assert [at(ga, x) for x in xs[:16]] == [(c, 0) for c in range(16)]
    assert at(ga, ys[-1]) == (15, 24 * 32)


def mlp_chain(n, name="x"):
    """x = in([n]); a, b, c = cont chain; c is the output (T07's shape, any size)."""
    ctx = lg.Context()
    x = vec(ctx, n, name, IN)
    a = lg.cont(x)
    b = lg.cont(a)
    c = lg.cont(b)
    lg.set_output(c)
    return graph(c), (x, a, b, c)


def test_buffers_never_shrink_and_smaller_graph_lands_at_worst_case_offsets():
    ga = Gallocr(cpub())
    g, _ = mlp_chain(256)
    assert ga.reserve(g) and ga.get_buffer_size() == 2048
    first = ga.buffers[0][0]
    small, ts = mlp_chain(128)           # same topology, half the bytes
    assert ga._replay_check(small) == A._SAME_SHAPE and not ga.needs_realloc(small)
    assert ga.alloc_graph(small)
    assert offsets(ga, *ts) == [0, 1024, 0, 1024]   # a fresh plan would say 0, 512, 0, 512
    assert ga.buffers[0][0] is first
    assert ga.reserve(mlp_chain(128)[0]) and ga.buffers[0][0] is first and ga.get_buffer_size() == 2048
    big, ts = mlp_chain(512)
    assert ga.needs_realloc(big) and ga.alloc_graph(big)   # one buffer: reserves by itself
    assert ga.buffers[0][0] is not first and ga.get_buffer_size() == 4096 and first.size == 0
    assert offsets(ga, *ts) == [0, 2048, 0, 2048]


def test_realloc_replaces_every_chunk():
    ga = Gallocr(cpub(max_size=2048))
    g, _ = mlp_chain(256)                # one chunk of 2048
    assert ga.reserve(g)
    first = list(ga.buffers[0])
    ctx = lg.Context()                   # now two chunks, the first still 2048: no realloc
    xs = [vec(ctx, 256, f"x{i}", IN | lg.FLAG_OUTPUT) for i in range(3)]
    assert ga.reserve(graph(lg.add(lg.add(xs[0], xs[1]), xs[2])))
    assert [b.size for b in ga.buffers[0]] == [2048, 2048] and ga.buffers[0][0] is not first[0]
    assert ga.reserve(g) and [b.size for b in ga.buffers[0]] == [2048, 2048]   # keeps both


def test_needs_realloc_rules():
    ga = Gallocr(cpub())
    g, (x, a, b, c) = mlp_chain(256)
    assert ga.needs_realloc(g)           # nothing reserved yet
    ga.reserve(g)
    assert not ga.needs_realloc(g)
    g2, _ = mlp_chain(256)
    assert not ga.needs_realloc(g2)
    g3, _ = mlp_chain(257)               # a tensor larger than its plan
    assert ga.needs_realloc(g3)
    ctx = lg.Context()
    x4 = vec(ctx, 256, "x", IN)
    g4 = graph(lg.cont(lg.cont(x4)))     # fewer nodes
    assert ga.needs_realloc(g4)
    # a position that had data at reserve time (no plan) but needs memory now
    wctx = lg.Context()
    w = vec(wctx, 256, "w")
    alloc_ctx_tensors_from_buft(wctx, cpub(name="W"))
    ga = Gallocr(cpub())
    assert ga.reserve(graph(lg.scale(w, 2.0)))
    ctx = lg.Context()
    assert ga.needs_realloc(graph(lg.scale(vec(ctx, 256, "w2"), 2.0)))
    # after an alloc_graph every tensor has data: nothing needs memory
    ga = Gallocr(cpub())
    assert ga.alloc_graph(g)
    assert not ga.needs_realloc(g)


def test_rewired_graph_is_checked_slot_by_slot():
    """Same counts, states and layouts, but c reads a where it read the view v: that slot had no
    plan (views get none), so GGML re-plans."""
    def make(rewire):
        ctx = lg.Context()
        x = vec(ctx, 256, "x", IN)
        a = lg.cont(x)
        v = lg.view_1d(a, 256, 0)
        c = lg.add(a if rewire else v, a)
        g = graph(v, c)
        assert [t.op for t in g.nodes] == [A.Op.CONT, A.Op.VIEW, A.Op.ADD]
        return g

    ga = Gallocr(cpub())
    assert ga.reserve(make(False))
    assert not ga.needs_realloc(make(False))
    assert ga._replay_check(make(True)) == A._REALLOC


def test_tensor_at_two_positions_keeps_its_first_place():
    """A graph assembled by hand (as the scheduler does) may list a tensor twice; GGML places it
    at its first position and leaves the second alone."""
    def make(first):
        ctx = lg.Context()
        p, q, r = (vec(ctx, 256, name, IN | lg.FLAG_OUTPUT) for name in "pqr")
        g = lg.Graph()
        if first:
            g.leafs += [p, q, p]
            g.nodes.append(lg.add(p, q))
        else:
            g.leafs += [r, p, p]
            g.nodes.append(lg.add(p, p))
        return g, p

    fast, slow = Gallocr(cpub()), Gallocr(cpub())
    slow._sized_by_layout = False
    for ga in (fast, slow):
        assert ga.reserve(make(True)[0])
    (g1, p1), (g2, _) = make(False), make(False)
    assert fast._replay_check(g1) == A._SAME_SHAPE
    assert fast.alloc_graph(g1) and slow.alloc_graph(g2)
    assert places(fast, g1) == places(slow, g2) and p1.offset == 1024


def two_buffer_graph():
    ctx = lg.Context()
    x = vec(ctx, 256, "x", IN)
    a = lg.cont(x)
    b = lg.cont(a)
    lg.set_output(b)
    return graph(b), (x, a, b)


def test_several_buffers_need_reserve_n():
    b0, b1 = cpub(name="B0"), cpub(name="B1")
    ga = Gallocr([b0, b1])
    g, (x, a, b) = two_buffer_graph()
    assert ga.alloc_graph(g) is False and x.buffer is None   # cannot reserve by itself
    assert ga.reserve_n(g, [0, 1], [0])
    assert ga.alloc_graph(g)
    assert (x.buffer, a.buffer, b.buffer) == (ga.buffers[0][0], ga.buffers[0][0], ga.buffers[1][0])
    assert offsets(ga, x, a, b) == [0, 1024, 0]
    assert (ga.get_buffer_size(0), ga.get_buffer_size(1)) == (2048, 1024)
    g2, ts = two_buffer_graph()          # same shape: replays
    assert ga.alloc_graph(g2) and offsets(ga, *ts) == [0, 1024, 0]


def test_shared_buffer_type_shares_allocator_and_buffer():
    buft = cpub()
    ga = Gallocr([buft, buft])
    g, (x, a, b) = two_buffer_graph()
    assert ga.reserve_n(g, [0, 1], [0]) and ga.alloc_graph(g)
    assert ga.buffers[0] is ga.buffers[1] and ga.buf_tallocs[0] is ga.buf_tallocs[1]
    assert offsets(ga, x, a, b) == [0, 1024, 0]   # b reuses x's hole across ids
    assert (ga.get_buffer_size(0), ga.get_buffer_size(1)) == (2048, 0)
    assert ga.reserve_n_size(two_buffer_graph()[0], [0, 1], [0]) == [2048, 2048]   # no dedupe here
    # a graph whose tensors all have memory now (this one) plans nothing
    assert ga.reserve_n_size(g, [0, 1], [0]) == [0, 0]
    assert len(ga.memory_report()) == 1 and ga.memory_report()[0]["buffer_ids"] == [0, 1]


def test_reserve_n_size_plans_without_allocating():
    buft = CountingBuft("CPUB", alignment=32, host=True)
    ga = Gallocr(buft)
    g, ts = mlp_chain(256)
    assert ga.reserve_n_size(g) == [2048] and ga.buffers == [None] and buft.calls == []
    assert ga.alloc_graph(g) and buft.calls == [2048] and offsets(ga, *ts) == [0, 1024, 0, 1024]
    # a larger plan drops the buffer that can't hold it; the next alloc_graph reserves again
    big, ts = mlp_chain(512)
    assert ga.reserve_n_size(big) == [4096] and ga.buffers == [None]
    assert ga.alloc_graph(big) and buft.calls == [2048, 4096]


def test_buffer_reset_hook_runs_before_placement():
    log = []

    class ResettingBuffer(Buffer):
        def reset(self):
            log.append("reset")

        def init_tensor(self, t):
            log.append(t.name)
            return super().init_tensor(t)

    class Buft(BufferType):
        def alloc_buffer(self, size):
            return ResettingBuffer(self, size)

    g, ts = mlp_chain(64)
    ga = Gallocr(Buft("R", alignment=32, host=True))
    assert ga.alloc_graph(g)
    assert log == ["reset"] + [t.name for t in ts]
    log.clear()
    g2, ts2 = mlp_chain(64, "x2")
    assert ga.alloc_graph(g2) and log == ["reset"] + [t.name for t in ts2]


# -- memory report -------------------------------------------------------------------------------------
def test_memory_report_and_debug_log(monkeypatch, caplog):
    g, _ = mlp_chain(256)
    ga = Gallocr(cpub())
    monkeypatch.setenv("LAZYGGML_DEBUG", "1")
    with caplog.at_level(logging.INFO, logger="lazyggml"):
        assert ga.alloc_graph(g)
    assert ga.memory_report() == [{"buft": "CPUB", "buffer_ids": [0], "peak": 2048, "buffer_size": 2048,
                                   "no_reuse": 4096, "n_tensors": 4}]
    assert any(r.name == "lazyggml" and r.levelno == logging.INFO and "peak 2.00 KiB" in r.getMessage()
               and "50.0%" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.delenv("LAZYGGML_DEBUG")
    with caplog.at_level(logging.INFO, logger="lazyggml"):
        ga.reserve(g)
    assert not caplog.records


# -- whole contexts (docs/graph-alloc-sched.md §4.8) -----------------------------------------------------------------------------
def test_tallocr_is_linear_and_padded():
    buf = cpub().alloc_buffer(2048)
    ctx = lg.Context()
    a, b, c = vec(ctx, 256, "a"), vec(ctx, 100, "b"), vec(ctx, 256, "c")
    t = Tallocr(buf)
    t.alloc(a)
    t.alloc(b)
    assert (a.offset, b.offset, t.offset) == (0, 1024, 1024 + 416)
    with pytest.raises(lg.OutOfMemoryError, match="not enough space"):
        t.alloc(c)


def test_alloc_ctx_tensors_splits_at_max_size():
    buft = CountingBuft("CPUB", alignment=32, max_size=2048, host=True)
    ctx = lg.Context()
    a = vec(ctx, 256, "a")               # 1024
    b = vec(ctx, 100, "b")               # 400 -> 416
    c = vec(ctx, 256, "c")               # 1024: would pass 2048, starts buffer 1
    v = lg.view_1d(a, 16, 64)            # a view of a tensor of an earlier buffer
    d = vec(ctx, 600, "d")               # 2400, larger than the maximum: a buffer of its own
    assert alloc_ctx_tensors_from_buft_size(ctx, buft) == 1440 + 1024 + 2400 and buft.calls == []
    mb = alloc_ctx_tensors_from_buft(ctx, buft)
    assert isinstance(mb, MultiBuffer) and buft.calls == [1440, 1024, 2400]
    parts = mb.buffers
    assert [(t.buffer, t.offset) for t in (a, b, c, d)] == [(parts[0], 0), (parts[0], 1024), (parts[1], 0),
                                                             (parts[2], 0)]
    assert v.buffer is parts[0] and v.offset == 64
    mb.usage = BufferUsage.WEIGHTS
    assert all(p.usage == BufferUsage.WEIGHTS for p in parts)
    # every tensor has memory now: nothing left to allocate
    assert alloc_ctx_tensors_from_buft(ctx, buft) is None and alloc_ctx_tensors_from_buft_size(ctx, buft) == 0


def test_alloc_ctx_tensors_single_buffer_and_backend():
    class Dev(Device):
        def __init__(self):
            super().__init__("D")
            self.buft = cpub(name="D_buf")

        def get_buffer_type(self):
            return self.buft

    backend = Backend(Dev())
    ctx = lg.Context()
    a, b = vec(ctx, 8, "a"), vec(ctx, 3, "b")
    buf = alloc_ctx_tensors(ctx, backend)
    assert isinstance(buf, Buffer) and not isinstance(buf, MultiBuffer)
    assert buf.buft is backend.device.buft and buf.size == 64 and (a.offset, b.offset) == (0, 32)
    with pytest.raises(ValueError, match="no_alloc"):
        alloc_ctx_tensors_from_buft(lg.Context(no_alloc=False), cpub())
    assert alloc_ctx_tensors_from_buft(lg.Context(), cpub()) is None


# -- property tests over random graphs --------------------------------------------------------------------
SHAPES = [(8, 1), (8, 2), (8, 4), (3, 1), (3, 2)]
UNARY = ["scale", "exp", "relu", "soft_max", "cont"]
BINARY = ["add", "mul", "add_inplace"]


@st.composite
def recipes(draw, max_ops=14):
    """A random graph as a list of steps, so that it can be built twice."""
    steps, shapes = [], []
    for _ in range(draw(st.integers(1, 4))):
        shape = draw(st.sampled_from(SHAPES))
        kind = draw(st.sampled_from(["input", "input", "leaf", "external"]))
        steps.append(("leaf", kind, shape))
        shapes.append(shape)
    for _ in range(draw(st.integers(1, max_ops))):
        i = draw(st.integers(0, len(shapes) - 1))
        choice = draw(st.sampled_from(UNARY + BINARY + ["view"]))
        if choice in BINARY:
            fits = [j for j, s in enumerate(shapes) if shapes[i][0] == s[0] and shapes[i][1] % s[1] == 0]
            j = draw(st.sampled_from(fits))
            steps.append((choice, i, j))
            shape = shapes[i]
        elif choice == "view":
            n = shapes[i][0] * shapes[i][1]
            k = draw(st.integers(1, n))
            first = draw(st.integers(0, n - k))
            steps.append(("view", i, k, first))
            shape = (k, 1)
        else:
            steps.append((choice, i))
            shape = shapes[i]
        shapes.append(shape)
    outputs = draw(st.lists(st.integers(0, len(steps) - 1), max_size=3))
    extra_roots = draw(st.lists(st.integers(0, len(steps) - 1), max_size=2))
    return steps, outputs, extra_roots


def build(recipe, ctx, externals):
    """The graph of ``recipe`` in ``ctx``; external leafs come from ``externals`` (shared)."""
    steps, outputs, extra_roots = recipe
    ts = []
    with ctx:
        for k, step in enumerate(steps):
            op = step[0]
            if op == "leaf":
                _, kind, shape = step
                if kind == "external":
                    t = externals[k]
                else:
                    t = ctx.new_tensor_2d(lg.F32, *shape)
                    if kind == "input":
                        lg.set_input(t)
            elif op == "view":
                _, i, n, first = step
                t = lg.view_1d(ts[i], n, 4 * first)
            elif op in BINARY:
                t = getattr(lg, op)(ts[step[1]], ts[step[2]])
            elif op == "scale":
                t = lg.scale(ts[step[1]], 0.5)
            else:
                t = getattr(lg, op)(ts[step[1]])
            t.name = f"t{k}"
            ts.append(t)
    for k in outputs:
        lg.set_output(ts[k])
    roots = [ts[-1]] + [ts[k] for k in extra_roots]
    g = lg.Graph()
    for t in roots:
        if t.op != A.Op.NONE:
            lg.build_forward_expand(g, t)
    return g, ts


def make_externals(recipe, no_alloc_buft):
    ctx = lg.Context()
    ext = {}
    for k, step in enumerate(recipe[0]):
        if step[0] == "leaf" and step[1] == "external":
            ext[k] = ctx.new_tensor_2d(lg.F32, *step[2])
            ext[k].name = f"ext{k}"
    if ext:
        alloc_ctx_tensors_from_buft(ctx, no_alloc_buft)
    return ext


def lifetimes(g):
    """(birth, death) in node steps of every tensor with memory of its own, as correctness needs
    it: from its producer (or the start, for leafs and inputs) to its last reader; views extend
    their root; outputs and results nobody reads live to the end."""
    n = g.n_nodes
    end = n + 1
    pos = {t: i for i, t in enumerate(g.nodes)}
    death = {}

    def extend(t, i):
        root = t.view_src or t
        death[root] = max(death.get(root, -1), i)

    consumed = set()
    for i, node in enumerate(g.nodes):
        for s in node.src:
            if s is not None:
                extend(s, i)
                consumed.add(s)
        if node.view_src is not None:
            extend(node, i)
    for t in g.leafs + g.nodes:
        if t.flags & lg.FLAG_OUTPUT or (t in pos and t not in consumed):
            extend(t, end)
    spans = {}
    for t in g.leafs + g.nodes:
        if t.view_src is None:
            birth = -1 if (t not in pos or t.flags & IN) else pos[t]
            spans[t] = (birth, death.get(t, birth))
    for node in g.nodes:  # INPUT sources are placed in the counting pass too
        for s in node.src:
            if s is not None and s.view_src is None and s.flags & IN:
                spans[s] = (-1, spans[s][1])
    return spans, pos


def check_plan(g, ga):
    spans, pos = lifetimes(g)
    ours = {id(b) for chunks in ga.buffers if chunks for b in chunks}
    placed = [t for t in spans if t.buffer is not None and id(t.buffer) in ours]
    # every tensor (views included) lies inside its buffer
    for t in g.leafs + g.nodes:
        buf = t.data_buffer()
        assert buf is not None and t.offset is not None, t.name
        assert 0 <= t.offset and t.offset + t.nbytes() <= buf.size, t.name
    for i, t1 in enumerate(placed):
        for t2 in placed[i + 1:]:
            if t1.buffer is not t2.buffer:
                continue
            if t1.offset >= t2.offset + t2.nbytes() or t2.offset >= t1.offset + t1.nbytes():
                continue
            (b1, d1), (b2, d2) = spans[t1], spans[t2]
            if d1 < b2 or d2 < b1:
                continue
            # the only allowed overlap: an in-place result over its source, which dies there
            young, old = (t2, t1) if b2 > b1 else (t1, t2)
            j = spans[young][0]
            assert young.op in INPLACE_OPS and old in young.src and spans[old][1] == j, \
                f"{t1.name} {spans[t1]} and {t2.name} {spans[t2]} overlap while both alive"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipes(), st.sampled_from([SIZE_MAX, 64, 128]))
def test_random_graphs_never_overlap_live_tensors(recipe, max_size):
    ext = make_externals(recipe, cpub(name="EXT"))
    g, _ = build(recipe, lg.Context(), ext)
    ga = Gallocr(cpub(max_size=max_size))
    assert ga.alloc_graph(g)
    check_plan(g, ga)
    # the same recipe again replays the plan, through the fast path, at the same places
    g2, _ = build(recipe, lg.Context(), ext)
    assert ga._replay_check(g2) == A._SAME_SHAPE
    assert ga.alloc_graph(g2)
    assert places(ga, g2) == places(ga, g)


def resized(recipe, rows):
    """The same recipe with every leaf's row count changed by ``rows(n)`` (views that no longer
    fit their source fail to build)."""
    steps, outputs, extra_roots = recipe
    steps = [("leaf", s[1], (s[2][0], rows(s[2][1]))) if s[0] == "leaf" else s for s in steps]
    return steps, outputs, extra_roots


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipes(), recipes(), st.sampled_from(["same", "smaller", "larger", "other"]))
def test_fast_replay_matches_ggml_slot_by_slot(recipe, other, replay):
    """The fast path (_GraphShape) decides and places exactly like GGML's slot-by-slot check."""
    replay = {"same": recipe, "smaller": resized(recipe, lambda n: 1), "larger": resized(recipe, lambda n: 2 * n),
              "other": other}[replay]
    ext = make_externals(recipe, cpub(name="EXT"))
    ext.update({k: v for k, v in make_externals(replay, cpub(name="EXT2")).items() if k not in ext})
    g0, _ = build(recipe, lg.Context(), ext)
    fast, slow = Gallocr(cpub()), Gallocr(cpub())
    slow._sized_by_layout = False        # never builds a shape: GGML's check and init only
    assert fast.reserve(g0) and slow.reserve(g0)
    assert fast._replay_key is not None and slow._replay_key is None
    try:
        ga_g, _ = build(replay, lg.Context(), ext)
        gb_g, _ = build(replay, lg.Context(), ext)
    except ValueError:
        return  # a view that no longer fits its source, or shapes that no longer broadcast
    assert fast.needs_realloc(ga_g) == slow.needs_realloc(gb_g)
    assert fast.alloc_graph(ga_g) and slow.alloc_graph(gb_g)
    assert fast.get_buffer_size() == slow.get_buffer_size()
    assert places(fast, ga_g) == places(slow, gb_g)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipes(), st.randoms(use_true_random=False))
def test_random_graphs_compute_like_unplanned(recipe, rnd):
    from lazyggml.backends.cpu import backend_cpu_init, cpu_buffer_type
    # each run gets its own external tensors (in-place ops may write them), with the same data
    ext, ext_free = make_externals(recipe, cpu_buffer_type()), make_externals(recipe, cpu_buffer_type())
    for k, t in ext.items():
        data = np.array([rnd.uniform(-1, 1) for _ in range(t.nelements())], np.float32)
        lg.tensor_set(t, data)
        lg.tensor_set(ext_free[k], data)
    planned, pts = build(recipe, lg.Context(), ext)
    free, fts = build(recipe, lg.Context(no_alloc=False), ext_free)   # every tensor its own memory
    ga = Gallocr(cpu_buffer_type())
    assert ga.alloc_graph(planned)
    for pt, ft in zip(pts, fts):
        if pt in planned and pt.op == A.Op.NONE and pt.view_src is None and pt not in ext.values():
            data = np.array([rnd.uniform(-1, 1) for _ in range(pt.nelements())], np.float32)
            lg.tensor_set(pt, data)
            lg.tensor_set(ft, data)
    backend = backend_cpu_init()
    backend.graph_compute(planned)
    backend.graph_compute(free)
    consumed = {s for n in planned.nodes for s in n.src if s is not None}
    for pt, ft in zip(pts, fts):
        if pt in planned and pt.op != A.Op.NONE and (pt.flags & lg.FLAG_OUTPUT or pt not in consumed):
            np.testing.assert_allclose(lg.tensor_get(pt), lg.tensor_get(ft), rtol=1e-6, atol=1e-6,
                                       err_msg=pt.name)
