"""Devices and backends: levels 3 to 5 of GGML's backend interface (ggml-backend-impl.h), and the
wrappers around it (ggml-backend.cpp). Levels 1 and 2, buffer types and buffers, are in
``buffer.py``; finding the devices of this machine is ``registry.py``'s job.

* ``Device``: what a device can do (``supports_op``, ``supports_buft``, ``offload_op``);
* ``Backend``: a stream on a device that computes graphs, maybe asynchronously;
* ``Registry``: a family of devices (CPU, OpenCL, CUDA).

Optional methods are class attributes set to ``None``; the module-level wrappers (``tensor_copy``,
``tensor_set_async``...) supply GGML's defaults when they are missing, exactly as ggml-backend.cpp
does when an interface pointer is NULL.
"""
from __future__ import annotations

import enum
import itertools

import numpy as np

from .types import blck_size, is_quantized, np_dtype, type_name

__all__ = ["DeviceType", "Device", "Backend", "Registry", "backend_graph_compute", "tensor_set",
           "tensor_get", "tensor_get_bytes", "tensor_memset", "tensor_set_async", "tensor_copy",
           "tensor_copy_async", "host_layout", "host_view", "event_new", "event_synchronize"]



class DeviceType(enum.IntEnum):
    CPU = 0
    GPU = 1
    IGPU = 2
    ACCEL = 3


# -- level 3 and 4: device and backend --------------------------------------------------------------
class Device:
    """A device: what it supports and how to start a backend on it."""

    def __init__(self, name, description="", type=DeviceType.GPU, reg=None):  # noqa: A002
        self.name = name
        self.description = description or name
        self.type = DeviceType(type)
        self.reg = reg

    def get_name(self):
        return self.name

    def get_description(self):
        return self.description

    def get_type(self):
        return self.type

    def memory(self):
        """(free, total) bytes."""
        return (0, 0)

    get_memory = memory

    def get_buffer_type(self):
        raise NotImplementedError(f"device {self.name} has no buffer type")

    def get_host_buffer_type(self):
        return None

    def supports_op(self, t):
        return True

    def supports_buft(self, buft):
        return buft.device is self

    def offload_op(self, t):
        return False

    def init_backend(self):
        return Backend(self)

    def event_new(self):
        """An event for this device, or None when it has no events (GGML's default)."""
        return None

    def event_synchronize(self, event):
        pass

    def __repr__(self):
        return f"<Device {self.name} {self.type.name}>"


class Backend:
    """A stream on a device. ``graph_compute`` may return before the work is done."""

    _guids = itertools.count()

    # optional interface methods (GGML: NULL pointers); the wrappers below supply the defaults
    set_tensor_async = None     # (t, data, offset, size)
    get_tensor_async = None     # (t, offset, size) -> array, valid after synchronize
    cpy_tensor_async = None     # (backend_src, backend_dst, src, dst) -> bool
    event_record = None         # (event)
    event_wait = None           # (event)
    graph_optimize = None       # (graph) -> None, may reorder nodes

    def __init__(self, device, name=None):
        self.device = device
        self.name = name or device.name
        self.guid = next(Backend._guids)

    def get_name(self):
        return self.name

    def get_default_buffer_type(self):
        return self.device.get_buffer_type()

    def graph_compute(self, g):
        raise NotImplementedError(f"backend {self.name} cannot compute graphs")

    def synchronize(self):
        pass

    def supports_op(self, t):
        return self.device.supports_op(t)

    def supports_buft(self, buft):
        return self.device.supports_buft(buft)

    def offload_op(self, t):
        return self.device.offload_op(t)

    def free(self):
        pass

    def __repr__(self):
        return f"<Backend {self.name}>"


# -- GGML's wrappers over the optional methods ----------------------------------------------------
def backend_graph_compute(backend, g):
    """Compute and wait (GGML's ``ggml_backend_graph_compute``)."""
    status = backend.graph_compute(g)
    backend.synchronize()
    return status


def _as_bytes(data):
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def _check_range(name, t, offset, size):
    buf = t.data_buffer()
    if buf is None or t.offset is None:
        raise ValueError(f"{name}: tensor '{t.name}' is not allocated")
    if offset < 0 or offset + size > t.nbytes():
        raise ValueError(f"{name}: {size} bytes at offset {offset} do not fit tensor '{t.name}' "
                         f"({t.nbytes()} bytes)")
    return buf


def tensor_set(t, data, offset=0):
    """Copy the bytes of the NumPy array ``data`` into ``t`` at byte ``offset`` (blocking)."""
    raw = _as_bytes(data)
    buf = _check_range("tensor_set", t, offset, raw.size)
    if raw.size:
        buf.set_tensor(t, raw, offset, raw.size)


