"""Backends: ``cpu`` always, ``opencl`` through pyopencl, ``cuda`` through numba-cuda."""
