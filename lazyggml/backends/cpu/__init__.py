"""The CPU backend (GGML's ``ggml-cpu``): host buffers and Numba ``@njit`` kernels.

``backend.py`` is the device, its buffer type and the backend that plans and replays graphs;
``table.py`` the kernel table; one module per kernel family registers its forward functions there
(``elementwise``, ``reduce``, ``norm``, ``softmax``, ``rope``, ``rows``, ``copy``, ``shape``,
``matmul``), with what they share in ``common``; ``quant`` (GGML's quantizers), ``vec_dot`` (the
dot products) and ``simd`` (LLVM vector intrinsics) are the building blocks; ``traits`` is the
per-type table of those, ``dispatch`` the type switches generated from it
(``scripts/generate_cpu_dispatch.py``), ``convert`` whole arrays to and from a type.
"""
from .backend import (CPUBackend, CPUDevice, backend_cpu_init, cpu_buffer_type, cpu_device, registry,
                      set_n_threads)

__all__ = ["CPUBackend", "CPUDevice", "backend_cpu_init", "cpu_buffer_type", "cpu_device", "registry",
           "set_n_threads"]
