"""CPU kernels (Numba ``@njit``), one module per family, and the CPU backend's dispatch table.

Each module registers its forward functions with ``@forward(Op.X, supports=...)``: the function
``fn(node, dst, srcs)`` gets NumPy views of the result and of the sources (``None`` where a source
slot is empty, see ``backend.host_layout``), and ``supports(node)`` says which types and layouts it
handles (the CPU device's ``supports_op`` asks it). This is GGML's ``ggml_compute_forward`` switch,
as a table.
"""
from .. import KernelTable

FORWARD = KernelTable("CPU")
forward = FORWARD.forward
