"""CUDA kernels (numba-cuda ``@cuda.jit``), one module per family, and the CUDA backend's dispatch table.

Each module registers the glue for its ops with ``@forward(Op.X, supports=...)``, as the CPU
kernels do: ``fn(be, node)`` launches the kernels for one graph node on the backend's stream, and
``supports(node)`` says which types and layouts it handles (the device's ``supports_op`` asks it).
``be`` is the ``CUDABackend``: ``be.stream``, ``be.view(t, dtype)`` (a flat device view of a
tensor's bytes, cached) and ``be.scratch(name, nbytes, dtype)`` (a reusable device work area).

Modules: ``common`` (dp4a, warp reductions, constants), ``quantize`` (q8_1 activations), ``mmvq``,
``mmq``, ``dequant``, ``matmul`` (float GEMM and the mul_mat dispatch), ``elementwise``, ``norm``,
``softmax``, ``rope``, ``rows``, ``graphs`` (CUDA graph capture), ``ops`` (the glue).
"""
from .. import KernelTable

FORWARD = KernelTable("CUDA")
forward = FORWARD.forward
