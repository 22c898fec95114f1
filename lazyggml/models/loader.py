"""Placing a model's weights (llama.cpp's ``llama_model_loader`` and ``load_tensors``).

Each weight goes to the backend of its layer (``layer_backends``: the input layer on the CPU,
repeating layers and the output where the layer split put them) unless that backend cannot run the
op the graph makes of it (``archs.TENSOR_OPS``) and the CPU can: then it stays in host memory, as
llama.cpp falls back to a buffer type whose device supports the op, and the scheduler runs that node
on the CPU (an OpenCL device and a mixture of experts' ``MUL_MAT_ID``). Within a backend it goes to
the first of the device's extra buffer types that runs that op (the CPU's CPU_REPACK, unless
``repack`` is off: llama.cpp's ``use_extra_bufts``), else the device's own.

Weights are used in place from the mapped file where the backend computes on host memory and the
file's type is kept (llama.cpp's ``use_mmap``: the page cache holds them once, shared and
file-backed); every other weight goes to a ``WEIGHTS`` buffer of its buffer type, filled from the
map. RoPE's frequency factors serve every layer: each layer's device gets a copy, as llama.cpp
duplicates them per layer; read from the CPU, they would split a GPU's graph at every layer.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from .. import ops
from ..alloc import alloc_ctx_tensors_from_buft
from ..backend import tensor_get, tensor_set
from ..buffer import BufferUsage, tensor_alloc
from ..errors import GGUFError, LazyGGMLError, OutOfMemoryError
from ..ops import op_desc
from ..quants import dequantize
from ..tensor import Context
from ..types import Op, Type, row_size, type_name
from .archs import tensor_op

__all__ = ["Weights", "load_weights", "weight_node", "ROPE_FACTORS"]

log = logging.getLogger("lazyggml")

#: RoPE's per-dimension frequency factors, one tensor for every layer: Llama 3.1's, Phi-3's long and
#: short ones (each layer's device gets a copy: ``Weights.on``)
ROPE_FACTORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class Weights:
    """A loaded model's weights: ``tensors`` (name -> tensor), ``on`` ((name, backend) -> that
    backend's copy of a weight every layer reads), the ``buffers`` holding them, and where layers
    run: ``layer_backends`` (per layer, and the output last) and ``backends`` (the GPU-class ones in
    order, the CPU last). ``hp`` and ``arch`` are the model's hyper-parameters and architecture."""

    def __init__(self, hp, arch, layer_backends, backends):
        self.hp, self.arch = hp, arch
        self.layer_backends, self.backends = layer_backends, backends
        self.tensors, self.on, self.buffers = {}, {}, []

    @property
    def cpu(self):
        return self.backends[-1]


def weight_node(name, type_, ne):
    """The node the graph makes of weight ``name`` (a stand-in of ``type_`` and ``ne``), by its
    op in ``archs.TENSOR_OPS``: what a backend is asked whether it runs."""
    ctx = Context()
    w = ctx.new_tensor(type_, ne)
    w.name = name
    op = tensor_op(name)
    x = ctx.new_tensor_1d(Type.F32, ne[0])
    if op == Op.GET_ROWS:
        return ops.get_rows(w, ctx.new_tensor_1d(Type.I32, 1))
    if op == Op.ADD:
        return ops.add(x, w)
    if op == Op.MUL:
        return ops.mul(x, w)
    if op == Op.ROPE:     # frequency factors: half a head's rotated dimensions
        return ops.rope_ext(ctx.new_tensor_3d(Type.F32, 2 * ne[0], 1, 1), ctx.new_tensor_1d(Type.I32, 1), w,
                            2 * ne[0], 0)
    if op == Op.MUL_MAT_ID:
        return ops.mul_mat_id(w, ops.reshape_3d(x, ne[0], 1, 1), ctx.new_tensor_2d(Type.I32, 1, 1))
    return ops.mul_mat(w, x)


def _place(name, info, backend, cpu):
    """Where weight ``name`` goes: its layer's ``backend``, unless that device cannot run the node the
    graph makes of it and the CPU can."""
    if (backend is cpu or len(info.ne) == 1 or _runs(backend, name, info.type, info.ne)
            or not _runs(cpu, name, info.type, info.ne)):
        return backend
    log.info("%s: the %s backend cannot run %s; kept on the CPU", name, backend.name,
             op_desc(weight_node(name, info.type, info.ne)))
    return cpu


def _load_type(path, name, info, backend):
    """The type weight ``name`` is loaded as: its file type when ``backend`` runs the node the graph
    makes of it; else, for a 1-D F16/BF16 weight (a norm), F32, which holds it exactly; else the file
    is refused now rather than at the first eval."""
    if _runs(backend, name, info.type, info.ne):
        return info.type
    if len(info.ne) == 1 and info.type in (Type.F16, Type.BF16) and _runs(backend, name, Type.F32, info.ne):
        log.info("%s: %s weights widened to f32", name, type_name(info.type))
        return Type.F32
    try:
        what = op_desc(weight_node(name, info.type, info.ne))
    except LazyGGMLError as e:    # the op takes no such operand at all
        what = str(e)
    raise GGUFError(path, f"tensor '{name}'", f"{type_name(info.type)} weights: the {backend.name} "
                                              f"backend cannot run {what} on them")


def _runs(backend, name, type_, ne):
    """Whether ``backend`` runs the node the graph makes of weight ``name`` as a ``type_`` tensor (an
    op whose constructor refuses that type, as RoPE's F32-only frequency factors, does not run)."""
    try:
        return backend.supports_op(weight_node(name, type_, ne))
    except LazyGGMLError:
        return False


