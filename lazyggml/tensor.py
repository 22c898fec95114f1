"""Lazy tensors and the contexts that create them (GGML's ``ggml_tensor`` / ``ggml_context``).

A tensor is metadata only: a type, a shape ``ne`` and byte strides ``nb`` (both in GGML's order,
``ne[0]`` innermost), the op that produces it and its sources. Memory comes later, from a backend
buffer: ``buffer`` and ``offset`` (GGML's ``data - base``). A tensor whose ``offset`` is set "has
data" in GGML's sense; a view made of an allocated root gets its ``offset`` at once but keeps
``buffer = None`` until ``view_init`` (docs/graph-alloc-sched.md §1.2).

This module imports only ``types`` and ``buffer``: the ops (``ops.py``) add the operator sugar
(``a + b``, ``w @ x``) to ``Tensor`` and ``graph.py`` adds ``Context.new_graph``, from above.
"""
from __future__ import annotations

import threading
from numbers import Integral

import numpy as np

from .buffer import host_buffer_type, placement_changed
from .errors import AllocationError, OutOfMemoryError
from .types import Op, Type, as_type, blck_size, type_size, type_name, np_dtype

__all__ = ["MAX_DIMS", "MAX_SRC", "MAX_NAME", "FLAG_INPUT", "FLAG_OUTPUT", "FLAG_PARAM", "FLAG_LOSS",
           "FLAG_COMPUTE", "Tensor", "Context", "current_context", "contiguous_strides", "set_input",
           "set_output", "set_param", "set_loss", "set_name", "get_name"]

MAX_DIMS = 4
MAX_SRC = 10
MAX_NAME = 64

FLAG_INPUT = 1
FLAG_OUTPUT = 2
FLAG_PARAM = 4
FLAG_LOSS = 8
FLAG_COMPUTE = 16


def _check_ne(ne, what="tensor"):
    """Validate a shape of 1 to 4 non-negative ints; return it padded to 4 with ones."""
    try:
        ne = list(ne)
    except TypeError:
        raise ValueError(f"{what}: shape must be a sequence of 1 to 4 ints, got {ne!r}") from None
    if not 1 <= len(ne) <= MAX_DIMS:
        raise ValueError(f"{what}: shape must have 1 to {MAX_DIMS} dims, got {len(ne)}: {ne}")
    for n in ne:
        # plain ints first: the ABC check against Integral costs ~1 µs, and graphs make many tensors
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, Integral)) or n < 0:
            raise ValueError(f"{what}: sizes must be non-negative ints, got {ne}")
    return tuple(int(n) for n in ne) + (1,) * (MAX_DIMS - len(ne))


def contiguous_strides(type_, ne):
    """GGML's strides for a packed tensor: ``nb[1]`` is a row of blocks, then products."""
    nb0 = type_size(type_)
    nb1 = nb0 * (ne[0] // blck_size(type_))
    return (nb0, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2])


