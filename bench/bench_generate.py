"""Generation speed on the CPU: prefill and decode tokens/s of lazyggml, next to llama.cpp where present.

    python bench/bench_generate.py                       # both models, 3 runs, the table on stdout
    python bench/bench_generate.py --write bench/results/generate.md
    python bench/bench_generate.py --load 1 --write bench/results/generate_load1.md   # one busy process beside
    python bench/bench_generate.py --profile 20          # also cProfile 20 lazyggml decode steps

Models:

* ``default``: the embedded model, ``lazyggml/data/default.gguf`` (3.7M parameters, Q4_K_M mix);
* ``llama-125m``: a random-weight llama written by ``lazyggml.testing.make_tiny_llama`` with the
  Q4_K_M mix (Q4_K, Q6_K), or with every matrix in one type (``llama-125m:q5_0``, ``:q4_1``, ...): n_embd 768, 12 layers, 12 heads, 4 KV heads, n_ff 2048, n_vocab 32000
  (76M parameters in the layers, 125M with the embeddings and the output);
* ``moe-8x2``: a random-weight Qwen3-MoE (``make_tiny_model(arch="qwen3moe")``, Q4_K_M mix): n_embd
  512, 8 layers, 8 heads of 64, 4 KV heads, 8 experts of 768 of which each token uses 2, n_vocab 16000.
Random models are written once into ``--model-dir`` (a temporary folder unless given) and reused from there.

Each engine loads the model once with the same context, thread count (``--threads``, 2) and
attention (``--flash-attn``: ``on``, fused, the default of lazyggml and of llama.cpp's own tools;
``off``, llama-cpp-python's default), does
one untimed warm-up (a 128-token prefill and 8 decode steps, so that every kernel is compiled and
every graph shape has been seen once), then per run: reset the KV cache, prefill ``--n-prompt``
(128) random token ids in one ``eval`` call (timed: prefill tok/s = 128 / time), then decode
``--n-gen`` (64) random token ids one ``eval`` call each (timed together: decode tok/s = 64 / time).
Figures are the median of ``--runs`` (3) runs. Sampling is not timed; the token ids are the same for
both engines.

Each engine runs in a child process of its own that loads the model once and answers one run per
request, so the two engines' runs alternate (lazyggml, llama.cpp, lazyggml, ...), background load
hits both alike, and each process's memory is its engine's alone:

* lazyggml: ``lg.load_model(path, n_ctx=..., n_threads=..., flash_attn=...)``, ``model.eval(ids, logits_all=False)``
  (prefill goes in micro-batches of ``lazyggml.models.runner.N_BATCH`` tokens), ``model.reset()``,
  in this interpreter;
* llama.cpp: ``llama_cpp.Llama(path, n_ctx=..., n_threads=..., n_threads_batch=..., n_batch=128,
  logits_all=False, flash_attn=..., verbose=False)`` (llama-cpp-python, optional), ``llm.eval(ids)``,
  ``llm.reset()``, in ``--llama-python`` (by default this interpreter if it can ``import
  llama_cpp``, else ``/tmp/llvenv/bin/python`` or ``$LLAMA_CPP_PYTHON`` if those can). Without
  llama-cpp-python, lazyggml is reported alone.

Memory, from each child's ``/proc/self/status`` after its last run: peak RSS (``VmHWM``), and the
resident anonymous and file-backed parts (``RssAnon``, ``RssFile``). Weights used in place from the
mapped file count as file-backed; a copy of them would count as anonymous.

``--load N`` starts N busy processes (a Python loop each) before the timed runs and stops them
after: the machine a user shares with a compiler or a test suite.

n_ctx is ``min(512, the model's training context)`` for both (the embedded model was trained at 256).
Ratio = lazyggml tok/s / llama.cpp tok/s (> 1: lazyggml faster). Issue 19's targets: idle, decode
at least 1.0x on the 125M model and 0.8x on the embedded one, prefill at least 0.8x on both; with
``--load 1``, lazyggml keeps 40% of its idle decode speed on the 125M model and beats llama.cpp; peak
RSS at most 1.2x llama.cpp's.

Run it as a user runs lazyggml, with the normal scheduling policy (no ``chrt`` or other real-time
priority): on a loaded machine a descheduled worker thread stalls both engines' parallel regions,
and the alternating runs spread that over both alike. The scheduling policy in use is printed with
the results.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lazyggml as lg  # noqa: E402
from run_info import cpu_model, end_child, git_commit, sched_policy  # noqa: E402
from lazyggml.gguf_io import read_gguf  # noqa: E402
from lazyggml.models.hparams import HParams  # noqa: E402

N_CTX = 512
N_WARMUP_DECODE = 8
BIG = dict(n_layer=12, n_embd=768, n_head=12, n_head_kv=4, n_ff=2048, n_vocab=32000, n_ctx=512, seed=0)
# a small Qwen3-MoE: 8 experts of 768, 2 used per token (issue 20's MoE target)
MOE = dict(arch="qwen3moe", n_layer=8, n_embd=512, n_head=8, n_head_kv=4, head_dim=64, n_ff=1536, n_ff_exp=768,
           n_expert=8, n_expert_used=2, n_vocab=16000, n_ctx=512, seed=0)
RANDOM_MODELS = {"llama-125m": BIG, "moe-8x2": MOE}
DEFAULT_LLAMA_PYTHONS = ("/tmp/llvenv/bin/python",)

# One engine in a child process: loads the model, warms up, then one run per "run" line on stdin,
# answered by one JSON line with the run's times and the process's memory so far.
ENGINE_CHILD = r"""
import json, re, sys, time
cfg = json.loads(sys.argv[1])

