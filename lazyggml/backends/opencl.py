"""The OpenCL backend: device memory in ``cl.Buffer``s and one kernel launch per graph node.

Devices. ``registry()`` lists the OpenCL devices by type (GPUs, then accelerators, then CPU
devices such as PoCL), whatever platform they come from; a machine may list one PoCL device
through two platforms, and such duplicates are dropped. They are named ``OpenCL0``, ``OpenCL1``...
``LAZYGGML_OPENCL_DEVICE`` keeps only the device with that index, or those whose device or
platform name contains that text. Every device reports ``DeviceType.GPU``, PoCL's CPU device too:
the scheduler's job is to tell "the backend with its own memory, where weights are offloaded"
from "the host", and PoCL stands in for a GPU in tests and CI. pyopencl is imported lazily;
without it, or without a device, ``registry()`` returns None and lazyggml runs on the CPU alone.

Memory. A buffer type per device (``OpenCL0``...), not host memory: alignment is the device's
``CL_DEVICE_MEM_BASE_ADDR_ALIGN`` (in bytes, at least 32), the largest buffer its
``CL_DEVICE_MAX_MEM_ALLOC_SIZE``. A tensor is a byte offset in its buffer; kernels get
``(cl.Buffer, tensor_t)`` pairs, ``tensor_t`` being the offset plus GGML's ``ne``/``nb`` passed by
value (kernels/opencl/common.cl), so views and odd offsets need no sub-buffers.

Streams. As in GGML's OpenCL backend, a device has one in-order command queue, shared by its
buffers and its backends: kernels, copies and events are ordered by the queue itself, so a
blocking ``tensor_get`` after an asynchronous ``graph_compute`` sees the results. The buffers'
copies wait for their command (GGML's blocking ``set_tensor``/``get_tensor``); the backend's
``set_tensor_async``/``get_tensor_async``/``cpy_tensor_async`` only enqueue; ``event_record``
enqueues a marker, ``event_wait`` a barrier on it, ``synchronize`` is ``queue.finish()``.

Kernels. The ``.cl`` files in ``lazyggml.kernels.opencl`` are joined into one program, built once
per device. PoCL caches what it compiles (``POCL_CACHE_DIR``, set here to ``<cache>/pocl`` unless
already set, before PoCL loads); other drivers use pyopencl's binary cache in ``<cache>/opencl``;
``<cache>`` is lazyggml's kernel cache directory (``lazyggml/cache.py``). ``supports_op`` claims exactly
the (op, types, layout) combinations in ``_FORWARD`` below; the scheduler sends the rest to the CPU.
"""
from __future__ import annotations

import importlib.resources
import importlib.util
import math
import os

import numpy as np

from ..backend import Backend, Buffer, BufferType, BufferUsage, Device, DeviceType, Registry, Status
from ..kernels import KernelTable
from ..ops import EMPTY_OPS, ROPE_TYPE_NEOX, GluOp, Op, UnaryOp
from ..types import Type, type_size

cl = None  # pyopencl, imported by registry(): the package is optional

KERNEL_FILES = ("common.cl", "quants.cl", "elementwise.cl", "reduce.cl", "rope.cl", "rows.cl", "copy.cl",
                "mul_mat.cl")

# kernels/opencl/common.cl's tensor_t, field for field
TENSOR_T = np.dtype([("off", "<u8"), ("ne", "<i4", 4), ("nb", "<u8", 4)], align=True)

# Element-wise function codes of kernel_unary: GGML's unary ops keep their UnaryOp values, the
# simple math ops and SCALE/CLAMP get codes of their own. Passed to the compiler as -D options.
_EW_CODES = {**{f"EW_{u.name}": int(u) for u in UnaryOp},
             "EW_SQR": 100, "EW_SQRT": 101, "EW_LOG": 102, "EW_SIN": 103, "EW_COS": 104,
             "EW_SCALE": 105, "EW_CLAMP": 106}
