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

import contextlib
import enum
import itertools

import numpy as np

from .buffer import HostBuffer
from .errors import AllocationError, ShapeError, TensorTypeError
from .types import blck_size, is_quantized, np_dtype, type_name

__all__ = ["DeviceType", "Device", "Backend", "Registry", "backend_graph_compute", "tensor_set",
           "tensor_get", "tensor_get_bytes", "tensor_memset", "tensor_set_async", "tensor_copy",
           "tensor_copy_async", "host_layout", "host_view", "host_bytes", "event_new", "event_synchronize"]



class DeviceType(enum.IntEnum):
    """GGML's ``ggml_backend_dev_type``: what kind of device (CPU, discrete GPU, integrated GPU,
    accelerator)."""
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
        """The device's short name, e.g. ``CPU``."""
        return self.name

    def get_description(self):
        """A longer description of the device (its name when none was given)."""
        return self.description

    def get_type(self):
        """The device's ``DeviceType``."""
        return self.type

    def memory(self):
        """(free, total) bytes."""
        return (0, 0)

    get_memory = memory

    def get_buffer_type(self):
        """The buffer type of this device's own memory, where its backends compute."""
        raise NotImplementedError(f"device {self.name} has no buffer type")

    def get_host_buffer_type(self):
        """A host buffer type this device can copy from and to quickly (pinned memory), or None."""
        return None

    def get_extra_buffer_types(self):
        """Buffer types a model loader offers a weight before ``get_buffer_type``, each with a
        ``supports_op(node)`` of the node the weight is used in: GGML's ``ggml_backend_dev_get_extra_bufts``
        (the CPU's CPU_REPACK). None by default."""
        return []

    def buffer_from_host_ptr(self, data):
        """A buffer whose memory is ``data``, existing host memory (a ``uint8`` array the caller keeps
        alive, e.g. a mapped file), used in place: GGML's ``ggml_backend_dev_buffer_from_host_ptr``.
        None when this device cannot compute on host memory in place (the default)."""
        return None

    def supports_op(self, t):
        """Whether this device can compute the node ``t`` (its op, types and shapes)."""
        return True

    def supports_buft(self, buft):
        """Whether this device's backends can use tensors in buffers of type ``buft``; by default only its
        own."""
        return buft.device is self

    def offload_op(self, t):
        """Whether this device wants to compute ``t`` even though its weights sit in host memory, copying them
        every time; by default no."""
        return False

    def init_backend(self):
        """A new backend (a stream) on this device."""
        return Backend(self)

    def event_new(self):
        """An event for this device, or None when it has no events (GGML's default)."""
        return None

    def event_synchronize(self, event):
        """Wait until the work recorded before ``event`` is done; a device without events has nothing to wait
        for."""
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
    # True when set_tensor_async has read its host data by the time it returns (CUDA's uploads
    # from pageable memory are staged at once): the scheduler then queues uploads of host inputs
    # behind the backend's earlier work instead of waiting for it
    host_copy_snapshots = False

    def __init__(self, device, name=None):
        self.device = device
        self.name = name or device.name
        self.guid = next(Backend._guids)

    def get_name(self):
        """The backend's name (its device's by default)."""
        return self.name

    def get_default_buffer_type(self):
        """The buffer type for tensors this backend computes: its device's."""
        return self.device.get_buffer_type()

    def warmup_variants(self):
        """lazyggml's own: the settings ``lazyggml warmup`` runs each case under, as context
        managers, so that every kernel variant a real run may take compiles: the backend as it is."""
        return [contextlib.nullcontext()]

    def graph_compute(self, g):
        """Compute the nodes of graph ``g`` in order and return a ``Status``; the work may still be running on
        return (see ``synchronize``)."""
        raise NotImplementedError(f"backend {self.name} cannot compute graphs")

    def synchronize(self):
        """Wait until all the work queued on this backend is done."""
        pass

    def supports_op(self, t):
        """Whether this backend can compute the node ``t``: its device's answer."""
        return self.device.supports_op(t)

    def supports_buft(self, buft):
        """Whether this backend can use tensors in buffers of type ``buft``: its device's answer."""
        return self.device.supports_buft(buft)

    def offload_op(self, t):
        """Whether this backend wants ``t`` although its weights are in host memory: its device's answer."""
        return self.device.offload_op(t)

    def free(self):
        """Release what the backend holds; it must not be used afterwards."""
        pass

    def __repr__(self):
        return f"<Backend {self.name}>"


