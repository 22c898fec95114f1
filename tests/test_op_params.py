"""Op params, typed, and the constants GGML derives from them on the host (``lazyggml/ops.py``).

* Every constructor's arguments come back through its accessor (``rope_params(t)``, ...), while
  ``op_params`` stays a plain tuple of ints and floats in GGML's order (the scheduler, graph printing
  and CUDA graph keys compare and hash it).
* ``rope_yarn_corr_dims`` is GGML's ``ggml_rope_yarn_corr_dims`` in C float: checked against a
  float32 NumPy re-derivation and, where ggml-python is installed, against libggml itself, on random
  parameters and on parameters that put the correction dims exactly on the floor/ceil boundary,
  where a float64 computation lands on the other side (which the test also checks, so a float64
  regression fails it).
* ``soft_max_alibi`` is GGML's ALiBi ``m0, m1, n_head_log2`` in float32.
* The CPU, CUDA and OpenCL glue hand their kernels exactly these shared constants: each backend's
  forward function runs on a ROPE / SOFT_MAX node with its kernel launch replaced by a recorder.
"""
from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

import lazyggml as lg
from lazyggml.ops import (ClampParams, GluParams, PadParams, PermuteParams, RopeParams, ScaleParams,
                          SoftMaxParams, clamp_params, concat_dim, diag_mask_n_past, glu_params, norm_eps,
                          pad_params, permute_axes, rope_params, rope_theta_scale, rope_yarn_corr_dims,
                          scale_params, soft_max_alibi, soft_max_params, unary_op, view_offset)

F32, I32 = lg.F32, lg.I32
f32 = np.float32


def _plain(t):
    """op_params hold plain ints and floats only (no enums, bools or NamedTuples)."""
    assert type(t.op_params) is tuple
    assert all(type(v) in (int, float) for v in t.op_params), t.op_params


@pytest.fixture
def ctx():
    return lg.Context()


# -- accessors round-trip the constructors' arguments ------------------------------------------------
def test_concat(ctx):
    a, b = ctx.new_tensor_4d(F32, 2, 3, 4, 5), ctx.new_tensor_4d(F32, 2, 3, 4, 5)
    for dim in range(4):
        t = lg.concat(a, b, dim)
        assert concat_dim(t) == dim and t.op_params == (dim,)
        _plain(t)


def test_unary(ctx):
    a = ctx.new_tensor_2d(F32, 4, 3)
    for uop in lg.UnaryOp:
        t = lg.unary(a, uop)
        assert unary_op(t) is uop and t.op_params == (int(uop),)
        assert lg.op_desc(t) == uop.name
        _plain(t)
    assert unary_op(lg.silu_inplace(a)) is lg.UnaryOp.SILU


def test_scale_clamp(ctx):
    a = ctx.new_tensor_2d(F32, 4, 3)
    assert scale_params(lg.scale(a, 0.3)) == ScaleParams(0.3, 0.0)
    assert scale_params(lg.scale_inplace(a, 2)) == (2.0, 0.0)
    t = lg.scale_bias(a, 0.7, -0.2)
    assert scale_params(t) == ScaleParams(s=0.7, b=-0.2) and t.op_params == (0.7, -0.2)
    _plain(t)
    t = lg.clamp(a, -1.5, 2)
    assert clamp_params(t) == ClampParams(min=-1.5, max=2.0) and t.op_params == (-1.5, 2.0)
    _plain(t)


def test_norm_eps(ctx):
    a = ctx.new_tensor_2d(F32, 4, 3)
    for build in (lg.norm, lg.norm_inplace, lg.rms_norm, lg.rms_norm_inplace):
        t = build(a, 3e-7)
        assert norm_eps(t) == 3e-7 and t.op_params == (3e-7,)
        _plain(t)
    assert norm_eps(lg.rms_norm(a)) == 1e-6 and norm_eps(lg.norm(a)) == 1e-5


