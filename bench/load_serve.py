"""Load test of ``lazyggml serve`` (issue 43): hundreds of requests, many at once, random prompt and
answer lengths, some streams closed early; every answer must be the one its request gets alone.

    python bench/load_serve.py                         # 300 requests twice, 32 at once, 8 slots (~20 s)
    python bench/load_serve.py --requests 60 --concurrency 12 --parallel 4 --max-tokens 8   # CI size
    python bench/load_serve.py --url http://127.0.0.1:8080 --api-key K --pid PID   # a server already running

Steps:

1. Start ``lazyggml serve`` (this interpreter's ``-m lazyggml.cli serve``) on a free port of
   127.0.0.1, unless ``--url`` names a running one, in the configuration where a token's results
   do not depend on the other tokens of its batch (``--batch-invariant``: see
   ``lazyggml.backends.cpu.set_column_order`` and ``tests/test_batch.py``'s docstring), with
   ``--max-queue`` = ``--requests`` and a short chat template (``--chat-template``: ChatML's ~35
   tokens would not fit the 32-token slots of 8 slots on the embedded model's 256-token context).
   A server of one's own (``--url``) should run so too, with a queue of at least ``--concurrency``.
2. ``--requests`` random requests (seeded by ``--seed``): completions or chat (``--chat-share``),
   prompts of random words from a fixed list (some repeat an earlier prompt, some extend one: the
   slots' prompt cache is used), random ``max_tokens``; half of them streamed; ``--cancel-share``
   of them are long streams (``ignore_eos``, the slot's whole context) that the client closes after
   1 to 4 chunks. A prompt too long for a slot's context loses words until it fits (the server
   answers 400).
3. Reference answers: each distinct request sent alone, one at a time, plain (not streamed),
   temperature 0: the single-sequence answers (with each token's top-5 log-probabilities, which do
   not change them, to classify mismatches).
4. ``--rounds`` (2) rounds of load: all requests at once (shuffled) through ``--concurrency``
   client threads (``openai``'s client). After each round, within ``--settle`` seconds, every slot
   must be idle and ``lazyggml:kv_cache_tokens`` must equal the sum of the slots' ``n_cached`` (no
   leaked KV cells); the server's RSS is read (``/proc/PID/status`` of the server started here, or
   of ``--pid``).
5. Checks: every answer read to its end equals its reference (text, finish_reason, completion and
   prompt tokens); the text a closed stream received begins its reference; the deltas of
   ``lazyggml:requests_finished`` account for every request exactly (``check_round``): nothing
   "error", "cancelled" = the closed streams the server had not finished; RSS grew less than
   ``--rss-growth-mb`` MB or ``--rss-growth-pct`` % from round 1 to the last round.

Mismatches are classified from the reference's log-probabilities: a *near-tie* when, where the two
texts part, both tokens were within ``NEAR_TIE`` of the most likely one. A batch-invariant server
(each slot's KV cells in position order in a range of its own, every product and attention in the
order of one token alone) has none; a server in llama.cpp's orders (a ``--url`` one without
``--batch-invariant``) moves logits by up to ~0.07 with what runs beside a sequence (flash attention's
F16 accumulator in cell order, the products' tiled orders), and greedy choices within that flip.
Near-ties fail the run unless ``--allow-near-ties``; any other mismatch (another sequence's data
would move logits by whole units) always does.

A summary is printed (requests, cancelled, mismatches, wall time, output tok/s, time to first token
of streams), ending with one line ``SUMMARY {json}``; exit status 0 when every check passed, 1 when
one failed, 2 when the run could not be done (the server did not start, ``--timeout`` passed, an
HTTP error outside the load). A server started here is stopped in every case (SIGTERM, then
SIGKILL). Traffic stays on loopback.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

WORDS = ("and God said let there be light the earth heaven water night day morning evening "
         "first second waters firmament dry land grass herb seed fruit tree after his kind "
         "lights stars sun moon rule over sea fish fowl air cattle creeping thing beast man "
         "image likeness male female blessed them multiply replenish subdue dominion every "
         "living moveth upon face deep darkness spirit divided called gathered together place "
         "good very behold given meat green whereas Lord king people house son father went "
         "came unto city children Israel David Jerusalem hand word because shall will heart voice "
         "mountain river bread wine gold silver servant brother mother").split()
assert len(set(WORDS)) >= 100

#: a short chat template for a server started here: "user: ...\nassistant:" (a few tokens)
SHORT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


class RunError(Exception):
    """The run could not be done (exit 2)."""


# -- the server ---------------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """``lazyggml serve`` in a child process on 127.0.0.1; its output goes to a temporary file."""

    def __init__(self, args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="lazyggml-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "lazyggml.cli", "serve", *([args.model] if args.model else []),
               "--host", "127.0.0.1", "--port", str(self.port), "-np", str(args.parallel),
               "-t", str(args.threads), "--batch-invariant", "--max-queue", str(max(args.requests, 1))]
        if args.chat_template != "server":
            cmd += ["--chat-template", SHORT_TEMPLATE if args.chat_template == "short" else args.chat_template]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.pid = self.proc.pid

    def check_alive(self):
        if self.proc.poll() is not None:
            raise RunError(f"the server exited with status {self.proc.returncode}:\n{self.tail()}")

    def tail(self, n=4000):
        try:
            with open(self.log.name, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def rss_mb(self):
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RunError("no VmRSS in /proc/PID/status")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


class HTTP:
    """Plain HTTP to the server (health, slots, metrics, tokenize), each call bounded by ``timeout``."""

    def __init__(self, url, api_key, timeout=30):
        u = urllib.parse.urlsplit(url)
        if u.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise RunError(f"--url must be a loopback address (127.0.0.1, localhost, ::1), not {u.hostname}")
        self.host, self.port, self.key, self.timeout = u.hostname, u.port or 80, api_key, timeout

    def request(self, method, path, body=None):
        c = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            headers = {"Content-Type": "application/json"}
            if self.key:
                headers["Authorization"] = f"Bearer {self.key}"
            c.request(method, path, json.dumps(body) if body is not None else None, headers)
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def json(self, method, path, body=None):
        status, data = self.request(method, path, body)
        if status != 200:
            raise RunError(f"{method} {path}: HTTP {status}: {data[:300]!r}")
        return json.loads(data)

    def metrics(self):
        """``{(name, ((label, value), ...)): value}`` from /metrics (Prometheus' text format)."""
        status, data = self.request("GET", "/metrics")
        if status != 200:
            raise RunError(f"GET /metrics: HTTP {status}")
        out = {}
        for line in data.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r'^([^{\s]+)(?:\{(.*)\})?\s+(\S+)', line)
            if m:
                labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
                out[(m.group(1), labels)] = float(m.group(3))
        return out


