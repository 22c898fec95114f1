"""The CUDA backend (numba-cuda): one device per GPU, device buffers, a stream, events, CUDA graphs.

**Devices.** ``registry()`` finds the GPUs through numba-cuda and names them ``CUDA0``, ``CUDA1``...;
it returns None when numba-cuda is missing or no GPU answers. Under numba-cuda's simulator
(``NUMBA_ENABLE_CUDASIM=1`` before numba is imported) it offers simulated devices, but only when
``LAZYGGML_CUDA_SIM=N`` asks for N of them: the simulator is for tests, never a default device.

**Memory.** A buffer is one device array of bytes; a tensor lives at its byte ``offset`` in it. A
kernel gets *flat views* of tensors (``view(t, dtype)``: the tensor's span, reinterpreted) plus
element strides, so strided views need no copies. Views are cached per (buffer, offset, span,
dtype): building a numba device-array view costs host time, and graphs of equal shapes ask for
the same views again. ``set``/``get`` run on a per-GPU transfer stream and wait for it (GGML:
``cudaStreamPerThread``): they are *not* ordered after a backend's queued work, so synchronize
the backend before reading its results (``backend_graph_compute`` does).

**Compute.** ``graph_compute`` launches one kernel (or a few: mul_mat quantizes its activations
first) per node on the backend's stream and returns at once; ``synchronize`` waits. Views, NONE
nodes, nodes without the COMPUTE flag and empty tensors are skipped, as on the CPU.

**CUDA graphs** (``graphs.py``; ``LAZYGGML_CUDA_GRAPHS=0`` turns them off): a graph computed
again under the reuse contract (``graph.py``: same ``version``, no tensor moved; the kernel
table's ``GraphPlan`` decides it in O(1)) is run eagerly the first time, captured the second, and
replayed from then on with one driver call. A model runner that wants replays keeps its graph
(llama.cpp pads the KV length to 256 so that one graph serves 256 tokens). At most
``MAX_CACHED_GRAPHS`` captured graphs are kept (least recently launched dropped first). Work
areas (``scratch``) only grow; when one must grow, every captured graph is dropped, since graphs
hold the old addresses (the old area and graphs are freed at the next ``synchronize``: queued work
may still use them).
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

import numpy as np

from ... import debug
from ...backend import Backend, Device, DeviceType, Registry
from ...buffer import Buffer, BufferType, Status
from ...errors import OutOfMemoryError
from ...ops import EMPTY_OPS, Op
from .table import FORWARD

MAX_CACHED_GRAPHS = 32
OFFLOAD_MIN_BATCH = 32   # GGML: an op on host weights is worth moving to the GPU from 32 rows on


def _cuda():
    from numba import cuda
    return cuda


def simulated():
    from numba import config
    return bool(config.ENABLE_CUDASIM)


# -- buffers ---------------------------------------------------------------------------------------
class CUDABufferType(BufferType):
    def __init__(self, device):
        super().__init__(device.name, device, alignment=128, host=False)

    def alloc_buffer(self, size):
        return CUDABuffer(self, size)


class CUDABuffer(Buffer):
    """``size`` bytes of device memory as one numba device array of ``uint8`` (``self.dev``)."""

    def __init__(self, buft, size):
        super().__init__(buft, size)
        self._views = {}
        with buft.device.context():
            try:
                self.dev = _cuda().device_array(max(self.size, 1), np.uint8)
            except Exception as e:    # numba-cuda's CudaAPIError (CUDA_ERROR_OUT_OF_MEMORY), or MemoryError
                raise OutOfMemoryError(f"{buft.name}: cannot allocate {self.size} bytes: {e}") from None
        self.ptr = None if simulated() else int(self.dev.device_ctypes_pointer.value)   # for raw copies

    def view(self, offset, nbytes, dtype, cols=None):
        """Bytes ``offset .. offset+nbytes`` as a flat ``dtype`` array, or 2-D with ``cols`` columns."""
        key = (offset, nbytes, dtype, cols)
        v = self._views.get(key)
        if v is None:
            v = self.dev[offset:offset + nbytes].view(dtype)
            self._views[key] = v = v if cols is None else v.reshape(v.size // cols, cols)
        return v

    # Plain set/get/copy run on the GPU's transfer stream and wait for it, as GGML's do on
    # cudaStreamPerThread: they are not ordered after a backend's queued work (synchronize the
    # backend first), and they do not wait for it either, so the scheduler can feed one
    # micro-batch's inputs while the GPU still computes the previous one.
    def _sync_copy(self, copy):
        dev = self.buft.device
        with dev.context():
            stream = dev.transfer_stream()
            out = copy(stream)
            stream.synchronize()
        return out

    def set_tensor(self, t, data, offset, size):
        host = np.ascontiguousarray(data[:size])
        if simulated():
            start = t.offset + offset
            self._sync_copy(lambda s: self.dev[start:start + size].copy_to_device(host, stream=s))
            return
        dev = self.buft.device
        with dev.context():
            h = _cu_stream(dev.transfer_stream())
            _raw_upload(self.ptr + t.offset + offset, host, h)
            _raw_sync(h)

    def get_tensor(self, t, offset, size):
        if simulated():
            start = t.offset + offset
            return self._sync_copy(lambda s: self.dev[start:start + size].copy_to_host(stream=s))
        dev = self.buft.device
        with dev.context():
            h = _cu_stream(dev.transfer_stream())
            out = _raw_download(self.ptr + t.offset + offset, size, h)
            _raw_sync(h)
        return out

    def memset_tensor(self, t, value, offset, size):
        self.set_tensor(t, np.full(size, value, np.uint8), offset, size)

    def cpy_tensor(self, src, dst):
        sbuf = src.data_buffer()
        if not isinstance(sbuf, CUDABuffer) or sbuf.buft is not self.buft:
            return False   # another GPU's buffer: the generic path copies through the host
        n = src.nbytes()
        self._sync_copy(lambda s: self.dev[dst.offset:dst.offset + n].copy_to_device(
            sbuf.dev[src.offset:src.offset + n], stream=s))
        return True

    def clear(self, value=0):
        if self.size:
            fill = np.full(self.dev.size, value, np.uint8)
            self._sync_copy(lambda s: self.dev.copy_to_device(fill, stream=s))

    def free(self):
        self._views.clear()
        self.dev = None
        super().free()


# -- device, events, backend -----------------------------------------------------------------------
class CUDAEvent:
    def __init__(self, device):
        self.device = device
        with device.context():
            self.event = _cuda().event() if simulated() else _cuda().event(timing=False)


_pinned = threading.local()   # .done: this thread made the only GPU's context current for good


class CUDADevice(Device):
    def __init__(self, index, description, only=False):
        super().__init__(f"CUDA{index}", description, DeviceType.GPU)
        self.index = index
        self._only = only   # the machine's only GPU
        self._buft = CUDABufferType(self)
        self._context = None
        self._transfer_stream = None
        self._peers = {}    # other GPU's index -> whether peer access is enabled

    def context(self):
        """Make this GPU current for numba and the driver (a no-op under the simulator). With several
        GPUs, numba's device scope: a push and a pop of the GPU's primary context, about four driver
        calls. With one, as the CUDA runtime (and GGML's ``ggml_cuda_set_device``) does: the primary
        context is pushed once per thread and stays current, so a scope costs nothing; a decoded
        token enters seven of them."""
        if simulated():
            return contextlib.nullcontext()
        if self._only:
            if not getattr(_pinned, "done", False):
                _cuda().gpus[self.index].get_primary_context().push()
                _pinned.done = True
            return contextlib.nullcontext()
        return _cuda().gpus[self.index]

    def transfer_stream(self):
        """The stream of plain (synchronous) copies to and from this GPU's buffers."""
        if self._transfer_stream is None:
            with self.context():
                self._transfer_stream = _cuda().stream()
        return self._transfer_stream

    def cuda_context(self):
        """numba's context of this GPU (its primary context)."""
        if self._context is None:
            with self.context():
                self._context = _cuda().current_context()
        return self._context

    def enable_peer_access(self, other):
        """Let kernels and copies on this GPU read ``other``'s memory directly, where the hardware
        allows (once per pair; GGML does the same before its first peer copy)."""
        if other.index in self._peers:
            return
        ctx = self.cuda_context()
        ok = ctx.can_access_peer(other.index)
        if ok:
            with self.context():
                try:
                    ctx.enable_peer_access(other.cuda_context().handle)
                except Exception as e:   # already enabled is fine; anything else: staged copies
                    ok = "ALREADY_ENABLED" in str(e)
        self._peers[other.index] = ok

    def memory(self):
        if simulated():
            return (0, 0)
        with self.context():
            free, total = _cuda().current_context().get_memory_info()
        return int(free), int(total)

    def get_buffer_type(self):
        return self._buft

    def supports_op(self, t):
        if t.op in EMPTY_OPS:
            return True
        return FORWARD.supports(t)   # loads the kernel modules on first use

    def offload_op(self, t):
        """GGML's rule: an op whose batch reaches 32 is worth running here even when its weights sit
        in host memory. The batch is ``ne[1]`` for MUL_MAT, ``ne[2]`` (tokens) for ROPE and
        MUL_MAT_ID, 0 for GET_ROWS (a table lookup), else the rows of the result."""
        if t.op in EMPTY_OPS or t.op == Op.GET_ROWS:
            return False
        batch = t.ne[1] if t.op == Op.MUL_MAT else t.ne[2] if t.op in (Op.ROPE, Op.MUL_MAT_ID) else t.nrows()
        return batch >= OFFLOAD_MIN_BATCH

    def init_backend(self):
        return CUDABackend(self)

    def event_new(self):
        return CUDAEvent(self)

    def event_synchronize(self, event):
        event.event.synchronize()


class CUDABackend(Backend):
    def __init__(self, device):
        super().__init__(device)
        FORWARD.load()   # numba compiles each kernel on its first launch
        with device.context():
            self.stream = _cuda().stream()
        self._scratch = {}           # name -> device array of bytes
        self._scratch_views = {}
        self._captured = OrderedDict()  # id -> _Replay holding a captured graph, least recently used first
        self._scratch_epoch = 0         # bumped when a work area moves: captured graphs hold its address
        self._retired = []              # old work areas and graphs, freed at the next synchronize
        self._capturing = False
        # (kind, tensor, bytes) of the activations quantized in the "q8" work area, for reuse by the
        # next product of the same tensor in this run (cuda/ops.py's MUL_MAT); None when stale
        self.q8_of = None
        # the mask whose visible cells fattn.py listed in its work area in this run (a model's
        # attention nodes share one mask); None when stale
        self.cells_of = None
        self.use_graphs = not simulated() and debug.flag("LAZYGGML_CUDA_GRAPHS")

    # -- what the kernels' glue uses
    def view(self, t, dtype, extra=0, cols=None):
        """Device view of ``t``'s bytes from ``extra`` bytes past its start, as ``dtype``: flat, or
        2-D with ``cols`` columns (quantized tensors: one row per block); a flat view ends at the last
        whole ``dtype`` element (Q6_K tensors seen as int32)."""
        n = t.nbytes() - extra
        return t.data_buffer().view(t.offset + extra, n - n % np.dtype(dtype).itemsize, dtype, cols)

    def scratch(self, name, nbytes, dtype, cols=None):
        """A work area of at least ``nbytes``, viewed as ``dtype`` (2-D with ``cols`` columns if
        given); reused by later nodes (the stream orders them), grown when too small."""
        key = (name, nbytes, dtype, cols)
        v = self._scratch_views.get(key)
        if v is not None:
            return v
        arr = self._scratch.get(name)
        if arr is None or arr.size < nbytes:
            if self._capturing:
                raise RuntimeError("CUDA backend: a work area had to grow during graph capture")
            # queued kernels may still use the old area, and queued replays the captured graphs
            # that hold its address: both are kept until the next synchronize (no wait here, so a
            # prompt's micro-batches stay queued while flash attention's areas grow)
            if arr is not None:
                self._retired.append(arr)
            self._scratch[name] = arr = _cuda().device_array(max(nbytes, 256), np.uint8)
            self._scratch_views = {k: v for k, v in self._scratch_views.items() if k[0] != name}
            self._scratch_epoch += 1
            for st in self._captured.values():
                self._retired.append(st.graph)
                st.graph = None
            self._captured.clear()
        v = arr[:nbytes].view(dtype)
        self._scratch_views[key] = v = v if cols is None else v.reshape(v.size // cols, cols)
        return v

    # -- interface
    def graph_compute(self, g):
        gp = FORWARD.plan(g)
        st = gp.state.get(self)
        with self.device.context():
            if st is None:              # first run: eager, which also compiles every kernel
                from .ops import fuse       # loaded with the kernels (FORWARD.load), never before
                st = gp.state[self] = _Replay(fuse(gp.nodes, g))
                self._run(st.runs)
            elif not self.use_graphs:
                self._run(st.runs)
            elif st.graph is None or st.scratch_epoch != self._scratch_epoch:
                from .graphs import capture    # second run (or work areas moved): capture
                if st.graph is not None:
                    st.graph.free()
                self._capturing = True
                try:
                    st.graph = capture(self.stream, lambda: self._run(st.runs))
                finally:
                    self._capturing = False
                st.scratch_epoch = self._scratch_epoch
                self._captured[id(st)] = st
                if len(self._captured) > MAX_CACHED_GRAPHS:   # least recently launched first
                    self._captured.popitem(last=False)[1].drop()
                st.graph.launch(self.stream)
            else:
                self._captured.move_to_end(id(st))
                st.graph.launch(self.stream)
        return Status.SUCCESS

    def _run(self, nodes):
        self.q8_of = self.cells_of = None
        for fn, node in nodes:
            self.writes(node)
            fn(self, node)

    def writes(self, t):
        """A kernel is about to write ``t``: forget the q8_1 activations and the mask's cell lists
        if their sources are being overwritten."""
        q8 = self.q8_of
        if q8 is not None and _overlaps(t, q8[1]):
            self.q8_of = None
        if self.cells_of is not None and _overlaps(t, self.cells_of):
            self.cells_of = None

    def _drop_graphs(self):
        for st in self._captured.values():
            st.drop()
        self._captured.clear()

    # Stream work runs with this backend's GPU current: with several GPUs, the scheduler calls
    # one backend right after another's.
    def synchronize(self):
        with self.device.context():
            if simulated():
                self.stream.synchronize()
            else:
                _raw_sync(_cu_stream(self.stream))
        if self._retired:
            self._retired.clear()   # the stream is idle: retired work areas and graphs can go

    host_copy_snapshots = True   # uploads from pageable memory are staged before the call returns

    def set_tensor_async(self, t, data, offset, size):
        host = np.ascontiguousarray(data[:size])
        with self.device.context():
            if simulated():
                t.data_buffer().view(t.offset + offset, size, np.uint8).copy_to_device(host, stream=self.stream)
            else:
                _raw_upload(t.data_buffer().ptr + t.offset + offset, host, _cu_stream(self.stream))

    def get_tensor_async(self, t, offset, size):
        start = t.offset + offset
        with self.device.context():
            return t.data_buffer().dev[start:start + size].copy_to_host(stream=self.stream)

    def cpy_tensor_async(self, backend_src, backend_dst, src, dst):
        """Device to device on this (the destination's) stream, after the source's queued work;
        between two GPUs a peer copy (``cuMemcpyPeerAsync``: over NVLink/PCIe directly where peer
        access is possible, staged by the driver otherwise)."""
        sbuf, dbuf = src.data_buffer(), dst.data_buffer()
        if not (isinstance(sbuf, CUDABuffer) and isinstance(dbuf, CUDABuffer)
                and isinstance(backend_src, CUDABackend)):
            return False
        if backend_src is not self:      # our copy must wait for the source backend's queued work
            ev = CUDAEvent(backend_src.device)
            with backend_src.device.context():
                ev.event.record(backend_src.stream)
        n = src.nbytes()
        with self.device.context():
            if backend_src is not self:
                ev.event.wait(self.stream)
            d, s = dbuf.dev[dst.offset:dst.offset + n], sbuf.dev[src.offset:src.offset + n]
            if sbuf.buft.device is self.device or simulated():
                d.copy_to_device(s, stream=self.stream)
            else:
                _peer_copy(d, self.device, s, sbuf.buft.device, n, self.stream)
        return True

    def event_record(self, event):
        with self.device.context():
            event.event.record(self.stream)

    def event_wait(self, event):
        with self.device.context():
            event.event.wait(self.stream)

    def free(self):
        self._drop_graphs()


# The per-token path (input uploads, the logits' download, stream waits) calls the driver through
# cuda.bindings: numba's wrappers look the current context up at every call, several driver calls
# and ~30 µs of host time per copy.
_cu_streams = {}


def _cu_stream(stream):
    """The driver handle of a numba stream (cached)."""
    h = _cu_streams.get(id(stream))
    if h is None or h[0] is not stream:
        from cuda.bindings import driver as drv
        h = _cu_streams[id(stream)] = (stream, drv.CUstream(int(stream.handle)))
    return h[1]


def _raw_upload(dev_ptr, host, stream):
    """Queue ``host`` (contiguous, pageable: staged before the call returns) to ``dev_ptr``."""
    from cuda.bindings import driver as drv
    from .graphs import _check
    _check(drv.cuMemcpyHtoDAsync(drv.CUdeviceptr(dev_ptr), host.ctypes.data, host.nbytes, stream), "cuMemcpyHtoDAsync")


def _raw_download(dev_ptr, nbytes, stream):
    from cuda.bindings import driver as drv
    from .graphs import _check
    out = np.empty(nbytes, np.uint8)
    _check(drv.cuMemcpyDtoHAsync(out.ctypes.data, drv.CUdeviceptr(dev_ptr), nbytes, stream), "cuMemcpyDtoHAsync")
    return out


def _raw_sync(stream):
    from cuda.bindings import driver as drv
    from .graphs import _check
    _check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")


def _peer_copy(dst, dst_dev, src, src_dev, nbytes, stream):
    """``nbytes`` from ``src`` (on ``src_dev``) to ``dst`` (on ``dst_dev``), queued on ``stream``."""
    from cuda.bindings import driver as drv
    from .graphs import _check
    dctx, sctx = dst_dev.cuda_context(), src_dev.cuda_context()
    dst_dev.enable_peer_access(src_dev)
    _check(drv.cuMemcpyPeerAsync(drv.CUdeviceptr(dst.device_ctypes_pointer.value), drv.CUcontext(int(dctx.handle)),
                                 drv.CUdeviceptr(src.device_ctypes_pointer.value), drv.CUcontext(int(sctx.handle)),
                                 nbytes, drv.CUstream(int(stream.handle))), "cuMemcpyPeerAsync")


def _overlaps(a, b):
    """Do tensors ``a`` and ``b`` share bytes?"""
    ba, bb = a.data_buffer(), b.data_buffer()
    return ba is bb and a.offset < b.offset + b.nbytes() and b.offset < a.offset + a.nbytes()


class _Replay:
    """What this backend keeps in a graph's ``GraphPlan``: the run list (``ops.fuse``), the CUDA
    graph (None until the second run captures it) and the work-area epoch it was captured under."""

    __slots__ = ("runs", "graph", "scratch_epoch")

    def __init__(self, runs):
        self.runs, self.graph, self.scratch_epoch = runs, None, -1

    def drop(self):
        if self.graph is not None:
            self.graph.free()
            self.graph = None


# -- registry --------------------------------------------------------------------------------------
_registry = None


def registry():
    """The CUDA registry, or None without numba-cuda or a GPU (see the module docstring)."""
    global _registry
    if _registry is None:
        try:
            cuda = _cuda()
        except ImportError:
            return None
        if simulated():
            n_sim = debug.value("LAZYGGML_CUDA_SIM")
            if not n_sim.isdigit() or int(n_sim) < 1:
                return None
            devices = [CUDADevice(i, "numba-cuda simulator") for i in range(int(n_sim))]
        else:
            try:
                if not cuda.is_available():
                    return None
                gpus = list(cuda.gpus)
                devices = [CUDADevice(i, g.name.decode() if isinstance(g.name, bytes) else str(g.name),
                                      only=len(gpus) == 1) for i, g in enumerate(gpus)]
            except Exception:   # a driver that is present but unusable: no CUDA devices
                return None
        _registry = Registry("CUDA", devices)
    return _registry