def test_diag_mask_and_soft_max(ctx):
    a, mask = ctx.new_tensor_3d(F32, 8, 4, 6), ctx.new_tensor_2d(lg.F16, 8, 4)
    for n_past in (0, 3):
        assert diag_mask_n_past(lg.diag_mask_inf(a, n_past)) == n_past
        assert diag_mask_n_past(lg.diag_mask_inf_inplace(a, n_past)) == n_past
    assert soft_max_params(lg.soft_max(a)) == SoftMaxParams(1.0, 0.0)
    t = lg.soft_max_ext(a, mask, 0.125, 8.0)
    assert soft_max_params(t) == SoftMaxParams(scale=0.125, max_bias=8.0) and t.op_params == (0.125, 8.0)
    _plain(t)
    assert soft_max_params(lg.soft_max_ext_inplace(a, None, 0.5)) == (0.5, 0.0)


def test_rope(ctx):
    a, pos, ff = ctx.new_tensor_3d(F32, 64, 4, 5), ctx.new_tensor_1d(I32, 5), ctx.new_tensor_1d(F32, 16)
    args = dict(n_ctx_orig=4096, freq_base=500000.0, freq_scale=0.25, ext_factor=1.0, attn_factor=0.9,
                beta_fast=32.0, beta_slow=2.0)
    for build in (lg.rope_ext, lg.rope_ext_inplace):
        t = build(a, pos, ff, 32, lg.ROPE_TYPE_NEOX, **args)
        p = rope_params(t)
        assert p == RopeParams(n_past=0, n_dims=32, mode=lg.ROPE_TYPE_NEOX, n_ctx=0, **args)
        assert t.op_params == tuple(p)    # the NamedTuple's fields are GGML's order
        assert t.op_params[:5] == (0, 32, 2, 0, 4096)   # GGML's int32 slots, then the floats
        _plain(t)
    p = rope_params(lg.rope(a, pos, 64, lg.ROPE_TYPE_NORMAL))
    assert (p.n_dims, p.mode, p.n_ctx_orig, p.freq_base, p.freq_scale, p.ext_factor, p.attn_factor,
            p.beta_fast, p.beta_slow) == (64, 0, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)


def test_glu(ctx):
    a, b = ctx.new_tensor_2d(F32, 8, 3), ctx.new_tensor_2d(F32, 8, 3)
    cases = [(lg.swiglu(a), lg.GluOp.SWIGLU, False), (lg.swiglu_swapped(a), lg.GluOp.SWIGLU, True),
             (lg.swiglu_split(a, b), lg.GluOp.SWIGLU, False), (lg.geglu(a), lg.GluOp.GEGLU, False),
             (lg.geglu_split(a, b), lg.GluOp.GEGLU, False), (lg.reglu(a), lg.GluOp.REGLU, False),
             (lg.reglu_split(a, b), lg.GluOp.REGLU, False)]
    for t, gop, swapped in cases:
        p = glu_params(t)
        assert p == GluParams(gop, swapped) and p.op is gop and p.swapped is swapped
        assert t.op_params == (int(gop), int(swapped)) and lg.op_desc(t) == gop.name
        _plain(t)


def test_pad(ctx):
    a = ctx.new_tensor_4d(F32, 2, 3, 4, 5)
    t = lg.pad_ext(a, 1, 2, 3, 4, 5, 6, 7, 8)
    assert pad_params(t) == PadParams(lp0=1, rp0=2, lp1=3, rp1=4, lp2=5, rp2=6, lp3=7, rp3=8)
    assert t.op_params == (1, 2, 3, 4, 5, 6, 7, 8)
    _plain(t)
    assert pad_params(lg.pad(a, 1, 2, 3, 4)) == PadParams(0, 1, 0, 2, 0, 3, 0, 4)


