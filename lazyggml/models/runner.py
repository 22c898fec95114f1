"""The generic runner: a GGUF model of any architecture in ``archs.py``, loaded, with its KV cache,
its graphs per batch shape, ``eval`` and ``generate`` (llama.cpp's ``llama_model`` + ``llama_context``).

The graph itself comes from the architecture's builder (``archs.get_arch(general.architecture)``,
built through ``builder.GraphBuilder``); everything here is the same for every family.

With **flash attention** (``flash_attn``; by default on when every layer's backend runs
``FLASH_ATTN_EXT``, as llama.cpp's ``-fa auto``) attention is one ``flash_attn_ext`` node that reads
the window's cells once and never writes the scores; V is stored like K, a row per cell. The CPU's
kernel has the arithmetic of GGML's (F16 sums while decoding, float32 tiles for batches of 64 and
more), so a model gives llama.cpp's numbers when both run with flash attention; ``flash_attn=False``
gives llama.cpp's without it (llama-cpp-python's default), with V stored transposed (``builder.py``).

Weights are loaded once into ``WEIGHTS`` buffers of the device that should compute with them:
the CPU's are used in place from the mapped file (``mmap``, llama.cpp's ``use_mmap``), a device's
are copied there (``n_gpu_layers``: the last N layers, and with N above the layer count the output too; over
several GPUs in consecutive runs of layers, ``split_layers``); the scheduler follows them, with
one split per device and the hidden state copied across. When several devices hold everything,
the scheduler runs pipeline-parallel (4 copy slots) and a prompt's micro-batches are queued
without waiting, so one device works on batch k+1 while the next still works on batch k. The
compute buffers are sized once, at load, for the largest micro-batch over the whole context, so
no later graph has to reallocate (and wait). The graph of a batch shape is built once and
replayed while the KV window (padded to ``KV_PAD`` cells, ``KV_PAD_BATCH`` for prefill) is
unchanged, as llama.cpp's graph reuse does.
"""
from __future__ import annotations

import codecs
import logging
import math
import time
from collections import OrderedDict

import numpy as np

from .. import ops
from ..ops import op_desc
from ..alloc import alloc_ctx_tensors_from_buft
from ..buffer import BufferUsage, tensor_alloc
from ..backend import DeviceType, host_layout, host_view, tensor_get, tensor_set
from ..registry import dev_by_name, dev_count, dev_get, rpc_add_server
from ..backends.cpu import backend_cpu_init, set_n_threads
from ..errors import GGUFError, OutOfMemoryError
from ..gguf_io import read_gguf
from ..quants import dequantize
from .archs import get_arch
from .builder import ROPE_FACTORS, GraphBuilder
from .hparams import HParams, check_tensors
from ..sampling import Sampler
from ..sched import Scheduler
from ..tensor import Context
from ..tokenizer import Tokenizer
from ..types import Type, row_size, type_name

__all__ = ["Model", "load_model", "offload_devices", "split_layers", "N_BATCH", "N_BATCH_GPU", "KV_PAD",
           "KV_PAD_BATCH"]

log = logging.getLogger("lazyggml")

# The attention window grows in steps of this many cells, so that graphs repeat. A new window
# means a new graph (built, allocated and planned: ~5 ms for the 3.7M model, ~15 ms for a 125M
# one), against attention over masked cells: decode steps take llama.cpp's 256 (get_n_kv), one
# graph for 256 tokens; prefill micro-batches, which build a graph each anyway and whose
# attention grows with the window times the batch, take 32.
KV_PAD = 256
KV_PAD_BATCH = 32
# Prefill micro-batch (tokens per graph) on the CPU. Measured on 2 threads (AVX2 machine, tok/s
# alternating in one process): a 512-token prompt on the 125M model 356 / 474 / 461 / 454 at
# 64 / 128 / 256 / 512, the 3.7M model's 128-token prompt 6,152 / 6,759 at 64 / 128: from 128 on,
# each weight row is read once per 128 activation rows, and larger batches only grow the buffers.
N_BATCH = 128
N_BATCH_GPU = 512  # ... and when the output layer, hence every layer, is on a GPU (llama.cpp's n_ubatch)
DECODE_GRAPHS = 4  # decode graphs kept (each with a scheduler and its small compute buffers)
PROMPT_GRAPHS = 4  # prompt micro-batch graphs kept (each with a scheduler and micro-batch-sized buffers)