def tensor_get_bytes(t, offset=0, size=None):
    """The raw bytes of ``t`` (GGML's ``ggml_backend_tensor_get``)."""
    size = t.nbytes() - offset if size is None else size
    buf = _check_range("tensor_get", t, offset, size)
    return buf.get_tensor(t, offset, size) if size else np.zeros(0, np.uint8)


def tensor_get(t):
    """A copy of ``t`` as a 4-D NumPy array of shape ``reversed(ne)``; quantized tensors give their
    raw block bytes, one row per ``ne[1..3]``. Strided views are gathered."""
    raw = tensor_get_bytes(t)
    shape, strides, dtype = host_layout(t)
    if raw.size == 0:
        return np.zeros(shape, dtype)
    return np.ndarray(shape, dtype, raw, 0, strides).copy()


def host_layout(t):
    """(shape, byte strides, dtype) of ``t``'s NumPy view: elements, or bytes for quantized rows."""
    ne, nb = t.ne, t.nb
    if is_quantized(t.type):
        return (ne[3], ne[2], ne[1], ne[0] // blck_size(t.type) * nb[0]), (nb[3], nb[2], nb[1], 1), np.uint8
    return (ne[3], ne[2], ne[1], ne[0]), (nb[3], nb[2], nb[1], nb[0]), np_dtype(t.type)


def host_view(t):
    """A NumPy view (no copy) of a tensor in a host buffer, laid out as ``host_layout``.

    Backends ask for the same views at every compute of a graph, and making one costs ~2 µs, so
    the last view is kept on the tensor, valid while the tensor stays at the same offset of the same
    memory (a tensor's shape and strides never change)."""
    buf = t.data_buffer()
    if buf is None or t.offset is None:
        raise ValueError(f"tensor '{t.name}' is not allocated")
    cached = t.host_view_cache
    if cached is not None and cached[0] is buf.data and cached[1] == t.offset:
        return cached[2]
    shape, strides, dtype = host_layout(t)
    view = np.zeros(shape, dtype) if 0 in shape else np.ndarray(shape, dtype, buf.data, t.offset, strides)
    t.host_view_cache = (buf.data, t.offset, view)
    return view


def tensor_memset(t, value, offset=0, size=None):
    size = t.nbytes() - offset if size is None else size
    buf = _check_range("tensor_memset", t, offset, size)
    if size:
        buf.memset_tensor(t, value, offset, size)


def tensor_set_async(backend, t, data, offset=0):
    raw = _as_bytes(data)
    buf = _check_range("tensor_set_async", t, offset, raw.size)
    if backend.set_tensor_async is None:
        backend.synchronize()
        buf.set_tensor(t, raw, offset, raw.size)
    else:
        backend.set_tensor_async(t, raw, offset, raw.size)


def _same_layout(a, b):
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


def tensor_copy(src, dst):
    """GGML's ``ggml_backend_tensor_copy``: through host memory where one side is host."""
    if not _same_layout(src, dst):
        raise ValueError(f"tensor_copy: layouts differ: '{src.name}' {type_name(src.type)}{list(src.ne)} "
                         f"vs '{dst.name}' {type_name(dst.type)}{list(dst.ne)}")
    if src is dst:
        return
    sbuf, dbuf = src.data_buffer(), dst.data_buffer()
    n = src.nbytes()
    if sbuf.is_host():
        dbuf.set_tensor(dst, sbuf.data[src.offset:src.offset + n], 0, n)
    elif dbuf.is_host():
        dbuf.data[dst.offset:dst.offset + n] = sbuf.get_tensor(src, 0, n)
    elif not dbuf.cpy_tensor(src, dst):
        dbuf.set_tensor(dst, sbuf.get_tensor(src, 0, n), 0, n)  # the slow copy, staged on the host


def tensor_copy_async(backend_src, backend_dst, src, dst):
    if src is dst:
        return
    if backend_dst.cpy_tensor_async is not None and backend_dst.cpy_tensor_async(backend_src, backend_dst, src, dst):
        return
    backend_src.synchronize()
    backend_dst.synchronize()
    tensor_copy(src, dst)


def event_new(device):
    return device.event_new()


def event_synchronize(event):
    event.device.event_synchronize(event)


# -- level 5: registry -------------------------------------------------------------------------------
class Registry:
    """A family of devices."""

    def __init__(self, name, devices=()):
        self.name = name
        self.devices = list(devices)
        for d in self.devices:
            d.reg = self

    def get_name(self):
        return self.name

    def get_device_count(self):
        return len(self.devices)

    def get_device(self, i):
        return self.devices[i]

    def get_proc_address(self, name):
        return None
