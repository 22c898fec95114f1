"""The OpenCL backend (lazyggml/backends/opencl/backend.py) on whatever OpenCL device there is: PoCL's CPU
device in CI (the test extra installs ``pyopencl[pocl]``). Skipped only when there is none.

* every case of the op-case catalogue (``lazyggml.op_cases``) that OpenCL claims, against its float64
  NumPy oracle;
* MUL_MAT for each weight type (F32, F16, Q8_0, Q4_K, Q6_K) through each kernel (mat-vec, tiled,
  the F32/F16 fallback), with broadcasting, strided views and odd sizes, against NumPy on the
  dequantized weights and, where the CPU backend supports the case, against it (GGML's rule:
  NMSE <= 5e-4; the CPU quantizes the activations);
* buffers (odd offsets, memset, clear, device-to-device copies), async copies and events;
* that supports_op refuses what is not implemented, and the registry's names and errors;
* the program's cache (kept, a damaged file rebuilt, a read-only cache survived), compiler
  warnings only with LAZYGGML_DEBUG=1, and what ``lazyggml info`` says the device is.
"""
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

import lazyggml as lg
from lazyggml import op_cases as table
from lazyggml.alloc import alloc_ctx_tensors
from lazyggml.backend import tensor_get, tensor_get_bytes, tensor_set
from lazyggml.backends.opencl import backend as opencl
from lazyggml.backends.cpu import backend_cpu_init
from lazyggml.quants import dequantize, quantize
from lazyggml.sched import Scheduler
from lazyggml.types import WEIGHT_TYPES, Type, is_quantized, row_size, type_name

if lg.dev_by_name("OpenCL0") is None:
    pytest.skip("no OpenCL device (pip install 'lazyggml[opencl]' for PoCL's CPU device), or "
                "LAZYGGML_DISABLE_OPENCL is set", allow_module_level=True)

F32, F16, Q8_0, Q4_K, Q6_K = Type.F32, Type.F16, Type.Q8_0, Type.Q4_K, Type.Q6_K
MUL_MAT_NMSE = 5e-4  # GGML's test_mul_mat::max_nmse_err


@pytest.fixture(scope="module")
def ocl():
    return lg.backend_init_by_name("OpenCL0")


@pytest.fixture(scope="module")
def cpu():
    return backend_cpu_init()


# -- the shared op table ------------------------------------------------------------------------------
# The cases the OpenCL backend does not claim today, each a gap in its kernels (a model that needs one
# runs that node on the CPU): writing quantized or BF16 rows, copies to and from BF16, I32 and the
# quantized types, I32 and permuted get_rows, quantized CONCAT. A list rather than skips, so that a
# new gap fails and a closed one asks to be struck off.
_QTYPES = tuple(type_name(t) for t in WEIGHT_TYPES if is_quantized(t))
OPENCL_GAPS = {
    *(f"set_rows({t}, idx {i})" for t in ("bf16", *_QTYPES) for i in ("i32", "i64")),
    "set_rows(bf16, idx i32, broadcast idx)", "set_rows(bf16, idx i64, broadcast idx)",
    "set_rows(q8_0, idx i32, broadcast idx)", "set_rows(q4_K, idx i32, broadcast idx)",
    "get_rows(i32, idx i32, short rows)", "get_rows(i32, idx i64, short rows)", "get_rows(permuted rows)",
    *(f"cpy({a} -> {b})" for t in ("bf16", *_QTYPES) for a, b in (("f32", t), (t, "f32"))),
    *(f"cpy({a} -> {b}, {how})" for a, b in (("f32", "bf16"), ("bf16", "f32"), ("f16", "bf16"), ("bf16", "f16"),
                                             ("f32", "i32"), ("i32", "f32"))
      for how in ("short rows", "reshaped")),
    "cpy(bf16 permuted -> f32)", "cpy(f32 -> view of bf16 with gaps)", "cpy(f16 -> q8_0)",
    "cpy(q8_0 -> f32, reshaped)", "cpy(q4_0 -> q4_0)", "concat(dim=1, q8_0)",
    # mixture of experts: the scheduler runs a MoE layer's routing and experts on the CPU
    *(c.name for c in table.CASES if c.name.startswith(("mul_mat_id(", "argsort"))),
}


