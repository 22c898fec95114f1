"""The RPC server (lazyggml/backends/rpc/server.py) through raw sockets: every command of protocol
7.0.0 as llama.cpp's client sends it, a graph computed remotely giving the bytes of a local
compute, the weight cache, and hostile peers: after each violation the server must have closed that
connection and must serve the next client as before. A seeded fuzz test mutates valid messages
and checks that the server never dies, hangs or writes outside the buffers a message names.

The client here is deliberately raw (``Peer``: protocol.py's framing and records, nothing of
client.py), so that the bytes on the wire are exactly the ones written in each test.
"""
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

import lazyggml as lg
from lazyggml.backends.rpc.protocol import (ALLOC_REQ, CLEAR_REQ, CONN_CAPS, GGML_OP, HEADER, HELLO_REPLY,
                                            MEMSET_TAIL, RANGE, SET_HEAD, TENSOR, TWO_U64, U8, U32, U64, Channel,
                                            Cmd, RPCError, WireTensor, fnv1a64, params_to_wire)
from lazyggml.backends.rpc.server import RPCServer
from lazyggml.tensor import contiguous_strides
from lazyggml.testing import StandInDevice

WAIT = 20.0    # seconds any reply or close may take before the test calls it a hang
F32, I32 = int(lg.F32), int(lg.I32)


# -- a raw client -------------------------------------------------------------------------------------
class Peer:
    """One connection to the server, speaking the protocol byte by byte."""

    def __init__(self, server, hello=True):
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
        self.ch = Channel(self.sock, server.endpoint)
        self.ids = iter(range(1, 1 << 30))
        if hello:
            assert self.hello()[:3] == (7, 0, 0)

    def raw(self, cmd, payload=b"", size=None):
        """Send a command with any payload and any announced size (after those ``call`` held back)."""
        self.ch.flush("raw")
        self.sock.sendall(HEADER.pack(cmd, len(payload) if size is None else size) + bytes(payload))

    def call(self, cmd, payload=b"", reply_size=None):
        return self.ch.command(cmd, payload, reply_size)

    def hello(self):
        return HELLO_REPLY.unpack(self.call(Cmd.HELLO, CONN_CAPS, HELLO_REPLY.size))

    def alloc(self, size, device=0):
        """(handle, base) of a new buffer."""
        handle, got = TWO_U64.unpack(self.call(Cmd.ALLOC_BUFFER, ALLOC_REQ.pack(device, size), 16))
        assert handle and got == size
        return handle, U64.unpack(self.call(Cmd.BUFFER_GET_BASE, U64.pack(handle), 8))[0]

    def tensor(self, type_, ne, handle=0, data=0, nb=None, op=0, params=(0,) * 16, src=(), view_src=0,
               view_offs=0, flags=0, name="", id_=None):
        ne = tuple(ne) + (1,) * (4 - len(ne))
        if nb is None:
            nb = contiguous_strides(lg.Type(type_), ne)
        return WireTensor(next(self.ids) if id_ is None else id_, type_, handle, ne, tuple(nb), op,
                          tuple(params), flags, tuple(src) + (0,) * (10 - len(src)), view_src, view_offs,
                          data, name)

    def set(self, w, data, offset=0, cache=0):
        self.call(Cmd.SET_TENSOR, w.pack() + SET_HEAD.pack(cache, offset) + bytes(data))

    def get(self, w, offset=0, size=None):
        size = nbytes(w) - offset if size is None else size
        return bytes(self.call(Cmd.GET_TENSOR, w.pack() + RANGE.pack(offset, size), size))

    def closed_by_server(self):
        """True when the server has closed this connection (EOF or reset); False if it still waits."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False

    def close(self):
        self.ch.close()


def nbytes(w):
    t = lg.Context().new_tensor(lg.Type(w.type), w.ne)
    t.nb = w.nb
    return t.nbytes()


def graph_payload(node_ids, tensors, device=0):
    """GRAPH_COMPUTE's payload: device, node ids, tensors."""
    return (struct.pack(f"<II{len(node_ids)}Q", device, len(node_ids), *node_ids) + U32.pack(len(tensors))
            + b"".join(w.pack() for w in tensors))


# -- the server under test: in a thread of this process, on a free port --------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # device 1 is a deferred stand-in GPU: its backend computes only when synchronized, so a reply
    # that came before the server synchronized would show stale bytes
    s = RPCServer([lg.dev_by_name("CPU"), StandInDevice("SI0", deferred=True)], port=0,
                  cache_dir=tmp_path_factory.mktemp("rpc-cache"), n_threads=2, timeout=5.0)
    thread = threading.Thread(target=s.serve_forever, daemon=True)
    thread.start()
    yield s
    s.close()
    thread.join(WAIT)
    assert not thread.is_alive()


