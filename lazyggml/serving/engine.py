"""Continuous batching: many requests served by one model, one ``Model.decode`` per step (what
llama.cpp's server does with its slots, ``tools/server/server.cpp``).

The engine has ``n_parallel`` *slots*; slot ``i`` is KV-cache sequence ``i`` and serves one request
at a time. Each step builds one ``Batch``:

1. one token for every slot that is generating (the token it sampled last step), logits wanted;
2. the rest of the batch, up to ``n_batch`` tokens, filled with chunks of the prompts waiting in
   slots, oldest first; only a prompt's last token wants logits.

Then one ``decode`` runs them all, and each slot whose row came back samples its next token with
its own ``RequestSampler``. A request that arrives while others generate joins the next step's
batch: nobody waits for a whole answer to finish (that is the "continuous" in the name).

Slots keep their cells after a request ends. A new request goes to the free slot whose cached tokens
share the longest prefix with its prompt (llama-server's prompt cache): those cells are kept, the
rest dropped (``kv.seq_rm``), and only the new part of the prompt is decoded; ``usage`` reports the
reused tokens as ``cached_tokens``. Each slot has ``n_ctx // n_parallel`` cells of the cache
(llama-server's per-slot context; ``KVCache.split_cells``), so a step always finds room and a
slot's cells stay in position order: with the CPU's products column by column (``lazyggml serve
--batch-invariant``) an answer is the same bits as its run alone, whatever runs beside it.

Requests wait in a queue of at most ``max_queue`` beyond the free slots (``QueueFull`` beyond, which the server answers
with 503). ``Request.cancel()`` (a client that went away) frees its slot before the next step.

Threads: ``start()`` runs steps on a thread of its own, which alone touches the model; other threads
``submit`` and read events. A request's events arrive in a thread-safe queue (``events()`` iterates
them) or, for an asyncio server, on its event loop (``submit(..., loop=...)``, then ``aevents()``).
"""
from __future__ import annotations

import asyncio
import codecs
import collections
import dataclasses
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

from ..models.batch import Batch
from .params import RequestSampler, SamplingParams

__all__ = ["Engine", "Request", "Token", "Done", "QueueFull"]

log = logging.getLogger("lazyggml.serving")


class QueueFull(RuntimeError):
    """More requests wait than the engine's ``max_queue``."""


@dataclass
class Token:
    """A sampled token: its id, the text it releases (held back while it may begin a stop string;
    "" while a UTF-8 character is incomplete) and, when asked for, its log-probabilities."""
    id: int
    text: str
    logprobs: dict | None = None


@dataclass
class Done:
    """The request ended: ``finish_reason`` is ``"stop"`` (end of generation, a stop string or a
    complete grammar), ``"length"`` (``max_tokens`` or the slot's context), ``"cancelled"`` or
    ``"error"`` (``error`` says why); ``text`` is the remaining text; ``usage`` counts tokens."""
    finish_reason: str
    text: str = ""
    usage: dict = field(default_factory=dict)
    error: str | None = None


class Request:
    """One prompt to complete (token ids) with its ``SamplingParams`` and optional grammar
    ``constraint``; made by ``Engine.submit``."""

    _ids = iter(range(1 << 62))

    def __init__(self, prompt, params, constraint=None, loop=None):
        self.id = next(Request._ids)
        self.prompt = [int(t) for t in prompt]
        self.params = params
        self.constraint = constraint
        self.created = time.time()
        self.cancelled = False
        self._loop = loop
        self._q = asyncio.Queue() if loop is not None else queue.Queue()
        self._done = threading.Event()

    def cancel(self):
        """Stop generating and free the slot (at the engine's next step)."""
        self.cancelled = True

    def _emit(self, ev):
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._q.put_nowait, ev)
            except RuntimeError:        # the loop is closed: nobody listens any more
                self.cancelled = True
        else:
            self._q.put(ev)
        if isinstance(ev, Done):
            self._done.set()

    def events(self, timeout=None):
        """The events (``Token``s, then one ``Done``) as they come, for a thread."""
        while True:
            ev = self._q.get(timeout=timeout)
            yield ev
            if isinstance(ev, Done):
                return

    async def next_event(self):
        """The next event, on the event loop the request was submitted with (safe to cancel)."""
        return await self._q.get()

    async def aevents(self):
        """The events, on the event loop the request was submitted with."""
        while True:
            ev = await self._q.get()
            yield ev
            if isinstance(ev, Done):
                return

    def result(self, timeout=None):
        """Wait for the end: ``(text, tokens, done)`` (thread-side requests only)."""
        text, tokens = [], []
        for ev in self.events(timeout):
            text.append(ev.text)
            if isinstance(ev, Token):
                tokens.append(ev.id)
        return "".join(text), tokens, ev


