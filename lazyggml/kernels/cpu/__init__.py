"""CPU kernels (Numba ``@njit``), one module per family, and the CPU backend's dispatch table.

Each module registers its forward functions with ``@forward(Op.X, supports=...)``: the function
``fn(node, dst, srcs)`` gets NumPy views of the result and of the sources (``None`` where a source
slot is empty, see ``backend.host_layout``), and ``supports(node)`` says which types and layouts it
handles (the CPU device's ``supports_op`` asks it). This is GGML's ``ggml_compute_forward`` switch,
as a table.
"""
FORWARD = {}  # Op -> (fn, supports)


def _any(node):
    return True


def forward(*ops, supports=_any):
    def register(fn):
        for op in ops:
            if op in FORWARD:
                raise RuntimeError(f"two CPU kernels for {op.name}")
            FORWARD[op] = (fn, supports)
        return fn
    return register