@pytest.fixture
def peer(server):
    """Opens connections to the server; each is closed at the end of the test (the server serves one
    connection at a time, so one left open would keep every later test waiting)."""
    opened = []

    def open_(hello=True):
        p = Peer(server, hello)
        opened.append(p)
        return p
    yield open_
    for p in opened:
        p.close()


def assert_serves(server):
    """A fresh client gets its bytes back: the server is alive and well."""
    p = Peer(server)
    try:
        h, base = p.alloc(256)
        w = p.tensor(F32, (64,), h, base)
        x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
        p.set(w, x.tobytes())
        assert p.get(w) == x.tobytes()
    finally:
        p.close()


# -- every command, honestly -----------------------------------------------------------------------------
def test_hello_and_device_queries(server, peer):
    p = peer(hello=False)
    p.raw(Cmd.HELLO, CONN_CAPS)
    assert U64.unpack(p.ch.recv_exact(8, "size"))[0] == 28
    assert bytes(p.ch.recv_exact(28, "hello")) == bytes([7, 0, 0, 0]) + bytes(24)
    p.raw(Cmd.DEVICE_COUNT)    # the wire: 0x0F and a zero size, as GGML's client sends it
    assert U64.unpack(p.ch.recv_exact(8, "size"))[0] == 4 and U32.unpack(p.ch.recv_exact(4, "n"))[0] == 2
    assert U64.unpack(p.call(Cmd.GET_ALIGNMENT, U32.pack(0), 8))[0] == 32
    assert U64.unpack(p.call(Cmd.GET_MAX_SIZE, U32.pack(0), 8))[0] == 2**64 - 1
    free, total = TWO_U64.unpack(p.call(Cmd.GET_DEVICE_MEMORY, U32.pack(0), 16))
    assert 0 < free <= total
    w = p.tensor(int(lg.Q4_K), (512, 3))
    payload = U32.pack(0) + w.pack() + bytes(10 * TENSOR.size)
    assert U64.unpack(p.call(Cmd.GET_ALLOC_SIZE, payload, 8))[0] == 3 * 2 * 144


def test_buffers_and_tensors_round_trip(server, peer):
    rng = np.random.default_rng(1)
    p = peer()
    (h1, b1), (h2, b2) = p.alloc(10000), p.alloc(9000)
    assert h1 != h2 and b1 and b2 and b1 % 4096 == 0 and b2 % 4096 == 0
    assert b1 + 10000 <= b2 or b2 + 9000 <= b1       # distinct ranges
    zero, size = TWO_U64.unpack(p.call(Cmd.ALLOC_BUFFER, ALLOC_REQ.pack(0, 0), 16))
    assert zero and size == 0 and U64.unpack(p.call(Cmd.BUFFER_GET_BASE, U64.pack(zero), 8))[0] == 0

    a = p.tensor(F32, (100, 20), h1, b1 + 64)
    x = rng.integers(0, 256, nbytes(a), dtype=np.uint8)
    p.set(a, x)
    assert p.get(a) == x.tobytes()
    p.set(a, b"\x07" * 40, offset=400)                         # part of it
    x[400:440] = 7
    assert p.get(a, 396, 48) == x[396:444].tobytes()
    p.call(Cmd.MEMSET_TENSOR, a.pack() + MEMSET_TAIL.pack(1000, 24, 0xAB))
    x[1000:1024] = 0xAB
    assert p.get(a) == x.tobytes()
    p.call(Cmd.INIT_TENSOR, a.pack())                          # nothing to do on the CPU, but accepted
    assert p.get(a) == x.tobytes()

    c = p.tensor(F32, (100, 20), h2, b2 + 32)                  # COPY_TENSOR from buffer 1 to buffer 2
    assert p.call(Cmd.COPY_TENSOR, a.pack() + c.pack(), 1) == U8.pack(1)
    assert p.get(c) == x.tobytes()

    p.call(Cmd.BUFFER_CLEAR, CLEAR_REQ.pack(h1, 0x5A))
    assert p.get(a) == b"\x5a" * nbytes(a) and p.get(c) == x.tobytes()
    p.call(Cmd.FREE_BUFFER, U64.pack(h1))
    assert p.get(c) == x.tobytes()


def test_a_second_device(server, peer):
    """Device 1's buffers are its own: a copy from the CPU's is refused with 0 (GGML's client then
    copies through its host), and a graph on device 1 is synchronized before the next reply."""
    p = peer()
    (hc, bc), (hs, bs) = p.alloc(256), p.alloc(256, device=1)
    a, b = p.tensor(F32, (8,), hc, bc), p.tensor(F32, (8,), hs, bs)
    x = np.arange(8, dtype=np.float32)
    p.set(a, x.tobytes())
    p.set(b, x.tobytes())
    assert p.call(Cmd.COPY_TENSOR, a.pack() + b.pack(), 1) == U8.pack(0)
    src = p.tensor(F32, (8,), hs, bs)
    out = p.tensor(F32, (8,), hs, bs + 64, op=GGML_OP[lg.Op.SCALE], src=(src.id,), flags=lg.FLAG_COMPUTE,
                   params=params_to_wire(lg.Op.SCALE, (3.0, 1.0)))
    p.call(Cmd.GRAPH_COMPUTE, graph_payload([out.id], [src, out], device=1))
    assert np.frombuffer(p.get(out), np.float32).tolist() == (x * 3 + 1).tolist()


