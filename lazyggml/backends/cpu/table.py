"""The CPU backend's kernel table: every module of this package that defines kernels registers them
here with ``@forward(Op.X, supports=...)`` (``KernelTable.load`` imports them all).

The forward function ``fn(node, dst, srcs)`` gets NumPy views of the result and of the sources
(``None`` where a source slot is empty, see ``backend.host_layout``) and returns the calls that
compute the node, a list of ``(kernel, args)``; ``supports(node)`` says which types and layouts it
handles (the CPU device's ``supports_op`` asks it). This is GGML's ``ggml_compute_forward``
switch, as a table.

Returning calls instead of making them lets the CPU backend plan a graph once (``backend.py``):
the arguments are checked, converted and packed when the plan is made, and a decode step replays
the plan, one call per kernel. So a forward must not read the *contents* of its tensors (they
change between replays): work that depends on them is a step of its own, a jitted kernel or a
plain Python function.
"""
from .. import KernelTable

FORWARD = KernelTable("CPU", __package__)
forward = FORWARD.forward
