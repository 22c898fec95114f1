"""Batched decoding of many sequences: llama.cpp's ``llama-batched-bench`` measure, lazyggml and
llama.cpp in the same run (issue 43).

    python bench/bench_batched.py                                   # 125M Q4_K_M, npp 512, ntg 128, B = 1..64
    python bench/bench_batched.py --npp 64 --ntg 16 --npl 1,2,4 --runs 1 --check
    python bench/bench_batched.py --model default --npp 32 --ntg 16 --npl 1,2,4   # the embedded 3.7M model
    python bench/bench_batched.py -ngl 99 --llama-batched-bench /tmp/llamacpp/build/bin/llama-batched-bench \\
        --model-dir /tmp/lazyggml-batched --out bench/results/batched.md        # on the GPU machine
    python bench/bench_batched.py --profile 4                       # also profile lazyggml's decode step at B=4

**The measure** (llama-batched-bench's, prompts not shared, its ``-pps`` off). For each B of
``--npl``: fill one batch with B prompts of ``--npp`` tokens, sequence j at positions 0..npp-1,
sequence after sequence, logits wanted for the batch's last token only (as llama-batched-bench
flags them); then, timed as ``t_pp``: clear the KV cache (its memory too) and decode the batch in
chunks of ``-b`` tokens (one ``llama_decode`` / ``Model.decode`` each, which cut a chunk into
micro-batches of ``-ub`` tokens), waiting for each. Then, timed as ``t_tg``: ``--ntg`` steps, each
one batch of B tokens (one per sequence, at position npp + i, logits wanted for all of them).
S_PP = B * npp / t_pp, S_TG = B * ntg / t_tg, S = B * (npp + ntg) / (t_pp + t_tg) tokens/s.

**Tokens**: fixed ids, never sampled (llama-batched-bench feeds fixed ids too, and sampling is not
part of its measure). ``--tokens random`` (the default with llama-cpp-python): each sequence's prompt
and step tokens are ids drawn from a generator seeded with ``--seed``, sequence j the same for every
B; ``--tokens zero``: every token is id 0, exactly what ``llama-batched-bench`` feeds (the default
when it runs, so that both engines decode the same ids). Both engines get the same ids. Speed of a
dense model does not depend on the ids; ``--check`` needs ``random`` (identical sequences would
hide a mix-up).

**The context**: ``-c`` = the largest B * (npp + ntg) rounded up to a multiple of 256 (what
llama-batched-bench needs: the sum over sequences, it skips a B that does not fit; llama.cpp pads
n_ctx to 256 itself). llama.cpp is given ``n_seq_max`` = the largest B (``-npl B`` when its binary
runs, one B per run) and by default its per-sequence KV streams (``kv_unified`` off, n_ctx split over
the sequences, llama-batched-bench's default; ``--kvu`` turns on its unified cache, ``-kvu``).
lazyggml has one unified cache of ``-c`` cells (its n_ctx is at most the model's training context: a B
that does not fit is skipped in both engines). The default model is therefore bench_generate.py's
125M shape (``BIG``: random Q4_K_M weights, seed 0) written with a training context of 65,536 (or
the context asked for, if larger) into ``--model-dir``, reused from there.

**The engines**, alternating per B (for each B: ``--warmup`` untimed runs of each, then ``--runs``
timed runs, llama.cpp then lazyggml each time; medians of t_pp and t_tg), with the same threads
(``--threads``), flash attention (``--fa``), ``-b``, ``-ub``, ``-ngl`` and file:

* lazyggml: ``lg.load_model(path, n_gpu_layers=NGL, n_ctx=C, n_threads=T, flash_attn=FA,
  n_batch=UB)``, ``lg.Batch``, ``Model.decode``, ``Model.reset``, in a child process of this
  interpreter that loads once and answers one run per request;
* llama.cpp, with ``--llama-batched-bench PATH`` (built on the GPU machine by
  ``../shared/tools/llama-cpp-anchor build``): the binary itself, one process per run, ``-m -c -b -ub
  -npp -ntg -npl B -fa -t -ngl`` (and ``-kvu``), its table parsed (times from its S columns, which
  keep more digits);
* llama.cpp otherwise: llama-cpp-python's low-level API in a child process (``--llama-python``, by
  default this interpreter: see bench_generate.py), the same loop as the binary's:
  ``llama_model_load_from_file``, ``llama_init_from_model`` (n_ctx, n_batch, n_ubatch, n_seq_max,
  n_threads, n_threads_batch, flash_attn_type, kv_unified), ``llama_memory_clear``, ``llama_decode``
  on views of one batch, ``llama_synchronize`` after each; logits are not read (the binary does not).

``--check`` (lazyggml, in this process, before the timed runs; it exits non-zero on a failure): at
each B, the logits of the first decode step (B rows) against each sequence run alone from an empty
cache (its prompt, then its first step token). On the CPU first in GGML's per-column configuration
(``repack=False``, tiled and llamafile orders off, as tests/test_batch.py), where every row must be
the same bits; then as shipped, where the repacked and tiled products' orders depend on the batch's
column count, so rounding differs (NMSE ~1e-4 to 1e-3 on the random 125M model): NMSE below 1e-2
(a row of another sequence is ~0.5-2 away). With ``-ngl``, the as-shipped comparison only.

``--profile B`` (lazyggml, in this process, after the timed runs): cProfile of the decode phase at B
(host time: Python, launches, and the wait for the device in the backend's synchronize), then one
step at B node by node, grouped by op, types and shapes as profile_gpu.py groups them: on a GPU its
GPU time per node (``profile_gpu.NodeTimer``), on the CPU each node computed and waited for through
the scheduler's eval callback (``Scheduler.set_eval_callback``; ~10-50 µs of each node's time is the
callback's): where the device's time goes.

The table also gives how many graphs lazyggml built (``GraphCache.alloc``) in a timed run's prompt
and decode phases: a new graph is built when a micro-batch's shape class (tokens, KV window, rows of
logits) is not among the kept ones.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from run_info import end_child  # noqa: E402

PAD = 256                 # llama.cpp pads n_ctx to this
N_CTX_TRAIN = 65536       # the default model's training context (room for B = 64 of 512 + 128 and more)
N_SEQ_MAX = 64            # lazyggml's sequences (models/kv_cache.py)
CHECK_NMSE = 1e-2        # as shipped, against a sequence alone (a mix-up of sequences: ~0.5-2)
PROTO = "@@ "             # the children's answer lines start with this (anything else on stdout is ignored)


def pad(n, to=PAD):
    return (n + to - 1) // to * to


def make_tokens(cfg):
    """(prompts (max B, npp), step tokens (max B, ntg)) as int32 arrays: the same in every engine."""
    shape_p, shape_g = (cfg["max_b"], cfg["npp"]), (cfg["max_b"], cfg["ntg"])
    if cfg["tokens"] == "zero":
        return np.zeros(shape_p, np.int32), np.zeros(shape_g, np.int32)
    rng = np.random.default_rng(cfg["seed"])
    lo = min(3, cfg["n_vocab"] - 1)      # above the usual specials of a SentencePiece vocabulary
    return (rng.integers(lo, cfg["n_vocab"], shape_p).astype(np.int32),
            rng.integers(lo, cfg["n_vocab"], shape_g).astype(np.int32))


# -- the measure: one engine's run at B -----------------------------------------------------------------
def measure(eng, B, npp, ntg, n_batch, between=None):
    """llama-batched-bench's loop for B sequences, prompts not shared: (t_pp, t_tg, the first decode
    step's output). ``eng``: ``fill_prompt(B)``, ``clear()``, ``decode(i0, n)`` (tokens i0..i0+n of
    the filled batch, waited for), ``fill_step(B, i)``; ``between()`` is called between the phases,
    off the clock."""
    n_pp = B * npp
    eng.fill_prompt(B)
    t0 = time.perf_counter()
    eng.clear()
    for i0 in range(0, n_pp, n_batch):
        eng.decode(i0, min(n_batch, n_pp - i0))
    t1 = time.perf_counter()
    if between:
        between()
    t1b = time.perf_counter()
    first = None
    for i in range(ntg):
        eng.fill_step(B, i)
        for i0 in range(0, B, n_batch):
            out = eng.decode(i0, min(n_batch, B - i0))
        if i == 0:
            first = out
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1b, first


class LazyEngine:
    """lazyggml: ``Model.decode`` of ``lg.Batch``es (the prompt's chunks built before the clock starts,
    as llama-batched-bench fills its batch before)."""

    def __init__(self, cfg):
        sys.path.insert(0, cfg["root"])
        import lazyggml as lg
        self.lg, self.cfg = lg, cfg
        self.m = lg.load_model(cfg["path"], n_gpu_layers=cfg["ngl"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
                               flash_attn=cfg["fa"], n_batch=cfg["ubatch"], repack=cfg.get("repack", True))
        self.prompts, self.gens = make_tokens(cfg)
        self.npp = cfg["npp"]
        self.chunks, self.step = {}, lg.Batch()
        self.builds = 0
        alloc = self.m.graphs.alloc

        def counted(*a, **k):
            self.builds += 1
            return alloc(*a, **k)
        self.m.graphs.alloc = counted
        self.info = {"version": lg.__version__, "n_ctx": self.m.n_ctx, "n_batch": self.m.n_batch,
                     "flash_attn": self.m.flash_attn}

    def fill_prompt(self, B, seqs=None):
        """The prompt batch of sequences ``seqs`` (default 0..B-1), sequence ``k`` of the batch given
        sequence id k, cut into ``-b`` chunks (each a Batch)."""
        seqs = range(B) if seqs is None else seqs
        npp, nb = self.npp, self.cfg["batch"]
        tokens = self.prompts[list(seqs)].ravel()
        n = len(tokens)
        pos = np.tile(np.arange(npp), len(seqs))
        sid = np.repeat(np.arange(len(seqs)), npp)
        want = np.zeros(n, bool)
        want[-1] = True
        self.chunks = {i0: self.lg.Batch(tokens[i0:i0 + nb], pos[i0:i0 + nb], sid[i0:i0 + nb], want[i0:i0 + nb])
                       for i0 in range(0, n, nb)}
        self.mode = "prompt"

    def clear(self):
        self.m.reset()

    def fill_step(self, B, i, seqs=None):
        seqs = range(B) if seqs is None else seqs
        b = self.step
        b.clear()
        for k, s in enumerate(seqs):
            b.add(int(self.gens[s, i]), self.npp + i, k, True)
        self.mode = "step"

    def decode(self, i0, n):
        if self.mode == "prompt":
            return self.m.decode(self.chunks[i0])
        if i0 == 0 and n == len(self.step):
            return self.m.decode(self.step)
        s = self.step
        return self.m.decode(self.lg.Batch(s.tokens[i0:i0 + n], s.pos[i0:i0 + n], s.seq_id[i0:i0 + n],
                                           s.logits[i0:i0 + n]))

    def run(self, B):
        marks = [self.builds]
        t_pp, t_tg, self.first = measure(self, B, self.npp, self.cfg["ntg"], self.cfg["batch"],
                                         lambda: marks.append(self.builds))
        return dict(t_pp=t_pp, t_tg=t_tg, builds_pp=marks[1] - marks[0], builds_tg=self.builds - marks[1])

    def alone(self, s):
        """Sequence ``s`` alone from an empty cache (as sequence 0): its first step's logits."""
        self.fill_prompt(1, [s])
        self.clear()
        n_pp, nb = self.npp, self.cfg["batch"]
        for i0 in range(0, n_pp, nb):
            self.decode(i0, min(nb, n_pp - i0))
        self.fill_step(1, 0, [s])
        return self.decode(0, 1)[0]

    def check(self, B, refs):
        """The last run's first decode step (B rows) against each sequence alone."""
        got = self.first
        assert got.shape == (B, self.m.hp.n_vocab), got.shape
        res = dict(nmse=[], bits=0, argmax=0, other=None)
        for s in range(B):
            if s not in refs:
                refs[s] = self.alone(s)
            r, g = refs[s].astype(np.float64), got[s].astype(np.float64)
            res["nmse"].append(float(((g - r) ** 2).sum() / (r ** 2).sum()))
            res["bits"] += int(np.array_equal(got[s], refs[s]))
            res["argmax"] += int(got[s].argmax() == refs[s].argmax())
        if B > 1:   # what a mix-up would look like: a row against another sequence's run alone
            r, g = refs[1].astype(np.float64), got[0].astype(np.float64)
            res["other"] = float(((g - r) ** 2).sum() / (r ** 2).sum())
        res["max_nmse"] = max(res["nmse"])
        return res


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python's low-level API: one ``llama_batch`` over numpy arrays,
    decoded through views of it, as llama-batched-bench's ``decode_helper``."""

    def __init__(self, cfg):
        import llama_cpp as L
        self.L, self.cfg = L, cfg
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = cfg["ngl"]
        self.model = L.llama_model_load_from_file(cfg["path"].encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file failed for {cfg['path']}")
        cp = L.llama_context_default_params()
        cp.n_ctx = cfg["n_ctx"]
        cp.n_batch = cfg["batch"]
        cp.n_ubatch = cfg["ubatch"]
        cp.n_seq_max = cfg["max_b"]
        cp.n_threads = cp.n_threads_batch = cfg["threads"]
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg["fa"] else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.kv_unified = cfg["kvu"]
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.mem = L.llama_get_memory(self.ctx)
        self.prompts, self.gens = make_tokens(cfg)
        self.npp = cfg["npp"]
        n = max(cfg["max_b"] * self.npp, cfg["max_b"])
        self.tok, self.pos = np.zeros(n, np.int32), np.zeros(n, np.int32)
        self.nseq, self.sid = np.ones(n, np.int32), np.zeros(n, np.int32)
        self.sidptr = (self.sid.ctypes.data + 4 * np.arange(n)).astype(np.uint64)
        self.want = np.zeros(n, np.int8)
        self.info = {"version": L.__version__, "n_ctx": L.llama_n_ctx(self.ctx),
                     "system_info": L.llama_print_system_info().decode(errors="replace").strip()}

    def fill_prompt(self, B):
        n = B * self.npp
        self.tok[:n] = self.prompts[:B].ravel()
        self.pos[:n] = np.tile(np.arange(self.npp), B)
        self.sid[:n] = np.repeat(np.arange(B), self.npp)
        self.want[:n] = 0
        self.want[n - 1] = 1

    def clear(self):
        self.L.llama_memory_clear(self.mem, True)

    def fill_step(self, B, i):
        self.tok[:B] = self.gens[:B, i]
        self.pos[:B] = self.npp + i
        self.sid[:B] = np.arange(B)
        self.want[:B] = 1

    def decode(self, i0, n):
        L, P, c = self.L, ctypes.POINTER, ctypes
        view = L.llama_batch(n, c.cast(self.tok.ctypes.data + 4 * i0, P(c.c_int)), None,
                             c.cast(self.pos.ctypes.data + 4 * i0, P(c.c_int)),
                             c.cast(self.nseq.ctypes.data + 4 * i0, P(c.c_int)),
                             c.cast(self.sidptr.ctypes.data + 8 * i0, P(P(c.c_int))),
                             c.cast(self.want.ctypes.data + i0, P(c.c_byte)))
        ret = L.llama_decode(self.ctx, view)
        if ret != 0:
            raise RuntimeError(f"llama_decode failed ({ret}) on {n} tokens from {i0}")
        L.llama_synchronize(self.ctx)

    def run(self, B):
        t_pp, t_tg, _ = measure(self, B, self.cfg["npp"], self.cfg["ntg"], self.cfg["batch"])
        return dict(t_pp=t_pp, t_tg=t_tg)


def child_main(cfg):
    """One engine in this process: load, then answer ``run B`` lines on stdin."""
    def say(obj):
        print(PROTO + json.dumps(obj), flush=True)
    try:
        eng = (LlamaCppEngine if cfg["engine"] == "llama.cpp" else LazyEngine)(cfg)
    except Exception as e:
        say({"error": f"{cfg['engine']}: {e!r}"})
        return
    say(dict(ready=True, **eng.info))
    for line in sys.stdin:
        cmd, _, b = line.strip().partition(" ")
        if cmd != "run":
            break
        say(eng.run(int(b)))


class Child:
    """An engine in a child process (``python bench_batched.py --child CFG``), loaded once."""

    def __init__(self, python, cfg):
        self.err = tempfile.TemporaryFile(mode="w+")    # llama.cpp's log: not a pipe nobody drains
        self.p = subprocess.Popen([python, os.path.abspath(__file__), "--child", json.dumps(cfg)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                  bufsize=1, cwd=ROOT)
        self.info = self._read()
        if "error" in self.info:
            self.close()
            raise RuntimeError(self.info["error"])

    def _read(self):
        for line in self.p.stdout:
            if line.startswith(PROTO):
                return json.loads(line[len(PROTO):])
        self.err.seek(0)
        raise RuntimeError(f"the child exited ({self.p.wait()}):\n{self.err.read()[-4000:]}")

    def run(self, B):
        self.p.stdin.write(f"run {B}\n")
        self.p.stdin.flush()
        return self._read()

    def close(self):
        end_child(self.p, 60)
        self.err.close()


ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6)


class BinaryEngine:
    """llama.cpp's ``llama-batched-bench``: one process per run at one B, its table row parsed."""

    def __init__(self, exe, cfg):
        self.exe, self.cfg = exe, cfg
        self.env = dict(os.environ)
        if cfg["ngl"] > 0:
            self.env.setdefault("CUDA_VISIBLE_DEVICES", "0")
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, env=self.env)
        version = " ".join((r.stdout + r.stderr).split())
        self.info = {"version": version[:200] or "unknown"}

    def command(self, B):
        c = self.cfg
        cmd = [self.exe, "-m", c["path"], "-c", str(c["n_ctx"]), "-b", str(c["batch"]), "-ub", str(c["ubatch"]),
               "-npp", str(c["npp"]), "-ntg", str(c["ntg"]), "-npl", str(B), "-fa", "on" if c["fa"] else "off",
               "-t", str(c["threads"]), "-ngl", str(c["ngl"])]
        return cmd + (["-kvu"] if c["kvu"] else [])

    def run(self, B):
        cmd = self.command(B)
        r = subprocess.run(cmd, capture_output=True, text=True, env=self.env)
        rows = [m for m in (ROW.match(line.strip()) for line in (r.stdout + "\n" + r.stderr).splitlines()) if m]
        if r.returncode != 0 or not rows:
            raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode} without a table row:\n"
                               f"{(r.stdout + r.stderr)[-3000:]}")
        pp, tg, b, _, t_pp, s_pp, t_tg, s_tg = (float(x) for x in rows[-1].groups()[:8])
        assert (pp, tg, b) == (self.cfg["npp"], self.cfg["ntg"], B), rows[-1].group(0)
        # the speeds keep more digits than the times (%8.2f tok/s against %8.3f s)
        return dict(t_pp=B * pp / s_pp if s_pp else t_pp, t_tg=B * tg / s_tg if s_tg else t_tg)

    def close(self):
        pass