_SIMPLE_EW = {Op.SQR: "EW_SQR", Op.SQRT: "EW_SQRT", Op.LOG: "EW_LOG", Op.SIN: "EW_SIN", Op.COS: "EW_COS"}
_BINARY_OPS = (Op.ADD, Op.SUB, Op.MUL, Op.DIV)

# weight types of get_rows and mul_mat -> the kernels' name suffix
_WEIGHT_TYPES = {Type.F32: "f32", Type.F16: "f16", Type.Q8_0: "q8_0", Type.Q4_K: "q4_K", Type.Q6_K: "q6_K"}

# mul_mat (mul_mat.cl says why there are two layouts of each kernel)
MV_MAX_COLS = 8     # columns of src1 up to which the mat-vec kernels run
MV_TILES = ((1, 2, 1), (2, 2, 2), (4, 2, 4), (8, 2, 8))  # CPU mat-vec: (up to n columns, R rows, NC columns)
MV_GROUP = 16       # CPU mat-vec: work-items per work-group
MV_ROWS = 4         # GPU mat-vec: rows per work-group
MM_BM = 32          # rows per tile
MM_CPU_COLS = 60    # CPU tiled kernel: columns per work-item (MM_CB * MM_TC)
MM_NC, MM_NW = 8, 8  # GPU tiled kernel: columns per work-item, work-items per group
MAX_LANES = 256     # common.cl's MAX_LANES
ROW_LANES = 64      # lanes per row for the row kernels, at most


def cache_dir(kind):
    """``<lazyggml's kernel cache>/<kind>`` (``lazyggml.cache``: versioned), created."""
    from .. import cache
    path = os.path.join(cache.cache_dir(), kind)
    os.makedirs(path, exist_ok=True)
    return path


def build_options():
    """The -D options that give the kernels lazyggml's op codes."""
    defs = dict(_EW_CODES)
    defs.update({f"OP_{o.name}": int(o) for o in _BINARY_OPS})
    defs.update({f"GLU_{g.name}": int(g) for g in GluOp})
    return [f"-D{k}={v}" for k, v in sorted(defs.items())]


def program_source():
    files = importlib.resources.files("lazyggml.kernels.opencl")
    return "\n".join(f"// ---- {name} ----\n{(files / name).read_text()}" for name in KERNEL_FILES)


