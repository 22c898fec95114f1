"""Kernels, one package per backend: ``cpu`` (Numba @njit), ``cuda`` (@cuda.jit), ``opencl`` (.cl)."""
