"""Tensors, views and flags (docs/graph-alloc-sched.md §1)."""
from __future__ import annotations

import numpy as np
import pytest

import lazyggml as lg

F32, F16 = lg.F32, lg.F16


def test_fresh_tensor_has_packed_strides_and_no_memory():
    ctx = lg.Context()
    t = ctx.new_tensor_3d(F32, 5, 4, 3)
    assert t.ne == (5, 4, 3, 1) and t.nb == (4, 20, 80, 240)
    assert t.nbytes() == 240 and t.buffer is None and t.offset is None
    q = ctx.new_tensor_2d(lg.Q4_K, 512, 3)
    assert q.nb == (144, 288, 864, 864) and q.nbytes() == 864


def test_views_of_views_point_at_the_root_with_summed_offsets():
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 64)
    v1 = lg.view_1d(a, 32, 16)
    v2 = lg.view_2d(v1, 4, 3, 32, 8)
    v3 = lg.transpose(v2)
    assert v1.view_src is a and v1.view_offs == 16
    assert v2.view_src is a and v2.view_offs == 24
    assert v3.view_src is a and v3.view_offs == 24
    # src[0] is the tensor the view was made of, not the root
    assert v2.src[0] is v1 and v3.src[0] is v2
    assert v2.op == lg.Op.VIEW and v2.op_params == (8,)
    assert v3.op == lg.Op.TRANSPOSE and v3.ne[:2] == (3, 4) and v3.nb[:2] == (32, 4)


def test_inplace_results_are_views_of_their_first_operand():
    ctx = lg.Context()
    a, b = ctx.new_tensor_2d(F32, 8, 2), ctx.new_tensor_2d(F32, 8, 2)
    v = lg.view_2d(a, 4, 2, a.nb[1], 8)
    for r in (lg.add_inplace(a, b), lg.scale_inplace(a, 2.0), lg.soft_max_inplace(a),
              lg.rms_norm_inplace(a), lg.clamp(a, 0, 1), lg.silu_inplace(v)):
        assert r.view_src is a
    assert lg.add_inplace(v, lg.view_2d(b, 4, 2, b.nb[1], 0)).view_offs == 8
    c = lg.cpy(a, b)
    assert c.view_src is b and c.src[:2] == [a, b]
    idx = ctx.new_tensor_1d(lg.I32, 2)
    s = lg.set_rows(a, b, idx)
    assert s.view_src is a and s.src[:3] == [b, idx, a]


def test_set_output_marks_the_view_and_its_root():
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 64)
    v1 = lg.view_1d(a, 32, 0)
    v2 = lg.view_1d(v1, 8, 4)
    lg.set_output(v2)
    assert v2.flags & lg.FLAG_OUTPUT and a.flags & lg.FLAG_OUTPUT
    assert not v1.flags & lg.FLAG_OUTPUT  # flattened: v2's chain is v2 -> a


def test_flag_setters():
    ctx = lg.Context()
    a = ctx.new_tensor_1d(F32, 4)
    v = lg.view_1d(a, 2, 0)
    lg.set_input(v)
    assert v.flags == lg.FLAG_INPUT and a.flags == 0
    lg.set_param(a)
    assert a.flags == lg.FLAG_PARAM
    with pytest.raises(ValueError):
        lg.set_param(lg.neg(a))
    s = lg.sum(a)
    lg.set_loss(s)
    assert s.flags & lg.FLAG_LOSS
    with pytest.raises(ValueError):
        lg.set_loss(a)                                   # not a scalar
    with pytest.raises(ValueError):
        lg.set_loss(ctx.new_tensor_1d(F16, 1))           # not F32


def test_views_of_an_allocated_root_get_an_address_but_no_buffer():
    ctx = lg.Context(no_alloc=False)
    a = ctx.new_tensor_1d(F32, 16)
    v = lg.view_1d(a, 4, 8)
    assert a.buffer is not None and a.offset == 0
    assert v.offset == 8 and v.buffer is None and v.data_buffer() is a.buffer
    lg.tensor_set(a, np.arange(16, dtype=np.float32))
    assert lg.tensor_get(v).ravel().tolist() == [2.0, 3.0, 4.0, 5.0]


def test_view_bounds_and_shapes_are_checked():
    ctx = lg.Context()
    a = ctx.new_tensor_2d(F32, 4, 3)
    with pytest.raises(ValueError, match="out of range"):
        lg.view_1d(a, 12, 4)
    with pytest.raises(ValueError, match="out of range"):
        lg.view_2d(a, 4, 3, 20, 0)
    with pytest.raises(ValueError):
        lg.view_1d(a, 4, -4)
    with pytest.raises(ValueError):
        lg.view_1d(a, 4, 1.5)
    with pytest.raises(ValueError):
        lg.reshape_2d(lg.transpose(a), 3, 4)             # not contiguous
    with pytest.raises(ValueError):
        lg.reshape_2d(a, 5, 3)                           # 15 != 12 elements
    assert lg.reshape_3d(a, 2, 2, 3).ne == (2, 2, 3, 1)


