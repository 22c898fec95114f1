"""The RPC server: lazyggml devices served to GGML RPC clients (llama.cpp's ``ggml-rpc`` client or
lazyggml's own, ``client.py``), protocol 7.0.0 (``protocol.py``), as llama.cpp's ``ggml-rpc-server``
serves GGML's (``lazyggml rpc-server``).

The design is GGML's (``rpc_serve_client`` in ggml-rpc.cpp):

* **One connection at a time**, served until it ends; other clients wait in the listen backlog.
  Each connection has its own state (``_Connection``): the buffers it allocated and, per device,
  the graph it last computed (for GRAPH_RECOMPUTE). When the connection ends, for whatever reason,
  its buffers are freed.
* **Addresses.** GGML's server hands out its own pointers: a buffer's handle is its
  ``ggml_backend_buffer_t`` and tensors come back with absolute ``data`` addresses. Here a handle is
  a number, and each buffer gets a made-up base address (non-zero, 4096-aligned, its range apart
  from every other buffer's) from which the client computes ``data = base + offset`` as GGML's
  allocator does; the server turns ``data`` back into ``(buffer, data - base)``. Nothing a peer
  sends is ever used as a pointer.
* **Memory** is reached only through the ``Buffer`` methods (``set_tensor``, ``get_tensor``,
  ``memset_tensor``, ``clear``, ``cpy_tensor``), so CPU, OpenCL and CUDA devices are served alike;
  graphs run on a backend per device (``graph_compute``, then ``synchronize``).

**Hostile peers.** The protocol has no authentication, and GGML's own server asserts (and so dies)
on several malformed messages. This one checks every message, and on any violation logs one line
(logger ``lazyggml.rpc``) and closes the connection; the server goes on to the next client. It is
stricter than GGML's:

* framing: HELLO first and only once; known commands; a fixed-size request exactly its size; a
  SET_TENSOR's data no more than the target tensor holds (checked before the data is read); a
  graph at most ``MAX_GRAPH_SIZE`` bytes, its node and tensor counts matching its size exactly.
  Before its HELLO and inside a message a peer must keep sending (``timeout`` seconds per receive);
  between commands it may be silent as long as it likes (a chat waiting for its user).
* tensors: a type lazyggml knows; ``ne[0]`` a multiple of its block, quantized rows packed, fewer
  than 2^63 elements, strides that do not overlap elements (``_spans_its_elements``), strides and
  address aligned to the element (2 bytes for quantized blocks); a buffer this connection
  allocated (or none: buffer 0 with data 0) and the bytes ``[data, data + nbytes)`` inside it; a
  view where its source and offset put it; offsets and sizes of SET/GET/MEMSET inside the tensor,
  COPY_TENSOR's source no larger than its destination.
* graphs (GRAPH_COMPUTE): ids unique and non-zero, nodes too; each tensor's sources and view
  source earlier in the tensor array (GGML's client sends a post-order DFS, so this holds for
  honest clients and rules out cycles and deep recursion); op ids lazyggml knows; node ids in the
  array. Our kernels do not check bounds, so a node whose shapes break its op's rule could read or
  write outside its tensors: every computed tensor is **rebuilt with lazyggml's own op
  constructor** (``contract.REBUILD``) from its decoded sources and ``op_params``, which raises on shapes
  or types the op does not take, and the result must have the wire's type, shape, strides, sources
  and view source. Each node that will run must be supported by the backend (``supports_op``) and
  have its result and sources in memory the backend can use.

Indices are data, known only when the graph runs (GET_ROWS, SET_ROWS, MUL_MAT_ID): the kernels
check them. The CPU's raise on an index out of range, which fails the compute and closes the
connection; CUDA's and OpenCL's ignore such a row (a zero row read, no row written), so a graph
never reaches memory outside its tensors on any device. A new buffer in device memory is cleared
before a client gets it: no client reads what another left there.
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import sys
import tempfile
from typing import NamedTuple

import numpy as np

from ... import ops
from ...buffer import Status, buft_alloc_buffer
from ...graph import Graph
from ...ops import EMPTY_OPS
from ...tensor import FLAG_COMPUTE, Context
from ...types import Op, Type, blck_size, type_size
from .contract import INPLACE, REBUILD
from .protocol import (ALLOC_REQ, CLEAR_REQ, CONN_CAPS, DEFAULT_PORT, HEADER, HELLO_REPLY, MEMSET_TAIL,
                       OP_FROM_GGML, RANGE, REPLIES, REQUEST_SIZE, SET_HEAD, TENSOR, TWO_U64, U8, U32, U64,
                       VERSION, Channel, Cmd, RPCError, WireTensor, fnv1a64, params_from_wire)

__all__ = ["RPCServer", "serve", "MAX_GRAPH_SIZE"]

log = logging.getLogger("lazyggml.rpc")

MAX_GRAPH_SIZE = 256 << 20    # bytes of one GRAPH_COMPUTE: ~900,000 tensors, far beyond any model's graph
MAX_RECORDS = 4096            # checked tensor records kept per connection (tensor_in_buffer)
_PAGE = 4096                  # made-up bases are aligned to this (or the buffer type's alignment, if larger)
_FIRST_BASE = 0x10000000000   # where a connection's made-up addresses start: any non-zero value would do
_ADDRESS_END = 1 << 64        # they must stay u64


def _runs(node):
    """Whether a backend computes ``node`` (GGML skips the empty ops, unselected nodes, empty tensors)."""
    return node.op not in EMPTY_OPS and node.flags & FLAG_COMPUTE and node.nelements() > 0


def _spans_its_elements(t):
    """Whether dims 0, 0-1, 0-2 and 0-3 of ``t`` each span at least the bytes their elements take
    packed: true of every packed tensor and of every view or permutation of one. Strides that
    overlap elements fail it; they would let a few bytes of buffer stand for a huge tensor (and as
    much work), and let a kernel that reads a row or a matrix whole run past the tensor's end."""
    if t.nelements() == 0:
        return True
    span = packed = type_size(t.type)
    for i, (n, nb) in enumerate(zip(t.ne, t.nb)):
        n = n // blck_size(t.type) if i == 0 else n
        span, packed = span + (n - 1) * nb, packed * n
        if span < packed:
            return False
    return True


