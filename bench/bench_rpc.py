"""GGML's RPC protocol over loopback: a model split between the local CPU and a remote device,
against the whole model on the local CPU.

    python bench/bench_rpc.py                                   # both models, 5 runs, table on stdout
    python bench/bench_rpc.py --write bench/results/rpc.md

Configurations, all driven from this process (the client, ``--threads`` 2):

* ``local``: every layer on the local CPU backend;
* ``split, lazyggml server``: the last half of the repeating layers (``-ngl n_layer/2``) on the CPU
  device of ``lazyggml rpc-server`` (a child process, ``--threads``) over 127.0.0.1;
* ``split, llama.cpp server``: the same on llama.cpp's own RPC server (GGML's CPU device; needs
  llama-cpp-python built with ``CMAKE_ARGS=-DGGML_RPC=ON``, else the row is left out).

Per configuration: prefill (128 random token ids in one ``eval``) and decode (64 single-token evals)
tok/s, the median of ``--runs`` runs with the configurations alternating; and per decode step what
crossed the RPC connection (the client's counters: bytes sent and received, and round trips, the
commands that waited for a reply). On a one-machine loopback the client and the server take turns
(a pipeline of one stage each), so a split step costs the local step plus the wire plus each side's
per-graph overheads; docs/distributed.md turns the per-step figures into predictions for real links.

Models: ``default`` (the embedded 3.7M model) and ``llama-125m`` (bench_generate.py's random 125M
Q4_K_M model, written once into ``--model-dir``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lazyggml as lg  # noqa: E402
from bench_generate import BIG  # noqa: E402
from run_info import cpu_model, git_commit, sched_policy, write_table  # noqa: E402
from lazyggml.backends.rpc.client import RPCBackend  # noqa: E402
from lazyggml.testing import RPCServerProcess, make_tiny_model  # noqa: E402

N_CTX = 512


def model_path(name, model_dir):
    if name == "default":
        return os.path.join(ROOT, "lazyggml", "data", "default.gguf")
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, "llama-125m-q4_k_m.gguf")
    if not os.path.exists(path):
        make_tiny_model(path, **BIG)
    return path


def channel_of(model):
    """The RPC connection of a split model (None for a local one)."""
    return next((b.server.channel for b in model.backends if isinstance(b, RPCBackend)), None)


def one_run(model, prompt, gen):
    model.reset()
    t0 = time.perf_counter()
    model.eval(prompt, logits_all=False)
    t1 = time.perf_counter()
    ch = channel_of(model)
    before = (ch.bytes_sent, ch.bytes_received, ch.round_trips) if ch else (0, 0, 0)
    t2 = time.perf_counter()
    for tok in gen:
        model.eval([tok], logits_all=False)
    t3 = time.perf_counter()
    after = (ch.bytes_sent, ch.bytes_received, ch.round_trips) if ch else (0, 0, 0)
    wire = [(a - b) / len(gen) for a, b in zip(after, before)]
    return t1 - t0, t3 - t2, wire


def bench_model(name, path, args, servers):
    hp = lg.load_model(path, n_ctx=8).hp
    ngl = hp.n_layer // 2
    models = {"local": lg.load_model(path, n_ctx=min(N_CTX, hp.n_ctx_train), n_threads=args.threads)}
    for engine, srv in servers.items():
        models[f"split, {engine} server"] = lg.load_model(path, n_ctx=min(N_CTX, hp.n_ctx_train), n_threads=args.threads,
                                                          n_gpu_layers=ngl, device=lg.rpc_device(srv.endpoint))
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, hp.n_vocab, args.n_prompt).tolist()
    gen = rng.integers(3, hp.n_vocab, args.n_gen).tolist()
    for m in models.values():   # warm-up: every kernel compiled, every graph shape seen
        one_run(m, prompt, gen[:8])
    res = {k: ([], [], None) for k in models}
    for r in range(args.runs):
        for k, m in models.items():
            pre, dec, wire = one_run(m, prompt, gen)
            res[k][0].append(pre)
            res[k][1].append(dec)
            res[k] = (res[k][0], res[k][1], wire)
            print(f"  {name} run {r + 1}/{args.runs} {k:26s}: prefill {args.n_prompt / pre:8.1f} tok/s, "
                  f"decode {args.n_gen / dec:7.1f} tok/s", file=sys.stderr)
    rows = []
    base = statistics.median(res["local"][1])
    for k, (pre, dec, wire) in res.items():
        d = statistics.median(dec)
        rows.append(f"| {name} ({hp.n_layer} layers, n_embd {hp.n_embd}) | {k} | {ngl if k != 'local' else 0} | "
                    f"{args.n_prompt / statistics.median(pre):,.1f} | {args.n_gen / d:,.1f} | "
                    f"{(d - base) / args.n_gen * 1e6:+,.0f} | "
                    + (f"{wire[0]:,.0f} / {wire[1]:,.0f} | {wire[2]:.1f} |" if k != "local" else "- | - |"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--models", default="default,llama-125m")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--write", default=None)
    args = ap.parse_args()
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="lazyggml-bench-rpc-")
    servers = {"lazyggml": RPCServerProcess("lazyggml", threads=args.threads)}
    try:
        servers["llama.cpp"] = RPCServerProcess("llama.cpp", threads=args.threads)
    except (RuntimeError, OSError) as e:
        print(f"llama.cpp's RPC server is not available ({e}); its rows are left out", file=sys.stderr)
    try:
        rows = []
        for name in args.models.split(","):
            rows += bench_model(name, model_path(name, model_dir), args, servers)
    finally:
        for s in servers.values():
            s.kill()
    text = "\n".join([
        f"* date: {datetime.date.today().isoformat()}",
        f"* commit: {git_commit()}",
        f"* machine: {cpu_model()}, {os.cpu_count()} logical CPUs; {args.threads} threads for the client and "
        f"for each server; Python {platform.python_version()}",
        f"* scheduling: {sched_policy()}",
        f"* prefill: {args.n_prompt} random token ids in one eval; decode: {args.n_gen} single-token evals; "
        f"median of {args.runs} runs, configurations alternating; the wire figures are per decode step",
        "",
        "| model | configuration | layers remote | prefill tok/s | decode tok/s | decode step vs local (µs) "
        "| bytes sent / received per step | round trips per step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows])
    print(text)
    if args.write:
        write_table(args.write, "RPC over loopback: a split model against the local CPU", text)


if __name__ == "__main__":
    main()
