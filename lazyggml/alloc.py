"""Memory planning for graphs: GGML's ggml-alloc.c (docs/graph-alloc-sched.md §4).

Three allocators live here.

``Tallocr`` (GGML's ``ggml_tallocr``) is a bump pointer over one existing buffer: each tensor takes
the next aligned range. ``alloc_ctx_tensors_from_buft`` uses it to give every tensor of a context
(weights, KV cache) its own memory, cutting the context into several buffers when the buffer type
has a maximum size.

``DynTallocr`` (GGML's ``ggml_dyn_tallocr``) plans ranges without touching memory. It only tracks
which bytes are free: per *chunk* a list of free blocks sorted by offset, and a high-water mark
``max_size``. ``alloc`` best-fits a hole, else takes the end of a chunk (the *tail* block, which
grows the chunk), else opens a new chunk; ``free`` gives the range back and merges it with its
neighbours. A chunk becomes one backend buffer of ``max_size`` bytes, so an address is a pair
``(chunk, offset)``. Buffer types without a maximum size only ever use one chunk.

``Gallocr`` (GGML's ``ggml_gallocr``) plans a whole graph with one dyn allocator per buffer type.
It simulates the execution order: a tensor gets memory when its producer runs and gives it back
once its last consumer has run (``n_children``), or, for a tensor that views hold on to, once every
view node of it is done (``n_views``). An op that may run in place (``op_can_inplace``) takes over
the memory of a source that dies at this very node instead of asking for new bytes. The outcome,
a ``(buffer id, chunk, offset)`` per tensor, is recorded by *position* (node index, source slot,
leaf index) so that the next graph of the same shape replays it without planning (``alloc_graph``).
Graph outputs, pre-allocated tensors and views never give memory back or away.

Replaying must cost far less than planning. A graph with the reserved graph's shape (same
wiring, layouts and data: ``_GraphShape``) is recognised with a few list comparisons and placed
position by position, without GGML's per-slot work; any other graph takes GGML's slot-by-slot
check and init, which decide and place the same way. ``memory_report`` compares the planned peak
with what the same tensors would take without any reuse.
"""
from __future__ import annotations

import logging
from operator import itemgetter

from .buffer import (SIZE_MAX, Buffer, BufferType, BufferUsage, MultiBuffer, Status, buft_alloc_buffer,
                     tensor_alloc, view_init)
from . import debug
from .errors import OutOfMemoryError
from .ops import INPLACE_OPS, Op
from .tensor import FLAG_INPUT, FLAG_OUTPUT

__all__ = ["MAX_FREE_BLOCKS", "VBUFFER_MAX_CHUNKS", "DynTallocr", "Gallocr", "Tallocr",
           "alloc_ctx_tensors_from_buft", "alloc_ctx_tensors_from_buft_size", "alloc_ctx_tensors"]

MAX_FREE_BLOCKS = 256       # per chunk
VBUFFER_MAX_CHUNKS = 16     # GGML_VBUFFER_MAX_CHUNKS: the last chunk is unlimited

logger = logging.getLogger("lazyggml")


def _pad(size, alignment):
    """Round ``size`` up to a multiple of the power of two ``alignment``."""
    return (size + alignment - 1) & -alignment


# -- the dynamic range allocator -----------------------------------------------------------------
class TallocrChunk:
    """One future backend buffer: free blocks ``[offset, size]`` sorted by offset, and the highest
    byte ever handed out (``max_size``), which is what the buffer will have to hold."""

    __slots__ = ("blocks", "max_size")

    def __init__(self, size):
        self.blocks = [[0, size]]
        self.max_size = 0


