"""The backend scheduler: one graph, several devices (GGML's ``ggml_backend_sched``).

Given backends in priority order (index 0 first, the CPU last), the scheduler decides where each
node runs, cuts the node list into *splits* (runs of consecutive nodes on one backend), adds the
copies that move tensors between backends, allocates every compute buffer with one ``Gallocr``
(buffer id = backend index) and runs the splits in order. ``split_graph`` decides everything in
five passes over the graph (docs/graph-alloc-sched.md §6.4):

1. **Pre-allocated and weight-based assignment.** Leafs, then nodes, that already live in a buffer
   go to the first backend that can use that buffer and run their op ("1.dst", "1.vsrc"); a user
   INPUT goes to the CPU ("1.inp"); an op reading a WEIGHTS tensor follows the weight ("1.wgt<i>"),
   unless a higher-priority backend asks to ``offload_op`` it from host memory ("1.off").
2. **Expansion.** Four sweeps grow the assigned regions into their unassigned neighbours: GPU down,
   GPU up (both ignoring the CPU), then any backend down and up ("2.sup"). A node the current
   backend can't run is jumped over, not a barrier. The GPU sweeps come first so the CPU only keeps
   what weights or inputs pinned to it.
3. **Upgrade and best backend.** A node on backend ``k`` moves to a higher-priority backend that
   uses the very same buffer type object and can read all its sources ("3.upg", e.g. a BLAS or
   ACCEL backend sharing the CPU's buffers). A node still unassigned goes to the backend that can
   read the most of its assigned sources ("3.best").
4. **Sources and views.** A view follows its root ("4.vsrc"); any other unassigned source (a leaf
   without buffer) follows its first consumer ("4.cur").
5. **Splits and copies.** Walking the nodes (view ops don't cut), a new split starts where the
   backend changes, or where a node reads a weight from another backend that this one can't read
   (so the memory of each offloaded weight's copy can be reused), or where a node needs a new input
   and the split's input list is full (30 slots at first; a node that overshoots makes the list
   double, with a warning, and the larger capacity stays with that split slot). A source on a backend whose buffer
   the split backend can't read gets a same-layout copy ``"<backend>#<name>#<c>"`` on the split's
   backend, listed once as an input of the split that first needs it, and the node's ``src`` is
   rewritten to point at the copy. **The user's graph is mutated**, so build a fresh graph for every
   ``alloc_graph`` (llama.cpp's pattern).

Then an internal copy of the graph is built for the allocator: each split contributes, per input,
a dependency node (an op-NONE view of the input, which keeps the input's memory alive until the
copy is made) and the input's copy, then its own nodes.

With ``parallel=True`` there are 4 copy slots (pipeline parallelism): every split input and every
user INPUT exists 4 times, flagged INPUT|OUTPUT so the allocator never reuses them, and each
``alloc_graph`` moves to the next slot, so the host can fill slot k+1 while a device still reads
slot k.

``LAZYGGML_SCHED_DEBUG=1`` (or ``2`` for every node) prints the splits and assignments in the format
of GGML's ``GGML_SCHED_DEBUG``, except that the cause of each placement is filled in (GGML compiles
causes out of release builds and prints 8 blanks there; the field keeps its width).

Differences from GGML: maps are dicts keyed by tensor identity, so ``graph_size`` bounds nothing;
every input copy is a plain copy but one, GGML's too: host expert weights of a ``MUL_MAT_ID`` that a
device offloads (CUDA's ``offload_op``: 32 tokens or more) are copied expert by expert, only those
the batch's ids pick, after reading the ids back (``_used_experts``); an input in host
memory going to a backend whose ``set_tensor_async`` has the bytes when it returns
(``host_copy_snapshots``, CUDA) is uploaded on that backend's stream without any wait, where GGML
waits for the backend and copies synchronously (a Python wait costs more than GGML's).
"""
from __future__ import annotations

import itertools
import logging

import numpy as np

from . import debug
from .alloc import Gallocr
from .buffer import BufferUsage, Status
from .errors import UnsupportedOpError
from .backend import (DeviceType, event_new, event_synchronize, host_bytes, tensor_copy, tensor_get,
                      tensor_set_async)
from .graph import Graph
from .ops import Op, is_view_op, node_desc, op_desc
from .tensor import FLAG_COMPUTE, FLAG_INPUT, Context, set_input, set_output

__all__ = ["SCHED_MAX_BACKENDS", "SCHED_MAX_SPLIT_INPUTS", "SCHED_MAX_COPIES", "Split", "Scheduler",
           "fmt_size"]