def wait_ready(api, server, deadline):
    while time.time() < deadline:
        if server is not None:
            server.check_alive()
        try:
            status, _ = api.request("GET", "/health")
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RunError("the server did not get ready before --timeout")


def finished_counts(metrics):
    """``lazyggml:requests_finished`` by finish reason (a counter: ``..._total`` in the text format)."""
    return {dict(k[1]).get("finish_reason"): v for k, v in metrics.items()
            if k[0] in ("lazyggml:requests_finished", "lazyggml:requests_finished_total")}


def metric(metrics, name):
    return metrics.get((name, ()), metrics.get((name + "_total", ()), 0.0))


# -- requests ------------------------------------------------------------------------------------------------
class Spec:
    """One request of the load: ``kind`` "completion" or "chat", its prompt ``text``,
    ``max_tokens``, ``ignore_eos``; ``stream``; ``cancel_after``: chunks read before the stream is
    closed (None: read to the end)."""

    def __init__(self, i, kind, words, max_tokens, stream, cancel_after=None):
        self.i, self.kind, self.words, self.max_tokens = i, kind, list(words), max_tokens
        self.stream, self.cancel_after = stream, cancel_after

    @property
    def text(self):
        return " ".join(self.words)

    @property
    def ignore_eos(self):
        return self.cancel_after is not None        # a stream to close: long, so that it is still running

    @property
    def key(self):
        return (self.kind, self.text, self.max_tokens, self.ignore_eos)

    def body(self, stream):
        b = dict(model="x", max_tokens=self.max_tokens, temperature=0, stream=stream)
        if self.kind == "chat":
            b["messages"] = [{"role": "user", "content": self.text}]
        else:
            b["prompt"] = self.text
        extra = {"ignore_eos": True} if self.ignore_eos else {}
        if stream:
            b["stream_options"] = {"include_usage": True}
        return b, extra


