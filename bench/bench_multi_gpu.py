"""One GPU against two: a random LLaMA split over CUDA0 and CUDA1, its logits and its speed.

    python bench/bench_multi_gpu.py --model-dir /tmp/mg --write bench/results/multi_gpu.md

For each model (``--models``, shapes below; written once by ``lazyggml.testing.make_tiny_llama``
with the Q4_K_M mix into ``--model-dir``) it loads the model with every layer and the output
offloaded (``n_gpu_layers`` above the layer count) twice: on ``CUDA0`` alone, and on ``CUDA0,CUDA1``
(layers split by free memory, llama.cpp's rule; the scheduler then runs pipeline-parallel with 4
copy slots). Then:

* **correctness**: the logits of a ``--n-check``-token prompt (every position) and of 4 decode
  steps after it, two GPUs against one: the same kernels, so NMSE should be ~0 (issue: <= 1e-6);
* **speed**: after one untimed warm-up (compiles kernels, captures CUDA graphs), per run: reset,
  prefill ``--n-prompt`` random tokens in one ``eval`` (micro-batches of ``--n-batch``, queued
  without waiting between them), then ``--n-gen`` single-token decode steps; median of ``--runs``.

Prints a Markdown table (and writes it with ``--write``) with the placement, the split count and
whether peer access was enabled between the GPUs.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lazyggml as lg  # noqa: E402
from lazyggml.cli import _placement  # noqa: E402
from run_info import git_commit, write_table  # noqa: E402

MODELS = {   # make_tiny_llama shapes
    "llama-125m": dict(n_layer=12, n_embd=768, n_head=12, n_head_kv=4, n_ff=2048, n_vocab=32000),
    "llama-1b": dict(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=5632, n_vocab=32000),
    "llama-8b": dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=32000),
}


def nmse(a, b):
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


DISTINCT_ROWS = 64   # random rows per matrix, repeated: an 8B file in seconds; speed is the same


def model_path(name, model_dir, n_ctx):
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, f"{name}-q4_k_m-ctx{n_ctx}-r{DISTINCT_ROWS}.gguf")
    if not os.path.exists(path):
        from lazyggml.testing import make_tiny_llama
        t0 = time.perf_counter()
        make_tiny_llama(path + ".part", n_ctx=n_ctx, seed=0, distinct_rows=DISTINCT_ROWS, **MODELS[name])
        os.replace(path + ".part", path)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def speed(model, args, rng):
    prefill, decode = [], []
    for run in range(args.runs + 1):      # run 0: warm-up
        model.reset()
        ids = rng.integers(0, model.hp.n_vocab, args.n_prompt + args.n_gen).tolist()
        t0 = time.perf_counter()
        model.eval(ids[:args.n_prompt], logits_all=False)
        t1 = time.perf_counter()
        for t in ids[args.n_prompt:]:
            model.eval([t], logits_all=False)
        t2 = time.perf_counter()
        if run:
            prefill.append(args.n_prompt / (t1 - t0))
            decode.append(args.n_gen / (t2 - t1))
    return statistics.median(prefill), statistics.median(decode), prefill, decode


def bench(name, args, rows, checks):
    path = model_path(name, args.model_dir, args.n_ctx)
    rng = np.random.default_rng(1)
    check_ids = rng.integers(0, MODELS[name]["n_vocab"], args.n_check + 4).tolist()
    logits = {}
    for devices in ("CUDA0", "CUDA0,CUDA1"):
        model = lg.load_model(path, n_gpu_layers=10**6, device=devices, n_ctx=args.n_ctx, n_batch=args.n_batch)
        out = [model.eval(check_ids[:args.n_check])] + [model.eval([t]) for t in check_ids[args.n_check:]]
        logits[devices] = np.concatenate(out)
        p, d, ps, ds = speed(model, args, np.random.default_rng(2))
        peers = [f"{a.name}->{b.name}: {b.device._peers.get(a.device.index)}"
                 for a in model.backends[:-1] for b in model.backends[:-1] if a is not b]
        rows.append((name, devices, _placement(model), model.sched.n_splits, model.sched.n_copies,
                     "; ".join(peers) or "-", p, d, ps, ds))
        print(rows[-1], flush=True)
        del model
    checks.append((name, nmse(logits["CUDA0,CUDA1"], logits["CUDA0"]), logits["CUDA0"].shape))
    print(checks[-1], flush=True)


def table(rows, checks, args):
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip().replace("\n", "; ")
    commit = git_commit()
    out = [f"* date: {datetime.date.today()}; commit: {commit}; GPUs: {gpus}; Python {platform.python_version()}",
           f"* prompt {args.n_prompt} tokens in micro-batches of {args.n_batch}, then {args.n_gen} decode "
           f"steps; n_ctx {args.n_ctx}; median of {args.runs} runs after a warm-up",
           "", "| model | devices | placement | splits | copy slots | peer access | prefill tok/s | "
           "decode tok/s | runs: prefill / decode |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, devs, place, ns, nc, peers, p, d, ps, ds in rows:
        runs = ", ".join(f"{x:.0f}" for x in ps) + " / " + ", ".join(f"{x:.0f}" for x in ds)
        out.append(f"| {name} | {devs} | {place} | {ns} | {nc} | {peers} | {p:,.1f} | {d:,.1f} | {runs} |")
    out += ["", "| model | logits compared | NMSE two GPUs vs one |", "| --- | --- | --- |"]
    out += [f"| {name} | {shape[0]} positions x {shape[1]} | {e:.2e} |" for name, e, shape in checks]
    return "\n".join(out)


def model_args(ap, models, model_dir):
    """The arguments the GPU benchmarks share: which ``MODELS``, where their files go, how long."""
    ap.add_argument("--models", default=models)
    ap.add_argument("--model-dir", default=model_dir)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-prompt", type=int, default=2048)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=64)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(ap, "llama-125m,llama-1b", "/tmp/lazyggml-multi-gpu")
    ap.add_argument("--n-check", type=int, default=300)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--write", help="also write the table to this file")
    args = ap.parse_args()
    os.makedirs(args.model_dir, exist_ok=True)
    names = [d.name for d in (lg.dev_get(i) for i in range(lg.dev_count())) if d.name.startswith("CUDA")]
    if len(names) < 2:
        sys.exit(f"need two CUDA devices, found {names}")
    rows, checks = [], []
    for name in args.models.split(","):
        bench(name, args, rows, checks)
    text = table(rows, checks, args)
    print(text)
    if args.write:
        write_table(args.write, "One GPU against two (issue 10)", text)


if __name__ == "__main__":
    main()
