"""Planning cost of the graph allocator on a 32-layer LLaMA-shaped graph.

Times the first ``Gallocr.reserve`` (a full plan plus buffer allocation) against ``alloc_graph``
replaying that plan on fresh graphs of the same shape, the way a decoder rebuilds its graph for
every token. Target: the replay is at least 10x faster than the plan. Also timed: the replay of
a graph with half the tokens, which the plan holds at its worst-case offsets (smaller layouts,
as when a decoder replays the worst case it reserved), and the same replay through GGML's
slot-by-slot check alone (the path of graphs whose wiring differs from the reserved one).

    python bench/bench_alloc.py [--layers 32] [--tokens 32] [--repeat 20] [--write [PATH]]

``--write`` stores the results in PATH (default bench/results/alloc.md).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lazyggml as lg  # noqa: E402
from lazyggml.alloc import Gallocr, alloc_ctx_tensors_from_buft  # noqa: E402
from run_info import cpu_model  # noqa: E402
from lazyggml.buffer import BufferType, BufferUsage  # noqa: E402

# small dims: the plan's cost depends on the number of tensors, not on their sizes
N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_VOCAB = 256, 8, 4, 688, 512
HEAD_DIM = N_EMBD // N_HEAD


def make_weights(n_layer, buft):
    """The model's weights in their own context and WEIGHTS buffer (pre-allocated tensors)."""
    ctx = lg.Context()
    new = ctx.new_tensor_2d
    layers = []
    for il in range(n_layer):
        layers.append({
            "attn_norm": ctx.new_tensor_1d(lg.F32, N_EMBD),
            "wq": new(lg.F32, N_EMBD, N_EMBD),
            "wk": new(lg.F32, N_EMBD, HEAD_DIM * N_HEAD_KV),
            "wv": new(lg.F32, N_EMBD, HEAD_DIM * N_HEAD_KV),
            "wo": new(lg.F32, N_EMBD, N_EMBD),
            "ffn_norm": ctx.new_tensor_1d(lg.F32, N_EMBD),
            "w_gate": new(lg.F32, N_EMBD, N_FF),
            "w_up": new(lg.F32, N_EMBD, N_FF),
            "w_down": new(lg.F32, N_FF, N_EMBD),
        })
        for name, t in layers[-1].items():
            t.name = f"blk.{il}.{name}"
    out_norm = ctx.new_tensor_1d(lg.F32, N_EMBD)
    out = new(lg.F32, N_EMBD, N_VOCAB)
    buf = alloc_ctx_tensors_from_buft(ctx, buft)
    buf.usage = BufferUsage.WEIGHTS
    return layers, out_norm, out


def build_graph(weights, n_tokens):
    """One forward pass (llama.cpp's llm_build_llama without a KV cache)."""
    layers, out_norm, out = weights
    ctx = lg.Context()
    with ctx:
        inp = ctx.new_tensor_2d(lg.F32, N_EMBD, n_tokens)
        pos = ctx.new_tensor_1d(lg.I32, n_tokens)
        mask = ctx.new_tensor_2d(lg.F32, n_tokens, n_tokens)
        for t in (inp, pos, mask):
            lg.set_input(t)
        x = inp
        for w in layers:
            cur = lg.mul(lg.rms_norm(x, 1e-5), w["attn_norm"])
            q = lg.reshape_3d(lg.mul_mat(w["wq"], cur), HEAD_DIM, N_HEAD, n_tokens)
            k = lg.reshape_3d(lg.mul_mat(w["wk"], cur), HEAD_DIM, N_HEAD_KV, n_tokens)
            v = lg.reshape_3d(lg.mul_mat(w["wv"], cur), HEAD_DIM, N_HEAD_KV, n_tokens)
            q = lg.permute(lg.rope_ext(q, pos, None, HEAD_DIM, lg.ROPE_TYPE_NORMAL), 0, 2, 1, 3)
            k = lg.permute(lg.rope_ext(k, pos, None, HEAD_DIM, lg.ROPE_TYPE_NORMAL), 0, 2, 1, 3)
            v = lg.cont(lg.permute(v, 1, 2, 0, 3))             # [n_tokens, head_dim, n_head_kv]
            kq = lg.soft_max_ext(lg.mul_mat(k, q), mask, HEAD_DIM ** -0.5, 0.0)
            kqv = lg.mul_mat(v, kq)                            # [head_dim, n_tokens, n_head]
            cur = lg.cont_2d(lg.permute(kqv, 0, 2, 1, 3), N_EMBD, n_tokens)
            ffn_inp = lg.add(lg.mul_mat(w["wo"], cur), x)
            cur = lg.mul(lg.rms_norm(ffn_inp, 1e-5), w["ffn_norm"])
            ffn = lg.swiglu_split(lg.mul_mat(w["w_gate"], cur), lg.mul_mat(w["w_up"], cur))
            x = lg.add(lg.mul_mat(w["w_down"], ffn), ffn_inp)
        logits = lg.mul_mat(out, lg.mul(lg.rms_norm(x, 1e-5), out_norm))
        lg.set_output(logits)
    g = lg.Graph(4096)
    lg.build_forward_expand(g, logits)
    return g