def test_views(ctx):
    a = ctx.new_tensor_3d(F32, 6, 4, 2)
    assert view_offset(lg.view_1d(a, 5, 8)) == 8
    assert view_offset(lg.view_2d(a, 3, 4, 24, 4)) == 4
    assert view_offset(lg.view_3d(a, 3, 2, 2, 24, 96, 12)) == 12
    assert view_offset(lg.view_4d(a, 3, 2, 2, 1, 24, 96, 192)) == 0
    t = lg.permute(a, 2, 0, 1, 3)
    assert permute_axes(t) == PermuteParams(2, 0, 1, 3) and t.op_params == (2, 0, 1, 3)
    _plain(t)
    assert permute_axes(lg.transpose(a)) == (1, 0, 2, 3)


def test_accessor_checks_the_op(ctx):
    a = ctx.new_tensor_2d(F32, 4, 3)
    with pytest.raises(ValueError, match="SoftMaxParams.*SCALE"):
        soft_max_params(lg.scale(a, 2.0))
    with pytest.raises(ValueError, match="NORM or RMS_NORM"):
        norm_eps(lg.soft_max(a))


# -- ROPE's correction dims: GGML's float32 formula -------------------------------------------------------
def corr_dims_f32(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    """GGML's ggml_rope_yarn_corr_dims re-derived with NumPy float32 arrays (one entry per parameter
    set). ``logf`` is the float64 log rounded to float32: glibc's logf but in rare last-bit cases."""
    n_dims, n_ctx_orig, freq_base = (np.asarray(v, np.float32) for v in (n_dims, n_ctx_orig, freq_base))

    def logf(x):
        return np.log(x.astype(np.float64)).astype(np.float32)

    def corr_dim(n_rot):
        n_rot = np.asarray(n_rot, np.float32)
        return n_dims * logf(n_ctx_orig / (n_rot * f32(2) * f32(np.pi))) / (f32(2) * logf(freq_base))

    start, end = np.floor(corr_dim(beta_fast)), np.ceil(corr_dim(beta_slow))
    return np.maximum(f32(0), start), np.minimum(n_dims - f32(1), end)


def corr_dims_f64(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    """The same in double: what a float64 port (as the CUDA glue had) computes."""
    def corr_dim(n_rot):
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))
    return max(0.0, math.floor(corr_dim(beta_fast))), min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))


def _random_sets(rng, n):
    out = []
    for _ in range(n):
        n_dims = int(rng.choice([16, 32, 64, 80, 96, 128, 256, 2 * rng.integers(1, 256)]))
        n_ctx_orig = int(rng.choice([2048, 4096, 8192, 32768, 131072, rng.integers(1, 200000)]))
        freq_base = float(f32(rng.choice([10000.0, 500000.0, 1e6, rng.uniform(2.0, 1e7)])))
        beta_fast = float(f32(rng.choice([32.0, rng.uniform(0.5, 64.0)])))
        beta_slow = float(f32(rng.choice([1.0, rng.uniform(0.1, 4.0)])))
        out.append((n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow))
    return out