def make_specs(args, rng, n_ctx_slot):
    """``args.requests`` random requests (see the module's docstring)."""
    specs = []
    n_cancel = round(args.requests * args.cancel_share)
    cancel_ids = set(rng.sample(range(args.requests), n_cancel))
    for i in range(args.requests):
        kind = "chat" if rng.random() < args.chat_share else "completion"
        r = rng.random()
        if specs and r < 0.1:                                   # an earlier prompt again
            words = rng.choice(specs).words
        elif specs and r < 0.3:                                 # an earlier prompt, longer
            words = rng.choice(specs).words + [rng.choice(WORDS) for _ in range(rng.randint(1, 4))]
        else:
            words = [rng.choice(WORDS) for _ in range(rng.randint(1, args.max_words))]
        words = [w.capitalize() if j == 0 else w for j, w in enumerate(words[:args.max_words + 4])]
        if i in cancel_ids:             # a short prompt and the whole slot to fill: long after it is closed
            specs.append(Spec(i, kind, words[:3], n_ctx_slot, True, cancel_after=rng.randint(1, 4)))
        else:
            specs.append(Spec(i, kind, words, rng.randint(args.min_tokens, args.max_tokens), rng.random() < 0.5))
    return specs


def call(client, spec, stream, timeout, logprobs=None):
    """Send ``spec``; returns a dict: text, finish, usage (completion_tokens, prompt_tokens),
    ttft (streams: seconds to the first text), chunks, closed (a stream closed before its end),
    seen_finish (its last chunk had arrived), error."""
    body, extra = spec.body(stream)
    if logprobs:
        if spec.kind == "chat":
            body.update(logprobs=True, top_logprobs=logprobs)
        else:
            body["logprobs"] = logprobs
    c = client.with_options(timeout=timeout)
    create = c.chat.completions.create if spec.kind == "chat" else c.completions.create
    out = dict(text="", finish=None, usage=None, ttft=None, chunks=0, closed=False, seen_finish=False, error=None,
               logprobs=None, latency=None)
    t0 = time.perf_counter()
    try:
        return _call(create, spec, stream, body, extra, out, t0)
    except Exception as e:            # reported per request
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        out["latency"] = time.perf_counter() - t0


def _call(create, spec, stream, body, extra, out, t0):
    """One request (``call``'s body): plain, or a stream read to its end or closed after
    ``spec.cancel_after`` chunks."""
    if not stream:
        r = create(**body, extra_body=extra)
        ch = r.choices[0]
        out["text"] = ch.message.content if spec.kind == "chat" else ch.text
        out["finish"] = ch.finish_reason
        out["usage"] = (r.usage.completion_tokens, r.usage.prompt_tokens)
        out["logprobs"] = ch.logprobs
        return out
    parts = []
    s = create(**body, extra_body=extra)
    try:
        for chunk in s:
            out["chunks"] += 1
            if chunk.choices:
                ch = chunk.choices[0]
                piece = (ch.delta.content if spec.kind == "chat" else ch.text) or ""
                if piece and out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - t0
                parts.append(piece)
                if ch.finish_reason is not None:
                    out["finish"] = ch.finish_reason
                    out["seen_finish"] = True
            if chunk.usage is not None:
                out["usage"] = (chunk.usage.completion_tokens, chunk.usage.prompt_tokens)
            if spec.cancel_after is not None and out["chunks"] >= spec.cancel_after and not out["seen_finish"]:
                out["closed"] = True
                break
    finally:
        s.close()                 # closes the HTTP response: the server sees the client go
    out["text"] = "".join(parts)
    return out


