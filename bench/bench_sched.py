"""Scheduling cost of a 32-layer LLaMA-shaped graph split over two devices.

Half the layers' weights live on a mock "GPU" (its own non-host buffer type), the rest and the
output head on the CPU. Nothing is computed: this times the scheduler alone.

* ``split_graph``: the five passes (assignment, expansion, upgrade, sources, splits and copies);
* ``reserve``: split plus the allocator's full plan and the buffer allocation, on a fresh scheduler;
* the replay: ``split_graph`` mutates the graph it is given (sources are rewritten to copies), so
  llama.cpp rebuilds the graph for every token and calls ``reset`` + ``alloc_graph``; timed as
  build + reset + alloc_graph, and alloc_graph alone.

    python bench/bench_sched.py [--layers 32] [--tokens 32] [--repeat 20] [--write]

``--write`` stores the results in bench/results/sched.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lazyggml as lg  # noqa: E402
from lazyggml.alloc import alloc_ctx_tensors_from_buft  # noqa: E402
from lazyggml.backend import Backend, Device, DeviceType  # noqa: E402
from lazyggml.buffer import BufferType, BufferUsage
from lazyggml.sched import Scheduler  # noqa: E402

from bench_alloc import N_EMBD, N_FF, N_HEAD_KV, N_VOCAB, HEAD_DIM, build_graph, machine  # noqa: E402


class MockDevice(Device):
    """Supports every op; a GPU reads only its own buffers, the CPU any host buffer."""

    def __init__(self, name, type_):
        super().__init__(name, type=type_)
        self.buft = BufferType(f"{name}_buf", self, 32, host=type_ == DeviceType.CPU)

    def get_buffer_type(self):
        return self.buft

    def supports_buft(self, buft):
        return buft.is_host() if self.type == DeviceType.CPU else buft is self.buft

    def init_backend(self):
        return MockBackend(self)


class MockBackend(Backend):
    def graph_compute(self, g):
        return lg.Status.SUCCESS


def make_weights(n_layer, gpu_buft, cpu_buft):
    """Layers 0 .. n/2-1 on the GPU, the rest and the output head on the CPU, each side in one
    WEIGHTS buffer (as llama.cpp's partial offload with n_gpu_layers = n/2 puts the last ones on
    the GPU; the mirror image schedules the same way)."""
    ctxs = {id(gpu_buft): lg.Context(), id(cpu_buft): lg.Context()}
    layers = []
    for il in range(n_layer):
        ctx = ctxs[id(gpu_buft if il < n_layer // 2 else cpu_buft)]
        shapes = {"attn_norm": (N_EMBD,), "wq": (N_EMBD, N_EMBD), "wk": (N_EMBD, HEAD_DIM * N_HEAD_KV),
                  "wv": (N_EMBD, HEAD_DIM * N_HEAD_KV), "wo": (N_EMBD, N_EMBD), "ffn_norm": (N_EMBD,),
                  "w_gate": (N_EMBD, N_FF), "w_up": (N_EMBD, N_FF), "w_down": (N_FF, N_EMBD)}
        layers.append({name: ctx.new_tensor(lg.F32, ne) for name, ne in shapes.items()})
        for name, t in layers[-1].items():
            t.name = f"blk.{il}.{name}"
    cpu_ctx = ctxs[id(cpu_buft)]
    out_norm = cpu_ctx.new_tensor_1d(lg.F32, N_EMBD)
    out = cpu_ctx.new_tensor_2d(lg.F32, N_EMBD, N_VOCAB)
    for buft in (gpu_buft, cpu_buft):
        alloc_ctx_tensors_from_buft(ctxs[id(buft)], buft).usage = BufferUsage.WEIGHTS
    return layers, out_norm, out


def ms(times):
    return statistics.median(times) * 1e3


def run(n_layer, n_tokens, repeat):
    gpu = MockDevice("GPU", DeviceType.GPU).init_backend()
    cpu = MockDevice("CPU", DeviceType.CPU).init_backend()
    weights = make_weights(n_layer, gpu.get_default_buffer_type(), cpu.get_default_buffer_type())

    build_t, split_t, reserve_t = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        g = build_graph(weights, n_tokens)
        build_t.append(time.perf_counter() - t0)
        s = Scheduler([gpu, cpu])
        t0 = time.perf_counter()
        s.split_graph(g)
        split_t.append(time.perf_counter() - t0)
        s = Scheduler([gpu, cpu])
        g = build_graph(weights, n_tokens)
        t0 = time.perf_counter()
        assert s.reserve(g)
        reserve_t.append(time.perf_counter() - t0)

    # the replay on a reserved scheduler: rebuild, reset, alloc_graph (no re-reservation)
    s = Scheduler([gpu, cpu])
    s.reserve(build_graph(weights, n_tokens))
    replay_t, alloc_t = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        g = build_graph(weights, n_tokens)
        t1 = time.perf_counter()
        s.reset()
        assert s.alloc_graph(g)
        t2 = time.perf_counter()
        replay_t.append(t2 - t0)
        alloc_t.append(t2 - t1)
    return {
        "n_nodes": g.n_nodes, "n_leafs": g.n_leafs, "n_splits": s.n_splits,
        "n_inputs": sum(sp.n_inputs for sp in s.splits),
        "build_ms": ms(build_t), "split_ms": ms(split_t), "reserve_ms": ms(reserve_t),
        "replay_ms": ms(replay_t), "alloc_ms": ms(alloc_t),
        "gpu_buf": s.get_buffer_size(gpu), "cpu_buf": s.get_buffer_size(cpu),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--write", action="store_true", help="write bench/results/sched.md")
    args = ap.parse_args()

    r = run(args.layers, args.tokens, args.repeat)
    per_node = lambda v: 1e3 * v / r["n_nodes"]  # noqa: E731
    lines = [
        f"graph: {args.layers} layers ({args.layers // 2} on the GPU), {args.tokens} tokens: {r['n_nodes']} nodes, "
        f"{r['n_leafs']} leafs -> {r['n_splits']} splits, {r['n_inputs']} split inputs",
        f"build graph:                        {r['build_ms']:8.2f} ms",
        f"split_graph (five passes):          {r['split_ms']:8.2f} ms  ({per_node(r['split_ms']):.2f} us/node)",
        f"reserve (split + plan + buffers):   {r['reserve_ms']:8.2f} ms  ({per_node(r['reserve_ms']):.2f} us/node)",
        f"replay: build + reset + alloc_graph {r['replay_ms']:8.2f} ms",
        f"        of which alloc_graph        {r['alloc_ms']:8.2f} ms  ({per_node(r['alloc_ms']):.2f} us/node)",
        f"compute buffers: GPU {r['gpu_buf']} B, CPU {r['cpu_buf']} B",
    ]
    print("\n".join(lines))
    if args.write:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sched.md")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("# Scheduler: split, reserve and the per-token replay\n\n")
            f.write(f"* date: {datetime.date.today().isoformat()}\n* machine: {machine()}\n* commit: (lead)\n")
            f.write(f"* command: `python bench/bench_sched.py --layers {args.layers} --tokens {args.tokens} "
                    f"--repeat {args.repeat} --write` (medians)\n\n```\n" + "\n".join(lines) + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
