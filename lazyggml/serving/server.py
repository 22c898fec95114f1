"""``lazyggml serve``: an OpenAI-compatible HTTP server over the continuous-batching ``Engine``
(what llama.cpp's ``llama-server`` offers, on FastAPI and uvicorn).

Endpoints (llama-server's names and JSON):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI's requests and answers, streamed
  as server-sent events (``data: {...}`` chunks ending with ``data: [DONE]``) when ``stream`` is
  true; ``usage`` in every answer (in the last chunk with ``stream_options.include_usage``). Chat
  renders the conversation with the file's chat template (``--chat-template`` overrides it; a file
  without one gets ChatML, as llama-server does). ``response_format`` (``json_object`` or
  ``json_schema``) constrains the answer to JSON (``grammar.py``, llguidance).
* ``GET /v1/models``, ``GET /health`` (503 while the model loads), ``POST /tokenize``,
  ``POST /detokenize``, ``GET /props``, ``GET /slots``, ``GET /metrics`` (Prometheus' text format).

Errors are OpenAI's error objects: 400 for a bad request (malformed JSON, a field of the wrong type or
out of range, a prompt longer than a slot's context), 401 for a missing or wrong API key (every
endpoint but ``/health`` asks for ``Authorization: Bearer KEY`` when ``--api-key`` is given), 503
while loading or when ``--max-queue`` requests wait already, 500 when generation failed.

A client that disconnects cancels its request: a streamed one when its stream is torn down, a
plain one within half a second (its handler watches the connection while it waits); the engine
frees the slot at its next step.

The model runs on the engine's thread; the event loop only parses, renders and forwards events, so
HTTP never waits for a decode step and a step never waits for a client.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..chat import ChatTemplate, ChatTemplateError, tokenize_chat
from .engine import Done, Engine, QueueFull
from .grammar import GrammarFactory
from .params import SamplingParams

__all__ = ["ServerState", "create_app", "CHATML"]

#: the template of a file that has none (llama-server's fallback too)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
POLL_S = 0.5          # how often a waiting plain request checks that its client is still there


class APIError(Exception):
    """An error answered as OpenAI's error object."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             500: "server_error", 503: "unavailable_error"}

    def __init__(self, status, message, param=None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self):
        return JSONResponse({"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                                       "param": self.param, "code": self.status}}, status_code=self.status)


class ServerState:
    """What the app serves: ``load()`` returns ``(model, template or None)`` and runs on a thread of
    its own, so the server answers ``/health`` (503) while it loads; then an ``Engine`` with
    ``n_parallel`` slots starts."""

    def __init__(self, load, n_parallel=4, api_key=None, max_queue=256, model_name="lazyggml"):
        self.load, self.n_parallel, self.api_key = load, n_parallel, api_key
        self.max_queue, self.model_name = max_queue, model_name
        self.engine = self.model = self.template = self.grammars = None
        self.load_error = None
        self.created = int(time.time())

    def start(self):
        def run():
            try:
                model, template = self.load()
                self.template = template or ChatTemplate(CHATML, where="ChatML (the file has no chat template)")
                self.grammars = GrammarFactory(model.tokenizer)
                self.engine = Engine(model, self.n_parallel, max_queue=self.max_queue).start()
                self.model = model
            except Exception as e:          # said by /health and the log; the process keeps serving it
                self.load_error = f"{type(e).__name__}: {e}"
        self._loader = threading.Thread(target=run, name="lazyggml-load", daemon=True)
        self._loader.start()
        return self

    def ready(self):
        if self.model is None:
            raise APIError(503, f"the model failed to load: {self.load_error}" if self.load_error else "Loading model")
        return self.engine


# -- reading a request ---------------------------------------------------------------------------------
def _field(body, name, kinds, default=None, check=None, why=""):
    """``body[name]`` of one of the types ``kinds`` (bool is not a number here), else 400."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise APIError(400, f"'{name}' must be {why or ' or '.join(k.__name__ for k in kinds)}, got {v!r}", name)
    if check is not None and not check(v):
        raise APIError(400, f"'{name}' is out of range: {v!r} ({why})", name)
    return v


def _params(body, max_tokens_default, logprobs):
    num = (int, float)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise APIError(400, "'stop' must be a string or a list of strings", "stop")
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise APIError(400, "'logit_bias' must be an object of token id -> bias", "logit_bias")
    try:
        bias = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise APIError(400, "'logit_bias' keys must be token ids and values numbers", "logit_bias") from None
    if _field(body, "n", (int,), 1) != 1:
        raise APIError(400, "'n' must be 1: one choice per request (send several requests: they run in parallel)", "n")
    max_tokens = _field(body, "max_completion_tokens", (int,), None) or _field(body, "max_tokens", (int,), None)
    p = SamplingParams(
        max_tokens=max_tokens_default if max_tokens is None else max_tokens,
        temperature=float(_field(body, "temperature", num, 0.8)),
        top_k=_field(body, "top_k", (int,), 40),
        top_p=float(_field(body, "top_p", num, 0.95)),
        min_p=float(_field(body, "min_p", num, 0.05)),
        seed=_field(body, "seed", (int,), None),
        repeat_penalty=float(_field(body, "repeat_penalty", num, 1.0)),
        repeat_last_n=_field(body, "repeat_last_n", (int,), 64),
        frequency_penalty=float(_field(body, "frequency_penalty", num, 0.0)),
        presence_penalty=float(_field(body, "presence_penalty", num, 0.0)),
        logit_bias=bias, stop=stop or [], logprobs=logprobs,
        ignore_eos=bool(_field(body, "ignore_eos", (bool,), False)))
    return p


async def _json_body(request, state):
    """The request's JSON object, once the model is loaded (else 503)."""
    state.ready()
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


# -- answers --------------------------------------------------------------------------------------------
class _Answer:
    """Builds one request's OpenAI objects (chat or completion) from the engine's events."""

    def __init__(self, state, chat, req):
        self.state, self.chat, self.req = state, chat, req
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{req.id}"
        self.created = int(time.time())
        self.tk = state.model.tokenizer

    def _piece(self, tok):
        return self.tk.token_to_piece(tok).decode("utf-8", errors="replace")

    def logprobs(self, toks):
        """OpenAI's log-probabilities of tokens ``toks`` (``Token`` events): chat's or completions'."""
        if not toks or toks[0].logprobs is None:
            return None
        if self.chat:
            def entry(i, lp):
                s = self._piece(i)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [dict(entry(t.id, t.logprobs["logprob"]),
                                     top_logprobs=[entry(i, lp) for i, lp in t.logprobs["top"]]) for t in toks]}
        return {"tokens": [self._piece(t.id) for t in toks],
                "token_logprobs": [t.logprobs["logprob"] for t in toks],
                "top_logprobs": [{self._piece(i): lp for i, lp in t.logprobs["top"]} for t in toks]}

    def choice(self, text, finish, toks, delta=False):
        c = {"index": 0, "finish_reason": finish, "logprobs": self.logprobs(toks)}
        if self.chat:
            c["delta" if delta else "message"] = ({"content": text} if delta else {"role": "assistant", "content": text})
        else:
            c["text"] = text
        return c

    def obj(self, choices, usage=None, chunk=False):
        o = {"id": self.id, "object": ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else ""),
             "created": self.created, "model": self.state.model_name, "choices": choices}
        if usage is not None:
            o["usage"] = usage
        return o


