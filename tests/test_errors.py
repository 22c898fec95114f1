"""Bad input gets an error that names what is wrong, of a class a caller can catch (lazyggml/errors.py),
raised as early as the mistake can be seen: when data is set, when an op is built."""
from __future__ import annotations

import numpy as np
import pytest

import lazyggml as lg
from lazyggml import F16, F32, I32, Q4_K

ERRORS = [lg.GGUFError, lg.ShapeError, lg.TensorTypeError, lg.UnsupportedOpError, lg.AllocationError,
          lg.OutOfMemoryError]


def test_every_error_is_a_lazyggml_error_and_keeps_its_builtin_base():
    builtin = {lg.GGUFError: ValueError, lg.ShapeError: ValueError, lg.TensorTypeError: ValueError,
               lg.UnsupportedOpError: NotImplementedError, lg.AllocationError: RuntimeError,
               lg.OutOfMemoryError: MemoryError}
    for cls in ERRORS:
        assert issubclass(cls, lg.LazyGGMLError) and issubclass(cls, builtin[cls]), cls
    assert issubclass(lg.OutOfMemoryError, lg.AllocationError)


def _f32_tensor(ne=(4, 3)):
    ctx = lg.Context(no_alloc=False)
    t = ctx.new_tensor(F32, ne)
    lg.set_name(t, "x")
    return t


# -- tensor_set ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int32, np.float16, np.float64, np.int64])
def test_tensor_set_refuses_another_dtype_and_names_both(dtype):
    t = _f32_tensor()
    before = lg.tensor_get(t).copy()
    with pytest.raises(lg.TensorTypeError) as e:
        lg.tensor_set(t, np.ones((3, 4), dtype))
    msg = str(e.value)
    assert "'x'" in msg and "f32" in msg and "float32" in msg and np.dtype(dtype).name in msg
    np.testing.assert_array_equal(lg.tensor_get(t), before)     # nothing was written


def test_tensor_set_refuses_a_short_or_long_array():
    t = _f32_tensor()
    with pytest.raises(lg.ShapeError, match=r"'x' f32\[4, 3, 1, 1\] needs 48 bytes from offset 0; got 44"):
        lg.tensor_set(t, np.ones(11, np.float32))
    with pytest.raises(lg.ShapeError, match="needs 48 bytes"):
        lg.tensor_set(t, np.ones(13, np.float32))


def test_tensor_set_takes_its_dtype_raw_bytes_and_explicit_parts():
    t = _f32_tensor()
    v = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    lg.tensor_set(t, v)
    np.testing.assert_array_equal(lg.tensor_get(t)[0, 0], v)
    lg.tensor_set(t, v[::-1].copy().view(np.uint8))              # raw bytes of the exact size
    np.testing.assert_array_equal(lg.tensor_get(t)[0, 0], v[::-1])
    lg.tensor_set(t, np.float32([7, 8]), offset=8, size=8)       # a part, said so by size
    assert lg.tensor_get(t)[0, 0, 0, 2:].tolist() == [7, 8]
    lg.tensor_set(t, np.float32([5, 6]), offset=40)              # the rest of the tensor from offset
    assert lg.tensor_get(t)[0, 0, 2, 2:].tolist() == [5, 6]


def test_tensor_set_on_a_quantized_tensor_takes_only_bytes():
    ctx = lg.Context(no_alloc=False)
    w = ctx.new_tensor_2d(Q4_K, 256, 2)
    with pytest.raises(lg.TensorTypeError, match=r"q4_K, which takes uint8 \(raw block bytes\) data; got float32"):
        lg.tensor_set(w, np.ones((2, 256), np.float32))
    raw = lg.quantize(Q4_K, np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32))
    lg.tensor_set(w, raw)
    np.testing.assert_array_equal(lg.tensor_get(w).reshape(-1), np.asarray(raw).reshape(-1))


# -- build time ------------------------------------------------------------------------------------
@pytest.mark.parametrize("build", [
    lambda a, b: lg.soft_max(a), lambda a, b: lg.rms_norm(a, 1e-6), lambda a, b: lg.silu(a),
    lambda a, b: lg.scale(a, 2.0), lambda a, b: lg.sum_rows(a), lambda a, b: lg.argmax(a),
    lambda a, b: lg.sqrt(a), lambda a, b: lg.swiglu(a), lambda a, b: lg.mul_mat(b, a),
    lambda a, b: lg.rope(lg.reshape_3d(a, 2, 2, 3), lg.Context().new_tensor_1d(I32, 2), 2, 0),
])
def test_float_ops_refuse_integer_input_when_built(build):
    ctx = lg.Context()
    a, b = ctx.new_tensor_2d(I32, 4, 3), ctx.new_tensor_2d(F32, 4, 3)
    lg.set_name(a, "ids")
    with pytest.raises(lg.TensorTypeError, match=r"i32 input; this op takes f32, f16 or bf16 \('ids[' ]"):
        build(a, b)


