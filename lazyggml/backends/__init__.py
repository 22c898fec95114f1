"""Backends, one package per backend (GGML's ``src/ggml-<backend>/``): ``cpu`` (Numba ``@njit``),
``opencl`` (pyopencl, ``.cl`` sources) and ``cuda`` (numba-cuda ``@cuda.jit``).

Each package holds its device, buffers and backend (``backend.py``), its kernel table
(``table.py``), the glue from graph nodes to kernel launches and the kernels themselves. A package
imports nothing from another backend's package.

The one registration rule, shared by all three: a backend's ``KernelTable`` names its package, and
on first use imports every module in it (``load``); each module registers the forward functions it
defines with ``@forward(Op.X, supports=...)``. Adding a kernel module is adding a file.
"""
from __future__ import annotations

import importlib
import pkgutil
import weakref

from .. import buffer
from ..errors import UnsupportedOpError
from ..ops import EMPTY_OPS, node_desc
from ..tensor import FLAG_COMPUTE


def _any(node):
    return True


class KernelTable(dict):
    """One backend's dispatch table, Op -> (fn, supports): GGML's compute switch as data.

    ``supports(node)`` says which types and layouts ``fn`` handles; the device's ``supports_op``
    asks it. What ``fn`` receives is the backend's own convention (its ``table.py`` says).
    """

    def __init__(self, backend, package):
        super().__init__()
        self.backend = backend
        self.package = package           # dotted name of the package whose modules register here
        self._loaded = False
        self._plans = weakref.WeakKeyDictionary()  # graph -> GraphPlan

    def forward(self, *ops, supports=_any):
        def register(fn):
            for op in ops:
                if op in self:
                    raise RuntimeError(f"two {self.backend} kernels for {op.name}")
                self[op] = (fn, supports)
            return fn
        return register

    def load(self):
        """Import every module of the package, once: importing a module registers its kernels."""
        if self._loaded:
            return self
        self._loaded = True
        pkg = importlib.import_module(self.package)
        for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
            importlib.import_module(f"{self.package}.{m.name}")
        return self

    def supports(self, node):
        self.load()
        entry = self.get(node.op)
        return entry is not None and entry[1](node)

    def plan(self, g):
        """The ``GraphPlan`` of ``g``: ``(fn, node)`` for each node a backend must run, in order, and
        room for what each backend derives from them (``state``). As in GGML, empty ops (NONE and
        the view ops), nodes without COMPUTE (unselected branches) and empty tensors are skipped; a
        node this table cannot run is an error that names it.

        The reuse contract: a graph computed again (a decode step) gets the same plan while its
        ``version`` is the same and no tensor anywhere has moved (``buffer.placement_epoch``), two
        comparisons. When something moved, but maybe not this graph's tensors (a prompt batch was
        allocated between decode steps), its placement is compared once before rebuilding."""
        p = self._plans.get(g)
        if p is not None and p.version == g.version:
            if p.epoch == buffer.placement_epoch:
                return p
            if _placement(g) == p.placement:
                p.epoch = buffer.placement_epoch
                return p
        out = []
        for node in g.nodes:
            if node.op in EMPTY_OPS or not node.flags & FLAG_COMPUTE or node.nelements() == 0:
                continue
            if not self.supports(node):
                raise UnsupportedOpError(f"{self.backend} backend cannot run {node_desc(node)}")
            out.append((self[node.op][0], node))
        p = self._plans[g] = GraphPlan(g, out)
        return p


def _placement(g):
    """Where every node of ``g`` and its sources live."""
    return tuple((t.buffer, t.offset) for n in g.nodes for t in (n, *n.src) if t is not None)


class GraphPlan:
    """What a backend runs for one graph (``nodes``: ``(fn, node)`` pairs) and what that was decided
    from: the graph's ``version``, the placement epoch and the placement it saw. ``state`` holds, per
    backend, what the backend derived in turn (the CPU's bound kernel calls, CUDA's captured graph);
    it goes away with the plan when the graph changes."""

    __slots__ = ("version", "epoch", "placement", "nodes", "state")

    def __init__(self, g, nodes):
        self.version, self.epoch, self.placement = g.version, buffer.placement_epoch, _placement(g)
        self.nodes, self.state = nodes, {}