class _Remote(NamedTuple):
    """A buffer as the peer knows it: the memory and its made-up base address (0 for a dummy)."""
    buffer: object
    base: int


# -- one connection ---------------------------------------------------------------------------------
class _Connection:
    """What one client allocated and computed, and the handling of each of its commands."""

    def __init__(self, server, sock, peer):
        self.server, self.sock, self.peer = server, sock, peer
        self.channel = None
        self.buffers = {}                 # handle -> _Remote
        self.graphs = {}                  # device index -> the Graph it last computed
        self.records = {}                 # tensor record -> its checked tensor (tensor_in_buffer)
        self.handles = itertools.count(1)
        self.next_base = _FIRST_BASE
        self.handlers = {
            Cmd.ALLOC_BUFFER: self.alloc_buffer, Cmd.GET_ALIGNMENT: self.get_alignment,
            Cmd.GET_MAX_SIZE: self.get_max_size, Cmd.BUFFER_GET_BASE: self.buffer_get_base,
            Cmd.FREE_BUFFER: self.free_buffer, Cmd.BUFFER_CLEAR: self.buffer_clear,
            Cmd.SET_TENSOR_HASH: self.set_tensor_hash, Cmd.GET_TENSOR: self.get_tensor,
            Cmd.COPY_TENSOR: self.copy_tensor, Cmd.GRAPH_COMPUTE: self.graph_compute,
            Cmd.GET_DEVICE_MEMORY: self.get_device_memory, Cmd.INIT_TENSOR: self.init_tensor,
            Cmd.GET_ALLOC_SIZE: self.get_alloc_size, Cmd.DEVICE_COUNT: self.device_count,
            Cmd.GRAPH_RECOMPUTE: self.graph_recompute, Cmd.MEMSET_TENSOR: self.memset_tensor,
        }

    def serve(self):
        """Serve until the peer leaves or breaks a rule; then free everything it allocated."""
        try:
            self.channel = Channel(self.sock, self.peer)
            head = self.next_header(self.server.timeout)
            if head is None:
                log.info("RPC client %s left without a command", self.peer)
                return
            if head != (Cmd.HELLO, REQUEST_SIZE[Cmd.HELLO]):
                raise RPCError(f"expected HELLO with {REQUEST_SIZE[Cmd.HELLO]} bytes, got command {head[0]} "
                               f"with {head[1]} (a client older than protocol 7?)")
            self.recv(REQUEST_SIZE[Cmd.HELLO])     # the client's transport caps: we speak plain TCP only
            self.channel.reply(HELLO_REPLY.pack(*VERSION, CONN_CAPS))
            while (head := self.next_header(None)) is not None:
                self.command(*head)
            log.info("RPC client %s closed the connection", self.peer)
        except RPCError as e:
            log.warning("RPC client %s: %s; connection closed", self.peer, e)
        except Exception as e:   # noqa: BLE001 - a kernel's failure must not take the server down
            log.warning("RPC client %s: %s: %s; connection closed", self.peer, type(e).__name__, e)
        finally:
            self.sock.close()
            for remote in self.buffers.values():
                remote.buffer.free()
            self.buffers.clear()
            self.graphs.clear()

    # -- framing ---------------------------------------------------------------------------------
    def next_header(self, idle_timeout):
        """The next command's (id, payload size), or None when the peer closed the connection between
        commands. The first byte may take ``idle_timeout`` seconds (None: forever), each later
        receive ``server.timeout``."""
        self.sock.settimeout(idle_timeout)
        try:
            first = self.sock.recv(1)
        except socket.timeout:
            raise RPCError(f"no command within {idle_timeout} s") from None
        except OSError:
            return None            # reset by the peer, or shut down by RPCServer.close
        if not first:
            return None
        self.sock.settimeout(self.server.timeout)
        return HEADER.unpack(first + self.recv(HEADER.size - 1))

    def recv(self, n):
        return self.channel.recv_exact(n, "receive")

    def command(self, cmd, size):
        try:
            cmd = Cmd(cmd)
        except ValueError:
            raise RPCError(f"unknown command {cmd}") from None
        if cmd == Cmd.HELLO:
            raise RPCError("a second HELLO")
        if cmd == Cmd.SET_TENSOR:   # reads its own payload: its size is checked against the target first
            self.set_tensor(size)
            return
        want = REQUEST_SIZE[cmd]
        if want is not None and size != want:
            raise RPCError(f"{cmd.name} of {size} bytes; it takes {want}")
        if cmd == Cmd.GRAPH_COMPUTE and not 12 <= size <= MAX_GRAPH_SIZE:
            raise RPCError(f"GRAPH_COMPUTE of {size} bytes; it takes 12 to {MAX_GRAPH_SIZE}")
        reply = self.handlers[cmd](self.recv(size))
        if cmd in REPLIES:
            self.channel.reply(reply)

    # -- devices, buffers, tensors: lookups that validate ------------------------------------------
    def device(self, index):
        if index >= len(self.server.devices):
            raise RPCError(f"device {index}: the server has {len(self.server.devices)}")
        return self.server.devices[index]

    def backend(self, index):
        self.device(index)
        return self.server.backends[index]

    def remote(self, handle):
        remote = self.buffers.get(handle)
        if remote is None:
            raise RPCError(f"unknown buffer handle {handle:#x}")
        return remote

    def tensor(self, ctx, w, view_src=None):
        """The wire tensor ``w`` as a tensor of ``ctx`` (a view of ``view_src`` when given) with the wire's
        type, shape and strides, placed at its ``data`` in its buffer, or without memory (buffer 0)."""
        try:
            type_ = Type(w.type)
        except ValueError:
            raise RPCError(f"tensor '{w.name}': unknown type id {w.type}") from None
        ne, nb = tuple(w.ne), tuple(w.nb)
        if ne[0] * ne[1] * ne[2] * ne[3] >= 1 << 63:
            raise RPCError(f"tensor '{w.name}': {list(ne)} has 2^63 elements or more")
        if blck_size(type_) > 1 and nb[0] != type_size(type_):
            raise RPCError(f"tensor '{w.name}': quantized blocks {nb[0]} bytes apart; they are {type_size(type_)}")
        # misaligned elements would fault a GPU (and have Numba compile kernels for unaligned arrays)
        align = type_size(type_) if blck_size(type_) == 1 else 2    # blocks: their fp16 fields
        if any(n % align for n in nb):
            raise RPCError(f"tensor '{w.name}': strides {list(nb)} are not multiples of {align}")
        if view_src is None:
            t = ctx.new_tensor(type_, ne)      # raises for ne[0] not a multiple of the block
            t.nb = nb
        else:
            t = ctx.view_tensor(view_src, ne, nb, w.view_offs)   # raises for a view outside its source
            if t.type != type_:
                raise RPCError(f"tensor '{w.name}': a {type_.name} view of a {t.type.name} tensor")
        if not _spans_its_elements(t):
            raise RPCError(f"tensor '{w.name}': strides {list(nb)} overlap the elements of {list(ne)}")
        t.name = w.name
        buffer = offset = None
        if w.buffer != 0:
            base, size = (remote := self.remote(w.buffer)).base, remote.buffer.size
            if not base <= w.data <= w.data + t.nbytes() <= base + size:
                raise RPCError(f"tensor '{w.name}': {t.nbytes()} bytes at {w.data:#x} are outside its buffer "
                               f"[{base:#x}, {base + size:#x})")
            if (w.data - base) % align:
                raise RPCError(f"tensor '{w.name}': data {w.data:#x} is not a multiple of {align}")
            buffer, offset = remote.buffer, w.data - base
        elif w.data != 0:
            raise RPCError(f"tensor '{w.name}': data {w.data:#x} without a buffer")
        self.place(t, buffer, offset)
        return t

    @staticmethod
    def place(t, buffer, offset):
        """Give ``t`` its memory; a view's must be where its source and offset put it."""
        root = t.view_src
        if root is not None and (buffer is not root.buffer or
                                 (offset is not None and offset != root.offset + t.view_offs)):
            raise RPCError(f"tensor '{t.name}': a view that is not where its source and offset put it")
        t.buffer, t.offset = buffer, offset

    def tensor_in_buffer(self, payload, at=0):
        """The tensor record at ``at`` of ``payload``, which must have memory (SET, GET, ...). A record
        seen before on this connection is the tensor checked then (``records``): a decode step
        uploads the same inputs every token, and checking a record costs ~45 µs."""
        rec = bytes(payload[at:at + TENSOR.size])
        t = self.records.get(rec)
        if t is None:
            t = self.tensor(Context(), WireTensor.unpack(rec))
            if t.buffer is None:
                raise RPCError(f"tensor '{t.name}' has no buffer")
            if len(self.records) >= MAX_RECORDS:
                self.records.clear()
            self.records[rec] = t
        return t

    @staticmethod
    def check_range(t, offset, size):
        if offset + size > t.nbytes():
            raise RPCError(f"{size} bytes at offset {offset} of tensor '{t.name}' ({t.nbytes()} bytes)")

    # -- the commands ------------------------------------------------------------------------------
    def device_count(self, payload):
        return U32.pack(len(self.server.devices))

    def get_alignment(self, payload):
        return U64.pack(self.device(U32.unpack(payload)[0]).get_buffer_type().get_alignment())

    def get_max_size(self, payload):
        return U64.pack(min(self.device(U32.unpack(payload)[0]).get_buffer_type().get_max_size(), _ADDRESS_END - 1))

    def get_device_memory(self, payload):
        free, total = self.device(U32.unpack(payload)[0]).memory()
        return TWO_U64.pack(free, total)

    def alloc_buffer(self, payload):
        index, size = ALLOC_REQ.unpack(payload)
        device = self.device(index)
        buft = device.get_buffer_type()
        align = max(_PAGE, buft.get_alignment())
        base = -(-self.next_base // align) * align
        total = device.memory()[1]
        # a request larger than the device is refused before trying: host memory is overcommitted,
        # so a terabyte of zeros would be "allocated" and the process killed when it is touched
        if size > buft.get_max_size() or (total and size > total) or base + size + _PAGE > _ADDRESS_END:
            log.info("RPC client %s: ALLOC_BUFFER of %d bytes on %s refused", self.peer, size, device.name)
            return TWO_U64.pack(0, 0)
        try:
            buffer = buft_alloc_buffer(buft, size)
        except (MemoryError, ValueError) as e:    # OutOfMemoryError is a MemoryError
            log.info("RPC client %s: ALLOC_BUFFER of %d bytes on %s failed: %s", self.peer, size, device.name, e)
            return TWO_U64.pack(0, 0)
        if size and not buffer.is_host():
            buffer.clear(0)   # device memory comes as the last user left it: no client reads another's
        handle = next(self.handles)
        if size:
            self.buffers[handle] = _Remote(buffer, base)
            self.next_base = base + size + _PAGE    # a gap: ranges never touch
        else:
            self.buffers[handle] = _Remote(buffer, 0)   # GGML's dummy buffer: no base
        return TWO_U64.pack(handle, buffer.size)

    def buffer_get_base(self, payload):
        return U64.pack(self.remote(U64.unpack(payload)[0]).base)

    def free_buffer(self, payload):
        handle = U64.unpack(payload)[0]
        self.remote(handle).buffer.free()
        del self.buffers[handle]
        self.graphs.clear()    # as GGML: a stored graph may use the buffer
        self.records.clear()   # and so may a checked record

    def buffer_clear(self, payload):
        handle, value = CLEAR_REQ.unpack(payload)
        self.remote(handle).buffer.clear(value)

    def set_tensor(self, size):
        head_size = TENSOR.size + SET_HEAD.size
        if size < head_size:
            raise RPCError(f"SET_TENSOR of {size} bytes; it takes at least {head_size}")
        head = self.recv(head_size)
        t = self.tensor_in_buffer(head)
        cache, offset = SET_HEAD.unpack_from(head, TENSOR.size)
        n = size - head_size
        self.check_range(t, offset, n)
        data = np.frombuffer(self.recv(n), np.uint8)
        if cache and self.server.cache_dir:
            self.server._cache_store(data)
        if n:
            t.buffer.set_tensor(t, data, offset, n)

    def set_tensor_hash(self, payload):
        t = self.tensor_in_buffer(payload)
        offset, hash_ = RANGE.unpack_from(payload, TENSOR.size)
        data = self.server._cache_load(hash_)
        # a blob that does not fit is not the one the client means: it sends the bytes instead
        if data is None or offset + data.size > t.nbytes():
            return U8.pack(0)
        if data.size:
            t.buffer.set_tensor(t, data, offset, data.size)
        return U8.pack(1)

    def get_tensor(self, payload):
        t = self.tensor_in_buffer(payload)
        offset, size = RANGE.unpack_from(payload, TENSOR.size)
        self.check_range(t, offset, size)
        return t.buffer.get_tensor(t, offset, size) if size else b""

    def memset_tensor(self, payload):
        t = self.tensor_in_buffer(payload)
        offset, size, value = MEMSET_TAIL.unpack_from(payload, TENSOR.size)
        self.check_range(t, offset, size)
        if size:
            t.buffer.memset_tensor(t, value, offset, size)

    def copy_tensor(self, payload):
        src, dst = self.tensor_in_buffer(payload), self.tensor_in_buffer(payload, TENSOR.size)
        self.check_range(dst, 0, src.nbytes())
        # False (another device's memory): GGML's client then copies through its host
        return U8.pack(1 if dst.buffer.cpy_tensor(src, dst) else 0)

    def init_tensor(self, payload):
        t = self.tensor_in_buffer(payload)
        if t.buffer.init_tensor(t) != Status.SUCCESS or t.extra is not None:
            raise RPCError(f"INIT_TENSOR of '{t.name}' failed")   # GGML's rule: extra data can't be served

    def get_alloc_size(self, payload):
        device = self.device(U32.unpack_from(payload)[0])
        # the sources that follow are not read: lazyggml's buffer types size a tensor by itself
        t = self.tensor(Context(), WireTensor.unpack(payload, 4))
        buft = device.get_buffer_type() if t.buffer is None else t.buffer.buft
        return U64.pack(buft.get_alloc_size(t))

    def graph_compute(self, payload):
        index, n_nodes = struct.unpack_from("<II", payload)
        backend = self.backend(index)
        at = 8 + 8 * n_nodes     # n_tensors, then the tensors
        if n_nodes == 0 or len(payload) < at + 4:
            raise RPCError(f"GRAPH_COMPUTE of {len(payload)} bytes with {n_nodes} nodes")
        node_ids = struct.unpack_from(f"<{n_nodes}Q", payload, 8)
        if len(set(node_ids)) != n_nodes:     # a node listed again would be computed again
            raise RPCError("GRAPH_COMPUTE lists a node twice")
        n_tensors = U32.unpack_from(payload, at)[0]
        if len(payload) != at + 4 + n_tensors * TENSOR.size:
            raise RPCError(f"GRAPH_COMPUTE of {len(payload)} bytes with {n_nodes} nodes and {n_tensors} tensors")
        ctx, tensors = Context(), {}
        for i in range(n_tensors):
            w = WireTensor.unpack(payload, at + 4 + i * TENSOR.size)
            if w.id == 0 or w.id in tensors:
                raise RPCError(f"graph tensor '{w.name}': id {w.id:#x} is 0 or repeated")
            tensors[w.id] = self.graph_tensor(ctx, w, tensors)
        g = Graph(n_nodes)
        for i in node_ids:
            node = tensors.get(i)
            if node is None:
                raise RPCError(f"graph node {i:#x} is not among the graph's tensors")
            if _runs(node):
                if not backend.supports_op(node):
                    raise RPCError(f"{backend.name} cannot compute {ops.node_desc(node)}")
                for x in (node, *(s for s in node.src if s is not None)):
                    if x.buffer is None or not backend.supports_buft(x.buffer.buft):
                        raise RPCError(f"{ops.node_desc(node)}: '{x.name}' is not in {backend.name}'s memory")
            g.add_node(node)
        self.compute(backend, g)
        self.graphs[index] = g

    def graph_tensor(self, ctx, w, seen):
        """One tensor of a graph; its sources and view source are among ``seen``, those before it."""
        def ref(i):
            if i and i not in seen:
                raise RPCError(f"graph tensor '{w.name}': source {i:#x} does not come before it")
            return seen.get(i)
        srcs, view_src = [ref(i) for i in w.src], ref(w.view_src)
        op = OP_FROM_GGML.get(w.op)
        if op is None:
            raise RPCError(f"graph tensor '{w.name}': op {w.op} is not one lazyggml computes")
        params = params_from_wire(op, w.op_params)
        if op in EMPTY_OPS:      # a leaf or a view: its memory as the wire places it
            if op != Op.NONE and view_src is None:
                raise RPCError(f"graph tensor '{w.name}': {op.name} without a view source")
            t = self.tensor(ctx, w, view_src)
            t.op, t.src, t.op_params = op, srcs, params
        else:
            t = self.tensor(ctx, w)
            r = REBUILD[op](srcs, params, t)
            if view_src is not None and r.view_src is None and op in INPLACE:
                inplace = ctx.view_tensor(srcs[0])   # GGML's *_inplace: the same node, viewing src[0]
                inplace.op, inplace.src, inplace.op_params = r.op, r.src, r.op_params
                r = inplace
            if r.view_src is not view_src or any(a is not b for a, b in zip(r.src, srcs)):
                raise RPCError(f"graph tensor '{w.name}': sources or view source are not those {op.name} takes")
            if (r.type, r.ne, r.nb) != (t.type, t.ne, t.nb):
                raise RPCError(f"graph tensor '{w.name}': {t.type.name}{list(t.ne)} strides {list(t.nb)}, but "
                               f"{ops.node_desc(r)} gives strides {list(r.nb)}")
            r.name = t.name
            self.place(r, t.buffer, t.offset)
            t = r
        t.flags = w.flags
        return t

    def graph_recompute(self, payload):
        index = U32.unpack(payload)[0]
        backend = self.backend(index)
        g = self.graphs.get(index)
        if g is None:
            raise RPCError(f"GRAPH_RECOMPUTE on device {index} without a stored graph")
        self.compute(backend, g)

    @staticmethod
    def compute(backend, g):
        status = backend.graph_compute(g)
        backend.synchronize()
        if status != Status.SUCCESS:
            raise RPCError(f"{backend.name}: graph compute failed ({Status(status).name})")


# -- the server ----------------------------------------------------------------------------------------
class RPCServer:
    """Serves ``devices`` (lazyggml devices: ``lg.dev_by_name("CPU")``, ``CUDA0``, ...) to GGML RPC
    clients on ``host:port`` (port 0: a free one; see ``port`` and ``endpoint``). It binds at once;
    ``serve_forever`` serves one connection at a time until ``close`` (from any thread). ``cache_dir``:
    where SET_TENSOR_HASH finds weights it was sent before (None: no cache); ``n_threads``: the CPU
    backend's threads. ``timeout``: the seconds a receive may wait before a HELLO and inside a message."""

    def __init__(self, devices, host="127.0.0.1", port=DEFAULT_PORT, cache_dir=None, n_threads=None,
                 *, timeout=60.0):
        self.devices = list(devices)
        if not self.devices:
            raise ValueError("RPCServer: no devices to serve")
        if n_threads is not None and n_threads < 1:
            raise ValueError(f"RPCServer: n_threads must be at least 1, got {n_threads}")
        self.backends = [d.init_backend() for d in self.devices]
        for d, b in zip(self.devices, self.backends):   # as GGML's server: through the registry, for a CPU
            set_n_threads = d.reg.get_proc_address("ggml_backend_set_n_threads") if d.reg else None
            if n_threads and set_n_threads:
                set_n_threads(b, n_threads)
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        if self.cache_dir:
            os.makedirs(self.cache_dir, exist_ok=True)
        self.timeout = timeout
        self.host = host
        self._closed = False
        self._client = None     # the socket being served, for close
        self._listener = socket.create_server((host, port), family=socket.AF_INET)
        self.port = self._listener.getsockname()[1]

    @property
    def endpoint(self):
        """``"host:port"``, as clients name this server."""
        return f"{self.host}:{self.port}"

    def serve_forever(self):
        """Accept and serve connections, one at a time, until ``close``."""
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                log.warning("RPC server %s: accept failed: %s", self.endpoint, e)
                continue
            self._client = sock
            if self._closed:   # close() ran between accept and here
                sock.close()
                return
            log.info("RPC client %s:%d connected", *addr)
            _Connection(self, sock, f"{addr[0]}:{addr[1]}").serve()
            self._client = None

    def close(self):
        """Stop: ``serve_forever`` returns once the connection being served (if any) is dropped."""
        self._closed = True
        for s in (self._listener, self._client):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)   # wakes a blocked accept or recv in the serving thread
                except OSError:
                    pass
        self._listener.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the cache of SET_TENSOR_HASH: a file per blob, named by its FNV-1a hash as GGML names it ----
    def _cache_load(self, hash_):
        """The cached blob of this hash as a ``uint8`` array, or None."""
        if not self.cache_dir:
            return None
        path = os.path.join(self.cache_dir, f"{hash_:016x}")
        return np.fromfile(path, np.uint8) if os.path.isfile(path) else None

    def _cache_store(self, data):
        """Keep ``data`` (a ``uint8`` array) under its hash, unless the cache holds it already."""
        path = os.path.join(self.cache_dir, f"{fnv1a64(data):016x}")
        if os.path.exists(path):
            return
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir)
        try:    # written aside and renamed: a blob in the cache is always whole
            with os.fdopen(fd, "wb") as f:
                f.write(memoryview(data))
            os.replace(tmp, path)
        except OSError as e:   # a full disk costs the cache, not the client
            log.warning("RPC cache %s: %s", self.cache_dir, e)
            if os.path.exists(tmp):
                os.remove(tmp)


def serve(devices, host="127.0.0.1", port=DEFAULT_PORT, cache_dir=None, n_threads=None):
    """``lazyggml rpc-server``: serve ``devices`` until interrupted, after GGML's banner on stdout
    (and, for a host other than 127.0.0.1, its warning on stderr: the protocol has no
    authentication)."""
    if host not in ("127.0.0.1", "localhost"):
        print(f"\nWARNING: host {host!r} is not 127.0.0.1: anyone who can reach this port can use the server's\n"
              f"         devices and memory. The RPC protocol has no authentication: never expose it to an\n"
              f"         open network.\n", file=sys.stderr)
    with RPCServer(devices, host, port, cache_dir, n_threads) as server:
        print(f"Starting RPC server v{'.'.join(map(str, VERSION))}")
        print(f"  endpoint       : {server.endpoint}")
        print(f"  local cache    : {server.cache_dir or 'n/a'}")
        print("Devices:")
        for d in server.devices:
            free, total = d.memory()
            print(f"  {d.name}: {d.description} ({total >> 20} MiB, {free >> 20} MiB free)")
        print("  transport      : TCP", flush=True)
        server.serve_forever()
