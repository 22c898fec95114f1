"""The OpenCL backend's kernel table: ``ops.py`` registers the glue of each op here with
``@forward(Op.X, supports=...)`` (``KernelTable.load`` imports it on first use).

``fn(be, node)`` enqueues the kernel launches for one graph node on the backend's queue;
``supports(node)`` claims exactly the (op, types, layout) combinations the ``.cl`` kernels compute,
and the scheduler sends the rest to the CPU.
"""
from .. import KernelTable

FORWARD = KernelTable("OpenCL", __package__)
forward = FORWARD.forward
