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
value (backends/opencl/common.h), so views and odd offsets need no sub-buffers.

Streams. As in GGML's OpenCL backend, a device has one in-order command queue, shared by its
buffers and its backends: kernels, copies and events are ordered by the queue itself, so a
blocking ``tensor_get`` after an asynchronous ``graph_compute`` sees the results. The buffers'
copies wait for their command (GGML's blocking ``set_tensor``/``get_tensor``); the backend's
``set_tensor_async``/``get_tensor_async``/``cpy_tensor_async`` only enqueue; ``event_record``
enqueues a marker, ``event_wait`` a barrier on it, ``synchronize`` is ``queue.finish()``.

Kernels. The ``.h`` and ``.cl`` files of this package are joined into one program
(``program.py``), built once per device. Its binary is kept in ``<cache>/opencl`` (``<cache>`` is
lazyggml's kernel cache directory, ``lazyggml/cache.py``), in a file named by a hash of the source,
the build options and the device and driver: a process finds it there, or builds from source and
saves it, so ``lazyggml warmup --check`` can tell whether a build is needed without building. On
PoCL the file holds the *compiled* program, which each process links (half a second): PoCL's binary
of a linked program holds every kernel compiled for a generic work-group size, which takes it half
a minute to make. Elsewhere it holds the linked program, which loads ready to run. A file that is
corrupt, or that the driver refuses, is rebuilt. PoCL also compiles each kernel per work-group
size at its first launch, into its own cache (``POCL_CACHE_DIR``, set here to ``<cache>/pocl``
unless already set, before PoCL loads; PoCL cannot build at all without a folder it can write,
so a read-only ``<cache>`` gives it a temporary one). The compiler's warnings are shown only with
``LAZYGGML_DEBUG=1``. The program's load or build, and (while ``lazyggml warmup`` listens) each
kernel's first launch, are events of ``compiling.py``'s stream. ``supports_op`` claims exactly the (op, types, layout) combinations of the
glue in ``ops.py``; the scheduler sends the rest to the CPU.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
import warnings

import numpy as np

from ... import cache, debug
from ...backend import Backend, Device, DeviceType, Registry
from ...buffer import Buffer, BufferType, Status
from ... import compiling
from ...errors import OutOfMemoryError
from ...ops import EMPTY_OPS
from .program import TENSOR_T, build_options, lanes_for, program_source
from .table import FORWARD

cl = None  # pyopencl, imported by registry(): the package is optional


def cache_dir(kind):
    """``<lazyggml's kernel cache>/<kind>`` (``lazyggml.cache``: versioned); made by the first save."""
    return os.path.join(cache.CACHE_DIR, kind)


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
        super().__init__(buft, size)
        self.queue = buft.device.queue
        try:
            self.cl_buf = cl.Buffer(buft.device.context, cl.mem_flags.READ_WRITE, max(self.size, 1))
        except cl.Error as e:
            raise OutOfMemoryError(f"{buft.name}: cannot allocate {self.size} bytes: {e}") from None

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
        super().free()


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
        # what the device is, whereas `type` is how the scheduler treats it (see "Devices" above)
        self.hardware_type = (DeviceType.CPU if cl_device.type & cl.device_type.CPU else
                              DeviceType.ACCEL if cl_device.type & cl.device_type.ACCELERATOR else DeviceType.GPU)
        self.is_cpu = self.hardware_type == DeviceType.CPU
        self.pocl = cl_device.platform.name == "Portable Computing Language"
        self._buft = OpenCLBufferType(self)
        self._context = self._queue = self._kernels = None
        self.launched = set()   # (kernel, size) launched once in this process (``OpenCLBackend._first_launch``)

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
            self._kernels = {k.function_name: k for k in self._program().all_kernels()}
        return self._kernels

    def program_path(self):
        """The file of this device's program binary in lazyggml's cache (see "Kernels" above)."""
        d = self.cl_device
        h = hashlib.sha256()
        for part in (program_source(), *build_options(), d.name, d.vendor, d.version, d.driver_version,
                     d.platform.name, d.platform.version):
            h.update(part.encode() + b"\0")
        return os.path.join(cache_dir("opencl"), f"{h.hexdigest()[:32]}.bin")

    def program_cached(self):
        """Whether the program's binary is in the cache, intact; asks the driver nothing."""
        return cache.read_entry(self.program_path()) is not None

    def _program(self):
        """The program, linked: from its cached binary, or else built from source and its binary saved;
        either is a compile event (``compiling.py``: a hit, or a miss)."""
        path = self.program_path()
        binary = cache.read_entry(path)
        if binary is not None:
            try:
                t0 = time.perf_counter()
                prg = cl.Program(self.context, [self.cl_device], [binary])
                prg = cl.link_program(self.context, [prg]) if self.pocl else prg.build()
                compiling.loaded("program", time.perf_counter() - t0, backend=self.name)
                return prg
            except cl.Error:    # refused by this driver after all: build from source, below
                pass
        prg = cl.Program(self.context, program_source())
        # -w: no warnings (left out of the file's name: it changes no code)
        options = build_options() + ([] if debug.level("LAZYGGML_DEBUG") else ["-w"])
        with compiling.compiling("program", backend=self.name), warnings.catch_warnings():
            # pyopencl's: "see the build log" (shown below with LAZYGGML_DEBUG=1), and, for compile(),
            # that its binary cache is bypassed (as meant: lazyggml's is used)
            warnings.simplefilter("ignore", cl.CompilerWarning)
            warnings.filterwarnings("ignore", "Pre-build attribute access")
            prg = prg.compile(options) if self.pocl else prg.build(options, cache_dir=False)
        build_log = prg.get_build_info(self.cl_device, cl.program_build_info.LOG).strip()
        if build_log and debug.level("LAZYGGML_DEBUG"):
            debug.enable_log()
            debug.log.info(f"{self.name}: OpenCL build log:\n{build_log}")
        cache.write_entry(path, prg.binaries[0])
        return cl.link_program(self.context, [prg]) if self.pocl else prg

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
        return FORWARD.supports(t)

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
        for fn, node in FORWARD.plan(g).nodes:
            fn(self, node)
        return Status.SUCCESS

    def launch(self, name, gsize, lsize, *args):
        if compiling.watching_launches():
            return self._first_launch(name, gsize, lsize, args)
        self.kernels[name](self.queue, gsize, lsize, *args)

    def _first_launch(self, name, gsize, lsize, args):
        """A launch while a listener of ``compiling`` wants first launches (``lazyggml warmup``):
        the driver compiles a kernel at its first launch per work-group size (per global size where
        ``lsize`` is None and the driver picks it), so each first one of this process is waited for
        and reported, a miss when PoCL's cache gained a file or, for other drivers, when it took
        longer than FIRST_LAUNCH_MISS_S."""
        size = f"local size {tuple(lsize)}" if lsize is not None else f"global size {tuple(gsize)}"
        key = (name, size)
        if key in self.device.launched:
            return self.kernels[name](self.queue, gsize, lsize, *args)
        self.device.launched.add(key)
        self.queue.finish()
        n0, t0 = _pocl_files() if self.device.pocl else 0, time.perf_counter()
        self.kernels[name](self.queue, gsize, lsize, *args)
        self.queue.finish()
        dt = time.perf_counter() - t0
        miss = _pocl_files() > n0 if self.device.pocl else dt > FIRST_LAUNCH_MISS_S
        compiling.report(compiling.CompileEvent(self.name, name, f"({size})", "miss" if miss else "hit", dt))

    def launch_rows(self, name, rows, *args, lanes=None):
        """One work-group per row (i1, i2, i3) of ``rows``; its lanes stride along ne[0]."""
        lanes = lanes or lanes_for(rows.ne[0])
        self.launch(name, (lanes * rows.ne[1], rows.ne[2], rows.ne[3]), (lanes, 1, 1), *args)


FIRST_LAUNCH_MISS_S = 0.1   # without a driver cache to look at: a first launch this slow compiled


def _pocl_files():
    """The number of compiled programs and kernels in PoCL's cache (not its temporary files)."""
    root = os.environ.get("POCL_CACHE_DIR")
    if not root:
        return 0
    return sum(not f.startswith("tempfile") and f != "last_accessed" for _, _, files in os.walk(root) for f in files)


def targ(t, extra_offset=0):
    """The two kernel arguments of tensor ``t``: its ``cl.Buffer`` and its ``tensor_t``."""
    buf = t.data_buffer()
    if not isinstance(buf, OpenCLBuffer):
        raise ValueError(f"OpenCL backend: tensor '{t.name}' is not in an OpenCL buffer ({buf!r})")
    return buf.cl_buf, np.array((t.offset + extra_offset, t.ne, t.nb), TENSOR_T)




# -- level 5: registry -------------------------------------------------------------------------------------
def _import_pyopencl():
    """pyopencl, or None. Points PoCL's kernel cache into lazyggml's before PoCL loads."""
    global cl
    if cl is None:
        if importlib.util.find_spec("pyopencl") is None:
            return None
        if "POCL_CACHE_DIR" not in os.environ:
            pocl = cache_dir("pocl")
            if not cache.writable(pocl):    # PoCL finds no device without a cache folder it can write
                cache.warn_not_writable(pocl)
                pocl = tempfile.mkdtemp(prefix="lazyggml-pocl-")
                atexit.register(shutil.rmtree, pocl, True)
            os.environ["POCL_CACHE_DIR"] = pocl
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
        want = debug.value("LAZYGGML_OPENCL_DEVICE").strip()
        if want:
            devices = _select(devices, want)
        if not devices:
            return None
        _registry = Registry("OpenCL", [OpenCLDevice(i, d) for i, d in enumerate(devices)])
    return _registry