class _Slot:
    """A sequence of the KV cache and the request it serves."""

    def __init__(self, i):
        self.id = i
        self.cache = []           # the tokens whose cells this sequence holds, positions 0, 1, ...
        self.req = None
        self.last_used = 0.0

    def start(self, req, engine):
        self.n_cached = self._reuse(req.prompt, engine.model.kv)
        self.todo = req.prompt[self.n_cached:]      # prompt tokens still to decode
        params = req.params
        if params.ignore_eos:    # llama.cpp's ignore_eos: end-of-generation tokens may not be sampled
            eog = dict.fromkeys(engine.tokenizer.eog_ids, -float("inf"))
            params = dataclasses.replace(params, logit_bias={**params.logit_bias, **eog})
        self.sampler = RequestSampler(params, req.constraint, req.prompt)
        self.next_token = None                      # sampled, to be decoded next step
        self.n_gen = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.sent = "", 0
        self.t_start = time.perf_counter()
        self.t_first = None
        self.req = req             # last: other threads read a busy slot's fields (slot_states)

    def _reuse(self, prompt, kv):
        """Keep the cached prefix shared with ``prompt`` (at least one token is decoded again: its
        logits start the answer); drop the other cells."""
        n = min(_common_prefix(self.cache, prompt), len(prompt) - 1)
        kv.seq_rm(self.id, n, -1)
        del self.cache[n:]
        return n

    @property
    def generating(self):
        return self.req is not None and not self.todo


