"""GGML's five-level backend interface (ggml-backend-impl.h), the wrappers around it, the registry.

The five levels, each a class to subclass when adding a device:

* ``BufferType``: how to get memory (alignment, max size, host or not);
* ``Buffer``: one allocation; tensors live in it at byte offsets;
* ``Device``: what a device can do (``supports_op``, ``supports_buft``, ``offload_op``);
* ``Backend``: a stream on a device that computes graphs, maybe asynchronously;
* ``Registry``: a family of devices (CPU, OpenCL, CUDA).

Optional methods are class attributes set to ``None``; the module-level wrappers (``tensor_copy``,
``tensor_set_async``...) supply GGML's defaults when they are missing, exactly as ggml-backend.cpp
does when an interface pointer is NULL.

The base ``Buffer`` holds host memory (a NumPy ``uint8`` array), so a test device only has to say
what differs. A buffer type that is not ``is_host()`` is treated as device memory: only its own
methods touch it.
"""
from __future__ import annotations

import enum
import itertools
import os

import numpy as np

from .ops import EMPTY_OPS
from .tensor import placement_changed
from .types import blck_size, is_quantized, np_dtype, type_name

SIZE_MAX = 2**64 - 1


class BufferUsage(enum.IntEnum):
    ANY = 0
    WEIGHTS = 1
    COMPUTE = 2


class DeviceType(enum.IntEnum):
    CPU = 0
    GPU = 1
    IGPU = 2
    ACCEL = 3


class Status(enum.IntEnum):
    ALLOC_FAILED = -2
    FAILED = -1
    SUCCESS = 0
    ABORTED = 1


# -- level 1: buffer type ------------------------------------------------------------------------
class BufferType:
    """Where memory comes from. Override ``alloc_buffer`` for real device memory."""

    def __init__(self, name, device=None, alignment=32, max_size=SIZE_MAX, host=False):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"BufferType {name}: alignment must be a power of two, got {alignment}")
        self.name = name
        self.device = device
        self._alignment = alignment
        self._max_size = max_size
        self._host = host

    def get_name(self):
        return self.name

    def get_alignment(self):
        return self._alignment

    def get_max_size(self):
        return self._max_size

    def get_alloc_size(self, t):
        return t.nbytes()

    def is_host(self):
        return self._host

    def alloc_buffer(self, size):
        return Buffer(self, size)

    def __repr__(self):
        return f"<BufferType {self.name}>"


def buft_alloc_buffer(buft, size):
    """GGML's wrapper: a zero-size request gets a dummy buffer without asking the buffer type."""
    if size == 0:
        return Buffer(buft, 0)
    return buft.alloc_buffer(size)


# -- level 2: buffer -------------------------------------------------------------------------------
class Buffer:
    """One allocation of ``size`` bytes. The base class keeps host memory in ``self.data``."""

    _ids = itertools.count()

    def __init__(self, buft, size):
        self.buft = buft
        self.size = int(size)
        self._usage = BufferUsage.ANY
        self.data = np.zeros(self.size, dtype=np.uint8)
        self.id = next(Buffer._ids)

    # usage is a property so that a multi-buffer can pass it on to its parts
    @property
    def usage(self):
        return self._usage

    @usage.setter
    def usage(self, u):
        self._usage = BufferUsage(u)

    def is_host(self):
        return self.buft.is_host()

    def get_base(self):
        return None if self.size == 0 else 0

    def init_tensor(self, t):
        return Status.SUCCESS

    def set_tensor(self, t, data, offset, size):
        """Write ``size`` bytes of ``data`` (a ``uint8`` array) at ``offset`` inside ``t``."""
        start = t.offset + offset
        self.data[start:start + size] = data[:size]

    def get_tensor(self, t, offset, size):
        start = t.offset + offset
        return self.data[start:start + size].copy()

    def memset_tensor(self, t, value, offset, size):
        start = t.offset + offset
        self.data[start:start + size] = value

    def cpy_tensor(self, src, dst):
        """Copy ``src`` (anywhere) into ``dst`` (in this buffer); False when this buffer can't."""
        sbuf = src.data_buffer()
        if sbuf is not None and sbuf.is_host() and self.is_host():
            n = src.nbytes()
            self.data[dst.offset:dst.offset + n] = sbuf.data[src.offset:src.offset + n]
            return True
        return False

    def clear(self, value=0):
        self.data[:] = value

    reset = None  # optional: called before the allocator re-places tensors

    def free(self):
        self.data = np.zeros(0, dtype=np.uint8)
        self.size = 0
        placement_changed()

    def __repr__(self):
        return f"<Buffer {self.buft.name} {self.size} B {self.usage.name}>"