# -- phases --------------------------------------------------------------------------------------------------
def references(client, specs, deadline):
    """Each distinct request alone, plain, temperature 0, with the top-5 log-probabilities of each
    token (for ``classify``; they do not change the answer): ``{key: result}``. A prompt too long
    for a slot loses its last words until it fits (the spec is changed in place)."""
    refs = {}
    for spec in specs:
        while True:
            if time.time() > deadline:
                raise RunError("--timeout passed while taking the reference answers")
            if spec.key in refs:
                break
            r = call(client, spec, False, timeout=max(1.0, min(120.0, deadline - time.time())), logprobs=5)
            if r["error"] and "not fit" in r["error"] and len(spec.words) > 1:
                spec.words = spec.words[:-1]
                continue
            if r["error"]:
                raise RunError(f"reference of request {spec.i} ({spec.kind}, {spec.text!r}): {r['error']}")
            refs[spec.key] = r
            break
    return refs


def settle(api, timeout):
    """Wait until every slot is idle and nothing waits; returns (slots, metrics, seconds waited)."""
    t0 = time.time()
    while True:
        slots = api.json("GET", "/slots")
        m = api.metrics()
        if not any(s["is_processing"] for s in slots) and metric(m, "lazyggml:requests_deferred") == 0:
            slots2 = api.json("GET", "/slots")
            if slots2 == slots:
                return slots, m, time.time() - t0
        if time.time() - t0 > timeout:
            return slots, m, time.time() - t0
        time.sleep(0.05)


def run_round(client, specs, args, rng, deadline):
    order = list(specs)
    rng.shuffle(order)
    results = {}
    pool = cf.ThreadPoolExecutor(args.concurrency, thread_name_prefix="load")
    t0 = time.perf_counter()
    try:
        futs = {pool.submit(call, client, s, s.stream, max(1.0, min(args.request_timeout, deadline - time.time()))): s
                for s in order}
        for f in cf.as_completed(futs, timeout=max(0.0, deadline - time.time())):
            results[futs[f].i] = f.result()
    except cf.TimeoutError:
        raise RunError(f"--timeout passed during a round ({len(results)} of {len(specs)} answers in)") from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return results, time.perf_counter() - t0


#: a mismatch whose first differing token was within this log-probability of the reference's choice
#: is a near-tie. Measured on the embedded model (flash attention, per-column products): a
#: sequence whose KV cells are not in position order gets logits up to ~0.07 away from its run
#: with ordered cells (flash attention's F16 accumulator, GGML's VKQ16, adds the cells in cell
#: order), while reading another sequence's cells moves them by whole units (NMSE ~0.1).
NEAR_TIE = 0.1


