"""Where a GPU token goes (issue 17): per-node GPU time and host time of whole models on one GPU.

    python bench/profile_gpu.py --model-dir /tmp/e2e --models llama-1b,llama-8b

For each model (``bench_multi_gpu.MODELS`` shapes, every layer and the output on CUDA0), after a
prompt of ``--n-prompt`` tokens:

* **GPU time per node** of one decode step and of one prefill micro-batch (the prompt's last),
  run eagerly (CUDA graphs off) with a timing event before and after every node's launches,
  behind a kernel that holds the stream for HOLD_MS while the host queues them all (so host
  launch time is not counted).
  Nodes are grouped by op, types and shapes (the layers repeat), largest total first. "span" is
  the stream's time from the first node to the last.
* **GPU time of a replayed decode step**: the decode split timed with events around the CUDA
  graph launch, i.e. what the GPU needs per token when the host is out of the way.
* **GPU time per node inside the replayed decode graph**: the step is captured again with an
  event-record node (``CU_EVENT_RECORD_EXTERNAL``) after every node's launches, replayed, and
  each node is charged the time between its event and the previous one (its kernels plus the
  graph's launch gap before them). The events themselves cost a little; the total is printed
  beside the replay without them.
* **Host time of a prompt**: the whole prompt again from an empty cache (every micro-batch a graph
  not seen in that shape since the warm-up, so built, split and launched eagerly): wall time and
  host time (wall minus the time blocked on the GPU) per micro-batch, and a cProfile of it by own
  time, kernel launches counted.
* **Host time per decode token** with CUDA graphs on: wall time minus the time blocked on the GPU
  (``bench_gpu_e2e.WaitClock``), and a cProfile of the decode steps (top functions by own time).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import lazyggml as lg  # noqa: E402
from lazyggml.ops import op_desc  # noqa: E402
from lazyggml.types import type_name  # noqa: E402
from bench_gpu_e2e import WaitClock  # noqa: E402
from bench_multi_gpu import model_args, model_path  # noqa: E402


def label(node):
    """A node's group: op, source types and shapes (equal for every layer)."""
    srcs = " x ".join(f"{type_name(s.type)}{list(s.ne[:3])}" for s in node.src[:2] if s is not None)
    return f"{op_desc(node):<14} {srcs} -> {list(node.ne[:3])}"


HOLD_MS = 400
_hold = None


def _hold_kernel():
    from numba import cuda

    @cuda.jit
    def hold(ms):
        for _ in range(ms):
            cuda.nanosleep(1000000)
    return hold


class NodeTimer:
    """Times every node the CUDA backend runs eagerly, with events on its stream."""

    def __init__(self, backend):
        from numba import cuda
        global _hold
        if _hold is None:
            _hold = _hold_kernel()
        self.backend, self.cuda, self.marks = backend, cuda, []
        backend.use_graphs = False
        backend._run = self._run

    def _run(self, nodes):
        be, ev = self.backend, self.cuda.event
        be.q8_of = be.cells_of = None     # as the backend's own _run: nothing derived from a last run
        if not self.marks:   # hold the stream while the host queues everything: no launch gaps timed
            _hold[1, 1, be.stream](HOLD_MS)
        for fn, node in nodes:
            a, b = ev(timing=True), ev(timing=True)
            a.record(be.stream)
            fn(be, node)
            b.record(be.stream)
            self.marks.append((node, a, b))

    def report(self, title):
        self.backend.synchronize()
        groups = defaultdict(lambda: [0, 0.0])
        for node, a, b in self.marks:
            g = groups[label(node)]
            g[0] += 1
            g[1] += self.cuda.event_elapsed_time(a, b) * 1e3
        span = self.cuda.event_elapsed_time(self.marks[0][1], self.marks[-1][2]) * 1e3
        total = sum(g[1] for g in groups.values())
        print(f"\n{title}: {len(self.marks)} nodes, kernels {total / 1e3:.3f} ms, span {span / 1e3:.3f} ms")
        print(f"  {'us':>9} {'%':>5} {'n':>4} {'us/node':>8}  node")
        for name, (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"  {us:9.1f} {100 * us / total:5.1f} {n:4d} {us / n:8.1f}  {name}")
        self.marks = []
        del self.backend._run
        self.backend.use_graphs = True


