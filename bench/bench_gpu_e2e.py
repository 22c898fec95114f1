"""Whole models on one GPU, lazyggml against llama.cpp on the same GGUF files, in the same run (issue 17).

    python bench/bench_gpu_e2e.py --llama-bench /tmp/llamacpp/build/bin/llama-bench \
        --model-dir /tmp/e2e --models llama-1b,llama-8b --write bench/results/gpu_e2e.md

``llama-bench`` is built on the GPU machine with ``../shared/tools/llama-cpp-anchor build``. For each
model (``bench_multi_gpu.MODELS`` shapes, random Q4_K_M weights written once by
``lazyggml.testing.make_tiny_llama``) the engines alternate, ``--runs`` times each: llama-bench
(``-ngl 99 -p N_PROMPT -n N_GEN -d 0,N_PROMPT -ub N_BATCH -b N_PROMPT -r 1``) and then lazyggml
(every layer and the output on CUDA0, micro-batches of ``N_BATCH``; after one untimed warm-up:
reset, prefill ``N_PROMPT`` random tokens in one ``eval``, then ``N_GEN`` one-token decode steps;
reset, then ``N_GEN`` decode steps from the empty cache). Medians.

Decode is reported at two depths, as llama-bench measures it: ``tg`` from an empty KV cache
(llama-bench's ``tg64``, its default depth 0) and ``tg @ d`` after ``N_PROMPT`` tokens (its
``-d``), where every step's attention reads the whole prompt's keys and values.

The profile line splits a lazyggml decode token's wall time into **waiting on the GPU** (time
inside the CUDA backend's ``synchronize`` and its device-to-host copies, which block until the
stream drains) and **host** (everything else: Python building, splitting and launching), measured
over the timed decode steps. The host part is what the graph-reuse work must shrink; the GPU part
bounds what it can reach.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import lazyggml as lg  # noqa: E402
from bench_multi_gpu import model_args, model_path  # noqa: E402
from run_info import git_commit, write_table  # noqa: E402


def llama_bench(exe, path, args):
    """(prefill, decode at depth 0, decode at depth N_PROMPT) tok/s of one llama-bench repetition."""
    cmd = [exe, "-m", path, "-ngl", "99", "-p", str(args.n_prompt), "-n", str(args.n_gen), "-d", f"0,{args.n_prompt}",
           "-ub", str(args.n_batch), "-b", str(args.n_prompt), "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"}).stdout
    rows = json.loads(out)

    def ts(prompt, gen, depth):
        return next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt and r["n_gen"] == gen
                    and r.get("n_depth", 0) == depth)
    return ts(args.n_prompt, 0, 0), ts(0, args.n_gen, 0), ts(0, args.n_gen, args.n_prompt)


class WaitClock:
    """Adds up the seconds the host spends blocked on the GPU: in the CUDA backend's
    ``synchronize`` and in its buffers' device-to-host copies."""

    def __init__(self):
        from lazyggml.backends.cuda.backend import CUDABackend, CUDABuffer
        self.seconds = 0.0
        self._patched = [(CUDABackend, "synchronize"), (CUDABuffer, "get_tensor")]
        self._orig = [getattr(cls, name) for cls, name in self._patched]
        for (cls, name), orig in zip(self._patched, self._orig):
            setattr(cls, name, self._timed(orig))

    def _timed(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed

    def close(self):
        for (cls, name), orig in zip(self._patched, self._orig):
            setattr(cls, name, orig)


def lazyggml_run(model, args, rng, clock):
    """(prefill, decode at depth 0, decode at depth N_PROMPT) tok/s, and the decode wall and wait
    seconds at depth N_PROMPT, of one run."""
    model.reset()
    ids = rng.integers(0, model.hp.n_vocab, args.n_prompt + args.n_gen).tolist()
    t0 = time.perf_counter()
    model.eval(ids[:args.n_prompt], logits_all=False)
    t1 = time.perf_counter()
    w0 = clock.seconds
    for t in ids[args.n_prompt:]:
        model.eval([t], logits_all=False)
    t2 = time.perf_counter()
    wait = clock.seconds - w0
    model.reset()
    t3 = time.perf_counter()
    for t in ids[args.n_prompt:]:
        model.eval([t], logits_all=False)
    t4 = time.perf_counter()
    return args.n_prompt / (t1 - t0), args.n_gen / (t4 - t3), args.n_gen / (t2 - t1), t2 - t1, wait


def bench(name, args):
    path = model_path(name, args.model_dir, args.n_ctx)
    model = lg.load_model(path, n_gpu_layers=10**6, device="CUDA0", n_ctx=args.n_ctx, n_batch=args.n_batch)
    clock = WaitClock()
    rng = np.random.default_rng(1)
    lazyggml_run(model, args, rng, clock)               # warm-up: kernels loaded, graphs captured
    ours, theirs = [], []
    for _ in range(args.runs):
        theirs.append(llama_bench(args.llama_bench, path, args) if args.llama_bench else (float("nan"),) * 3)
        ours.append(lazyggml_run(model, args, rng, clock))
        print(name, "llama.cpp", theirs[-1], "lazyggml", ours[-1][:3], flush=True)
    clock.close()
    del model
    med = [statistics.median(x) for x in zip(*ours)]
    return dict(name=name, lcpp=[statistics.median(x) for x in zip(*theirs)], ours=med[:3],
                host_ms=(med[3] - med[4]) / args.n_gen * 1e3, wait_ms=med[4] / args.n_gen * 1e3)


def table(rows, args):
    gpu = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    d = args.n_prompt
    out = [f"* date: {datetime.date.today()}; commit: {git_commit()}; GPU: {gpu}",
           f"* prefill {d} tokens (micro-batch {args.n_batch}); decode {args.n_gen} tokens from an empty cache (tg) "
           f"and after the {d}-token prompt (tg @ d{d}); engines alternating, median of {args.runs}",
           "", f"| model | llama.cpp pp / tg / tg @ d{d} (tok/s) | lazyggml pp / tg / tg @ d{d} (tok/s) | ratio | "
           f"lazyggml ms/token @ d{d}: host / waiting on GPU |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lc, us = r["lcpp"], r["ours"]
        out.append(f"| {r['name']} | {' / '.join(f'{v:,.0f}' for v in lc)} | {' / '.join(f'{v:,.0f}' for v in us)} | "
                   f"{' / '.join(f'{o / t:.2f}' for o, t in zip(us, lc))} | {r['host_ms']:.2f} / {r['wait_ms']:.2f} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench executable (without it: lazyggml alone)")
    model_args(ap, "llama-1b,llama-8b", "/tmp/lazyggml-e2e")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--write", help="also write the table to this file")
    args = ap.parse_args()
    os.makedirs(args.model_dir, exist_ok=True)
    rows = [bench(name, args) for name in args.models.split(",")]
    text = table(rows, args)
    print(text)
    if args.write:
        write_table(args.write, "GPU end to end against llama.cpp (issue 17)", text)


if __name__ == "__main__":
    main()
