"""Every op against a float64 NumPy oracle, in the style of GGML's test-backend-ops.

The cases are the op-case catalogue, ``lazyggml.op_cases.CASES`` (op x types x shapes:
broadcasting, strided and permuted views, the ``_inplace`` twins, YaRN rope, ALiBi soft_max, every
weight type of mul_mat, get_rows, set_rows and cpy, the threaded sizes, an attention block, ...),
which ``lazyggml warmup`` and ``lazyggml info`` read as well. ``run_case(case, backend)`` fills a
case's inputs, computes it and compares it with the case's oracle by GGML's normalized mean squared
error, after checking that NaN and Inf agree and that no input other than the outputs' own memory
was written (``op_cases``' docstring has the details). Here every case runs on the CPU, directly
and with every tensor placed by ``Gallocr``; ``test_opencl.py`` and ``test_cuda.py`` run the same
table on their backends.

The seed is random per session unless ``LAZYGGML_TEST_SEED`` is set; a failure prints it.

Below the table: the CPU's own behaviours (argmax ties, out-of-range rows, refused types, plans
replayed across allocations, F16/BF16 rounding), the graph-building errors of every op, and parity
with libggml itself.
"""
from __future__ import annotations

import numpy as np
import pytest

import lazyggml as lg
from lazyggml import quants
from lazyggml.backend import backend_graph_compute, tensor_get, tensor_set
from lazyggml.backends.cpu import CPUBackend, backend_cpu_init, cpu_device, simd
from lazyggml.backends.cpu.params import ALWAYS_PARALLEL, NEVER_PARALLEL
from lazyggml.op_cases import CASES, SEED, f32, new, nmse, run_case, to_bf16_bits

F32, F16, BF16, I32 = lg.F32, lg.F16, lg.BF16, lg.I32
Q4_0, Q8_0, Q4_K = lg.Q4_0, lg.Q8_0, lg.Q4_K


# ===================================================================================================
# the op-case catalogue on the CPU
# ===================================================================================================
_names = [c.name for c in CASES]


@pytest.fixture(scope="module")
def cpu():
    return backend_cpu_init()


@pytest.mark.parametrize("case", CASES, ids=_names)
def test_cpu(case, cpu):
    assert run_case(case, cpu) == "ok", f"{case.name}: the CPU backend does not support it"


@pytest.mark.parametrize("case", CASES, ids=_names)
def test_cpu_through_gallocr(case, cpu):
    """The same cases with every intermediate placed by the static allocator."""
    assert run_case(case, cpu, gallocr=True) == "ok", f"{case.name}: the CPU backend does not support it"


# ===================================================================================================
# every parallel kernel as a job of the CPU backend's thread pool
# ===================================================================================================
# The families whose kernels split their rows or tiles over threads (common.parallel_kernel, the
# products' and MUL_MAT_ID's tasks, flash attention's tiles).
_POOLED_FAMILIES = ("mul_mat", "unary", "binary", "glu", "norm", "rope", "soft_max", "flash_attn", "attention")


@pytest.fixture
def every_kernel_pooled(cpu, monkeypatch):
    """Every parallel kernel takes its pool job, whatever its size (the thresholds at 0)."""
    monkeypatch.setattr(cpu, "thresholds", ALWAYS_PARALLEL)


@pytest.mark.parametrize("case", [c for c in CASES if c.family in _POOLED_FAMILIES],
                         ids=[c.name for c in CASES if c.family in _POOLED_FAMILIES])
def test_cpu_every_kernel_on_the_pool(case, cpu, every_kernel_pooled):
    """The catalogue's cases of the parallel families, every kernel split into chunks on the pool
    (the backend's workers active), against their oracles on this session's random data."""
    assert run_case(case, cpu) == "ok", f"{case.name}: the CPU backend does not support it"


def _bits_alone_and_pooled(specs, datas, build):
    """The result's bytes computed with every kernel on this thread, then with every kernel a pool job."""
    return [run_lazyggml(specs, datas, build, CPUBackend(cpu_device(), thresholds=thresholds))
            for thresholds in (NEVER_PARALLEL, ALWAYS_PARALLEL)]


_POOL_BITS = [   # (name, input specs, build): shapes with rows or tiles that do not divide evenly
    ("rms_norm", [f32(256, 37, 3)], lambda a: lg.rms_norm(a, 1e-6)),
    ("add, b repeated over rows", [f32(256, 37, 3), f32(256, 1, 3)], lambda a, b: lg.add(a, b)),
    ("mul, b tiled along dim 0", [f32(256, 37, 3), f32(64, 37, 3)], lambda a, b: lg.mul(a, b)),
    ("silu", [f32(300, 41)], lambda a: lg.silu(a)),
    ("swiglu", [f32(512, 41)], lambda a: lg.swiglu(a)),
    ("soft_max_ext with a mask", [f32(96, 70, 4), f32(96, 70)], lambda a, m: lg.soft_max_ext(a, m, 0.125)),
    ("flash_attn_ext, tiled", [f32(64, 130, 4), (F16, (64, 160, 2)), (F16, (64, 160, 2))],
     lambda q, k, v: lg.flash_attn_ext(q, k, v, None, 0.125)),
    ("mul_mat Q4_K, 40 columns", [(Q4_K, (512, 72)), f32(512, 40)], lambda w, x: lg.mul_mat(w, x)),
    ("mul_mat F16, 40 columns", [(F16, (256, 72)), f32(256, 40)], lambda w, x: lg.mul_mat(w, x)),
]


@pytest.mark.parametrize("name, specs, build", _POOL_BITS, ids=[p[0] for p in _POOL_BITS])
def test_pool_jobs_give_the_bits_of_one_thread(name, specs, build):
    """A kernel's chunks on the pool compute exactly what it computes alone: the same bits."""
    rng = np.random.default_rng(SEED)
    datas = []
    for t, ne in specs:
        x = rng.uniform(-1, 1, tuple(reversed(ne))).astype(np.float32)
        datas.append(x.astype(np.float16) if t == F16 else
                     quants.quantize(t, x.reshape(-1, ne[0])).reshape(-1) if t == Q4_K else x)
    alone, pooled = _bits_alone_and_pooled(specs, datas, build)
    assert np.array_equal(alone, pooled), f"{name}: the pool's result differs from one thread's (seed {SEED})"


