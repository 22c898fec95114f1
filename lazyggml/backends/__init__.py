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
        self._runnable = weakref.WeakKeyDictionary()  # graph -> (its nodes, their kernels)

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

    def runnable(self, g):
        """``(fn, node)`` for each node of ``g`` a backend must run, in order. As in GGML, empty ops
        (NONE and the view ops), nodes without COMPUTE (unselected branches) and empty tensors
        are skipped; a node this table cannot run is an error that names it. A graph computed
        again with the same nodes (a decode step) reuses the answer."""
        nodes = tuple(g.nodes)
        cached = self._runnable.get(g)
        if cached is not None and cached[0] == nodes:
            return cached[1]
        out = []
        for node in g.nodes:
            if node.op in EMPTY_OPS or not node.flags & FLAG_COMPUTE or node.nelements() == 0:
                continue
            if not self.supports(node):
                raise UnsupportedOpError(f"{self.backend} backend cannot run {node_desc(node)}")
            out.append((self[node.op][0], node))
        self._runnable[g] = (nodes, out)
        return out
