"""Memory: levels 1 and 2 of GGML's backend interface (ggml-backend-impl.h), buffer types and
buffers, and the two calls that place a tensor in a buffer.

* ``BufferType``: how to get memory (alignment, max size, host or not);
* ``Buffer``: one allocation; tensors live in it at byte offsets (a tensor's ``buffer`` and
  ``offset``). ``Buffer`` is the interface; ``HostBuffer`` is host memory (a NumPy ``uint8``
  array), what the CPU backend and contexts with ``no_alloc=False`` use; a device backend
  subclasses ``Buffer`` with its own memory.

This module sits below ``tensor.py``: tensors point at buffers, buffers know tensors only by their
``offset``, ``nbytes()`` and ``data_buffer()``. Devices and backends (levels 3 to 5) are in
``backend.py``.

Where tensors live changes rarely, and caches of what is derived from tensors' addresses (the CPU
backend's kernel plans) must know when it does: ``placement_epoch`` is bumped whenever a tensor
gets, changes or loses memory and whenever a buffer is freed.
"""
from __future__ import annotations

import enum
import itertools

import numpy as np

from .errors import AllocationError, OutOfMemoryError

__all__ = ["SIZE_MAX", "BufferUsage", "Status", "BufferType", "Buffer", "HostBuffer", "MultiBuffer",
           "buft_alloc_buffer", "host_buffer_type", "tensor_alloc", "view_init"]

SIZE_MAX = 2**64 - 1


class BufferUsage(enum.IntEnum):
    """GGML's ``ggml_backend_buffer_usage``: what a buffer holds. WEIGHTS buffers draw the scheduler's ops to
    their device; the graph allocator's buffers are COMPUTE; ANY is the default."""
    ANY = 0
    WEIGHTS = 1
    COMPUTE = 2


class Status(enum.IntEnum):
    """GGML's ``ggml_status``."""
    ALLOC_FAILED = -2
    FAILED = -1
    SUCCESS = 0
    ABORTED = 1


# Bumped whenever a tensor gets, changes or loses memory (its ``buffer`` or ``offset``: see
# ``Tensor``'s setters) and when a buffer is freed: what is derived from tensors' addresses stays
# valid while this number is unchanged, without re-checking every tensor.
placement_epoch = 0


def placement_changed():
    global placement_epoch
    placement_epoch += 1


# -- level 1: buffer type ------------------------------------------------------------------------
class BufferType:
    """Where memory comes from. The base class hands out host memory (``HostBuffer``); a device
    overrides ``alloc_buffer``. ``host`` says whether the CPU may read the memory directly: a test
    device may keep NumPy memory and still call it device memory, and then only its own buffer
    methods touch it."""

    def __init__(self, name, device=None, alignment=32, max_size=SIZE_MAX, host=False):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"BufferType {name}: alignment must be a power of two, got {alignment}")
        self.name = name
        self.device = device
        self._alignment = alignment
        self._max_size = max_size
        self._host = host

    def get_name(self):
        """The buffer type's name, e.g. ``CPU``."""
        return self.name

    def get_alignment(self):
        """The alignment, in bytes (a power of two), of every tensor placed in this type's buffers."""
        return self._alignment

    def get_max_size(self):
        """The largest single buffer this type can allocate, in bytes (``SIZE_MAX``: no limit)."""
        return self._max_size

    def get_alloc_size(self, t):
        """Bytes that ``t`` takes in a buffer of this type: ``t.nbytes()`` unless a device needs more."""
        return t.nbytes()

    def is_host(self):
        """Whether the CPU may read and write this type's memory directly (GGML's host buffer type).

        The CPU computes in place only on a ``HostBuffer``'s memory (its ``.data``), and copies read
        and write that memory directly. A host type whose buffers are another ``Buffer`` holds its
        bytes its own way: copies (``tensor_copy``, the scheduler's) go through its ``get_tensor``
        and ``set_tensor``, and the CPU refuses to compute on it in place (``host_view``)."""
        return self._host

    def alloc_buffer(self, size):
        """A new buffer of ``size`` bytes; the base class gives zeroed host memory (a ``HostBuffer``)."""
        return HostBuffer(self, size)

    def __repr__(self):
        return f"<BufferType {self.name}>"


def buft_alloc_buffer(buft, size):
    """GGML's wrapper: a zero-size request gets a dummy buffer without asking the buffer type."""
    if size == 0:
        return HostBuffer(buft, 0)
    return buft.alloc_buffer(size)


_host_buft = None


def host_buffer_type():
    """Plain host memory, 32-byte aligned: what a ``Context(no_alloc=False)`` gives its tensors
    (GGML's context memory) and what the CPU device's buffer type is made of."""
    global _host_buft
    if _host_buft is None:
        _host_buft = BufferType("CPU", alignment=32, host=True)
    return _host_buft


