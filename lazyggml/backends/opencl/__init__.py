"""The OpenCL backend (GGML's ``ggml-opencl``), through pyopencl.

``backend.py`` is the devices (found on every platform, duplicates dropped), their buffers and
the backend on each device's in-order queue; ``program.py`` joins the ``.h`` and ``.cl`` sources
into the one program each device builds; ``ops.py`` is the glue from graph nodes to kernel
launches, registered in ``table.py``.
"""
from .backend import OpenCLBackend, OpenCLBuffer, OpenCLDevice, cache_dir, discover, registry

__all__ = ["OpenCLBackend", "OpenCLBuffer", "OpenCLDevice", "cache_dir", "discover", "registry"]