def test_opencl_gaps_are_table_cases():
    assert OPENCL_GAPS <= {c.name for c in table.CASES}


@pytest.mark.parametrize("case", table.CASES, ids=[c.name for c in table.CASES])
def test_op_table(case, ocl):
    """Every case runs on OpenCL and matches the oracle, but the known gaps (``OPENCL_GAPS``), which
    the backend must refuse rather than compute wrongly."""
    result = table.run_case(case, ocl)
    if case.name in OPENCL_GAPS:
        assert result == "unsupported", f"{case.name} runs on OpenCL now: strike it off OPENCL_GAPS"
    else:
        assert result != "unsupported", f"{case.name}: the OpenCL backend does not claim it"


# Row indices out of range (op_cases.run_rows_out_of_range): the float kernels and a few quantized
# ones (one macro makes them all; Q4_K is read with 16-byte loads). Before the kernels checked their
# indices, these cases crashed PoCL (SIGSEGV, SIGBUS): a regression fails the test run that way too.
_OOR_CASES = [(op, t, it) for op, types in (("get_rows", (F32, F16, Type.BF16, Type.Q4_0, Q8_0, Q4_K, Q6_K)),
                                            ("set_rows", (F32, F16)))
              for t in types for it in (Type.I32, Type.I64)]


@pytest.mark.parametrize("op, type_, itype", _OOR_CASES,
                         ids=[f"{op}({type_name(t)}, idx {type_name(it)})" for op, t, it in _OOR_CASES])
def test_rows_out_of_range(op, type_, itype, ocl):
    """An index outside the indexed tensor touches no memory: GET_ROWS gives a row of zeros, SET_ROWS
    writes nothing, the good rows are right."""
    assert table.run_rows_out_of_range(ocl, op, type_, itype) == "ok"


# -- MUL_MAT ------------------------------------------------------------------------------------------
def _weights(rng, type_, shape):
    """Uniform [-1, 1] weights of NumPy shape (..., k): (the bytes to upload, their exact values)."""
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    if type_ == F32:
        return x, x.astype(np.float64)
    if type_ == F16:
        return x.astype(np.float16), x.astype(np.float16).astype(np.float64)
    q = quantize(type_, x.reshape(-1, shape[-1]))
    return q, dequantize(type_, q, shape[-1]).reshape(shape).astype(np.float64)


def _mul_mat_graph(ctx, type_, m, n, k, a_batch, b_batch, view):
    """mul_mat(a, b) with a [k, m, *a_batch] of type_ and b [k, n, *b_batch] F32; ``view`` makes a
    every other row of a bigger tensor and b a permuted (non-contiguous) view."""
    if view:
        a_root = ctx.new_tensor(type_, (k, 2 * m, *a_batch))
        rs = row_size(type_, k)
        a = lg.view_4d(a_root, k, m, *a_batch, 2 * rs, 2 * rs * m, 2 * rs * m * a_batch[0])
        b_root = ctx.new_tensor(F32, (k, b_batch[0], n, b_batch[1]))
        b = lg.permute(b_root, 0, 2, 1, 3)
    else:
        a_root = a = ctx.new_tensor(type_, (k, m, *a_batch))
        b_root = b = ctx.new_tensor(F32, (k, n, *b_batch))
    return a_root, a, b_root, b, lg.mul_mat(a, b)


def _run_mul_mat(backend, type_, m, n, k, a_batch, b_batch, view, a_bytes, b_vals, host):
    ctx = lg.Context(no_alloc=not host)
    a_root, a, b_root, b, out = _mul_mat_graph(ctx, type_, m, n, k, a_batch, b_batch, view)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    if not all(backend.device.supports_op(nd) for nd in g.nodes):
        return None
    if not host:
        alloc_ctx_tensors(ctx, backend)
    tensor_set(a_root, a_bytes)
    tensor_set(b_root, b_vals)
    lg.backend_graph_compute(backend, g)
    return tensor_get(out).astype(np.float64)