class MultiBuffer(Buffer):
    """Several buffers that act as one for ``usage`` (GGML's multi-buffer)."""

    def __init__(self, buft, buffers):
        self.buft = buft
        self.buffers = list(buffers)
        self.size = sum(b.size for b in self.buffers)
        self._usage = BufferUsage.ANY
        self.data = None
        self.id = next(Buffer._ids)

    @Buffer.usage.setter
    def usage(self, u):
        self._usage = BufferUsage(u)
        for b in self.buffers:
            b.usage = u

    def clear(self, value=0):
        for b in self.buffers:
            b.clear(value)

    def free(self):
        for b in self.buffers:
            b.free()


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


def view_init(t):
    """Give a view its root's buffer and address (GGML's ``ggml_backend_view_init``)."""
    root = t.view_src
    if root is None or root.buffer is None or root.offset is None:
        raise ValueError(f"view_init: the root of '{t.name}' is not allocated")
    t.buffer = root.buffer
    t.offset = root.offset + t.view_offs
    return root.buffer.init_tensor(t)


def tensor_alloc(buffer, t, offset):
    """Place ``t`` at ``offset`` inside ``buffer`` (GGML's ``ggml_backend_tensor_alloc``)."""
    if t.buffer is not None or t.offset is not None:
        raise ValueError(f"tensor_alloc: '{t.name}' is already allocated")
    size = buffer.buft.get_alloc_size(t)
    if offset + size > buffer.size:
        raise ValueError(f"tensor_alloc: '{t.name}' ({size} B at {offset}) does not fit buffer of {buffer.size} B")
    t.buffer = buffer
    t.offset = offset
    return buffer.init_tensor(t)


def is_empty_op(t):
    return t.op in EMPTY_OPS


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


_registries = None


def _builtin_registries():
    """CUDA, OpenCL, then CPU last; each only when its library and a device exist."""
    regs = []
    if os.environ.get("LAZYGGML_DISABLE_CUDA", "0") in ("", "0"):
        from .backends import cuda
        regs.append(cuda.registry())
    if os.environ.get("LAZYGGML_DISABLE_OPENCL", "0") in ("", "0"):
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
    _regs().append(reg)


def reg_count():
    return len(_regs())


def reg_get(i):
    return _regs()[i]


def reg_by_name(name):
    return next((r for r in _regs() if r.name.lower() == name.lower()), None)


def _devices():
    return [d for r in _regs() for d in r.devices]


def dev_count():
    return len(_devices())


def dev_get(i):
    return _devices()[i]


def dev_by_name(name):
    return next((d for d in _devices() if d.name.lower() == name.lower()), None)


def dev_by_type(type_):
    return next((d for d in _devices() if d.type == type_), None)


def backend_init_by_name(name):
    d = dev_by_name(name)
    if d is None:
        raise ValueError(f"no device named {name!r}; devices: {[x.name for x in _devices()]}")
    return d.init_backend()


def backend_init_by_type(type_):
    d = dev_by_type(type_)
    return None if d is None else d.init_backend()


def backend_init_best():
    """A GPU if there is one, else an integrated GPU, else the CPU."""
    for ty in (DeviceType.GPU, DeviceType.IGPU, DeviceType.CPU):
        d = dev_by_type(ty)
        if d is not None:
            return d.init_backend()
    return None