def offload_devices(device=None):
    """The devices to offload layers to, in order.

    ``device`` is a device, a name (``"CUDA0"``), a comma-separated list of names or a list of
    either. Without it, every GPU-class device of the first registry that has one (llama.cpp's
    default: all GPUs; with CUDA present that keeps an OpenCL platform on the same cards out)."""
    if device is None:
        by_reg = {}
        for i in range(dev_count()):
            dev = dev_get(i)
            if dev.type in (DeviceType.GPU, DeviceType.IGPU):
                by_reg.setdefault(dev.reg, []).append(dev)
        return next(iter(by_reg.values()), [])
    names = device.split(",") if isinstance(device, str) else device if isinstance(device, (list, tuple)) else [device]
    devs = []
    for d in names:
        if isinstance(d, str):
            dev = dev_by_name(d.strip())
            if dev is None:
                raise ValueError(f"no device named {d.strip()!r}; see `lazyggml info`")
            d = dev
        if d.type != DeviceType.CPU and d not in devs:
            devs.append(d)
    return devs


def split_layers(n_layer, n_gpu_layers, devices, tensor_split=None):
    """llama.cpp's layer split: for each layer ``0 .. n_layer`` (the last entry is the output
    layer) the index into ``devices`` that holds it, or None for the CPU.

    The last ``n_gpu_layers`` repeating layers are offloaded, and with ``n_gpu_layers`` above the
    layer count the output too (it counts as one more layer). They are cut into consecutive runs,
    one per device, in proportion to ``tensor_split`` (one ratio per device), or else to each
    device's free memory, or else equally."""
    if not devices or n_gpu_layers <= 0:
        return [None] * (n_layer + 1)
    if tensor_split is not None:
        weights = [float(x) for x in tensor_split]
        if len(weights) != len(devices) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"tensor_split {list(tensor_split)}: need one non-negative ratio per device "
                             f"({', '.join(d.name for d in devices)}), not all zero")
    else:
        weights = [float(d.memory()[0]) for d in devices]
        if sum(weights) <= 0:
            weights = [1.0] * len(devices)
    total, cum = sum(weights), 0.0
    bounds = []
    for w in weights:
        cum += w
        bounds.append(cum / total)
    first = max(n_layer - n_gpu_layers, 0)
    n_act = min(n_gpu_layers, n_layer + 1)
    out = []
    for il in range(n_layer + 1):
        if il < first or il - first >= n_act:
            out.append(None)
        else:   # upper bound: the first device whose cumulative share exceeds this layer's position
            frac = (il - first) / n_act
            out.append(next((i for i, b in enumerate(bounds) if b > frac), len(devices) - 1))
    return out


def _gib(n):
    """Bytes for a reader: GiB with two decimals, MiB with one below a GiB, KiB below a MiB."""
    return (f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else
            f"{n // 1024} KiB")


def _weight_use(name, type_, ne):
    """The node a graph makes of weight ``name`` (a stand-in with ``type_`` and ``ne``), for asking a
    backend whether it runs that: token embeddings are gathered (``get_rows``), biases are added to
    and other 1-D weights (norms) multiply a hidden state, experts' stacked matrices multiply it
    through the router's choice (``mul_mat_id``), the rest are matrices it is multiplied by."""
    ctx = Context()
    w = ctx.new_tensor(type_, ne)
    w.name = name
    if name == "token_embd.weight":
        return ops.get_rows(w, ctx.new_tensor_1d(Type.I32, 1))
    x = ctx.new_tensor_1d(Type.F32, ne[0])
    if len(ne) == 1:
        return ops.add(x, w) if name.endswith(".bias") else ops.mul(x, w)
    if name.endswith("_exps.weight"):   # experts: multiplied through the router's choice
        return ops.mul_mat_id(w, ops.reshape_3d(x, ne[0], 1, 1), ctx.new_tensor_2d(Type.I32, 1, 1))
    return ops.mul_mat(w, x)