SCHED_MAX_BACKENDS = 16
SCHED_MAX_SPLIT_INPUTS = 30   # first capacity of an input list; it doubles when exceeded
SCHED_MAX_COPIES = 4

log = logging.getLogger("lazyggml")



class Split:
    """Nodes ``[i_start, i_end)`` of the graph, run on ``backend_id`` after copying ``inputs``.

    ``graph`` is the view of those nodes that the backend computes (view ops included)."""

    __slots__ = ("backend_id", "i_start", "i_end", "inputs", "graph")

    def __init__(self, backend_id, i_start):
        self.backend_id = backend_id
        self.i_start = i_start
        self.i_end = i_start
        self.inputs = []
        self.graph = None

    @property
    def n_inputs(self):
        return len(self.inputs)

    def __repr__(self):
        names = ", ".join(t.name for t in self.inputs)
        return f"<Split backend={self.backend_id} [{self.i_start},{self.i_end}) inputs=[{names}]>"


def fmt_size(size):
    """GGML's debug size: whole MiB from 1 MiB up, else whole KiB (so 256 B is ``0K``)."""
    return f"{size // (1024 * 1024)}M" if size >= 1024 * 1024 else f"{size // 1024}K"


class Scheduler:
    """GGML's ``ggml_backend_sched``. ``backends`` in priority order, the last one a CPU backend;
    ``bufts[i]`` is backend ``i``'s compute buffer type (its default one when omitted).
    ``graph_size`` is kept for GGML's signature: the per-tensor maps are dicts that grow.
    ``debug`` (from ``LAZYGGML_SCHED_DEBUG``) may also be set on the object."""

    def __init__(self, backends, bufts=None, graph_size=2048, parallel=False, op_offload=True):
        backends = list(backends)
        n = len(backends)
        if not 1 <= n <= SCHED_MAX_BACKENDS:
            raise ValueError(f"Scheduler: need 1 to {SCHED_MAX_BACKENDS} backends, got {n}")
        if backends[-1].device.get_type() != DeviceType.CPU:
            raise ValueError(f"Scheduler: the last backend must be a CPU backend, got {backends[-1].name} "
                             f"({backends[-1].device.get_type().name})")
        bufts = [b.get_default_buffer_type() for b in backends] if bufts is None else list(bufts)
        if len(bufts) != n:
            raise ValueError(f"Scheduler: {n} backends but {len(bufts)} buffer types")
        for b, buft in zip(backends, bufts):
            if not b.supports_buft(buft):
                raise ValueError(f"Scheduler: backend {b.name} does not support buffer type {buft.name}")

        self.backends = backends
        self.bufts = bufts
        self.graph_size = graph_size
        self._n_copies = SCHED_MAX_COPIES if parallel else 1
        self.cur_copy = 0
        self.next_copy = 0
        # one event per (backend, copy slot) for pipeline parallelism; None where a device has none
        self.events = [[event_new(b.device) if self._n_copies > 1 else None for _ in range(self._n_copies)]
                       for b in backends]
        self.galloc = Gallocr(bufts)  # buffer id = backend index; identical bufts share a buffer
        self.op_offload = op_offload
        self.callback_eval = None

        self.debug = debug.level("LAZYGGML_SCHED_DEBUG")
        # > 0: raise on a re-reservation that nothing explains; > 1: on any re-reservation
        self.debug_realloc = debug.level("LAZYGGML_SCHED_DEBUG_REALLOC")

        # GGML's hash set: per tensor, a backend id and the copies [backend][slot]
        self._ids = {}
        self._copies = {}   # (tensor, backend id) -> list of n_copies tensors
        self._causes = {}

        self._splits = []
        self._inputs_capacity = []  # per split slot; kept across graphs, as GGML reuses its array
        self.graph_inputs = []
        self._graph_inputs_capacity = SCHED_MAX_SPLIT_INPUTS
        self._ctx = None
        self.graph_copy = None
        self._graph_capacity = 0
        self._graph_size = self._prev_graph_size = 0
        # GGML keeps two id arrays and swaps them at every split, so "prev" starts zero-filled
        self._node_ids, self._prev_node_ids = [], []
        self._leaf_ids, self._prev_leaf_ids = [], []

        self._is_reset = False
        self._is_alloc = False
        self.reset()

    # -- small queries (GGML's getters) ----------------------------------------------------------
    @property
    def n_backends(self):
        """How many backends the scheduler has."""
        return len(self.backends)

    @property
    def n_copies(self):
        """How many copy slots inputs get: several with ``parallel=True`` (pipeline parallelism), else 1."""
        return self._n_copies

    @property
    def n_splits(self):
        """How many splits the last graph was cut into."""
        return len(self._splits)

    @property
    def splits(self):
        """The last graph's splits, in execution order (a new list)."""
        return list(self._splits)

    def get_n_backends(self):
        """GGML's getter for ``n_backends``."""
        return self.n_backends

    def get_n_copies(self):
        """GGML's getter for ``n_copies``."""
        return self._n_copies

    def get_n_splits(self):
        """GGML's getter for ``n_splits``."""
        return self.n_splits

    def get_backend(self, i):
        """The backend of priority ``i`` (0 the highest)."""
        if not 0 <= i < self.n_backends:
            raise ValueError(f"get_backend: index {i} out of range 0..{self.n_backends - 1}")
        return self.backends[i]

    def _backend_index(self, backend, what):
        for i, b in enumerate(self.backends):
            if b is backend:
                return i
        raise ValueError(f"{what}: backend {getattr(backend, 'name', backend)!r} is not in this scheduler")

    def get_buffer_type(self, backend):
        """The compute buffer type used for ``backend``."""
        return self.bufts[self._backend_index(backend, "get_buffer_type")]

    def get_buffer_size(self, backend):
        """Bytes of the backend's compute buffer; 0 when its buft is shared with a higher-priority
        backend (that one reports the shared buffer)."""
        return self.galloc.get_buffer_size(self._backend_index(backend, "get_buffer_size"))

    @property
    def node_backend_ids(self):
        """Backend id of each node of ``graph_copy`` (what the allocator was given)."""
        return self._node_ids[:self.graph_copy.n_nodes] if self.graph_copy is not None else []

    @property
    def leaf_backend_ids(self):
        """Backend id of each leaf of ``graph_copy`` (what the allocator was given)."""
        return self._leaf_ids[:self.graph_copy.n_leafs] if self.graph_copy is not None else []

    # -- tensor assignments ----------------------------------------------------------------------
    def set_tensor_backend(self, t, backend):
        """Pin ``t`` to ``backend``; the passes never overwrite a user assignment."""
        self._ids[t] = self._backend_index(backend, "set_tensor_backend")
        self._causes[t] = "usr"
        self._is_reset = False

    def get_tensor_backend(self, t):
        """The backend ``t`` was assigned to, or None (unassigned, or a copy made by the scheduler)."""
        b = self._ids.get(t, -1)
        return None if b == -1 else self.backends[b]

    def get_tensor_cause(self, t):
        """Why ``t`` got its backend: "usr", "1.dst", "1.vsrc", "1.inp", "1.off", "1.wgt<i>",
        "2.sup", "3.upg", "3.best", "4.vsrc", "4.cur", or "4.cpy" for the scheduler's copies."""
        return self._causes.get(t, "")

    def get_tensor_copy(self, t, backend_id, copy_id):
        """The copy of ``t`` made for ``backend_id`` and copy slot ``copy_id``, or None."""
        copies = self._copies.get((t, backend_id))
        return None if copies is None else copies[copy_id]

    def set_eval_callback(self, fn):
        """``fn(t, ask)``: with ``ask=True`` return whether you want to see ``t`` once computed; the
        scheduler then computes up to ``t``, synchronizes, and calls ``fn(t, False)``, whose False
        return stops the current split. ``None`` removes the callback."""
        self.callback_eval = fn

    # -- lifecycle ---------------------------------------------------------------------------------
    def reset(self):
        """Forget all assignments and copies (unless nothing happened since the last reset)."""
        if not self._is_reset:
            self._ids.clear()
            self._copies.clear()
            self._causes.clear()
            self._is_reset = True
        self._is_alloc = False

    def synchronize(self):
        """Wait for every backend. While no graph is allocated, the next graph uses copy slot 0,
        so that token-by-token generation always reuses the same slot."""
        for b in self.backends:
            b.synchronize()
        if not self._is_alloc:
            self.next_copy = 0

    def reserve(self, g):
        """Size the compute buffers for the worst-case graph ``g`` (then forget ``g``)."""
        self.synchronize()
        self.split_graph(g)
        if not self.galloc.reserve_n(self.graph_copy, self.node_backend_ids, self.leaf_backend_ids):
            return False
        self.reset()
        return True

    def reserve_size(self, g):
        """The compute-buffer bytes per backend ``g`` would need, as a list by backend index;
        nothing is allocated. Backends sharing a buft each report the shared total."""
        self.reset()
        self.synchronize()
        self.split_graph(g)
        return list(self.galloc.reserve_n_size(self.graph_copy, self.node_backend_ids, self.leaf_backend_ids))

    def alloc_graph(self, g):
        """Assign, split and allocate ``g``. False when the allocator could not place the graph."""
        if self._is_alloc:
            raise ValueError("alloc_graph: a graph is already allocated; call reset() first")
        self.cur_copy = self.next_copy
        self.next_copy = (self.next_copy + 1) % self._n_copies
        self.split_graph(g)
        if not self._alloc_splits():
            return False
        self._is_alloc = True
        return True

    def graph_compute_async(self, g):
        """Allocate ``g`` unless it already is (``alloc_graph``), then start its splits in order; returns a
        ``Status`` and may return before the backends are done."""
        if not self._is_reset and not self._is_alloc:
            self.reset()
        if not self._is_alloc and not self.alloc_graph(g):
            return Status.ALLOC_FAILED
        return self._compute_splits()

    def graph_compute(self, g):
        """Compute ``g`` over the backends and wait for them (``graph_compute_async``, then ``synchronize``);
        returns a ``Status``."""
        status = self.graph_compute_async(g)
        self.synchronize()
        return status

    # -- helpers of the passes ---------------------------------------------------------------------
    def _set(self, t, backend_id, cause):
        self._ids[t] = backend_id
        self._causes[t] = cause

    def _backend_from_buffer(self, t, op):
        """The first backend that can use the buffer ``t`` (or its root) lives in and run ``op``."""
        buf = t.view_src.buffer if t.view_src is not None else t.buffer
        if buf is None:
            return -1
        for i, b in enumerate(self.backends):
            if b.supports_buft(buf.buft) and b.supports_op(op):
                return i
        return -1

    def _buffer_supported(self, t, backend_id):
        """Can ``backend_id`` read ``t`` where it is (or will be allocated)?"""
        buf = t.view_src.buffer if t.view_src is not None else t.buffer
        if buf is not None:
            buft = buf.buft
        else:
            b = self._ids.get(t, -1)
            if b == -1 and t.view_src is not None:
                b = self._ids.get(t.view_src, -1)
            buft = self.bufts[b] if b != -1 else None
        return buft is not None and self.backends[backend_id].supports_buft(buft)

    def _backend_id_from_cur(self, t):
        """Pass 1's rule for one tensor (-1: no opinion yet)."""
        b = self._backend_from_buffer(t, t)
        if b != -1:
            self._causes[t] = "1.dst"
            return b
        if t.view_src is not None:
            # views are flattened, so this only finds more than rule 1 for a view whose view_src
            # is itself a view not yet initialised (a graph built by hand)
            b = self._backend_from_buffer(t.view_src, t)
            if b != -1:
                self._causes[t] = "1.vsrc"
                return b
        buf = t.view_src.buffer if t.view_src is not None else t.buffer
        if t.buffer is not None or buf is not None:
            # it can't move, and nobody here can run it where it is
            raise ValueError(f"pre-allocated tensor ({t.name}) in a buffer ({buf.buft.name}) that cannot "
                             f"run the operation ({t.op.name})")
        if t.flags & FLAG_INPUT:
            self._causes[t] = "1.inp"
            return self.n_backends - 1
        # run where the weights are; ROPE's frequency factors and FLASH_ATTN_EXT's sinks are too
        # small to decide that
        if t.op not in (Op.ROPE, Op.FLASH_ATTN_EXT):
            for i, s in enumerate(t.src):
                if s is None or s.buffer is None or s.buffer.usage != BufferUsage.WEIGHTS:
                    continue
                b = self._backend_from_buffer(s, t)
                if self.op_offload and b == self.n_backends - 1 and s.buffer.is_host():
                    # a faster backend may want the op anyway, copying the weight each time
                    for k in range(b):
                        if self.backends[k].supports_op(t) and self.backends[k].offload_op(t):
                            self._causes[t] = "1.off"
                            return k
                self._causes[t] = f"1.wgt{i}"
                return b  # the first weight decides, even when nobody can use its buffer (-1)
        return -1

    def _dup_layout(self, t, name):
        """A new tensor with ``t``'s type, shape and strides (GGML's ``ggml_dup_tensor_layout``)."""
        c = self._ctx.dup_tensor(t)
        c.nb = t.nb
        c.name = name
        return c

    def _add_split_input(self, k, split, t):
        if len(split.inputs) >= self._inputs_capacity[k]:
            cap = self._inputs_capacity[k]
            if cap:
                log.warning("split_graph: increasing split inputs capacity from %d to %d", cap, 2 * cap)
            self._inputs_capacity[k] = 2 * cap if cap else SCHED_MAX_SPLIT_INPUTS
        split.inputs.append(t)

    def _add_graph_input(self, t):
        if len(self.graph_inputs) >= self._graph_inputs_capacity:
            cap = self._graph_inputs_capacity
            log.warning("split_graph: increasing graph inputs capacity from %d to %d", cap, 2 * cap)
            self._graph_inputs_capacity = 2 * cap
        self.graph_inputs.append(t)

    def _new_split(self, backend_id, i_start):
        k = len(self._splits)
        if k == len(self._inputs_capacity):
            self._inputs_capacity.append(0)
        split = Split(backend_id, i_start)
        self._splits.append(split)
        return split

    # -- the five passes -----------------------------------------------------------------------
    def split_graph(self, g):
        """Assign every tensor of ``g`` to a backend, cut ``g`` into splits, create the copies and
        rewrite the sources that need them, then build ``graph_copy`` for the allocator."""
        ids, backends = self._ids, self.backends
        cpu = self.n_backends - 1
        self._splits = []
        self.graph_inputs = []
        self._is_reset = False
        self._ctx = Context(no_alloc=True)  # the copies live here until the next split

        # pass 1: pre-allocated tensors, inputs and weight users; user assignments are kept
        for t in itertools.chain(g.leafs, g.nodes):
            if ids.get(t, -1) == -1:
                ids[t] = self._backend_id_from_cur(t)

        # pass 2: grow the regions into unassigned neighbours; view ops neither take nor pass on
        compute_nodes = [n for n in g.nodes if not is_view_op(n.op)]
        for order, skip_cpu in ((compute_nodes, True), (compute_nodes[::-1], True),
                                (compute_nodes, False), (compute_nodes[::-1], False)):
            cur = -1
            for node in order:
                b = ids.get(node, -1)
                if b != -1:
                    cur = -1 if skip_cpu and b == cpu else b
                elif cur != -1 and backends[cur].supports_op(node):
                    self._set(node, cur, "2.sup")  # an unsupported node is jumped, not a barrier

        # pass 3: upgrade to a higher-priority backend with the same buft; place the leftovers
        for node in compute_nodes:
            srcs = [s for s in node.src if s is not None]
            cur = ids.get(node, -1)
            if cur == -1:
                best = -1
                for b in range(self.n_backends):
                    if backends[b].supports_op(node):
                        n_supported = sum(1 for s in srcs
                                          if (ids.get(s, -1) != -1 or ids.get(s.view_src, -1) != -1)
                                          and self._buffer_supported(s, b))
                        if n_supported > best:  # ties keep the higher priority
                            best = n_supported
                            self._set(node, b, "3.best")
            else:
                for b in range(cur):
                    if (self.bufts[b] is self.bufts[cur] and backends[b].supports_op(node)
                            and all(self._buffer_supported(s, b) for s in srcs)):
                        self._set(node, b, "3.upg")
                        break

        # pass 4: views follow their root, other unassigned sources their (first) consumer
        for node in g.nodes:
            if node.view_src is not None and ids.get(node, -1) == -1:
                self._set(node, ids.get(node.view_src, -1), "4.vsrc")
            cur = ids.get(node, -1)
            for s in node.src:
                if s is not None and ids.get(s, -1) == -1:
                    if s.view_src is not None:
                        self._set(s, ids.get(s.view_src, -1), "4.vsrc")
                    else:
                        self._set(s, cur, "4.cur")
            for b in range(self.n_backends):
                if ids.get(node, -1) != -1:
                    break
                if backends[b].supports_op(node):
                    self._set(node, b, "2.sup")
            if ids.get(node, -1) == -1:
                raise UnsupportedOpError(f"split_graph: no backend can run {node_desc(node)}")

        self._pass5(g)
        if self.debug:
            self._print_assignments(g)
        self._build_graph_copy(g)
        g.changed()   # sources rewritten, nodes reordered: what backends derived from g is stale

    def _pass5(self, g):
        """Pass 5: cut the node list into splits and give each split copies of what it can't read."""
        ids, copies, nc = self._ids, self._copies, self._n_copies
        nodes = g.nodes
        i = 0
        while i < len(nodes) and is_view_op(nodes[i].op):
            i += 1  # leading view ops belong to split 0
        # GGML keeps a stale id when there is no compute node at all; any backend will do then
        split = self._new_split(ids[nodes[i]] if i < len(nodes) else self.n_backends - 1, 0)
        cur = split.backend_id
        for i in range(i, len(nodes)):
            node = nodes[i]
            if is_view_op(node.op):
                continue
            node_b = ids.get(node, -1)
            srcs = [(j, s) for j, s in enumerate(node.src) if s is not None]

            need_new_split = False
            if node_b == cur and split.inputs:
                for _, s in srcs:
                    # each weight offloaded from another backend gets its own split, so the memory of
                    # its copy can be reused by the next one
                    if s.buffer is not None and s.buffer.usage == BufferUsage.WEIGHTS:
                        if ids.get(s, -1) != cur and not self._buffer_supported(s, cur):
                            need_new_split = True
                            break
                    # a full input list: start over rather than grow it (a node can still overshoot)
                    if len(split.inputs) >= self._inputs_capacity[len(self._splits) - 1]:
                        if (ids.get(s, -1) != cur and (s, cur) not in copies
                                and not self._buffer_supported(s, cur)):
                            need_new_split = True
                            break

            if node_b != cur or need_new_split:
                split.i_end = i
                split = self._new_split(node_b, i)
                cur = node_b

            for j, s in srcs:
                src_b = ids.get(s, -1)
                if src_b == -1:
                    raise UnsupportedOpError(f"split_graph: source {s.label} of {node.label} has no backend")
                if s.flags & FLAG_INPUT and nc > 1 and (s, src_b) not in copies:
                    # user inputs get n_copies slots too; the current slot is the tensor itself
                    slots = [s if c == self.cur_copy else
                             self._dup_layout(s, f"{self.backends[src_b].name}#{s.name}#{c}")
                             for c in range(nc)]
                    for t in slots:
                        set_input(t)
                        set_output(t)  # OUTPUT: the allocator never reuses this memory
                        self._causes[t] = "4.cpy"
                    copies[(s, src_b)] = slots
                    self._add_graph_input(s)

                if src_b != cur and not self._buffer_supported(s, cur):
                    if (s, cur) not in copies:  # one copy per (tensor, backend) for the whole graph
                        slots = [self._dup_layout(s, f"{self.backends[cur].name}#{s.name}#{c}")
                                 for c in range(nc)]
                        for t in slots:
                            if nc > 1:
                                set_input(t)
                                set_output(t)
                            self._causes[t] = "4.cpy"
                        copies[(s, cur)] = slots
                        self._add_split_input(len(self._splits) - 1, split, s)
                    node.src[j] = copies[(s, cur)][self.cur_copy]
        split.i_end = len(nodes)

    def _build_graph_copy(self, g):
        """The graph the allocator sees: per split, (dependency, copy) per input, then its nodes."""
        ids, nc, cc = self._ids, self._n_copies, self.cur_copy
        # the id arrays of the previous split become "prev"; GGML swaps two persistent arrays
        self._node_ids, self._prev_node_ids = self._prev_node_ids, self._node_ids
        self._leaf_ids, self._prev_leaf_ids = self._prev_leaf_ids, self._leaf_ids

        total_inputs = len(self.graph_inputs) + sum(len(s.inputs) for s in self._splits)
        size = max(g.n_nodes, g.n_leafs) + total_inputs * 2 * nc
        self._prev_graph_size, self._graph_size = self._graph_size, size
        self._graph_capacity = max(self._graph_capacity, size)
        gc = Graph(max(self._graph_capacity, 1))
        node_ids, leaf_ids = [], []

        for split in self._splits:
            split.graph = g.view(split.i_start, split.i_end)
            backend = self.backends[split.backend_id]
            if backend.graph_optimize is not None:
                backend.graph_optimize(split.graph)
                g.nodes[split.i_start:split.i_end] = split.graph.nodes  # GGML's view shares the array
            for inp in split.inputs:
                # keeps the input (or its root) alive until the copy; op NONE, so not a "view node"
                dep = self._ctx.view_tensor(inp)
                dep.src[0] = inp
                gc.nodes.append(dep)
                node_ids.append(ids[inp])
                # allocated at the start of the split
                gc.nodes.append(self._copies[(inp, split.backend_id)][cc])
                node_ids.append(split.backend_id)
            for node in split.graph.nodes:
                gc.nodes.append(node)
                node_ids.append(ids[node])

        if nc > 1:  # every slot of every copy is a leaf, so they are placed first and kept
            for inp in self.graph_inputs:
                b = ids[inp]
                gc.leafs.extend(self._copies[(inp, b)])
                leaf_ids.extend([b] * nc)
            for split in self._splits:
                for inp in split.inputs:
                    gc.leafs.extend(self._copies[(inp, split.backend_id)])
                    leaf_ids.extend([split.backend_id] * nc)
        for leaf in g.leafs:
            gc.leafs.append(leaf)
            leaf_ids.append(ids.get(leaf, -1))

        _overwrite(self._node_ids, node_ids)
        _overwrite(self._leaf_ids, leaf_ids)
        self.graph_copy = gc

    # -- allocation and computation ----------------------------------------------------------------
    def _alloc_splits(self):
        gc = self.graph_copy
        changed = (_ids_changed(self._node_ids, self._prev_node_ids, gc.n_nodes, self.bufts)
                   or _ids_changed(self._leaf_ids, self._prev_leaf_ids, gc.n_leafs, self.bufts))
        if changed or not self.galloc.alloc_graph(gc):
            if self.debug_realloc > 0:
                unexpected = not changed and self._prev_graph_size == self._graph_size
                if unexpected or self.debug_realloc > 1:
                    raise RuntimeError(f"alloc_graph: unexpected graph reallocation (graph size = "
                                       f"{self._graph_size}, nodes = {gc.n_nodes}, leafs = {gc.n_leafs}), "
                                       f"debug_realloc = {self.debug_realloc}")
            # the split inputs may move: wait for everyone (not self.synchronize: keep next_copy)
            for b in self.backends:
                b.synchronize()
            self.galloc.reserve_n(gc, self.node_backend_ids, self.leaf_backend_ids)
            if not self.galloc.alloc_graph(gc):
                log.error("alloc_graph: failed to allocate graph")
                return False
        return True

    def _host_wait(self, backend_id):
        """Block the host until ``backend_id`` finished its work on the current slot."""
        e = self.events[backend_id][self.cur_copy]
        if e is not None:
            event_synchronize(e)
        else:
            self.backends[backend_id].synchronize()

    def _compute_splits(self):
        prev_id = -1
        for split in self._splits:
            sid = split.backend_id
            backend = self.backends[sid]
            event = self.events[sid][self.cur_copy]

            # the allocator may have reused the previous backend's memory for this split
            if not split.inputs and prev_id >= 0 and prev_id != sid:
                self._host_wait(prev_id)

            for k, inp in enumerate(split.inputs):
                inp_backend = self.backends[self._ids[inp]]
                cpy = self._copies[(inp, sid)][self.cur_copy]
                sbuf = inp.data_buffer()
                experts = self._used_experts(split, k, cpy) if sbuf.is_host() else None
                if backend.host_copy_snapshots and sbuf.is_host():
                    # the upload is queued behind this backend's earlier work, which read the old
                    # contents, and has the bytes once it returns: neither side waits
                    inp_backend.synchronize()
                    for off, n in experts or [(0, inp.nbytes())]:
                        backend.set_tensor_async(cpy, host_bytes(inp, off, n), off, n)
                elif experts is not None:
                    self._slot_free(backend, event)
                    for off, n in experts:
                        tensor_set_async(backend, cpy, host_bytes(inp, off, n), off, n)
                elif inp.flags & FLAG_INPUT:
                    # user data: copy now, before the user can overwrite it
                    self._host_wait(sid)
                    tensor_copy(inp, cpy)
                else:
                    self._slot_free(backend, event)
                    if backend.cpy_tensor_async is None or not backend.cpy_tensor_async(inp_backend, backend, inp, cpy):
                        inp_backend.synchronize()
                        self._host_wait(sid)
                        tensor_copy(inp, cpy)

            if self.callback_eval is None:
                status = _status(backend.graph_compute(split.graph))
                if status != Status.SUCCESS:
                    return status
            else:
                status = self._compute_with_callback(backend, split.graph)
                if status != Status.SUCCESS:
                    return status

            if event is not None:
                backend.event_record(event)
            prev_id = sid
        return Status.SUCCESS

    @staticmethod
    def _slot_free(backend, event):
        """Wait until ``backend`` is done reading the previous contents of this copy slot."""
        if event is not None:
            backend.event_wait(event)
        else:
            backend.synchronize()

    def _used_experts(self, split, k, cpy):
        """GGML's shortcut for a mixture of experts' weights offloaded from host memory: when
        ``split`` starts with a MUL_MAT_ID whose expert matrices are ``cpy`` (the copy of its input
        ``k``, host WEIGHTS), the byte ranges (offset, size) of the experts its ids pick, runs of
        consecutive experts merged (and padded), so that only those are copied; else None. Reads the ids back,
        waiting for the backend that computed them (the original, when the ids are a later input of
        this split, not copied yet). An id out of range: None (the whole copy; the kernel reports it)."""
        node = split.graph.nodes[0] if split.graph.nodes else None
        src = split.inputs[k]
        if node is None or node.op != Op.MUL_MAT_ID or node.src[0] is not cpy or \
                src.data_buffer().usage != BufferUsage.WEIGHTS:
            return None
        ids = node.src[2]
        ids = next((t for t in split.inputs[k + 1:] if self._copies[(t, split.backend_id)][self.cur_copy] is ids), ids)
        ids_backend = self.get_tensor_backend(ids) or self.backends[split.backend_id]
        ids_backend.synchronize()
        used = np.unique(tensor_get(ids))
        if used.size == 0 or used[0] < 0 or used[-1] >= src.ne[2]:
            return None
        runs = []
        for e in used.tolist():
            if runs and runs[-1][1] == e:
                runs[-1][1] = e + 1
            else:
                runs.append([e, e + 1])
        # each run but one that ends at the last expert takes min(expert, 512) bytes more, as GGML
        # does: a kernel may read a little past its expert's rows
        size, n_expert = src.nb[2], src.ne[2]
        return [(a * size, (b - a) * size + (min(size, 512) if b < n_expert else 0)) for a, b in runs]

    def _compute_with_callback(self, backend, sg):
        """Compute ``sg`` in batches that end at each node the callback asks for."""
        cb, nodes = self.callback_eval, sg.nodes
        j0 = 0
        while j0 < len(nodes):
            t = nodes[j0]
            need = cb(t, True)
            j1 = j0
            while not need and j1 < len(nodes) - 1:
                j1 += 1
                t = nodes[j1]
                need = cb(t, True)
            status = _status(backend.graph_compute(sg.view(j0, j1 + 1)))
            if status != Status.SUCCESS:
                return status
            backend.synchronize()
            if need and not cb(t, False):
                break  # stops this split only; the next splits still run
            j0 = j1 + 1
        return Status.SUCCESS

    # -- debug output ----------------------------------------------------------------------------
    def _name_of(self, t):
        b = self.get_tensor_backend(t)
        return b.name if b is not None else "NULL"

    def _print_assignments(self, g):
        """GGML_SCHED_DEBUG's listing: split headers (level 1) and every compute node (level 2)."""
        debug.enable_log()
        k = 0
        for i, node in enumerate(g.nodes):
            if k < len(self._splits) and i == self._splits[k].i_start:
                split = self._splits[k]
                line = f"\n## SPLIT #{k}: {self.backends[split.backend_id].name} # {len(split.inputs)} inputs"
                if split.inputs:
                    line += ": " + "".join("[%s (%5.5s)] " % (t.name, fmt_size(t.nbytes())) for t in split.inputs)
                log.debug(line)
                k += 1
            if is_view_op(node.op) or self.debug < 2:
                continue
            line = "node #%3d (%10.10s): %20.20s (%5.5s) [%5.5s %8.8s] use=%d,c=%d:" % (
                i, op_desc(node), node.name, fmt_size(node.nbytes()), self._name_of(node),
                self.get_tensor_cause(node), g.use_count(node), 1 if node.flags & FLAG_COMPUTE else 0)
            for s in node.src:
                if s is not None:
                    line += " %20.20s (%5.5s) [%5.5s %8.8s]" % (
                        s.name, fmt_size(s.nbytes()), self._name_of(s), self.get_tensor_cause(s))
            log.debug(line)


def _status(s):
    """A backend's ``graph_compute`` result; returning nothing counts as success."""
    return Status.SUCCESS if s is None else s


def _overwrite(arr, values):
    """Write ``values`` over the start of ``arr``, growing it with zeros (GGML's calloc'd arrays)."""
    if len(arr) < len(values):
        arr.extend([0] * (len(values) - len(arr)))
    arr[:len(values)] = values


def _ids_changed(ids, prev, n, bufts):
    """Did a position move to a backend with a different buft since the previous split?"""
    for i in range(n):
        a, b = ids[i], prev[i] if i < len(prev) else 0
        if a != b and bufts[a] is not bufts[b]:
            return True
    return False
