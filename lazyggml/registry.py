"""Finding the devices: the built-in backend registries, and GGML's ``ggml_backend_reg_*`` /
``ggml_backend_dev_*`` / ``ggml_backend_init_*`` functions over them.

The registries are made on first use, in GGML's order: CUDA, OpenCL, then the CPU last; each only
when its library and a device exist. ``LAZYGGML_DISABLE_CUDA=1`` / ``LAZYGGML_DISABLE_OPENCL=1``
leave one out.
"""
from __future__ import annotations

from . import debug
from .backend import DeviceType

__all__ = ["register_backend", "reg_count", "reg_get", "reg_by_name", "dev_count", "dev_get", "dev_by_name",
           "dev_by_type", "backend_init_by_name", "backend_init_by_type", "backend_init_best", "rpc_add_server",
           "rpc_device"]

_registries = None


def _builtin_registries():
    regs = []
    if not debug.flag("LAZYGGML_DISABLE_CUDA"):
        from .backends import cuda
        regs.append(cuda.registry())
    if not debug.flag("LAZYGGML_DISABLE_OPENCL"):
        from .backends import opencl
        regs.append(opencl.registry())
    from .backends import cpu
    regs.append(cpu.registry())
    return [r for r in regs if r is not None]


def _regs():
    global _registries
    if _registries is None:
        _registries = _builtin_registries()
    return _registries


def register_backend(reg):
    """Add a registry of your own (a test device, a new backend) after the built-in ones."""
    _regs().append(reg)


def reg_count():
    """How many backend registries there are (built in and registered)."""
    return len(_regs())


def reg_get(i):
    """The ``i``-th registry, in GGML's order (CUDA, OpenCL, CPU, then those registered)."""
    return _regs()[i]


def reg_by_name(name):
    """The registry named ``name`` (any case), or None."""
    return next((r for r in _regs() if r.name.lower() == name.lower()), None)


def _devices():
    return [d for r in _regs() for d in r.devices]


def dev_count():
    """How many devices all the registries hold together."""
    return len(_devices())


def dev_get(i):
    """The ``i``-th device over all the registries, in their order."""
    return _devices()[i]


def dev_by_name(name):
    """The device named ``name`` (any case), or None."""
    return next((d for d in _devices() if d.name.lower() == name.lower()), None)


def dev_by_type(type_):
    """The first device of the ``DeviceType`` ``type_``, or None."""
    return next((d for d in _devices() if d.type == type_), None)


def backend_init_by_name(name):
    """A new backend on the device named ``name`` (any case); ``ValueError`` listing the devices when none has
    it."""
    d = dev_by_name(name)
    if d is None:
        raise ValueError(f"no device named {name!r}; devices: {[x.name for x in _devices()]}")
    return d.init_backend()


def backend_init_by_type(type_):
    """A new backend on the first device of the ``DeviceType`` ``type_``, or None when there is none."""
    d = dev_by_type(type_)
    return None if d is None else d.init_backend()


def backend_init_best():
    """A GPU if there is one, else an integrated GPU, else the CPU."""
    for ty in (DeviceType.GPU, DeviceType.IGPU, DeviceType.CPU):
        d = dev_by_type(ty)
        if d is not None:
            return d.init_backend()
    return None


def rpc_add_server(endpoint, timeout=None):
    """Connect to the GGML RPC server at ``"host:port"`` (lazyggml's ``lazyggml rpc-server`` or
    llama.cpp's ``ggml-rpc-server``) and register its devices (``RPC0``, ...), GGML's
    ``ggml_backend_rpc_add_server``; returns their ``Registry``. ``timeout``: seconds a reply may
    take before the connection counts as dead (default ``client.DEFAULT_TIMEOUT``)."""
    from .backends.rpc import client
    reg = client.add_server(endpoint, client.DEFAULT_TIMEOUT if timeout is None else timeout)
    if reg not in _regs():   # in place of a registry of the same server whose connection died
        _regs()[:] = [r for r in _regs() if r.name != reg.name]
        register_backend(reg)
    return reg


def rpc_device(endpoint, index=0, timeout=None):
    """Device ``index`` of the RPC server at ``"host:port"``, connected and registered."""
    reg = rpc_add_server(endpoint, timeout)
    if not 0 <= index < reg.get_device_count():
        raise ValueError(f"RPC server {endpoint} serves {reg.get_device_count()} device(s); there is no device {index}")
    return reg.get_device(index)