def test_no_kernel_a_plan_runs_is_an_openmp_region():
    """The CPU kernels are plain or pool jobs; Numba's OpenMP regions (parallel=True) are left only
    in convert.py's row quantizers, which Python steps call (model loading, quantized KV caches)."""
    import importlib
    import pkgutil
    from numba.core.registry import CPUDispatcher
    import lazyggml.backends.cpu as cpu_pkg
    regions = []
    for info in pkgutil.iter_modules(cpu_pkg.__path__):
        mod = importlib.import_module(f"lazyggml.backends.cpu.{info.name}")
        for name, obj in vars(mod).items():
            for d in (obj, getattr(obj, "run", None)):
                if isinstance(d, CPUDispatcher) and d.targetoptions.get("parallel"):
                    regions.append(f"{info.name}.{name}")
    assert sorted(set(regions)) == ["convert.dequantize_rows_parallel", "convert.quantize_rows_parallel"]


def compute(cpu, build, *datas):
    """Build ``build(*leafs)`` over F32/F16/I32 leafs made from ``datas`` (NumPy order), compute it
    on the CPU and return the result's NumPy array."""
    ctx = lg.Context(no_alloc=False)
    with ctx:
        types = {np.dtype(np.float32): F32, np.dtype(np.float16): F16, np.dtype(np.int32): I32}
        leafs = [ctx.new_tensor(types[d.dtype], tuple(reversed(d.shape))) for d in datas]
        out = build(*leafs)
    for t, d in zip(leafs, datas):
        tensor_set(t, d)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    cpu.graph_compute(g)
    return tensor_get(out)


def test_argmax_ties_keep_the_last_maximum(cpu):
    """GGML's CPU loop (``max = MAX(max, x); if (max == x) idx = i``) returns the LAST of equal
    maxima; checked against libggml: [1, 3, 3, 2] -> 2 and [5, 5, 0, 5] -> 3."""
    got = compute(cpu, lg.argmax, np.array([[1, 3, 3, 2], [5, 5, 0, 5]], np.float32))
    assert got.ravel().tolist() == [2, 3]


def test_get_rows_index_out_of_range_raises(cpu):
    with pytest.raises(IndexError, match="out of range"):
        compute(cpu, lg.get_rows, np.zeros((3, 4), np.float32), np.array([1, 3], np.int32))
    with pytest.raises(IndexError, match="out of range"):
        compute(cpu, lambda a, b, c: lg.set_rows(a, b, c), np.zeros((3, 4), np.float32),
                np.ones((2, 4), np.float32), np.array([0, -1], np.int32))


def test_replayed_get_rows_still_checks_its_indices(cpu):
    """A replayed plan calls the row kernels' compiled code directly: indices set after the first
    run are still checked, and good ones still gathered."""
    ctx = lg.Context(no_alloc=False)
    a, idx = ctx.new_tensor_2d(F32, 4, 3), ctx.new_tensor_1d(I32, 2)
    out = lg.get_rows(a, idx)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    rows = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    tensor_set(a, rows)
    for ids in ([2, 0], [1, 1], [0, 2]):
        tensor_set(idx, np.array(ids, np.int32))
        cpu.graph_compute(g)
        np.testing.assert_array_equal(tensor_get(out).reshape(2, 4), rows[ids])
    tensor_set(idx, np.array([1, 3], np.int32))
    with pytest.raises(IndexError, match="get_rows: 1 indices out of range"):
        cpu.graph_compute(g)


@pytest.mark.parametrize("wtype, n_threads", [(Q4_K, 1), (Q4_K, 2), (F16, 2)])
def test_mul_mat_id_checks_its_expert_ids_at_every_run(cpu, wtype, n_threads):
    """Expert ids are data: a replayed MUL_MAT_ID plan computes new good ones and raises for one
    outside [0, n_expert), on one thread and on several (a product large enough to go parallel)."""
    ctx = lg.Context(no_alloc=False)
    w, x, ids = ctx.new_tensor_3d(wtype, 256, 512, 4), ctx.new_tensor_3d(F32, 256, 1, 3), ctx.new_tensor_2d(I32, 2, 3)
    out = lg.mul_mat_id(w, x, ids)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    rng = np.random.default_rng(3)
    wf = rng.uniform(-1, 1, (4, 512, 256)).astype(np.float32)
    tensor_set(w, quants.quantize(wtype, wf.reshape(-1, 256)) if lg.is_quantized(wtype) else wf.astype(np.float16))
    wd = lg.dequantize(wtype, lg.tensor_get_bytes(w), 256).reshape(4, 512, 256) if lg.is_quantized(wtype) else \
        wf.astype(np.float16).astype(np.float64)
    xs = rng.uniform(-1, 1, (3, 1, 256)).astype(np.float32)
    tensor_set(x, xs)
    before = cpu.n_threads
    lg.set_n_threads(cpu, n_threads)
    try:
        for chosen in ([[0, 3], [2, 1], [3, 3]], [[1, 0], [0, 2], [2, 3]]):
            tensor_set(ids, np.array(chosen, np.int32))
            cpu.graph_compute(g)
            want = np.stack([[wd[e] @ xs[t, 0] for e in chosen[t]] for t in range(3)])
            assert nmse(tensor_get(out).reshape(3, 2, 512), want) < 5e-4
        tensor_set(ids, np.array([[0, 1], [4, 2], [-1, 0]], np.int32))
        with pytest.raises(IndexError, match="mul_mat_id: expert ids: 2 indices out of range \\[0, 4\\)"):
            cpu.graph_compute(g)
    finally:
        lg.set_n_threads(cpu, before)


def test_f32_rows_to_f16_round_as_numpy_does():
    """The CPU's F32 -> F16 row conversion (the KV cache's writes; 8 lanes at a time, then a tail)
    rounds to nearest even like NumPy's float16, subnormals, overflow and signed zeros included."""
    from lazyggml.backends.cpu import common as C
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-9, 6, 1000),
                        [0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 6e-8, 2.9e-8, -6.1e-5, 1e-10]])
    x = x.astype(np.float32)
    got = np.zeros(x.size, np.uint16)
    C.convert_row(x.view(np.uint32), C.KIND_F32, got, C.KIND_F16)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, x.astype(np.float16).view(np.uint16))
    strided = np.zeros(2 * x.size, np.uint16)   # a destination whose elements are not packed
    C.convert_row(x.view(np.uint32), C.KIND_F32, strided[::2], C.KIND_F16)
    np.testing.assert_array_equal(strided[::2], got)


