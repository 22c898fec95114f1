"""GGML's RPC protocol end to end: lazyggml's client and server, and both against llama.cpp's own.

* our client -> our server (``lazyggml rpc-server`` in a child process): a model's layers on the
  remote device give the logits of a local run, bit for bit (the same CPU kernels compute them);
  decode steps after the prompt resend nothing but GRAPH_RECOMPUTE;
* our client -> llama.cpp's RPC server (``ggml_backend_rpc_start_server`` of the llama-cpp-python
  build, with ``-DGGML_RPC=ON``, in a child process): logits within NMSE 1e-6 of our CPU run (GGML's
  CPU kernels compute them; F32 and F16 weights);
* llama.cpp's client (``ggml_backend_rpc_add_server`` + ``Llama(n_gpu_layers=99)`` in a child) ->
  our server: logits within NMSE 1e-6 of llama.cpp's local run;
* a dead or silent server is a clear ``RPCError`` naming it, within the timeout.

The hostile-peer tests of the server are in test_rpc_server.py.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import lazyggml as lg
from lazyggml.backends.rpc import protocol as P
from lazyggml.backends.rpc.client import RPCBuffer
from lazyggml.testing import RPCServerProcess, make_tiny_model

SEED = 1234
N_CTX = 64
TOKENS = np.random.default_rng(SEED).integers(3, 256, 12).tolist()


def _nmse(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lazyggml_server():
    return RPCServerProcess("lazyggml")


def llama_cpp_server():
    return RPCServerProcess("llama.cpp")


# llama.cpp's client: argv = model, json tokens, out.npy, endpoint or "" (local). GGML's client
# aborts the process when a server is unreachable, hence a child.
LLAMA_CLIENT_CHILD = r"""
import ctypes, json, os, sys
import numpy as np
import llama_cpp
# the libggml that libllama loaded (its soname, libggml.so.0): the wheel holds libggml.so as a copy,
# not a link, and a device registered in that other copy's registry is one libllama never sees
lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml.so.0"))
path, tokens, out, endpoint = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
if endpoint:
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_register.argtypes = [ctypes.c_void_p]
    add = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(
        lib.ggml_backend_reg_get_proc_address(lib.ggml_backend_reg_by_name(b"RPC"), b"ggml_backend_rpc_add_server"))
    lib.ggml_backend_register(add(endpoint.encode()))
llm = llama_cpp.Llama(path, n_ctx=64, n_threads=2, logits_all=True, verbose=bool(endpoint), flash_attn=False,
                      n_gpu_layers=99 if endpoint else 0)