MUL_MAT_CASES = [
    # (m, n, k, a's dims 2-3, b's dims 2-3, views): n <= 8 is the mat-vec kernel (on a CPU device in
    # tiles of 1, 2, 4 or 8 columns and 1 or 2 rows), more the tiled one (32 rows x 60 columns,
    # register tiles of 4 x 6): odd m and n reach their tails
    (40, 1, 512, (1, 1), (1, 1), False),
    (33, 2, 256, (1, 1), (1, 1), False),
    (40, 5, 512, (1, 1), (1, 1), False),
    (36, 8, 256, (2, 1), (4, 2), False),
    (40, 9, 512, (1, 1), (1, 1), False),
    (70, 37, 768, (1, 1), (1, 1), False),
    (33, 20, 256, (2, 1), (4, 2), False),
    (12, 3, 256, (1, 1), (2, 1), True),
    (12, 17, 256, (1, 1), (2, 1), True),
    (37, 67, 256, (1, 1), (1, 1), False),
]


@pytest.mark.parametrize("type_", [F32, F16, Q8_0, Q4_K, Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("shape", MUL_MAT_CASES, ids=lambda s: f"m{s[0]}n{s[1]}k{s[2]}a{s[3]}b{s[4]}{'v' if s[5] else ''}")
def test_mul_mat(type_, shape, ocl, cpu):
    m, n, k, (a2, a3), (b2, b3), view = shape
    rng = np.random.default_rng(table.SEED + 7 * m + n)
    a_bytes, a_vals = _weights(rng, type_, (a3, a2, 2 * m if view else m, k))
    b_vals = rng.uniform(-1, 1, (b3, n, b2, k) if view else (b3, b2, n, k)).astype(np.float32)
    got = _run_mul_mat(ocl, type_, m, n, k, (a2, a3), (b2, b3), view, a_bytes, b_vals, host=False)

    # NumPy: the exact weights against the activations, broadcast over dims 2 and 3
    w = a_vals[:, :, ::2] if view else a_vals
    x = np.swapaxes(b_vals, 1, 2) if view else b_vals
    w = np.repeat(np.repeat(w, b3 // a3, axis=0), b2 // a2, axis=1)
    want = np.einsum("abmk,abnk->abnm", w, x.astype(np.float64))
    assert table.nmse(got, want) < 1e-10
    # the CPU backend (its activations are quantized to Q8_K/Q8_0/F16, hence GGML's looser bound)
    cpu_got = _run_mul_mat(cpu, type_, m, n, k, (a2, a3), (b2, b3), view, a_bytes, b_vals, host=True)
    if cpu_got is not None:
        assert table.nmse(got, cpu_got) < MUL_MAT_NMSE


@pytest.mark.parametrize("type_,m,k,n", [(t, 5, 800, n) for t in (F32, F16, Q8_0) for n in (3, 61)]
                         + [(t, 7, 37, n) for t in (F32, F16, Type.BF16) for n in (1, 12)])
def test_mul_mat_rows_not_a_multiple_of_the_tile(type_, m, k, n, ocl):
    """Rows of 800: the tiled kernel steps 256 weights at a time, so its last step is shorter.
    Rows of 37: F32/F16/BF16 rows that are not a multiple of 16 long take the naive kernel."""
    rng = np.random.default_rng(table.SEED)
    a_bytes, a_vals = _weights(rng, type_, (m, k))
    b = rng.uniform(-1, 1, (n, k)).astype(np.float32)
    got = _run_mul_mat(ocl, type_, m, n, k, (1, 1), (1, 1), False, a_bytes, b, host=False)
    assert table.nmse(got[0, 0], b.astype(np.float64) @ a_vals.T) < 1e-10


@pytest.mark.parametrize("type_", [F32, Q4_K, Q6_K])
@pytest.mark.parametrize("n", [3, 20])
def test_mul_mat_gpu_layout(type_, n, ocl, monkeypatch):
    """The GPU layouts: work-items share a mat-vec row (local-memory reduction) or a tile."""
    monkeypatch.setattr(ocl, "cpu_layout", False)
    monkeypatch.setattr(ocl, "mv_lanes", 4)
    rng = np.random.default_rng(table.SEED)
    a_bytes, a_vals = _weights(rng, type_, (9, 1280))
    b = rng.uniform(-1, 1, (n, 1280)).astype(np.float32)
    got = _run_mul_mat(ocl, type_, 9, n, 1280, (1, 1), (1, 1), False, a_bytes, b, host=False)
    assert table.nmse(got[0, 0], b.astype(np.float64) @ a_vals.T) < 1e-10


# -- buffers, async copies, events ----------------------------------------------------------------------
def _bytes_tensor(ctx, n):
    return ctx.new_tensor_1d(Type.I8, n)


def test_buffer_type(ocl):
    dev = ocl.device
    buft = dev.get_buffer_type()
    assert buft.name == dev.name == ocl.name and not buft.is_host()
    align = buft.get_alignment()
    assert align >= 32 and align & (align - 1) == 0
    assert align == max(32, dev.cl_device.mem_base_addr_align // 8)
    assert buft.get_max_size() == dev.cl_device.max_mem_alloc_size
    assert dev.supports_buft(buft) and not dev.supports_buft(lg.backend_cpu_init().get_default_buffer_type())


def test_set_get_at_odd_offsets(ocl):
    buf = ocl.get_default_buffer_type().alloc_buffer(1000)
    ctx = lg.Context()
    t = _bytes_tensor(ctx, 301)
    lg.tensor_alloc(buf, t, 3)
    data = np.random.default_rng(0).integers(-128, 128, 301).astype(np.int8)
    tensor_set(t, data)
    assert np.array_equal(tensor_get(t).ravel(), data)
    tensor_set(t, np.arange(5, dtype=np.int8), offset=7, size=5)  # a partial write inside the tensor
    data[7:12] = np.arange(5)
    assert np.array_equal(tensor_get_bytes(t, 5, 20), data[5:25].view(np.uint8))
    lg.tensor_memset(t, 0xAB, offset=11, size=13)
    data[11:24] = np.uint8(0xAB).view(np.int8)
    assert np.array_equal(tensor_get(t).ravel(), data)
    buf.clear(7)
    assert (tensor_get(t) == 7).all()
    buf.free()
    assert buf.size == 0


def test_copies_device_to_device_and_host(ocl):
    buft = ocl.get_default_buffer_type()
    b1, b2 = buft.alloc_buffer(512), buft.alloc_buffer(512)
    ctx = lg.Context()
    src, dst, dst2 = _bytes_tensor(ctx, 100), _bytes_tensor(ctx, 100), _bytes_tensor(ctx, 100)
    lg.tensor_alloc(b1, src, 5)
    lg.tensor_alloc(b2, dst, 77)
    lg.tensor_alloc(b1, dst2, 301)
    data = np.random.default_rng(1).integers(-128, 128, 100).astype(np.int8)
    tensor_set(src, data)
    assert b2.cpy_tensor(src, dst)  # device to device, no trip through the host
    assert np.array_equal(tensor_get(dst).ravel(), data)
    lg.tensor_copy(dst, dst2)
    assert np.array_equal(tensor_get(dst2).ravel(), data)
    host_ctx = lg.Context(no_alloc=False)
    h = _bytes_tensor(host_ctx, 100)
    lg.tensor_copy(src, h)  # device to host
    assert np.array_equal(tensor_get(h).ravel(), data)
    assert not b2.cpy_tensor(h, dst)  # a host source is the wrapper's job


def test_async_copies_and_events(ocl):
    buf = ocl.get_default_buffer_type().alloc_buffer(4096)
    ctx = lg.Context()
    a, b = ctx.new_tensor_1d(F32, 300), ctx.new_tensor_1d(F32, 300)
    lg.tensor_alloc(buf, a, 0)
    lg.tensor_alloc(buf, b, 2048)
    x = np.random.default_rng(2).uniform(-1, 1, 300).astype(np.float32)
    staging = x.copy()
    lg.tensor_set_async(ocl, a, staging)
    staging[:] = 0  # the backend copied what it needs
    lg.tensor_copy_async(ocl, ocl, a, b)
    ev = lg.event_new(ocl.device)
    ocl.event_record(ev)
    ocl.event_wait(ev)
    lg.event_synchronize(ev)
    out = ocl.get_tensor_async(b, 0, b.nbytes())
    ocl.synchronize()
    assert np.array_equal(out.view(np.float32), x)


def test_graph_results_need_no_explicit_sync(ocl):
    """Buffers and backend share the device's in-order queue: a blocking get sees the kernels."""
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 4096)
    out = lg.scale(lg.silu(a), 3.0)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    alloc_ctx_tensors(ctx, ocl)
    x = np.linspace(-4, 4, 4096, dtype=np.float32)
    tensor_set(a, x)
    ocl.graph_compute(g)
    assert np.allclose(tensor_get(out).ravel(), 3 * x / (1 + np.exp(-x)), rtol=1e-5, atol=1e-6)


# -- with the scheduler ----------------------------------------------------------------------------------
@pytest.mark.parametrize("parallel", [False, True], ids=["one copy", "parallel (events)"])
def test_scheduler_splits_between_opencl_and_cpu(parallel, ocl, cpu):
    """Q4_K weights in an OpenCL WEIGHTS buffer pull the mul_mat there; the BF16 copies OpenCL
    refuses run on the CPU; the scheduler copies between the two."""
    rng = np.random.default_rng(table.SEED)
    wctx = lg.Context()
    w = wctx.new_tensor_2d(Q4_K, 256, 16)
    alloc_ctx_tensors(wctx, ocl).usage = lg.BufferUsage.WEIGHTS
    w_bytes, w_vals = _weights(rng, Q4_K, (16, 256))
    tensor_set(w, w_bytes)

    sched = Scheduler([ocl, cpu], parallel=parallel)
    for _ in range(2):  # a new graph of the same shape, as a decoder builds one per token
        ctx = lg.Context()
        x = ctx.new_tensor_2d(F32, 256, 3)
        lg.set_input(x)
        h = lg.cpy(lg.mul_mat(w, x), ctx.new_tensor_2d(Type.BF16, 16, 3))
        out = lg.silu(lg.cpy(h, ctx.new_tensor_2d(F32, 16, 3)))
        lg.set_output(out)
        g = lg.Graph()
        lg.build_forward_expand(g, out)
        assert sched.alloc_graph(g)
        xv = rng.uniform(-1, 1, (3, 256)).astype(np.float32)
        tensor_set(x, xv)
        sched.graph_compute(g)
        assert sched.get_tensor_backend(g.nodes[0]) is ocl and sched.n_splits >= 2
        hv = table.q_round(Type.BF16, xv.astype(np.float64) @ w_vals.T)
        assert table.nmse(tensor_get(out)[0, 0], hv / (1 + np.exp(-hv))) < 1e-5
        sched.reset()


# -- supports_op is honest -------------------------------------------------------------------------------
def test_supports_op_refuses_what_is_not_implemented(ocl):
    ctx = lg.Context()
    f16 = ctx.new_tensor_2d(F16, 32, 4)
    f32 = ctx.new_tensor_2d(F32, 32, 4)
    refused = [
        lg.add(f16, f16), lg.silu(f16), lg.rms_norm(f16), lg.soft_max(f16), lg.sum_rows(f16),
        lg.mul_mat(ctx.new_tensor_2d(Type.Q8_1, 32, 4), f32),      # an activation type, no weight kernels
        lg.mul_mat(f32, ctx.new_tensor_2d(F16, 32, 4)),
        lg.mul_mat(f32, lg.transpose(ctx.new_tensor_2d(F32, 4, 32))),  # src1 rows not contiguous
        lg.get_rows(ctx.new_tensor_2d(Type.Q8_1, 32, 4), ctx.new_tensor_1d(Type.I32, 2)),
        # Q4_K and Q5_K blocks are read with 16-byte loads: a view that starts 8 bytes in is refused
        lg.mul_mat(lg.view_2d(ctx.new_tensor_1d(Q4_K, 1024), 256, 2, 144, 8), ctx.new_tensor_2d(F32, 256, 3)),
        lg.mul_mat(lg.view_2d(ctx.new_tensor_1d(Type.Q5_K, 1024), 256, 2, 176, 8), ctx.new_tensor_2d(F32, 256, 3)),
        lg.cpy(f32, ctx.new_tensor_2d(Type.Q8_0, 32, 4)),
        lg.cpy(f32, ctx.new_tensor_2d(Type.BF16, 32, 4)),
    ]
    for t in refused:
        assert not ocl.supports_op(t), lg.op_desc(t)
    g = lg.Graph()
    lg.build_forward_expand(g, refused[0])
    with pytest.raises(lg.UnsupportedOpError, match="OpenCL backend cannot run ADD"):
        ocl.graph_compute(g)
    for t in (lg.add(f32, f32), lg.mul_mat(ctx.new_tensor_2d(Q4_K, 256, 4), ctx.new_tensor_2d(F32, 256, 3)),
              lg.cpy(f32, ctx.new_tensor_2d(F16, 32, 4)), lg.reshape_1d(f32, 128)):
        assert ocl.supports_op(t), lg.op_desc(t)


# -- registry ---------------------------------------------------------------------------------------------
def test_devices_are_named_and_typed(ocl):
    names = [lg.dev_get(i).name for i in range(lg.dev_count())]
    assert names[-1] == "CPU" and "OpenCL0" in names
    assert names.index("OpenCL0") < names.index("CPU")
    dev = lg.dev_by_name("OpenCL0")
    assert dev.get_type() == lg.DeviceType.GPU  # PoCL's CPU device too: see the module docstring
    assert dev.cl_device.platform.name.strip() in dev.get_description()
    assert dev.memory()[1] > 0
    with pytest.raises(ValueError, match="OpenCL99"):
        lg.backend_init_by_name("OpenCL99")


def test_device_selection_env(monkeypatch):
    monkeypatch.setattr(opencl, "_registry", None)
    monkeypatch.setenv("LAZYGGML_OPENCL_DEVICE", "no such device anywhere")
    with pytest.raises(RuntimeError, match="matches no OpenCL device"):
        opencl.registry()
    monkeypatch.setattr(opencl, "_registry", None)
    monkeypatch.setenv("LAZYGGML_OPENCL_DEVICE", "0")
    reg = opencl.registry()
    assert [d.name for d in reg.devices] == ["OpenCL0"]


def test_devices_are_not_listed_twice():
    devices = opencl.discover()
    keys = [(d.name, d.platform.name) for d in devices]
    assert len(set(keys)) == len(keys)
    assert len({d.int_ptr for d in devices}) == len(devices)


def _python(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_disable_env():
    r = _python("import lazyggml as lg; print([lg.dev_get(i).name for i in range(lg.dev_count())])",
                {**os.environ, "LAZYGGML_DISABLE_OPENCL": "1"})
    assert r.returncode == 0, r.stderr
    assert "OpenCL" not in r.stdout and "CPU" in r.stdout


# a small computation on OpenCL0, in a fresh process
RELU = ("import numpy as np, lazyggml as lg; from lazyggml.alloc import alloc_ctx_tensors\n"
        "be = lg.backend_init_by_name('OpenCL0')\n"
        "ctx = lg.Context(); a = ctx.new_tensor_1d(lg.F32, 64); out = lg.relu(a)\n"
        "g = lg.Graph(); lg.build_forward_expand(g, out); alloc_ctx_tensors(ctx, be)\n"
        "lg.tensor_set(a, np.ones(64, np.float32)); lg.backend_graph_compute(be, g)\n"
        "print(float(lg.tensor_get(out).sum()))")


def _cache_env(cache, **extra):
    """The environment with ``cache`` as lazyggml's cache, PoCL's inside it (lazyggml's default)."""
    env = {k: v for k, v in os.environ.items() if k not in ("POCL_CACHE_DIR", "LAZYGGML_DEBUG")}
    return {**env, "LAZYGGML_CACHE_DIR": str(cache), **extra}


def test_kernel_cache_is_under_lazyggml_cache_dir(tmp_path):
    """A fresh process builds the program and, on PoCL, leaves the compiled kernels in
    <LAZYGGML_CACHE_DIR>/pocl; a second process finds them there and compiles nothing new."""
    env = _cache_env(tmp_path)
    first = _python(RELU, env)
    assert first.returncode == 0, first.stderr
    assert float(first.stdout) == 64.0
    if not lg.dev_by_name("OpenCL0").pocl:
        return  # other drivers keep their per-launch compiles, if any, in caches of their own
    def cache():  # PoCL's own temporary files aside
        return sorted(p for p in (tmp_path / "pocl").rglob("*") if not p.name.startswith("tempfile"))

    cached = cache()
    assert cached, "PoCL wrote no kernel cache under LAZYGGML_CACHE_DIR"
    second = _python(RELU, env)
    assert second.returncode == 0, second.stderr
    assert cache() == cached


def test_program_binary_is_kept_and_a_corrupt_one_rebuilt(tmp_path):
    """The first process saves the program's binary in <cache>/opencl, a second loads it (no build
    from source); a truncated or garbled file, or one the driver refuses, is rebuilt, not a crash."""
    env = _cache_env(tmp_path)
    assert _python(RELU, env).returncode == 0
    [binary] = (tmp_path / "opencl").glob("*.bin")
    saved = binary.read_bytes()
    # the source is read once to name the binary's file, and once more by a build from source
    count_reads = ("import lazyggml.backends.opencl.backend as b; reads = []; source = b.program_source\n"
                   "b.program_source = lambda: reads.append(1) or source()\n"
                   "import atexit; atexit.register(lambda: print('source read', len(reads)))\n")
    r = _python(count_reads + RELU, env)
    assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["64.0", "source read 1"], r.stdout + r.stderr
    refused = hashlib.sha256(b"no program").digest() + b"no program"   # intact, but the driver says no
    for damaged in (saved[:len(saved) // 2], b"garbage", refused):
        binary.write_bytes(damaged)
        r = _python(count_reads + RELU, env)
        assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["64.0", "source read 2"], r.stdout + r.stderr
        assert binary.read_bytes() != damaged and lg.cache.read_entry(str(binary)), "the damaged binary was kept"


def test_compiler_warnings_only_with_debug(tmp_path):
    """A program whose source draws a compiler warning: built quietly, and with LAZYGGML_DEBUG=1
    the compiler's output is shown."""
    warn = ("import lazyggml.backends.opencl.backend as b; source = b.program_source\n"
            "b.program_source = lambda: source() + '__kernel void k_warn(__global float *x) { x[0] == 1.0f; }'\n")
    quiet = _python(warn + RELU, _cache_env(tmp_path / "quiet"))
    assert quiet.returncode == 0 and quiet.stdout.strip() == "64.0", quiet.stderr
    assert quiet.stderr == ""
    loud = _python(warn + RELU, _cache_env(tmp_path / "loud", LAZYGGML_DEBUG="1"))
    assert loud.returncode == 0, loud.stderr
    assert "OpenCL build log" in loud.stderr and "result unused" in loud.stderr


def test_read_only_cache_runs(tmp_path):
    """A cache folder that cannot be written (here: below a file): OpenCL runs all the same, with
    one line saying so; PoCL, which needs a cache folder it can write, gets a temporary one."""
    (tmp_path / "file").write_text("")
    r = _python(RELU, _cache_env(tmp_path / "file" / "cache"))
    assert r.returncode == 0 and r.stdout.strip() == "64.0", r.stderr
    assert r.stderr.count("not writable") == 1 and str(tmp_path / "file" / "cache") in r.stderr, r.stderr


def test_info_says_what_the_device_is(ocl, capsys):
    """OpenCL devices are scheduled as GPUs (see backend.py's docstring); `lazyggml info` says what
    they are, e.g. PoCL's "CPU device; scheduled as a GPU"."""
    from lazyggml.cli import main
    dev = lg.dev_by_name("OpenCL0")
    assert dev.get_type() == lg.DeviceType.GPU
    assert (dev.hardware_type == lg.DeviceType.CPU) == bool(dev.cl_device.type & opencl.cl.device_type.CPU)
    assert main(["info"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("OpenCL0: "))
    kind = "GPU" if dev.hardware_type == lg.DeviceType.GPU else f"{dev.hardware_type.name} device; scheduled as a GPU"
    assert line.endswith(f"({kind})"), line