def classify(spec, ref, got):
    """Where a mismatch begins and how close the two choices were there, from the reference's own
    top-5 log-probabilities of each token, walked token by token while both texts take its token.
    Returns (near_tie, lines): near_tie when, at a token, the reference and the answer go on with
    two different tokens both within ``NEAR_TIE`` of the most likely one."""
    lines = [f"request {spec.i} ({spec.kind}, stream={spec.stream}, max_tokens={spec.max_tokens}) prompt={spec.text!r}",
             f"  reference: {ref['text']!r} finish={ref['finish']} usage={ref['usage']}",
             f"  got:       {got['text']!r} finish={got['finish']} usage={got['usage']}"]
    k = len(os.path.commonprefix([ref["text"], got["text"]]))
    if k == min(len(ref["text"]), len(got["text"])):
        lines.append("  one text begins the other (an end-of-generation token against a text token): not classified")
        return False, lines
    lp = ref["logprobs"]
    if spec.kind == "chat":
        toks = [(t.token, [(x.token, x.logprob) for x in t.top_logprobs]) for t in lp.content]
    else:
        toks = [(t, sorted(top.items(), key=lambda kv: -kv[1])) for t, top in zip(lp.tokens, lp.top_logprobs)]
    ra, ga = ref["text"], got["text"]
    pos = 0
    for j, (tok, top) in enumerate(toks):
        if pos > k:
            break
        # the tokens within NEAR_TIE of the most likely: any of them may come first in a run whose
        # logits moved by less than half of that; one taken by each text, different: a near-tie
        band = [(t, x) for t, x in top if t and x >= top[0][1] - NEAR_TIE]
        pair = next(((r, g) for r in band for g in band if r[0] != g[0] and ra.startswith(r[0], pos)
                     and ga.startswith(g[0], pos)), None)
        if pair is not None:
            (rt, rx), (gt, gx) = pair
            lines.append(f"  token {j} (at character {pos}), top-5 of the reference: " + ", ".join(f"{t!r} {x:.4f}" for t, x in top))
            lines.append(f"  reference {rt!r}, answer {gt!r}: {top[0][1] - min(rx, gx):.4f} or less below the most "
                         f"likely: a near-tie (< {NEAR_TIE}: KV cells out of position order move the logits that much)")
            return True, lines
        if not (ra.startswith(tok, pos) and ga.startswith(tok, pos)):
            lines.append(f"  token {j} (at character {pos}), top-5 of the reference: " + ", ".join(f"{t!r} {x:.4f}" for t, x in top))
            lines.append(f"  the reference ({ra[pos:pos + 8]!r}) and the answer ({ga[pos:pos + 8]!r}) do not both take "
                         f"tokens within {NEAR_TIE} of the most likely there: NOT a near-tie (another sequence's data?)")
            return False, lines
        pos += len(tok)
    lines.append("  the texts part after the reference's last token: not classified")
    return False, lines


