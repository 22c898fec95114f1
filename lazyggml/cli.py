"""The ``lazyggml`` command line: ``demo``, ``generate``, ``chat``, ``serve``, ``info``, ``warmup``,
``rpc-server`` and ``graph-demo``.

``chat`` (and ``generate --chat``) write the conversation in the model's own chat template
(``lazyggml.chat``). ``chat`` reads one user turn per line from stdin (with a ``> `` prompt on a
terminal; empty lines are skipped, end of input ends the chat) and streams each answer; every turn
renders the whole conversation again and evaluates only the tokens after those already in the KV
cache, and a full context ends the chat with a note.

Every option is checked when it is parsed (a bad value is one ``lazyggml: error:`` line naming the
option, exit 2); a value that is capped says so on stderr; an error the user can cause while running
(a bad file, an impossible offload) is one line and exit 1; Ctrl-C is one line and exit 130.
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time

from . import __version__
from .models.archs import ARCHITECTURES
from .models.kv_cache import N_SEQ_MAX

_T0 = time.perf_counter()  # process start, near enough: the CLI module is imported first


def _graph_demo(args):
    import numpy as np
    import lazyggml as lg

    rng = np.random.default_rng(args.seed)
    n_embd, n_ff, n_tokens = 256, 512, 8
    print(f"lazyggml {lg.__version__}: a 2-layer SwiGLU MLP block on {n_tokens} tokens, computed on the CPU")

    # weights live in their own context and buffer, marked WEIGHTS, as a model loader does
    wctx = lg.Context()
    w_gate = wctx.new_tensor_2d(lg.F32, n_embd, n_ff)
    w_up = wctx.new_tensor_2d(lg.F32, n_embd, n_ff)
    w_down = wctx.new_tensor_2d(lg.F32, n_ff, n_embd)
    norm_w = wctx.new_tensor_1d(lg.F32, n_embd)
    for t, name in ((w_gate, "ffn_gate"), (w_up, "ffn_up"), (w_down, "ffn_down"), (norm_w, "ffn_norm")):
        t.name = name
    backend = lg.backend_cpu_init()
    wbuf = lg.alloc_ctx_tensors(wctx, backend)
    wbuf.usage = lg.BufferUsage.WEIGHTS
    weights = {t: (rng.uniform(-1, 1, tuple(reversed(t.ne[:2]))) / np.sqrt(t.ne[0])).astype(np.float32)
               for t in (w_gate, w_up, w_down)}
    weights[norm_w] = rng.uniform(0.5, 1.5, n_embd).astype(np.float32)
    for t, v in weights.items():
        lg.tensor_set(t, v)

    # the graph: lazy tensors, nothing computed yet
    ctx = lg.Context()
    x = ctx.new_tensor_2d(lg.F32, n_embd, n_tokens)
    x.name = "x"
    lg.set_input(x)
    h = lg.mul(lg.rms_norm(x, 1e-5), norm_w)
    ff = lg.mul_mat(w_down, lg.swiglu_split(lg.mul_mat(w_gate, h), lg.mul_mat(w_up, h)))
    out = lg.soft_max(lg.add(ff, x))
    out.name = "out"
    lg.set_output(out)
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    g.print()

    galloc = lg.Gallocr(backend.get_default_buffer_type())
    galloc.alloc_graph(g)
    report = galloc.memory_report()
    xv = rng.uniform(-1, 1, (n_tokens, n_embd)).astype(np.float32)
    lg.tensor_set(x, xv)
    for label in ("first compute (compiles kernels)", "second compute"):
        t0 = time.perf_counter()
        lg.backend_graph_compute(backend, g)
        print(f"{label}: {1e3 * (time.perf_counter() - t0):.1f} ms")
    got = lg.tensor_get(out)[0, 0]

    # the same block in float64 NumPy, as the oracle
    xd = xv.astype(np.float64)
    hd = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-5) * weights[norm_w]
    gate, up = hd @ weights[w_gate].T.astype(np.float64), hd @ weights[w_up].T.astype(np.float64)
    ffd = (gate / (1 + np.exp(-gate)) * up) @ weights[w_down].T.astype(np.float64) + xd
    ref = np.exp(ffd - ffd.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    nmse = float(((got - ref) ** 2).sum() / (ref ** 2).sum())
    print(f"compute buffer: {report}")
    print(f"NMSE against float64 NumPy: {nmse:.2e}")
    print(f"total: {time.perf_counter() - _T0:.2f} s from start")
    return 0 if nmse < 1e-7 else 1


def _placement(model):
    """Where the layers went, e.g. ``CUDA0 0-6, CUDA1 7-11, output CUDA1``."""
    runs = []   # [backend name, first layer, last layer]
    for il, b in enumerate(model.layer_backends[:-1]):
        if runs and runs[-1][0] == b.name:
            runs[-1][2] = il
        else:
            runs.append([b.name, il, il])
    parts = [f"{name} {a}" if a == z else f"{name} {a}-{z}" for name, a, z in runs]
    return ", ".join(parts + [f"output {model.layer_backends[-1].name}"])


def _ratios(text):
    """``--tensor-split 3,1`` (llama.cpp also takes ``3/1``)."""
    try:
        return [float(x) for x in re.split(r"[,/]", text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None


def _number(kind, lo=None, hi=None, lo_open=False):
    """An argparse type: a ``kind`` (int or float) in [lo, hi] ((lo, hi] with ``lo_open``)."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
            lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
            hi_s = "" if hi is None else f"<= {hi}"
            raise argparse.ArgumentTypeError(f"must be {' and '.join(x for x in (lo_s, hi_s) if x)}, got {text}")
        return v
    return parse