class ReplayNodeTimer:
    """Per-node GPU time inside a replayed CUDA graph: capture with an external event after each node."""

    def __init__(self, backend, n_nodes_max=8192):
        from cuda.bindings import driver
        self.drv, self.backend = driver, backend
        flags = driver.CUevent_flags.CU_EVENT_DEFAULT
        with backend.device.context():
            self.events = [self._ok(driver.cuEventCreate(flags)) for _ in range(n_nodes_max + 1)]
        self.nodes = []
        backend._drop_graphs()
        self._orig = backend._run
        backend._run = self._run

    def _ok(self, res):
        if res[0] != self.drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(repr(res[0]))
        return res[1] if len(res) > 1 else None

    def _run(self, nodes):
        be, drv = self.backend, self.drv
        if not be._capturing:
            return self._orig(nodes)
        h = drv.CUstream(int(be.stream.handle))
        ext = drv.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL
        self.nodes = []
        be.q8_of = be.cells_of = None
        self._ok(drv.cuEventRecordWithFlags(self.events[0], h, ext))
        for fn, node in nodes:
            be.writes(node)
            fn(be, node)
            self.nodes.append(node)
            self._ok(drv.cuEventRecordWithFlags(self.events[len(self.nodes)], h, ext))

    def report(self, model, rng, title, n=8):
        """Replay the step n times; report the median per-node times of the groups."""
        per = defaultdict(list)
        totals = []
        for t in rng.integers(0, model.hp.n_vocab, n + 2).tolist():
            model.eval([t], logits_all=False)       # first: eager (plan changed?) / capture
            self.backend.synchronize()
            if not self.nodes:
                continue
            ts = [self._ok(self.drv.cuEventElapsedTime(self.events[i], self.events[i + 1])) * 1e3
                  for i in range(len(self.nodes))]
            totals.append(sum(ts))
            groups = defaultdict(float)
            for node, us in zip(self.nodes, ts):
                groups[label(node)] += us
            for k, v in groups.items():
                per[k].append(v)
        del self.backend._run
        self.backend._drop_graphs()
        count = defaultdict(int)
        for node in self.nodes:
            count[label(node)] += 1
        total = float(np.median(totals))
        print(f"\n{title}: {len(self.nodes)} nodes, {total / 1e3:.3f} ms with an event after each node "
              f"(median of {len(totals)} replays)")
        print(f"  {'us':>9} {'%':>5} {'n':>4} {'us/node':>8}  node")
        med = {k: float(np.median(v)) for k, v in per.items()}
        for name, us in sorted(med.items(), key=lambda kv: -kv[1])[:30]:
            print(f"  {us:9.1f} {100 * us / total:5.1f} {count[name]:4d} {us / count[name]:8.1f}  {name}")


def replay_gpu_ms(model, rng, n):
    """GPU milliseconds per decode step with the captured graph replayed (events around the split)."""
    from numba import cuda
    be = model.backends[0]
    orig = be.graph_compute
    spans = []

    def timed(g):
        a, b = cuda.event(timing=True), cuda.event(timing=True)
        a.record(be.stream)
        status = orig(g)
        b.record(be.stream)
        spans.append((a, b))
        return status

    be.graph_compute = timed
    for t in rng.integers(0, model.hp.n_vocab, n).tolist():
        model.eval([t], logits_all=False)
    del be.graph_compute
    return float(np.median([cuda.event_elapsed_time(a, b) for a, b in spans]))


def _top(prof, n):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    print("\n".join(s.getvalue().splitlines()[4:]))


def prefill_host(model, ids, args):
    from numba.cuda.dispatcher import _Kernel
    launches = [0]
    orig = _Kernel.launch

    def counted(self, *a, **k):
        launches[0] += 1
        return orig(self, *a, **k)

    model.reset()
    clock = WaitClock()
    _Kernel.launch = counted
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    model.eval(ids, logits_all=False)
    prof.disable()
    wall = time.perf_counter() - t0
    _Kernel.launch = orig
    clock.close()
    nmb = -(-len(ids) // args.n_batch)
    print(f"\nprefill of {len(ids)} under cProfile: wall {wall / nmb * 1e3:.1f} ms per micro-batch, host "
          f"{(wall - clock.seconds) / nmb * 1e3:.1f} ms, {launches[0] / nmb:.0f} kernel launches per micro-batch; "
          f"by own time:")
    _top(prof, args.top)


def profile(name, args):
    path = model_path(name, args.model_dir, args.n_ctx)
    model = lg.load_model(path, n_gpu_layers=10**6, device="CUDA0", n_ctx=args.n_ctx, n_batch=args.n_batch)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, model.hp.n_vocab, args.n_prompt).tolist()
    model.eval(ids, logits_all=False)                  # warm-up: kernels compiled, graphs captured
    for t in rng.integers(0, model.hp.n_vocab, 4).tolist():
        model.eval([t], logits_all=False)
    print(f"\n## {name}: prompt {args.n_prompt}, micro-batch {args.n_batch}")

    model.reset()
    nb = args.n_batch
    model.eval(ids[:-nb], logits_all=False)
    timer = NodeTimer(model.backends[0])
    model.eval(ids[-nb:], logits_all=False)
    timer.report(f"prefill micro-batch of {nb} (KV {args.n_prompt})")
    model.eval([ids[0]], logits_all=False)
    timer = NodeTimer(model.backends[0])
    model.eval([ids[1]], logits_all=False)
    timer.report(f"decode step, eager (KV {model.n_past})")

    prefill_host(model, ids, args)
    print(f"\ndecode step replayed: GPU {replay_gpu_ms(model, rng, 16):.3f} ms per token")
    ReplayNodeTimer(model.backends[0]).report(model, rng, f"decode step replayed, per node (KV {model.n_past})")
    clock = WaitClock()
    toks = rng.integers(0, model.hp.n_vocab, args.n_gen).tolist()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    for t in toks[:args.n_gen // 2]:
        model.eval([t], logits_all=False)
    t1 = time.perf_counter()
    w1 = clock.seconds
    prof.enable()
    for t in toks[args.n_gen // 2:]:
        model.eval([t], logits_all=False)
    prof.disable()
    clock.close()
    n = args.n_gen // 2
    print(f"decode wall {(t1 - t0) / n * 1e3:.3f} ms per token, host {((t1 - t0) - w1) / n * 1e3:.3f} ms "
          f"(not profiled); cProfile of {n} more steps, by own time:")
    _top(prof, args.top)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(ap, "llama-1b,llama-8b", "/tmp/lazyggml-e2e")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    for name in args.models.split(","):
        profile(name, args)


if __name__ == "__main__":
    main()
