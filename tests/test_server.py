"""``lazyggml serve`` as a user meets it: a real server process on 127.0.0.1, talked to with OpenAI's
own Python client (and plain HTTP where a client would hide the bytes): completions and chat, plain
and streamed, token counts, seeds, requests that overlap, JSON output, every bad input, a client
that goes away, Prometheus metrics. Traffic is bounded (tens of requests) and every wait has a limit.
"""
from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

KEY = "test-key"
PROMPT = "And God said"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``lazyggml serve`` process of the embedded model; stopped at the end of the module."""

    def __init__(self, *args):
        self.port = _free_port()
        self.log = tempfile.TemporaryFile("w+")          # a file, not a pipe nobody drains
        self.proc = subprocess.Popen([sys.executable, "-m", "lazyggml.cli", "serve", "--port", str(self.port),
                                      "-t", "1", *args], stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout=300):
        """Poll /health until 200; every answer before must be 503 (loading) or no connection yet."""
        t0 = time.time()
        seen = []
        while time.time() - t0 < timeout:
            assert self.proc.poll() is None, self.output()
            try:
                status, _ = self.get("/health")
                seen.append(status)
                if status == 200:
                    return seen
                assert status == 503
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the server did not get ready")

    def output(self):
        self.log.seek(0)
        return self.log.read()

    def request(self, method, path, body=None, key=KEY, raw=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        c.request(method, path, body=raw if raw is not None else (json.dumps(body) if body is not None else None),
                  headers=headers)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data

    def get(self, path, key=KEY):
        return self.request("GET", path, key=key)

    def json(self, path, body=None, method="POST", status=200, key=KEY):
        got, data = self.request(method, path, body, key=key)
        assert got == status, (data, self.output()[-3000:])
        return json.loads(data)

    def client(self, key=KEY):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=60)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def servers():
    """Two servers of the embedded model: 4 slots with an API key; 1 slot, no key; both with answers
    that do not depend on their batch-mates (``--batch-invariant``), so that seeds can be compared."""
    s4 = Server("-np", "4", "--api-key", KEY, "--batch-invariant")
    s1 = Server("-np", "1", "--batch-invariant")
    try:
        s4.seen = s4.wait_ready()
        s1.wait_ready()
        yield s4, s1
    finally:
        s4.stop()
        s1.stop()


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """A server whose answers take seconds (a random model with a context of 8192 and answers of
    thousands of tokens), one slot and a queue of one: for requests that must still be running."""
    from lazyggml.testing import make_tiny_model
    path = make_tiny_model(tmp_path_factory.mktemp("slow") / "long.gguf", n_ctx=8192, seed=3)
    s = Server(str(path), "-np", "1", "--max-queue", "1")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def srv(servers):
    return servers[0]


def test_health_models_props(srv):
    assert srv.seen[-1] == 200 and set(srv.seen) <= {200, 503}
    assert srv.json("/health", method="GET") == {"status": "ok"}
    models = srv.client().models.list().data
    assert [m.id for m in models] == ["default.gguf"]
    props = srv.json("/props", method="GET")
    assert props["total_slots"] == 4 and props["n_ctx_slot"] == props["n_ctx"] // 4
    assert "<|im_start|>" in props["chat_template"]       # the embedded model has none: ChatML


def test_completion_plain_and_streamed(srv):
    c = srv.client()
    r = c.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 12
    n_prompt = len(srv.json("/tokenize", {"content": PROMPT, "add_special": True})["tokens"])
    assert r.usage.prompt_tokens == n_prompt and r.usage.total_tokens == n_prompt + 12
    chunks = list(c.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == choice.text and choice.text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_stream_ends_with_done(srv):
    status, data = srv.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True})
    events = [e for e in data.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert all("text" in json.loads(e[6:])["choices"][0] for e in events[:-1])


def test_chat_plain_and_streamed(srv):
    c = srv.client()
    msgs = [{"role": "user", "content": "Who spoke?"}]     # ChatML's markers are many tokens of this vocabulary
    r = c.chat.completions.create(model="x", messages=msgs, max_tokens=10, temperature=0)
    m = r.choices[0].message
    assert m.role == "assistant" and m.content and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    parts = list(c.chat.completions.create(model="x", messages=msgs, max_tokens=10, temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == m.content


def test_same_seed_same_text_with_1_or_4_slots_and_under_concurrency(servers):
    s4, s1 = servers
    args = dict(model="x", prompt="In the beginning", max_tokens=16, temperature=0.9, seed=1234)
    alone = s1.client(None).completions.create(**args).choices[0].text
    c4 = s4.client()
    with cf.ThreadPoolExecutor(6) as ex:
        noise = [ex.submit(c4.completions.create, **dict(args, seed=s, prompt=f"Then {s}")) for s in range(4)]
        same = [ex.submit(c4.completions.create, **args) for _ in range(2)]
        texts = [f.result().choices[0].text for f in same]
        [f.result() for f in noise]
    assert texts == [alone, alone]
    other = c4.completions.create(**dict(args, seed=99)).choices[0].text
    assert other != alone          # the seed matters (else this test proves nothing)


def test_requests_overlap(srv):
    """Four long streams at once: /slots shows them busy together, and all finish."""
    c = srv.client()
    busy = []

    def run(i):
        return "".join(ch.choices[0].text for ch in c.completions.create(
            model="x", prompt=f"And {i}", max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    with cf.ThreadPoolExecutor(4) as ex:
        fs = [ex.submit(run, i) for i in range(4)]
        t0 = time.time()
        while not all(f.done() for f in fs) and time.time() - t0 < 60:
            busy.append(sum(s["is_processing"] for s in srv.json("/slots", method="GET")))
            time.sleep(0.01)
        [f.result() for f in fs]
    assert max(busy) >= 2


def test_json_schema_output(servers):
    srv = servers[1]      # one slot: the whole context (a JSON object is many tokens of this small vocabulary)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = srv.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "a person"}], max_tokens=150, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int)
    r = srv.client().completions.create(model="x", prompt="{", max_tokens=150, temperature=0,
                                        extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)


def test_logprobs(srv):
    r = srv.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                             temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)     # greedy: the most likely one


@pytest.mark.parametrize("body, field", [
    ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "top_p": 2}, "top_p"),
    ({"prompt": PROMPT, "n": 2}, "n"),
    ({"prompt": PROMPT, "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "stop": 3}, "stop"),
    ({"prompt": [1, 2, 10 ** 9]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "word " * 400}, "prompt"),
    ({"prompt": PROMPT, "response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_requests_are_400(srv, body, field):
    err = srv.json("/v1/completions", body, status=400)["error"]
    assert err["type"] == "invalid_request_error" and field in err["message"]


def test_bad_bodies_and_keys(srv):
    status, data = srv.request("POST", "/v1/completions", raw="{not json")
    assert status == 400 and "JSON" in json.loads(data)["error"]["message"]
    assert srv.json("/v1/chat/completions", {"messages": []}, status=400)["error"]["param"] == "messages"
    with pytest.raises(openai.AuthenticationError):
        srv.client("wrong").completions.create(model="x", prompt=PROMPT, max_tokens=1)
    assert srv.json("/v1/models", method="GET", key=None, status=401)["error"]["type"] == "authentication_error"
    assert srv.get("/health", key=None)[0] == 200       # health needs no key


def test_queue_full_is_503(slow):
    s1 = slow             # one slot, a queue of one
    long = dict(model="x", prompt=PROMPT, max_tokens=4000, temperature=0, extra_body={"ignore_eos": True})
    c = s1.client(None)
    with cf.ThreadPoolExecutor(2) as ex:
        first = ex.submit(c.completions.create, **long)
        _wait(lambda: any(s["is_processing"] for s in s1.json("/slots", method="GET")))
        second = ex.submit(c.completions.create, **dict(long, max_tokens=2))
        _wait(lambda: _metric(s1, "lazyggml:requests_deferred") == 1)
        err = s1.json("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, status=503)["error"]
        assert err["type"] == "unavailable_error"
        assert first.result().usage.completion_tokens == 4000 and second.result().usage.completion_tokens == 2


def test_disconnect_frees_the_slot(slow):
    s1 = slow
    c = http.client.HTTPConnection("127.0.0.1", s1.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 8000, "stream": True,
                                                     "ignore_eos": True}), {"Content-Type": "application/json"})
    r = c.getresponse()
    r.readline()                       # the first event arrived: the request is in its slot
    assert s1.json("/slots", method="GET")[0]["is_processing"]
    cancelled = _metric(s1, "lazyggml:requests_finished", finish_reason="cancelled")
    n0 = _metric(s1, "lazyggml:tokens_predicted")
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    _wait(lambda: not s1.json("/slots", method="GET")[0]["is_processing"], timeout=10)
    assert _metric(s1, "lazyggml:requests_finished", finish_reason="cancelled") == cancelled + 1
    assert _metric(s1, "lazyggml:tokens_predicted") - n0 < 4000        # it stopped long before its 8000 tokens


def test_metrics_parse(srv):
    srv.client().completions.create(model="x", prompt=PROMPT, max_tokens=3)
    text = srv.get("/metrics")[1].decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    value = {name: f.samples[0].value for name, f in fams.items() if f.samples}
    assert value["lazyggml:tokens_predicted"] >= 3 and value["lazyggml:prompt_tokens"] >= 1
    assert 0 <= value["lazyggml:kv_cache_usage_ratio"] <= 1
    slots = srv.json("/slots", method="GET")
    assert value["lazyggml:kv_cache_tokens"] == sum(s["n_cached"] for s in slots)     # no cell leaks


def test_tokenize_detokenize(srv):
    toks = srv.json("/tokenize", {"content": "In the beginning God"})["tokens"]
    assert toks and srv.json("/detokenize", {"tokens": toks})["content"] == "In the beginning God"
    assert srv.json("/detokenize", {"tokens": [-1]}, status=400)["error"]["param"] == "tokens"


def _wait(cond, timeout=30):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.02)


def _metric(server, name, **labels):
    """A metric's value (0 for a labelled sample not there yet)."""
    text = server.get("/metrics")[1].decode()
    fam = next(f for f in text_string_to_metric_families(text) if f.name == name)
    return next((s.value for s in fam.samples if s.labels == labels), 0)


def test_serve_without_the_extra_says_how(tmp_path):
    """Without FastAPI, ``serve`` is one line naming the pip command, exit 1."""
    (tmp_path / "fastapi.py").write_text("raise ImportError('no', name='fastapi')\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-m", "lazyggml.cli", "serve"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "pip install 'lazyggml[server]'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