def _usable_cpus():
    """The CPUs this process may run on (its affinity), which is what threads can use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def _check_run_options(args):
    """What argparse cannot check alone: option combinations, and caps (said on stderr)."""
    if args.device and args.n_gpu_layers == 0:
        raise ValueError(f"--device {args.device} offloads nothing without -ngl N (N > 0)")
    if getattr(args, "chat", None) is False and (args.system is not None or args.chat_template is not None):
        raise ValueError("--system and --chat-template need --chat")
    if args.threads is not None and args.threads > _usable_cpus():
        print(f"lazyggml: note: -t {args.threads} capped to {_usable_cpus()}, the CPUs this process may use",
              file=sys.stderr)
        args.threads = _usable_cpus()


class _FirstRunNotice:
    """What a user sees while kernels compile: one line when the first one starts (on a first run,
    or after an upgrade), then, on a terminal, a progress bar counting them until ``close()``."""

    def __init__(self):
        self.bar = None
        self.said = False

    def on_start(self, name):
        if not self.said:
            from .cache import CACHE_DIR
            print(f"lazyggml: compiling kernels for this machine, once: this first run takes a minute or so, "
                  f"later runs load them from {CACHE_DIR} ('lazyggml warmup' compiles them ahead of time)",
                  file=sys.stderr)
            self.said = True
            if sys.stderr.isatty():
                from tqdm import tqdm
                self.bar = tqdm(desc="compiling", unit=" kernels", leave=False, file=sys.stderr)
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=False)

    def on_end(self, name):
        if self.bar is not None:
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _generate(args, path=None, body=None):
    """Run ``body`` (``_run``: generate; ``_chat``) on the model, counting the kernels it compiles."""
    from .compiling import CompileWatch

    _check_run_options(args)
    path = path or args.model
    notice = _FirstRunNotice()
    with CompileWatch(notice.on_start, notice.on_end) as watch:
        try:
            return (body or _run)(args, path, watch, notice)
        finally:
            notice.close()


def _load(args, path, out=None):
    """The model, loaded as the options ask, its one-token kernels ready; what was loaded is said on
    ``out`` (stdout by default)."""
    from .models.runner import load_model
    from .sampling import Sampler
    model = load_model(path, n_gpu_layers=args.n_gpu_layers, device=args.device, n_ctx=args.ctx_size,
                       n_threads=args.threads, progress=sys.stderr.isatty(), tensor_split=args.tensor_split,
                       n_batch=args.ubatch_size, flash_attn={"on": True, "off": False}.get(args.flash_attn),
                       mmap=not args.no_mmap, rpc=args.rpc, repack=not args.no_repack)
    # One decode step, then forgotten: on a first run it compiles the one-token kernels now, before
    # any output, instead of stalling after the first token (the prompt's kernels compile during
    # the prefill, which comes before any output too). Later runs load them in milliseconds.
    Sampler().sample(model.eval([0], logits_all=False)[-1])   # the sampler's compiled part too
    model.reset()
    # Everything alive now (the model, its graphs, Numba's compiled kernels: ~120k objects) lives as
    # long as this command: keep the garbage collector from rescanning it. A full pass takes ~45 ms
    # on the dev machine, and one in the middle of a 48-token demo cut its decode speed by 2 to 3x.
    gc.freeze()
    backends = ", ".join(b.name for b in model.backends)
    print(f"loaded {path} in {model.load_time:.2f} s: {model.hp.n_layer} layers, n_embd {model.hp.n_embd}, "
          f"vocab {model.hp.n_vocab}; backends {backends}", file=out)
    print(f"layers: {_placement(model)}", file=out)
    if args.ctx_size is not None and args.ctx_size > model.n_ctx:
        print(f"lazyggml: note: -c {args.ctx_size} capped to {model.n_ctx}, the model's training context",
              file=sys.stderr)
    return model


def _stream(args, model, prompt, watch, notice, echo=""):
    """Generate after ``prompt`` (text or token ids), writing ``echo`` then the pieces to stdout as
    they come; the stats (with the ``text`` written after ``echo``), and the compile seconds before
    the prompt, after it and at the end."""
    stats, text = {}, []
    compiled = [watch.seconds]
    first = (watch.seconds, watch.count)   # compiling until the first token
    for i, piece in enumerate(model.generate(prompt, args.n_predict, temp=args.temp, top_k=args.top_k,
                                             top_p=args.top_p, seed=args.seed, stats=stats)):
        if i == 0:
            compiled.append(watch.seconds)
            first = (watch.seconds, watch.count)
            notice.close()
            sys.stdout.write(echo)
        sys.stdout.write(piece)
        sys.stdout.flush()
        text.append(piece)
    if len(compiled) == 1:
        compiled.append(watch.seconds)
        sys.stdout.write(echo)
    compiled.append(watch.seconds)
    stats.update(first=first, text="".join(text))
    return stats, compiled


def _run(args, path, watch, notice):
    """Load, generate and print, as ``_generate`` describes; ``watch`` counts the compiles."""
    chat = getattr(args, "chat", False)
    if chat:   # the prompt as a user's turn in the chat template, rendered before loading (errors at once)
        messages = _system(args) + [{"role": "user", "content": args.prompt}]
        text = _template(args, path).render(messages, add_generation_prompt=True)
    model = _load(args, path)
    prompt, echo = args.prompt, args.prompt
    if chat:   # the answer alone is printed
        from .chat import tokenize_chat
        prompt, echo = tokenize_chat(model.tokenizer, text), ""
    stats, compiled = _stream(args, model, prompt, watch, notice, echo)
    first = stats["first"]
    print()
    if "first_token_time" in stats:
        print(f"first token: {stats['first_token_time'] - _T0:.2f} s"
              + (f" ({first[0]:.2f} s of it compiling {first[1]} kernels)" if first[1] else ""))
    prefill_s, prefill_c = _excluding(stats["prefill_s"], compiled[1] - compiled[0])
    decode_s, decode_c = _excluding(stats["decode_s"], compiled[2] - compiled[1])
    print(f"prefill: {stats['n_prompt']} tokens in {prefill_s:.2f} s "
          f"({stats['n_prompt'] / max(prefill_s, 1e-9):.1f} tokens/s){prefill_c}")
    print(f"decode: {stats['n_decoded'] / max(decode_s, 1e-9):.1f} tokens/s "
          f"({stats['n_decoded']} tokens){decode_c}")
    print(f"splits: {stats['n_splits']}")
    if stats.get("stop") == "context":
        print(f"lazyggml: note: stopped after {stats['n_decoded']} of {args.n_predict} tokens: the context of "
              f"{model.n_ctx} tokens is full (-c)", file=sys.stderr)
    return 0


def _template(args, path):
    """The chat template (``--chat-template``, else the file's), read and compiled before the model
    loads: a missing or broken one is said at once, before any kernel compiles."""
    from .chat import chat_template
    from .gguf_io import read_gguf
    from .tokenizer import Tokenizer
    metadata = read_gguf(path).metadata
    return chat_template(metadata, Tokenizer(metadata, path), path, args.chat_template)


def _system(args):
    """The conversation's opening system message (``--system``), if any."""
    return [{"role": "system", "content": args.system}] if args.system else []


def _chat(args, path, watch, notice):
    """The interactive chat (module docstring): the model's lines go to stderr, the answers to stdout."""
    from .chat import tokenize_chat
    template = _template(args, path)
    model = _load(args, path, out=sys.stderr)
    messages = _system(args)
    cached = []   # the token ids in the KV cache
    tty = sys.stdin.isatty()
    while True:
        try:
            line = input("> ") if tty else sys.stdin.readline()
        except EOFError:
            line = ""
        if not line:   # end of input (a blank line is "\n")
            if tty:
                print()
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tokenize_chat(model.tokenizer, template.render(messages, add_generation_prompt=True))
        if len(ids) > model.n_ctx:
            print(f"lazyggml: note: the conversation is {len(ids)} tokens, more than the context of {model.n_ctx} "
                  f"(-c): the chat ends here", file=sys.stderr)
            return 0
        # keep the longest common prefix in the cache (at least one token must be evaluated, for
        # its logits): the cells after it are given up
        keep = 0
        while keep < min(len(cached), len(ids) - 1) and cached[keep] == ids[keep]:
            keep += 1
        if keep == 0:
            model.reset()
        model.kv.seq_rm(0, keep, -1)
        stats, compiled = _stream(args, model, ids[keep:], watch, notice)
        print()
        cached = (ids + stats["tokens"])[:model.n_past]
        messages.append({"role": "assistant", "content": stats["text"]})
        prefill_s, _ = _excluding(stats["prefill_s"], compiled[1] - compiled[0])
        decode_s, _ = _excluding(stats["decode_s"], compiled[2] - compiled[1])
        print(f"[prefill: {stats['n_prompt']} new tokens in {prefill_s:.2f} s; decode: {stats['n_decoded']} "
              f"tokens, {stats['n_decoded'] / max(decode_s, 1e-9):.1f} tokens/s; stop: {stats['stop']}]",
              file=sys.stderr)
        if stats["stop"] == "context":
            print(f"lazyggml: note: the answer was cut: the context of {model.n_ctx} tokens is full (-c); "
                  f"the chat ends here", file=sys.stderr)
            return 0


def _excluding(seconds, compile_s):
    """A phase's time without the kernels compiled in it, and a note saying so when there were some."""
    if compile_s <= 0:
        return seconds, ""
    return max(seconds - compile_s, 0.0), f"; {compile_s:.2f} s compiling kernels not counted"


def _serve(args):
    """``lazyggml serve`` (``lazyggml.serving.server``): load the model on a thread while the server
    already answers (``/health``: 503 until loaded), then serve until Ctrl-C."""
    try:
        import uvicorn
        from .serving.server import ServerState, create_app
    except ImportError as e:
        if (e.name or "").startswith("lazyggml"):
            raise
        raise RuntimeError(f"serve needs the server extra ({e.name} is missing): pip install 'lazyggml[server]'") from None
    from .chat import ChatTemplateError
    from .models import default_model_path
    path = args.model or default_model_path()
    _check_run_options(args)
    if args.batch_invariant:
        from .backends.cpu import set_column_order
        set_column_order(True)
        args.no_repack = True
        if args.flash_attn == "off":
            raise ValueError("--batch-invariant needs flash attention (-fa on or auto): without it a row's "
                             "soft-max adds over every cell of the batch's window")
        args.flash_attn = "on"
    try:
        template = _template(args, path)
    except ChatTemplateError:
        if args.chat_template is not None:
            raise
        template = None               # no template in the file: ChatML (server.CHATML)
    notice = _FirstRunNotice()

    def load():
        from .compiling import CompileWatch
        with CompileWatch(notice.on_start, notice.on_end):
            try:
                return _load(args, path, out=sys.stderr), template
            finally:
                notice.close()
    name = args.alias or os.path.basename(path)
    state = ServerState(load, n_parallel=args.parallel, api_key=args.api_key, max_queue=args.max_queue,
                        model_name=name)
    print(f"lazyggml: serving {name} on http://{args.host}:{args.port}/v1 with {args.parallel} slots "
          f"(Ctrl-C stops)", file=sys.stderr)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level="warning")
    return 0