def _gib(n):
    """Bytes for a reader: GiB with two decimals, MiB with one below a GiB, KiB below a MiB."""
    return (f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else
            f"{n // 1024} KiB")


def _check_memory(path, types, infos, where, layer_backends, kv_layer_bytes, n_ctx):
    """Refuse, before anything is allocated, a placement whose weights and KV cache do not fit a
    device's free memory (a device that cannot say how much it has free reports 0 and is not
    checked). The compute buffers come on top, sized later by the scheduler."""
    need = {}
    for name, info in infos.items():
        need.setdefault(where[name], [0, 0])[0] += row_size(types[name], info.ne[0]) * math.prod(info.ne[1:])
    for backend in layer_backends[:-1]:
        need.setdefault(backend, [0, 0])[1] += kv_layer_bytes
    for backend, (weights, kv) in need.items():
        free = backend.device.memory()[0]
        if free and weights + kv > free:
            raise OutOfMemoryError(
                f"{path}: {backend.name} has {_gib(free)} free, but its share of the model needs "
                f"{_gib(weights + kv)} ({_gib(weights)} of weights, {_gib(kv)} of KV cache for a context "
                f"of {n_ctx}); put fewer layers there (-ngl) or use a smaller context (-c)")


def load_weights(file, path, hp, arch, infos, layer_backends, backends, *, kv_layer_bytes, n_ctx, mmap=True,
                 repack=True, progress=False):
    """Place and load the weights ``infos`` (name -> ``TensorInfo`` of the GGUF ``file`` at ``path``)
    of a model whose layers run on ``layer_backends`` (``backends``: those used, the CPU last);
    ``kv_layer_bytes`` and ``n_ctx`` size the KV cache for the memory check. Returns ``Weights``."""
    wts = Weights(hp, arch, layer_backends, backends)
    cpu = wts.cpu

    def backend_of(name):
        """llama.cpp's placement: the input layer on the CPU, repeating layers from the end."""
        if name.startswith("blk."):
            return layer_backends[int(name.split(".")[1])]
        if name in ("output.weight", "output_norm.weight"):
            return layer_backends[hp.n_layer]
        return cpu

    where = {name: _place(name, info, backend_of(name), cpu) for name, info in infos.items()}
    types = {name: _load_type(path, name, info, where[name]) for name, info in infos.items()}
    _check_memory(path, types, infos, where, layer_backends, kv_layer_bytes, n_ctx)
    extras = cpu.device.get_extra_buffer_types() if repack else []
    bufts = {}
    for name, info in infos.items():
        b = where[name]
        use = weight_node(name, types[name], info.ne) if b is cpu and extras else None
        bufts[name] = next((bt for bt in extras if use is not None and bt.supports_op(use)),
                           b.get_default_buffer_type())
    ctxs, maps, copied = {}, {}, []
    file_map = np.memmap(path, dtype=np.uint8, mode="c").view(np.ndarray) if mmap else None
    for name, info in infos.items():
        b, bt = where[name], bufts[name]
        if mmap and bt not in maps:   # private (copy-on-write) map: writable arrays, as kernels expect
            maps[bt] = (b.device.buffer_from_host_ptr(file_map) if bt is b.get_default_buffer_type()
                        else b.device.buffer_from_host_ptr(file_map, bt))
        buf = maps.get(bt)
        in_place = buf is not None and types[name] == info.type and info.offset % buf.buft.get_alignment() == 0
        t = ctxs.setdefault(None if in_place else bt, Context()).new_tensor(types[name], info.ne)   # None: mapped
        t.name = name
        wts.tensors[name] = t
        if in_place:
            tensor_alloc(buf, t, info.offset)
            buf.usage = BufferUsage.WEIGHTS
        else:
            copied.append((name, info))
    wts.buffers = [buf for buf in maps.values() if buf is not None and buf.usage == BufferUsage.WEIGHTS]
    for bt, ctx in ctxs.items():
        if bt is not None:
            _weights_buffer(wts, ctx, bt)
    items = copied
    if progress:
        from tqdm import tqdm
        items = tqdm(items, desc="loading", unit="tensor", leave=False)
    for name, info in items:
        data = file.mmap[info.offset:info.offset + info.nbytes]
        if types[name] != info.type:
            data = dequantize(info.type, data, info.ne[0])
        tensor_set(wts.tensors[name], data)
    _copy_per_layer(wts, where, infos)
    return wts


def _weights_buffer(wts, ctx, buft):
    buf = alloc_ctx_tensors_from_buft(ctx, buft)
    buf.usage = BufferUsage.WEIGHTS
    wts.buffers.append(buf)


def _copy_per_layer(wts, where, infos):
    """RoPE's frequency factors: a copy on every layer's device (``Weights.on``)."""
    ctxs = {}
    for name in (n for n in ROPE_FACTORS if n in wts.tensors):
        wts.on[name, where[name]] = wts.tensors[name]
        for b in dict.fromkeys(wts.layer_backends[:wts.hp.n_layer]):
            if (name, b) not in wts.on:
                t = wts.on[name, b] = ctxs.setdefault(b, Context()).new_tensor(Type.F32, infos[name].ne)
                t.name = name
    for b, ctx in ctxs.items():
        _weights_buffer(wts, ctx, b.get_default_buffer_type())
    for (name, b), t in wts.on.items():
        if t is not wts.tensors[name]:
            tensor_set(t, tensor_get(wts.tensors[name]))
