"""MUL_MAT on the CPU: lazyggml next to GGML's CPU backend, in the same process, same thread count.

    python bench/bench_mul_mat.py                 # the table of bench/results/mul_mat_cpu.md
    python bench/bench_mul_mat.py --quick         # fewer rounds
    python bench/bench_mul_mat.py --write bench/results/mul_mat_cpu.md

Shapes are test-backend-ops' perf shapes: weights m=4096 rows of k=14336, activations n columns
(MUL_MAT type x F32). GGML runs through ggml-python (a one-node graph, ``ggml_graph_plan`` once and
``ggml_graph_compute`` per run), lazyggml through ``backends.cpu.matmul.mul_mat``; both include the
conversion of the float activations to the weight's vec_dot_type. The two are timed in alternating
blocks (ours, GGML, ours, ...) so that background load hits both alike; each figure is the median
over all timed runs after a warm-up. Weights are random blocks with sane fp16 scales: the integer
kernels' speed does not depend on the values. FLOPS = 2*m*n*k / time; ratio = lazyggml throughput
/ GGML throughput (> 1: lazyggml faster).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numba  # noqa: E402

from lazyggml.backends.cpu import matmul as M  # noqa: E402
from lazyggml.backends.cpu import simd  # noqa: E402
from lazyggml.types import Type, blck_size, row_size, type_size  # noqa: E402

import ggml  # noqa: E402  (ggml-python)
from run_info import cpu_model, git_commit, sched_policy  # noqa: E402

M_ROWS, K = 4096, 14336
ROWS = [(Type.Q4_K, 1), (Type.Q4_K, 2), (Type.Q4_K, 4), (Type.Q4_K, 8), (Type.Q4_K, 512)] + [
    (t, n) for t in (Type.Q5_K, Type.Q6_K, Type.Q8_0, Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q2_K,
                     Type.Q3_K, Type.IQ4_NL, Type.IQ4_XS, Type.F16, Type.BF16) for n in (1, 512)]
# byte offsets of the fp16 scales in each block (random bytes there could be inf/NaN)
SCALE_OFFSETS = {Type.Q4_K: (0, 2), Type.Q5_K: (0, 2), Type.Q6_K: (208,), Type.Q8_0: (0,), Type.Q4_0: (0,),
                 Type.Q4_1: (0, 2), Type.Q5_0: (0,), Type.Q5_1: (0, 2), Type.Q2_K: (80, 82), Type.Q3_K: (108,),
                 Type.IQ4_NL: (0,), Type.IQ4_XS: (0,)}


class GGMLMulMat:
    """dst = mul_mat(w, x) as a one-node GGML graph, built once and computed many times."""

    def __init__(self, w_bytes, t, x_shape, n_threads):
        ne03, ne02, ne01, _ = w_bytes.shape
        ne13, ne12, ne11, ne10 = x_shape
        self.dst_shape = (ne13, ne12, ne11, ne01)
        mem = (w_bytes.nbytes + 4 * ne13 * ne12 * ne11 * ne10 + 4 * int(np.prod(self.dst_shape))
               + 16 * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead() + (1 << 20))
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=False))
        self.w = ggml.ggml_new_tensor_4d(self.ctx, int(t), ne10, ne01, ne02, ne03)
        ctypes.memmove(ggml.ggml_get_data(self.w), np.ascontiguousarray(w_bytes).ctypes.data,
                       w_bytes.nbytes)
        self.x = ggml.ggml_new_tensor_4d(self.ctx, ggml.GGML_TYPE_F32, ne10, ne11, ne12, ne13)
        self.out = ggml.ggml_mul_mat(self.ctx, self.w, self.x)
        self.gf = ggml.ggml_new_graph(self.ctx)
        ggml.ggml_build_forward_expand(self.gf, self.out)
        # ggml_graph_compute_with_ctx would allocate a new work buffer in the context on every
        # call: plan once, own the work buffer, and call ggml_graph_compute (the same code path)
        self.plan = ggml.ggml_graph_plan(self.gf, n_threads, None)
        self.work = np.empty(max(int(self.plan.work_size), 1), np.uint8)
        self.plan.work_data = self.work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))

    def set_x(self, x):
        x = np.ascontiguousarray(x, np.float32)
        ctypes.memmove(ggml.ggml_get_data(self.x), x.ctypes.data, x.nbytes)

    def compute(self):
        ggml.ggml_graph_compute(self.gf, ctypes.byref(self.plan))

    def result(self):
        n = int(np.prod(self.dst_shape))
        p = ctypes.cast(ggml.ggml_get_data(self.out), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(p, (n,)).reshape(self.dst_shape).copy()

    def close(self):
        ggml.ggml_free(self.ctx)


def random_weights(rng, t, m, k):
    if t in (Type.F16, Type.BF16):   # rows of elements (float16, or BF16's bits as uint16)
        w = rng.uniform(-1, 1, (1, 1, m, k)).astype(np.float32)
        return w.astype(np.float16) if t == Type.F16 else (w.view(np.uint32) >> 16).astype(np.uint16)
    nb = m * k // blck_size(t)
    b = rng.integers(0, 256, (nb, type_size(t)), dtype=np.uint8)
    for o in SCALE_OFFSETS[t]:
        b[:, o:o + 2] = rng.uniform(1e-3, 1e-2, nb).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(1, 1, m, row_size(t, k))


def timed(fn, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def bench_row(rng, t, n, n_threads, rounds, budget_s):
    w = random_weights(rng, t, M_ROWS, K)
    x = rng.uniform(-1, 1, (1, 1, n, K)).astype(np.float32)
    dst = np.empty((1, 1, n, M_ROWS), np.float32)
    g = GGMLMulMat(w, t, x.shape, n_threads)
    g.set_x(x)
    ours = lambda: M.mul_mat(w, t, x, dst)  # noqa: E731
    # warm-up (compiles on a cold cache) and a correctness check
    ours()
    g.compute()
    err = float(np.linalg.norm(dst - g.result()) / np.linalg.norm(g.result()))
    t_one = min(timed(ours, 1) + timed(g.compute, 1))
    reps = max(1, int(budget_s / rounds / 2 / max(t_one, 1e-6)))
    to, tg = [], []
    for _ in range(rounds):
        to += timed(ours, reps)
        tg += timed(g.compute, reps)
    g.close()
    return (float(np.median(to)), float(np.median(tg)), float(np.min(to)), float(np.min(tg)), err,
            len(to))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    ap.add_argument("--write", metavar="PATH", help="also write the markdown results file")
    ap.add_argument("--types", help="only these weight types, comma-separated (e.g. q4_1,q5_0)")
    args = ap.parse_args()
    wanted = set(args.types.lower().split(",")) if args.types else None
    known = {t.name.lower() for t, _ in ROWS}
    if wanted and wanted - known:
        sys.exit(f"--types: no rows for {', '.join(sorted(wanted - known))}; known: {', '.join(sorted(known))}")
    rows = [(t, n) for t, n in ROWS if wanted is None or t.name.lower() in wanted]
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rounds = 3 if args.quick else 5
    load0 = os.getloadavg()
    lines = []
    hdr = ("| type | n | lazyggml µs | lazyggml GFLOPS | GGML µs | GGML GFLOPS | ratio "
           "| min µs lazyggml / GGML | ratio of mins | runs | rel. err |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(hdr[0])
    print(hdr[1])
    for t, n in rows:
        budget = (6.0 if n < 100 else 16.0) * (0.5 if args.quick else 1.0)
        to, tg, mo, mg, err, runs = bench_row(rng, t, n, args.threads, rounds, budget)
        flops = 2.0 * M_ROWS * n * K
        line = (f"| {t.name} | {n} | {to * 1e6:,.0f} | {flops / to / 1e9:.1f} | {tg * 1e6:,.0f} | "
                f"{flops / tg / 1e9:.1f} | {tg / to:.2f} | {mo * 1e6:,.0f} / {mg * 1e6:,.0f} | "
                f"{mg / mo:.2f} | {runs} | {err:.0e} |")
        print(line, flush=True)
        lines.append(line)
    load1 = os.getloadavg()
    meta = [
        f"* date: {datetime.date.today().isoformat()}",
        f"* commit: {git_commit()}",
        f"* machine: {cpu_model()}, {os.cpu_count()} logical CPUs; {args.threads} threads for both",
        f"* lazyggml SIMD path: {simd.ISA}; numba {numba.__version__}, threading layer "
        f"{numba.threading_layer()}",
        f"* GGML: ggml-python {getattr(ggml, '__version__', '?')} (its vendored GGML, built with "
        f"-march=native), one-node graph, `ggml_graph_plan` + `ggml_graph_compute`",
        f"* load average before/after: {load0[0]:.2f} / {load1[0]:.2f}; scheduling: {sched_policy()} "
        f"(run as users run, without real-time priority: with other processes on the cores, a "
        f"descheduled thread stalls every parallel region and both sides come out slower alike)",
        f"* m={M_ROWS}, k={K}; µs = median per run; ratio = GGML time / lazyggml time "
        f"(throughput ratio, > 1 means lazyggml is faster); the min columns are the fastest run of "
        f"each, the better estimate of an idle machine when others load the cores; runs = timed "
        f"runs of each; rel. err = ‖ours − GGML‖/‖GGML‖",
    ]
    print("\n".join(meta))
    if args.write:
        with open(args.write, "w") as f:
            f.write("# MUL_MAT on the CPU: lazyggml vs GGML (same process, same threads)\n\n")
            f.write("Produced by `python bench/bench_mul_mat.py --write bench/results/mul_mat_cpu.md`.\n\n")
            f.write("\n".join(meta) + "\n\n")
            f.write("\n".join(hdr) + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