def check_round(name, specs, refs, results, before, m, slots, waited, args, failures, notes):
    """The checks of one round (failures appended to ``failures``, what is allowed but worth
    reading to ``notes``); returns its numbers.

    Accounting of ``lazyggml:requests_finished`` (each request ends once): the requests read to
    their end must have ended with their reference's finish reason; a closed stream ends either
    "cancelled" or, when the server had generated all of it before it saw the client go, "length"
    (they ask for ``ignore_eos`` and the slot's whole context). So, per reason, the deltas must be:
    "stop" = the reads to their end that stopped; "length" = the reads that ran to length + X;
    "cancelled" = closed - X, for the X closed streams the server finished first (0 <= X <= closed);
    nothing else ("error")."""
    by_i = {s.i: s for s in specs}
    mismatches, errors, prefix_bad, ttfts, lat = [], [], [], [], []
    closed = closed_unfinished = out_tokens = 0
    want = {"stop": 0, "length": 0}
    for i, r in results.items():
        s = by_i[i]
        ref = refs[s.key]
        lat.append(r["latency"])
        if r["ttft"] is not None:
            ttfts.append(r["ttft"])
        if r["closed"]:
            closed += 1
            closed_unfinished += not r["seen_finish"]
            if not ref["text"].startswith(r["text"]):
                prefix_bad.append((s, r))
            continue
        if r["error"]:
            errors.append((s, r))
            continue
        want[ref["finish"]] = want.get(ref["finish"], 0) + 1
        out_tokens += r["usage"][0] if r["usage"] else 0
        if (r["text"], r["finish"], r["usage"]) != (ref["text"], ref["finish"], ref["usage"]):
            mismatches.append((s, r))
    after = finished_counts(m)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    d = {k: int(v) for k, v in d.items() if v}
    n_cancelled = d.get("cancelled", 0)
    x = closed - n_cancelled                       # closed streams the server finished first
    kv_tokens = int(metric(m, "lazyggml:kv_cache_tokens"))
    n_cached = sum(s["n_cached"] for s in slots)
    busy = sum(s["is_processing"] for s in slots)
    near, real, shown_real, shown_near = 0, 0, [], []
    for s, r in mismatches + prefix_bad:
        is_near, lines = classify(s, refs[s.key], r)
        if r["closed"]:
            lines[0] += " (a stream closed early: its text must begin the reference)"
        near += is_near
        real += not is_near
        shown = shown_near if is_near else shown_real
        if len(shown) < 3:
            shown.append("\n".join(lines))
    fail = []
    if errors:
        fail.append(f"{len(errors)} requests failed, the first: request {errors[0][0].i}: {errors[0][1]['error']}")
    if near and not real and args.allow_near_ties:
        notes.append(f"{name}: {near} answers differ from their reference at near-ties of the logits (allowed); "
                     f"the first:\n{shown_near[0]}")
    if real or (near and not args.allow_near_ties):
        fail.append(f"{len(mismatches)} answers differ from their reference and {len(prefix_bad)} closed streams' "
                    f"texts do not begin theirs: {near} at near-ties of the logits, {real} not; the first:"
                    + "".join(f"\n{t}" for t in (shown_real + shown_near)[:3]))
    expect = {"stop": want.get("stop", 0), "length": want.get("length", 0) + x, "cancelled": n_cancelled}
    if not 0 <= x <= closed or {k: v for k, v in expect.items() if v} != d:
        fail.append(f"requests_finished grew by {d}; expected {expect} ({len(results) - closed - len(errors)} read to "
                    f"their end, {closed} closed, {len(errors)} failed)")
    if busy:
        fail.append(f"{busy} slots still busy {waited:.1f} s after the round")
    if kv_tokens != n_cached:
        fail.append(f"lazyggml:kv_cache_tokens {kv_tokens} != {n_cached}, the sum of the slots' n_cached: leaked cells")
    failures += [f"{name}: {f}" for f in fail]
    return dict(requests=len(specs), closed=closed, closed_unfinished=closed_unfinished, cancelled=n_cancelled,
                server_finished_first=x, finished=d, mismatches=len(mismatches) + len(prefix_bad), near_ties=near,
                real_mismatches=real, errors=len(errors),
                out_tokens=out_tokens, ttft=ttfts, latency_max=max(lat, default=0.0), kv_cache_tokens=kv_tokens,
                slots_n_cached=n_cached, settle_s=waited)


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