llm.eval(tokens)
np.save(out, np.array(llm.scores[:len(tokens)], np.float32))
"""


def llama_cpp_logits(path, tokens, tmp_path, endpoint=""):
    out = tmp_path / f"llama-{'rpc' if endpoint else 'local'}.npy"
    r = subprocess.run([sys.executable, "-c", LLAMA_CLIENT_CHILD, str(path), json.dumps(tokens), str(out), endpoint],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"llama.cpp's client failed ({r.returncode}):\n{r.stderr[-4000:]}"
    if endpoint:   # llama.cpp's log: every layer on the RPC device, none left on its CPU
        assert "using device RPC0" in r.stderr and "assigned to device CPU" not in r.stderr, r.stderr[-4000:]
    return np.load(out)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("rpc")
    kw = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=256, n_ctx=128, seed=SEED)
    return {"f32": make_tiny_model(d / "f32.gguf", types={"*": lg.F32}, **kw),
            # norms stay F32 as llama.cpp writes them (GGML's CPU has no F32 x F16 MUL)
            "f16": make_tiny_model(d / "f16.gguf", types={"*norm.weight": lg.F32, "token_embd.weight": lg.F32,
                                                          "*": lg.F16}, **kw),
            "q4_k_m": make_tiny_model(d / "q4km.gguf", **kw)}


def _local(path, flash_attn=False):
    """The local run, its weights in plain CPU buffers as a server's (GGML's rpc-server offers no
    extra buffer types, so nothing there is repacked: repack.py)."""
    m = lg.load_model(path, n_ctx=N_CTX, n_threads=2, flash_attn=flash_attn, repack=False)
    return m.eval(TOKENS), [m.eval([t])[-1] for t in TOKENS[:3]]


def _remote(path, endpoint, flash_attn=False):
    dev = lg.rpc_device(endpoint)
    m = lg.load_model(path, n_ctx=N_CTX, n_threads=2, n_gpu_layers=99, device=dev, flash_attn=flash_attn)
    assert {b.name for b in m.layer_backends} == {dev.name}, "every layer and the output on the RPC device"
    return m, m.eval(TOKENS), [m.eval([t])[-1] for t in TOKENS[:3]]


@pytest.fixture(scope="module")
def ours():
    srv = lazyggml_server()
    yield srv
    srv.kill()


@pytest.mark.parametrize("mix", ["f32", "q4_k_m"])
@pytest.mark.parametrize("flash_attn", [False, True])
def test_our_client_and_server_give_the_local_logits(models, ours, mix, flash_attn):
    want, want_steps = _local(models[mix], flash_attn)
    model, got, steps = _remote(models[mix], ours.endpoint, flash_attn)
    np.testing.assert_array_equal(got, want)
    for g, w in zip(steps, want_steps):
        np.testing.assert_array_equal(g, w)
    assert any(isinstance(b, RPCBuffer) for b in model.weights.buffers)


def test_decode_steps_resend_only_graph_recompute(models, ours, monkeypatch):
    model, _, _ = _remote(models["f32"], ours.endpoint)
    sent = []
    real = P.Channel.command

    def spy(self, cmd, payload=b"", reply_size=None):
        sent.append((cmd, len(payload)))
        return real(self, cmd, payload, reply_size)
    monkeypatch.setattr(P.Channel, "command", spy)
    model.eval([5])
    first = [c for c, _ in sent]
    sent.clear()
    model.eval([6])
    again = [c for c, _ in sent]
    assert P.Cmd.GRAPH_COMPUTE not in again and P.Cmd.GRAPH_RECOMPUTE in again, (first, again)
    assert sum(n for _, n in sent) < 4096, sent   # the inputs, the logits' request, 4 bytes of graph


@pytest.mark.parametrize("mix", ["f32", "f16"])
@pytest.mark.parametrize("flash_attn", [False, True])
def test_our_client_with_llama_cpp_server(models, mix, flash_attn):
    """GGML's CPU kernels on the server against ours here. With flash attention the mask crosses
    the wire as F16, GGML's only mask type (an F32 mask, read there as halves, gave other text from
    the first token)."""
    srv = llama_cpp_server()
    try:
        _, got, steps = _remote(models[mix], srv.endpoint, flash_attn)
    finally:
        srv.kill()
    want, want_steps = _local(models[mix], flash_attn)
    assert _nmse(got, want) <= 1e-6
    for g, w in zip(steps, want_steps):
        assert _nmse(g, w) <= 1e-6


def test_client_refuses_a_node_that_breaks_its_ops_contract():
    """A FLASH_ATTN_EXT whose mask was swapped for an F32 one after its constructor ran: GGML's
    server would read the floats as halves, so the client refuses the graph, naming the node; the
    same node with its F16 mask passes."""
    from lazyggml.backends.rpc.client import serialize_graph
    from lazyggml.backends.rpc.contract import check_node
    ctx = lg.Context()
    q, k, v = ctx.new_tensor_3d(lg.F32, 64, 5, 4), ctx.new_tensor_3d(lg.F16, 64, 7, 2), ctx.new_tensor_3d(lg.F16, 64, 7, 2)
    fa = lg.flash_attn_ext(q, k, v, ctx.new_tensor_2d(lg.F16, 7, 5), 0.125)
    lg.set_name(fa, "attn")
    check_node(fa)
    fa.src[3] = ctx.new_tensor_2d(lg.F32, 7, 5)
    g = lg.Graph()
    g.build_forward_expand(fa)
    with pytest.raises(lg.UnsupportedOpError, match=r"'attn'.*mask must be F16"):
        serialize_graph(g, 0, None)


@pytest.mark.parametrize("mix", ["f32", "f16"])
def test_llama_cpp_client_with_our_server(models, mix, tmp_path):
    want = llama_cpp_logits(models[mix], TOKENS, tmp_path)
    # a server of its own: a server serves one connection at a time, as GGML's does, and this
    # process keeps its connection to ``ours``
    with lazyggml_server() as srv:
        got = llama_cpp_logits(models[mix], TOKENS, tmp_path, srv.endpoint)
    assert _nmse(got, want) <= 1e-6


def test_unreachable_server_is_a_clear_error():
    port = _free_port()
    with pytest.raises(lg.LazyGGMLError, match=f"127.0.0.1:{port}.*cannot connect"):
        lg.rpc_add_server(f"127.0.0.1:{port}", timeout=5)
    with pytest.raises(ValueError, match="host:port"):
        lg.rpc_add_server("localhost")


def test_silent_server_times_out():
    """A peer that accepts and never answers: the HELLO times out after ``timeout`` seconds."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        t0 = time.monotonic()
        with pytest.raises(P.RPCError, match="HELLO.*timed out"):
            lg.rpc_add_server(f"127.0.0.1:{listener.getsockname()[1]}", timeout=1)
        assert time.monotonic() - t0 < 10


