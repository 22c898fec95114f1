"""Start-up latency: from ``import lazyggml`` to the first generated token, cold and after warm-up.

Each measurement is a new Python process that runs ``lazyggml demo`` (the embedded default model)
through the CLI's own ``main``, with the clock started just before ``import lazyggml``: the CLI's
``first token: X.XX s`` line then counts the import, the model load, every kernel compiled or
loaded from the cache, the prompt and the first sampled token. The kernel cache is a fresh folder
(``LAZYGGML_CACHE_DIR``), so the numbers do not depend on what this machine ran before:

* **cold**: the empty cache; every kernel the demo needs is compiled on the way;
* **after warm-up**: the same cache after ``lazyggml warmup`` filled it (runs 1..N, median);
* the warm-up itself (cold) and ``lazyggml warmup --check`` are timed too.

``--backend cpu,cuda`` narrows the warm-up to those backends and ``--ngl 99`` offloads the demo's
layers (``-ngl``), for the GPU path. ``--command graph-demo`` measures ``lazyggml graph-demo``
instead (its ``total: X.XX s`` line), for trees where the demo model is not there yet. The table is printed as Markdown; ``--out`` also
writes it to a file (bench/results/startup.md holds the committed one).

    python bench/bench_startup.py [--runs 5] [--command demo|graph-demo] [--jobs 2]
                                  [--backend cpu,cuda] [--ngl 99] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

DRIVER = """
import sys, time
t0 = time.perf_counter()
import lazyggml.cli as cli
cli._T0 = t0   # count from before `import lazyggml`
sys.exit(cli.main(sys.argv[1:]))
"""

COMMANDS = {
    # the CLI line that carries the time from the clock's start, and the arguments
    "demo": (r"^first token: ([\d.]+) s$", ["demo", "-n", "4", "--seed", "0"]),
    "graph-demo": (r"^total: ([\d.]+) s from start$", ["graph-demo"]),
}


def run(args, env, pattern=None, ok=(0,)):
    """Run the CLI in a new process; (seconds matched by ``pattern`` or None, wall seconds, stdout)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", DRIVER, *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode not in ok:
        sys.exit(f"`lazyggml {' '.join(args)}` failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    m = re.search(pattern, r.stdout, re.M) if pattern else None
    if pattern and not m:
        sys.exit(f"no line matching {pattern!r} in the output of `lazyggml {' '.join(args)}`:\n{r.stdout}")
    return (float(m.group(1)) if m else None), wall, r.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5, help="warm runs (the median is reported)")
    p.add_argument("--command", choices=sorted(COMMANDS), default="demo")
    p.add_argument("--jobs", type=int, default=1, help="processes for the warm-up")
    p.add_argument("--backend", help="warm up only these backends (warmup's --backend)")
    p.add_argument("--ngl", type=int, help="layers the demo offloads (demo's -ngl)")
    p.add_argument("--out", help="also write the table to this file")
    a = p.parse_args()
    pattern, cmd = COMMANDS[a.command]
    if a.ngl is not None:
        cmd = cmd + ["-ngl", str(a.ngl)]
    narrow = ["--backend", a.backend] if a.backend else []
    warmup, check = ["warmup", "--jobs", str(a.jobs), *narrow], ["warmup", *narrow, "--check"]

    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, LAZYGGML_CACHE_DIR=cache)
        env.pop("NUMBA_CACHE_DIR", None)
        _, python_s, _ = run(["info"], env)  # also builds the OpenCL program, if any, outside the timings
        cold, cold_wall, _ = run(cmd, env, pattern)
        # a fresh cache again for the warm-up, so that it compiles everything itself
        for entry in os.listdir(cache):
            shutil.rmtree(os.path.join(cache, entry))
        _, warm_s, out = run(warmup, env)
        counts = re.search(r"^hits=(\d+) misses=(\d+)$", out, re.M).group(0)
        _, check_s, check_out = run(check, env, ok=(0, 1))   # 1: something would compile
        check_counts = re.search(r"^hits=(\d+) misses=(\d+)$", check_out, re.M).group(0)
        warm = [run(cmd, env, pattern) for _ in range(a.runs)]

    first = [w[0] for w in warm]
    walls = [w[1] for w in warm]
    options = (f" --backend {a.backend}" if a.backend else "") + (f" --ngl {a.ngl}" if a.ngl is not None else "")
    label = {"demo": "`lazyggml demo`: import to first token", "graph-demo": "`lazyggml graph-demo`: import to end"}
    lines = [
        f"# Start-up time: {label[a.command]}",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; `python bench/bench_startup.py --command {a.command} --runs {a.runs}"
        f"{f' --jobs {a.jobs}' if a.jobs > 1 else ''}{options}`. Each row is a new process; the clock starts just "
        f"before `import lazyggml`.",
        "",
        "| kernel cache | import to first token (s) | whole process (s) |"
        if a.command == "demo" else "| kernel cache | import to end of graph-demo (s) | whole process (s) |",
        "| --- | --- | --- |",
        f"| empty (cold: compiles every kernel it meets) | {cold:.2f} | {cold_wall:.2f} |",
        f"| after `lazyggml warmup`, median of {a.runs} | {statistics.median(first):.2f} "
        f"(min {min(first):.2f}, max {max(first):.2f}) | {statistics.median(walls):.2f} |",
        "",
        f"`lazyggml {' '.join(warmup)}` on the empty cache: {warm_s:.1f} s "
        f"(`{counts}`); then `lazyggml {' '.join(check)}`: {check_s:.1f} s (`{check_counts}`); "
        f"`lazyggml info` (a whole process: Python, `import lazyggml`, device discovery): {python_s:.2f} s.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
