"""Serving many clients: ``lazyggml serve`` and llama.cpp's ``llama-server`` on the same file, N
concurrent streaming clients each (issue 43).

    python bench/bench_serve.py                                  # the 125M Q4_K_M of bench_batched.py, N = 1, 8
    python bench/bench_serve.py --clients 1,8,32 -ngl 99 --llama-server /tmp/llamacpp/build/bin/llama-server \\
        --out bench/results/serve.md                             # on the GPU machine

**The measure.** For each N of ``--clients``: start each engine's server on 127.0.0.1 with ``-np N``
slots and a context of N * (prompt + answer) tokens (6 a prompt word; rounded up to 256), the same threads, flash
attention and ``-ngl``; N client threads then each send ``--requests`` streamed
``/v1/completions`` one after the other, every prompt of ``--prompt-words`` random words (seeded,
each client its own) and ``max_tokens`` = ``--max-tokens`` with ``ignore_eos`` (both servers take it),
so every answer has exactly that many tokens. Timed from the first request to the last answer's end:
aggregate output tok/s = tokens received / wall time; per request the time to the first token and
the gaps between tokens (inter-token latency), p50 and p95 over all. Engines alternate per N (llama.cpp
first), one server at a time; each server is stopped before the next starts.

Only loopback traffic, bounded counts, and every wait has a limit (``--timeout`` per server).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from run_info import cpu_model, git_commit  # noqa: E402

WORDS = ("the lord said unto moses and aaron speak to the children of israel saying this is the thing "
         "which the lord hath commanded when a man shall make a vow bread wine land house city king").split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """One server process on a free port; ``stop()`` ends it (terminate, then kill)."""

    def __init__(self, cmd, name):
        self.port = free_port()
        self.name = name
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([c.replace("{port}", str(self.port)) for c in cmd], stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited: {self.log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready within {timeout} s")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def stream_one(url, prompt, max_tokens, timeout):
    """One streamed completion: (token arrival times from the request's start, tokens)."""
    # logprobs 0: a chunk for every token, also one whose text is held back (an incomplete UTF-8
    # character of a random model's byte tokens), so each token's arrival is timed
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "logprobs": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    times = []
    try:
        r = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:500]!r}") from None
    with r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and (ev["choices"][0].get("text") or ev["choices"][0].get("logprobs")):
                times.append(time.perf_counter() - t0)
    return times


def run_clients(url, n, args, rng):
    prompts = [[" ".join(rng.choice(WORDS, args.prompt_words)) for _ in range(args.requests)] for _ in range(n)]

    def client(i):
        return [stream_one(url, p, args.max_tokens, args.timeout) for p in prompts[i]]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as ex:
        results = [r for f in [ex.submit(client, i) for i in range(n)] for r in f.result()]
    wall = time.perf_counter() - t0
    # a streamed chunk may carry more than one token's text (a UTF-8 character cut): count chunks,
    # and tokens as requested (ignore_eos: every answer has max_tokens)
    n_tok = len(results) * args.max_tokens
    ttft = [t[0] for t in results if t]
    itl = [b - a for t in results for a, b in zip(t, t[1:])]
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")  # noqa: E731
    return {"tok_s": n_tok / wall, "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
            "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95), "wall": wall}


def commands(args, n, ctx):
    common = ["-c", str(ctx), "-t", str(args.threads), "-ngl", str(args.n_gpu_layers), "-fa", args.fa]
    ours = [sys.executable, "-m", "lazyggml.cli", "serve", args.model, "--port", "{port}", "-np", str(n), *common]
    out = {"lazyggml": ours}
    if args.llama_server:
        out["llama.cpp"] = [args.llama_server, "-m", args.model, "--port", "{port}", "-np", str(n), *common,
                            "--no-webui", "--log-disable"]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file (default: bench_batched.py's 125M Q4_K_M)")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "lazyggml-batched"))
    p.add_argument("--clients", default="1,8", help="comma-separated N (default 1,8)")
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", "-t", type=int, default=2)
    p.add_argument("--fa", choices=("on", "off"), default="on")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (the competitor)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a server may take to start, a request to end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append the table (with date, machine, commit) to this file")
    args = p.parse_args(argv)
    if args.model is None:
        from bench_batched import resolve_model
        args.model = resolve_model(argparse.Namespace(model="llama-125m", model_dir=args.model_dir), 65536)[1]
    ns = [int(x) for x in args.clients.split(",")]
    rows = []
    for n in ns:
        ctx = -(-n * (6 * args.prompt_words + args.max_tokens + 16) // 256) * 256   # ~4 tokens a word here
        for name, cmd in commands(args, n, ctx).items():
            srv = ServerProc(cmd, name)
            try:
                srv.wait_ready(args.timeout)
                run_clients(srv.url, n, argparse.Namespace(**{**vars(args), "requests": 1, "max_tokens": 8}),
                            np.random.default_rng(args.seed + 1))          # warm-up: kernels, graphs
                r = run_clients(srv.url, n, args, np.random.default_rng(args.seed))
            finally:
                srv.stop()
            rows.append((n, name, r))
            print(f"N={n:3d} {name:9s} {r['tok_s']:8.1f} tok/s  TTFT p50/p95 {r['ttft_p50']:.0f}/{r['ttft_p95']:.0f} ms"
                  f"  ITL p50/p95 {r['itl_p50']:.1f}/{r['itl_p95']:.1f} ms", flush=True)
    lines = ["| N | engine | output tok/s | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) |", "| --- | --- | --- | --- | --- |"]
    for n, name, r in rows:
        lines.append(f"| {n} | {name} | {r['tok_s']:,.1f} | {r['ttft_p50']:.0f} / {r['ttft_p95']:.0f} | "
                     f"{r['itl_p50']:.1f} / {r['itl_p95']:.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        head = (f"\n## {datetime.date.today()}, {cpu_model()}, {args.threads} threads, -ngl {args.n_gpu_layers}, "
                f"commit {git_commit()}\n\n`{' '.join(sys.argv)}`\n\n")
        with open(args.out, "a") as f:
            f.write(head + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