# -- the parent: models, runs, the table -----------------------------------------------------------------
def run_check(cfg, bs):
    """``--check``, in this process before the timed runs: at each B, lazyggml's first decode step
    against each sequence run alone. On the CPU first in GGML's per-column configuration (plain CPU
    buffers, tiled and llamafile orders off, as tests/test_batch.py): the same bits are promised;
    then as shipped, where the products' orders depend on the batch's column count: NMSE only.
    [(how, [(B, result)])]."""
    sys.path.insert(0, ROOT)
    from lazyggml.backends.cpu import matmul, tiled
    out = []
    for per_column in ((True, False) if cfg["ngl"] == 0 else (False,)):
        how = "per-column orders (bits promised)" if per_column else "as shipped"
        saved = tiled.TILED, matmul.LLAMAFILE
        if per_column:
            tiled.TILED = matmul.LLAMAFILE = False
        try:
            eng, refs, res = LazyEngine(dict(cfg, ntg=1, repack=not per_column)), {}, []
            for B in bs:
                eng.run(B)
                c = eng.check(B, refs)
                res.append((B, c))
                print(f"check, {how}, B={B}: {c['bits']}/{B} rows the same bits as the runs alone, max NMSE "
                      f"{c['max_nmse']:.2e}, {c['argmax']}/{B} the same argmax"
                      + (f"; a row against another sequence's run: NMSE {c['other']:.2f}" if c["other"] else ""),
                      flush=True)
            out.append((how, res))
            del eng
        finally:
            tiled.TILED, matmul.LLAMAFILE = saved
    return out