# -- level 2: buffer -------------------------------------------------------------------------------
class Buffer:
    """One allocation of ``size`` bytes: the interface. Subclasses say how to reach the memory."""

    _ids = itertools.count()

    def __init__(self, buft, size):
        self.buft = buft
        self.size = int(size)
        self._usage = BufferUsage.ANY
        self.id = next(Buffer._ids)

    # usage is a property so that a multi-buffer can pass it on to its parts
    @property
    def usage(self):
        """What this buffer holds, a ``BufferUsage``; settable."""
        return self._usage

    @usage.setter
    def usage(self, u):
        self._usage = BufferUsage(u)

    def is_host(self):
        """Whether the CPU may read and write this buffer's memory directly: its type's ``is_host``
        (see there for a host buffer that is not a ``HostBuffer``)."""
        return self.buft.is_host()

    def get_base(self):
        """The address of the first byte: 0, as tensors' offsets count from it; None for a zero-size
        buffer."""
        return None if self.size == 0 else 0

    def init_tensor(self, t):
        """Called when ``t`` is placed in this buffer (a device may set up ``t.extra``); returns a
        ``Status``."""
        return Status.SUCCESS

    def set_tensor(self, t, data, offset, size):
        """Write ``size`` bytes of ``data`` (a ``uint8`` array) at ``offset`` inside ``t``."""
        raise NotImplementedError(f"{type(self).__name__}.set_tensor")

    def get_tensor(self, t, offset, size):
        """``size`` bytes at ``offset`` inside ``t``, as a new ``uint8`` array."""
        raise NotImplementedError(f"{type(self).__name__}.get_tensor")

    def memset_tensor(self, t, value, offset, size):
        """Set ``size`` bytes at ``offset`` inside ``t`` to the byte ``value``."""
        raise NotImplementedError(f"{type(self).__name__}.memset_tensor")

    def cpy_tensor(self, src, dst):
        """Copy ``src`` (anywhere) into ``dst`` (in this buffer); False when this buffer can't."""
        return False

    def clear(self, value=0):
        """Set every byte of the buffer to ``value``."""
        raise NotImplementedError(f"{type(self).__name__}.clear")

    reset = None  # optional: called before the allocator re-places tensors

    def free(self):
        """Release the memory (the size becomes 0); tensors placed in it must not be used afterwards."""
        self.size = 0
        placement_changed()

    def __repr__(self):
        return f"<Buffer {self.buft.name} {self.size} B {self.usage.name}>"


class HostBuffer(Buffer):
    """Host memory: one NumPy ``uint8`` array, ``self.data``: new zeroed memory, or ``data``, memory
    that exists already (a mapped file: GGML's ``buffer_from_host_ptr``), used in place."""

    def __init__(self, buft, size, data=None):
        super().__init__(buft, size)
        if data is not None:
            if data.dtype != np.uint8 or data.ndim != 1 or data.size < self.size:
                raise ValueError(f"{buft.name}: host memory must be a uint8 array of at least {self.size} bytes")
            self.data = data
            return
        try:
            self.data = np.zeros(self.size, dtype=np.uint8)
        except MemoryError:
            raise OutOfMemoryError(f"{buft.name}: cannot allocate {self.size} bytes of host memory") from None

    def set_tensor(self, t, data, offset, size):
        start = t.offset + offset
        self.data[start:start + size] = data[:size]

    def get_tensor(self, t, offset, size):
        start = t.offset + offset
        return self.data[start:start + size].copy()

    def memset_tensor(self, t, value, offset, size):
        start = t.offset + offset
        self.data[start:start + size] = value

    def cpy_tensor(self, src, dst):
        sbuf = src.data_buffer()
        if isinstance(sbuf, HostBuffer) and sbuf.is_host() and self.is_host():
            n = src.nbytes()
            self.data[dst.offset:dst.offset + n] = sbuf.data[src.offset:src.offset + n]
            return True
        return False

    def clear(self, value=0):
        self.data[:] = value

    def free(self):
        self.data = np.zeros(0, dtype=np.uint8)
        super().free()


class MultiBuffer(Buffer):
    """Several buffers that act as one for ``usage`` and ``clear``/``free`` (GGML's multi-buffer);
    tensors live in the parts."""

    def __init__(self, buft, buffers):
        self.buffers = list(buffers)
        super().__init__(buft, sum(b.size for b in self.buffers))

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


# -- placing tensors (GGML's ggml_backend_tensor_alloc and ggml_backend_view_init) ----------------
def view_init(t):
    """Give a view its root's buffer and address (GGML's ``ggml_backend_view_init``)."""
    root = t.view_src
    if root is None or root.buffer is None or root.offset is None:
        raise AllocationError(f"view_init: the root of {t.label} is not allocated")
    t.buffer = root.buffer
    t.offset = root.offset + t.view_offs
    return root.buffer.init_tensor(t)


def tensor_alloc(buffer, t, offset):
    """Place ``t`` at ``offset`` inside ``buffer`` (GGML's ``ggml_backend_tensor_alloc``)."""
    if t.buffer is not None or t.offset is not None:
        raise ValueError(f"tensor_alloc: {t.label} is already allocated")
    size = buffer.buft.get_alloc_size(t)
    if offset + size > buffer.size:
        raise OutOfMemoryError(f"tensor_alloc: {t.label} ({size} B at {offset}) does not fit buffer of {buffer.size} B")
    t.buffer = buffer
    t.offset = offset
    return buffer.init_tensor(t)
