"""``bench/load_serve.py`` at CI size (issue 43's load test): a ``lazyggml serve`` of the embedded
model with 4 slots, 60 requests twice, 12 at once (completions and chat, plain and streamed, 6 streams
closed early each round), every answer compared with its request's answer alone; afterwards no busy
slot, no leaked KV cell, flat memory. The script starts and stops the server itself, on loopback,
within its ``--timeout``.

Near-ties: greedy answers under load may differ from the answer alone where two tokens' logits are
within ~0.01 of each other, because a sequence's KV cells stop being in position order when other
slots free cells below them, and flash attention adds cells in cell order in an F16 accumulator
(GGML's VKQ16), so its logits move by up to ~0.07. The script classifies each mismatch from the
reference's own log-probabilities; this test lets near-ties pass the run (``--allow-near-ties``)
but marks itself xfail when any occurred, and fails on any other mismatch. When the KV cache keeps
each sequence's cells in position order, drop the flag: every answer must then be the same.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "load_serve.py"
REQUESTS, CONCURRENCY, PARALLEL, ROUNDS = 60, 12, 4, 2


def test_load_serve_small():
    cmd = [sys.executable, str(SCRIPT), "--requests", str(REQUESTS), "--concurrency", str(CONCURRENCY),
           "--parallel", str(PARALLEL), "--rounds", str(ROUNDS), "--max-tokens", "8", "--max-words", "8",
           "--seed", "43", "--threads", "2", "--timeout", "280", "--allow-near-ties"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=320, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("SUMMARY ")]
    assert r.returncode == 0 and lines, out[-6000:]
    s = json.loads(lines[-1][len("SUMMARY "):])
    assert s["ok"] and s["failures"] == 0, out[-6000:]
    assert s["requests"] == REQUESTS * ROUNDS and s["rounds"] == ROUNDS and s["parallel"] == PARALLEL
    assert s["errors"] == 0 and s["real_mismatches"] == 0
    assert s["closed"] == ROUNDS * round(REQUESTS * 0.1)          # --cancel-share 0.1
    assert s["cancelled"] + s["server_finished_first"] == s["closed"]
    assert s["kv_leak"] == [0] * ROUNDS
    assert s["output_tokens"] > 0 and s["output_tok_s"] > 0
    assert s["ttft_p50_ms"] is not None and s["ttft_p50_ms"] <= s["ttft_p95_ms"]
    assert None not in s["rss_mb"] and (s["rss_growth_mb"] < 20 or s["rss_growth_pct"] < 5)
    if s["near_ties"]:
        pytest.xfail(f"{s['near_ties']} of {s['requests']} answers differ from their answer alone at a near-tie of "
                     f"the logits (KV cells out of position order; see the module's docstring)")