class Engine:
    """Continuous batching over ``model`` (a ``lazyggml.Model``) with ``n_parallel`` slots; see the
    module's docstring. ``n_batch``: tokens per step (default the model's); ``max_queue``: requests
    that may wait for a slot."""

    def __init__(self, model, n_parallel=4, n_batch=None, max_queue=256):
        n_seq_max = model.kv.n_seq_max
        if not 1 <= n_parallel <= n_seq_max:
            raise ValueError(f"n_parallel: {n_parallel} slots, the KV cache has 1..{n_seq_max} sequences")
        self.model = model
        self.tokenizer = model.tokenizer
        self.n_vocab = model.hp.n_vocab
        self.n_ctx_slot = model.n_ctx // n_parallel
        self.n_batch = n_batch or model.n_batch
        self.max_queue = max_queue
        self.slots = [_Slot(i) for i in range(n_parallel)]
        self.waiting = collections.deque()
        self._wake = threading.Condition()
        self._thread = None
        self._stopping = False
        model.reset()
        model.kv.split_cells(n_parallel)     # each slot's cells in position order: its run alone's bits
        # counters (the server's /metrics)
        self.n_prompt_tokens = 0          # prompt tokens decoded (cached ones not counted)
        self.n_gen_tokens = 0
        self.n_requests = collections.Counter()    # by finish reason
        self.n_steps = 0
        self.t_prompt = 0.0               # seconds of steps, shared by their tokens
        self.t_gen = 0.0

    # -- requests -------------------------------------------------------------------------------------
    def submit(self, prompt, params=None, constraint=None, loop=None):
        """Queue a request for ``prompt`` (token ids); returns its ``Request``. ValueError for a
        prompt that is empty, has ids outside the vocabulary or does not fit a slot's context, or
        bad ``params``; ``QueueFull`` when ``max_queue`` requests wait already."""
        params = (params or SamplingParams()).check(self.n_vocab)
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt: no tokens")
        bad = [t for t in prompt if not 0 <= t < self.n_vocab]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:5]} are outside the vocabulary of {self.n_vocab}")
        if len(prompt) >= self.n_ctx_slot:
            raise ValueError(f"prompt: {len(prompt)} tokens do not fit a slot's context of {self.n_ctx_slot} "
                             f"(n_ctx {self.model.n_ctx} / {len(self.slots)} slots), with room for an answer")
        req = Request(prompt, params, constraint, loop)
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine has stopped")
            free = sum(s.req is None for s in self.slots)       # read on this thread: near enough
            if len(self.waiting) - free >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests wait already (max_queue {self.max_queue})")
            self.waiting.append(req)
            self._wake.notify()
        return req

    def start(self):
        """Run steps on a thread of the engine's own until ``stop()``."""
        self._thread = threading.Thread(target=self._loop, name="lazyggml-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        """End the thread; requests still running or waiting end as ``"cancelled"``."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        for s in self.slots:
            if s.req is not None:
                self._finish(s, "cancelled")
        while self.waiting:
            self._done(self.waiting.popleft(), Done("cancelled"))

    def _loop(self):
        while True:
            with self._wake:
                while not self._stopping and not self.waiting and all(s.req is None for s in self.slots):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:     # a step that fails ends its requests, not the server
                log.exception("engine step failed")
                for s in self.slots:
                    if s.req is not None:
                        self._finish(s, "error", error=f"{type(e).__name__}: {e}")
                self.model.reset()
                for s in self.slots:
                    s.cache.clear()

    @property
    def busy(self):
        return sum(s.req is not None for s in self.slots)

    def slot_states(self):
        """Each slot: its id, whether it is busy, the request's id, and token counts."""
        out = []
        for s in self.slots:
            r = s.req
            out.append({"id": s.id, "is_processing": r is not None, "id_task": None if r is None else r.id,
                        "n_ctx": self.n_ctx_slot, "n_cached": len(s.cache),
                        "n_prompt_tokens": 0 if r is None else len(r.prompt),
                        "n_decoded": 0 if r is None else s.n_gen})
        return out

    # -- a step ---------------------------------------------------------------------------------------
    def step(self):
        """Admit waiting requests to free slots, decode one batch, sample; returns the tokens decoded."""
        self._drop_cancelled()
        self._admit()
        batch = Batch()
        rows = []                  # (slot, is a generated token) per token whose logits come back
        for s in self.slots:
            if s.generating:
                batch.add(s.next_token, len(s.cache), s.id, logits=True)
                rows.append(s)
        n_gen = len(batch)
        for s in sorted((s for s in self.slots if s.req is not None and s.todo), key=lambda s: s.req.created):
            room = self.n_batch - len(batch)
            if room <= 0:
                break
            chunk = s.todo[:room]
            for j, t in enumerate(chunk):
                last = j == len(chunk) - 1 and len(chunk) == len(s.todo)
                batch.add(t, len(s.cache) + j, s.id, logits=last)
            if len(chunk) == len(s.todo):
                rows.append(s)
        if not len(batch):
            return 0
        t0 = time.perf_counter()
        logits = self.model.decode(batch)
        dt = time.perf_counter() - t0
        n_prompt = len(batch) - n_gen
        self.t_gen += dt * n_gen / len(batch)
        self.t_prompt += dt * n_prompt / len(batch)
        self.n_prompt_tokens += n_prompt
        self.n_gen_tokens += n_gen
        self.n_steps += 1
        for t, s in zip(batch.tokens, batch.seq_id):      # the cells now hold these tokens
            self.slots[s].cache.append(t)
        self._advance_prompts(batch)
        for s, row in zip(rows, logits):
            self._sample(s, row)
        return len(batch)

    def _advance_prompts(self, batch):
        """Drop the prompt tokens this batch decoded from their slots' ``todo``."""
        n = collections.Counter(batch.seq_id)
        for s in self.slots:
            if s.req is not None and s.todo:
                s.todo = s.todo[n[s.id]:]

    def _drop_cancelled(self):
        with self._wake:
            keep = [r for r in self.waiting if not r.cancelled]
            gone = [r for r in self.waiting if r.cancelled]
            self.waiting = collections.deque(keep)
        for r in gone:
            self._done(r, Done("cancelled"))
        for s in self.slots:
            if s.req is not None and s.req.cancelled:
                self._finish(s, "cancelled")

    def _admit(self):
        while True:
            free = [s for s in self.slots if s.req is None]
            with self._wake:
                if not free or not self.waiting:
                    return
                req = self.waiting.popleft()
            slot = _pick_slot(free, req.prompt)
            slot.start(req, self)

    def _sample(self, s, logits):
        """Slot ``s`` has the logits of its last token: sample, release text, maybe finish."""
        if s.req.params.max_tokens == 0:    # the prompt only: an empty answer, nothing sampled
            self._finish(s, "length")
            return
        try:
            tok, lp = s.sampler.sample(logits)
            s.sampler.accept(tok)
        except ValueError as e:         # nothing left to sample (a grammar with no way on)
            self._finish(s, "error", error=str(e))
            return
        if s.t_first is None:
            s.t_first = time.perf_counter()
        p, tk = s.req.params, self.tokenizer
        if tk.is_eog(tok):
            self._finish(s, "stop")
            return
        s.n_gen += 1
        s.text += s.decoder.decode(tk.token_to_piece(tok))
        stop_at = _find_stop(s.text, s.sent, p.stop)
        if stop_at is not None:
            s.text = s.text[:stop_at]
            s.decoder.reset()               # bytes after the stop string: dropped, not flushed as U+FFFD
            s.req._emit(Token(tok, "", lp))
            self._finish(s, "stop")
            return
        end = len(s.text) - _held(s.text, s.sent, p.stop)
        s.req._emit(Token(tok, s.text[s.sent:end], lp))
        s.sent = end
        s.next_token = tok
        if s.sampler.grammar_done:
            self._finish(s, "stop")
        elif p.max_tokens is not None and s.n_gen >= p.max_tokens:
            self._finish(s, "length")
        elif len(s.cache) >= self.n_ctx_slot:     # no cell left for it in the slot's context
            self._finish(s, "length")

    def _finish(self, s, reason, error=None):
        req = s.req
        if reason in ("stop", "length"):
            s.text += s.decoder.decode(b"", final=True)
        rest = s.text[s.sent:] if reason in ("stop", "length") else ""
        n_prompt = len(req.prompt)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": s.n_gen, "total_tokens": n_prompt + s.n_gen,
                 "prompt_tokens_details": {"cached_tokens": s.n_cached}}
        s.req, s.last_used = None, time.time()
        self._done(req, Done(reason, rest, usage, error))

    def _done(self, req, done):
        self.n_requests[done.finish_reason] += 1
        req._emit(done)


#: a free slot whose cached tokens share more than this share of a new prompt serves it (llama-server's
#: --slot-prompt-similarity); otherwise the slot used least recently (one never used first), so that
#: a prompt sharing only BOS with a cache does not overwrite it
SLOT_PROMPT_SIMILARITY = 0.5


def _pick_slot(free, prompt):
    best = max(free, key=lambda s: (_common_prefix(s.cache, prompt), -s.last_used))
    if _common_prefix(best.cache, prompt) > SLOT_PROMPT_SIMILARITY * len(prompt):
        return best
    return min(free, key=lambda s: s.last_used)


def _common_prefix(a, b):
    """How many leading tokens ``a`` and ``b`` share."""
    return len(os.path.commonprefix([a, b]))


def _find_stop(text, sent, stops):
    """Where the first stop string in the unsent text begins, or None."""
    hits = [i for i in (text.find(s, sent) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held(text, sent, stops):
    """How many characters at the end of the unsent text might begin a stop string (kept back)."""
    tail = text[sent:]
    for n in range(min(len(tail), max((len(s) for s in stops), default=0)), 0, -1):
        if any(s.startswith(tail[-n:]) for s in stops):
            return n
    return 0
