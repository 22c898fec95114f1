"""The generic runner: a GGUF model of any architecture in ``archs.py``, loaded, with its KV cache,
its graphs per batch shape, ``eval`` and ``generate`` (llama.cpp's ``llama_model`` + ``llama_context``).

What a model is made of lives in rooms of its own, and ``Model`` puts them together:

* ``loader.py`` places and loads the weights (``Weights``), on the devices of the layer split
  (``split_layers``: the last ``n_gpu_layers`` layers, and with more the output too, over several
  GPUs in consecutive runs); the scheduler follows them, with one split per device and the hidden
  state copied across;
* ``kv_cache.py`` is the KV cache (``KVCache``: cells with positions and sequences, its layout and
  its graph inputs); ``eval`` extends sequence 0, ``decode`` runs a ``Batch`` (``batch.py``) of
  tokens from up to ``N_SEQ_MAX`` sequences, each seeing only its own sequence's cells;
* ``builder.py`` builds a micro-batch's graph (the architecture's graph function from ``archs.py``)
  with its inputs (``inputs.py``), and ``graphs.py`` keeps the graphs per batch shape: one is built,
  split and allocated once and replayed while the KV window (padded to ``KV_PAD`` cells,
  ``KV_PAD_BATCH`` for prefill) is unchanged, as llama.cpp's graph reuse does.

With **flash attention** (``flash_attn``; by default on when every layer's backend runs
``FLASH_ATTN_EXT``, as llama.cpp's ``-fa auto``) attention is one ``flash_attn_ext`` node that reads
the window's cells once and never writes the scores; V is stored like K, a row per cell. The CPU's
kernel has the arithmetic of GGML's (F16 sums while decoding, float32 tiles for batches of 64 and
more), so a model gives llama.cpp's numbers when both run with flash attention; ``flash_attn=False``
gives llama.cpp's without it (llama-cpp-python's default), with V stored transposed.

When several devices hold everything, the scheduler runs pipeline-parallel (4 copy slots) and a
prompt's micro-batches are queued without waiting, so one device works on batch k+1 while the next
still works on batch k.
"""
from __future__ import annotations

import codecs
import logging
import time

import numpy as np

from .. import ops
from ..backend import DeviceType
from ..backends.cpu import backend_cpu_init, set_n_threads
from ..gguf_io import read_gguf
from ..ops import op_desc
from ..registry import dev_by_name, dev_count, dev_get, rpc_add_server
from ..sampling import Sampler
from ..sched import Scheduler
from ..tensor import Context
from ..tokenizer import Tokenizer
from ..types import Type
from .archs import get_arch
from .builder import GraphBuilder
from .graphs import GraphCache
from .hparams import HParams, check_tensors
from .batch import split
from .inputs import UBatch
from .kv_cache import N_SEQ_MAX, KVCache
from .loader import load_weights

__all__ = ["Model", "load_model", "offload_devices", "split_layers", "N_BATCH", "N_BATCH_GPU", "KV_PAD",
           "KV_PAD_BATCH"]

log = logging.getLogger("lazyggml")

# The attention window grows in steps of this many cells, so that graphs repeat. A new window
# means a new graph (built, allocated and planned: ~5 ms for the 3.7M model, ~15 ms for a 125M
# one), against attention over masked cells: decode steps take llama.cpp's 256 (get_n_kv), one
# graph for 256 tokens; prefill micro-batches, which build a graph each anyway and whose
# attention grows with the window times the batch, take 32. A micro-batch of one token for each of
# B sequences is a decode step too (serving), whose shape comes back step after step; the shared
# cache grows by B cells a step, so its window grows by 256 * B cells, one graph for 256 steps (with
# 32, B = 4 built a new graph every 8 steps; with 256, B = 32 on a GPU rebuilt every 8 steps, at
# ~0.1 s each, half of the run).
KV_PAD = 256
KV_PAD_BATCH = 32
# Prefill micro-batch (tokens per graph) on the CPU. Measured on 2 threads (AVX2 machine, tok/s
# alternating in one process): a 512-token prompt on the 125M model 356 / 474 / 461 / 454 at
# 64 / 128 / 256 / 512, the 3.7M model's 128-token prompt 6,152 / 6,759 at 64 / 128: from 128 on,
# each weight row is read once per 128 activation rows, and larger batches only grow the buffers.
N_BATCH = 128
N_BATCH_GPU = 512  # ... and when the output layer, hence every layer, is on a GPU (llama.cpp's n_ubatch)


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