class Tensor:
    """One GGML tensor. Create them through a ``Context`` or an op, not directly."""

    __slots__ = ("ctx", "type", "ne", "nb", "op", "op_params", "flags", "src", "view_src",
                 "view_offs", "_name", "_buffer", "_offset", "extra", "host_view_cache", "__weakref__")

    def __init__(self, ctx, type_, ne, nb=None, view_src=None, view_offs=0):
        self.ctx = ctx
        self.type = type_
        self.ne = ne
        self.nb = nb if nb is not None else contiguous_strides(type_, ne)
        self.op = Op.NONE
        self.op_params = ()
        self.flags = 0
        self.src = [None] * MAX_SRC
        self.view_src = view_src
        self.view_offs = view_offs
        self._name = ""
        self.buffer = None
        # an allocated root gives its views an address at once (GGML sets view->data here)
        self.offset = None if view_src is None or view_src.offset is None else view_src.offset + view_offs
        self.extra = None  # per-backend data (GGML's tensor->extra)
        self.host_view_cache = None  # (memory, offset, NumPy view): see backend.host_view

    # -- memory: setting either counts as a move (see buffer.placement_epoch) ------------------
    @property
    def buffer(self):
        """The buffer holding this tensor's bytes, or None: before allocation, and for a view until
        ``view_init``. Setting it counts as a move."""
        return self._buffer

    @buffer.setter
    def buffer(self, b):
        self._buffer = b
        placement_changed()

    @property
    def offset(self):
        """Where the bytes start, counted from the buffer's base (GGML's ``data - base``), or None while the
        tensor has no address. Setting it counts as a move."""
        return self._offset

    @offset.setter
    def offset(self, o):
        self._offset = o
        placement_changed()

    # -- names ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The tensor's name; one longer than ``MAX_NAME - 1`` characters is cut when set."""
        return self._name

    @name.setter
    def name(self, s):
        self._name = str(s)[: MAX_NAME - 1]

    @property
    def label(self) -> str:
        """How messages name this tensor: its name in quotes, or what it is when it has none
        (``unnamed MUL_MAT result``, ``unnamed F32 tensor``): a bare ``''`` tells the reader nothing."""
        if self._name:
            return f"'{self._name}'"
        return f"unnamed {self.op.name} result" if self.op != Op.NONE else f"unnamed {type_name(self.type)} tensor"

    # -- sizes ---------------------------------------------------------------------------------
    def nelements(self) -> int:
        """The number of elements, ne0·ne1·ne2·ne3."""
        ne = self.ne
        return ne[0] * ne[1] * ne[2] * ne[3]

    def nrows(self) -> int:
        """The number of rows, ne1·ne2·ne3."""
        return self.ne[1] * self.ne[2] * self.ne[3]

    def nbytes(self) -> int:
        """Bytes spanned from the first to the last element (GGML's ``ggml_nbytes``)."""
        ne, nb = self.ne, self.nb
        if min(ne) <= 0:
            return 0
        rest = (ne[1] - 1) * nb[1] + (ne[2] - 1) * nb[2] + (ne[3] - 1) * nb[3]   # MAX_DIMS = 4
        bs = blck_size(self.type)
        if bs == 1:
            return type_size(self.type) + (ne[0] - 1) * nb[0] + rest
        return ne[0] * nb[0] // bs + rest

    def row_bytes(self) -> int:
        """Bytes in one row: ne0 elements at ``nb[0]`` bytes per block."""
        return self.ne[0] * self.nb[0] // blck_size(self.type)

    # -- layout predicates (GGML's ggml_is_*) ----------------------------------------------------
    def is_contiguous(self) -> bool:
        """The elements are packed in order, with no gaps (GGML's ``ggml_is_contiguous``)."""
        return self._contiguous_from(0)

    def is_contiguous_1(self) -> bool:
        """Contiguous except that rows may be spaced apart (GGML's ``ggml_is_contiguous_1``)."""
        return self._contiguous_from(1)

    def is_contiguous_rows(self) -> bool:
        """The elements of each row are adjacent; the rows themselves may lie anywhere."""
        return self.ne[0] == blck_size(self.type) or self.nb[0] == type_size(self.type)

    def _contiguous_from(self, n):
        """GGML's ``ggml_is_contiguous_n``: dims above ``n`` are packed, dims 1..n may have gaps."""
        nxt = type_size(self.type)
        if self.ne[0] != blck_size(self.type) and self.nb[0] != nxt:
            return False
        nxt *= self.ne[0] // blck_size(self.type)
        for i in range(1, MAX_DIMS):
            if self.ne[i] != 1:
                if i > n:
                    if self.nb[i] != nxt:
                        return False
                    nxt *= self.ne[i]
                else:
                    nxt = self.ne[i] * self.nb[i]
        return True

    def is_transposed(self) -> bool:
        """Dims 0 and 1 are swapped in memory: ``nb[0] > nb[1]``."""
        return self.nb[0] > self.nb[1]

    def is_permuted(self) -> bool:
        """The strides are out of order, so some dims are swapped in memory."""
        nb = self.nb
        return nb[0] > nb[1] or nb[1] > nb[2] or nb[2] > nb[3]

    def is_scalar(self) -> bool:
        """One element: the shape is [1, 1, 1, 1]."""
        return self.ne == (1, 1, 1, 1)

    def is_vector(self) -> bool:
        """A single row: ne1 = ne2 = ne3 = 1."""
        return self.ne[1] == 1 and self.ne[2] == 1 and self.ne[3] == 1

    def is_matrix(self) -> bool:
        """At most two dims: ne2 = ne3 = 1."""
        return self.ne[2] == 1 and self.ne[3] == 1

    def n_dims(self) -> int:
        """The number of dims up to the last one larger than 1, at least 1 (GGML's ``ggml_n_dims``)."""
        for i in range(MAX_DIMS - 1, 0, -1):
            if self.ne[i] > 1:
                return i + 1
        return 1

    # -- memory ----------------------------------------------------------------------------------
    def has_data(self) -> bool:
        """GGML's ``data != NULL``: the tensor (or its view root) has an address."""
        return self.offset is not None

    def data_buffer(self):
        """The buffer that holds this tensor's bytes (a view reads its root's)."""
        return self.buffer if self.buffer is not None or self.view_src is None else self.view_src.buffer

    # -- convenience -----------------------------------------------------------------------------
    def __repr__(self):
        shape = "x".join(str(n) for n in self.ne[: self.n_dims()])
        return f"<Tensor {self._name or '?'} {self.op.name} {type_name(self.type)} [{shape}]>"

    @property
    def shape(self):
        """NumPy's order: ``tuple(reversed(ne))`` trimmed to ``n_dims``."""
        return tuple(reversed(self.ne[: self.n_dims()]))