def _place(name, info, backend, cpu):
    """Where weight ``name`` goes: its layer's ``backend``, unless that device cannot run the node the
    graph makes of it and the CPU can (e.g. an OpenCL device and a mixture of experts' MUL_MAT_ID):
    then the CPU's memory, as llama.cpp falls back to a buffer type whose device supports the op; the
    scheduler then runs that node on the CPU."""
    use = _weight_use(name, info.type, info.ne)
    if backend is cpu or backend.supports_op(use) or len(info.ne) == 1 or not cpu.supports_op(use):
        return backend
    log.info("%s: the %s backend cannot run %s; kept on the CPU", name, backend.name, op_desc(use))
    return cpu


class _HostIO:
    """A graph's inputs and output, written and read in place where the scheduler put them in host
    memory: a decode step writes five small inputs and reads one row of logits, and through
    ``tensor_set`` / ``tensor_get`` (checks, conversions, copies) that cost ~70 µs, an eighth of the
    3.7M model's step. A tensor on a device goes through them (``set``/``get`` say which)."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.views = [None if t is None or not t.data_buffer().is_host() else _flat_view(t) for t in tensors]

    def set(self, i, data):
        """Tensor ``i`` = the elements of ``data`` in order, converted to the tensor's element type."""
        v = self.views[i]
        if v is not None:
            v[...] = np.asarray(data).reshape(-1)
        else:
            t = self.tensors[i]
            tensor_set(t, np.asarray(data, host_layout(t)[2]))

    def get(self, i):
        """Tensor ``i`` as a 4-D array: the host view itself (copy what you keep), or a copy."""
        v = self.views[i]
        return v.reshape(host_layout(self.tensors[i])[0]) if v is not None else tensor_get(self.tensors[i])


def _flat_view(t):
    """A 1-D view of a contiguous tensor in host memory (None if it is not contiguous)."""
    v = host_view(t)
    return v.reshape(-1) if v.flags.c_contiguous else None


