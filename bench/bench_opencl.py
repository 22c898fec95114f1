"""OpenCL backend benchmark: MUL_MAT Q4_K x F32, m=4096, k=14336, n in {1, 8, 512}.

    python bench/bench_opencl.py [--rounds 5] [--n 1 8 512] [--write]

Runs the same product on the OpenCL device (PoCL's CPU device here) and on lazyggml's CPU
backend in one process, and on GGML itself through ggml-python when it is installed (the
in-process figure that bench/results/mul_mat_cpu.md compares against). Each time is the median of
``--rounds`` synchronous ``graph_compute`` calls after one warm-up call (which pays the kernel
compilations); GFLOPS = 2*m*n*k / time. ``OpenCL/CPU`` is OpenCL's throughput over the CPU
backend's (the target on PoCL: >= 0.5). ``--write`` stores the table in bench/results/opencl.md.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lazyggml as lg  # noqa: E402
from run_info import git_commit  # noqa: E402
from lazyggml.alloc import alloc_ctx_tensors  # noqa: E402
from lazyggml.quants import quantize  # noqa: E402

M, K = 4096, 14336


def median_time(fn, rounds):
    fn()  # warm-up: kernel compilation, first touch of the memory
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def lazyggml_runner(backend, w_bytes, x):
    """A graph computing mul_mat(W, x) on ``backend``; None when the backend does not support it."""
    ctx = lg.Context()
    w = ctx.new_tensor_2d(lg.Q4_K, K, M)
    b = ctx.new_tensor_2d(lg.F32, K, x.shape[0])
    out = lg.mul_mat(w, b)
    if not backend.supports_op(out):
        return None
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    alloc_ctx_tensors(ctx, backend)
    lg.tensor_set(w, w_bytes)
    lg.tensor_set(b, x)
    return lambda: lg.backend_graph_compute(backend, g), out


def ggml_runner(w_bytes, x, n_threads):
    """The same product in GGML's own CPU backend (ggml-python), or None without it."""
    try:
        import ggml
    except ImportError:
        return None
    n = x.shape[0]
    size = w_bytes.nbytes + x.nbytes + M * n * 4 + 64 * 1024 * 1024
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
    w = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_Q4_K, K, M)
    b = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, K, n)
    out = ggml.ggml_mul_mat(ctx, w, b)
    gf = ggml.ggml_new_graph(ctx)
    ggml.ggml_build_forward_expand(gf, out)
    ctypes.memmove(ggml.ggml_get_data(w), w_bytes.ctypes.data, w_bytes.nbytes)
    ctypes.memmove(ggml.ggml_get_data(b), x.ctypes.data, x.nbytes)

    def run():
        ggml.ggml_graph_compute_with_ctx(ctx, gf, n_threads)

    result = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)), (n, M))
    return run, result, lambda: ggml.ggml_free(ctx)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8, 512])
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    load = os.getloadavg()[0]
    ocl = lg.backend_init_by_name("OpenCL0")
    cpu = lg.backend_cpu_init()
    n_threads = cpu.n_threads
    rng = np.random.default_rng(0)
    w_bytes = quantize(lg.Q4_K, rng.uniform(-1, 1, (M, K)).astype(np.float32))

    rows = []
    for n in args.n:
        x = rng.uniform(-1, 1, (n, K)).astype(np.float32)
        rounds = args.rounds if n <= 8 else max(2, args.rounds // 2)
        flop = 2.0 * M * n * K
        run, out = lazyggml_runner(ocl, w_bytes, x)
        t_ocl = median_time(run, rounds)
        got = lg.tensor_get(out)[0, 0].astype(np.float64)
        cpu_run = lazyggml_runner(cpu, w_bytes, x)
        t_cpu = median_time(cpu_run[0], rounds) if cpu_run else None
        ref = ggml_runner(w_bytes, x, n_threads)
        t_ggml = nmse = None
        if ref is not None:
            t_ggml = median_time(ref[0], rounds)
            want = ref[1].astype(np.float64)
            nmse = float(np.sum((got - want) ** 2) / np.sum(want ** 2))
            ref[2]()
        rows.append((n, t_ocl, flop / t_ocl / 1e9, t_cpu, t_ggml, nmse))
        print(f"n={n}: OpenCL {t_ocl * 1e3:.2f} ms, CPU " + (f"{t_cpu * 1e3:.2f} ms" if t_cpu else "n/a")
              + (f", GGML {t_ggml * 1e3:.2f} ms, NMSE vs GGML {nmse:.1e}" if t_ggml else ""), flush=True)

    def ms(t):
        return "n/a" if t is None else f"{t * 1e3:.2f}"

    lines = [
        f"MUL_MAT Q4_K x F32, m={M}, k={K}: {ocl.device.get_description()}; "
        f"CPU backend and GGML with {n_threads} threads; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; {datetime.date.today()}; commit {git_commit()}; median of {args.rounds} runs "
        f"({max(2, args.rounds // 2)} for n > 8); load average at start: {load:.1f}.",
        "",
        "| n | OpenCL ms | OpenCL GFLOPS | CPU backend ms | GGML CPU ms | OpenCL/CPU | OpenCL/GGML | NMSE vs GGML |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, t_ocl, gflops, t_cpu, t_ggml, nmse in rows:
        lines.append(f"| {n} | {ms(t_ocl)} | {gflops:.1f} | {ms(t_cpu)} | {ms(t_ggml)} | "
                     f"{'n/a' if t_cpu is None else f'{t_cpu / t_ocl:.2f}'} | "
                     f"{'n/a' if t_ggml is None else f'{t_ggml / t_ocl:.2f}'} | "
                     f"{'n/a' if nmse is None else f'{nmse:.1e}'} |")
    text = "\n".join(lines)
    print(text)
    if args.write:  # the table is replaced; a "## Notes" section written by hand is kept
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "opencl.md")
        notes = ""
        if os.path.exists(path):
            with open(path) as f:
                old = f.read()
            notes = old[old.find("\n## Notes"):] if "\n## Notes" in old else ""
        with open(path, "w") as f:
            f.write("# OpenCL backend: Q4_K mul_mat\n\nWritten by `python bench/bench_opencl.py --write`.\n\n"
                    + text + "\n" + notes)


if __name__ == "__main__":
    main()