# -- level 1 and 2: buffer type and buffer -----------------------------------------------------------
class OpenCLBufferType(BufferType):
    def __init__(self, device):
        d = device.cl_device
        super().__init__(device.name, device, alignment=max(32, d.mem_base_addr_align // 8),
                         max_size=d.max_mem_alloc_size, host=False)

    def alloc_buffer(self, size):
        return OpenCLBuffer(self, size)


class OpenCLBuffer(Buffer):
    """``size`` bytes of device memory; its copies go through the device's queue and wait."""

    def __init__(self, buft, size):
        # not Buffer.__init__: that would allocate host memory
        self.buft = buft
        self.size = int(size)
        self._usage = BufferUsage.ANY
        self.id = next(Buffer._ids)
        self.data = None
        self.queue = buft.device.queue
        try:
            self.cl_buf = cl.Buffer(buft.device.context, cl.mem_flags.READ_WRITE, max(self.size, 1))
        except cl.Error as e:
            raise RuntimeError(f"{buft.name}: cannot allocate {self.size} bytes: {e}") from None

    def set_tensor(self, t, data, offset, size):
        cl.enqueue_copy(self.queue, self.cl_buf, np.ascontiguousarray(data[:size]), dst_offset=t.offset + offset)

    def get_tensor(self, t, offset, size):
        out = np.empty(size, np.uint8)
        cl.enqueue_copy(self.queue, out, self.cl_buf, src_offset=t.offset + offset)
        return out

    def memset_tensor(self, t, value, offset, size):
        cl.enqueue_fill_buffer(self.queue, self.cl_buf, np.uint8(value), t.offset + offset, size).wait()

    def cpy_tensor(self, src, dst):
        sbuf = src.data_buffer()
        if not _on_same_device(sbuf, self):
            return False
        cl.enqueue_copy(self.queue, self.cl_buf, sbuf.cl_buf, byte_count=src.nbytes(), src_offset=src.offset,
                        dst_offset=dst.offset).wait()
        return True

    def clear(self, value=0):
        if self.size:
            cl.enqueue_fill_buffer(self.queue, self.cl_buf, np.uint8(value), 0, self.size).wait()

    def free(self):
        if self.cl_buf is not None:
            self.cl_buf.release()
            self.cl_buf = None
        self.size = 0


def _on_same_device(buf, other):
    return isinstance(buf, OpenCLBuffer) and buf.buft.device is other.buft.device


# -- events ---------------------------------------------------------------------------------------------
class OpenCLEvent:
    """GGML's backend event: the marker enqueued by the last ``event_record``."""

    def __init__(self, device):
        self.device = device
        self.marker = None


# -- level 3 and 4: device and backend ---------------------------------------------------------------
class OpenCLDevice(Device):
    def __init__(self, index, cl_device):
        desc = f"{cl_device.name.strip()} ({cl_device.platform.name.strip()}, {cl_device.version.strip()})"
        super().__init__(f"OpenCL{index}", desc, DeviceType.GPU)
        self.cl_device = cl_device
        self.is_cpu = bool(cl_device.type & cl.device_type.CPU)
        self._buft = OpenCLBufferType(self)
        self._context = self._queue = self._kernels = None

    # the context, the queue and the program are made on first use
    @property
    def context(self):
        if self._context is None:
            self._context = cl.Context([self.cl_device])
        return self._context

    @property
    def queue(self):
        if self._queue is None:
            self._queue = cl.CommandQueue(self.context)
        return self._queue

    def kernels(self):
        """Every kernel of the program, by name; built once per device (and cached on disk)."""
        if self._kernels is None:
            prg = cl.Program(self.context, program_source()).build(options=build_options(),
                                                                   cache_dir=cache_dir("opencl"))
            self._kernels = {k.function_name: k for k in prg.all_kernels()}
        return self._kernels

    def memory(self):
        total = self.cl_device.global_mem_size
        return total, total  # OpenCL cannot say how much is free

    def get_buffer_type(self):
        return self._buft

    def supports_buft(self, buft):
        return buft is self._buft

    def supports_op(self, t):
        if t.op in EMPTY_OPS:
            return True
        return _FORWARD.supports(t)

    def init_backend(self):
        return OpenCLBackend(self)

    def event_new(self):
        return OpenCLEvent(self)

    def event_synchronize(self, event):
        if event.marker is not None:
            event.marker.wait()


class OpenCLBackend(Backend):
    """The device's in-order command queue; ``graph_compute`` only enqueues."""

    def __init__(self, device):
        super().__init__(device)
        self.queue = device.queue
        self.kernels = device.kernels()
        # mul_mat.cl's layouts: on a CPU device a work-item has a tile of its own (its SIMD lanes
        # are float16 components); on a GPU neighbouring work-items share a row (mv_lanes of
        # them, a warp's worth) or a tile
        self.cpu_layout = device.is_cpu
        self.mv_lanes = 32

    # -- async copies and events --
    def set_tensor_async(self, t, data, offset, size):
        # a private copy: the caller may reuse `data` at once; pyopencl keeps it alive until done
        host = np.array(data[:size], dtype=np.uint8, copy=True)
        cl.enqueue_copy(self.queue, t.data_buffer().cl_buf, host, dst_offset=t.offset + offset, is_blocking=False)

    def get_tensor_async(self, t, offset, size):
        out = np.empty(size, np.uint8)
        cl.enqueue_copy(self.queue, out, t.data_buffer().cl_buf, src_offset=t.offset + offset, is_blocking=False)
        return out

    def cpy_tensor_async(self, backend_src, backend_dst, src, dst):
        """Device to device, when both tensors are on this device (then so is backend_src's queue)."""
        sbuf, dbuf = src.data_buffer(), dst.data_buffer()
        if not (isinstance(backend_src, OpenCLBackend) and backend_src.device is self.device
                and _on_same_device(sbuf, dbuf) and dbuf.buft.device is self.device):
            return False
        cl.enqueue_copy(self.queue, dbuf.cl_buf, sbuf.cl_buf, byte_count=src.nbytes(), src_offset=src.offset,
                        dst_offset=dst.offset)
        return True

    def event_record(self, event):
        event.marker = cl.enqueue_marker(self.queue)

    def event_wait(self, event):
        if event.marker is None:
            return
        if event.device is self.device:
            cl.enqueue_barrier(self.queue, wait_for=[event.marker])
        else:  # another context's event cannot be waited for on this queue
            event.marker.wait()

    def synchronize(self):
        self.queue.finish()

    # -- compute --
    def graph_compute(self, g):
        for fn, node in _FORWARD.runnable(g):
            fn(self, node)
        return Status.SUCCESS

    def launch(self, name, gsize, lsize, *args):
        self.kernels[name](self.queue, gsize, lsize, *args)

    def launch_rows(self, name, rows, *args, lanes=None):
        """One work-group per row (i1, i2, i3) of ``rows``; its lanes stride along ne[0]."""
        lanes = lanes or _lanes(rows.ne[0])
        self.launch(name, (lanes * rows.ne[1], rows.ne[2], rows.ne[3]), (lanes, 1, 1), *args)


def _lanes(n, most=ROW_LANES):
    """The smallest power of two >= n, capped at ``most``."""
    return min(most, 1 << max(0, int(n) - 1).bit_length())


def targ(t, extra_offset=0):
    """The two kernel arguments of tensor ``t``: its ``cl.Buffer`` and its ``tensor_t``."""
    buf = t.data_buffer()
    if not isinstance(buf, OpenCLBuffer):
        raise ValueError(f"OpenCL backend: tensor '{t.name}' is not in an OpenCL buffer ({buf!r})")
    return buf.cl_buf, np.array((t.offset + extra_offset, t.ne, t.nb), TENSOR_T)


# -- the ops: (launch, supports) per op, GGML's compute switch as a table --------------------------------
_FORWARD = KernelTable("OpenCL")
_forward = _FORWARD.forward


def _f32(*ts):
    return all(t is not None and t.type == Type.F32 for t in ts)


def _all_f32(node):
    return _f32(node, *[s for s in node.src if s is not None])


def _index(t):
    return t.type in (Type.I32, Type.I64)


@_forward(Op.SQR, Op.SQRT, Op.LOG, Op.SIN, Op.COS, Op.UNARY, Op.SCALE, Op.CLAMP, supports=_all_f32)
def _unary(be, node):
    p0 = p1 = 0.0
    if node.op == Op.UNARY:
        code = _EW_CODES[f"EW_{UnaryOp(node.op_params[0]).name}"]
    elif node.op in (Op.SCALE, Op.CLAMP):
        code = _EW_CODES[f"EW_{node.op.name}"]
        p0, p1 = node.op_params
    else:
        code = _EW_CODES[_SIMPLE_EW[node.op]]
    be.launch_rows("kernel_unary", node, *targ(node.src[0]), *targ(node), np.int32(code), np.float32(p0),
                   np.float32(p1))


@_forward(*_BINARY_OPS, Op.ADD1, supports=_all_f32)
def _binary(be, node):
    op = Op.ADD if node.op == Op.ADD1 else node.op  # ADD1 adds a scalar: ADD with broadcasting
    be.launch_rows("kernel_binary", node, *targ(node.src[0]), *targ(node.src[1]), *targ(node), np.int32(op))


@_forward(Op.GLU, supports=_all_f32)
def _glu(be, node):
    a, b = node.src[0], node.src[1]
    if b is None:  # value and gate are the two halves of each row of a
        half = node.ne[0] * a.nb[0]
        swapped = node.op_params[1]
        x, g = targ(a, half if swapped else 0), targ(a, 0 if swapped else half)
    else:
        x, g = targ(a), targ(b)
    be.launch_rows("kernel_glu", node, *x, *g, *targ(node), np.int32(node.op_params[0]))


@_forward(Op.DIAG_MASK_INF, supports=_all_f32)
def _diag_mask_inf(be, node):
    be.launch_rows("kernel_diag_mask_inf", node, *targ(node.src[0]), *targ(node), np.int32(node.op_params[0]))


@_forward(Op.SUM_ROWS, Op.MEAN, supports=_all_f32)
def _sum_rows(be, node):
    a = node.src[0]
    be.launch_rows("kernel_sum_rows", a, *targ(a), *targ(node), np.int32(node.op == Op.MEAN))


@_forward(Op.SUM, supports=_all_f32)
def _sum(be, node):
    be.launch("kernel_sum", (MAX_LANES,), (MAX_LANES,), *targ(node.src[0]), *targ(node))


@_forward(Op.ARGMAX, supports=lambda n: _f32(n.src[0]) and n.type == Type.I32)
def _argmax(be, node):
    a = node.src[0]
    be.launch_rows("kernel_argmax", a, *targ(a), *targ(node))


@_forward(Op.NORM, Op.RMS_NORM, supports=_all_f32)
def _norm(be, node):
    a = node.src[0]
    be.launch_rows("kernel_norm", a, *targ(a), *targ(node), np.float32(node.op_params[0]),
                   np.int32(node.op == Op.RMS_NORM))


def _soft_max_ok(node):
    m = node.src[1]
    return _f32(node, node.src[0]) and (m is None or m.type in (Type.F32, Type.F16))


@_forward(Op.SOFT_MAX, supports=_soft_max_ok)
def _soft_max(be, node):
    a, mask = node.src[0], node.src[1]
    scale, max_bias = node.op_params
    # ALiBi (GGML's soft_max): heads below the largest power of two <= n_head get m0^(h+1),
    # the others m1^(2(h - n_head_log2) + 1)
    n_head_log2 = 1 << int(math.floor(math.log2(a.ne[2])))
    m0 = np.float32(2.0) ** np.float32(-max_bias / n_head_log2)
    m1 = np.float32(2.0) ** np.float32(-(max_bias / 2.0) / n_head_log2)
    mask_type = 0 if mask is None else (1 if mask.type == Type.F32 else 2)
    be.launch_rows("kernel_soft_max", a, *targ(a), *targ(mask if mask is not None else a), *targ(node),
                   np.int32(mask_type), np.float32(scale), np.float32(max_bias), np.float32(m0), np.float32(m1),
                   np.int32(n_head_log2), lanes=_lanes(a.ne[0], MAX_LANES))


def _rope_ok(node):
    a, pos, ff = node.src[0], node.src[1], node.src[2]
    return (_f32(node, a) and pos.type == Type.I32 and (ff is None or ff.type == Type.F32)
            and node.op_params[2] in (0, ROPE_TYPE_NEOX))


def rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    """GGML's ``ggml_rope_yarn_corr_dims``, in float32 as GGML computes it."""
    f = np.float32

    def corr_dim(n_rot):
        return f(n_dims) * np.log(f(n_ctx_orig) / (f(n_rot) * f(2) * f(np.pi))) / (f(2) * np.log(f(freq_base)))

    with np.errstate(divide="ignore"):  # n_ctx_orig = 0 gives -inf, as in GGML
        start, end = np.floor(corr_dim(beta_fast)), np.ceil(corr_dim(beta_slow))
    return max(f(0), start), min(f(n_dims - 1), end)


@_forward(Op.ROPE, supports=_rope_ok)
def _rope(be, node):
    a, pos, ff = node.src[0], node.src[1], node.src[2]
    (_, n_dims, mode, _, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast,
     beta_slow) = node.op_params
    corr0, corr1 = rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    be.launch_rows("kernel_rope", node, *targ(a), *targ(pos), *targ(ff if ff is not None else pos),
                   np.int32(ff is not None), *targ(node), np.int32(n_dims), np.int32(mode == ROPE_TYPE_NEOX),
                   np.float32(freq_base), np.float32(freq_scale), np.float32(ext_factor), np.float32(attn_factor),
                   np.float32(corr0), np.float32(corr1), lanes=_lanes(max(n_dims // 2, a.ne[0] - n_dims)))


def _get_rows_ok(node):
    a, idx = node.src[0], node.src[1]
    return (a.type in _WEIGHT_TYPES and a.nb[0] == type_size(a.type) and _blocks_aligned(a) and _index(idx)
            and _f32(node))


@_forward(Op.GET_ROWS, supports=_get_rows_ok)
def _get_rows(be, node):
    a, idx = node.src[0], node.src[1]
    be.launch_rows(f"kernel_get_rows_{_WEIGHT_TYPES[a.type]}", node, *targ(a), *targ(idx),
                   np.int32(idx.type == Type.I64), *targ(node))


def _set_rows_ok(node):
    b, idx = node.src[0], node.src[1]
    return _f32(b) and _index(idx) and node.type in (Type.F32, Type.F16)


@_forward(Op.SET_ROWS, supports=_set_rows_ok)
def _set_rows(be, node):
    b, idx = node.src[0], node.src[1]
    be.launch_rows(f"kernel_set_rows_{_WEIGHT_TYPES[node.type]}", b, *targ(b), *targ(idx),
                   np.int32(idx.type == Type.I64), *targ(node))


def _cpy_ok(node):
    return node.src[0].type in (Type.F32, Type.F16) and node.type in (Type.F32, Type.F16)


@_forward(Op.CPY, Op.DUP, Op.CONT, supports=_cpy_ok)
def _cpy(be, node):
    a = node.src[0]
    name = f"kernel_cpy_{_WEIGHT_TYPES[a.type]}_{_WEIGHT_TYPES[node.type]}"
    be.launch_rows(name, a, *targ(a), *targ(node))


_MOVE_SIZES = {Type.F32: 4, Type.I32: 4, Type.F16: 2, Type.BF16: 2}


def _moves_ok(node):
    return node.type in _MOVE_SIZES and all(s.type == node.type for s in node.src if s is not None)


@_forward(Op.CONCAT, supports=_moves_ok)
def _concat(be, node):
    be.launch_rows(f"kernel_concat_{_MOVE_SIZES[node.type]}", node, *targ(node.src[0]), *targ(node.src[1]),
                   *targ(node), np.int32(node.op_params[0]))


@_forward(Op.PAD, supports=_moves_ok)
def _pad(be, node):
    lp = node.op_params[0::2]
    be.launch_rows(f"kernel_pad_{_MOVE_SIZES[node.type]}", node, *targ(node.src[0]), *targ(node),
                   *(np.int32(p) for p in lp))


@_forward(Op.REPEAT, supports=_moves_ok)
def _repeat(be, node):
    be.launch_rows(f"kernel_repeat_{_MOVE_SIZES[node.type]}", node, *targ(node.src[0]), *targ(node))


def _blocks_aligned(t):
    """Q4_K blocks are read with 16-byte loads (quants.cl): they must start 16-byte aligned. Buffers
    and tensors are allocated at least 32-byte aligned, so the view offset and strides decide."""
    return t.type != Type.Q4_K or (t.view_offs % 16 == 0 and all(nb % 16 == 0 for nb in t.nb[1:]))


def _mul_mat_ok(node):
    a, b = node.src[0], node.src[1]
    return (a.type in _WEIGHT_TYPES and a.nb[0] == type_size(a.type) and _blocks_aligned(a) and _f32(node, b)
            and b.nb[0] == 4 and all(nb % 4 == 0 for nb in b.nb))


@_forward(Op.MUL_MAT, supports=_mul_mat_ok)
def _mul_mat(be, node):
    """The mat-vec kernels up to MV_MAX_COLS columns, the tiled ones above, in the device's layout."""
    a, b = node.src[0], node.src[1]
    suffix = _WEIGHT_TYPES[a.type]
    m, n, batch = a.ne[1], b.ne[1], b.ne[2] * b.ne[3]
    args = (*targ(a), *targ(b), *targ(node))
    if a.type in (Type.F32, Type.F16) and a.ne[0] % 16:
        be.launch(f"kernel_mul_mat_{suffix}_f32_naive", (m, n, batch), None, *args)
    elif n <= MV_MAX_COLS and be.cpu_layout:
        _, r, nc = next(t for t in MV_TILES if n <= t[0])
        be.launch(f"kernel_mul_mv_{suffix}_f32_{r}x{nc}", (_round_up(-(-m // r), MV_GROUP), batch), (MV_GROUP, 1),
                  *args)
    elif n <= MV_MAX_COLS:
        lanes = be.mv_lanes
        be.launch(f"kernel_mul_mv_{suffix}_f32_lanes", (lanes, _round_up(m, MV_ROWS), batch), (lanes, MV_ROWS, 1),
                  *args)
    elif be.cpu_layout:
        be.launch(f"kernel_mul_mm_{suffix}_f32", (-(-m // MM_BM), -(-n // MM_CPU_COLS), batch), (1, 1, 1), *args)
    else:
        col_groups = -(-n // MM_NC)
        nw = min(MM_NW, col_groups)
        be.launch(f"kernel_mul_mm_{suffix}_f32_lanes", (-(-m // MM_BM) * nw, -(-col_groups // nw), batch),
                  (nw, 1, 1), *args)


def _round_up(n, k):
    return -(-n // k) * k


# -- level 5: registry -------------------------------------------------------------------------------------
def _import_pyopencl():
    """pyopencl, or None. Points PoCL's kernel cache into lazyggml's before PoCL loads."""
    global cl
    if cl is None:
        if importlib.util.find_spec("pyopencl") is None:
            return None
        os.environ.setdefault("POCL_CACHE_DIR", cache_dir("pocl"))
        import pyopencl
        cl = pyopencl
    return cl


def discover():
    """The OpenCL devices, GPUs first, then accelerators, then CPU devices; duplicates dropped."""
    if _import_pyopencl() is None:
        return []
    try:
        platforms = cl.get_platforms()
    except cl.Error:  # no ICD platform at all
        return []
    found, first_seen = [], {}
    for kind in (cl.device_type.GPU, cl.device_type.ACCELERATOR, cl.device_type.CPU):
        for p in platforms:
            try:
                devices = p.get_devices(device_type=kind)
            except cl.Error:  # DEVICE_NOT_FOUND
                continue
            for d in devices:
                key = (d.name.strip(), d.vendor.strip(), d.driver_version, d.global_mem_size, d.max_compute_units)
                if first_seen.setdefault(key, p) is p:  # another platform listing the same device: skip
                    found.append(d)
    return found


def _select(devices, want):
    """``LAZYGGML_OPENCL_DEVICE``: an index into ``devices`` or a piece of a device or platform name."""
    names = [f"{d.name.strip()} ({d.platform.name.strip()})" for d in devices]
    if want.isdigit():
        chosen = [devices[int(want)]] if int(want) < len(devices) else []
    else:
        chosen = [d for d, n in zip(devices, names) if want.lower() in n.lower()]
    if not chosen:
        raise RuntimeError(f"LAZYGGML_OPENCL_DEVICE={want!r} matches no OpenCL device; found: {names or 'none'}"
                           + ("" if cl is not None else " (pyopencl is not installed: pip install 'lazyggml[opencl]')"))
    return chosen


_registry = None


def registry():
    """The OpenCL registry; None when pyopencl or a device is missing, unless
    ``LAZYGGML_OPENCL_DEVICE`` asks for one (then a RuntimeError says what was found)."""
    global _registry
    if _registry is None:
        devices = discover()
        want = os.environ.get("LAZYGGML_OPENCL_DEVICE", "").strip()
        if want:
            devices = _select(devices, want)
        if not devices:
            return None
        _registry = Registry("OpenCL", [OpenCLDevice(i, d) for i, d in enumerate(devices)])
    return _registry