def test_unsupported_types_are_refused(cpu):
    """supports_op is honest: F16 arithmetic is not implemented, and compute says so."""
    ctx = lg.Context(no_alloc=False)
    a, b = ctx.new_tensor_2d(F16, 4, 3), ctx.new_tensor_2d(F16, 4, 3)
    for out in (lg.add(a, b), lg.rms_norm(a), lg.soft_max(a), lg.silu(a), lg.sum_rows(a), lg.argmax(a)):
        assert not cpu.device.supports_op(out)
    g = lg.Graph()
    lg.build_forward_expand(g, lg.add(a, b))
    with pytest.raises(lg.UnsupportedOpError, match="CPU backend cannot run ADD"):
        cpu.graph_compute(g)


def test_replayed_plan_reads_new_data_and_follows_moved_tensors(cpu):
    """The CPU backend replays a graph's plan: new input values must be read, and tensors placed
    elsewhere (a new buffer, as after a re-allocation) must be used where they are now."""
    from lazyggml.alloc import alloc_ctx_tensors_from_buft
    from lazyggml.backends.cpu import cpu_buffer_type
    ctx = lg.Context(no_alloc=True)
    with ctx:
        a, w = ctx.new_tensor_2d(F32, 64, 3), ctx.new_tensor_2d(F16, 64, 5)
        out = lg.rms_norm(lg.mul_mat(w, lg.add(a, a)), 1e-6)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    rng = np.random.default_rng(SEED)
    wv = rng.standard_normal((5, 64)).astype(np.float16)
    for placement in range(2):
        buf = alloc_ctx_tensors_from_buft(ctx, cpu_buffer_type())
        tensor_set(w, wv)
        for _ in range(2):
            av = rng.standard_normal((3, 64)).astype(np.float32)
            tensor_set(a, av)
            cpu.graph_compute(g)
            y = (2.0 * av) @ wv.T.astype(np.float64)
            want = y / np.sqrt((y * y).mean(axis=1, keepdims=True) + 1e-6)
            assert np.allclose(tensor_get(out), want, rtol=1e-2, atol=1e-2)
        buf.free()
        for t in (a, w, out) + tuple(n for n in g.nodes):
            t.buffer = t.offset = None


def test_plan_survives_other_graphs_allocations(cpu):
    """Allocating other tensors (another graph, as a prompt batch between decode steps) keeps a
    graph's plan; moving one of its own tensors rebuilds it."""
    from lazyggml.alloc import alloc_ctx_tensors_from_buft
    from lazyggml.backends.cpu import cpu_buffer_type
    ctx = lg.Context(no_alloc=True)
    with ctx:
        a = ctx.new_tensor_1d(F32, 16)
        out = lg.scale(a, 3.0)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    alloc_ctx_tensors_from_buft(ctx, cpu_buffer_type())
    tensor_set(a, np.arange(16, dtype=np.float32))
    cpu.graph_compute(g)
    plan = cpu._plan(g)
    other = lg.Context(no_alloc=True)
    other.new_tensor_1d(F32, 8)
    alloc_ctx_tensors_from_buft(other, cpu_buffer_type())      # moves the epoch, not our tensors
    cpu.graph_compute(g)
    assert cpu._plan(g) is plan
    a.buffer, a.offset = out.buffer, out.offset                 # a now lives where out does
    tensor_set(a, np.ones(16, np.float32))
    cpu.graph_compute(g)
    assert cpu._plan(g) is not plan and np.array_equal(tensor_get(out).ravel(), np.full(16, 3.0))


@pytest.mark.parametrize("n_cols", [5, 1], ids=["batch", "decode"])
def test_products_of_one_input_quantize_it_once(cpu, n_cols):
    """Quantized products of the same activations one after the other (Q, K, V) quantize them once
    per plan; a node that writes those activations in between (an in-place add) makes the next
    product quantize them again. A single column is quantized by its first product's own call
    (``_matvec``); the next product runs without quantizing (``_rows_chunk``). Every result equals
    its product computed alone."""
    from lazyggml.alloc import alloc_ctx_tensors_from_buft
    from lazyggml.backends.cpu import cpu_buffer_type, matmul
    Q4_K = lg.Type.Q4_K
    rng = np.random.default_rng(SEED)
    ws = [quants.quantize(Q4_K, rng.uniform(-1, 1, (8, 256)).astype(np.float32)) for _ in range(4)]
    ctx = lg.Context(no_alloc=True)
    with ctx:
        x, b = ctx.new_tensor_2d(F32, 256, n_cols), ctx.new_tensor_2d(F32, 256, n_cols)
        w = [ctx.new_tensor_2d(Q4_K, 256, 8) for _ in ws]
        y0, y1 = lg.mul_mat(w[0], x), lg.mul_mat(w[1], x)
        x2 = lg.add_inplace(x, b)                 # x's memory, written after y0 and y1 read it
        y2, y3 = lg.mul_mat(w[2], x2), lg.mul_mat(w[3], x2)
    g = lg.Graph()
    for y in (y0, y1, y2, y3):
        lg.build_forward_expand(g, y)
    alloc_ctx_tensors_from_buft(ctx, cpu_buffer_type())
    xv, bv = rng.uniform(-1, 1, (2, n_cols, 256)).astype(np.float32)
    for t, v in [(x, xv), (b, bv)] + list(zip(w, ws)):
        tensor_set(t, v)
    cpu.graph_compute(g)
    names = [getattr(k, "__name__", "") for k, _ in cpu._plan(g).calls]
    quantizing = ("_matvec",) if n_cols == 1 else ("_quantize_acts",)
    assert len([n for n in names if n.startswith(quantizing)]) == 2, names
    for run in range(2):   # the plan's first run from Python, then replayed (backends/cpu/replay.py)
        for y, wv, xin in [(y0, ws[0], xv), (y1, ws[1], xv), (y2, ws[2], xv + bv), (y3, ws[3], xv + bv)]:
            alone = matmul.mul_mat(wv.reshape(1, 1, 8, -1), Q4_K, xin.reshape(1, 1, n_cols, 256),
                                   np.empty((1, 1, n_cols, 8), np.float32))
            assert np.array_equal(tensor_get(y).reshape(n_cols, 8), alone.reshape(n_cols, 8))
        xv = rng.uniform(-1, 1, (n_cols, 256)).astype(np.float32)
        tensor_set(x, xv)
        cpu.graph_compute(g)