class Model:
    """A loaded GGUF model (``lg.load_model``; llama.cpp's ``llama_model`` and one ``llama_context``):
    ``arch`` is its architecture's ``archs.Arch``, ``hp`` its ``HParams``, ``weights`` where its
    tensors live (``loader.Weights``), ``kv`` its ``KVCache`` (sequence 0 is the one ``eval`` extends;
    ``decode`` runs batches of several, which ``kv.seq_rm`` / ``seq_cp`` / ``seq_keep`` / ``seq_add``
    edit), ``graphs`` its graphs per batch shape."""

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
        devices = self._offload_devices(n_gpu_layers, device, rpc)
        placement = split_layers(hp.n_layer, n_gpu_layers, devices, tensor_split)
        used = sorted({i for i in placement if i is not None})
        gpu_backends = {i: devices[i].init_backend() for i in used}
        self.backends = [gpu_backends[i] for i in used] + [cpu]
        #: per layer (and the output, last) the backend that holds its weights and KV cache
        self.layer_backends = [cpu if i is None else gpu_backends[i] for i in placement]
        self.weights = load_weights(self.file, self.path, hp, self.arch, infos, self.layer_backends, self.backends,
                                    kv_layer_bytes=KVCache.layer_bytes(hp, self.n_ctx), n_ctx=self.n_ctx,
                                    mmap=mmap, repack=repack, progress=progress)
        self.flash_attn = self._pick_flash_attn(flash_attn)
        self.kv = KVCache(hp, self.n_ctx, self.layer_backends, v_trans=not self.flash_attn, n_seq_max=N_SEQ_MAX)
        self._ub1 = UBatch(np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32))
        on_gpu = self.layer_backends[-1] is not cpu
        self.n_batch = min(n_batch or (N_BATCH_GPU if on_gpu else N_BATCH), self.n_ctx)
        if self.n_batch < 1:
            raise ValueError(f"n_batch must be positive, got {n_batch}")
        # pipeline parallelism (llama.cpp's rule): several devices hold every layer and the output,
        # so micro-batches of a prompt can flow through them one behind the other
        parallel = len(used) > 1 and n_gpu_layers > hp.n_layer and all(
            b.device.event_new() is not None for b in self.backends[:-1])
        # graph capacity: llama.cpp's graph_max_nodes, 8 nodes per weight tensor (at least 1024)
        self.graph_size = max(1024, 8 * len(infos))
        self.graphs = GraphCache(self.backends, self.graph_size, parallel, self.n_batch, self.n_ctx, self._build)
        self.load_time = time.perf_counter() - t0

    @staticmethod
    def _offload_devices(n_gpu_layers, device, rpc):
        """The devices layers may go to: ``device`` (see ``offload_devices``), or the RPC servers'
        devices first, then every GPU (llama.cpp's ``--rpc``)."""
        endpoints = rpc.split(",") if isinstance(rpc, str) else list(rpc or ())
        remote = [d for ep in endpoints for d in rpc_add_server(ep.strip()).devices]
        if n_gpu_layers <= 0:
            return []
        devices = offload_devices(device) if device is not None else remote + [
            d for d in offload_devices() if d not in remote]
        if not devices:
            log.warning("no GPU-class device: all layers run on the CPU")
        return devices

    @property
    def w(self):
        """The weights by name."""
        return self.weights.tensors

    @property
    def sched(self):
        """The first scheduler (the prompt's, reserved for a whole micro-batch): its statistics."""
        return self.graphs.sched

    @property
    def n_past(self):
        """Tokens of sequence 0 in the KV cache (the next one's position)."""
        return int(self.kv.pos_max[0]) + 1

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

    def build_graph(self, n_tokens, n_kv, n_outputs=None):
        """The graph of a micro-batch of ``n_tokens`` tokens over ``n_kv`` cells with ``n_outputs`` rows
        of logits (default: every token's): a built ``GraphBuilder`` (its ``graph``, ``inputs`` and
        ``logits``)."""
        return GraphBuilder(self.weights, self.kv, self.flash_attn, self.graph_size, n_tokens, n_kv,
                            n_tokens if n_outputs is None else n_outputs).build()

    def _build(self, sched, n_tokens, n_kv, n_outputs):
        """The graph of a micro-batch shape, with the builder's pinned tensors assigned in ``sched``."""
        b = self.build_graph(n_tokens, n_kv, n_outputs)
        for t, backend in b.pins:
            sched.set_tensor_backend(t, backend)
        return b

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
            n, p0 = len(batch), self.n_past
            if n == 1:    # a decode step: its micro-batch refilled in place
                ub = self._ub1
                ub.tokens[0], ub.pos[0] = batch[0], p0
            else:
                ub = UBatch(np.asarray(batch, np.int32), np.arange(p0, p0 + n, dtype=np.int32), np.zeros(n, np.int32),
                            None if logits_all else np.array([n - 1], np.int32))
            if logits_all or i0 + nb >= len(tokens):
                out.append(self._run(ub))
            else:   # logits nobody reads: queue the batch and go on (devices overlap micro-batches)
                self._run(ub, wait=False)
        return np.concatenate(out) if logits_all else out[-1]

    def decode(self, batch):
        """Run a ``Batch`` of tokens from one or several sequences (llama.cpp's ``llama_decode``), in
        micro-batches of up to ``n_batch`` tokens; return the float32 logits of the tokens whose
        ``logits`` flag is set, one row each in batch order (``batch.output_rows()``), shape
        (n_outputs, n_vocab). Each sequence's positions must continue its cells' (``kv.seq_pos_max``)
        without gaps; ValueError names the first token that does not, or that does not fit."""
        out = []
        for ub in split(batch, self.n_batch, self.kv, self.hp.n_vocab):
            if ub.n_outputs:
                out.append(self._run(ub))
            else:   # no logits wanted: the last token's computed, not read, and the batch queued
                ub.out_ids = np.array([ub.n_tokens - 1], np.int32)
                self._run(ub, wait=False)
        return np.concatenate(out) if out else np.empty((0, self.hp.n_vocab), np.float32)

    def _run(self, ub, wait=True):
        """One micro-batch: its cells, its graph (of its shape class), its inputs, the run; the logits
        (n_outputs, n_vocab), or None when not ``wait``ing (the graph queued)."""
        if self.kv.has_shift:
            self._shift()
        n = ub.n_tokens
        decode_step = n == 1 or (n <= N_SEQ_MAX and len(np.unique(ub.seq_id)) == n)   # a token per sequence
        self.kv.prepare(ub, KV_PAD * n if decode_step else KV_PAD_BATCH)
        step = self.graphs.get(n, ub.n_kv, ub.n_outputs)
        for inp in step.inputs:
            inp.set_input(ub)
        if not wait:
            step.sched.graph_compute_async(step.graph)
            return None
        step.sched.graph_compute(step.graph)
        return step.logits.read()[0, 0].copy()

    def _shift(self):
        """Rotate the cached keys that ``kv.seq_add`` moved (llama.cpp's K shift, before the next
        batch): a graph of its own, run once on a scheduler of its own."""
        b = GraphBuilder(self.weights, self.kv, self.flash_attn, self.graph_size, 0, 0, 0).build_shift()
        sched = Scheduler(self.backends, graph_size=self.graph_size)
        if not sched.alloc_graph(b.graph):
            raise RuntimeError("the scheduler could not allocate the K shift's graph")
        for inp in b.inputs:
            inp.bind().set_input(None)
        sched.graph_compute(b.graph)
        self.kv.shift_done()

    def reset(self):
        """Forget the KV cache."""
        self.kv.clear()

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