def resolve_model(args, n_ctx_needed):
    """(name, path) of ``--model``: a path, ``default`` (the embedded 3.7M model) or ``llama-125m``."""
    sys.path.insert(0, ROOT)
    if args.model == "default":
        from lazyggml.models import default_model_path
        return "default (3.7M)", str(default_model_path())
    if args.model != "llama-125m":
        if not os.path.exists(args.model):
            sys.exit(f"--model {args.model}: no such file (or: default, llama-125m)")
        return os.path.basename(args.model), args.model
    from bench_generate import BIG                   # bench_generate.py's 125M shape and seed
    ctx = max(N_CTX_TRAIN, pad(n_ctx_needed, 4096))
    kw = dict(BIG, n_ctx=ctx)
    d = args.model_dir
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"llama-125m-q4_k_m-seed{kw['seed']}-ctx{ctx}.gguf")
    if not os.path.exists(path):
        from lazyggml.testing import make_tiny_model
        t0 = time.perf_counter()
        make_tiny_model(path + ".part", **kw)
        os.replace(path + ".part", path)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return "llama-125m (Q4_K_M, random)", path


def gpu_name():
    try:
        return subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip() or None
    except OSError:
        return None


def fmt(x, digits=1):
    return "" if x is None else f"{x:,.{digits}f}"