# -- GGML's wrappers over the optional methods ----------------------------------------------------
def backend_graph_compute(backend, g):
    """Compute and wait (GGML's ``ggml_backend_graph_compute``)."""
    status = backend.graph_compute(g)
    backend.synchronize()
    return status


NOT_ALLOCATED_HINT = ("a Context() makes tensors without memory (no_alloc=True): place them with "
                      "lg.alloc_ctx_tensors(ctx, backend), a graph's nodes with lg.Gallocr or a "
                      "lg.Scheduler, or make the context with lg.Context(no_alloc=False)")


def not_allocated(what, t):
    """The error for a tensor used before it has memory, with how to give it some."""
    return AllocationError(f"{what}: tensor {t.label} is not allocated; {NOT_ALLOCATED_HINT}")


def _as_bytes(name, t, data, offset, size, nbytes):
    """``data`` as raw bytes for ``t``: its dtype must be ``t``'s element dtype, or ``uint8`` (raw
    bytes; the only form for quantized tensors); ``size`` bytes, by default the rest of the
    tensor from ``offset``, so that a short array is an error rather than a partial write."""
    data = np.asarray(data)
    want = np_dtype(t.type)
    if data.dtype != np.uint8 and (want is None or data.dtype != want):
        expected = f"{np.dtype(want).name} or uint8 (raw bytes)" if want is not None else "uint8 (raw block bytes)"
        raise TensorTypeError(f"{name}: tensor {t.label} is {type_name(t.type)}, which takes {expected} data; "
                              f"got {data.dtype.name}" + (f" (convert with .astype(np.{np.dtype(want).name}))"
                                                          if want is not None else ""))
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    size = nbytes - offset if size is None else size
    if raw.size != size:
        raise ShapeError(f"{name}: tensor {t.label} {type_name(t.type)}{list(t.ne)} needs {size} bytes from "
                         f"offset {offset}; got {raw.size} ({data.dtype.name}{list(data.shape)})")
    return raw


def _check_range(name, t, offset, size, nbytes):
    buf = t.data_buffer()
    if buf is None or t.offset is None:
        raise not_allocated(name, t)
    if offset < 0 or offset + size > nbytes:
        raise ShapeError(f"{name}: {size} bytes at offset {offset} do not fit tensor {t.label} "
                         f"({nbytes} bytes)")
    return buf


def tensor_set(t, data, offset=0, size=None):
    """Copy the NumPy array ``data`` into ``t`` from byte ``offset`` on (blocking; GGML's
    ``ggml_backend_tensor_set``).

    ``data`` holds ``t``'s elements in its own dtype (F32: ``float32``, F16: ``float16``, BF16:
    ``uint16`` bit patterns, I32: ``int32``, ...) or raw ``uint8`` bytes (quantized tensors take only
    these). It must
    fill ``size`` bytes, by default all of the tensor from ``offset``; pass ``size`` to write a part."""
    n = t.nbytes()
    buf = _check_range("tensor_set", t, offset, size or 0, n)   # size None: _as_bytes makes the rest fit
    raw = _as_bytes("tensor_set", t, data, offset, size, n)
    if raw.size:
        buf.set_tensor(t, raw, offset, raw.size)


def tensor_get_bytes(t, offset=0, size=None):
    """The raw bytes of ``t`` (GGML's ``ggml_backend_tensor_get``)."""
    n = t.nbytes()
    size = n - offset if size is None else size
    buf = _check_range("tensor_get", t, offset, size, n)
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
    """A NumPy view (no copy) of a tensor in a host buffer, laid out as ``host_layout``: how the CPU
    computes on host memory in place, which must be a ``HostBuffer``'s (its ``.data``).

    Backends ask for the same views at every compute of a graph, and making one costs ~2 µs, so
    the last view is kept on the tensor, valid while the tensor stays at the same offset of the same
    memory (a tensor's shape and strides never change)."""
    buf = t.data_buffer()
    if buf is None or t.offset is None:
        raise not_allocated("host_view", t)
    cached = t.host_view_cache
    if cached is not None and cached[0] is buf.data and cached[1] == t.offset:
        return cached[2]
    if not isinstance(buf, HostBuffer):
        raise AllocationError(f"host_view: {t.label} is in a {type(buf).__name__} of type {buf.buft.name}, which "
                              f"says is_host but is no HostBuffer: the CPU computes only on a HostBuffer's memory")
    shape, strides, dtype = host_layout(t)
    view = np.zeros(shape, dtype) if 0 in shape else np.ndarray(shape, dtype, buf.data, t.offset, strides)
    t.host_view_cache = (buf.data, t.offset, view)
    return view