def _raise_failed(done):
    if done.finish_reason == "error":
        raise APIError(500, f"generation failed: {done.error}")


async def _complete(state, http, req, chat):
    """The whole answer, once done; the request is cancelled if the client goes away meanwhile."""
    ans = _Answer(state, chat, req)
    text, toks = [], []
    while True:
        try:
            ev = await asyncio.wait_for(req.next_event(), POLL_S)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                req.cancel()
            continue
        text.append(ev.text)
        if isinstance(ev, Done):
            _raise_failed(ev)
            return JSONResponse(ans.obj([ans.choice("".join(text), ev.finish_reason, toks)], ev.usage))
        toks.append(ev)


def _stream(state, req, chat, include_usage):
    """The answer as server-sent events; a client gone (the generator closed) cancels the request."""
    ans = _Answer(state, chat, req)

    def sse(o):
        return f"data: {json.dumps(o, ensure_ascii=False)}\n\n"

    async def events():
        done = None
        try:
            if chat:    # OpenAI's first chunk names the role
                yield sse(ans.obj([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None, "logprobs": None}], chunk=True))
            async for ev in req.aevents():
                if isinstance(ev, Done):
                    done = ev
                    if ev.finish_reason == "error":
                        yield sse({"error": {"message": f"generation failed: {ev.error}", "type": "server_error",
                                             "code": 500}})
                        break
                    yield sse(ans.obj([ans.choice(ev.text, ev.finish_reason, [], delta=True)], chunk=True))
                    if include_usage:
                        yield sse(ans.obj([], ev.usage, chunk=True))
                elif ev.text or ev.logprobs is not None:
                    yield sse(ans.obj([ans.choice(ev.text, None, [ev], delta=True)], chunk=True))
            yield "data: [DONE]\n\n"
        finally:
            if done is None:
                req.cancel()
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# -- the app ----------------------------------------------------------------------------------------------
def create_app(state):
    """The FastAPI app serving ``state`` (a ``ServerState``; its ``start()`` is called at startup)."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start()
        yield
        if state.engine is not None:
            state.engine.stop()

    app = FastAPI(title="lazyggml", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request, e):
        return e.response()

    @app.middleware("http")
    async def auth(request, call_next):
        if state.api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {state.api_key}":
                return APIError(401, "invalid or missing API key (Authorization: Bearer KEY)").response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        state.ready()
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        state.ready()
        hp = state.model.hp
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "lazyggml",
                                            "meta": {"n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train,
                                                     "n_embd": hp.n_embd, "n_layer": hp.n_layer}}]}

    async def submit(body, prompt, chat):
        eng = state.ready()
        if chat:
            logprobs = _field(body, "top_logprobs", (int,), 0) if _field(body, "logprobs", (bool,), False) else None
        else:
            logprobs = _field(body, "logprobs", (int,), None)
            if _field(body, "echo", (bool,), False):
                raise APIError(400, "'echo' is not supported", "echo")
        params = _params(body, None if chat else 16, logprobs)
        try:
            constraint = state.grammars.from_response_format(body.get("response_format"))
            return eng.submit(prompt, params, constraint, loop=asyncio.get_running_loop())
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def answer(http, body, prompt, chat):
        stream = _field(body, "stream", (bool,), False)
        opts = _field(body, "stream_options", (dict,), {})
        req = await submit(body, prompt, chat)
        if stream:
            return _stream(state, req, chat, bool(opts.get("include_usage")))
        return await _complete(state, http, req, chat)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(http: HTTPRequest):
        body = await _json_body(http, state)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = state.model.tokenize(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
        return await answer(http, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(http: HTTPRequest):
        body = await _json_body(http, state)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
        messages = [dict(m, content=_content(m.get("content"))) for m in messages]
        try:
            text = state.template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        return await answer(http, body, tokenize_chat(state.model.tokenizer, text), chat=True)

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        body = await _json_body(http, state)
        content = _field(body, "content", (str,), None)
        if content is None:
            raise APIError(400, "'content' (a string) is required", "content")
        add_special = _field(body, "add_special", (bool,), False)
        return {"tokens": state.model.tokenizer.tokenize(content, add_special=add_special, parse_special=True)}

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest):
        body = await _json_body(http, state)
        toks = body.get("tokens")
        n = state.model.hp.n_vocab
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n
                                                 for t in toks):
            raise APIError(400, f"'tokens' must be a list of token ids in 0..{n - 1}", "tokens")
        return {"content": state.model.tokenizer.detokenize(toks)}

    @app.get("/props")
    async def props():
        eng = state.ready()
        d = SamplingParams()
        return {"model_path": state.model.path, "total_slots": len(eng.slots), "n_ctx": state.model.n_ctx,
                "n_ctx_slot": eng.n_ctx_slot, "chat_template": state.template.source,
                "default_generation_settings": {k: getattr(d, k) for k in (
                    "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                    "frequency_penalty", "presence_penalty")}}

    @app.get("/slots")
    async def slots():
        return state.ready().slot_states()

    registry = CollectorRegistry()
    registry.register(_EngineMetrics(state))

    @app.get("/metrics")
    async def metrics():
        state.ready()
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    return app


def _content(c):
    """A message's content as text: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts."""
    if c is None or isinstance(c, str):
        return c or ""
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    raise APIError(400, "a message's 'content' must be a string or a list of text parts", "messages")


