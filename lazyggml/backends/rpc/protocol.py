"""GGML's RPC protocol, version 7.0.0, as llama.cpp's ``ggml-rpc`` speaks it (the ggml that
llama-cpp-python 0.3.36 vendors): the wire format, shared by the client (``client.py``) and the
server (``server.py``). docs/distributed.md describes the protocol in full; the facts the code needs:

* **Framing.** A request is the command byte, its payload size (u64) and the payload; a reply, for
  the commands that have one (``REPLIES``), is its size (u64) and its payload. Everything is
  little-endian and packed (no padding anywhere). The first command of a connection is HELLO; a
  peer that breaks a rule is dropped, never answered with an error.
* **Tensors** travel as a 296-byte record (``TENSOR``): the client's id for it (any unique non-zero
  value, 0 = none), GGML's type id, the server's buffer handle, ``ne`` and ``nb`` as u32, GGML's op
  id and its sixteen int32 ``op_params``, flags, the ids of its sources and view source, the view
  offset, its address in the server's memory (``data``), its name and its use count.
* **Graphs** (GRAPH_COMPUTE): the device, the node ids in order, then every tensor they reach, each
  after its sources and view source (a post-order DFS, de-duplicated).

Op ids are GGML's, not ours (``types.Op`` numbers only what lazyggml has): ``GGML_OP`` maps them.
"""
from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass

import numpy as np
from numba import njit

from ...errors import LazyGGMLError
from ...ops import OP_DEFS, OP_PARAMS
from ...tensor import MAX_NAME, MAX_SRC
from ...types import Op

__all__ = ["VERSION", "DEFAULT_PORT", "Cmd", "REPLIES", "RPCError", "WireTensor", "TENSOR", "GGML_OP",
           "OP_FROM_GGML", "params_to_wire", "params_from_wire", "fnv1a64", "Channel", "parse_endpoint"]

VERSION = (7, 0, 0)
DEFAULT_PORT = 50052
CONN_CAPS = bytes(24)         # HELLO's transport capabilities: all zero = plain TCP (no RDMA)
HASH_THRESHOLD = 10 << 20     # GGML's client sends weights above this size by hash first
COMBINE_MAX = 64 << 10        # commands without a reply below this size are sent together (Channel.command)


class Cmd(enum.IntEnum):
    """GGML's ``enum rpc_cmd``."""
    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17


# the commands that get a reply; the others are fire-and-forget (the server answers the next
# command that has a reply only when they are done, which is how a client waits for a compute)
REPLIES = frozenset({Cmd.ALLOC_BUFFER, Cmd.GET_ALIGNMENT, Cmd.GET_MAX_SIZE, Cmd.BUFFER_GET_BASE,
                     Cmd.SET_TENSOR_HASH, Cmd.GET_TENSOR, Cmd.COPY_TENSOR, Cmd.GET_DEVICE_MEMORY,
                     Cmd.GET_ALLOC_SIZE, Cmd.HELLO, Cmd.DEVICE_COUNT})

HEADER = struct.Struct("<BQ")         # command, payload size
U8, U32, U64 = struct.Struct("<B"), struct.Struct("<I"), struct.Struct("<Q")
HELLO_REPLY = struct.Struct("<BBBx24s")
ALLOC_REQ = struct.Struct("<IQ")      # device, size
TWO_U64 = struct.Struct("<QQ")        # ALLOC_BUFFER's (handle, size); GET_DEVICE_MEMORY's (free, total)
CLEAR_REQ = struct.Struct("<QB")      # handle, byte
# id, type, buffer, ne[4], nb[4], op, op_params[16], flags, src[10], view_src, view_offs, data,
# name[64], use_count
TENSOR = struct.Struct(f"<QIQ4I4II16ii{MAX_SRC}QQQQ{MAX_NAME}si")
assert TENSOR.size == 296
RANGE = struct.Struct("<QQ")          # after a tensor: GET_TENSOR's (offset, size), SET_TENSOR_HASH's (offset, hash)
SET_HEAD = struct.Struct("<BQ")       # after a tensor: SET_TENSOR's (cache flag, offset), then the bytes
MEMSET_TAIL = struct.Struct("<QQB")   # after a tensor: offset, size, byte