_local = threading.local()


def current_context():
    """The innermost ``with ctx:`` context of this thread, or None."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


class Context:
    """Creates tensors (GGML's ``ggml_context``).

    ``no_alloc=True`` (the default, and the way GGML is used with backends) creates metadata only.
    With ``no_alloc=False`` each new tensor also gets host memory at once, so it can be filled with
    ``tensor_set`` and computed without an allocator; ``mem_size`` (bytes) then caps the total.
    """

    def __init__(self, mem_size=None, no_alloc=True):
        if mem_size is not None and (not isinstance(mem_size, Integral) or mem_size < 0):
            raise ValueError(f"Context: mem_size must be a non-negative int, got {mem_size!r}")
        self.mem_size = mem_size
        self.no_alloc = no_alloc
        self.mem_used = 0
        self._tensors = []

    def __enter__(self):
        if not hasattr(_local, "stack"):
            _local.stack = []
        _local.stack.append(self)
        return self

    def __exit__(self, *exc):
        _local.stack.pop()

    def tensors(self):
        """Every tensor this context created, in order of creation (a new list)."""
        return list(self._tensors)

    def get_tensor(self, name):
        """The first tensor of this context named ``name``, or None (``ggml_get_tensor``)."""
        for t in self._tensors:
            if t.name == name:
                return t
        return None

    # -- creation ---------------------------------------------------------------------------------
    def _new(self, type_, ne, nb=None, view_src=None, view_offs=0, what="new_tensor"):
        type_ = as_type(type_)
        ne = _check_ne(ne, what)
        if ne[0] % blck_size(type_):
            raise ValueError(f"{what}: ne[0]={ne[0]} is not a multiple of {type_name(type_)}'s "
                             f"block size {blck_size(type_)}")
        if view_src is not None and view_src.view_src is not None:
            view_offs += view_src.view_offs  # views of views point at the root (docs/graph-alloc-sched.md §1.2)
            view_src = view_src.view_src
        t = Tensor(self, type_, ne, nb, view_src, view_offs)
        if view_src is not None:
            if view_offs < 0 or view_offs + t.nbytes() > view_src.nbytes():
                raise ValueError(f"{what}: view of {t.nbytes()} bytes at offset {view_offs} is out of "
                                 f"range of {view_src.label} ({view_src.nbytes()} bytes)")
        elif not self.no_alloc:
            self._alloc_host(t)
        self._tensors.append(t)
        return t

    def _alloc_host(self, t):
        size = t.nbytes()
        if self.mem_size is not None and self.mem_used + size > self.mem_size:
            raise OutOfMemoryError(f"Context: not enough space: {self.mem_used + size} bytes needed, "
                             f"mem_size is {self.mem_size}")
        buf = host_buffer_type().alloc_buffer(max(size, 1))
        t.buffer, t.offset = buf, 0
        self.mem_used += size

    def new_tensor(self, type_, ne):
        """A new packed tensor of type ``type_`` and shape ``ne`` (1 to 4 sizes, ne[0] innermost); with host
        memory when the context has ``no_alloc=False``."""
        return self._new(type_, ne)

    def new_tensor_1d(self, type_, ne0):
        """``new_tensor`` with the shape [ne0]."""
        return self._new(type_, (ne0,))

    def new_tensor_2d(self, type_, ne0, ne1):
        """``new_tensor`` with the shape [ne0, ne1]: ne1 rows of ne0 elements."""
        return self._new(type_, (ne0, ne1))

    def new_tensor_3d(self, type_, ne0, ne1, ne2):
        """``new_tensor`` with the shape [ne0, ne1, ne2]."""
        return self._new(type_, (ne0, ne1, ne2))

    def new_tensor_4d(self, type_, ne0, ne1, ne2, ne3):
        """``new_tensor`` with the shape [ne0, ne1, ne2, ne3]."""
        return self._new(type_, (ne0, ne1, ne2, ne3))

    def dup_tensor(self, src):
        """A new packed tensor with ``src``'s type and shape (GGML's ``ggml_dup_tensor``)."""
        return self._new(src.type, src.ne)

    def view_tensor(self, src, ne=None, nb=None, offset=0, what="view_tensor"):
        """A view of ``src`` (same shape and strides by default), named ``"<src> (view)"``."""
        t = self._new(src.type, src.ne if ne is None else ne, src.nb if nb is None else nb,
                      view_src=src, view_offs=offset, what=what)
        t.name = f"{src.name} (view)"
        return t

    def new_i32(self, value):
        """A new one-element I32 tensor holding ``value``; the context must have ``no_alloc=False``."""
        t = self.new_tensor_1d(Type.I32, 1)
        _set_scalar(t, np.int32(value))
        return t

    def new_f32(self, value):
        """A new one-element F32 tensor holding ``value``; the context must have ``no_alloc=False``."""
        t = self.new_tensor_1d(Type.F32, 1)
        _set_scalar(t, np.float32(value))
        return t


def _set_scalar(t, v):
    if t.offset is None:
        raise AllocationError("new_i32/new_f32 need a context with no_alloc=False")
    raw = np.asarray([v], dtype=np_dtype(t.type)).view(np.uint8)
    t.buffer.set_tensor(t, raw, 0, raw.size)


# -- flag setters (GGML's ggml_set_*) --------------------------------------------------------------
def set_input(t):
    """Mark ``t`` as a graph input (``FLAG_INPUT``): the allocator places it before any computed tensor, and
    the scheduler assigns it to the last (CPU) backend unless it already lives in a buffer."""
    t.flags |= FLAG_INPUT


def set_output(t):
    """Mark ``t`` and its view root as outputs (docs/graph-alloc-sched.md §1.3)."""
    while t is not None:
        t.flags |= FLAG_OUTPUT
        t = t.view_src


def set_param(t):
    """Mark the leaf ``t`` as a trainable parameter (``FLAG_PARAM``): graphs then list it as a node, not a
    leaf."""
    if t.op != Op.NONE:
        raise ValueError(f"set_param: {t.label} is the result of {t.op.name}; only leafs can be params")
    t.flags |= FLAG_PARAM


def set_loss(t):
    """Mark ``t``, a one-element F32 tensor, as the loss (``FLAG_LOSS``)."""
    if not t.is_scalar() or t.type != Type.F32:
        raise ValueError(f"set_loss: the loss must be a scalar F32, got {t!r}")
    t.flags |= FLAG_LOSS


def set_name(t, name):
    """Name ``t`` (cut to ``MAX_NAME - 1`` characters) and return it."""
    t.name = name
    return t


def get_name(t):
    """``t``'s name."""
    return t.name