def test_ropes_of_one_position_tensor_share_their_cache(cpu):
    """Ropes with the same positions and parameters (Q and K of every layer) make their cos/sin
    cache once per plan; other parameters make their own. Each result equals its rope alone."""
    from lazyggml.alloc import alloc_ctx_tensors_from_buft
    from lazyggml.backends.cpu import cpu_buffer_type
    rng = np.random.default_rng(SEED)
    ctx = lg.Context(no_alloc=True)
    with ctx:
        q, k = ctx.new_tensor_3d(F32, 64, 4, 3), ctx.new_tensor_3d(F32, 64, 2, 3)
        pos = ctx.new_tensor_1d(lg.Type.I32, 3)
        outs = [lg.rope(q, pos, 64, 0), lg.rope(k, pos, 64, 0), lg.rope(q, pos, 32, 2)]
    g = lg.Graph()
    for o in outs:
        lg.build_forward_expand(g, o)
    alloc_ctx_tensors_from_buft(ctx, cpu_buffer_type())
    qv, kv = rng.uniform(-1, 1, (3, 4, 64)).astype(np.float32), rng.uniform(-1, 1, (3, 2, 64)).astype(np.float32)
    pv = np.array([5, 900, 17], np.int32)
    for t, v in ((q, qv), (k, kv), (pos, pv)):
        tensor_set(t, v)
    cpu.graph_compute(g)
    caches = [f for f, _ in cpu._plan(g).calls if getattr(f, "__name__", "") == "rope_cache"]
    assert len(caches) == 2
    for o, (x, n_dims, mode) in zip(outs, [(qv, 64, 0), (kv, 64, 0), (qv, 32, 2)]):
        alone = compute(cpu, lambda a, p: lg.rope(a, p, n_dims, mode), x, pv)
        assert np.array_equal(tensor_get(o).reshape(x.shape), alone.reshape(x.shape))


def test_float16_rounding_matches_numpy(cpu):
    """F32 -> F16 rounds to nearest even, overflows to inf, keeps NaN and subnormals (F16C's)."""
    special = np.array([0.0, -0.0, 65504.0, 65519.0, 65520.0, -1e9, np.inf, -np.inf, np.nan, 1e-8,
                        5.96e-8, 2.98e-8, 3e-8, 6.1e-5, 1 + 2**-11, 1 + 3 * 2**-11], np.float32)
    x = np.concatenate([special, np.random.default_rng(SEED).standard_normal(1008).astype(np.float32) * 1e3])
    got = compute(cpu, lambda a: lg.cpy(a, new(F16, x.size)), x).ravel()
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(want)
    assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(got[nan]).all()


def test_bf16_rounding(cpu):
    x = np.random.default_rng(SEED).standard_normal(512).astype(np.float32)
    got = compute(cpu, lambda a: lg.cpy(a, new(BF16, x.size)), x)
    assert np.array_equal(got.ravel(), to_bf16_bits(x))


# ===================================================================================================
# graph-building errors: every op checks its operands where GGML asserts, raising ValueError that
# names the op
# ===================================================================================================
def _t(*ne, type_=F32):
    return lg.Context().new_tensor(type_, ne)