# -- main ----------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300, help="requests per round (default 300)")
    p.add_argument("--concurrency", type=int, default=32, help="client threads: requests in flight (default 32)")
    p.add_argument("--parallel", type=int, default=8, help="the server's slots, -np (default 8)")
    p.add_argument("--cancel-share", type=float, default=0.1, help="share of requests that are streams closed early (default 0.1)")
    p.add_argument("--chat-share", type=float, default=0.4, help="share of chat completions (default 0.4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the requests (default 0)")
    p.add_argument("--model", default=None, help="GGUF file to serve (default: the embedded model)")
    p.add_argument("--threads", type=int, default=2, help="the server's CPU threads, -t (default 2)")
    p.add_argument("--timeout", type=float, default=600, help="bound on the whole run, seconds (default 600)")
    p.add_argument("--request-timeout", type=float, default=120, help="bound on one request, seconds (default 120)")
    p.add_argument("--min-tokens", type=int, default=1, help="smallest max_tokens (default 1)")
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens (default 16)")
    p.add_argument("--max-words", type=int, default=10, help="most words of a random prompt (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of load, >= 2 for the memory check (default 2)")
    p.add_argument("--settle", type=float, default=5, help="seconds for the slots to go idle after a round (default 5)")
    p.add_argument("--rss-growth-mb", type=float, default=20, help="RSS growth from round 1 to the last allowed, MB (default 20)")
    p.add_argument("--rss-growth-pct", type=float, default=5, help="... or percent (default 5): either bound passes")
    p.add_argument("--allow-near-ties", action="store_true",
                   help="answers that differ from their reference at a near-tie of the logits (see NEAR_TIE) are "
                        "counted and shown but do not fail the run (default: every mismatch fails)")
    p.add_argument("--chat-template", default="short",
                   help="a server started here: 'short' (default, a few tokens), 'server' (its own) or a template")
    p.add_argument("--url", default=None, help="a running server (loopback only) instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, for the memory check")
    p.add_argument("--api-key", default=None, help="the server's API key")
    a = p.parse_args(argv)
    if not (1 <= a.requests <= 5000 and 1 <= a.concurrency <= 256 and 1 <= a.parallel <= 64 and 0 <= a.cancel_share <= 1
            and 0 <= a.chat_share <= 1 and 1 <= a.min_tokens <= a.max_tokens and a.max_words >= 1 and a.rounds >= 1
            and 0 < a.timeout <= 7200):
        p.error("out of range: 1 <= requests <= 5000, 1 <= concurrency <= 256, 1 <= parallel <= 64, shares in [0, 1], "
                "1 <= min-tokens <= max-tokens, rounds >= 1, 0 < timeout <= 7200")
    return a


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.timeout
    server = None
    try:
        if args.url is None:
            server = LocalServer(args)
            url = server.url
            print(f"server: pid {server.pid}: {' '.join(server.cmd[1:])}", flush=True)
        else:
            url = args.url.rstrip("/")
        return run(args, url, server, deadline)
    except Exception as e:            # RunError, or the server's HTTP failing outside the load
        print(f"load_serve: cannot run: {type(e).__name__}: {e}", file=sys.stderr)
        if server is not None:
            print(f"--- server log ---\n{server.tail()}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()


def run(args, url, server, deadline):
    import openai
    api = HTTP(url, args.api_key)
    wait_ready(api, server, deadline)
    print(f"server ready after {time.time() - (deadline - args.timeout):.1f} s", flush=True)
    props = api.json("GET", "/props")
    n_ctx_slot, n_slots = props["n_ctx_slot"], props["total_slots"]
    client = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0,
                           timeout=args.request_timeout)
    rng = random.Random(args.seed)
    specs = make_specs(args, rng, n_ctx_slot)
    t0 = time.perf_counter()
    refs = references(client, specs, deadline)
    t_refs = time.perf_counter() - t0
    print(f"{len(refs)} reference answers (distinct requests, one at a time) in {t_refs:.1f} s; "
          f"slots {n_slots} of {n_ctx_slot} tokens", flush=True)
    failures, notes, rounds, rss = [], [], [], []
    for k in range(args.rounds):
        before = finished_counts(api.metrics())
        results, wall = run_round(client, specs, args, rng, deadline)
        slots, m, waited = settle(api, args.settle)
        st = check_round(f"round {k + 1}", specs, refs, results, before, m, slots, waited, args, failures, notes)
        st["wall_s"] = wall
        st["rss_mb"] = server.rss_mb() if server is not None else (_rss(args.pid) if args.pid else None)
        rounds.append(st)
        rss.append(st["rss_mb"])
        print(f"round {k + 1}: {st['requests']} requests in {wall:.1f} s, {st['out_tokens'] / wall:.0f} output tok/s, "
              f"{st['closed']} closed ({st['cancelled']} cancelled), {st['mismatches']} mismatches, "
              f"{st['errors']} errors; idle after {waited:.2f} s, KV {st['kv_cache_tokens']} cells = "
              f"{st['slots_n_cached']} cached; RSS {_mb(st['rss_mb'])}", flush=True)
    growth = growth_pct = None
    if len(rss) >= 2 and rss[0] is not None:
        growth = rss[-1] - rss[0]
        growth_pct = 100 * growth / rss[0]
        if growth >= args.rss_growth_mb and growth_pct >= args.rss_growth_pct:
            failures.append(f"RSS grew {growth:.1f} MB ({growth_pct:.1f} %) from round 1 to round {len(rss)} "
                            f"(limits {args.rss_growth_mb:g} MB or {args.rss_growth_pct:g} %)")
    summary = summarize(args, rounds, refs, t_refs, growth, growth_pct, failures, n_slots)
    print_summary(summary, failures, notes)
    return 1 if failures else 0


