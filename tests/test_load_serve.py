"""``bench/load_serve.py`` at CI size (issue 43's load test): a ``lazyggml serve`` of the embedded
model with 4 slots, 60 requests twice, 12 at once (completions and chat, plain and streamed, 6 streams
closed early each round), every answer compared with its request's answer alone; afterwards no busy
slot, no leaked KV cell, flat memory. The script starts and stops the server itself, on loopback,
within its ``--timeout``.

The server runs with ``--batch-invariant`` and each slot has its own range of KV cells, so a
token's logits do not depend on what else its batch holds: every answer must be its answer alone,
bit for bit (no near-tie allowance). The script still classifies a mismatch (a near-tie of the
logits, or not) to say where to look.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "load_serve.py"
REQUESTS, CONCURRENCY, PARALLEL, ROUNDS = 60, 12, 4, 2


def test_load_serve_small():
    cmd = [sys.executable, str(SCRIPT), "--requests", str(REQUESTS), "--concurrency", str(CONCURRENCY),
           "--parallel", str(PARALLEL), "--rounds", str(ROUNDS), "--max-tokens", "8", "--max-words", "8",
           "--seed", "43", "--threads", "2", "--timeout", "280"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=320, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("SUMMARY ")]
    assert r.returncode == 0 and lines, out[-6000:]
    s = json.loads(lines[-1][len("SUMMARY "):])
    assert s["ok"] and s["failures"] == 0, out[-6000:]
    assert s["requests"] == REQUESTS * ROUNDS and s["rounds"] == ROUNDS and s["parallel"] == PARALLEL
    assert s["errors"] == 0 and s["mismatches"] == 0
    assert s["closed"] == ROUNDS * round(REQUESTS * 0.1)          # --cancel-share 0.1
    assert s["cancelled"] + s["server_finished_first"] == s["closed"]
    assert s["kv_leak"] == [0] * ROUNDS
    assert s["output_tokens"] > 0 and s["output_tok_s"] > 0
    assert s["ttft_p50_ms"] is not None and s["ttft_p50_ms"] <= s["ttft_p95_ms"]
    assert None not in s["rss_mb"] and (s["rss_growth_mb"] < 20 or s["rss_growth_pct"] < 5)