def _boundary_sets(rng, n):
    """Betas that put each correction dim, in exact arithmetic, on an integer k: floor/ceil then
    decide on the last bits of the float arithmetic."""
    out = []
    for _ in range(n):
        n_dims = int(rng.choice([32, 64, 80, 96, 128, 256]))
        n_ctx_orig = int(rng.choice([2048, 4096, 8192, 32768, 131072]))
        freq_base = float(f32(rng.choice([10000.0, 500000.0, 1e6, rng.uniform(1e3, 1e7)])))
        k_fast, k_slow = rng.integers(1, n_dims // 2, 2)
        # corr_dim = n_dims ln(n_ctx_orig / (2 pi beta)) / (2 ln freq_base) = k
        beta = [n_ctx_orig / (2 * math.pi * freq_base ** (2 * k / n_dims)) for k in (k_fast, k_slow)]
        out.append((n_dims, n_ctx_orig, freq_base, *(float(f32(b)) for b in beta)))
    return out


# found with the sets above: float64 gives corr_dims[1] = 40, GGML (float) 39
FLOAT64_DIFFERS = (128, 33961, 1335429.5, 32.0, 1.0)
FLOAT64_DIFFERS_GGML = (23.0, 39.0)
EDGES = [FLOAT64_DIFFERS, (128, 0, 10000.0, 32.0, 1.0), (64, 4096, 10000.0, 32.0, 1.0),
         (128, 8192, 500000.0, 32.0, 1.0), (2, 1, 10000.0, 0.5, 0.5)]

CORR_SETS = (_random_sets(np.random.default_rng(1), 300) + _boundary_sets(np.random.default_rng(2), 300)
             + EDGES)


def test_rope_yarn_corr_dims_is_ggml_float32():
    cols = list(zip(*CORR_SETS))
    with np.errstate(divide="ignore", invalid="ignore"):   # n_ctx_orig = 0: logf(0) = -inf, as in C
        ref0, ref1 = corr_dims_f32(*cols)
    for i, p in enumerate(CORR_SETS):
        got = rope_yarn_corr_dims(*p)
        assert all(type(v) is np.float32 for v in got)
        assert got == (ref0[i], ref1[i]), p
    assert rope_yarn_corr_dims(*FLOAT64_DIFFERS) == FLOAT64_DIFFERS_GGML
    # n_ctx_orig = 0: C's MAX(0, -inf) and MIN(127, -inf)
    assert rope_yarn_corr_dims(128, 0, 10000.0, 32.0, 1.0) == (0.0, -np.inf)


def test_rope_yarn_corr_dims_is_not_float64():
    """The boundary sets are where float64 and GGML's float part: a float64 port would fail above."""
    assert corr_dims_f64(*FLOAT64_DIFFERS) != FLOAT64_DIFFERS_GGML
    differ = [p for p in CORR_SETS
              if p[1] > 0 and corr_dims_f64(*p) != tuple(map(float, rope_yarn_corr_dims(*p)))]
    assert len(differ) >= 10, differ


def test_rope_yarn_corr_dims_matches_libggml():
    import ggml as gg   # ggml-python, the GGML oracle (the test extra installs it)
    for p in CORR_SETS:
        dims = (ctypes.c_float * 2)()
        gg.ggml_rope_yarn_corr_dims(*p, dims)
        assert rope_yarn_corr_dims(*p) == (dims[0], dims[1]), p


def test_rope_theta_scale():
    # GGML: powf(freq_base, -2.0f/n_dims), the exponent in float32 (not -2.0/n_dims in double)
    for freq_base in (10000.0, 500000.0, 1e6, 75000.0):
        for n_dims in (16, 32, 64, 80, 96, 128, 256):
            expect = f32(math.pow(float(f32(freq_base)), float(f32(-2.0) / f32(n_dims))))
            assert rope_theta_scale(freq_base, n_dims) == expect
    assert rope_theta_scale(10000.0, 64) == f32(0.7498942)


# -- ALiBi ---------------------------------------------------------------------------------------------
def alibi_ref(n_head, max_bias):
    """GGML: n_head_log2 = 1 << floor(log2(n_head)), m0 = powf(2, -max_bias / n_head_log2),
    m1 = powf(2, -(max_bias / 2) / n_head_log2), all in float."""
    n_head_log2 = 2 ** int(np.floor(np.log2(n_head)))
    powf = lambda x, y: f32(np.power(np.float64(x), np.float64(y)))   # noqa: E731
    m0 = powf(2.0, -f32(max_bias) / f32(n_head_log2))
    m1 = powf(2.0, -(f32(max_bias) / f32(2)) / f32(n_head_log2))
    return m0, m1, n_head_log2


def test_soft_max_alibi():
    rng = np.random.default_rng(3)
    for n_head in [1, 2, 3, 5, 8, 12, 16, 20, 32, 40, 64, 96, 128]:
        for max_bias in [0.0, 1.0, 8.0, 12.1, 5.3, *rng.uniform(0.01, 16, 20)]:
            got = soft_max_alibi(n_head, float(max_bias))
            assert tuple(got) == alibi_ref(n_head, max_bias), (n_head, max_bias)
            assert type(got.m0) is np.float32 and type(got.m1) is np.float32 and type(got.n_head_log2) is int
    assert soft_max_alibi(12, 8.0) == (0.5, f32(2 ** -0.5), 8)
    assert soft_max_alibi(32, 0.0) == (1.0, 1.0, 32)
    # float64 then rounded gives a different m0 here: the float32 exponent matters
    assert soft_max_alibi(8, 12.1).m0 != f32(2.0 ** (-12.1 / 8))


# -- every backend's glue passes the shared constants to its kernels ----------------------------------
ROPE_ARGS = dict(n_ctx_orig=FLOAT64_DIFFERS[1], freq_base=FLOAT64_DIFFERS[2], freq_scale=0.25, ext_factor=1.0,
                 attn_factor=1.0, beta_fast=FLOAT64_DIFFERS[3], beta_slow=FLOAT64_DIFFERS[4])
N_HEAD, MAX_BIAS = 12, 12.1   # m0 differs from the float64 value, n_head_log2 = 8 < n_head


def _rope_node():
    ctx = lg.Context()
    a, pos = ctx.new_tensor_3d(F32, 128, 2, 3), ctx.new_tensor_1d(I32, 3)
    return lg.rope_ext(a, pos, None, 128, lg.ROPE_TYPE_NEOX, **ROPE_ARGS)


def _soft_max_node():
    ctx = lg.Context()
    a, mask = ctx.new_tensor_3d(F32, 8, 4, N_HEAD), ctx.new_tensor_2d(F32, 8, 4)
    return lg.soft_max_ext(a, mask, 0.5, MAX_BIAS)


def _expected_rope():
    corr0, corr1 = FLOAT64_DIFFERS_GGML
    return rope_theta_scale(ROPE_ARGS["freq_base"], 128), f32(corr0), f32(corr1)


def _expected_slopes():
    m0, m1, n_head_log2 = soft_max_alibi(N_HEAD, MAX_BIAS)
    return np.array([m0 ** f32(h + 1) if h < n_head_log2 else m1 ** f32(2 * (h - n_head_log2) + 1)
                     for h in range(N_HEAD)], np.float32)


def test_cpu_glue_uses_shared_constants():
    from lazyggml.backends.cpu.params import ComputeParams
    from lazyggml.backends.cpu.rope import rope_cache, rope_forward
    from lazyggml.backends.cpu.softmax import soft_max_forward
    node = _rope_node()
    x = np.zeros((1, 3, 2, 128), np.float32)
    plan = rope_forward(node, x, [x, np.arange(3, dtype=np.int32), None], ComputeParams(1))
    consts = next(args for kernel, args in plan if kernel is rope_cache)[4]   # rope_cache(.., consts, cache)
    assert tuple(f32(c) for c in consts[:3]) == _expected_rope()

    node = _soft_max_node()
    x = np.zeros((1, N_HEAD, 4, 8), np.float32)
    (_, args), = soft_max_forward(node, x, [x, np.zeros((1, 1, 4, 8), np.float32), None], ComputeParams(1))
    slopes = args[6]    # soft_max(ch, nch, x, mask, mkind, has_mask, slopes, scale, dst)
    m0, m1, n_head_log2 = soft_max_alibi(N_HEAD, MAX_BIAS)
    assert slopes[0] == m0 and slopes[n_head_log2] == m1   # m0^1, m1^1
    np.testing.assert_allclose(slopes, _expected_slopes(), rtol=1e-6)


class _Recorder:
    """Stands in for a numba-cuda kernel: ``kernel[grid, block, stream](*args)`` records ``args``."""
    args = None

    def __getitem__(self, config):
        return self._launch

    def _launch(self, *args):
        self.args = args


class _FakeBackend:
    """What the CUDA and OpenCL glue use of their backend, with the launches recorded."""
    stream = None

    def __init__(self):
        self.launches = []

    def view(self, t, dtype, *_):
        return np.zeros(1, dtype)

    def launch_rows(self, name, rows, *args, lanes=None):
        self.launches.append((name, args))


def test_cuda_glue_uses_shared_constants(monkeypatch):
    from lazyggml.backends.cuda import ops as cuda_ops, rope as cuda_rope, softmax as cuda_softmax
    rope_k, soft_max_k = _Recorder(), _Recorder()
    monkeypatch.setattr(cuda_rope, "rope", rope_k)
    monkeypatch.setattr(cuda_softmax, "soft_max", soft_max_k)

    cuda_ops.rope_op(_FakeBackend(), _rope_node())
    # rope(..., theta_scale, freq_scale, ext_factor, attn_factor, corr0, corr1)
    args = rope_k.args
    got = (args[-6], args[-2], args[-1])
    assert got == _expected_rope() and all(type(v) is np.float32 for v in got)

    cuda_ops.soft_max_op(_FakeBackend(), _soft_max_node())
    assert soft_max_k.args[-4:-1] == tuple(soft_max_alibi(N_HEAD, MAX_BIAS))   # (.., m0, m1, n_head_log2, empty_zero)


def test_opencl_glue_uses_shared_constants(monkeypatch):
    from lazyggml.backends.opencl import ops as cl_ops
    monkeypatch.setattr(cl_ops, "targ", lambda t, extra_offset=0: (t, extra_offset))
    be = _FakeBackend()
    cl_ops._rope(be, _rope_node())
    cl_ops._soft_max(be, _soft_max_node())
    (rope_name, rope_args), (sm_name, sm_args) = be.launches
    assert rope_name == "kernel_rope" and sm_name == "kernel_soft_max"
    # (.., theta_scale, freq_scale, ext_factor, attn_factor, corr0, corr1)
    assert (rope_args[-6], rope_args[-2], rope_args[-1]) == _expected_rope()
    assert sm_args[-3:] == tuple(soft_max_alibi(N_HEAD, MAX_BIAS))   # (.., m0, m1, n_head_log2)


def test_every_op_has_one_row_and_its_rebuild_gives_each_catalogue_node_back():
    """``ops.OP_DEFS``: one row per op, GGML's enum numbers (no two alike, below GGML_OP_COUNT = 101),
    and ``rebuild`` (what the RPC ends check every computed node with) makes each computed node of
    every op case again from its sources and op_params, the same type, shape, op and params; an
    ``inplace`` op's rebuilt node is a fresh tensor (the twin is not what a rebuild makes)."""
    from lazyggml.op_cases import CASES
    from lazyggml.ops import OP_DEFS
    from lazyggml.tensor import Context
    ids = [d.ggml_id for d in OP_DEFS.values()]
    assert set(OP_DEFS) == set(lg.Op) and len(set(ids)) == len(ids) and max(ids) < 101
    seen = set()
    for case in CASES:
        ctx = Context()
        case.build(ctx)
        for node in ctx.tensors():
            d = OP_DEFS[node.op]
            if d.rebuild is None:
                continue
            with Context():
                r = d.rebuild(node.src, node.op_params, node)
            assert (r.op, r.type, r.ne, r.op_params) == (node.op, node.type, node.ne, node.op_params), (case.name, node.op)
            seen.add(node.op)
    computed = {op for op, d in OP_DEFS.items() if d.rebuild is not None}
    assert seen == computed, f"ops no case covers: {sorted(o.name for o in computed - seen)}"