# -- a graph: remote bytes = local bytes ---------------------------------------------------------------------
def _small_model(rng):
    """A little of everything a transformer layer does, on quantized and float weights; the
    tensors live in host memory (for the local reference)."""
    ctx = lg.Context(no_alloc=False)
    x, pos, bias = ctx.new_tensor_2d(lg.F32, 256, 4), ctx.new_tensor_1d(lg.I32, 4), ctx.new_tensor_1d(lg.F32, 32)
    wq, w8 = ctx.new_tensor_2d(lg.Q4_K, 256, 32), ctx.new_tensor_2d(lg.Q8_0, 32, 32)
    lg.tensor_set(x, rng.standard_normal((4, 256)).astype(np.float32))
    lg.tensor_set(pos, np.array([0, 1, 2, 5], np.int32))
    lg.tensor_set(bias, rng.standard_normal(32).astype(np.float32))
    lg.tensor_set(wq, lg.quantize(lg.Q4_K, rng.standard_normal((32, 256)).astype(np.float32)))
    lg.tensor_set(w8, lg.quantize(lg.Q8_0, rng.standard_normal((32, 32)).astype(np.float32)))
    h = lg.rms_norm(lg.mul_mat(w8, lg.mul_mat(wq, x)), 1e-6)
    h = lg.rope_ext(lg.reshape_3d(h, 8, 4, 4), pos, None, 8, lg.ROPE_TYPE_NEOX, freq_base=10000.0)
    h = lg.scale_inplace(lg.soft_max_ext(lg.reshape_2d(h, 32, 4), None, 0.5), 3.0)   # in place: a view on the wire
    out = lg.add(h, bias)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    return g, x, out