def _demo(args):
    from .models import default_model_path
    return _generate(args, default_model_path())


def _probe_ops():
    """What ``info`` asks each device about: the result of the first op case (``lazyggml.op_cases``)
    of each op (the sub-op for UNARY and GLU), and of the first mul_mat case of each weight type."""
    from .op_cases import CASES
    from .ops import Op, op_desc
    from .tensor import Context
    from .types import type_name
    probes = {}
    for case in CASES:
        out = case.build(Context())[1][-1]
        name = op_desc(out).lower()
        if out.op == Op.MUL_MAT:
            name = f"mul_mat {type_name(out.src[0].type)}"
        probes.setdefault(name, out)
    return probes


def _info(args):
    import lazyggml as lg
    print(f"lazyggml {lg.__version__}")
    probes = _probe_ops()
    for d in [lg.dev_get(i) for i in range(lg.dev_count())]:
        try:
            free, total = d.memory()
        except lg.LazyGGMLError as e:   # an RPC server that has gone away: said, and the others listed
            print(f"{d.name}: {d.description}: unreachable ({e})")
            continue
        buft = d.get_buffer_type()
        # what the device is, when the scheduler treats it as another kind (PoCL's CPU device, a "GPU")
        hardware = getattr(d, "hardware_type", d.type)
        kind = d.type.name if hardware == d.type else f"{hardware.name} device; scheduled as a {d.type.name}"
        print(f"{d.name}: {d.description} ({kind})")
        print(f"  buffer type {buft.name}: alignment {buft.get_alignment()}, host={buft.is_host()}; "
              f"memory {free >> 20}/{total >> 20} MiB free")
        print(f"  supports: {', '.join(k for k, t in probes.items() if d.supports_op(t))}")
        missing = [k for k, t in probes.items() if not d.supports_op(t)]
        if missing:
            print(f"  not: {', '.join(missing)}")
    return 0


