"""The CUDA backend (GGML's ``ggml-cuda``), through numba-cuda.

``backend.py`` is the devices, their buffers, events, the backend on each GPU's stream and its
CUDA-graph replay; ``table.py`` the kernel table that ``ops.py`` (the glue, mul_mat's choice of
kernel included) registers in. The kernels: ``common`` (dp4a, warp reductions, constants),
``quantize`` (q8_1 activations), ``mmvq``, ``mmq``, ``dequant``, ``matmul`` (float GEMM),
``elementwise``, ``norm``, ``softmax``, ``rope``, ``rows``; ``graphs`` captures CUDA graphs.
Nothing here imports numba-cuda until a CUDA device is asked for.
"""
from .backend import CUDABackend, CUDABuffer, CUDADevice, registry, simulated

__all__ = ["CUDABackend", "CUDABuffer", "CUDADevice", "registry", "simulated"]