# fixed request sizes (None: variable); a request of another size is a broken peer
REQUEST_SIZE = {Cmd.ALLOC_BUFFER: ALLOC_REQ.size, Cmd.GET_ALIGNMENT: 4, Cmd.GET_MAX_SIZE: 4,
                Cmd.BUFFER_GET_BASE: 8, Cmd.FREE_BUFFER: 8, Cmd.BUFFER_CLEAR: CLEAR_REQ.size,
                Cmd.SET_TENSOR: None, Cmd.SET_TENSOR_HASH: TENSOR.size + RANGE.size,
                Cmd.GET_TENSOR: TENSOR.size + RANGE.size, Cmd.COPY_TENSOR: 2 * TENSOR.size,
                Cmd.GRAPH_COMPUTE: None, Cmd.GET_DEVICE_MEMORY: 4, Cmd.INIT_TENSOR: TENSOR.size,
                Cmd.GET_ALLOC_SIZE: 4 + (1 + MAX_SRC) * TENSOR.size, Cmd.HELLO: len(CONN_CAPS),
                Cmd.DEVICE_COUNT: 0, Cmd.GRAPH_RECOMPUTE: 4,
                Cmd.MEMSET_TENSOR: TENSOR.size + MEMSET_TAIL.size}


class RPCError(LazyGGMLError, ConnectionError):
    """The RPC peer is unreachable, timed out, closed the connection or broke the protocol."""


# -- op ids: GGML's enum ggml_op, as each op's OpDef gives it
GGML_OP = {op: d.ggml_id for op, d in OP_DEFS.items()}   # (ops.OpDef.ggml_id)
OP_FROM_GGML = {v: k for k, v in GGML_OP.items()}


def _float_slots(params_type):
    """Which fields of an op's params ``NamedTuple`` are floats (their annotations, maybe strings)."""
    return tuple(str(getattr(a, "__forward_arg__", a)) in ("float", "np.float32")
                 for a in params_type.__annotations__.values())


_FLOATS = {op: _float_slots(p) for op, p in OP_PARAMS.items()}


def params_to_wire(op, params):
    """``op_params`` (a tuple in GGML's order) as GGML's sixteen int32 slots: ints as they are,
    floats as their float32 bits; VIEW's byte offset is a size_t, two slots."""
    slots = np.zeros(16, np.int32)
    if op == Op.VIEW:
        slots.view(np.int64)[0] = params[0]
        return slots
    for i, (v, is_float) in enumerate(zip(params, _FLOATS.get(op, ()))):
        slots[i] = np.float32(v).view(np.int32) if is_float else int(v)
    return slots


def params_from_wire(op, slots):
    """The inverse of ``params_to_wire``: the op's params tuple from sixteen int32 slots (the slots
    beyond the op's fields, e.g. M-RoPE's sections, are not read)."""
    slots = np.asarray(slots, np.int32)
    if op == Op.VIEW:
        return (int(slots[:2].view(np.int64)[0]),)
    return tuple(float(slots[i:i + 1].view(np.float32)[0]) if is_float else int(slots[i])
                 for i, is_float in enumerate(_FLOATS.get(op, ())))


@dataclass
class WireTensor:
    """One tensor record as it travels (``TENSOR``); ``op`` is GGML's id."""
    id: int
    type: int
    buffer: int
    ne: tuple
    nb: tuple
    op: int
    op_params: tuple   # 16 int32
    flags: int
    src: tuple         # MAX_SRC ids, 0 = none
    view_src: int
    view_offs: int
    data: int
    name: str
    use_count: int = 0

    def pack(self):
        return TENSOR.pack(self.id, self.type, self.buffer, *self.ne, *self.nb, self.op, *self.op_params,
                           self.flags, *self.src, self.view_src, self.view_offs, self.data,
                           self.name.encode("utf-8", "replace")[:MAX_NAME - 1], self.use_count)

    @classmethod
    def unpack(cls, buf, offset=0):
        f = TENSOR.unpack_from(buf, offset)
        name = f[32 + MAX_SRC].split(b"\0", 1)[0].decode("utf-8", "replace")
        return cls(f[0], f[1], f[2], f[3:7], f[7:11], f[11], f[12:28], f[28], f[29:29 + MAX_SRC],
                   f[29 + MAX_SRC], f[30 + MAX_SRC], f[31 + MAX_SRC], name, f[33 + MAX_SRC])


