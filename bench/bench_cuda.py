"""CUDA backend benchmark: quantized mul_mat at GGML's perf shapes, and a decode step of a layer stack.

    python bench/bench_cuda.py                          # check + Q4_K mul_mat table + decode step
    python bench/bench_cuda.py --quick                  # fewer repetitions
    python bench/bench_cuda.py --only-mul-mat --types q2_k,q3_k,q5_k,iq4_nl,iq4_xs --n 1 8

1. **Check** at real shapes: mul_mat of the ``--types`` (Q4_K by default) and of Q6_K, Q8_0 and F16
   (m=4096, k=14336 for Q4_K, else m=1024, k=4096; n in 1, 8, 512) against NumPy in float64 on
   the dequantized weights, by GGML's NMSE (limit 5e-4).
2. **MUL_MAT x F32** for each of the ``--types``, m=4096, k=14336, n in {1, 8, 512}, timed as
   GGML's test-backend-ops does: the op repeated in one graph (same weights, so they may sit in the
   60 MB L2, as in GGML's figure), the graph replayed as a CUDA graph, CUDA events around many
   replays, median of rounds. Each op includes quantizing src1, as GGML's does. A second row per n
   rotates over 4 copies of the weights (beyond L2). Columns: µs per op, TFLOPS (2·m·n·k per op),
   GB/s of weights read (once per op), and the ratio to GGML's H200 time where there is one.
3. **Decode step** of a small LLaMA-shaped stack (Q4_K weights, Q6_K output, F16 KV cache): one
   token's graph timed (a) replayed as one CUDA graph, (b) as the sum of its kernels (each node's
   launches captured alone and replayed: pure GPU time, no gaps), (c) launched eagerly from Python.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lazyggml as lg  # noqa: E402
from lazyggml.alloc import alloc_ctx_tensors  # noqa: E402
from lazyggml.types import Type, row_size, type_size  # noqa: E402

# GGML's H200 times (µs) for m=4096, k=14336 at n = 1, 8, 512: test-backend-ops perf of the GGML that
# llama-cpp-python 0.3.36 vendors, built with llama-cpp-anchor (the issue 18 figures)
_GGML_H200 = {"q4_0": (14.5, 32.8, 306.6), "q4_1": (11.8, 31.3, 346.3), "q5_0": (17.7, 37.8, 321.6),
              "q5_1": (16.8, 36.7, 369.9), "q8_0": (23.3, 45.5, 312.6), "q2_k": (16.9, 59.4, 530.1),
              "q3_k": (23.3, 58.9, 415.6), "q4_k": (16.0, 46.6, 346.7), "q5_k": (18.6, 48.5, 361.0),
              "q6_k": (24.0, 57.3, 423.3), "iq4_nl": (15.9, 34.2, 313.3), "iq4_xs": (14.5, 35.2, 284.9),
              "f16": (30.8, 48.4, 114.9), "bf16": (30.2, 48.5, 104.8)}
GGML_US = {(Type[name.upper()], n): us for name, row in _GGML_H200.items() for n, us in zip((1, 8, 512), row)}
M, K = 4096, 14336
# the fp16 fields of each block (byte offset: value) that random_blocks sets to sane scales
HALVES = {Type.Q4_0: {0: 0.004}, Type.Q4_1: {0: 0.004, 2: 0.002}, Type.Q5_0: {0: 0.004},
          Type.Q5_1: {0: 0.004, 2: 0.002}, Type.Q8_0: {0: 0.004}, Type.Q2_K: {80: 0.002, 82: 0.001},
          Type.Q3_K: {108: 0.002}, Type.Q4_K: {0: 0.002, 2: 0.001}, Type.Q5_K: {0: 0.002, 2: 0.001},
          Type.Q6_K: {208: 0.0005}, Type.IQ4_NL: {0: 0.004}, Type.IQ4_XS: {0: 0.002}}


def cuda_backend():
    dev = lg.dev_by_name("CUDA0")
    if dev is None:
        sys.exit("no CUDA device (numba-cuda sees no GPU)")
    return dev.init_backend()


def random_blocks(type_, m, k, rng):
    """Valid random quantized rows without running a quantizer: random bytes, sane fp16 scales (F16
    and BF16: random values in [-1, 1])."""
    if type_ == Type.F16:
        return rng.uniform(-1, 1, (m, k)).astype(np.float16).view(np.uint8)
    if type_ == Type.BF16:
        from lazyggml.op_cases import to_bf16_bits
        return to_bf16_bits(rng.uniform(-1, 1, (m, k)).astype(np.float32)).view(np.uint8)
    raw = rng.integers(0, 256, (m, row_size(type_, k)), dtype=np.uint8)
    blocks = raw.reshape(m, -1, type_size(type_))
    for off, v in HALVES[type_].items():
        blocks[:, :, off:off + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)
    return raw


def events_time(be, fn, reps, rounds):
    """Median over rounds of the GPU time per call of ``fn`` (µs), by CUDA events on be's stream."""
    from numba import cuda
    fn()
    be.synchronize()
    out = []
    for _ in range(rounds):
        e0, e1 = cuda.event(), cuda.event()
        e0.record(be.stream)
        for _ in range(reps):
            fn()
        e1.record(be.stream)
        e1.synchronize()
        out.append(cuda.event_elapsed_time(e0, e1) * 1000.0 / reps)
    return statistics.median(out)