_BAD = [  # (the op named in the message, a thunk that must raise)
    ("add", lambda: lg.add(_t(4, 3), _t(3))),
    ("add", lambda: lg.add(_t(4, 3), _t(4, 2))),
    ("sub", lambda: lg.sub(_t(4, 3, 2), _t(4, 3, 4))),
    ("mul", lambda: lg.mul(_t(6), 2.0)),
    ("div", lambda: lg.div_inplace(_t(4), _t(8))),
    ("add1", lambda: lg.add1(_t(4), _t(2))),
    ("concat", lambda: lg.concat(_t(4, 3), _t(4, 3, type_=F16), 0)),
    ("concat", lambda: lg.concat(_t(4, 3), _t(4, 3), 4)),
    ("concat", lambda: lg.concat(_t(4, 3), _t(5, 2), 1)),
    ("repeat", lambda: lg.repeat(_t(3), _t(4))),
    ("silu", lambda: lg.silu(lg.transpose(_t(4, 3)))),
    ("gelu", lambda: lg.gelu(np.zeros(4, np.float32))),
    ("scale", lambda: lg.scale(lg.transpose(_t(4, 3)), 2.0)),
    ("clamp", lambda: lg.clamp(_t(4), 1.0, -1.0)),
    ("argmax", lambda: lg.argmax(_t(4, 3, 2))),
    ("norm", lambda: lg.norm(_t(4), -1e-5)),
    ("rms_norm", lambda: lg.rms_norm(_t(4), -1.0)),
    ("mul_mat", lambda: lg.mul_mat(_t(4, 3), _t(5, 2))),
    ("mul_mat", lambda: lg.mul_mat(_t(4, 3, 2), _t(4, 2, 3))),
    ("get_rows", lambda: lg.get_rows(_t(4, 3), _t(2))),
    ("get_rows", lambda: lg.get_rows(_t(4, 3, 2), _t(2, 3, type_=I32))),
    ("get_rows", lambda: lg.get_rows(_t(4, 3), [0, 1])),
    ("set_rows", lambda: lg.set_rows(_t(4, 5), _t(4, 2, type_=F16), _t(2, type_=I32))),
    ("set_rows", lambda: lg.set_rows(_t(4, 5), _t(4, 2), _t(2))),
    ("set_rows", lambda: lg.set_rows(_t(4, 5), _t(3, 2), _t(2, type_=I32))),
    ("set_rows", lambda: lg.set_rows(_t(4, 5), _t(4, 2), _t(3, type_=I32))),
    ("soft_max", lambda: lg.soft_max(lg.transpose(_t(4, 3)))),
    ("soft_max", lambda: lg.soft_max_ext(_t(4, 3), _t(4, 3, type_=I32))),
    ("soft_max", lambda: lg.soft_max_ext(_t(4, 3), _t(5, 3))),
    ("soft_max", lambda: lg.soft_max_ext(_t(4, 3), _t(4, 2))),
    ("soft_max", lambda: lg.soft_max_ext(_t(4, 3, 4), _t(4, 3, 3))),
    ("soft_max", lambda: lg.soft_max_ext(_t(4, 3), None, 1.0, 8.0)),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4, type_=F16), _t(8, 5, 2, type_=F16), _t(8, 5, 2))),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(8, 5, 2, type_=BF16), _t(8, 5, 2, type_=BF16))),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(8, 5, 2, type_=F16), _t(8, 5, 2))),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(6, 5, 2), _t(8, 5, 2))),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(8, 5, 3), _t(8, 5, 3))),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(8, 5, 2), _t(8, 6, 2))),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(8, 5, 2), _t(8, 5, 2), _t(5, 1, type_=F16))),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(8, 5, 2), _t(8, 5, 2), _t(4, 2, type_=F16))),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(8, 5, 2), _t(8, 5, 2), _t(5, 2, 3, type_=F16))),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(8, 5, 2), _t(8, 5, 2), _t(5, 2, type_=I32))),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(8, 5, 2), _t(8, 5, 2), lg.transpose(_t(2, 5, type_=F16)))),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(8, 5, 2), _t(8, 5, 2), _t(5, 2))),   # an F32 mask
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), _t(8, 5, 2), _t(8, 5, 2), None, 1.0, 8.0)),
    ("flash_attn_ext", lambda: lg.flash_attn_ext(_t(8, 2, 4), lg.transpose(_t(5, 8)), _t(8, 5))),
    ("flash_attn_ext_set_prec", lambda: lg.flash_attn_ext_set_prec(lg.soft_max(_t(4, 3)), lg.PREC_F32)),
    ("rope", lambda: lg.rope(_t(8, 2, 3), _t(3, type_=I32), 8, 1)),
    ("rope", lambda: lg.rope(_t(8, 2, 3), _t(3), 8, 0)),
    ("rope", lambda: lg.rope(_t(8, 2, 3), _t(4, type_=I32), 8, 0)),
    ("rope", lambda: lg.rope(_t(8, 2, 3), _t(3, type_=I32), 7, 0)),
    ("rope", lambda: lg.rope(_t(8, 2, 3), _t(3, type_=I32), 10, 0)),
    ("rope", lambda: lg.rope_ext(_t(8, 2, 3), _t(3, type_=I32), _t(2), 8, 0)),
    ("argsort", lambda: lg.argsort(_t(4, 3, type_=I32))),
    ("argsort", lambda: lg.argsort(_t(4, 3), 2)),
    ("argsort_top_k", lambda: lg.argsort_top_k(_t(4, 3), 5)),
    ("mul_mat_id", lambda: lg.mul_mat_id(_t(8, 4, 3), _t(8, 1, 2), _t(2, 2))),                    # F32 ids
    ("mul_mat_id", lambda: lg.mul_mat_id(_t(8, 4, 3), _t(6, 1, 2), _t(2, 2, type_=I32))),        # k differs
    ("mul_mat_id", lambda: lg.mul_mat_id(_t(8, 4, 3), _t(8, 1, 3), _t(2, 2, type_=I32))),        # tokens differ
    ("mul_mat_id", lambda: lg.mul_mat_id(_t(8, 4, 3), _t(8, 3, 2), _t(2, 2, type_=I32))),        # no broadcast
    ("mul_mat_id", lambda: lg.mul_mat_id(_t(8, 4, 3, 2), _t(8, 1, 2), _t(2, 2, type_=I32))),     # 4-D experts
    ("mul_mat_id", lambda: lg.mul_mat_id(_t(8, 4, 3, type_=I32), _t(8, 1, 2), _t(2, 2, type_=I32))),
    ("swiglu", lambda: lg.swiglu(_t(5, 2))),
    ("geglu", lambda: lg.geglu_split(_t(4, 2), _t(4, 3))),
    ("reglu", lambda: lg.reglu_split(_t(4, 2), _t(4, 2, type_=F16))),
    ("pad", lambda: lg.pad_ext(_t(4, 2), -1, 0)),
    ("pad", lambda: lg.pad(_t(4, 2), 1.5)),
    ("reshape", lambda: lg.reshape_2d(lg.transpose(_t(4, 3)), 4, 3)),
    ("reshape", lambda: lg.reshape(_t(4, 3), _t(5, 2))),
    ("view", lambda: lg.view_1d(_t(4, 3), 4, 36)),
    ("view", lambda: lg.view_2d(_t(4, 3), 4, 3, 20, 0)),
    ("view", lambda: lg.view_1d(_t(4), 2, -4)),
    ("permute", lambda: lg.permute(_t(4, 3), 0, 1, 1, 3)),
    ("cpy", lambda: lg.cpy(_t(4, 3), _t(4, 4))),
    ("cont", lambda: lg.cont_2d(_t(4, 3), 5, 2)),
    ("dup", lambda: lg.dup(None)),
    ("sum_rows", lambda: lg.sum_rows("a")),
    ("diag_mask_inf", lambda: lg.diag_mask_inf(3, 0)),
    ("new_tensor", lambda: lg.Context().new_tensor(F32, [1, 2, 3, 4, 5])),
    ("new_tensor", lambda: lg.Context().new_tensor_2d(F32, 4, -1)),
]


@pytest.mark.parametrize("op, thunk", _BAD, ids=[f"{op}-{i}" for i, (op, _) in enumerate(_BAD)])
def test_graph_building_errors(op, thunk):
    with pytest.raises(ValueError) as e:
        thunk()
    assert op in str(e.value), str(e.value)


# ===================================================================================================
# parity with libggml itself (ggml-python, a test dependency): the same inputs through GGML's CPU
# backend. Most ops are bit-identical (GELU too: GGML's fp16 lookup tables); the exceptions are
# its exp (SILU, SWIGLU, SOFT_MAX: the AVX-512 build's ggml_v_expf rounds differently from the
# AVX2 one that lazyggml follows) and NORM's variance (summed in SIMD lanes, in an order that
# depends on the build), compared by NMSE instead.
# ===================================================================================================
_EXP_BITS = not simd.HAVE_AVX512   # GGML's AVX2 exponentials, which lazyggml's CPU kernels follow


