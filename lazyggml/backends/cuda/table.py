"""The CUDA backend's kernel table: every module of this package that defines glue registers it
here with ``@forward(Op.X, supports=...)`` (``KernelTable.load`` imports them all, on first use:
importing them needs numba-cuda).

``fn(be, node)`` launches the kernels for one graph node on the backend's stream, and
``supports(node)`` says which types and layouts it handles (the device's ``supports_op`` asks
it). ``be`` is the ``CUDABackend``: ``be.stream``, ``be.view(t, dtype)`` (a flat device view of a
tensor's bytes, cached) and ``be.scratch(name, nbytes, dtype)`` (a reusable device work area).

Modules: ``common`` (dp4a, warp reductions, constants), ``quantize`` (q8_1 activations), ``mmvq``,
``mmq``, ``dequant``, ``matmul`` (float GEMM), ``elementwise``, ``norm``, ``softmax``, ``rope``,
``rows``, ``graphs`` (CUDA graph capture), ``ops`` (the glue, mul_mat's dispatch included).
"""
from .. import KernelTable

FORWARD = KernelTable("CUDA", __package__)
forward = FORWARD.forward
