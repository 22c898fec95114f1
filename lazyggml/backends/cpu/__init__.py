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
from . import attention, matmul, tiled

__all__ = ["CPUBackend", "CPUDevice", "backend_cpu_init", "cpu_buffer_type", "cpu_device", "registry",
           "set_column_order", "set_n_threads"]


def set_column_order(on: bool = True):
    """Every product and attention of this process in the order of one column alone (``on``): GGML's
    vec_dot order (no llamafile sgemm, no tiled matmul: ``LAZYGGML_LLAMAFILE=0 LAZYGGML_TILED_MM=0``)
    and flash attention's one-query path (no query tiles, no KV split). A token's result then does
    not depend on the other tokens of its batch, so a server's answers do not depend on what else
    it runs (``lazyggml serve --batch-invariant``; repacked weights, which have their own order, are
    turned off at load). ``on=False`` restores llama.cpp's orders. For graphs planned afterwards."""
    matmul.LLAMAFILE = tiled.TILED = not on
    attention.ONE_QUERY_ORDER = on
