"""Kernels, one package per backend: ``cpu`` (Numba @njit), ``cuda`` (@cuda.jit), ``opencl`` (.cl)."""
import weakref


def _any(node):
    return True


class KernelTable(dict):
    """One backend's dispatch table, Op -> (fn, supports): GGML's compute switch as data.

    Kernel modules fill it with ``@table.forward(Op.X, supports=pred)``; ``supports(node)`` says
    which types and layouts ``fn`` handles, and the device's ``supports_op`` asks it.
    """

    def __init__(self, backend):
        super().__init__()
        self.backend = backend
        self._runnable = weakref.WeakKeyDictionary()  # graph -> (its nodes, their kernels)

    def forward(self, *ops, supports=_any):
        def register(fn):
            for op in ops:
                if op in self:
                    raise RuntimeError(f"two {self.backend} kernels for {op.name}")
                self[op] = (fn, supports)
            return fn
        return register

    def supports(self, node):
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
        from ..ops import EMPTY_OPS, op_desc
        from ..tensor import FLAG_COMPUTE
        out = []
        for node in g.nodes:
            if node.op in EMPTY_OPS or not node.flags & FLAG_COMPUTE or node.nelements() == 0:
                continue
            if not self.supports(node):
                srcs = ", ".join(repr(s) for s in node.src if s is not None)
                raise ValueError(f"{self.backend} backend: {op_desc(node)} is not supported for "
                                 f"'{node.name}' ({srcs})")
            out.append((self[node.op][0], node))
        self._runnable[g] = (nodes, out)
        return out