@njit(cache=True)
def _fnv1a64(data):
    h = np.uint64(0xCBF29CE484222325)
    for b in data:
        h = (h ^ np.uint64(b)) * np.uint64(0x100000001B3)
    return h


def fnv1a64(data):
    """GGML's RPC content hash: 64-bit FNV-1a over the bytes (SET_TENSOR_HASH's cache keys)."""
    return int(_fnv1a64(np.frombuffer(memoryview(data), np.uint8)))


def parse_endpoint(endpoint):
    """``"host:port"`` -> (host, port), split at the first ``:`` as GGML does (no IPv6 literals)."""
    host, sep, port = str(endpoint).partition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"RPC endpoint {endpoint!r}: expected host:port with a port in 1..65535")
    return host, int(port)


class Channel:
    """One TCP connection to or from a peer, with GGML's framing. Every failure (a closed peer, a
    timeout, a short read) is an ``RPCError`` naming the peer and what was being done."""

    def __init__(self, sock, peer):
        self.sock, self.peer = sock, peer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # what crossed the wire (docs/distributed.md's figures): bytes each way, and the commands
        # that waited for a reply (round trips)
        self.bytes_sent = self.bytes_received = self.round_trips = 0
        self.pending = bytearray()   # client commands held back to be sent together (``command``)

    @classmethod
    def connect(cls, endpoint, timeout):
        host, port = parse_endpoint(endpoint)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise RPCError(f"RPC server {endpoint}: cannot connect ({e.strerror or e})") from None
        return cls(sock, endpoint)

    def send(self, data, what):
        try:
            self.sock.sendall(data)
            self.bytes_sent += len(data)
        except OSError as e:
            raise RPCError(f"RPC peer {self.peer}: {what}: send failed ({e.strerror or e})") from None

    def recv_exact(self, n, what):
        """Exactly ``n`` bytes (a ``bytearray``)."""
        out = bytearray(n)
        view, got = memoryview(out), 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except socket.timeout:
                raise RPCError(f"RPC peer {self.peer}: {what}: no answer (timed out)") from None
            except OSError as e:
                raise RPCError(f"RPC peer {self.peer}: {what}: receive failed ({e.strerror or e})") from None
            if k == 0:   # a server drops a client whose message it refuses, and says why in its log
                raise RPCError(f"RPC peer {self.peer}: {what}: the connection was closed "
                               f"(a server closes it on a message it refuses or fails to compute: see its log)")
            got += k
        self.bytes_received += n
        return out

    # -- client side -----------------------------------------------------------------------------
    def command(self, cmd, payload=b"", reply_size=None):
        """Send ``cmd`` with ``payload``; for a command with a reply, receive it and check its size
        (``reply_size``; None: any, for GET_TENSOR's bytes).

        Small commands without a reply (a step's input uploads) are held back and go out with the
        next command that has a reply or starts a compute, in one send: a decode step is then two
        sends instead of seven, and on loopback each send cost ~20-40 µs of waking the server."""
        frame = HEADER.pack(cmd, len(payload))
        if len(payload) < COMBINE_MAX:
            self.pending += frame
            self.pending += payload
        else:                        # a large payload is sent as it is, not copied to be joined
            self.flush(cmd.name)
            self.send(frame, cmd.name)
            self.send(payload, cmd.name)
        if cmd not in REPLIES:
            if cmd in (Cmd.GRAPH_COMPUTE, Cmd.GRAPH_RECOMPUTE) or len(self.pending) >= COMBINE_MAX:
                self.flush(cmd.name)   # a compute starts now, not when its result is asked for
            return None
        self.flush(cmd.name)
        self.round_trips += 1
        size = U64.unpack(self.recv_exact(8, cmd.name))[0]
        if reply_size is not None and size != reply_size:
            raise RPCError(f"RPC peer {self.peer}: {cmd.name}: reply of {size} bytes, expected {reply_size}")
        return self.recv_exact(size, cmd.name)

    def flush(self, what):
        """Send the commands held back by ``command``."""
        if self.pending:
            data, self.pending = bytes(self.pending), bytearray()
            self.send(data, what)

    # -- server side -----------------------------------------------------------------------------
    def reply(self, payload):
        self.send(U64.pack(len(payload)) + bytes(payload), "reply")

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