class _EngineMetrics:
    """Prometheus metrics read from the engine when scraped (llama-server's names, ``lazyggml:``)."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        e = self.state.engine
        if e is None:
            return
        kv = self.state.model.kv
        yield from (
            CounterMetricFamily("lazyggml:prompt_tokens", "prompt tokens decoded", value=e.n_prompt_tokens),
            CounterMetricFamily("lazyggml:prompt_seconds", "seconds of steps spent on prompt tokens", value=e.t_prompt),
            CounterMetricFamily("lazyggml:tokens_predicted", "tokens generated", value=e.n_gen_tokens),
            CounterMetricFamily("lazyggml:tokens_predicted_seconds", "seconds of steps spent on generated tokens",
                                value=e.t_gen),
            CounterMetricFamily("lazyggml:n_decode", "decode steps (batches)", value=e.n_steps),
            GaugeMetricFamily("lazyggml:requests_processing", "requests in a slot", value=e.busy),
            GaugeMetricFamily("lazyggml:requests_deferred", "requests waiting for a slot", value=len(e.waiting)),
            GaugeMetricFamily("lazyggml:kv_cache_tokens", "KV cache cells in use", value=kv.n_used),
            GaugeMetricFamily("lazyggml:kv_cache_usage_ratio", "share of KV cache cells in use",
                              value=kv.n_used / kv.size))
        done = CounterMetricFamily("lazyggml:requests_finished", "requests ended, by finish reason",
                                   labels=["finish_reason"])
        for reason, n in sorted(e.n_requests.items()):
            done.add_metric([reason], n)
        yield done