def table(rows, args):
    lines = ["| B | npp | ntg | N_KV | llama.cpp S_PP | llama.cpp S_TG | llama.cpp S | lazyggml S_PP | lazyggml S_TG "
             "| lazyggml S | ratio PP / TG / S | lazyggml graphs built pp / tg |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        lc, lz = r.get("llama.cpp"), r["lazyggml"]
        ratio = " / ".join(f"{lz[k] / lc[k]:.2f}" for k in ("s_pp", "s_tg", "s")) if lc else ""
        lines.append(f"| {r['B']} | {args.npp} | {args.ntg} | {r['B'] * (args.npp + args.ntg)} | "
                     f"{fmt(lc and lc['s_pp'])} | {fmt(lc and lc['s_tg'])} | {fmt(lc and lc['s'])} | "
                     f"{fmt(lz['s_pp'])} | {fmt(lz['s_tg'])} | {fmt(lz['s'])} | {ratio} | "
                     f"{lz['builds_pp']} / {lz['builds_tg']} |")
    return "\n".join(lines)


def summarize(B, runs, args):
    t_pp = statistics.median(r["t_pp"] for r in runs)
    t_tg = statistics.median(r["t_tg"] for r in runs)
    out = dict(t_pp=t_pp, t_tg=t_tg, s_pp=B * args.npp / t_pp, s_tg=B * args.ntg / t_tg,
               s=B * (args.npp + args.ntg) / (t_pp + t_tg))
    if "builds_pp" in runs[0]:
        out.update(builds_pp=runs[-1]["builds_pp"], builds_tg=runs[-1]["builds_tg"])
    return out


def profile_nodes(eng, B, n_top=20):
    """One decode step of B tokens (the last step's again, once its cells are removed), node by node,
    grouped as profile_gpu.py groups them (``label``): on a CUDA backend its GPU time per node
    (``profile_gpu.NodeTimer``: events around each node, the host's launches not counted; it prints
    its table); on the CPU each node computed and waited for through the scheduler's eval callback.
    Returns the lines to print (the CPU's table, or none)."""
    from profile_gpu import NodeTimer, label
    last = eng.npp + eng.cfg["ntg"] - 1
    for k in range(B):
        eng.m.kv.seq_rm(k, last, -1)
    eng.fill_step(B, eng.cfg["ntg"] - 1)
    cuda = [b for b in eng.m.backends if type(b).__name__ == "CUDABackend"]
    if cuda:
        timer = NodeTimer(cuda[0])
        eng.decode(0, B)
        timer.report(f"One step at B={B}, GPU time per node on {cuda[0].name}")
        return []
    groups = {}
    clock = [0.0]

    def cb(t, ask):
        if not ask:
            now = time.perf_counter()
            n, sec = groups.get(label(t), (0, 0.0))
            groups[label(t)] = (n + 1, sec + now - clock[0])
            clock[0] = now
        return True

    graphs = eng.m.graphs
    scheds = [g.sched for g in (*graphs.prompt.values(), *graphs.decode.values())]
    for sc in scheds:
        sc.set_eval_callback(cb)
    try:
        clock[0] = t0 = time.perf_counter()
        eng.decode(0, B)
        total = time.perf_counter() - t0
    finally:
        for sc in scheds:
            sc.set_eval_callback(None)
    lines = [f"One step at B={B} node by node (each waited for, ~10-50 µs of which is the callback): {total * 1e3:.2f} ms"]
    for name, (n, sec) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:n_top]:
        lines.append(f"{sec * 1e3:9.3f} ms {n:5d}x {name}")
    return lines