def test_permute_moves_dim_i_to_axis_i():
    ctx = lg.Context()
    a = ctx.new_tensor_4d(F32, 2, 3, 4, 5)
    p = lg.permute(a, 2, 0, 1, 3)
    assert p.ne == (3, 4, 2, 5) and p.nb == (8, 24, 4, 96)
    assert p.view_src is a and p.op_params == (2, 0, 1, 3)
    with pytest.raises(ValueError):
        lg.permute(a, 0, 0, 1, 2)


def test_predicates():
    ctx = lg.Context()
    a = ctx.new_tensor_3d(F32, 4, 3, 2)
    t = lg.transpose(a)
    assert a.is_contiguous() and not t.is_contiguous() and t.is_transposed() and t.is_permuted()
    rows = lg.view_3d(a, 2, 3, 2, a.nb[1], a.nb[2], 0)
    assert not rows.is_contiguous() and rows.is_contiguous_1() and rows.is_contiguous_rows()
    assert ctx.new_tensor_1d(F32, 1).is_scalar() and a.n_dims() == 3 and a.nrows() == 6


@pytest.mark.parametrize("ne", [[], [1, 2, 3, 4, 5], [4, -1], [2.0], ["3"], [True]])
def test_bad_shapes(ne):
    with pytest.raises(ValueError):
        lg.Context().new_tensor(F32, ne)


def test_bad_types_and_blocks():
    ctx = lg.Context()
    with pytest.raises(ValueError):
        ctx.new_tensor_1d(99, 4)
    with pytest.raises(ValueError, match="block size"):
        ctx.new_tensor_1d(lg.Q4_0, 48)


def test_context_memory_limit():
    ctx = lg.Context(mem_size=64, no_alloc=False)
    ctx.new_tensor_1d(F32, 8)
    with pytest.raises(lg.OutOfMemoryError, match="not enough space"):
        ctx.new_tensor_1d(F32, 16)


def test_host_view_follows_the_tensor_when_it_moves():
    """backend.host_view keeps the last view on the tensor; moving the tensor must not reuse it."""
    import numpy as np
    from lazyggml.backend import host_view
    from lazyggml.buffer import tensor_alloc
    from lazyggml.backends.cpu import cpu_buffer_type

    ctx = lg.Context()
    t = ctx.new_tensor_1d(lg.F32, 8)
    buf1, buf2 = cpu_buffer_type().alloc_buffer(64), cpu_buffer_type().alloc_buffer(128)
    tensor_alloc(buf1, t, 0)
    assert host_view(t) is host_view(t)
    t.buffer, t.offset = None, None
    tensor_alloc(buf2, t, 32)
    host_view(t)[...] = 7.0
    assert np.all(buf2.data[32:64].view(np.float32) == 7.0) and not buf1.data.any()
    buf2.free()
    with pytest.raises(ValueError):
        host_view(t)[...] = 1.0   # freed memory: a fresh (empty) array, not the old view


def test_the_buffer_interface_names_what_a_subclass_must_provide():
    """``Buffer`` is the interface: a device buffer that forgets a method fails naming it, instead
    of touching host memory it does not have; ``HostBuffer`` is the host memory."""
    from lazyggml.buffer import Buffer, BufferType, HostBuffer

    class Forgetful(Buffer):
        pass

    buft = BufferType("dev", host=False)
    buf = Forgetful(buft, 64)
    ctx = lg.Context()
    t = ctx.new_tensor_1d(lg.F32, 4)
    t.buffer, t.offset = buf, 0
    with pytest.raises(NotImplementedError, match="Forgetful.set_tensor"):
        lg.tensor_set(t, np.zeros(4, np.float32))
    with pytest.raises(NotImplementedError, match="Forgetful.get_tensor"):
        lg.tensor_get(t)
    assert not buf.cpy_tensor(t, t) and isinstance(buft.alloc_buffer(8), HostBuffer)


def test_a_buffer_over_existing_host_memory_uses_it_in_place():
    """GGML's ``buffer_from_host_ptr``: the CPU device wraps memory that exists (a mapped file), so
    a tensor placed in it reads and writes that memory; memory of the wrong kind is refused."""
    from lazyggml.backends.cpu import cpu_device
    from lazyggml.buffer import HostBuffer, tensor_alloc
    mem = np.arange(64, dtype=np.uint8)
    buf = cpu_device().buffer_from_host_ptr(mem)
    t = lg.Context().new_tensor_1d(lg.F32, 4)
    tensor_alloc(buf, t, 16)
    assert np.array_equal(lg.tensor_get(t).ravel(), mem[16:32].view(np.float32))
    lg.tensor_set(t, np.full(4, 2.0, np.float32))
    assert np.array_equal(mem[16:32].view(np.float32), np.full(4, 2.0, np.float32))
    assert lg.Device("dev").buffer_from_host_ptr(mem) is None      # a device that cannot: None
    for bad in (mem.astype(np.int16), mem.reshape(8, 8)):
        with pytest.raises(ValueError, match="uint8 array of at least"):
            HostBuffer(buf.buft, 64, bad)