# -- 1. correctness at real shapes ----------------------------------------------------------------
def check(be, rng, types):
    from lazyggml.backends.cuda.mmvq import VEC_DOT
    from lazyggml.quants import dequantize, quantize
    print("## Check against NumPy (float64, dequantized weights), NMSE limit 5e-4\n")
    print("| src0 | m | k | n | kernel | NMSE |\n| --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for type_ in dict.fromkeys((*types, Type.Q6_K, Type.Q8_0, Type.F16)):
        m, k = (M, K) if type_ == Type.Q4_K else (1024, 4096)
        W = rng.uniform(-1, 1, (m, k)).astype(np.float32)
        wb = W.astype(np.float16) if type_ == Type.F16 else quantize(type_, W)
        Wd = wb.astype(np.float64) if type_ == Type.F16 else dequantize(type_, wb, k).astype(np.float64)
        for n in (1, 8, 512):
            ctx = lg.Context()
            w, x = ctx.new_tensor_2d(type_, k, m), ctx.new_tensor_2d(lg.F32, k, n)
            y = lg.mul_mat(w, x)
            g = lg.Graph()
            lg.build_forward_expand(g, y)
            buf = alloc_ctx_tensors(ctx, be)
            X = rng.uniform(-1, 1, (n, k)).astype(np.float32)
            lg.tensor_set(w, wb)
            lg.tensor_set(x, X)
            be.graph_compute(g)
            be.synchronize()
            got = lg.tensor_get(y)[0, 0].astype(np.float64)
            ref = X.astype(np.float64) @ Wd.T
            e = float(np.sum((got - ref) ** 2) / np.sum(ref ** 2))
            worst = max(worst, e)
            kern = ("mmvq" if n <= 8 and type_ in VEC_DOT else ("mmq" if type_ == Type.Q4_K else "dequant+gemm")) \
                if type_ != Type.F16 else ("mmvf" if n <= 8 else "gemm")
            print(f"| {type_.name} | {m} | {k} | {n} | {kern} | {e:.2e} |", flush=True)
            buf.free()
    print(f"\nworst NMSE {worst:.2e}: {'PASS' if worst <= 5e-4 else 'FAIL'}\n")
    return worst <= 5e-4


# -- 2. MUL_MAT x F32 ------------------------------------------------------------------------------
def bench_mul_mat(be, rng, type_, n, copies, quick):
    flops = 2.0 * M * n * K
    runs = {1: 64, 8: 32, 512: 8}.get(n, 8 if n > 8 else 32) // (2 if quick else 1)
    ctx = lg.Context()
    ws = [ctx.new_tensor_2d(type_, K, M) for _ in range(copies)]
    x = ctx.new_tensor_2d(lg.F32, K, n)
    g = lg.Graph(size=4 * runs + 16)
    for r in range(runs):
        lg.build_forward_expand(g, lg.mul_mat(ws[r % copies], x))
    buf = alloc_ctx_tensors(ctx, be)
    wb = random_blocks(type_, M, K, rng)
    for w in ws:
        lg.tensor_set(w, wb)
    lg.tensor_set(x, rng.uniform(-1, 1, (n, K)).astype(np.float32))
    for _ in range(3):                     # eager, capture, replay
        be.graph_compute(g)
    us = events_time(be, lambda: be.graph_compute(g), 5 if quick else 20, 5 if quick else 9) / runs
    buf.free()
    wbytes = row_size(type_, K) * M
    return us, flops / us / 1e6, wbytes / us / 1e3


# -- 3. decode step of a layer stack ----------------------------------------------------------------
def build_stack(ctx, n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, n_ctx, n_kv):
    hd = n_embd // n_head
    n_embd_kv = hd * n_head_kv
    T = {}
    x = T["inp"] = ctx.new_tensor_2d(lg.F32, n_embd, 1)
    pos = T["pos"] = ctx.new_tensor_1d(lg.I32, 1)
    kv_idx = T["kv_idx"] = ctx.new_tensor_1d(lg.I64, 1)
    mask = T["mask"] = ctx.new_tensor_2d(lg.F16, n_kv, 1)
    weights = []
    for il in range(n_layer):
        W = {name: ctx.new_tensor_2d(typ, a, b) for name, typ, a, b in [
            ("wq", lg.Q4_K, n_embd, n_embd), ("wk", lg.Q4_K, n_embd, n_embd_kv), ("wv", lg.Q6_K, n_embd, n_embd_kv),
            ("wo", lg.Q4_K, n_embd, n_embd), ("gate", lg.Q4_K, n_embd, n_ff), ("up", lg.Q4_K, n_embd, n_ff),
            ("down", lg.Q6_K, n_ff, n_embd)]}
        W["attn_norm"] = ctx.new_tensor_1d(lg.F32, n_embd)
        W["ffn_norm"] = ctx.new_tensor_1d(lg.F32, n_embd)
        kc = W["k_cache"] = ctx.new_tensor_2d(lg.F16, n_embd_kv, n_ctx)
        vc = W["v_cache"] = ctx.new_tensor_2d(lg.F16, n_embd_kv, n_ctx)
        weights.append(W)

        h = lg.mul(lg.rms_norm(x, 1e-5), W["attn_norm"])
        q = lg.reshape_3d(lg.mul_mat(W["wq"], h), hd, n_head, 1)
        k = lg.reshape_3d(lg.mul_mat(W["wk"], h), hd, n_head_kv, 1)
        v = lg.mul_mat(W["wv"], h)
        q = lg.rope_ext(q, pos, None, hd, lg.ROPE_TYPE_NEOX)
        k = lg.rope_ext(k, pos, None, hd, lg.ROPE_TYPE_NEOX)
        kc = lg.set_rows(kc, lg.reshape_2d(k, n_embd_kv, 1), kv_idx)
        vc = lg.set_rows(vc, v, kv_idx)
        K_ = lg.view_3d(kc, hd, n_kv, n_head_kv, kc.nb[1], hd * 2, 0)
        V_ = lg.view_3d(vc, hd, n_kv, n_head_kv, vc.nb[1], hd * 2, 0)
        kq = lg.mul_mat(K_, lg.permute(q, 0, 2, 1, 3))                     # [n_kv, 1, n_head]
        kq = lg.soft_max_ext(kq, mask, 1.0 / np.sqrt(hd), 0.0)
        kqv = lg.mul_mat(lg.cont(lg.transpose(V_)), kq)                   # [hd, 1, n_head]
        o = lg.cont_2d(lg.permute(kqv, 0, 2, 1, 3), n_embd, 1)
        x = lg.add(x, lg.mul_mat(W["wo"], o))
        h = lg.mul(lg.rms_norm(x, 1e-5), W["ffn_norm"])
        a = lg.swiglu_split(lg.mul_mat(W["gate"], h), lg.mul_mat(W["up"], h))
        x = lg.add(x, lg.mul_mat(W["down"], a))
    T["norm"] = ctx.new_tensor_1d(lg.F32, n_embd)
    T["output"] = ctx.new_tensor_2d(lg.Q6_K, n_embd, n_vocab)
    logits = lg.mul_mat(T["output"], lg.mul(lg.rms_norm(x, 1e-5), T["norm"]))
    return T, weights, logits


def bench_decode(be, rng, quick):
    from lazyggml.backends.cuda.graphs import capture
    cfg = dict(n_layer=8, n_embd=2048, n_head=32, n_head_kv=8, n_ff=5632, n_vocab=32000, n_ctx=256, n_kv=129)
    ctx = lg.Context()
    T, weights, logits = build_stack(ctx, **cfg)
    g = lg.Graph(size=4096)
    lg.build_forward_expand(g, logits)
    buf = alloc_ctx_tensors(ctx, be)
    for t in ctx.tensors():
        if t.buffer is None or t.op != lg.Op.NONE:
            continue
        if t.type in (lg.Q4_K, lg.Q6_K):
            lg.tensor_set(t, random_blocks(t.type, t.ne[1], t.ne[0], rng))
        elif t.type == lg.F16:
            lg.tensor_set(t, rng.uniform(-1, 1, tuple(reversed(t.ne))).astype(np.float16))
        elif t.type == lg.F32:
            lg.tensor_set(t, rng.uniform(0.5, 1.5, tuple(reversed(t.ne))).astype(np.float32))
    lg.tensor_set(T["pos"], np.array([cfg["n_kv"] - 1], np.int32))
    lg.tensor_set(T["kv_idx"], np.array([cfg["n_kv"] - 1], np.int64))
    lg.tensor_set(T["mask"], np.zeros((1, cfg["n_kv"]), np.float16))
    reps, rounds = (5, 5) if quick else (20, 9)

    for _ in range(3):
        be.graph_compute(g)
    t_graph = events_time(be, lambda: be.graph_compute(g), reps, rounds)

    be.use_graphs = False
    be.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        be.graph_compute(g)
    be.synchronize()
    t_eager = (time.perf_counter() - t0) * 1e6 / reps

    from lazyggml.backends.cuda.table import FORWARD
    nodes = [n for n in g.nodes if n.op not in lg.ops.EMPTY_OPS and n.nelements() > 0]
    t_sum = 0.0
    for n in nodes:
        fn = FORWARD[n.op][0]
        cg = capture(be.stream, lambda fn=fn, n=n: fn(be, n))
        t_sum += events_time(be, lambda cg=cg: cg.launch(be.stream), 10, 3)
        cg.free()
    be.use_graphs = True
    buf.free()
    return cfg, len(nodes), t_graph, t_sum, t_eager


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--only-mul-mat", action="store_true", help="just the mul_mat table (dp4a variants)")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8, 512], help="mul_mat column counts")
    ap.add_argument("--types", default="q4_k", help="mul_mat weight types, comma-separated (e.g. q2_k,iq4_xs)")
    args = ap.parse_args()
    known = {t.name.lower(): t for t in (*HALVES, Type.F16, Type.BF16)}
    wanted = args.types.lower().split(",")
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        sys.exit(f"--types: no rows for {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    types = list(dict.fromkeys(known[w] for w in wanted))
    rng = np.random.default_rng(0)
    be = cuda_backend()
    from lazyggml.backends.cuda.common import DP4A_IMPL
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip() or be.device.description
    print(f"# lazyggml CUDA benchmark, {datetime.date.today()}, {name}, dp4a: {DP4A_IMPL}\n")
    ok = True
    if not (args.skip_check or args.only_mul_mat):
        ok = check(be, rng, types)

    from lazyggml.backends.cuda.mmq import use_mma
    with be.device.context():
        mmq_kind = "int8 MMA" if use_mma() else "dp4a"
    print(f"## MUL_MAT x F32, m={M}, k={K} (dp4a: {DP4A_IMPL}, mmq: {mmq_kind})\n")
    print("| src0 | n | weights | µs/op | TFLOPS | GB/s weights | GGML H200 µs | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for type_ in types:
        for n in args.n:
            for copies, label in ((1, "same (L2-warm, as GGML)"), (4, "4 copies (L2-cold)")):
                us, tflops, gbs = bench_mul_mat(be, rng, type_, n, copies, args.quick)
                ggml = GGML_US.get((type_, n))
                vs = f"{ggml} | {us / ggml:.2f}x" if ggml else "– | –"
                print(f"| {type_.name} | {n} | {label} | {us:.1f} | {tflops:.2f} | {gbs:.0f} | {vs} |", flush=True)
    if args.only_mul_mat:
        return
    cfg, n_nodes, t_graph, t_sum, t_eager = bench_decode(be, rng, args.quick)
    print(f"\n## Decode step, {cfg['n_layer']} layers (n_embd {cfg['n_embd']}, n_ff {cfg['n_ff']}, "
          f"{cfg['n_head']}/{cfg['n_head_kv']} heads, n_kv {cfg['n_kv']}, vocab {cfg['n_vocab']}), {n_nodes} nodes\n")
    print("| how | µs per token |\n| --- | --- |")
    print(f"| replayed as one CUDA graph | {t_graph:.0f} |")
    print(f"| sum of its kernels (each replayed alone) | {t_sum:.0f} |")
    print(f"| launched eagerly from Python | {t_eager:.0f} |")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