def profile_decode(cfg, B, n_top=25):
    """cProfile lazyggml's decode phase at B (after an untimed run and a timed one), in this process:
    (a summary line, the top functions by own time)."""
    import cProfile
    import io
    import pstats
    eng = LazyEngine(cfg)
    eng.run(B)
    plain = eng.run(B)
    pr = cProfile.Profile()
    marks = []

    def start():
        marks.append(eng.builds)
        pr.enable()
    _, t_tg, _ = measure(eng, B, eng.npp, cfg["ntg"], cfg["batch"], start)
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(n_top)
    out.write("".join(f"\n{line}" for line in profile_nodes(eng, B)) + "\n")
    ntg = cfg["ntg"]
    head = (f"B={B}: decode phase {plain['t_tg'] / ntg * 1e3:.2f} ms/step without the profiler "
            f"({plain['builds_tg']} graphs built in its {ntg} steps), {t_tg / ntg * 1e3:.2f} ms/step under it "
            f"({eng.builds - marks[0]} graphs built)")
    return head, out.getvalue()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-125m", help="a GGUF path, 'llama-125m' (default: bench_generate's "
                    "125M shape, random Q4_K_M, written into --model-dir) or 'default' (the embedded 3.7M model)")
    ap.add_argument("--model-dir", default="/tmp/lazyggml-batched", help="where the random model is written and reused")
    ap.add_argument("--npp", type=int, default=512, help="prompt tokens per sequence (llama-batched-bench -npp)")
    ap.add_argument("--ntg", type=int, default=128, help="decode steps (llama-batched-bench -ntg)")
    ap.add_argument("--npl", default="1,2,4,8,16,32,64", help="comma-separated B: sequences decoded together (-npl)")
    ap.add_argument("-b", "--batch", type=int, default=2048, help="tokens per decode call (llama.cpp's n_batch, -b)")
    ap.add_argument("-ub", "--ubatch", type=int, default=512,
                    help="tokens per micro-batch (llama.cpp's n_ubatch, -ub; lazyggml's n_batch)")
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--fa", choices=("on", "off"), default="on", help="flash attention in both engines")
    ap.add_argument("-ngl", "--n-gpu-layers", dest="ngl", type=int, default=0)
    ap.add_argument("--kvu", action="store_true", help="llama.cpp's unified KV cache (-kvu; lazyggml's is always)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per engine and B (medians)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per engine and B before them")
    ap.add_argument("--tokens", choices=("random", "zero"),
                    help="fixed token ids: seeded random (default with llama-cpp-python) or all 0 "
                         "(llama-batched-bench's ids; the default when its binary runs)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--llama-batched-bench", metavar="PATH", help="llama.cpp's llama-batched-bench binary")
    ap.add_argument("--llama-python", help="interpreter with llama-cpp-python when no binary is given "
                    "('none': lazyggml alone)")
    ap.add_argument("--check", action="store_true",
                    help="lazyggml's first decode step at each B against each sequence run alone")
    ap.add_argument("--profile", type=int, default=0, metavar="B", help="also cProfile lazyggml's decode phase at B")
    ap.add_argument("--out", metavar="FILE", help="append the table, with date, machine, commit and command, to FILE")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(json.loads(args.child))

    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    from run_info import cpu_model, git_commit, sched_policy
    from bench_generate import find_llama_python, model_params

    bs = [int(x) for x in args.npl.split(",") if x.strip()]
    if not bs or min(bs) < 1 or min(args.npp, args.ntg, args.batch, args.ubatch, args.threads) < 1:
        sys.exit("--npl, --npp, --ntg, -b, -ub and --threads must be positive")
    tokens = args.tokens or ("zero" if args.llama_batched_bench else "random")
    if args.check and tokens == "zero":
        print("--check with --tokens zero: every sequence is the same, so a mix-up would not show")
    name, path = resolve_model(args, max(bs) * (args.npp + args.ntg))
    hp, n_params = model_params(path)
    skipped = [b for b in bs if b > N_SEQ_MAX or b * (args.npp + args.ntg) > hp.n_ctx_train]
    bs = [b for b in bs if b not in skipped]
    if skipped:
        print(f"skipping B = {', '.join(map(str, skipped))}: more than {N_SEQ_MAX} sequences, or B * (npp + ntg) "
              f"above the model's training context {hp.n_ctx_train} (lazyggml's largest n_ctx)")
    if not bs:
        sys.exit("nothing to run")
    n_ctx = min(pad(max(b * (args.npp + args.ntg) for b in bs)), hp.n_ctx_train)
    cfg = dict(path=os.path.abspath(path), root=ROOT, n_ctx=n_ctx, batch=args.batch, ubatch=args.ubatch,
               threads=args.threads, fa=args.fa == "on", ngl=args.ngl, kvu=args.kvu, npp=args.npp, ntg=args.ntg,
               max_b=max(bs), tokens=tokens, seed=args.seed, n_vocab=hp.n_vocab)
    print(f"{name}: {path} ({n_params / 1e6:.1f}M parameters, {hp.n_layer} layers, n_embd {hp.n_embd}, "
          f"n_vocab {hp.n_vocab}, n_ctx_train {hp.n_ctx_train}); -c {n_ctx}, -b {args.batch}, -ub {args.ubatch}, "
          f"{args.threads} threads, fa {args.fa}, ngl {args.ngl}, tokens {tokens}", flush=True)

    checks = run_check(cfg, bs) if args.check else []
    load0 = os.getloadavg()[0]
    engines = {}
    if args.llama_batched_bench:
        engines["llama.cpp"] = BinaryEngine(args.llama_batched_bench, cfg)
        llama_desc = f"llama-batched-bench ({args.llama_batched_bench}; {engines['llama.cpp'].info['version']})"
    else:
        python = find_llama_python(args.llama_python)
        llama_desc = "not run"
        if python:
            t0 = time.perf_counter()
            try:
                engines["llama.cpp"] = ch = Child(python, dict(cfg, engine="llama.cpp"))
                llama_desc = (f"llama-cpp-python {ch.info['version']} low-level API "
                              f"({'this interpreter' if python == sys.executable else python}), n_ctx "
                              f"{ch.info['n_ctx']}; {ch.info['system_info']}")
                print(f"llama.cpp: loaded in {time.perf_counter() - t0:.1f} s (n_ctx {ch.info['n_ctx']})", flush=True)
            except RuntimeError as e:
                print(f"llama.cpp: failed, reporting lazyggml alone: {e}")
    t0 = time.perf_counter()
    lazy = engines["lazyggml"] = Child(sys.executable, dict(cfg, engine="lazyggml"))
    print(f"lazyggml: loaded in {time.perf_counter() - t0:.1f} s (n_ctx {lazy.info['n_ctx']}, micro-batch "
          f"{lazy.info['n_batch']}, flash attention {lazy.info['flash_attn']})", flush=True)

    rows = []
    try:
        for B in bs:
            res = {e: [] for e in engines}
            for i in range(args.warmup + args.runs):
                for e, eng in engines.items():
                    time.sleep(0.3)       # let the other engine's threads go to sleep
                    r = eng.run(B)
                    if i < args.warmup:
                        continue
                    res[e].append(r)
                    print(f"B={B:3d} run {i - args.warmup + 1}/{args.runs} {e:9s}: S_PP {B * args.npp / r['t_pp']:9.1f}"
                          f" tok/s, S_TG {B * args.ntg / r['t_tg']:8.1f} tok/s"
                          + (f" ({r['builds_pp']} + {r['builds_tg']} graphs built)" if "builds_pp" in r else ""),
                          flush=True)
            rows.append(dict(B=B, **{e: summarize(B, rr, args) for e, rr in res.items()}))
    finally:
        for eng in engines.values():
            eng.close()
    load1 = os.getloadavg()[0]

    prof = None
    if args.profile:
        pb = args.profile
        if pb > N_SEQ_MAX or pb * (args.npp + args.ntg) > hp.n_ctx_train:
            sys.exit(f"--profile {pb}: more than {N_SEQ_MAX} sequences or more than the model's context")
        head, text = profile_decode(dict(cfg, max_b=max(max(bs), pb), n_ctx=max(n_ctx, min(pad(pb * (args.npp + args.ntg)),
                                                                                       hp.n_ctx_train))), pb)
        prof = head
        print(f"\ncProfile of lazyggml's decode phase: {head}\n{text}")

    gpu = gpu_name() if args.ngl > 0 else None
    cmd = "python " + " ".join([os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + [shlex.quote(a) for a in sys.argv[1:]])
    meta = [
        f"* date: {datetime.date.today().isoformat()}; commit: {git_commit()}",
        f"* machine: {cpu_model()}, {os.cpu_count()} logical CPUs" + (f"; GPU: {gpu}" if gpu else "")
        + f"; {args.threads} threads for both engines; scheduling {sched_policy()}; load average (1 min) "
        f"before/after {load0:.2f} / {load1:.2f}",
        f"* Python {platform.python_version()}, numba {__import__('numba').__version__}, lazyggml "
        f"{lazy.info['version']}; llama.cpp: {llama_desc}",
        f"* model: {name}, {os.path.basename(path)} ({n_params / 1e6:.1f}M parameters)",
        f"* llama-batched-bench's measure, prompts not shared: -c {n_ctx} -b {args.batch} -ub {args.ubatch} "
        f"-npp {args.npp} -ntg {args.ntg} -fa {args.fa} -t {args.threads} -ngl {args.ngl}"
        + (" -kvu" if args.kvu else " (llama.cpp: a KV stream per sequence, kv_unified off; lazyggml: one unified "
           "cache)") + f"; tokens: {tokens} fixed ids (not sampled); engines alternating per B, "
        f"{args.warmup} untimed + {args.runs} timed runs each, medians; ratio = lazyggml / llama.cpp",
    ]
    if checks:
        meta.append("* `--check`, lazyggml's first decode step against each sequence alone: "
                    + "; ".join(f"{how}: " + ", ".join(f"B={b} {c['bits']}/{b} rows the same bits, max NMSE "
                                                        f"{c['max_nmse']:.1e}" for b, c in res)
                                for how, res in checks))
    if prof:
        meta.append(f"* lazyggml decode profile (`--profile`): {prof}")
    text = "\n".join(meta) + "\n\n" + table(rows, args)
    print("\n" + text)
    if args.out:
        new = not os.path.exists(args.out) or os.path.getsize(args.out) == 0
        with open(args.out, "a") as f:
            if new:
                f.write("# Batched decoding: llama-batched-bench's measure, lazyggml and llama.cpp (issue 43)\n")
            f.write(f"\n## {datetime.date.today().isoformat()}, commit {git_commit()}: {name}, "
                    f"{args.threads} threads, fa {args.fa}, ngl {args.ngl}\n\nProduced by `{cmd}`\n\n{text}\n")
        print(f"\nappended to {args.out}")
    bad = [f"{how} B={b}" for how, res in checks for b, c in res
           if c["max_nmse"] >= CHECK_NMSE or how.startswith("per-column") and c["bits"] != b]
    if bad:
        sys.exit(f"check failed ({', '.join(bad)}): lazyggml's batched logits are not those of the runs alone")


if __name__ == "__main__":
    main()