def run(n_layer, n_tokens, repeat):
    buft = BufferType("CPU_bench", alignment=32, host=True)
    weights = make_weights(n_layer, buft)
    graphs = [build_graph(weights, n_tokens) for _ in range(repeat + 1)]
    smaller = [build_graph(weights, n_tokens // 2) for _ in range(2 * repeat)]

    # first reserve: fresh allocators, the full plan and the buffer allocation
    reserve_times = []
    for _ in range(repeat):
        ga = Gallocr(buft)
        t0 = time.perf_counter()
        ga.reserve(graphs[0])
        reserve_times.append(time.perf_counter() - t0)

    # replay: the plan on graphs of the same shape, each seen for the first time
    ga = Gallocr(buft)
    ga.reserve(graphs[0])
    alloc_times = []
    for g in graphs[1:]:
        t0 = time.perf_counter()
        assert ga.alloc_graph(g)
        alloc_times.append(time.perf_counter() - t0)
    report = ga.memory_report()[0]

    # a smaller graph: the plan holds it (worst-case offsets); then GGML's check alone
    smaller_times, slow_times = [], []
    for times, g in zip([smaller_times] * repeat + [slow_times] * repeat, smaller):
        if times is slow_times:
            ga._replay_key = None
        assert not ga.needs_realloc(g)
        t0 = time.perf_counter()
        assert ga.alloc_graph(g)
        times.append(time.perf_counter() - t0)
    return {
        "n_nodes": graphs[0].n_nodes, "n_leafs": graphs[0].n_leafs,
        "reserve_ms": statistics.median(reserve_times) * 1e3,
        "alloc_ms": statistics.median(alloc_times) * 1e3,
        "smaller_ms": statistics.median(smaller_times) * 1e3,
        "slow_ms": statistics.median(slow_times) * 1e3,
        "peak": report["peak"], "no_reuse": report["no_reuse"],
    }


def machine():
    return f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--write", nargs="?", metavar="PATH", help="write the results as markdown",
                    const=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "alloc.md"))
    args = ap.parse_args()

    r = run(args.layers, args.tokens, args.repeat)
    ratio = r["reserve_ms"] / r["alloc_ms"]

    def per_node(ms):
        return f"{1e3 * ms / r['n_nodes']:.2f}"

    lines = [
        f"machine: {machine()}",
        f"graph: {args.layers} layers, {args.tokens} tokens: {r['n_nodes']} nodes, {r['n_leafs']} leafs",
        f"first reserve (plan + buffers): {r['reserve_ms']:8.2f} ms  ({per_node(r['reserve_ms'])} us/node)",
        f"alloc_graph replay:             {r['alloc_ms']:8.2f} ms  ({per_node(r['alloc_ms'])} us/node)",
        f"ratio: {ratio:.1f}x (target >= 10x)",
        f"replay of a {args.tokens // 2}-token graph:     {r['smaller_ms']:8.2f} ms",
        f"  the same through GGML's slot-by-slot check only: {r['slow_ms']:.2f} ms",
        f"compute buffer: {r['peak']} B planned vs {r['no_reuse']} B without reuse "
        f"({100 * r['peak'] / r['no_reuse']:.1f}%)",
    ]
    print("\n".join(lines))
    if args.write:
        os.makedirs(os.path.dirname(args.write), exist_ok=True)
        with open(args.write, "w") as f:
            f.write("# Graph allocator: plan vs replay\n\n")
            f.write(f"* date: {datetime.date.today().isoformat()}\n* commit: (lead)\n")
            f.write(f"* command: `python bench/bench_alloc.py --layers {args.layers} --tokens {args.tokens} "
                    f"--repeat {args.repeat}` (medians)\n\n```\n" + "\n".join(lines) + "\n```\n")
    return 0 if ratio >= 10 else 1


if __name__ == "__main__":
    sys.exit(main())