class Model:
    """A loaded GGUF model with its KV cache (``lg.load_model``); ``arch`` is its architecture's
    ``archs.Arch``, ``hp`` its ``HParams``."""

    def __init__(self, path, n_gpu_layers=0, device=None, n_ctx=None, n_threads=None, progress=False,
                 tensor_split=None, n_batch=None, flash_attn=None, mmap=True, rpc=None, repack=True):
        t0 = time.perf_counter()
        self.path = str(path)
        self.file = read_gguf(path)
        self.hp = hp = HParams.from_metadata(self.file.metadata, self.path)
        self.arch = get_arch(hp.arch)
        infos = check_tensors(hp, self.file.tensors, self.path)
        self.tokenizer = Tokenizer(self.file.metadata, self.path)
        self.n_ctx = min(n_ctx or hp.n_ctx_train, hp.n_ctx_train)
        if self.n_ctx < 1:
            raise ValueError(f"n_ctx must be positive, got {n_ctx}")

        cpu = backend_cpu_init()
        if n_threads:
            set_n_threads(cpu, n_threads)
        endpoints = rpc.split(",") if isinstance(rpc, str) else list(rpc or ())
        remote = [d for ep in endpoints for d in rpc_add_server(ep.strip()).devices]
        devices = []
        if n_gpu_layers > 0:
            devices = offload_devices(device) if device is not None else remote + [
                d for d in offload_devices() if d not in remote]
        if n_gpu_layers > 0 and not devices:
            log.warning("no GPU-class device: all layers run on the CPU")
        placement = split_layers(hp.n_layer, n_gpu_layers, devices, tensor_split)
        used = sorted({i for i in placement if i is not None})
        gpu_backends = {i: devices[i].init_backend() for i in used}
        self.backends = [gpu_backends[i] for i in used] + [cpu]
        #: per layer (and the output, last) the backend that holds its weights and KV cache
        self.layer_backends = [cpu if i is None else gpu_backends[i] for i in placement]

        def backend_of(name):
            """llama.cpp's placement: the input layer on the CPU, repeating layers from the end."""
            if name.startswith("blk."):
                return self.layer_backends[int(name.split(".")[1])]
            if name in ("output.weight", "output_norm.weight"):
                return self.layer_backends[hp.n_layer]
            return cpu

        # weights: used in place from the mapped file where the backend computes on host memory and
        # the file's type is kept (llama.cpp's use_mmap: the page cache holds them once, shared and
        # file-backed); every other weight goes to a WEIGHTS buffer of its backend (one no_alloc
        # context each), filled from the map
        where = {name: _place(name, info, backend_of(name), cpu) for name, info in infos.items()}
        types = {name: self._load_type(name, info, where[name]) for name, info in infos.items()}
        self._check_memory(types, infos, where, backend_of)
        # llama.cpp's buffer type per weight: the first of its device's extra buffer types that runs
        # the node the graph makes of it (the CPU's CPU_REPACK, unless ``repack`` is off:
        # ``use_extra_bufts``), else the device's own
        extras = cpu.device.get_extra_buffer_types() if repack else []
        bufts = {}
        for name, info in infos.items():
            b = where[name]
            use = _weight_use(name, types[name], info.ne) if b is cpu and extras else None
            bufts[name] = next((bt for bt in extras if use is not None and bt.supports_op(use)),
                               b.get_default_buffer_type())
        self.w = {}
        ctxs, maps, copied = {}, {}, []
        file_map = np.memmap(self.path, dtype=np.uint8, mode="c").view(np.ndarray) if mmap else None
        for name, info in infos.items():
            b, bt = where[name], bufts[name]
            if mmap and bt not in maps:   # private (copy-on-write) map: writable arrays, as kernels expect
                maps[bt] = (b.device.buffer_from_host_ptr(file_map) if bt is b.get_default_buffer_type()
                            else b.device.buffer_from_host_ptr(file_map, bt))
            buf = maps.get(bt)
            in_place = buf is not None and types[name] == info.type and info.offset % buf.buft.get_alignment() == 0
            t = ctxs.setdefault(None if in_place else bt, Context()).new_tensor(types[name], info.ne)   # None: mapped
            t.name = name
            self.w[name] = t
            if in_place:
                tensor_alloc(buf, t, info.offset)
                buf.usage = BufferUsage.WEIGHTS
            else:
                copied.append((name, info))
        self.weight_buffers = [buf for buf in maps.values() if buf is not None and buf.usage == BufferUsage.WEIGHTS]
        for bt, ctx in ctxs.items():
            if bt is not None:
                buf = alloc_ctx_tensors_from_buft(ctx, bt)
                buf.usage = BufferUsage.WEIGHTS
                self.weight_buffers.append(buf)
        items = copied
        if progress:
            from tqdm import tqdm
            items = tqdm(items, desc="loading", unit="tensor", leave=False)
        for name, info in items:
            data = self.file.mmap[info.offset:info.offset + info.nbytes]
            if types[name] != info.type:
                data = dequantize(info.type, data, info.ne[0])
            tensor_set(self.w[name], data)

        # RoPE's frequency factors serve every layer: each layer reads a copy on its own device, as
        # llama.cpp duplicates them per layer; read from the CPU, they would split a GPU's graph at
        # every layer
        self.w_on = {}      # (name, backend) -> that backend's copy of a weight every layer reads
        dup_ctxs = {}
        for name in (n for n in ROPE_FACTORS if n in self.w):
            self.w_on[name, where[name]] = self.w[name]
            for b in dict.fromkeys(self.layer_backends[:hp.n_layer]):
                if (name, b) not in self.w_on:
                    t = self.w_on[name, b] = dup_ctxs.setdefault(b, Context()).new_tensor(Type.F32, infos[name].ne)
                    t.name = name
        for b, ctx in dup_ctxs.items():
            buf = alloc_ctx_tensors_from_buft(ctx, b.get_default_buffer_type())
            buf.usage = BufferUsage.WEIGHTS
            self.weight_buffers.append(buf)
        for (name, b), t in self.w_on.items():
            if t is not self.w[name]:
                tensor_set(t, tensor_get(self.w[name]))

        self.flash_attn = self._pick_flash_attn(flash_attn)
        # the KV cache on the layer's device: K has an F16 row of n_embd_k_gqa per cell, V too with
        # flash attention, else an F16 row of n_ctx cells per element (transposed)
        kv_ctxs = {}
        self.k_cache, self.v_cache = [], []
        for il in range(hp.n_layer):
            ctx = kv_ctxs.setdefault(backend_of(f"blk.{il}."), Context())
            k = ctx.new_tensor_2d(Type.F16, hp.n_embd_k_gqa, self.n_ctx)
            v = (ctx.new_tensor_2d(Type.F16, hp.n_embd_v_gqa, self.n_ctx) if self.flash_attn else
                 ctx.new_tensor_2d(Type.F16, self.n_ctx, hp.n_embd_v_gqa))
            k.name, v.name = f"cache_k_l{il}", f"cache_v_l{il}"
            self.k_cache.append(k)
            self.v_cache.append(v)
        self.kv_buffers = [alloc_ctx_tensors_from_buft(ctx, b.get_default_buffer_type())
                           for b, ctx in kv_ctxs.items()]
        for buf in self.kv_buffers:
            buf.clear(0)

        # pipeline parallelism (llama.cpp's rule): several devices hold every layer and the output,
        # so micro-batches of a prompt can flow through them one behind the other
        parallel = len(used) > 1 and n_gpu_layers > hp.n_layer and all(
            b.device.event_new() is not None for b in self.backends[:-1])
        # graph capacity: llama.cpp's graph_max_nodes, 8 nodes per weight tensor (at least 1024)
        self.sched = Scheduler(self.backends, graph_size=max(1024, 8 * len(infos)), parallel=parallel)
        self.n_past = 0
        # Graphs are kept per shape class (tokens, KV window, logits wanted), each with a scheduler
        # and compute buffers of its own, least recently used first: prompt micro-batches in
        # ``_prompt`` (PROMPT_GRAPHS of them: a prompt's micro-batches come back in the same shapes
        # when a conversation starts over), single-token steps in ``_decode`` (DECODE_GRAPHS: a
        # decode graph survives a prompt and a reset in between). Rebuilding one (build, split,
        # allocate, plan, and on a GPU the first eager run and the CUDA graph capture) costs ~5 ms
        # for the 3.7M model on the CPU and 50-150 ms for 1B-8B models on a GPU.
        self._prompt, self._decode = OrderedDict(), OrderedDict()   # key -> (scheduler, graph, inputs, logits)
        self._free = {False: [self.sched], True: [Scheduler(self.backends, graph_size=self.sched.graph_size)]}
        self._parallel = parallel
        # size the compute buffers once for the largest micro-batch over the whole context, as
        # llama.cpp does, so that later graphs fit without reallocating (which would synchronize)
        on_gpu = self.layer_backends[-1] is not cpu
        self.n_batch = min(n_batch or (N_BATCH_GPU if on_gpu else N_BATCH), self.n_ctx)
        if self.n_batch < 1:
            raise ValueError(f"n_batch must be positive, got {n_batch}")
        for sched, n_tokens in ((self.sched, self.n_batch), (self._free[True][0], 1)):
            self._reserve(sched, n_tokens)
        self.load_time = time.perf_counter() - t0

    # -- the graph ----------------------------------------------------------------------------------
    def _pick_flash_attn(self, want):
        """Flash attention on (``True``), off (``False``) or, for ``None``, on exactly when every
        layer's backend runs this model's FLASH_ATTN_EXT node (llama.cpp's ``-fa auto``)."""
        hp = self.hp
        ctx = Context()
        q = ctx.new_tensor_3d(Type.F32, hp.n_embd_head_k, 1, hp.n_head)
        k = ctx.new_tensor_3d(Type.F16, hp.n_embd_head_k, KV_PAD, hp.n_head_kv)
        v = ctx.new_tensor_3d(Type.F16, hp.n_embd_head_k, KV_PAD, hp.n_head_kv)
        node = ops.flash_attn_ext(q, k, v, ctx.new_tensor_2d(Type.F16, KV_PAD, 1), 1.0)
        layers = self.layer_backends[:-1]
        runs = all(b.supports_op(node) for b in layers)
        if want is None:
            return runs
        if want and not runs:
            bad = next(b for b in layers if not b.supports_op(node))
            raise ValueError(f"flash attention: the {bad.name} backend cannot run {op_desc(node)} for this "
                             f"model's heads ({hp.n_embd_head_k} x {hp.n_head}/{hp.n_head_kv})")
        return bool(want)

    def _load_type(self, name, info, backend):
        """The type weight ``name`` is loaded as: its file type when ``backend`` runs the node the
        graph makes of it (``_weight_use``); else, for a 1-D F16/BF16 weight (a norm), F32, which
        holds it exactly; else the file is refused now rather than at the first eval."""
        if backend.supports_op(_weight_use(name, info.type, info.ne)):
            return info.type
        if len(info.ne) == 1 and info.type in (Type.F16, Type.BF16) and \
                backend.supports_op(_weight_use(name, Type.F32, info.ne)):
            log.info("%s: %s weights widened to f32", name, type_name(info.type))
            return Type.F32
        use = _weight_use(name, info.type, info.ne)
        raise GGUFError(self.path, f"tensor '{name}'", f"{type_name(info.type)} weights: the {backend.name} "
                                                       f"backend cannot run {op_desc(use)} on them")

    def _check_memory(self, types, infos, where, backend_of):
        """Refuse, before anything is allocated, a placement whose weights and KV cache do not fit a
        device's free memory (a device that cannot say how much it has free reports 0 and is not
        checked). The compute buffers come on top, sized later by the scheduler."""
        need = {}
        for name, info in infos.items():
            need.setdefault(where[name], [0, 0])[0] += row_size(types[name], info.ne[0]) * math.prod(info.ne[1:])
        kv_bytes = 2 * self.n_ctx * (self.hp.n_embd_k_gqa + self.hp.n_embd_v_gqa)   # F16 K and V, per layer
        for il in range(self.hp.n_layer):
            need.setdefault(backend_of(f"blk.{il}."), [0, 0])[1] += kv_bytes
        for backend, (weights, kv) in need.items():
            free = backend.device.memory()[0]
            if free and weights + kv > free:
                raise OutOfMemoryError(
                    f"{self.path}: {backend.name} has {_gib(free)} free, but its share of the model needs "
                    f"{_gib(weights + kv)} ({_gib(weights)} of weights, {_gib(kv)} of KV cache for a context "
                    f"of {self.n_ctx}); put fewer layers there (-ngl) or use a smaller context (-c)")

    def _build(self, sched, n_tokens, n_kv, logits_all):
        """The graph of a batch, with the builder's pinned tensors assigned in ``sched``."""
        b = GraphBuilder(self, n_tokens, n_kv, logits_all).build()
        for t, backend in b.pins:
            sched.set_tensor_backend(t, backend)
        return b.graph, b.inputs, b.logits

    def _reserve(self, sched, n_tokens):
        if not sched.reserve(self._build(sched, n_tokens, self.n_ctx, False)[0]):
            raise RuntimeError("the scheduler could not reserve the compute buffers")

    def _alloc(self, sched, key):
        sched.reset()
        g, inputs, logits = self._build(sched, *key)
        if not sched.alloc_graph(g):
            raise RuntimeError("the scheduler could not allocate the graph")
        return sched, g, inputs, logits, _HostIO(inputs + (logits,))

    def _graph_for(self, n_tokens, n_kv, logits_all):
        """The scheduler and graph for this shape class, kept in ``_prompt`` or ``_decode``: built
        the first time, then the least recently used one of the kind gives up its scheduler."""
        key = (n_tokens, n_kv, logits_all)
        decode = n_tokens == 1
        cache, limit = (self._decode, DECODE_GRAPHS) if decode else (self._prompt, PROMPT_GRAPHS)
        hit = cache.get(key)
        if hit is None:
            if self._free[decode]:
                sched = self._free[decode].pop()
            elif len(cache) < limit:
                sched = Scheduler(self.backends, graph_size=self.sched.graph_size,
                                  parallel=self._parallel and not decode)
                self._reserve(sched, 1 if decode else self.n_batch)
            else:
                sched = cache.popitem(last=False)[1][0]
            hit = cache[key] = self._alloc(sched, key)
        cache.move_to_end(key)
        return hit

    # -- running -------------------------------------------------------------------------------------
    def eval(self, tokens, logits_all=True):
        """Run ``tokens`` (a list of ids) after the tokens already in the KV cache; return float32
        logits of shape (n_tokens, n_vocab), or (1, n_vocab) for the last token when not ``logits_all``."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("eval: no tokens")
        bad = [t for t in tokens if not 0 <= t < self.hp.n_vocab]
        if bad:
            raise ValueError(f"eval: token ids {bad[:5]} are outside the vocabulary of {self.hp.n_vocab}")
        if self.n_past + len(tokens) > self.n_ctx:
            raise ValueError(f"eval: {self.n_past} + {len(tokens)} tokens exceed the context of {self.n_ctx}")
        out = []
        nb = self.n_batch
        for i0 in range(0, len(tokens), nb):
            batch = tokens[i0:i0 + nb]
            if logits_all or i0 + nb >= len(tokens):
                out.append(self._eval_batch(batch, logits_all))
            else:   # logits nobody reads: queue the batch and go on (devices overlap micro-batches)
                self._eval_batch(batch, False, wait=False)
        return np.concatenate(out) if logits_all else out[-1]

    def _eval_batch(self, batch, logits_all, wait=True):
        n = len(batch)
        pad = KV_PAD if n == 1 else KV_PAD_BATCH
        n_kv = min(self.n_ctx, -(-(self.n_past + n) // pad) * pad)
        sched, g, inputs, logits, io = self._graph_for(n, n_kv, logits_all)
        tokens, pos, kv_idxs, v_idxs, kq_mask, kq_mask_swa = inputs
        p0 = self.n_past
        positions = np.arange(p0, p0 + n)
        io.set(0, batch)
        io.set(1, positions)
        io.set(2, positions)
        if v_idxs is not None:
            io.set(3, positions[:, None] + self.n_ctx * np.arange(self.hp.n_embd_v_gqa))
        # causal mask: token i sees cells 0..n_past+i (none when every layer slides)
        if kq_mask is None:
            pass
        elif n == 1 and io.views[4] is not None:
            row = io.views[4]
            row[:p0 + 1] = 0.0
            row[p0 + 1:] = -np.inf
        else:
            io.set(4, np.where(np.arange(n_kv)[None, :] <= positions[:, None], 0.0, -np.inf))
        # sliding-window layers: token i sees cells p with p <= n_past+i < p + n_swa (llama.cpp's
        # is_masked_swa, LLAMA_SWA_TYPE_STANDARD)
        if kq_mask_swa is None:
            pass
        elif n == 1 and io.views[5] is not None:
            row = io.views[5]
            row[:] = -np.inf
            row[max(p0 + 1 - self.hp.n_swa, 0):p0 + 1] = 0.0
        else:
            dist = positions[:, None] - np.arange(n_kv)[None, :]
            io.set(5, np.where((dist >= 0) & (dist < self.hp.n_swa), 0.0, -np.inf))
        self.n_past += n
        if not wait:
            sched.graph_compute_async(g)
            return None
        sched.graph_compute(g)
        return io.get(6)[0, 0].copy()

    def reset(self):
        """Forget the KV cache."""
        self.n_past = 0
        for buf in self.kv_buffers:
            buf.clear(0)

    def tokenize(self, text, add_bos=True):
        return self.tokenizer.tokenize(text, add_special=add_bos)

    def detokenize(self, ids):
        return self.tokenizer.detokenize(ids)

    def generate(self, prompt, n_predict=32, *, temp=0.8, top_k=40, top_p=0.95, seed=None, stats=None):
        """Yield text pieces of up to ``n_predict`` sampled tokens after ``prompt`` (text, or token ids
        as they are), which is evaluated after the tokens already in the KV cache (``n_past``): a chat
        passes only its new tokens. ``stats`` (a dict) receives prefill/decode timings, token counts,
        the sampled ``tokens`` (an EOG token left out) and why generation stopped (``stop``:
        ``"n_predict"``, ``"eog"`` for an end-of-generation token, or ``"context"`` when the
        context is full)."""
        sampler = Sampler(temp=temp, top_k=top_k, top_p=top_p, seed=seed)
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        sampled = []
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        t0 = time.perf_counter()
        logits = self.eval(ids, logits_all=False)[-1]
        t1 = time.perf_counter()
        n_decoded, stop = 0, "n_predict"
        for _ in range(n_predict):
            tok = sampler.sample(logits)
            if self.tokenizer.is_eog(tok):
                stop = "eog"
                break
            sampled.append(tok)
            piece = decoder.decode(self.tokenizer.token_to_piece(tok))
            if stats is not None and n_decoded == 0:
                stats["first_token_time"] = time.perf_counter()
            if piece:
                yield piece
            n_decoded += 1
            if n_decoded == n_predict:
                break
            if self.n_past >= self.n_ctx:
                stop = "context"
                break
            logits = self.eval([tok], logits_all=False)[-1]
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail
        if stats is not None:
            t2 = time.perf_counter()
            stats.update(n_prompt=len(ids), prefill_s=t1 - t0, n_decoded=n_decoded,
                         decode_s=t2 - t1, n_splits=self.sched.n_splits, stop=stop, tokens=sampled)


def load_model(path, n_gpu_layers=0, device=None, n_ctx=None, n_threads=None, progress=False,
               tensor_split=None, n_batch=None, flash_attn=None, mmap=True, rpc=None, repack=True):
    """Load a GGUF model of an architecture in ``archs.ARCHITECTURES`` (``lg.GGUFError`` if the
    file is malformed or unsupported).

    ``n_gpu_layers``: offload the last N layers (above the layer count, the output too) to
    ``device`` (a name, comma-separated names, or devices; default every GPU of the first GPU
    registry), split by ``tensor_split`` ratios or else by free memory (``split_layers``).
    ``n_batch``: tokens per prefill micro-batch (default ``N_BATCH``, or ``N_BATCH_GPU`` when every
    layer is on a GPU). ``flash_attn``: fused attention (``FLASH_ATTN_EXT``) on, off, or by default
    on when every layer's backend runs it (llama.cpp's ``-fa auto``). ``mmap``: CPU weights are used in
    place from the mapped file (llama.cpp's ``use_mmap``: held once, by the page cache); ``False``
    copies them into memory of their own (``--no-mmap``). ``rpc``: GGML RPC servers (``"host:port"``,
    a list or comma-separated): their devices come first among the devices layers are offloaded
    to, as llama.cpp's ``--rpc`` puts them (``lg.rpc_add_server``). ``repack``: the CPU's weights
    that llama.cpp would repack go to the CPU's CPU_REPACK buffer type, whose products add in the
    order of GGML's repacked kernels (``backends/cpu/repack.py``), llama.cpp's default; ``False``
    keeps them in plain CPU buffers, as ``--no-repack`` (``use_extra_bufts = false``)."""
    return Model(path, n_gpu_layers=n_gpu_layers, device=device, n_ctx=n_ctx, n_threads=n_threads,
                      progress=progress, tensor_split=tensor_split, n_batch=n_batch, flash_attn=flash_attn,
                      mmap=mmap, rpc=rpc, repack=repack)