def test_dead_server_mid_session_is_a_clear_error_and_frees(models):
    srv = lazyggml_server()
    try:
        model, _, _ = _remote(models["f32"], srv.endpoint)
    finally:
        srv.kill()
    with pytest.raises(P.RPCError, match=srv.endpoint):
        model.eval([7])
    assert all(b.size == 0 for b in model.weights.buffers if isinstance(b, RPCBuffer)), \
        "the dead connection's buffers are released"


def test_cli_generate_with_rpc(models):
    with lazyggml_server() as srv:   # its own: this process keeps its connection to ``ours``
        r = subprocess.run([sys.executable, "-m", "lazyggml.cli", "generate", str(models["q4_k_m"]), "-p", "hello",
                            "-n", "4", "--temp", "0", "-ngl", "99", "--rpc", srv.endpoint, "-c", "64"],
                           capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "RPC" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "lazyggml.cli", "generate", str(models["q4_k_m"]), "-ngl", "99",
                          "--rpc", f"127.0.0.1:{_free_port()}"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and "cannot connect" in bad.stderr


def test_our_server_serves_opencl_as_local_opencl_computes(models):
    """``lazyggml rpc-server --device OpenCL0`` (PoCL here): the remote device's logits are the local
    OpenCL device's, bit for bit (the same kernels)."""
    want = lg.load_model(models["q4_k_m"], n_ctx=N_CTX, n_gpu_layers=99, device="OpenCL0").eval(TOKENS)
    with RPCServerProcess("lazyggml", device="OpenCL0") as srv:
        model = lg.load_model(models["q4_k_m"], n_ctx=N_CTX, n_gpu_layers=99, device=lg.rpc_device(srv.endpoint))
        np.testing.assert_array_equal(model.eval(TOKENS), want)


def test_a_dead_servers_devices_leave_the_device_list(models):
    srv = lazyggml_server()
    try:
        dev = lg.rpc_device(srv.endpoint)
        assert dev in [lg.dev_get(i) for i in range(lg.dev_count())]
    finally:
        srv.kill()
    with pytest.raises(P.RPCError):
        dev.memory()
    assert dev not in [lg.dev_get(i) for i in range(lg.dev_count())]
    from lazyggml.cli import main
    assert main(["info"]) == 0
