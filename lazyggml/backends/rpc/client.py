"""The RPC client: a device on another process or host, behind GGML's backend interface.

``add_server("host:port")`` connects to an RPC server (lazyggml's ``lazyggml rpc-server`` or
llama.cpp's ``ggml-rpc-server``), says HELLO and asks how many devices it serves: ``RPC0``,
``RPC1``, ... as GGML names them. Registered (``lg.rpc_add_server``, ``lg.rpc_device``), they make ``-ngl``/``--device``/``--tensor-split`` and the
scheduler treat them like local GPUs. The pieces are GGML's (ggml-rpc.cpp), in our words:

* ``RPCDevice``: a GPU-class device; its memory is the server's answer (GET_DEVICE_MEMORY).
* ``RPCBufferType``: alignment and maximum size asked once; ``alloc_buffer`` is ALLOC_BUFFER
  followed by BUFFER_GET_BASE, and tensors get GGML's addresses (``base + offset``) on the wire.
* ``RPCBuffer``: SET_TENSOR / GET_TENSOR / MEMSET_TENSOR / BUFFER_CLEAR / COPY_TENSOR / FREE_BUFFER.
  Weights above 10 MiB are offered by hash first (SET_TENSOR_HASH): a server with a cache that
  already holds them answers yes and the bytes never cross the wire.
* ``RPCBackend``: ``graph_compute`` sends the graph (GRAPH_COMPUTE, no reply: the server answers the
  next command with a reply, e.g. reading the logits, when it is done), each node checked first
  against its op's contract (``contract.py``): GGML's server does not check, and would compute a
  wrong answer. The same graph computed
  again with nothing moved (a decode step's) is GRAPH_RECOMPUTE: four bytes instead of the graph.

One TCP connection per server, shared by its devices; the server frees everything a connection
allocated when it closes, which is also what happens to a client that fails: any error of the
connection (refused, closed, timed out after ``timeout`` seconds) is an ``RPCError`` naming the
server, and the connection is closed so that the server lets go of the client's memory.
"""
from __future__ import annotations

import itertools
import weakref

import numpy as np

from ... import buffer as buffer_mod
from ...backend import Backend, Device, DeviceType, Registry
from ...buffer import Buffer, BufferType, BufferUsage
from ...errors import OutOfMemoryError
from ...ops import Op
from ...tensor import MAX_SRC
from ...types import is_quantized, type_name
from .contract import check_node
from .protocol import (ALLOC_REQ, CLEAR_REQ, GGML_OP, HASH_THRESHOLD, HELLO_REPLY, MEMSET_TAIL, RANGE,
                       SET_HEAD, TWO_U64, U8, U32, U64, VERSION, CONN_CAPS, Channel, Cmd, RPCError,
                       WireTensor, fnv1a64, params_to_wire)