def test_mul_mat_refuses_quantized_or_integer_operands_when_built():
    ctx = lg.Context()
    w, x = ctx.new_tensor_2d(Q4_K, 256, 4), ctx.new_tensor_2d(Q4_K, 256, 2)
    with pytest.raises(lg.TensorTypeError, match=r"mul_mat: q4_K input"):
        lg.mul_mat(w, x)
    with pytest.raises(lg.TensorTypeError, match=r"mul_mat: i32 weights"):
        lg.mul_mat(ctx.new_tensor_2d(I32, 256, 4), ctx.new_tensor_2d(F32, 256, 2))
    assert lg.mul_mat(w, ctx.new_tensor_2d(F16, 256, 2)).type == F32   # float b of any width is fine


def test_shape_errors_name_the_op_and_operands():
    ctx = lg.Context()
    a, b = ctx.new_tensor_2d(F32, 4, 3), ctx.new_tensor_2d(F32, 5, 3)
    lg.set_name(a, "a")
    with pytest.raises(lg.ShapeError, match=r"mul_mat: inner sizes ne\[0\] differ \('a' f32\[4, 3, 1, 1\], "
                                            r"unnamed f32 tensor f32\[5, 3, 1, 1\]\)"):
        lg.mul_mat(a, b)


def _fa_operands(q_type=F32, kv_type=F16, n_head_kv=2):
    ctx = lg.Context()
    q, k, v = (ctx.new_tensor_3d(q_type, 64, 5, 4), ctx.new_tensor_3d(kv_type, 64, 7, n_head_kv),
               ctx.new_tensor_3d(kv_type, 64, 7, n_head_kv))
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        lg.set_name(t, name)
    return ctx, q, k, v


@pytest.mark.parametrize("build, error, why", [
    (lambda ctx, q, k, v: lg.flash_attn_ext(lg.cpy(q, ctx.new_tensor_3d(F16, 64, 5, 4)), k, v),
     lg.TensorTypeError, "q must be F32"),
    (lambda ctx, q, k, v: lg.flash_attn_ext(q, k, lg.cpy(v, ctx.new_tensor_3d(F32, 64, 7, 2))),
     lg.TensorTypeError, "k must be F16 or F32 and v of k's type"),
    (lambda ctx, q, k, v: lg.flash_attn_ext(q, ctx.new_tensor_3d(I32, 64, 7, 2), v),
     lg.TensorTypeError, "i32 input"),
    (lambda ctx, q, k, v: lg.flash_attn_ext(q, k, v, ctx.new_tensor_2d(I32, 7, 5)),
     lg.TensorTypeError, "mask must be F16"),
    (lambda ctx, q, k, v: lg.flash_attn_ext(q, k, v, ctx.new_tensor_2d(F32, 7, 5)),   # GGML reads masks as F16
     lg.TensorTypeError, "mask must be F16"),
    (lambda ctx, q, k, v: lg.flash_attn_ext(q, ctx.new_tensor_3d(F16, 64, 7, 3), ctx.new_tensor_3d(F16, 64, 7, 3)),
     lg.ShapeError, r"multiples of k's \(GQA broadcast\)"),
    (lambda ctx, q, k, v: lg.flash_attn_ext(q, ctx.new_tensor_3d(F16, 32, 7, 2), v),
     lg.ShapeError, "same head size"),
    (lambda ctx, q, k, v: lg.flash_attn_ext(q, k, ctx.new_tensor_3d(F16, 64, 6, 2)),
     lg.ShapeError, "v must match k"),
    (lambda ctx, q, k, v: lg.flash_attn_ext(q, k, v, ctx.new_tensor_2d(F16, 7, 4)),
     lg.ShapeError, r"ne\[1\] >= n_q"),
    (lambda ctx, q, k, v: lg.flash_attn_ext(q, k, v, ctx.new_tensor_2d(F16, 8, 5)),
     lg.ShapeError, r"ne\[0\] = n_kv"),
    (lambda ctx, q, k, v: lg.flash_attn_ext(q, k, v, ctx.new_tensor_3d(F16, 7, 5, 3)),
     lg.ShapeError, "mask dims 2, 3 must divide q's"),
    (lambda ctx, q, k, v: lg.flash_attn_ext(q, k, v, None, 0.125, 8.0),
     lg.ShapeError, r"ALiBi \(max_bias > 0\) needs a mask"),
])
def test_flash_attn_ext_errors_name_the_op_and_operands_when_built(build, error, why):
    ctx, q, k, v = _fa_operands()
    with pytest.raises(error, match=why) as e:
        build(ctx, q, k, v)
    assert str(e.value).startswith("flash_attn_ext: ") and "[64, 5, 4, 1]" in str(e.value), str(e.value)   # q