def _ggml():
    import ggml   # ggml-python, the GGML oracle (the test extra installs it)
    return ggml


def run_libggml(specs, datas, build, n_threads=1):
    """Build ``build(ggml, ctx, *inputs)`` with libggml, fill, compute on ``n_threads``, return the raw
    result."""
    import ctypes
    gg = _ggml()
    ctx = gg.ggml_init(gg.ggml_init_params(mem_size=64 << 20, mem_buffer=None, no_alloc=False))
    try:
        ins = []
        for (t, ne), d in zip(specs, datas):
            x = gg.ggml_new_tensor_4d(ctx, getattr(gg, f"GGML_TYPE_{t.name}"), *(list(ne) + [1] * (4 - len(ne))))
            ctypes.memmove(gg.ggml_get_data(x), np.ascontiguousarray(d).ctypes.data, gg.ggml_nbytes(x))
            ins.append(x)
        out = build(gg, ctx, *ins)
        gf = gg.ggml_new_graph(ctx)
        gg.ggml_build_forward_expand(gf, out)
        gg.ggml_graph_compute_with_ctx(ctx, gf, n_threads)
        return np.frombuffer(ctypes.string_at(gg.ggml_get_data(out), gg.ggml_nbytes(out)), np.uint8).copy()
    finally:
        gg.ggml_free(ctx)


def run_lazyggml(specs, datas, build, backend):
    ctx = lg.Context(no_alloc=False)
    ins = [ctx.new_tensor(t, ne) for t, ne in specs]
    for t, d in zip(ins, datas):
        tensor_set(t, d)
    out = build(*ins)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    backend_graph_compute(backend, g)   # compute and wait, as ggml_backend_graph_compute
    return lg.tensor_get_bytes(out)


def _rand(*shape, lo=-1.0, hi=1.0):
    return lambda rng: rng.uniform(lo, hi, shape).astype(np.float32)


def _positions(n, hi):
    return lambda rng: rng.integers(0, hi, n).astype(np.int32)


_PARITY = []


def parity(name, specs, makers, build_lg, gg_op, *gg_args, exact=True):
    """libggml's side is ``ggml_<gg_op>(ctx, *inputs, *gg_args)``."""
    def build_gg(g, c, *xs):
        return getattr(g, "ggml_" + gg_op)(c, *xs, *gg_args)
    _PARITY.append((name, specs, makers, build_lg, build_gg, exact))


_YARN = (512, 10000.0, 0.25, 1.0, 0.9, 32.0, 1.0)   # n_ctx_orig .. beta_slow
parity("rope normal yarn ff", [f32(64, 3, 7, 2), (I32, (7,)), f32(24)],
       [_rand(2, 7, 3, 64), _positions(7, 3000), _rand(24, lo=0.9, hi=1.1)],
       lambda x, p, f: lg.rope_ext(x, p, f, 48, 0, *_YARN), "rope_ext", 48, 0, *_YARN)
parity("rope neox yarn", [f32(64, 3, 7, 2), (I32, (7,))], [_rand(2, 7, 3, 64), _positions(7, 3000)],
       lambda x, p: lg.rope_ext(x, p, None, 64, 2, *_YARN), "rope_ext", None, 64, 2, *_YARN)