def _rpc_server(args):
    """``lazyggml rpc-server``: serve devices until Ctrl-C (exit 130, as any interrupted command)."""
    from .backends.rpc.server import serve
    from .cache import CACHE_DIR
    from .registry import dev_by_name, dev_count, dev_get
    from .backend import DeviceType
    if args.device:
        devices = []
        for name in args.device.split(","):
            d = dev_by_name(name.strip())
            if d is None:
                raise ValueError(f"--device: no device named {name.strip()!r}; see `lazyggml info`")
            devices.append(d)
    else:   # ggml-rpc-server's default: the GPUs, else the CPU
        all_devices = [dev_get(i) for i in range(dev_count())]
        devices = [d for d in all_devices if d.type in (DeviceType.GPU, DeviceType.IGPU)] or \
                  [d for d in all_devices if d.type == DeviceType.CPU]
    if args.threads is not None and args.threads > _usable_cpus():
        print(f"lazyggml: note: -t {args.threads} capped to {_usable_cpus()}, the CPUs this process may use",
              file=sys.stderr)
        args.threads = _usable_cpus()
    cache_dir = os.path.join(CACHE_DIR, "rpc") if args.cache else None
    return serve(devices, host=args.host, port=args.port, cache_dir=cache_dir, n_threads=args.threads)