def tensor_memset(t, value, offset=0, size=None):
    """Set ``size`` bytes of ``t`` from byte ``offset`` on (by default all of it) to the byte ``value``."""
    n = t.nbytes()
    size = n - offset if size is None else size
    buf = _check_range("tensor_memset", t, offset, size, n)
    if size:
        buf.memset_tensor(t, value, offset, size)


def tensor_set_async(backend, t, data, offset=0, size=None):
    """``tensor_set`` queued on ``backend`` (GGML's ``ggml_backend_tensor_set_async``): the same
    checks, and the copy may still run after the call returns."""
    n = t.nbytes()
    buf = _check_range("tensor_set_async", t, offset, size or 0, n)
    raw = _as_bytes("tensor_set_async", t, data, offset, size, n)
    if backend.set_tensor_async is None:
        backend.synchronize()
        buf.set_tensor(t, raw, offset, raw.size)
    else:
        backend.set_tensor_async(t, raw, offset, raw.size)


def _same_layout(a, b):
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


def host_bytes(t, offset, size):
    """``size`` bytes at ``offset`` inside ``t``, which is in a host buffer, as a ``uint8`` array: a
    view of a ``HostBuffer``'s memory (no copy), else a copy through the buffer's ``get_tensor``."""
    buf = t.data_buffer()
    if isinstance(buf, HostBuffer):
        start = t.offset + offset
        return buf.data[start:start + size]
    return buf.get_tensor(t, offset, size)


def tensor_copy(src, dst):
    """GGML's ``ggml_backend_tensor_copy``: through host memory where one side is host.

    GGML reads and writes a host buffer's memory in place; here only a ``HostBuffer``'s is (its
    ``.data``): any other ``Buffer`` whose type says ``is_host`` is copied through its own
    ``get_tensor`` and ``set_tensor``, as a device buffer is."""
    if not _same_layout(src, dst):
        raise ShapeError(f"tensor_copy: layouts differ: {src.label} {type_name(src.type)}{list(src.ne)} "
                         f"vs {dst.label} {type_name(dst.type)}{list(dst.ne)}")
    if src is dst:
        return
    sbuf, dbuf = src.data_buffer(), dst.data_buffer()
    n = src.nbytes()
    if sbuf.is_host():
        dbuf.set_tensor(dst, host_bytes(src, 0, n), 0, n)
    elif dbuf.is_host() or not dbuf.cpy_tensor(src, dst):
        dbuf.set_tensor(dst, sbuf.get_tensor(src, 0, n), 0, n)  # staged on the host


def tensor_copy_async(backend_src, backend_dst, src, dst):
    """Copy ``src`` into ``dst``, which have the same layout, queued on ``backend_dst`` when it can copy
    asynchronously; else both backends are synchronized and the copy blocks."""
    if src is dst:
        return
    if backend_dst.cpy_tensor_async is not None and backend_dst.cpy_tensor_async(backend_src, backend_dst, src, dst):
        return
    backend_src.synchronize()
    backend_dst.synchronize()
    tensor_copy(src, dst)


def event_new(device):
    """A new event on ``device``, or None when the device has no events."""
    return device.event_new()


def event_synchronize(event):
    """Wait until ``event`` has been reached on its device."""
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
        """The family's name, e.g. ``CPU`` or ``CUDA``."""
        return self.name

    def get_device_count(self):
        """How many devices this registry holds."""
        return len(self.devices)

    def get_device(self, i):
        """The ``i``-th device of this registry."""
        return self.devices[i]

    def get_proc_address(self, name):
        """A registry-specific extra function by name, as in GGML; lazyggml's registries have none (None)."""
        return None