def test_flash_attn_ext_takes_views_with_packed_rows_only():
    """K and V may be strided views of a cache (the model's case), q a permuted tensor; a view whose
    rows are not packed (a transposed one) is refused when built."""
    ctx, q, k, v = _fa_operands()
    cache = ctx.new_tensor_2d(F16, 128, 32)
    kv = lg.permute(lg.view_3d(cache, 64, 2, 7, 128, cache.nb[1], 0), 0, 2, 1, 3)   # [64, 7, 2], strided
    qp = lg.permute(ctx.new_tensor_3d(F32, 64, 4, 5), 0, 2, 1, 3)                     # [64, 5, 4]
    assert lg.flash_attn_ext(qp, kv, kv, ctx.new_tensor_2d(F16, 7, 5)).ne == (64, 4, 5, 1)
    with pytest.raises(lg.ShapeError, match=r"flash_attn_ext: q, k and v rows \(dim 0\) must be packed"):
        lg.flash_attn_ext(lg.transpose(ctx.new_tensor_2d(F32, 5, 64)), k, v)


def test_unnamed_tensors_are_described_not_shown_as_empty_quotes():
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 4)
    assert a.label == "unnamed f32 tensor"
    assert lg.relu(a).label == "unnamed UNARY result"
    lg.set_name(a, "w")
    assert a.label == "'w'"


# -- compute time ----------------------------------------------------------------------------------
def test_computing_without_memory_says_how_to_allocate():
    ctx = lg.Context()                      # the package docstring's example: metadata only
    a = ctx.new_tensor_2d(F32, 4, 3)
    g = lg.Graph()
    lg.build_forward_expand(g, lg.relu(lg.scale(a, 2.0)))
    cpu = lg.backend_cpu_init()
    with pytest.raises(lg.AllocationError, match=r"not allocated; a Context\(\) makes tensors without memory "
                                                 r".*alloc_ctx_tensors.*Gallocr.*no_alloc=False"):
        lg.backend_graph_compute(cpu, g)
    with pytest.raises(lg.AllocationError, match="tensor_set: tensor 'leaf_0' is not allocated"):
        lg.tensor_set(a, np.ones((3, 4), np.float32))


def test_the_package_docstring_example_runs():
    """The example a user reads first (``help(lazyggml)``) computes as written."""
    import textwrap
    block = lg.__doc__.split("\n\n")[2]
    assert "backend_graph_compute" in block
    scope = {}
    exec(textwrap.dedent(block), scope)
    np.testing.assert_array_equal(scope["lg"].tensor_get(scope["b"])[0, 0], np.full((3, 4), 2.0, np.float32))


def test_the_package_docstring_example_computes_when_allocated_as_the_hint_says():
    ctx = lg.Context(no_alloc=False)
    a = ctx.new_tensor_2d(F32, 4, 3)
    out = lg.relu(lg.scale(a, 2.0))
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    v = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    lg.tensor_set(a, v)
    lg.backend_graph_compute(lg.backend_cpu_init(), g)
    np.testing.assert_allclose(lg.tensor_get(out)[0, 0], np.maximum(2 * v, 0))


def test_a_node_no_backend_runs_is_an_unsupported_op_error_naming_it():
    ctx = lg.Context(no_alloc=True)
    a, b = ctx.new_tensor_2d(F16, 4, 3), ctx.new_tensor_2d(F16, 4, 3)
    lg.set_name(a, "h")
    out = lg.add(a, b)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    sched = lg.Scheduler([lg.backend_cpu_init()])
    with pytest.raises(lg.UnsupportedOpError, match=r"no backend can run ADD -> 'node_0' f16\[4, 3, 1, 1\] "
                                                    r"from 'h' f16"):
        sched.alloc_graph(g)


def test_a_buffer_larger_than_memory_is_an_out_of_memory_error_naming_the_buffer_type():
    from lazyggml.backends.cpu import cpu_buffer_type
    with pytest.raises(lg.OutOfMemoryError, match=r"CPU: cannot allocate 1152921504606846976 bytes of host memory"):
        cpu_buffer_type().alloc_buffer(1 << 60)