def _warmup(args):
    from .warmup import warmup

    def split(s):  # on commas, but not those inside a case name's parentheses
        return [x.strip() for x in re.split(r",(?![^()]*\))", s) if x.strip()] if s else None
    return warmup(kinds=split(args.backend), types=split(args.types), patterns=split(args.cases),
                  jobs=args.jobs, check=args.check)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as the one line every other error is."""

    def error(self, message):
        self.exit(2, f"lazyggml: error: {message} (see lazyggml {self.prog.split()[-1]} --help)\n")


def build_parser():
    p = _Parser(prog="lazyggml", description="GGML-compatible tensor runtime")
    p.add_argument("--version", action="version", version=f"lazyggml {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    def sampling_args(sp, prompt, n_predict):
        if prompt is not None:
            sp.add_argument("-p", "--prompt", default=prompt, help=f"the text to continue (default {prompt!r})")
        sp.add_argument("-n", "--n-predict", type=_number(int, 0), default=n_predict,
                        help=f"tokens to generate (default {n_predict}); generation also stops at the end of "
                             "the context or at an end-of-generation token")
        model_args(sp)
        sp.add_argument("--temp", type=_number(float, 0.0), default=0.8,
                        help="sampling temperature; 0 picks the most likely token (default 0.8)")
        sp.add_argument("--top-k", type=_number(int, 0), default=40,
                        help="sample among the K most likely tokens; 0 means all (default 40)")
        sp.add_argument("--top-p", type=_number(float, 0.0, 1.0, lo_open=True), default=0.95,
                        help="sample among the most likely tokens whose probabilities add up to P (default 0.95)")
        sp.add_argument("--seed", type=int, default=None, help="random seed of the sampler (default: random)")

    def model_args(sp):
        sp.add_argument("-ngl", "--n-gpu-layers", type=_number(int, 0), default=0,
                        help="offload the last N layers (above the layer count: the output too)")
        sp.add_argument("--device", default=None,
                        help="devices to offload to, comma-separated, e.g. CUDA0,CUDA1 (default: every GPU); "
                             "needs -ngl")
        sp.add_argument("--rpc", default=None, metavar="HOST:PORT[,HOST:PORT]",
                        help="GGML RPC servers (lazyggml rpc-server or llama.cpp's ggml-rpc-server) whose devices "
                             "take offloaded layers, before local GPUs")
        sp.add_argument("-ts", "--tensor-split", default=None, type=_ratios,
                        help="share of the offloaded layers per device, e.g. 3,1 (default: by free memory)")
        sp.add_argument("-c", "--ctx-size", type=_number(int, 1), default=None,
                        help="context length in tokens (default and maximum: the model's training context)")
        sp.add_argument("-ub", "--ubatch-size", type=_number(int, 1), default=None,
                        help="prompt tokens per micro-batch (default 128 on the CPU, 512 when all layers are on a GPU)")
        sp.add_argument("-fa", "--flash-attn", choices=("auto", "on", "off"), default="auto",
                        help="fused attention (FLASH_ATTN_EXT); auto: on when every layer's backend runs it")
        sp.add_argument("--no-mmap", action="store_true",
                        help="copy the CPU's weights into memory of their own instead of using the mapped file in place")
        sp.add_argument("-nr", "--no-repack", action="store_true",
                        help="keep the CPU's weights in plain buffers: their products add in GGML's vec_dot order "
                             "instead of its repacked kernels' (llama.cpp's --no-repack)")
        sp.add_argument("-t", "--threads", type=_number(int, 1), default=None,
                        help="CPU threads (default and maximum: the CPUs this process may use; fewer while other programs keep CPUs busy)")

    d = sub.add_parser("demo", help="generate text with the embedded default model")
    sampling_args(d, "And God said", 48)
    d.set_defaults(fn=_demo)
    gen = sub.add_parser("generate", help="generate text with a GGUF model")
    gen.add_argument("model", help=f"path of a GGUF file whose architecture is one of {', '.join(ARCHITECTURES)}")
    sampling_args(gen, "Once upon a time", 64)
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user's message in the model's chat template, and print the answer")

    def chat_args(sp):
        sp.add_argument("--system", default=None, help="a system message that opens the conversation")
        sp.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                        help="a Jinja chat template (a file, or the text itself) instead of the model's "
                             "tokenizer.chat_template")
    chat_args(gen)
    gen.set_defaults(fn=_generate)
    ch = sub.add_parser("chat", help="chat with an instruct GGUF model: one user turn per line of stdin")
    ch.add_argument("model", help=f"path of a GGUF file whose architecture is one of {', '.join(ARCHITECTURES)}")
    sampling_args(ch, None, 512)
    chat_args(ch)
    ch.set_defaults(fn=lambda args: _generate(args, body=_chat))
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: many requests at once, continuously batched")
    sv.add_argument("model", nargs="?", default=None,
                    help="path of a GGUF file (default: the embedded model of lazyggml demo)")
    model_args(sv)
    sv.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                    help="a Jinja chat template (a file, or the text itself) instead of the model's "
                         "tokenizer.chat_template (a file without one gets ChatML)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=_number(int, 1, 65535), default=8080, help="TCP port (default 8080)")
    sv.add_argument("-np", "--parallel", type=_number(int, 1, N_SEQ_MAX), default=4,
                    help=f"slots: requests generated at once, each with ctx-size / N tokens of context "
                         f"(default 4, at most {N_SEQ_MAX})")
    sv.add_argument("--max-queue", type=_number(int, 0), default=256,
                    help="requests that may wait for a slot; more are answered 503 (default 256)")
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (every endpoint but /health)")
    sv.add_argument("--batch-invariant", action="store_true",
                    help="answers that do not depend on what else the server runs (a seed gives the same text "
                         "under any load): the CPU's products column by column in GGML's vec_dot order, flash "
                         "attention on, no repacking (llama.cpp's orders change with the batch's size)")
    sv.add_argument("--alias", default=None, help="the model's name in /v1/models and answers (default: the file's name)")
    sv.set_defaults(fn=_serve)
    gd = sub.add_parser("graph-demo", help="build and compute a small graph, compared with NumPy")
    gd.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs (default 0)")
    gd.set_defaults(fn=_graph_demo)
    rs = sub.add_parser("rpc-server", help="serve this machine's devices to GGML RPC clients (--rpc of lazyggml "
                                           "and of llama.cpp)")
    rs.add_argument("-H", "--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1). The protocol has no authentication: "
                         "whoever reaches the port can use the devices and read their memory")
    rs.add_argument("-p", "--port", type=_number(int, 1, 65535), default=50052, help="TCP port (default 50052)")
    rs.add_argument("-d", "--device", default=None,
                    help="devices to serve, comma-separated, e.g. CUDA0 (default: every GPU, else the CPU)")
    rs.add_argument("-t", "--threads", type=_number(int, 1), default=None, help="CPU threads (default: all usable)")
    rs.add_argument("-c", "--cache", action="store_true",
                    help="keep tensors above 10 MiB in a local file cache by content hash, so that a client "
                         "loading the same weights again sends only their hashes")
    rs.set_defaults(fn=_rpc_server)
    i = sub.add_parser("info", help="list devices and buffer types")
    i.set_defaults(fn=_info)
    w = sub.add_parser("warmup", help="compile every kernel into the on-disk cache ahead of time")
    w.add_argument("--backend", help="comma-separated: cpu, opencl, cuda (default: every one present)")
    w.add_argument("--types", help="comma-separated tensor types, e.g. q4_K,q6_K (default: all)")
    w.add_argument("--cases", help="comma-separated name patterns of the cases to run, e.g. 'mul_mat*'")
    w.add_argument("-j", "--jobs", type=_number(int, 1), default=1, help="compile in this many processes")
    w.add_argument("--check", action="store_true",
                   help="compile nothing; exit 1 when any kernel would have to be compiled")
    w.set_defaults(fn=_warmup)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from .errors import LazyGGMLError
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("lazyggml: interrupted", file=sys.stderr)
        return 130
    except (LazyGGMLError, OSError, ValueError, RuntimeError, MemoryError) as e:   # say what, without a traceback
        print(f"lazyggml: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