__all__ = ["add_server", "RPCDevice", "RPCBackend", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 300.0   # seconds a reply may take: a long prompt on a slow server, not a dead one
HELLO_TIMEOUT = 30.0      # seconds the handshake may take
_U32_MAX = 2**32 - 1
_device_numbers = itertools.count()    # GGML's RPC<n>: one counter over every server of the process
_servers = {}                          # endpoint -> _Server


class _Server:
    """The connection to one server and what it told us; every command goes through ``command``,
    which closes the connection on the first failure (the server then frees our buffers)."""

    def __init__(self, endpoint, timeout):
        self.endpoint = endpoint
        self.registry = None                # its devices (add_server)
        # a server serves one client at a time (GGML's and ours): a busy one accepts the connection
        # and answers HELLO only when its client leaves, so the handshake waits less than a reply
        self.channel = Channel.connect(endpoint, min(timeout, HELLO_TIMEOUT))
        self.buffers = weakref.WeakSet()    # our live buffers there, emptied when the connection dies
        self.last_graph = {}                # device -> the key of the graph it holds (GRAPH_RECOMPUTE)
        self.pending_free = []              # handles of buffers garbage-collected since the last command
        try:
            hello = HELLO_REPLY.unpack(self.command(Cmd.HELLO, CONN_CAPS, HELLO_REPLY.size))
        except RPCError as e:
            raise RPCError(f"{e}; an RPC server serves one client at a time: is another one connected?") from None
        self.channel.sock.settimeout(timeout)
        major, minor, patch = hello[:3]
        if major != VERSION[0] or minor > VERSION[1]:   # GGML's rule: same major, no newer minor
            self.close()
            raise RPCError(f"RPC server {endpoint} speaks protocol {major}.{minor}.{patch}; "
                           f"lazyggml speaks {'.'.join(map(str, VERSION))}")
        self.n_devices = U32.unpack(self.command(Cmd.DEVICE_COUNT, b"", 4))[0]

    def command(self, cmd, payload=b"", reply_size=None):
        if self.channel is None:
            raise RPCError(f"RPC server {self.endpoint}: the connection was closed after an earlier error")
        try:
            while self.pending_free:        # sent here, not from __del__, which may run mid-command
                self.channel.command(Cmd.FREE_BUFFER, U64.pack(self.pending_free.pop()))
                self.last_graph.clear()
            return self.channel.command(cmd, payload, reply_size)
        except RPCError:
            self.close()
            raise

    def close(self):
        """Drop the connection: the server frees what it held for us; our buffers become empty."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        for b in list(self.buffers):
            b.size = 0
        if self.registry is not None:
            self.registry.devices.clear()   # a server that is gone lists no devices (lazyggml info, -ngl)
        _servers.pop(self.endpoint, None)
        buffer_mod.placement_changed()


def add_server(endpoint, timeout=DEFAULT_TIMEOUT):
    """A ``Registry`` of the devices an RPC server at ``"host:port"`` serves, connected (GGML's
    ``ggml_backend_rpc_add_server``; ``registry.rpc_add_server`` registers it); a second call for
    the same endpoint returns the same registry while its connection lives."""
    srv = _servers.get(endpoint)
    if srv is None:
        srv = _Server(endpoint, timeout)
        srv.registry = Registry(f"RPC[{endpoint}]", [RPCDevice(srv, i) for i in range(srv.n_devices)])
        _servers[endpoint] = srv
    return srv.registry


class RPCDevice(Device):
    """Device ``index`` of an RPC server, named ``RPC<n>`` with the endpoint as its description."""

    def __init__(self, server, index):
        super().__init__(f"RPC{next(_device_numbers)}", server.endpoint, DeviceType.GPU)
        self.server, self.index = server, index
        dev = U32.pack(index)
        alignment = U64.unpack(server.command(Cmd.GET_ALIGNMENT, dev, 8))[0]
        max_size = U64.unpack(server.command(Cmd.GET_MAX_SIZE, dev, 8))[0]
        self._buft = RPCBufferType(self, alignment, max_size)

    def memory(self):
        return TWO_U64.unpack(self.server.command(Cmd.GET_DEVICE_MEMORY, U32.pack(self.index), 16))

    def get_buffer_type(self):
        return self._buft

    def init_backend(self):
        return RPCBackend(self)


class RPCBufferType(BufferType):
    def __init__(self, device, alignment, max_size):
        super().__init__(f"{device.name}[{device.server.endpoint}]", device, alignment, max_size)
        self._alloc_sizes = {}

    def alloc_buffer(self, size):
        srv = self.device.server
        handle, got = TWO_U64.unpack(srv.command(Cmd.ALLOC_BUFFER, ALLOC_REQ.pack(self.device.index, size), 16))
        if handle == 0:
            raise OutOfMemoryError(f"{self.name}: the RPC server could not allocate {size} bytes")
        base = U64.unpack(srv.command(Cmd.BUFFER_GET_BASE, U64.pack(handle), 8))[0]
        return RPCBuffer(self, got, handle, base)

    def get_alloc_size(self, t):
        """GGML asks the server only where a device may pad: quantized rows not a multiple of 512
        (CUDA pads them) and the ops whose results a device may widen; else ``nbytes``."""
        if not (is_quantized(t.type) and t.ne[0] % 512 and t.view_src is None) and t.op not in _MAY_EXPAND:
            return t.nbytes()
        key = (t.type, t.ne, t.op, t.op_params)
        size = self._alloc_sizes.get(key)
        if size is None:
            srcs = b"".join(_wire(s, self.device.server).pack() if s is not None else bytes(296)
                            for s in t.src)
            payload = U32.pack(self.device.index) + _wire(t, self.device.server).pack() + srcs
            size = self._alloc_sizes[key] = U64.unpack(self.device.server.command(Cmd.GET_ALLOC_SIZE, payload, 8))[0]
        return max(size, t.nbytes())


_MAY_EXPAND = frozenset({Op.FLASH_ATTN_EXT, Op.MUL_MAT, Op.MUL_MAT_ID, Op.ARGSORT})


class RPCBuffer(Buffer):
    """A buffer in the server's memory: ``handle`` names it on the wire, ``base`` is its address
    there (a tensor at ``offset`` is at ``base + offset``)."""

    def __init__(self, buft, size, handle, base):
        super().__init__(buft, size)
        self.handle, self.base = handle, base
        self.server = buft.device.server
        self.server.buffers.add(self)

    def init_tensor(self, t):
        # a CUDA server zeroes the padding of quantized rows (see get_alloc_size)
        if is_quantized(t.type) and t.ne[0] % 512 and t.view_src is None and self.size:
            self.server.command(Cmd.INIT_TENSOR, _wire(t, self.server).pack())
        return buffer_mod.Status.SUCCESS

    def set_tensor(self, t, data, offset, size):
        head = _record(t, self.server)
        data = np.ascontiguousarray(data[:size])
        if self.usage == BufferUsage.WEIGHTS and size > HASH_THRESHOLD:
            found = self.server.command(Cmd.SET_TENSOR_HASH, head + RANGE.pack(offset, fnv1a64(data)), 1)
            if U8.unpack(found)[0]:
                return
            self.server.command(Cmd.SET_TENSOR, head + SET_HEAD.pack(1, offset) + memoryview(data))
            return
        self.server.command(Cmd.SET_TENSOR, head + SET_HEAD.pack(0, offset) + memoryview(data))

    def get_tensor(self, t, offset, size):
        out = self.server.command(Cmd.GET_TENSOR, _record(t, self.server) + RANGE.pack(offset, size), size)
        return np.frombuffer(out, np.uint8).copy() if size else np.zeros(0, np.uint8)

    def memset_tensor(self, t, value, offset, size):
        self.server.command(Cmd.MEMSET_TENSOR, _wire(t, self.server).pack() + MEMSET_TAIL.pack(offset, size, value))

    def cpy_tensor(self, src, dst):
        """A copy inside the same server (COPY_TENSOR); anything else goes through the host."""
        sbuf = src.data_buffer()
        if not isinstance(sbuf, RPCBuffer) or sbuf.server is not self.server:
            return False
        ok = self.server.command(Cmd.COPY_TENSOR, _wire(src, self.server).pack() + _wire(dst, self.server).pack(), 1)
        return bool(U8.unpack(ok)[0])

    def clear(self, value=0):
        if self.size:
            self.server.command(Cmd.BUFFER_CLEAR, CLEAR_REQ.pack(self.handle, value))

    def free(self):
        if self.size and self.server.channel is not None:
            self.server.command(Cmd.FREE_BUFFER, U64.pack(self.handle))
            self.server.last_graph.clear()     # the server forgets its graphs on FREE_BUFFER
        super().free()

    def __del__(self):
        if self.size and self.server.channel is not None:
            self.server.pending_free.append(self.handle)


class RPCBackend(Backend):
    """Computes graphs on the server's device."""

    def __init__(self, device):
        super().__init__(device)
        self.server = device.server

    def graph_compute(self, g):
        srv, dev = self.server, self.device.index
        key = (id(g), g.version, buffer_mod.placement_epoch)
        if srv.last_graph.get(dev) == key:
            srv.command(Cmd.GRAPH_RECOMPUTE, U32.pack(dev))
            return buffer_mod.Status.SUCCESS
        srv.command(Cmd.GRAPH_COMPUTE, serialize_graph(g, dev, srv))
        # the key as it stands now: the contract check made (and dropped) tensors, which counts as a move
        srv.last_graph[dev] = (id(g), g.version, buffer_mod.placement_epoch)
        return buffer_mod.Status.SUCCESS


_records = weakref.WeakKeyDictionary()   # tensor -> (placement epoch, its record): a step's inputs


def _record(t, server):
    """``_wire(t, server).pack()``, kept while nothing has moved: a decode step uploads the same
    input tensors every token, and packing a record costs ~20 µs."""
    hit = _records.get(t)
    if hit is not None and hit[0] == buffer_mod.placement_epoch and hit[1] is server:
        return hit[2]
    rec = _wire(t, server).pack()
    _records[t] = (buffer_mod.placement_epoch, server, rec)
    return rec


def _wire(t, server, use_count=0):
    """``t`` as a tensor record: its address only if it lives on ``server`` (GGML sends 0 for a
    tensor in another buffer; the server then refuses to touch it)."""
    buf = t.data_buffer()
    handle = data = 0
    if isinstance(buf, RPCBuffer) and buf.server is server and t.offset is not None:
        handle, data = buf.handle, buf.base + t.offset
    if any(n > _U32_MAX for n in t.ne) or any(n > _U32_MAX for n in t.nb):
        raise ValueError(f"RPC: tensor {t.label} {type_name(t.type)}{list(t.ne)} has a size or stride "
                         f"above 2^32-1, which GGML's RPC protocol cannot carry")
    return WireTensor(id(t), int(t.type), handle, tuple(t.ne), tuple(t.nb), GGML_OP[t.op],
                      tuple(params_to_wire(t.op, t.op_params)), t.flags,
                      tuple(0 if s is None else id(s) for s in t.src[:MAX_SRC]),
                      0 if t.view_src is None else id(t.view_src), t.view_offs, data, t.name, use_count)


def serialize_graph(g, device, server):
    """GRAPH_COMPUTE's payload: the device, the node ids in order, then every tensor the nodes reach,
    each after its sources and its view source (GGML's post-order, de-duplicated). Each node is first
    checked against its op's contract (``contract.check_node``): the server may be GGML's, which
    computes whatever arrives."""
    seen, order = set(), []
    for node in g.nodes:
        check_node(node)
        stack = [(node, False)]
        while stack:
            t, expanded = stack.pop()
            if id(t) in seen:
                continue
            if expanded:
                seen.add(id(t))
                order.append(t)
                continue
            stack.append((t, True))
            children = [s for s in t.src if s is not None] + ([t.view_src] if t.view_src is not None else [])
            stack.extend((s, False) for s in reversed(children) if id(s) not in seen)
    parts = [U32.pack(device), U32.pack(len(g.nodes)), b"".join(U64.pack(id(n)) for n in g.nodes),
             U32.pack(len(order))]
    parts += [_wire(t, server, g.use_count(t)).pack() for t in order]
    return b"".join(parts)