parity("rope neox", [f32(128, 4, 9), (I32, (9,))], [_rand(9, 4, 128), _positions(9, 5000)],
       lambda x, p: lg.rope_ext(x, p, None, 128, 2, 0, 500000.0),
       "rope_ext", None, 128, 2, 0, 500000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
parity("rms_norm", [f32(100, 4, 3)], [_rand(3, 4, 100)], lambda x: lg.rms_norm(x, 1e-6), "rms_norm", 1e-6)
parity("scale_bias", [f32(100, 4)], [_rand(4, 100)], lambda x: lg.scale_bias(x, 0.7, 0.2),
       "scale_bias", 0.7, 0.2)
parity("clamp", [f32(100, 4)], [_rand(4, 100)], lambda x: lg.clamp(x, -0.7, 0.2), "clamp", -0.7, 0.2)
parity("sum_rows", [f32(100, 4, 3)], [_rand(3, 4, 100)], lg.sum_rows, "sum_rows")
parity("mean", [f32(100, 4, 3)], [_rand(3, 4, 100)], lg.mean, "mean")
parity("argmax ties", [f32(4, 2)], [lambda r: np.array([[1, 3, 3, 2], [5, 5, 0, 5]], np.float32)],
       lg.argmax, "argmax")
parity("argsort desc", [f32(40, 6, 2)], [_rand(2, 6, 40)], lambda x: lg.argsort(x, lg.SortOrder.DESC),
       "argsort", 1)   # GGML_SORT_ORDER_DESC
# mixture of experts: ids per token, distinct, and activations broadcast (n_b=1) or one row per expert used
for _type in (F32, F16, Q4_0, Q8_0, Q4_K, lg.Q6_K, lg.IQ4_XS):
    for _n_b in (1, 2):
        parity(f"mul_mat_id {_type.name} n_b={_n_b}", [(_type, (256, 33, 6)), f32(256, _n_b, 5), (I32, (2, 5))],
               [lambda r, t=_type: (quants.quantize(t, r.uniform(-1, 1, (6 * 33, 256))) if lg.is_quantized(t)
                                    else r.uniform(-1, 1, (6, 33, 256)).astype(np.float16 if t == F16 else np.float32)),
                _rand(5, _n_b, 256), lambda r: np.stack([r.permutation(6)[:2] for _ in range(5)]).astype(np.int32)],
               lg.mul_mat_id, "mul_mat_id", exact=lg.is_quantized(_type))   # float products: mul_mat's lanes
parity("div broadcast", [f32(100, 4, 3), f32(100, 1, 3)], [_rand(3, 4, 100), _rand(3, 1, 100, lo=0.5, hi=2)],
       lg.div, "div")
parity("diag_mask_inf", [f32(10, 10, 2)], [_rand(2, 10, 10)], lambda x: lg.diag_mask_inf(x, 2),
       "diag_mask_inf", 2)
parity("get_rows q4_K", [(Q4_K, (256, 9)), (I32, (4,))],
       [lambda r: quants.quantize(Q4_K, r.uniform(-1, 1, (9, 256))),
        lambda r: np.array([3, 0, 8, 3], np.int32)],
       lg.get_rows, "get_rows")
parity("concat dim 1", [f32(6, 5, 4), f32(6, 2, 4)], [_rand(4, 5, 6), _rand(4, 2, 6)],
       lambda a, b: lg.concat(a, b, 1), "concat", 1)
for _type in (F16, BF16, Q4_0, Q8_0, Q4_K):
    parity(f"cpy f32 -> {_type.name}", [f32(256, 3), (_type, (256, 3))],
           [_rand(3, 256), lambda r, t=_type: np.zeros(3 * lg.row_size(t, 256), np.uint8)], lg.cpy, "cpy")
# F16 sources make values that land near a half step of Q8_0 common: GGML's CPU from_float rounds them
parity("cpy f16 -> Q8_0", [(F16, (256, 8)), (Q8_0, (256, 8))],
       [lambda r: r.uniform(-1, 1, (8, 256)).astype(np.float16),
        lambda r: np.zeros(8 * lg.row_size(Q8_0, 256), np.uint8)], lg.cpy, "cpy")
for _name in ("tanh", "elu", "sigmoid", "exp", "hardswish", "hardsigmoid", "sqr", "sin", "cos", "abs", "sgn",
              "step", "relu", "neg", "gelu_erf"):
    parity(_name, [f32(100, 4, 3)], [_rand(3, 4, 100, lo=-5, hi=5)], getattr(lg, _name), _name)
# GELU by GGML's fp16 tables (and GELU / GEGLU's limits at +-10)
for _name in ("gelu", "gelu_quick", "geglu"):
    parity(_name, [f32(96, 4, 3)], [_rand(3, 4, 96, lo=-12, hi=12)], getattr(lg, _name), _name)
_FP16_VALUES = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
_FP16_VALUES = _FP16_VALUES[np.isfinite(_FP16_VALUES)].astype(np.float32)   # every table entry
for _name in ("gelu", "gelu_quick"):
    parity(f"{_name} (every fp16 value)", [f32(_FP16_VALUES.size)], [lambda r: _FP16_VALUES], getattr(lg, _name),
           _name)
parity("geglu_split", [f32(96, 4, 3), f32(96, 4, 3)], [_rand(3, 4, 96, lo=-12, hi=12), _rand(3, 4, 96)],
       lg.geglu_split, "geglu_split")
# not bit-identical: NORM's SIMD-lane variance sums, in an order that depends on the build
parity("norm", [f32(100, 4, 3)], [_rand(3, 4, 100)], lambda x: lg.norm(x, 1e-5), "norm", 1e-5, exact=False)
# GGML's exp: ggml_v_expf in runs of 8, libm's expf for a row's last n % 8, and SOFT_MAX's sum of each run of 8
# in float32 before the double sum: bit-identical to an AVX2 build (an AVX-512 one runs 16 lanes, ulps apart)
for _n in (96, 100):
    parity(f"silu n={_n}", [f32(_n, 4, 3)], [_rand(3, 4, _n, lo=-5, hi=5)], lg.silu, "silu", exact=_EXP_BITS)
    parity(f"swiglu n={_n}", [f32(_n, 4, 3)], [_rand(3, 4, _n, lo=-5, hi=5)], lg.swiglu, "swiglu", exact=_EXP_BITS)
for _n in (64, 37, 5):
    parity(f"soft_max n={_n}", [f32(_n, 5, 6, 2)], [_rand(2, 6, 5, _n, lo=-3, hi=3)], lg.soft_max, "soft_max",
           exact=_EXP_BITS)
    parity(f"soft_max_ext n={_n} f32 causal mask", [f32(_n, 5, 6, 2), f32(_n, 8)],
           [_rand(2, 6, 5, _n, lo=-3, hi=3),
            lambda r, n=_n: np.where(np.arange(n) <= n - 8 + np.arange(8)[:, None], r.uniform(-1, 0, (8, n)), -np.inf)
            .astype(np.float32)],
           lambda x, m: lg.soft_max_ext(x, m, 0.3, 0.0), "soft_max_ext", 0.3, 0.0, exact=_EXP_BITS)
    parity(f"soft_max_ext n={_n} f16 mask alibi", [f32(_n, 5, 6, 2), (F16, (_n, 8, 2))],
           [_rand(2, 6, 5, _n, lo=-3, hi=3), lambda r, n=_n: r.uniform(-1, 1, (2, 8, n)).astype(np.float16)],
           lambda x, m: lg.soft_max_ext(x, m, 0.3, 8.0), "soft_max_ext", 0.3, 8.0, exact=_EXP_BITS)


@pytest.mark.parametrize("name, specs, makers, build_lg, build_gg, exact", _PARITY, ids=[p[0] for p in _PARITY])
def test_parity_with_libggml(name, specs, makers, build_lg, build_gg, exact, cpu):
    _ggml()
    rng = np.random.default_rng(SEED)
    datas = [m(rng) for m in makers]
    got = run_lazyggml(specs, datas, build_lg, cpu)
    want = run_libggml(specs, datas, build_gg)
    if exact:
        assert np.array_equal(got, want), f"{name}: not bit-identical to libggml (seed {SEED})"
    else:
        a, b = got.view(np.float32).astype(np.float64), want.view(np.float32).astype(np.float64)
        assert nmse(a, b) < 1e-12, f"{name}: NMSE {nmse(a, b):.2e} vs libggml (seed {SEED})"


# flash_attn_ext against libggml's CPU kernel, which lazyggml's follows path by path (backends/cpu/attention.py):
# row by row with F16 q and F16 sums (decode, short batches), tiled in float32 (>= 64 queries), and one query over
# >= 512 cells split between the threads (so libggml runs on the threads ours ran on). Measured with a libggml built
# for an AVX-512 host: the row-by-row cases identical; the tiled ones within 2e-14 (AVX2 exp and sums). With F16
# K/V, one last-bit difference can move an F16 rounding by a step (8e-10 when the dot products followed AVX2
# lanes), hence F16's limit. libggml's CPU reads the mask as F16 only.
_FA_PARITY = [  # (D, n_kv, n_q, n_head, n_head_kv, ne3, K/V type, mask rows, scale, max_bias, logit_softcap)
    (64, 7, 5, 4, 4, 1, F32, 5, 0.125, 0.0, 0.0),
    (128, 259, 1, 8, 2, 1, F16, 1, 128 ** -0.5, 0.0, 0.0),
    (64, 259, 32, 4, 1, 1, F16, 32, 0.125, 0.0, 0.0),
    (64, 7, 5, 6, 6, 1, F32, 5, 0.125, 8.0, 0.0),
    (64, 7, 5, 4, 2, 2, F32, 8, 1.0, 0.0, 50.0),
    (40, 9, 5, 4, 2, 1, F16, 5, 40 ** -0.5, 0.0, 0.0),
    (64, 600, 1, 4, 2, 1, F16, 1, 0.125, 0.0, 0.0),        # split cells
    (64, 600, 1, 4, 2, 1, F32, 1, 0.125, 8.0, 0.0),
    (64, 200, 70, 4, 2, 1, F16, 70, 0.125, 0.0, 0.0),      # tiled: a full tile and a partial one
    (80, 130, 64, 4, 4, 1, F16, 64, 0.11, 0.0, 30.0),
    (64, 100, 64, 2, 1, 2, F32, 64, 0.125, 8.0, 0.0),
]
_FA_F16_NMSE = 1e-8


@pytest.mark.parametrize("d, n_kv, n_q, n_head, n_head_kv, ne3, kv, m1, scale, max_bias, softcap", _FA_PARITY,
                         ids=[f"d{p[0]}-kv{p[1]}-q{p[2]}-h{p[3]}/{p[4]}-ne3{p[5]}-{p[6].name}-mb{p[9]}-cap{p[10]}"
                              for p in _FA_PARITY])
def test_flash_attn_ext_parity_with_libggml(d, n_kv, n_q, n_head, n_head_kv, ne3, kv, m1, scale, max_bias, softcap,
                                            cpu):
    _ggml()
    rng = np.random.default_rng(SEED)
    np_kv = np.float16 if kv == F16 else np.float32
    visible = np.arange(n_kv) <= n_kv - n_q + np.arange(m1)[:, None]      # causal: the batch is the last n_q cells
    mask = np.where(visible, rng.uniform(-1.0, 0.0, (ne3, m1, n_kv)), -np.inf)
    specs = [f32(d, n_q, n_head, ne3), (kv, (d, n_kv, n_head_kv, ne3)), (kv, (d, n_kv, n_head_kv, ne3)),
             (F16, (n_kv, m1, 1, ne3))]
    datas = [rng.uniform(-1, 1, (ne3, n_head, n_q, d)).astype(np.float32),
             rng.uniform(-1, 1, (ne3, n_head_kv, n_kv, d)).astype(np_kv),
             rng.uniform(-1, 1, (ne3, n_head_kv, n_kv, d)).astype(np_kv), mask.astype(np.float16)]
    got = run_lazyggml(specs, datas, lambda q, k, v, m: lg.flash_attn_ext(q, k, v, m, scale, max_bias, softcap), cpu)
    want = run_libggml(specs, datas, lambda g, c, q, k, v, m: g.ggml_flash_attn_ext(c, q, k, v, m, scale, max_bias,
                                                                                    softcap), cpu.n_threads)
    a, b = got.view(np.float32).astype(np.float64), want.view(np.float32).astype(np.float64)
    limit = _FA_F16_NMSE if kv == F16 else 1e-12
    assert nmse(a, b) < limit, f"NMSE {nmse(a, b):.2e} vs libggml (seed {SEED})"


def test_flash_attn_decode_block_sums_are_ggml_reduce_order():
    """The row-by-row path reduces 8 cells' dot-product lanes at once (simd.hadd_f32x8_cols): lane c
    must be GGML_F32x8_REDUCE's ``(r0 + r1) + (r2 + r3)`` with ``r = lo4 + hi4`` of vector c, in
    float32, bit for bit (the per-cell reduction it replaces)."""
    from numba import njit
    from lazyggml.backends.cpu import simd

    @njit
    def sums(a, out):   # vectors as plain values (a list of them would be stored under-aligned)
        L = simd.load_f32x8
        simd.store_f32x8(out, 0, simd.hadd_f32x8_cols(L(a, 0), L(a, 32), L(a, 64), L(a, 96), L(a, 128), L(a, 160),
                                                      L(a, 192), L(a, 224)))

    rng = np.random.default_rng(SEED)
    a = (rng.standard_normal((8, 8)) * 10.0 ** rng.integers(-6, 7, (8, 8))).astype(np.float32)
    out = np.full(8, np.nan, np.float32)
    sums(a.reshape(-1), out)
    r = a[:, :4] + a[:, 4:]
    np.testing.assert_array_equal(out, (r[:, 0] + r[:, 1]) + (r[:, 2] + r[:, 3]))


def test_flash_attn_ext_op_params_and_precision(cpu):
    """op_params are GGML's: scale, max_bias, logit_softcap (the caller's scale, not divided by the
    soft cap), then the precision, which ``flash_attn_ext_set_prec`` rewrites (GGML_PREC_F32 = 10)."""
    ctx = lg.Context()
    q, k, v = ctx.new_tensor_3d(F32, 64, 5, 4), ctx.new_tensor_3d(F16, 64, 7, 2), ctx.new_tensor_3d(F16, 32, 7, 2)
    mask = ctx.new_tensor_2d(F16, 7, 5)
    out = lg.flash_attn_ext(q, k, v, mask, 0.125, 8.0, 50.0)
    assert out.op == lg.Op.FLASH_ATTN_EXT and out.type == F32 and out.ne == (32, 4, 5, 1)
    assert out.src[:5] == [q, k, v, mask, None]
    assert out.op_params == (0.125, 8.0, 50.0, 0) == tuple(lg.flash_attn_params(out))
    assert (lg.PREC_DEFAULT, lg.PREC_F32) == (_ggml().GGML_PREC_DEFAULT, _ggml().GGML_PREC_F32) == (0, 10)
    lg.flash_attn_ext_set_prec(out, lg.PREC_F32)
    assert lg.flash_attn_params(out) == lg.FlashAttnParams(0.125, 8.0, 50.0, 10)
    with pytest.raises(ValueError, match="precision 3"):
        lg.flash_attn_ext_set_prec(out, 3)
    assert cpu.device.supports_op(out)