class DynTallocr:
    """GGML's ``ggml_dyn_tallocr``: plans offsets in up to 16 chunks (docs/graph-alloc-sched.md §4.1)."""

    def __init__(self, alignment, max_size=SIZE_MAX):
        self.alignment = alignment
        self.max_chunk_size = min(max_size, SIZE_MAX // 2)  # half of size_t: sums never overflow
        self.chunks = []

    def reset(self):
        """Forget every chunk and every planned block: the next plan starts empty."""
        self.chunks = []

    def max_size(self, chunk):
        """The bytes chunk ``chunk`` must hold: the end of the highest block planned in it (0 for a chunk not
        made yet)."""
        return self.chunks[chunk].max_size if chunk < len(self.chunks) else 0

    def total_size(self):
        """The bytes of all the chunks together: what the buffers must hold for this plan."""
        return sum(c.max_size for c in self.chunks)

    def alloc(self, size):
        """Plan ``size`` bytes; returns the address ``(chunk, offset)``."""
        size = _pad(size, self.alignment)
        chunks = self.chunks
        best_chunk = best_block = -1

        # A: best fit among the holes (every block but a chunk's last). The threshold restarts in
        # each chunk, so a fit in a later chunk wins over any fit in an earlier one; "<=" sends
        # ties to the later block.
        for c, chunk in enumerate(chunks):
            best_size = SIZE_MAX
            blocks = chunk.blocks
            for i in range(len(blocks) - 1):
                bsize = blocks[i][1]
                if size <= bsize <= best_size:
                    best_chunk, best_block, best_size = c, i, bsize

        # B: a tail block. reuse = bytes of the tail already inside the chunk's high-water mark
        # left over after this tensor (negative: how much the chunk must grow). Prefer the
        # smallest reuse >= 0, else the least growth; ties keep the earlier chunk.
        if best_block < 0:
            best_reuse = None
            for c, chunk in enumerate(chunks):
                if not chunk.blocks:
                    continue
                offset, bsize = chunk.blocks[-1]
                if bsize < size:
                    continue
                reuse = chunk.max_size - offset - size
                if best_reuse is None or (best_reuse < 0 and reuse > best_reuse) or 0 <= reuse < best_reuse:
                    best_chunk, best_block, best_reuse = c, len(chunk.blocks) - 1, reuse

        # C: a new chunk, limited to the buffer type's maximum unless the tensor alone is bigger;
        # the last possible chunk is unlimited so that planning never fails.
        if best_block < 0:
            if len(chunks) >= VBUFFER_MAX_CHUNKS:
                raise OutOfMemoryError(f"graph allocation: no room for {size} bytes in "
                                  f"{VBUFFER_MAX_CHUNKS} chunks")
            limit = SIZE_MAX // 2 if len(chunks) == VBUFFER_MAX_CHUNKS - 1 else max(size, self.max_chunk_size)
            chunks.append(TallocrChunk(limit))
            best_chunk, best_block = len(chunks) - 1, 0

        # carve the tensor from the front of the chosen block
        chunk = chunks[best_chunk]
        block = chunk.blocks[best_block]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del chunk.blocks[best_block]
        if offset + size > chunk.max_size:
            chunk.max_size = offset + size
        return best_chunk, offset

    def free(self, chunk_id, offset, size):
        """Give ``size`` bytes at ``(chunk_id, offset)`` back, merging with the neighbours."""
        size = _pad(size, self.alignment)
        blocks = self.chunks[chunk_id].blocks
        for i, block in enumerate(blocks):
            if block[0] + block[1] == offset:           # the range continues this block
                block[1] += size
                if i + 1 < len(blocks) and block[0] + block[1] == blocks[i + 1][0]:
                    block[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if offset + size == block[0]:               # the range ends where this block starts
                block[0] = offset
                block[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == offset:
                    blocks[i - 1][1] += block[1]
                    del blocks[i]
                return
        if len(blocks) >= MAX_FREE_BLOCKS:
            raise OutOfMemoryError(f"graph allocation: out of free blocks ({MAX_FREE_BLOCKS} per chunk)")
        pos = 0
        while pos < len(blocks) and blocks[pos][0] < offset:
            pos += 1
        blocks.insert(pos, [offset, size])


# -- the graph allocator ---------------------------------------------------------------------------
class _HashNode:
    """The planner's per-tensor record (GGML's ``hash_node``). ``allocated`` means "own": the
    tensor currently holds planned memory that the planner may free or hand on in place."""

    __slots__ = ("n_children", "n_views", "buffer_id", "chunk", "offset", "size", "allocated")

    def __init__(self):
        self.n_children = 0
        self.n_views = 0
        self.buffer_id = 0
        self.chunk = 0
        self.offset = 0
        self.size = 0       # alloc size, cached: GGML asks the buffer type again each time
        self.allocated = False


# A plan entry (GGML's ``tensor_alloc``): (buffer_id, chunk, offset, size_max); buffer id -1 for
# views and tensors that had data at reserve time.
_NO_ALLOC = (-1, -1, SIZE_MAX, 0)

# the three answers of Gallocr._replay_check
_REALLOC, _FITS, _SAME_SHAPE = 0, 1, 2


def _uses_nbytes(buft):
    """True when the buffer type sizes tensors by ``nbytes``, a function of the layout alone."""
    return getattr(buft.get_alloc_size, "__func__", None) is BufferType.get_alloc_size


def _picker(indices):
    """``itemgetter`` that always returns a tuple, whatever the number of indices."""
    if len(indices) == 1:
        i = indices[0]
        return lambda seq: (seq[i],)
    return itemgetter(*indices) if indices else (lambda seq: ())


def _plain(buffers):
    """True when none of these buffers has an ``init_tensor`` hook to call (the base no-op)."""
    return all(type(b).init_tensor is Buffer.init_tensor for b in buffers)


def _state(t):
    """What a planned position's tensor must keep: no data, not a view, the same layout."""
    return t.offset, t.view_src, t.type, t.ne, t.nb


class _GraphShape:
    """The reserved graph's shape: what a later graph must share with it to pass GGML's check
    by construction. Comparing shapes takes a few list comprehensions and C-level ``itemgetter``
    picks instead of GGML's Python step per source slot; this is what makes a replay cheap.

    Positions are node indices, then leaf indices after them (``n_nodes + i``), then one more for
    an empty slot. The shape holds:

    * the wiring: per node the number of empty source slots, and per used slot column the
      position of the tensor in that slot. Same wiring: each slot holds the tensor at the same
      position as before, so the slot's plan entry is that position's entry;
    * the planned positions (no data, not a view at reserve time): the new tensor there must be
      neither, and fit its plan: the same layout (hence the same nbytes: no need to ask the
      buffer type), or an alloc size within the planned one (a smaller graph, as when a decoder
      replays the worst case it reserved);
    * the positions that had data, or were views: the new tensors there must too, else they
      would need memory the plan never gave them.

    It exists only for graphs whose sources are all leafs or earlier nodes (graphs built by
    expansion). Then initialising a node's sources is a no-op, and a replay only places the
    planned positions and initialises the views.
    """

    __slots__ = ("none_counts", "columns", "planned", "planned_state", "with_data", "views", "order",
                 "places", "offsets", "limits", "order_entries", "plain")

    @classmethod
    def of(cls, graph):
        nodes, leafs = graph.nodes, graph.leafs
        n = len(nodes)
        position = {t: n + i for i, t in enumerate(leafs)}
        position.update((t, i) for i, t in enumerate(nodes))
        empty = n + len(leafs)
        width = max((k + 1 for node in nodes for k, s in enumerate(node.src) if s is not None), default=0)
        columns = [[] for _ in range(width)]
        for i, node in enumerate(nodes):
            for k in range(width):
                s = node.src[k]
                p = empty if s is None else position.get(s)
                if p is None or i <= p < n:
                    return None
                columns[k].append(p)
        shape = cls()
        shape.none_counts = [node.src.count(None) for node in nodes]
        shape.columns = [_picker(c) for c in columns]
        tensors = nodes + leafs

        def init_order(p):  # GGML initialises the leafs, then the nodes
            return p < n, p

        planned = sorted((p for p, t in enumerate(tensors) if t.offset is None and t.view_src is None),
                         key=init_order)
        views = sorted((p for p, t in enumerate(tensors) if t.view_src is not None), key=init_order)
        # backwards, so that a tensor found at two positions ends at the first, as in GGML
        shape.planned = _picker(planned[::-1])
        shape.planned_state = [_state(t) for t in shape.planned(tensors)]
        shape.with_data = _picker([p for p, t in enumerate(tensors)
                                   if t.offset is not None and t.view_src is None])
        shape.views = _picker(views)
        shape.order = _picker(sorted(planned + views, key=init_order))
        return shape

    def bind(self, bufts, buffers, entries):
        """Resolve the planned positions' chunk buffers, offsets and size limits, once per
        reserve."""
        picked = self.planned(entries)
        self.places = [buffers[e[0]][e[1]] for e in picked]
        self.offsets = [e[2] for e in picked]
        self.limits = [(bufts[e[0]], e[3]) for e in picked]
        self.order_entries = self.order(entries)
        self.plain = _plain(set(self.places))

    def matches(self, graph):
        """Whether ``graph`` has this shape and fits the plan (then GGML's check passes too)."""
        nodes = graph.nodes
        tensors = nodes + graph.leafs + [None]
        srcs = [node.src for node in nodes]
        if [s.count(None) for s in srcs] != self.none_counts:
            return False
        for k, column in enumerate(self.columns):
            if tuple([s[k] for s in srcs]) != column(tensors):
                return False
        if None in [t.offset for t in self.with_data(tensors)]:
            return False
        if None in [t.view_src for t in self.views(tensors)]:
            return False
        planned = self.planned(tensors)
        states = [_state(t) for t in planned]
        if states == self.planned_state:
            return True
        # some layouts changed: those tensors must still need memory, and fit in their plan
        for t, state, old, (buft, size_max) in zip(planned, states, self.planned_state, self.limits):
            if state != old and (t.offset is not None or t.view_src is not None
                                 or buft.get_alloc_size(t) > size_max):
                return False
        return True

    def place(self, graph, init):
        """Initialise a matching graph's tensors: GGML's init, minus the no-op source inits."""
        tensors = graph.nodes + graph.leafs
        if not self.plain:  # buffer hooks run in GGML's order, one tensor at a time
            for t, entry in zip(self.order(tensors), self.order_entries):
                if t.buffer is None:
                    init(t, entry)
            return
        # no hooks to run for the planned tensors (and matches() saw that they have no data):
        # place them, then initialise the views, whose roots all have their places by now
        for t, buf, offset in zip(self.planned(tensors), self.places, self.offsets):
            t.buffer, t.offset = buf, offset
        for t in self.views(tensors):
            root = t.view_src
            if t.buffer is None and root.buffer is not None:  # view_init, inlined
                t.buffer, t.offset = root.buffer, root.offset + t.view_offs
                root.buffer.init_tensor(t)


class Gallocr:
    """GGML's ``ggml_gallocr``: ``Gallocr(buft)`` or ``Gallocr([buft, ...])`` (buffer id = index).

    The same buffer type object given twice shares one dyn allocator and one physical buffer.
    ``buffers[id]`` is the list of chunk ``Buffer`` objects of that id (None before a reserve).
    """

    def __init__(self, bufts):
        self.bufts = list(bufts) if isinstance(bufts, (list, tuple)) else [bufts]
        if not self.bufts:
            raise ValueError("Gallocr: needs at least one buffer type")
        self.buf_tallocs = []
        for i, buft in enumerate(self.bufts):
            shared = next((self.buf_tallocs[j] for j in range(i) if self.bufts[j] is buft), None)
            if shared is None:
                shared = DynTallocr(buft.get_alignment(), buft.get_max_size())
            self.buf_tallocs.append(shared)
        self.buffers = [None] * len(self.bufts)
        self._sized_by_layout = all(_uses_nbytes(b) for b in self.bufts)
        self._hash = {}
        self._dst_allocs = []      # plan entry per node index
        self._src_allocs = []      # per node index, a tuple of entries, one per source slot
        self._leaf_allocs = []     # plan entry per leaf index
        self._replay_key = None    # the reserved graph's shape, for fast replays
        self.n_nodes = 0
        self.n_leafs = 0
        self._no_reuse = {}        # id(dyn allocator) -> [bytes without reuse, tensors placed]

    @property
    def n_buffers(self):
        """How many buffer ids the allocator has: one per buffer type it was given."""
        return len(self.bufts)

    # -- planning: one simulated execution -----------------------------------------------------
    def _record(self, t):
        hn = self._hash.get(t)
        if hn is None:
            hn = self._hash[t] = _HashNode()
        return hn

    def _allocate_node(self, t, buffer_id):
        """Give ``t`` memory (docs/graph-alloc-sched.md §4.3), unless it has some already or is a view."""
        hn = self._record(t)
        if hn.allocated or t.offset is not None or t.buffer is not None or t.view_src is not None:
            return
        hn.allocated = True

        if t.op in INPLACE_OPS:
            for p in t.src:
                if p is None:
                    continue
                p_hn = self._hash.get(p)
                # only memory this planner owns (never external tensors, never views: views are
                # never own, so GGML's "reuse a view parent" branch cannot run) and never an output
                if p_hn is None or not p_hn.allocated or p.flags & FLAG_OUTPUT:
                    continue
                if p.type != t.type or p.ne != t.ne or p.nb != t.nb:
                    continue  # a broadcast, transposed or retyped source
                if p_hn.n_children == 1 and p_hn.n_views == 0:  # t is its last consumer
                    hn.buffer_id, hn.chunk, hn.offset = p_hn.buffer_id, p_hn.chunk, p_hn.offset
                    hn.size = self.bufts[hn.buffer_id].get_alloc_size(t)
                    p_hn.allocated = False  # t frees these bytes now, p never will
                    self._free_extra_space(hn, p_hn)
                    self._count(hn)
                    return

        hn.buffer_id = buffer_id
        hn.size = self.bufts[buffer_id].get_alloc_size(t)
        hn.chunk, hn.offset = self.buf_tallocs[buffer_id].alloc(hn.size)
        self._count(hn)

    def _count(self, hn):
        """Memory report: what the tensor would cost in memory of its own."""
        talloc = self.buf_tallocs[hn.buffer_id]
        stats = self._no_reuse[id(talloc)]
        stats[0] += _pad(hn.size, talloc.alignment)
        stats[1] += 1

    def _free_extra_space(self, hn, p_hn):
        """An in-place result smaller than its parent returns the parent's surplus tail."""
        if p_hn.size < hn.size:
            raise ValueError("in-place reuse: the result needs more bytes than its parent")
        talloc = self.buf_tallocs[p_hn.buffer_id]
        p_size, size = _pad(p_hn.size, talloc.alignment), _pad(hn.size, talloc.alignment)
        if p_size > size:
            talloc.free(p_hn.chunk, p_hn.offset + size, p_size - size)

    def _free_node(self, t, hn):
        if t.flags & FLAG_OUTPUT:
            return  # graph outputs are never freed
        self.buf_tallocs[hn.buffer_id].free(hn.chunk, hn.offset, hn.size)
        hn.allocated = False

    def _alloc_graph_impl(self, graph, node_buffer_ids, leaf_buffer_ids):
        """The three phases of docs/graph-alloc-sched.md §4.5: leafs, counting, execution."""
        self._hash = {}
        record, allocate = self._record, self._allocate_node

        for i, leaf in enumerate(graph.leafs):
            allocate(leaf, leaf_buffer_ids[i] if leaf_buffer_ids is not None else 0)

        # count consumers and view nodes; inputs get memory now, before any computed tensor
        for i, node in enumerate(graph.nodes):
            bid = node_buffer_ids[i] if node_buffer_ids is not None else 0
            # op NONE views are the scheduler's dependency markers, not real views
            if node.view_src is not None and node.op != Op.NONE:
                record(node.view_src).n_views += 1
            if node.flags & FLAG_INPUT:
                allocate(node, bid)
            for s in node.src:
                if s is not None:
                    record(s).n_children += 1
                    if s.flags & FLAG_INPUT:
                        allocate(s, bid)  # in the consumer's buffer

        # execute: place each node, then release the sources it was the last consumer of
        hash_ = self._hash
        for i, node in enumerate(graph.nodes):
            bid = node_buffer_ids[i] if node_buffer_ids is not None else 0
            for s in node.src:
                if s is not None:
                    allocate(s, bid)
            allocate(node, bid)
            for p in node.src:  # duplicates included: each slot was counted
                if p is None:
                    continue
                p_hn = hash_[p]
                p_hn.n_children -= 1
                if p_hn.n_children == 0 and p_hn.n_views == 0:
                    root = p.view_src
                    if root is not None:
                        # a finished view releases its hold on the root
                        r_hn = self._record(root)
                        r_hn.n_views -= 1
                        if r_hn.n_views == 0 and r_hn.n_children == 0 and r_hn.allocated:
                            self._free_node(root, r_hn)
                    elif p_hn.allocated:
                        self._free_node(p, p_hn)

    def _plan_entry(self, t, memo):
        """The plan for one tensor: where it was placed, or nothing for views and tensors that
        already have data."""
        entry = memo.get(t)
        if entry is None:
            if t.view_src is not None or t.offset is not None:
                entry = _NO_ALLOC
            else:
                hn = self._hash[t]
                entry = (hn.buffer_id, hn.chunk, hn.offset, hn.size)
            memo[t] = entry
        return entry

    def _reserve_n_impl(self, graph, node_buffer_ids, leaf_buffer_ids, no_alloc):
        tallocs = list({id(t): t for t in self.buf_tallocs}.values())
        for talloc in tallocs:
            talloc.reset()
        self._no_reuse = {id(t): [0, 0] for t in tallocs}
        self._alloc_graph_impl(graph, node_buffer_ids, leaf_buffer_ids)

        # the plan, by position: per node index its own entry and a tuple for its source slots
        memo = {}
        plan = self._plan_entry
        self._dst_allocs = [plan(node, memo) for node in graph.nodes]
        self._src_allocs = [tuple(_NO_ALLOC if s is None else plan(s, memo) for s in node.src)
                            for node in graph.nodes]
        self._leaf_allocs = [plan(leaf, memo) for leaf in graph.leafs]
        self.n_nodes, self.n_leafs = graph.n_nodes, graph.n_leafs

        ok = self._realloc_buffers(no_alloc)
        # the shape for fast replays needs every buffer type to size tensors by nbytes (a function
        # of the layout alone) and the buffers in hand
        self._replay_key = None
        if ok and self._sized_by_layout and all(b is not None for b in self.buffers):
            self._replay_key = _GraphShape.of(graph)
            if self._replay_key is not None:
                self._replay_key.bind(self.bufts, self.buffers, self._dst_allocs + self._leaf_allocs)
        if ok and debug.level("LAZYGGML_DEBUG"):
            debug.enable_log()
            for line in self.format_memory_report():
                logger.info(line)
        return ok

    def _realloc_buffers(self, no_alloc):
        """Grow the physical buffers to the plan; they never shrink (docs/graph-alloc-sched.md §4.6)."""
        for i, talloc in enumerate(self.buf_tallocs):
            for j in range(i):
                if self.buf_tallocs[j] is talloc:  # same buffer type: same buffer
                    self.buffers[i] = self.buffers[j]
                    break
            current = self.buffers[i]
            realloc = current is None
            for c, chunk in enumerate(talloc.chunks):
                cur_size = current[c].size if current is not None and c < len(current) else 0
                if chunk.max_size > cur_size:
                    realloc = True
            if not realloc:
                continue
            if current is not None:
                for buf in current:
                    buf.free()
            self.buffers[i] = None
            if no_alloc:
                continue
            chunks = []
            for chunk in talloc.chunks:
                buf = buft_alloc_buffer(self.bufts[i], chunk.max_size)
                if buf is None:
                    logger.error("gallocr: failed to allocate %s buffer of size %d",
                                 self.bufts[i].name, talloc.total_size())
                    for b in chunks:
                        b.free()
                    return False
                buf.usage = BufferUsage.COMPUTE
                chunks.append(buf)
            self.buffers[i] = chunks
        return True

    def reserve_n(self, graph, node_buffer_ids=None, leaf_buffer_ids=None):
        """Plan ``graph`` with a buffer id per node and per leaf (default 0) and make sure the
        buffers can hold the plan. Returns False when a buffer could not be allocated."""
        return self._reserve_n_impl(graph, node_buffer_ids, leaf_buffer_ids, no_alloc=False)

    def reserve(self, graph):
        """``reserve_n`` with every node and leaf in buffer 0: plan ``graph`` and make the buffers big enough;
        False when a buffer could not be allocated."""
        return self.reserve_n(graph, None, None)

    def reserve_n_size(self, graph, node_buffer_ids=None, leaf_buffer_ids=None):
        """Plan without allocating; the bytes each buffer id's allocator would need (ids that share
        a buffer type report the same total). Buffers too small for this plan are dropped, as in
        GGML; the next ``alloc_graph`` re-reserves."""
        self._reserve_n_impl(graph, node_buffer_ids, leaf_buffer_ids, no_alloc=True)
        return [t.total_size() for t in self.buf_tallocs]

    # -- replay ----------------------------------------------------------------------------------
    def _replay_check(self, graph):
        """_SAME_SHAPE when ``graph`` has the reserved graph's shape, _FITS when it passes GGML's
        check slot by slot, _REALLOC otherwise (docs/graph-alloc-sched.md §4.7)."""
        nodes = graph.nodes
        if len(nodes) != self.n_nodes or len(graph.leafs) != self.n_leafs:
            return _REALLOC
        if (self.n_nodes or self.n_leafs) and any(b is None for b in self.buffers):
            return _REALLOC  # reserve_n_size dropped a buffer this plan needs (GGML would crash)
        if self._replay_key is not None and self._replay_key.matches(graph):
            return _SAME_SHAPE
        return _FITS if self._plan_holds(graph) else _REALLOC

    def _plan_holds(self, graph):
        """GGML's check, slot by slot: each node and source that still needs memory (no data, not
        a view) has a plan at its position at least as large as its alloc size now."""
        bufts = self.bufts
        for node, dst, srcs in zip(graph.nodes, self._dst_allocs, self._src_allocs):
            for t, e in zip((node, *node.src), (dst, *srcs)):
                if t is not None and t.offset is None and t.view_src is None:
                    if e[0] < 0 or e[3] < bufts[e[0]].get_alloc_size(t):
                        return False
        return True

    def needs_realloc(self, graph):
        """Whether ``graph`` differs from the reserved plan in a way the plan cannot absorb."""
        return self._replay_check(graph) == _REALLOC

    def _init_tensor(self, t, entry):
        """Place one tensor that has no buffer yet by its plan entry."""
        root = t.view_src
        if root is not None:
            if root.buffer is not None:  # else the root was allocated without a backend buffer
                view_init(t)
        elif t.offset is None:
            if entry[0] < 0:
                raise ValueError(f"gallocr: tensor {t.label} has no place in the plan; call reserve")
            buf = self.buffers[entry[0]][entry[1]]
            # the check saw that the plan holds the tensor, and each chunk buffer holds its plan
            t.buffer, t.offset = buf, entry[2]
            buf.init_tensor(t)

    def alloc_graph(self, graph):
        """Place every tensor of ``graph`` by the reserved plan (GGML's ``gallocr_alloc_graph``).

        When the plan does not fit the graph, a single-buffer allocator reserves again by itself;
        with several buffers it returns False and the caller must ``reserve_n``.
        """
        state = self._replay_check(graph)
        if state == _REALLOC:
            if len(self.bufts) != 1 or not self.reserve(graph):
                return False
            state = _SAME_SHAPE if self._replay_key is not None else _FITS
        for chunks in self.buffers:
            if chunks is not None:
                for buf in chunks:
                    if buf.reset is not None:
                        buf.reset()

        # leafs, then each node's sources and the node, in GGML's order; a tensor that has a
        # buffer is left alone
        init = self._init_tensor
        if state == _SAME_SHAPE:
            self._replay_key.place(graph, init)
        else:
            for leaf, entry in zip(graph.leafs, self._leaf_allocs):
                if leaf.buffer is None:
                    init(leaf, entry)
            for node, dst, srcs in zip(graph.nodes, self._dst_allocs, self._src_allocs):
                for s, entry in zip(node.src, srcs):
                    if s is not None and s.buffer is None:
                        init(s, entry)
                if node.buffer is None:
                    init(node, dst)
        return True

    # -- sizes -------------------------------------------------------------------------------------
    def get_buffer_size(self, buffer_id=0):
        """Bytes of ``buffer_id``'s buffer; 0 when it has none or shares an earlier id's buffer."""
        chunks = self.buffers[buffer_id]
        if chunks is None or any(self.buffers[i] is chunks for i in range(buffer_id)):
            return 0
        return sum(b.size for b in chunks)

    def memory_report(self):
        """Per buffer type of the last reserve: the planned peak bytes (all chunks), the size of
        the buffer actually held (buffers never shrink), and the bytes the same tensors would take
        without any reuse, each in its own memory."""
        report = []
        for i, talloc in enumerate(self.buf_tallocs):
            if any(self.buf_tallocs[j] is talloc for j in range(i)):
                continue
            no_reuse, n_tensors = self._no_reuse.get(id(talloc), (0, 0))
            report.append({
                "buft": self.bufts[i].name,
                "buffer_ids": [j for j, t in enumerate(self.buf_tallocs) if t is talloc],
                "peak": talloc.total_size(),
                "buffer_size": self.get_buffer_size(i),
                "no_reuse": no_reuse,
                "n_tensors": n_tensors,
            })
        return report

    def format_memory_report(self):
        """``memory_report`` as log lines (logged at INFO after each reserve when
        ``LAZYGGML_DEBUG=1``)."""
        lines = []
        for r in self.memory_report():
            share = f"{100.0 * r['peak'] / r['no_reuse']:.1f}%" if r["no_reuse"] else "-"
            lines.append(f"gallocr: {r['buft']} compute buffer: peak {_fmt_bytes(r['peak'])} "
                         f"(held {_fmt_bytes(r['buffer_size'])}) vs {_fmt_bytes(r['no_reuse'])} without "
                         f"reuse ({share}), {r['n_tensors']} tensors")
        return lines


def _fmt_bytes(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


# -- whole contexts: weights and other long-lived tensors --------------------------------------------
class Tallocr:
    """GGML's ``ggml_tallocr``: a linear allocator over one buffer."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.alignment = buffer.buft.get_alignment()
        self.offset = 0  # the aligned base: buffers start at offset 0

    def alloc(self, t):
        """Place ``t`` at the next aligned offset of the buffer (``OutOfMemoryError`` when it does not fit);
        returns the buffer's ``Status`` for it."""
        size = _pad(self.buffer.buft.get_alloc_size(t), self.alignment)
        if self.offset + size > self.buffer.size:
            raise OutOfMemoryError(f"Tallocr: not enough space in the buffer for {t.label} (needed {size}, "
                             f"available {self.buffer.size - self.offset})")
        offset = self.offset
        self.offset += size
        return tensor_alloc(self.buffer, t, offset)


def _alloc_tensor_range(tensors, buft, size, buffers):
    buffer = buft_alloc_buffer(buft, size)
    if buffer is None:
        logger.error("alloc_ctx_tensors: failed to allocate %s buffer of size %d", buft.name, size)
        return False
    buffers.append(buffer)
    tallocr = Tallocr(buffer)
    for t in tensors:
        if t.view_src is None:
            status = tallocr.alloc(t) if t.offset is None else Status.SUCCESS
        else:
            status = view_init(t) if t.buffer is None else Status.SUCCESS  # views of earlier tensors too
        if status != Status.SUCCESS:
            logger.error("alloc_ctx_tensors: failed to initialize tensor %s", t.name)
            return False
    return True


def _alloc_ctx_tensors_impl(ctx, buft, no_alloc):
    """Cut the context's tensors, in creation order, into buffers of at most the buffer type's
    max size; returns (buffers, total bytes)."""
    if not ctx.no_alloc:
        raise ValueError("alloc_ctx_tensors: the context must be created with no_alloc=True")
    alignment, max_size = buft.get_alignment(), buft.get_max_size()
    tensors = ctx.tensors()
    buffers, total, cur_size, first = [], 0, 0, 0
    for i, t in enumerate(tensors):
        this_size = _pad(buft.get_alloc_size(t), alignment) if t.offset is None and t.view_src is None else 0
        if cur_size > 0 and cur_size + this_size > max_size:
            if not no_alloc and not _alloc_tensor_range(tensors[first:i], buft, cur_size, buffers):
                _free_all(buffers)
                return None, 0
            first, total, cur_size = i, total + cur_size, this_size
        else:
            cur_size += this_size
    if cur_size > 0:
        total += cur_size
        if not no_alloc and not _alloc_tensor_range(tensors[first:], buft, cur_size, buffers):
            _free_all(buffers)
            return None, 0
    return buffers, total


def _free_all(buffers):
    for b in buffers:
        b.free()
    buffers.clear()


def alloc_ctx_tensors_from_buft(ctx, buft):
    """Allocate every tensor of ``ctx`` that has no memory yet in buffers of ``buft``: one buffer,
    a ``MultiBuffer`` when the max size forces several, or None when nothing needed memory."""
    buffers, _ = _alloc_ctx_tensors_impl(ctx, buft, no_alloc=False)
    if not buffers:
        return None
    return buffers[0] if len(buffers) == 1 else MultiBuffer(buft, buffers)


def alloc_ctx_tensors_from_buft_size(ctx, buft):
    """The bytes ``alloc_ctx_tensors_from_buft`` would allocate."""
    return _alloc_ctx_tensors_impl(ctx, buft, no_alloc=True)[1]


def alloc_ctx_tensors(ctx, backend):
    """Give every tensor of ``ctx`` without memory a place in buffers of ``backend``'s default buffer type
    (see ``alloc_ctx_tensors_from_buft``)."""
    return alloc_ctx_tensors_from_buft(ctx, backend.get_default_buffer_type())