def _send_graph(p, g, alignment=32):
    """GGML's client, in short: every tensor the nodes reach in post-order DFS (sources, view source,
    the tensor), each non-view placed in one server buffer, views at their root's place plus their
    offset; the leafs' bytes uploaded; returns the GRAPH_COMPUTE payload and the wire of each tensor."""
    order, seen = [], set()

    def add(t):
        if id(t) not in seen:
            seen.add(id(t))
            for s in t.src:
                if s is not None:
                    add(s)
            if t.view_src is not None:
                add(t.view_src)
            order.append(t)
    for n in g.nodes:
        add(n)
    offsets, end = {}, 0
    for t in order:
        if t.view_src is None:
            offsets[id(t)], end = end, -(-(end + t.nbytes()) // alignment) * alignment
    handle, base = p.alloc(end)
    wires = {}
    for t in order:
        off = offsets[id(t.view_src)] + t.view_offs if t.view_src is not None else offsets[id(t)]
        wires[id(t)] = p.tensor(int(t.type), t.ne, handle, base + off, t.nb, GGML_OP[t.op],
                                params_to_wire(t.op, t.op_params), [id(s) if s is not None else 0 for s in t.src],
                                id(t.view_src) if t.view_src is not None else 0, t.view_offs, t.flags, t.name, id(t))
        if t.op == lg.Op.NONE:
            p.set(wires[id(t)], lg.tensor_get_bytes(t))
    return graph_payload([id(n) for n in g.nodes], [wires[id(t)] for t in order]), wires


def test_graph_compute_gives_the_local_bytes_and_recompute(server, peer):
    rng = np.random.default_rng(2)
    g, x, out = _small_model(rng)
    p = peer()
    payload, wires = _send_graph(p, g)
    p.call(Cmd.GRAPH_COMPUTE, payload)
    cpu = lg.backend_cpu_init()
    lg.backend_graph_compute(cpu, g)
    assert p.get(wires[id(out)]) == lg.tensor_get_bytes(out).tobytes()

    x_new = rng.standard_normal((4, 256)).astype(np.float32)    # new input, the stored graph again
    lg.tensor_set(x, x_new)
    p.set(wires[id(x)], x_new.tobytes())
    p.call(Cmd.GRAPH_RECOMPUTE, U32.pack(0))
    lg.backend_graph_compute(cpu, g)
    assert p.get(wires[id(out)]) == lg.tensor_get_bytes(out).tobytes()


def test_set_tensor_hash_and_the_cache(server, peer):
    blob = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    h = fnv1a64(blob)
    p = peer()
    handle, base = p.alloc(8192)
    w = p.tensor(int(lg.I8), (4096,), handle, base + 4096)
    assert p.call(Cmd.SET_TENSOR_HASH, w.pack() + RANGE.pack(0, h), 1) == U8.pack(0)     # a miss
    p.set(w, blob, cache=1)
    assert p.get(w) == blob.tobytes()                   # (a reply: the SET_TENSOR before it is done)
    assert (server.cache_dir and open(os.path.join(server.cache_dir, f"{h:016x}"), "rb").read() == blob.tobytes())
    p.close()
    p = peer()                                          # a new connection, a new buffer: a hit
    handle, base = p.alloc(4096)
    w = p.tensor(int(lg.I8), (4096,), handle, base)
    assert p.call(Cmd.SET_TENSOR_HASH, w.pack() + RANGE.pack(0, h), 1) == U8.pack(1)
    assert p.get(w) == blob.tobytes()
    half = p.tensor(int(lg.I8), (2048,), handle, base)     # a blob that does not fit is a miss
    assert p.call(Cmd.SET_TENSOR_HASH, half.pack() + RANGE.pack(0, h), 1) == U8.pack(0)


# -- hostile peers: each case breaks one rule; the server must drop it and go on ----------------------------
def _buffer(p, size=4096):
    handle, base = p.alloc(size)
    return handle, base


def _mm_graph(p, handle, base, a_ne0=8, out_ne=(4, 2), at=None):
    """A mul_mat a [a_ne0, 4] x b [8, 2] in one buffer: the tensors (a, b, out), out at ``at``."""
    a = p.tensor(F32, (a_ne0, 4), handle, base)
    b = p.tensor(F32, (8, 2), handle, base + 256)
    out = p.tensor(F32, out_ne, handle, base + 512 if at is None else at, op=GGML_OP[lg.Op.MUL_MAT],
                   src=(a.id, b.id), flags=lg.FLAG_COMPUTE)
    return a, b, out


def _graph(p, tensors, nodes=None):
    p.raw(Cmd.GRAPH_COMPUTE, graph_payload([t.id for t in tensors[-1:]] if nodes is None else nodes, tensors))


def _one_node(p, op, ne, at=64, view=False, params=(0,) * 16):
    """A graph of a [8] F32 and one node of ``op`` on it, ``at`` bytes further, a view of a or not."""
    handle, base = _buffer(p)
    a = p.tensor(F32, (8,), handle, base)
    node = p.tensor(F32, ne, handle, base + at, op=GGML_OP[op], src=(a.id,), view_src=a.id if view else 0,
                    params=params, flags=lg.FLAG_COMPUTE)
    _graph(p, [a, node])


def _replace(w, **kw):
    return WireTensor(**{**w.__dict__, **kw})


HOSTILE = {
    # framing
    "not HELLO first": lambda p: p.raw(Cmd.DEVICE_COUNT),
    "HELLO of the wrong size": lambda p: p.raw(Cmd.HELLO, b""),
    "a second HELLO": lambda p: p.raw(Cmd.HELLO, CONN_CAPS),
    "a fixed size too long": lambda p: p.raw(Cmd.GET_ALIGNMENT, bytes(8)),
    "DEVICE_COUNT with a payload": lambda p: p.raw(Cmd.DEVICE_COUNT, bytes(4)),
    "command 18 (NONE)": lambda p: p.raw(18),
    "command 19": lambda p: p.raw(19, bytes(4)),
    "command 255": lambda p: p.raw(255),
    "SET_TENSOR shorter than its header": lambda p: p.raw(Cmd.SET_TENSOR, bytes(300)),
    "a 300 MiB graph announced": lambda p: p.raw(Cmd.GRAPH_COMPUTE, size=300 << 20),
    # devices and buffers
    "device out of range": lambda p: p.raw(Cmd.GET_ALIGNMENT, U32.pack(2)),
    "ALLOC_BUFFER on device 9": lambda p: p.raw(Cmd.ALLOC_BUFFER, ALLOC_REQ.pack(9, 64)),
    "unknown buffer handle": lambda p: p.raw(Cmd.BUFFER_GET_BASE, U64.pack(12345)),
    "FREE_BUFFER of an unknown handle": lambda p: p.raw(Cmd.FREE_BUFFER, U64.pack(77)),
    "a freed handle": lambda p: (p.call(Cmd.FREE_BUFFER, U64.pack(h := _buffer(p)[0])),
                                 p.raw(Cmd.BUFFER_CLEAR, CLEAR_REQ.pack(h, 1))),
    "GRAPH_RECOMPUTE without a graph": lambda p: p.raw(Cmd.GRAPH_RECOMPUTE, U32.pack(0)),
    # tensors
    "tensor in an unknown buffer": lambda p: p.raw(Cmd.GET_TENSOR, p.tensor(F32, (4,), 999, 4096).pack()
                                                   + RANGE.pack(0, 16)),
    "tensor below its buffer's base": lambda p: (hb := _buffer(p), p.raw(
        Cmd.GET_TENSOR, p.tensor(F32, (4,), hb[0], hb[1] - 16).pack() + RANGE.pack(0, 16))),
    "tensor past its buffer's end": lambda p: (hb := _buffer(p), p.raw(
        Cmd.MEMSET_TENSOR, p.tensor(F32, (4,), hb[0], hb[1] + 4096 - 12).pack() + MEMSET_TAIL.pack(0, 4, 0))),
    "data without a buffer": lambda p: p.raw(Cmd.INIT_TENSOR, p.tensor(F32, (4,), 0, 4096).pack()),
    "huge ne": lambda p: (hb := _buffer(p), p.raw(Cmd.GET_TENSOR, p.tensor(
        F32, (2**32 - 1,) * 4, hb[0], hb[1], nb=(4, 16, 16, 16)).pack() + RANGE.pack(0, 4))),
    "huge nb": lambda p: (hb := _buffer(p), p.raw(Cmd.GET_TENSOR, p.tensor(
        F32, (4, 2), hb[0], hb[1], nb=(4, 2**32 - 1, 0, 0)).pack() + RANGE.pack(0, 4))),
    "zero strides under a huge shape": lambda p: (hb := _buffer(p), p.raw(Cmd.GET_TENSOR, p.tensor(
        F32, (4, 2**31), hb[0], hb[1], nb=(4, 0, 0, 0)).pack() + RANGE.pack(0, 4))),
    "strides that overlap elements": lambda p: (hb := _buffer(p), p.raw(Cmd.SET_TENSOR, p.tensor(
        F32, (4, 2), *hb, nb=(2, 8, 16, 16)).pack() + SET_HEAD.pack(0, 0) + bytes(4))),
    "misaligned data": lambda p: (hb := _buffer(p), p.raw(
        Cmd.GET_TENSOR, p.tensor(F32, (4,), hb[0], hb[1] + 2).pack() + RANGE.pack(0, 4))),
    "misaligned strides": lambda p: (hb := _buffer(p), p.raw(
        Cmd.GET_TENSOR, p.tensor(F32, (2, 2), *hb, nb=(4, 10, 20, 20)).pack() + RANGE.pack(0, 4))),
    "unknown type id": lambda p: (hb := _buffer(p), p.raw(Cmd.GET_TENSOR, WireTensor(
        1, 4, hb[0], (4, 1, 1, 1), (4, 16, 16, 16), 0, (0,) * 16, 0, (0,) * 10, 0, 0, hb[1], "").pack()
        + RANGE.pack(0, 4))),
    "ne0 not a multiple of the block": lambda p: (hb := _buffer(p), p.raw(Cmd.GET_TENSOR, WireTensor(
        1, int(lg.Q8_0), hb[0], (31, 1, 1, 1), (34, 34, 34, 34), 0, (0,) * 16, 0, (0,) * 10, 0, 0, hb[1],
        "").pack() + RANGE.pack(0, 4))),
    "GET past the tensor": lambda p: (hb := _buffer(p), p.raw(
        Cmd.GET_TENSOR, p.tensor(F32, (4,), *hb).pack() + RANGE.pack(16, 1))),
    "GET larger than the tensor": lambda p: (hb := _buffer(p), p.raw(
        Cmd.GET_TENSOR, p.tensor(F32, (4,), *hb).pack() + RANGE.pack(0, 17))),
    "GET at offset 2^64-1": lambda p: (hb := _buffer(p), p.raw(
        Cmd.GET_TENSOR, p.tensor(F32, (4,), *hb).pack() + RANGE.pack(2**64 - 1, 1))),
    "SET more bytes than the tensor": lambda p: (hb := _buffer(p), p.raw(
        Cmd.SET_TENSOR, p.tensor(F32, (4,), *hb).pack() + SET_HEAD.pack(0, 0) + bytes(20))),
    "SET announcing 1 GiB": lambda p: (hb := _buffer(p), p.raw(
        Cmd.SET_TENSOR, p.tensor(F32, (4,), *hb).pack() + SET_HEAD.pack(0, 0), size=1 << 30)),
    "MEMSET past the tensor": lambda p: (hb := _buffer(p), p.raw(
        Cmd.MEMSET_TENSOR, p.tensor(F32, (4,), *hb).pack() + MEMSET_TAIL.pack(8, 9, 0))),
    "COPY into a smaller tensor": lambda p: (hb := _buffer(p), p.raw(
        Cmd.COPY_TENSOR, p.tensor(F32, (8,), *hb).pack() + p.tensor(F32, (4,), hb[0], hb[1] + 4096 - 16).pack())),
    "SET_TENSOR_HASH outside the buffer": lambda p: (hb := _buffer(p), p.raw(
        Cmd.SET_TENSOR_HASH, p.tensor(F32, (4,), hb[0], hb[1] + 4096).pack() + RANGE.pack(0, 1))),
    # graphs
    "graph: n_nodes beyond the payload": lambda p: p.raw(Cmd.GRAPH_COMPUTE, struct.pack("<IIQI", 0, 1000, 1, 0)),
    "graph: n_tensors beyond the payload": lambda p: (hb := _buffer(p), p.raw(Cmd.GRAPH_COMPUTE, graph_payload(
        [3], _mm_graph(p, *hb))[:-TENSOR.size])),
    "graph: no nodes": lambda p: (hb := _buffer(p), _graph(p, _mm_graph(p, *hb), nodes=[])),
    "graph: a node not in the array": lambda p: (hb := _buffer(p), _graph(p, _mm_graph(p, *hb), nodes=[42])),
    "graph: a node listed twice": lambda p: (hb := _buffer(p), t := _mm_graph(p, *hb),
                                            _graph(p, t, nodes=[t[2].id, t[2].id])),
    "graph: an unknown op": lambda p: (hb := _buffer(p), t := _mm_graph(p, *hb),
                                       _graph(p, [*t[:2], _replace(t[2], op=3)])),     # GGML's ADD_ID
    "graph: op id 2^32-1": lambda p: (hb := _buffer(p), t := _mm_graph(p, *hb),
                                      _graph(p, [*t[:2], _replace(t[2], op=2**32 - 1)])),
    "graph: a source after its user (a cycle)": lambda p: (
        hb := _buffer(p), t := _mm_graph(p, *hb), _graph(p, [_replace(t[0], src=(t[2].id,) + (0,) * 9), *t[1:]])),
    "graph: a repeated id": lambda p: (hb := _buffer(p), t := _mm_graph(p, *hb),
                                       _graph(p, [t[0], _replace(t[1], id=t[0].id), t[2]])),
    "graph: mul_mat with mismatched ne0": lambda p: (hb := _buffer(p), _graph(p, _mm_graph(p, *hb, a_ne0=16))),
    # the kernel would write 4x2 floats: one row past the end of the buffer
    "graph: a result smaller than its op's, at the buffer's end": lambda p: (
        hb := _buffer(p), _graph(p, _mm_graph(p, *hb, out_ne=(4, 1), at=hb[1] + 4096 - 16))),
    "graph: a result larger than its op's": lambda p: (hb := _buffer(p),
                                                       _graph(p, _mm_graph(p, *hb, out_ne=(4, 4)))),
    "graph: a mul_mat result as a view (in place)": lambda p: (
        hb := _buffer(p), t := _mm_graph(p, *hb), _graph(p, [*t[:2], _replace(t[2], view_src=t[0].id)])),
    "graph: sources in the wrong slots": lambda p: (
        hb := _buffer(p), t := _mm_graph(p, *hb),
        _graph(p, [*t[:2], _replace(t[2], src=(0, t[0].id, t[1].id) + (0,) * 7)])),
    "graph: a source without memory": lambda p: (hb := _buffer(p), t := _mm_graph(p, *hb),
                                                 _graph(p, [_replace(t[0], buffer=0, data=0), *t[1:]])),
    "graph: a source on another device": lambda p: (
        hb := _buffer(p), hs := p.alloc(4096, device=1), t := _mm_graph(p, *hb),
        _graph(p, [_replace(t[0], buffer=hs[0], data=hs[1]), *t[1:]])),
    "graph: a view op without its source": lambda p: _one_node(p, lg.Op.VIEW, (4,), at=0),
    "graph: a view beyond its source": lambda p: _one_node(p, lg.Op.VIEW, (16,), at=0, view=True),
    "graph: a view not where its source puts it": lambda p: _one_node(p, lg.Op.VIEW, (4,), view=True),
    "graph: an in-place result away from its source": lambda p: _one_node(
        p, lg.Op.SCALE, (8,), view=True, params=params_to_wire(lg.Op.SCALE, (2.0, 0.0))),
    "graph: a unary op lazyggml lacks (EXPM1)": lambda p: _one_node(p, lg.Op.UNARY, (8,), params=(14,) + (0,) * 15),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_peer_is_dropped_and_the_server_goes_on(server, peer, case):
    p = peer(hello=case not in ("not HELLO first", "HELLO of the wrong size"))
    HOSTILE[case](p)
    assert p.closed_by_server(), f"{case}: the server did not close the connection"
    assert_serves(server)


def test_a_stored_graph_dies_with_its_buffer(server, peer):
    p = peer()
    handle, base = p.alloc(4096)
    a, b, out = _mm_graph(p, handle, base)
    p.set(a, np.ones(32, np.float32).tobytes())
    p.set(b, np.ones(16, np.float32).tobytes())
    p.call(Cmd.GRAPH_COMPUTE, graph_payload([out.id], [a, b, out]))
    assert np.frombuffer(p.get(out), np.float32).tolist() == [8.0] * 8
    p.call(Cmd.FREE_BUFFER, U64.pack(p.alloc(64)[0]))          # any FREE_BUFFER drops stored graphs, as GGML's
    p.raw(Cmd.GRAPH_RECOMPUTE, U32.pack(0))
    assert p.closed_by_server()
    assert_serves(server)


def test_an_allocation_too_large_is_refused_and_the_connection_goes_on(server, peer):
    p = peer()
    for size in (2**62, 2**64 - 1):
        assert TWO_U64.unpack(p.call(Cmd.ALLOC_BUFFER, ALLOC_REQ.pack(0, size), 16)) == (0, 0)
    handle, base = p.alloc(64)
    w = p.tensor(F32, (16,), handle, base)
    p.set(w, np.arange(16, dtype=np.float32).tobytes())
    assert p.get(w) == np.arange(16, dtype=np.float32).tobytes()


def test_a_kernel_failure_drops_only_that_connection(server, peer):
    """get_rows with an index out of range passes every shape check; the kernel refuses it."""
    p = peer()
    handle, base = p.alloc(4096)
    a = p.tensor(F32, (4, 3), handle, base)
    idx = p.tensor(I32, (2,), handle, base + 64)
    out = p.tensor(F32, (4, 2), handle, base + 128, op=GGML_OP[lg.Op.GET_ROWS], src=(a.id, idx.id),
                   flags=lg.FLAG_COMPUTE)
    p.set(idx, np.array([1, 7], np.int32).tobytes())
    p.raw(Cmd.GRAPH_COMPUTE, graph_payload([out.id], [a, idx, out]))
    assert p.closed_by_server()
    assert_serves(server)


# -- time limits and stopping: a server of their own, with a short timeout -------------------------------------
@pytest.fixture
def quick_server():
    s = RPCServer([lg.dev_by_name("CPU")], port=0, timeout=0.5)
    thread = threading.Thread(target=s.serve_forever, daemon=True)
    thread.start()
    yield s, thread
    s.close()
    thread.join(WAIT)


def test_silent_and_stalling_peers_time_out(quick_server):
    s, _ = quick_server
    for stall in (b"", HEADER.pack(Cmd.HELLO, 24) + bytes(10), HEADER.pack(Cmd.GRAPH_COMPUTE, 1000)[:5]):
        p = Peer(s, hello=False)
        p.sock.sendall(stall)
        t0 = time.monotonic()
        assert p.closed_by_server() and time.monotonic() - t0 < 5
        p.close()
    p = Peer(s)
    p.raw(Cmd.GRAPH_COMPUTE, bytes(100), size=1000)   # inside a message, after the handshake
    assert p.closed_by_server()
    p.close()
    p = Peer(s)                                        # between commands a client may think for long
    time.sleep(1.0)
    assert U32.unpack(p.call(Cmd.DEVICE_COUNT, b"", 4))[0] == 1
    p.close()


def test_close_stops_serving_promptly(quick_server):
    s, thread = quick_server
    p = Peer(s)                      # a client in the middle of its session
    t0 = time.monotonic()
    s.close()
    thread.join(WAIT)
    assert not thread.is_alive() and time.monotonic() - t0 < 2
    assert p.closed_by_server()
    p.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", s.port), timeout=2).close()


def test_constructor_checks():
    with pytest.raises(ValueError):
        RPCServer([], port=0)
    with RPCServer([lg.dev_by_name("CPU")], port=0) as s:
        assert s.port and s.endpoint == f"127.0.0.1:{s.port}"
        with pytest.raises(OSError):        # the port is taken
            RPCServer([lg.dev_by_name("CPU")], port=s.port)


# -- fuzz: valid messages with bytes or fields changed ---------------------------------------------------------
class _Session:
    """A connection with a target buffer between two canary buffers, and three valid messages on the
    target: SET_TENSOR, GET_TENSOR and a small GRAPH_COMPUTE (mul_mat, add, an in-place scale)."""

    def __init__(self, server):
        self.p = Peer(server)
        self.canaries = [self.p.alloc(1024) for _ in range(2)]
        self.canary_w = [self.p.tensor(int(lg.I8), (1024,), h, b) for h, b in self.canaries]
        for w in self.canary_w:
            self.p.set(w, np.full(1024, 0xC5, np.uint8))
        handle, base = self.p.alloc(4096)
        a, b, out = _mm_graph(self.p, handle, base)
        bias = self.p.tensor(F32, (4,), handle, base + 1024)
        s = self.p.tensor(F32, (4, 2), handle, base + 1536, op=GGML_OP[lg.Op.ADD], src=(out.id, bias.id),
                          flags=lg.FLAG_COMPUTE)
        r = self.p.tensor(F32, (4, 2), handle, base + 1536, op=GGML_OP[lg.Op.SCALE], src=(s.id,),
                          view_src=s.id, params=params_to_wire(lg.Op.SCALE, (0.5, 0.0)), flags=lg.FLAG_COMPUTE)
        x = np.random.default_rng(4).standard_normal(256).astype(np.float32)
        for w in (a, b, bias):
            self.p.set(w, x[:nbytes(w) // 4].tobytes())
        self.graph = [a, b, out, bias, s, r]
        self.nodes = [out.id, s.id, r.id]
        self.messages = {
            Cmd.SET_TENSOR: a.pack() + SET_HEAD.pack(0, 0) + x[:32].tobytes(),
            Cmd.GET_TENSOR: a.pack() + RANGE.pack(0, 128),
            Cmd.GRAPH_COMPUTE: graph_payload(self.nodes, self.graph),
        }

    def names_a_canary(self, cmd, payload):
        """Whether a (mutated) message names a canary buffer: then writing there is no bug."""
        if cmd != Cmd.GRAPH_COMPUTE:
            records = [payload[:TENSOR.size]]
        else:
            at = 12 + 8 * struct.unpack_from("<I", payload, 4)[0]
            records = [payload[i:i + TENSOR.size] for i in range(at, len(payload) - TENSOR.size + 1, TENSOR.size)]
        return any(WireTensor.unpack(r).buffer in [h for h, _ in self.canaries] for r in records)

    def canaries_intact(self):
        return all(self.p.get(w) == b"\xc5" * 1024 for w in self.canary_w)


def _bytes_changed(rng, payload):
    """1 to 4 random bytes of the payload set to random values (the frame stays valid)."""
    payload = bytearray(payload)
    for _ in range(rng.integers(1, 5)):
        payload[rng.integers(len(payload))] = rng.integers(256)
    return bytes(payload)


_EDGES = (0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 255, 256, 4096, 2**31 - 1, 2**31, 2**32 - 1)


def _field_changed(rng, session):
    """The session's graph with one field of one tensor set to an edge value: a shape, a stride, the
    type, the op or a param, a source or view source (another tensor, or none), the place, the flags."""
    ts = list(session.graph)
    k = rng.integers(len(ts))
    w, ids = ts[k].__dict__.copy(), [0] + [t.id for t in ts]
    field = ["ne", "nb", "type", "op", "op_params", "src", "view_src", "data", "flags"][rng.integers(9)]
    pick = lambda seq: seq[rng.integers(len(seq))]    # noqa: E731
    if field in ("ne", "nb", "op_params", "src"):
        v = list(w[field])
        v[rng.integers(4 if field in ("ne", "nb") else 3)] = pick(ids) if field == "src" else pick(_EDGES)
        if field == "op_params":     # int32 slots
            v = [(int(x) + 2**31) % 2**32 - 2**31 for x in v]
        w[field] = tuple(v)
    else:
        w[field] = {"type": lambda: pick([F32, int(lg.Q8_0), int(lg.Q4_K), 4, 99]),
                    "op": lambda: pick([0, 1, 2, 3, 7, 15, 29, 32, 34, 35, 37, 40, 42, 46, 48, 91, 100, 2**31]),
                    "view_src": lambda: pick(ids),
                    "data": lambda: w["data"] + int(rng.integers(-1100, 3000)) // 4 * 4,
                    "flags": lambda: pick([0, 1, 2, 16, 255])}[field]()
    ts[k] = WireTensor(**w)
    return graph_payload(session.nodes, ts)


def test_fuzz_mutated_messages(server):
    rng = np.random.default_rng(12345)
    session, dropped, accepted = _Session(server), 0, 0
    t_end = time.monotonic() + 10.0
    for i in range(3000):
        if time.monotonic() > t_end:
            break
        cmd = [Cmd.SET_TENSOR, Cmd.GET_TENSOR, Cmd.GRAPH_COMPUTE, Cmd.GRAPH_COMPUTE][i % 4]
        payload = (_field_changed(rng, session) if i % 8 == 3 else
                   _bytes_changed(rng, session.messages[cmd]))
        try:
            session.p.call(cmd, payload)          # GET_TENSOR's reply, of whatever size it asked for
            intact = session.canaries_intact()    # also proves the server still answers
            accepted += 1
        except RPCError:                          # dropped: a new connection must be served
            dropped += 1
            session.p.close()
            session = _Session(server)
            continue
        assert intact or session.names_a_canary(cmd, payload), f"mutation {i} wrote outside its buffer"
    session.p.close()
    assert dropped > 100 and accepted > 100, (dropped, accepted)
    assert_serves(server)