def memory():
    with open("/proc/self/status") as f:
        s = f.read()
    return {k: int(re.search(k + r":\s+(\d+) kB", s).group(1)) * 1024 for k in ("VmHWM", "RssAnon", "RssFile")}

try:
    if cfg["engine"] == "llama.cpp":
        import llama_cpp
        llm = llama_cpp.Llama(cfg["path"], n_ctx=cfg["n_ctx"], n_threads=cfg["n_threads"],
                              n_threads_batch=cfg["n_threads"], n_batch=cfg["n_batch"], logits_all=False,
                              flash_attn=cfg["flash_attn"], verbose=False)
        reset, prefill, step = llm.reset, llm.eval, lambda tok: llm.eval([tok])
        info = {"version": llama_cpp.__version__,
                "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    else:
        sys.path.insert(0, cfg["root"])
        import lazyggml as lg
        m = lg.load_model(cfg["path"], n_ctx=cfg["n_ctx"], n_threads=cfg["n_threads"], flash_attn=cfg["flash_attn"])
        reset, prefill, step = m.reset, lambda ids: m.eval(ids, logits_all=False), lambda tok: m.eval([tok], logits_all=False)
        info = {"version": lg.__version__}
except Exception as e:
    print(json.dumps({"error": f"{cfg['engine']}: {e!r}"}), flush=True)
    sys.exit(0)
prompt, gen = cfg["prompt"], cfg["gen"]

def one_run(n_gen):
    reset()
    t0 = time.perf_counter()
    prefill(prompt)
    t1 = time.perf_counter()
    for tok in gen[:n_gen]:
        step(tok)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1

one_run(cfg["n_warmup_decode"])
print(json.dumps(dict(ready=True, **info)), flush=True)
for line in sys.stdin:
    if line.strip() != "run":
        break
    pre, dec = one_run(len(gen))
    print(json.dumps({"prefill_s": pre, "decode_s": dec, "memory": memory()}), flush=True)
"""


def can_import_llama_cpp(python):
    try:
        r = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def find_llama_python(explicit):
    """The interpreter to run llama.cpp with, or None (with the reason printed)."""
    if explicit:
        if explicit.lower() == "none":
            print("llama.cpp: skipped (--llama-python none)")
            return None
        if can_import_llama_cpp(explicit):
            return explicit
        print(f"llama.cpp: `import llama_cpp` fails in {explicit}; reporting lazyggml alone")
        return None
    try:
        import llama_cpp  # noqa: F401
        return sys.executable
    except Exception as e:  # ImportError, or a broken build
        print(f"llama.cpp: `import llama_cpp` fails in this interpreter ({sys.executable}: {e!r})")
    for python in ([os.environ["LLAMA_CPP_PYTHON"]] if os.environ.get("LLAMA_CPP_PYTHON") else []) + \
            list(DEFAULT_LLAMA_PYTHONS):
        if os.path.exists(python) and can_import_llama_cpp(python):
            print(f"llama.cpp: using llama-cpp-python from {python} in a child process")
            return python
    print("llama.cpp: no interpreter with llama-cpp-python found (--llama-python, $LLAMA_CPP_PYTHON, "
          f"{', '.join(DEFAULT_LLAMA_PYTHONS)}); reporting lazyggml alone")
    return None


class EngineChild:
    """One engine (``cfg["engine"]``: lazyggml or llama.cpp) in a child process of ``python``: loaded
    and warmed up once, one timed run per ``run()``."""

    def __init__(self, python, cfg):
        self.p = subprocess.Popen([python, "-c", ENGINE_CHILD, json.dumps(cfg)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.info = self._read()
        if "error" in self.info:
            raise RuntimeError(self.info["error"])
        self.memory = None

    def _read(self):
        line = self.p.stdout.readline()
        if not line:
            err = self.p.stderr.read()
            raise RuntimeError(f"the child exited ({self.p.wait()}):\n{err[-4000:]}")
        return json.loads(line)

    def run(self):
        self.p.stdin.write("run\n")
        self.p.stdin.flush()
        r = self._read()
        self.memory = r["memory"]
        return r["prefill_s"], r["decode_s"]

    def close(self):
        end_child(self.p, 30)


class Load:
    """``n`` busy processes (a loop each) beside the engines, as another program would be."""

    def __init__(self, n):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]

    def close(self):
        for p in self.procs:
            p.kill()
            p.wait()


def model_params(path):
    f = read_gguf(path)
    hp = HParams.from_metadata(f.metadata, str(path))
    n = sum(int(np.prod(t.ne)) for t in f.tensors.values())
    return hp, n


def bench_model(name, path, args, llama_python, rows):
    hp, n_params = model_params(path)
    n_ctx = min(N_CTX, hp.n_ctx_train)
    rng = np.random.default_rng(1234)
    # ids above the usual specials (0..2) of a SentencePiece vocabulary; any id is a valid input
    ids = rng.integers(3, hp.n_vocab, args.n_prompt + args.n_gen).tolist()
    cfg = dict(path=str(path), n_ctx=n_ctx, n_threads=args.threads, n_batch=args.n_prompt, root=ROOT,
               prompt=ids[:args.n_prompt], gen=ids[args.n_prompt:], n_warmup_decode=N_WARMUP_DECODE,
               flash_attn=args.flash_attn == "on")
    print(f"\n{name}: {path} ({n_params / 1e6:.1f}M parameters, {hp.n_layer} layers, n_embd {hp.n_embd}, "
          f"n_vocab {hp.n_vocab}), n_ctx {n_ctx}", flush=True)
    engines, llama_info = {}, None
    for engine, python in (("lazyggml", sys.executable), ("llama.cpp", llama_python)):
        if python is None:
            continue
        t0 = time.perf_counter()
        try:
            engines[engine] = child = EngineChild(python, dict(cfg, engine=engine))
        except RuntimeError as e:
            if engine == "lazyggml":
                raise
            print(f"  llama.cpp: failed, reporting lazyggml alone: {e}")
            continue
        if engine == "llama.cpp":
            llama_info = child.info
        print(f"  {engine}: loaded and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    times = {e: ([], []) for e in engines}
    load = Load(args.load)
    try:
        for i in range(args.runs):
            for e, eng in engines.items():
                time.sleep(0.3)   # let the other engine's worker threads go to sleep
                pre, dec = eng.run()
                times[e][0].append(pre)
                times[e][1].append(dec)
                print(f"  run {i + 1}/{args.runs} {e:9s}: prefill {args.n_prompt / pre:8.1f} tok/s, "
                      f"decode {args.n_gen / dec:7.1f} tok/s", flush=True)
    finally:
        load.close()
        for eng in engines.values():
            eng.close()
    res = {}
    for e, (pre, dec) in times.items():
        res[e] = dict(prefill=args.n_prompt / statistics.median(pre), decode=args.n_gen / statistics.median(dec),
                      prefill_runs=[args.n_prompt / t for t in pre], decode_runs=[args.n_gen / t for t in dec])
    for e in engines:
        r = res[e]
        ratio = None
        if e == "lazyggml" and "llama.cpp" in res:
            ratio = (r["prefill"] / res["llama.cpp"]["prefill"], r["decode"] / res["llama.cpp"]["decode"])
        rows.append(dict(model=f"{name} ({n_params / 1e6:.1f}M)", engine=e, prefill=r["prefill"],
                         decode=r["decode"], ratio=ratio, prefill_runs=r["prefill_runs"],
                         decode_runs=r["decode_runs"], memory=engines[e].memory))
    return llama_info


def profile_decode(path, args, n_steps):
    """cProfile ``n_steps`` lazyggml decode steps after a 128-token prefill (the decode graph already
    built, so no rebuild inside); (summary line, the top functions as pstats prints them)."""
    import cProfile
    import importlib
    import io
    import pstats
    from numba.core.dispatcher import Dispatcher
    hp, _ = model_params(path)
    m = lg.load_model(path, n_ctx=min(N_CTX, hp.n_ctx_train), n_threads=args.threads, flash_attn=args.flash_attn == "on")
    rng = np.random.default_rng(99)
    ids = rng.integers(3, hp.n_vocab, args.n_prompt + 1 + n_steps).tolist()
    gen = ids[args.n_prompt + 1:]

    def prefill():
        m.reset()
        m.eval(ids[:args.n_prompt], logits_all=False)
        m.eval([ids[args.n_prompt]], logits_all=False)    # builds the decode graph

    prefill()                                             # warm-up: compile, see the shapes
    for tok in gen:
        m.eval([tok], logits_all=False)
    prefill()
    t0 = time.perf_counter()
    for tok in gen:
        m.eval([tok], logits_all=False)
    plain = (time.perf_counter() - t0) / n_steps
    prefill()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for tok in gen:
        m.eval([tok], logits_all=False)
    pr.disable()
    prof = (time.perf_counter() - t0) / n_steps
    st = pstats.Stats(pr)
    # time inside Numba kernels: the entries that are Numba dispatchers of lazyggml.backends.cpu, or
    # their compiled entry points, which a CPU plan calls directly once bound (backends/cpu/backend.py)
    kernel_s = 0.0
    for (file, _, func), (_, _, tt, _, _) in st.stats.items():
        if file == "~" and func.startswith("<built-in method lazyggml.backends.cpu."):
            kernel_s += tt
        elif os.sep + os.path.join("lazyggml", "backends", "cpu") + os.sep in file:
            mod = importlib.import_module("lazyggml.backends.cpu." + os.path.basename(file)[:-3])
            if isinstance(getattr(mod, func, None), Dispatcher):
                kernel_s += tt
    (_, n_kv, _), step = next(reversed(m.graphs.decode.items()))   # the last decode step's graph
    summary = (f"{n_steps} decode steps (n_kv {n_kv}, {len(step.graph.nodes)} graph nodes): "
               f"{plain * 1e3:.2f} ms/step without the profiler, {prof * 1e3:.2f} ms/step under it, "
               f"of which {kernel_s / n_steps * 1e3:.2f} ms/step inside Numba kernels")
    out = io.StringIO()
    st.stream = out
    st.sort_stats("tottime").print_stats(25)
    return summary, out.getvalue()


def fmt_table(rows):
    lines = ["| model | engine | prefill tok/s | decode tok/s | ratio lazyggml/llama.cpp (prefill / decode) "
             "| peak RSS / anonymous / file-backed MB | runs: prefill / decode tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{r['ratio'][0]:.2f} / {r['ratio'][1]:.2f}" if r["ratio"] else ""
        mem = " / ".join(f"{r['memory'][k] / 2**20:.0f}" for k in ("VmHWM", "RssAnon", "RssFile"))
        runs = (", ".join(f"{x:.0f}" for x in r["prefill_runs"]) + " / "
                + ", ".join(f"{x:.1f}" for x in r["decode_runs"]))
        lines.append(f"| {r['model']} | {r['engine']} | {r['prefill']:,.1f} | {r['decode']:,.1f} | {ratio} | {mem} "
                     f"| {runs} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="N busy processes beside both engines during the timed runs (default 0: idle)")
    ap.add_argument("--models", default="default,llama-125m",
                    help="comma-separated: default, llama-125m (Q4_K_M), llama-125m:TYPE (every matrix TYPE, "
                         "e.g. q5_0), moe-8x2 (Q4_K_M)")
    ap.add_argument("--flash-attn", choices=("on", "off"), default="on",
                    help="both engines with fused attention (on: lazyggml's default and llama.cpp's -fa auto on "
                         "the CPU) or without (off: llama-cpp-python's default)")
    ap.add_argument("--model-dir", help="where to write (and reuse) the random 125M model")
    ap.add_argument("--llama-python", help="interpreter with llama-cpp-python ('none' to skip llama.cpp)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also cProfile N lazyggml decode steps on the last model")
    ap.add_argument("--write", metavar="FILE", help="also write the results as Markdown")
    args = ap.parse_args()
    if args.load < 0:
        sys.exit(f"--load {args.load}: the number of busy processes cannot be negative")

    load0 = os.getloadavg()[0]
    llama_python = find_llama_python(args.llama_python)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    rows, llama_info, last_path = [], None, None
    tmp = None
    for name in models:
        if name == "default":
            path = os.path.join(ROOT, "lazyggml", "data", "default.gguf")
        elif name.split(":")[0] in RANDOM_MODELS:
            if args.model_dir:
                os.makedirs(args.model_dir, exist_ok=True)
                d = args.model_dir
            else:
                tmp = tmp or tempfile.TemporaryDirectory(prefix="bench_generate_")
                d = tmp.name
            wtype = name.split(":")[1] if ":" in name else None     # e.g. llama-125m:q5_0
            mix = "q4_k_m" if wtype is None else wtype
            if wtype is not None and wtype.upper() not in lg.Type.__members__:
                sys.exit(f"unknown weight type {wtype!r} in model {name!r}; "
                         f"known: {', '.join(t.name.lower() for t in lg.types.WEIGHT_TYPES)}")
            types = None if wtype is None else {"*norm*": lg.F32, "*.weight": lg.Type[wtype.upper()]}
            kw = RANDOM_MODELS[name.split(":")[0]]
            path = os.path.join(d, f"{name.split(':')[0]}-{mix}-seed{kw['seed']}.gguf")
            if not os.path.exists(path):
                from lazyggml.testing import make_tiny_model
                t0 = time.perf_counter()
                make_tiny_model(path + ".part", types=types, **kw)
                os.replace(path + ".part", path)
                print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
        else:
            sys.exit(f"unknown model {name!r}")
        info = bench_model(name, path, args, llama_python, rows)
        llama_info = llama_info or info
        last_path = path

    prof = None
    if args.profile and last_path:
        summary, text = profile_decode(last_path, args, args.profile)
        prof = summary
        print(f"\ncProfile of lazyggml decode on {last_path}: {summary}\n{text}")
    if tmp is not None:
        tmp.cleanup()

    load1 = os.getloadavg()[0]
    table = fmt_table(rows)
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    if sched_policy().startswith("SCHED_RR"):
        cmd = f"chrt -r {os.sched_getparam(0).sched_priority} {cmd}"
    meta = [
        f"* date: {datetime.date.today().isoformat()}",
        f"* commit: {git_commit()} (the tree this table was measured on)",
        f"* machine: {cpu_model()}, {os.cpu_count()} logical CPUs; {args.threads} threads for both engines",
        f"* Python {platform.python_version()}, numba {__import__('numba').__version__}",
        "* llama.cpp: " + (f"llama-cpp-python {llama_info['version']} "
                           f"({'the interpreter of lazyggml' if llama_python == sys.executable else llama_python}); "
                           f"{llama_info['system_info']}" if llama_info else "not run (see the output: skipped, or "
                           "llama-cpp-python not importable)"),
        f"* scheduling: {sched_policy()}; load average (1 min) before/after: {load0:.2f} / {load1:.2f}; "
        f"{args.load} busy processes beside the engines (`--load`)",
        f"* prefill: {args.n_prompt} random token ids in one eval; decode: {args.n_gen} single-token evals "
        f"after it; median of {args.runs} runs, engines alternating; ratio = lazyggml tok/s / llama.cpp tok/s",
        f"* flash attention: {args.flash_attn} in both engines (`--flash-attn`)",
    ]
    if prof:
        meta.append(f"* lazyggml decode profile (`--profile`, {os.path.basename(last_path)}): {prof}")
    print("\n" + "\n".join(meta) + "\n\n" + table)
    if args.write:
        with open(args.write, "w") as f:
            f.write("# Generation speed on the CPU: lazyggml vs llama.cpp (same run, same threads)\n\n")
            f.write(f"Produced by `{cmd}`\n\n")
            f.write("\n".join(meta) + "\n\n" + table + "\n")
        print(f"\nwrote {args.write}")


if __name__ == "__main__":
    main()