def _rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def _mb(x):
    return "n/a" if x is None else f"{x:.1f} MB"


def summarize(args, rounds, refs, t_refs, growth, growth_pct, failures, n_slots):
    ttft = [t for r in rounds for t in r["ttft"]]
    wall = sum(r["wall_s"] for r in rounds)
    out = sum(r["out_tokens"] for r in rounds)
    return {
        "requests": sum(r["requests"] for r in rounds), "rounds": len(rounds), "concurrency": args.concurrency,
        "parallel": n_slots, "distinct": len(refs), "reference_s": round(t_refs, 2),
        "closed": sum(r["closed"] for r in rounds), "closed_unfinished": sum(r["closed_unfinished"] for r in rounds),
        "cancelled": sum(r["cancelled"] for r in rounds),
        "server_finished_first": sum(r["server_finished_first"] for r in rounds),
        "mismatches": sum(r["mismatches"] for r in rounds), "near_ties": sum(r["near_ties"] for r in rounds),
        "real_mismatches": sum(r["real_mismatches"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds), "latency_max_s": round(max(r["latency_max"] for r in rounds), 2),
        "wall_s": round(wall, 2), "output_tokens": out, "output_tok_s": round(out / wall, 1) if wall else None,
        "ttft_p50_ms": round(1000 * pct(ttft, 50), 1) if ttft else None,
        "ttft_p95_ms": round(1000 * pct(ttft, 95), 1) if ttft else None,
        "kv_leak": [r["kv_cache_tokens"] - r["slots_n_cached"] for r in rounds],
        "busy_after": [r["settle_s"] for r in rounds],
        "rss_mb": [None if r["rss_mb"] is None else round(r["rss_mb"], 1) for r in rounds],
        "rss_growth_mb": None if growth is None else round(growth, 2),
        "rss_growth_pct": None if growth_pct is None else round(growth_pct, 2),
        "near_ties_allowed": args.allow_near_ties, "failures": len(failures), "ok": not failures,
    }


def print_summary(s, failures, notes):
    print("\n== summary ==")
    print(f"requests        {s['requests']} ({s['rounds']} rounds; {s['distinct']} distinct, references in "
          f"{s['reference_s']} s); {s['concurrency']} concurrent, {s['parallel']} slots")
    print(f"cancelled       {s['closed']} streams closed early ({s['closed_unfinished']} before their last chunk): "
          f"{s['cancelled']} ended 'cancelled' on the server, {s['server_finished_first']} the server had finished first")
    print(f"mismatches      {s['mismatches']}: {s['near_ties']} at near-ties of the logits, {s['real_mismatches']} not "
          f"(near-ties {'allowed' if s['near_ties_allowed'] else 'fail'}); errors {s['errors']}")
    print(f"wall time       {s['wall_s']} s of load; {s['output_tokens']} output tokens, {s['output_tok_s']} tok/s; "
          f"slowest request {s['latency_max_s']} s")
    print(f"TTFT (streams)  p50 {s['ttft_p50_ms']} ms, p95 {s['ttft_p95_ms']} ms")
    print(f"KV cells leaked {s['kv_leak']} per round (kv_cache_tokens - sum of n_cached)")
    print(f"RSS             {s['rss_mb']} MB after each round; growth {s['rss_growth_mb']} MB "
          f"({s['rss_growth_pct']} %)")
    for n in notes:
        print(f"note: {n}")
    for f in failures:
        print(f"FAILED: {f}")
    print("result          " + ("ok" if not failures else f"{len(failures)} checks failed"))
    print("SUMMARY " + json.dumps(s), flush=True)


if __name__ == "__main__":
    sys.exit(main())
