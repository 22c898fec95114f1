"""The continuous-batching engine (``lazyggml/serving/engine.py``) and the per-request sampler
(``lazyggml/serving/params.py``): requests in one batch give the tokens of their runs alone, seeds
are per request, finished prompts are reused, stop strings are cut and never streamed, limits,
cancellation, the queue, bad requests, no cells leaked, and the sampler against NumPy.

Bits. In GGML's per-column configuration with flash attention (``test_batch``'s ``per_column``,
``repack=False``) a sequence's logits are the bits of its run alone while its cells are in position
order, whatever else shares its batches; the engine gives each slot its own range of cells
(``KVCache.split_cells``), where a reused slot only loses its tail and so keeps that order. So every
request, slots reused or not, is compared with ``model.eval`` from a reset cache bit for bit: its
tokens, and its log-probabilities to 1e-9 (one float32 ulp of a logit is 1e-7). (In a shared cache,
tokens of running requests took the cells a reused slot freed, below their older ones, and flash
attention's F16 accumulator then rounded differently: measured, 7 requests on 3 slots, log-probs
up to 0.08 off and about one greedy token in 200 changed.)

The engines run on one model loaded once; references are computed before an engine is made (an
engine resets the model, and ``model.eval`` would change cells its slots hold). Requests are
submitted before ``start()`` where the test needs the schedule fixed.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

import lazyggml as lg
from lazyggml.backends.cpu import matmul, tiled
from lazyggml.serving.engine import Done, Engine, QueueFull, Token
from lazyggml.serving.params import MAX_LOGPROBS, RequestSampler, SamplingParams

DEFAULT_GGUF = lg.models.default_model_path()
TIMEOUT = 60          # seconds to wait for an event before the test fails (instead of hanging)
INF = float("inf")


@pytest.fixture(scope="module")
def model():
    """The embedded model (n_ctx 256) in the per-column configuration with flash attention."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiled, "TILED", False)
        mp.setattr(matmul, "LLAMAFILE", False)
        yield lg.load_model(DEFAULT_GGUF, n_threads=2, flash_attn=True, repack=False)


@pytest.fixture
def engines(model):
    """``make(n_parallel, n_batch, **kw)``: an engine on the model, stopped when the test ends."""
    made = []

    def make(n_parallel=4, n_batch=8, **kw):
        made.append(Engine(model, n_parallel=n_parallel, n_batch=n_batch, **kw))
        return made[-1]
    yield make
    for e in made:
        e.stop()


def greedy(temperature=0.0, **kw):
    return SamplingParams(temperature=temperature, **kw)


def alone(model, prompt, n):
    """``prompt`` run by itself from a reset cache, greedy, as the engine's temperature 0 should
    run it: ``(tokens, rows)``, the tokens (up to ``n``; an end of generation ends them, not
    included) and the row of logits each was chosen from (float64)."""
    model.reset()
    row = model.eval(prompt)[-1]
    tokens, rows = [], []
    while True:
        t = int(np.argmax(row))
        if model.tokenizer.is_eog(t):
            break
        tokens.append(t)
        rows.append(row.astype(np.float64))
        if len(tokens) == n:
            break
        row = model.eval([t])[-1]
    return tokens, rows


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def collect(req):
    """A request's events: ``(Token events, Done)``."""
    evs = list(req.events(timeout=TIMEOUT))
    assert all(isinstance(ev, Token) for ev in evs[:-1]) and isinstance(evs[-1], Done)
    return evs[:-1], evs[-1]


def random_prompt(rng, n):
    return [1] + rng.integers(3, 1024, n - 1).tolist()        # BOS, then no special tokens


def spy_batches(monkeypatch, model):
    """Record every batch the model decodes: a list of ``(seq_ids, logits flags)``."""
    seen, decode = [], model.decode

    def spy(batch):
        seen.append((list(batch.seq_id), list(batch.logits)))
        return decode(batch)
    monkeypatch.setattr(model, "decode", spy)
    return seen


def check_cells(model, engine):
    """Each slot's sequence holds exactly the cells of its ``cache``, positions 0, 1, ...; no other."""
    kv = model.kv
    assert kv.n_used == sum(len(s.cache) for s in engine.slots)
    for s in engine.slots:
        mine = (kv.seqs & (np.uint64(1) << np.uint64(s.id))) != 0
        assert sorted(kv.pos[mine].tolist()) == list(range(len(s.cache))), f"slot {s.id}"


# -- 1. requests together give the tokens of their runs alone ------------------------------------------

def test_requests_in_one_batch_give_the_tokens_and_logits_of_their_runs_alone(model, engines, monkeypatch):
    """Four prompts of different lengths on four slots, n_batch 8: the 21-token prompt takes three
    steps beside the other slots' tokens; every token, log-probability and usage is the run alone's."""
    rng = np.random.default_rng(0)
    lens, max_tokens = (5, 21, 2, 13), (12, 7, 16, 9)
    prompts = [random_prompt(rng, n) for n in lens]
    refs = [alone(model, p, k) for p, k in zip(prompts, max_tokens)]
    seen = spy_batches(monkeypatch, model)
    e = engines(n_parallel=4, n_batch=8)
    reqs = [e.submit(p, greedy(max_tokens=k, logprobs=3)) for p, k in zip(prompts, max_tokens)]
    e.start()
    for req, p, k, (tokens, rows) in zip(reqs, prompts, max_tokens, refs):
        events, done = collect(req)
        assert [ev.id for ev in events] == tokens
        assert done.finish_reason == ("length" if len(tokens) == k else "stop")
        assert done.usage == {"prompt_tokens": len(p), "completion_tokens": len(tokens),
                              "total_tokens": len(p) + len(tokens), "prompt_tokens_details": {"cached_tokens": 0}}
        for ev, row in zip(events, rows):
            lp = log_softmax(row)
            top = np.argsort(-lp, kind="stable")[:3]
            assert [i for i, _ in ev.logprobs["top"]] == top.tolist()
            assert np.allclose([v for _, v in ev.logprobs["top"]], lp[top], rtol=0, atol=1e-9)
            assert abs(ev.logprobs["logprob"] - lp[ev.id]) <= 1e-9
    # the long prompt (slot 1) went in chunks, beside tokens the other slots generated (which come first)
    last = next(i for i, (seqs, flags) in enumerate(seen) if (1, True) in zip(seqs, flags))
    chunks = [seqs.count(1) for seqs, _ in seen[:last + 1]]
    assert sum(chunks) == 21 and sum(c > 0 for c in chunks) >= 3
    assert any(flags[0] and seqs[0] != 1 for seqs, flags in seen[1:last + 1])
    assert all(len(seqs) <= 8 for seqs, _ in seen)


def test_more_requests_than_slots_wait_and_reuse_the_slots(model, engines, monkeypatch):
    """Seven requests on three slots: four wait, each slot serves two or three in turn (its cells
    dropped for the next), prompts of 2 to 30 tokens cut into steps of 8 beside the others' tokens;
    still the tokens and log-probabilities of each run alone."""
    rng = np.random.default_rng(1)
    lens, max_tokens = (3, 30, 9, 17, 2, 24, 12), (9, 4, 14, 6, 11, 3, 8)
    prompts = [random_prompt(rng, n) for n in lens]
    refs = [alone(model, p, k) for p, k in zip(prompts, max_tokens)]
    seen = spy_batches(monkeypatch, model)
    e = engines(n_parallel=3, n_batch=8)
    reqs = [e.submit(p, greedy(max_tokens=k, logprobs=1)) for p, k in zip(prompts, max_tokens)]
    assert len(e.waiting) == 7
    e.start()
    for req, p, (tokens, rows) in zip(reqs, prompts, refs):
        events, done = collect(req)
        assert [ev.id for ev in events] == tokens
        assert done.usage["completion_tokens"] == len(tokens) and done.usage["prompt_tokens"] == len(p)
        for ev, row in zip(events, rows):
            assert abs(ev.logprobs["logprob"] - log_softmax(row)[ev.id]) <= 1e-9
    assert {s for seqs, _ in seen for s in seqs} == {0, 1, 2}
    assert sum(e.n_requests.values()) == 7 and not e.waiting and e.busy == 0
    check_cells(model, e)


# -- 2. seeds ----------------------------------------------------------------------------------------

def test_a_seed_gives_the_same_tokens_alone_and_beside_other_requests(model, engines):
    """Temperature 0.8: a request's draws come from its own seed, not from what else runs."""
    prompt = model.tokenize("And the LORD said unto Moses")
    eos = model.tokenizer.eos_id

    def params(seed):
        return SamplingParams(temperature=0.8, max_tokens=24, seed=seed, logit_bias={eos: -INF})
    greedy_tokens = alone(model, prompt, 24)[0]
    e = engines(n_parallel=1).start()
    one, done = collect(e.submit(prompt, params(1234)))
    one = [ev.id for ev in one]
    assert done.finish_reason == "length" and len(one) == 24
    e.stop()

    e = engines(n_parallel=4)
    others = [e.submit(prompt, params(s)) for s in (1, 2)]
    mine = e.submit(prompt, params(1234))                 # the same prompt, between other seeds
    others.append(e.submit(model.tokenize("In the beginning"), params(3)))
    e.start()
    assert [ev.id for ev in collect(mine)[0]] == one
    other_tokens = [[ev.id for ev in collect(r)[0]] for r in others]
    assert one != greedy_tokens and all(t != one for t in other_tokens)      # the draws do matter


# -- 3. prompt cache -----------------------------------------------------------------------------------

def test_a_prompt_that_extends_a_finished_one_reuses_its_cells(model, engines):
    a = model.tokenize("And the LORD said unto Moses")
    b = model.tokenize("Blessed are the poor", add_bos=False)      # no token in common with a
    answer_a = alone(model, a, 8)[0]
    extra = model.tokenize(" and the", add_bos=False)
    c = a + answer_a + extra
    answer_c = alone(model, c, 6)[0]
    assert len(answer_a) == 8 and len(answer_c) == 6 and len(alone(model, b, 5)[0]) == 5
    e = engines(n_parallel=2).start()
    collect(e.submit(b, greedy(max_tokens=5)))                   # slot 0
    events, done = collect(e.submit(a, greedy(max_tokens=8)))    # slot 1: the least recently used
    assert [ev.id for ev in events] == answer_a and done.usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert [s["n_cached"] for s in e.slot_states()] == [len(b) + 4, len(a) + 7]   # the last token never decoded

    # c extends a's prompt and answer: slot 1 (the most recently used, not the least) keeps them
    n_prompt = e.n_prompt_tokens
    events, done = collect(e.submit(c, greedy(max_tokens=6)))
    cached = len(a) + len(answer_a) - 1
    assert done.usage["prompt_tokens_details"]["cached_tokens"] == cached
    assert e.n_prompt_tokens - n_prompt == len(c) - cached           # only the new part decoded
    assert [ev.id for ev in events] == answer_c                       # the tokens of a fresh run
    assert e.slot_states()[1]["n_cached"] == len(c) + 5

    # a prompt equal to a cached prefix: its last token decoded again for its logits
    events, done = collect(e.submit(a, greedy(max_tokens=8)))
    assert done.usage["prompt_tokens_details"]["cached_tokens"] == len(a) - 1
    assert [ev.id for ev in events] == answer_a
    check_cells(model, e)


# -- 4. stop strings ---------------------------------------------------------------------------------

def streamed(events, done):
    """Each Token's text, then the Done's."""
    return [ev.text for ev in events] + [done.text]


def test_stop_strings_end_the_text_before_them_and_are_never_streamed(model, engines):
    prompt = model.tokenize("And the LORD said unto Moses")
    tokens = alone(model, prompt, 24)[0]
    assert len(tokens) == 24
    pieces = [model.tokenizer.token_to_piece(t).decode() for t in tokens]
    full = "".join(pieces)
    ends = np.cumsum([len(p) for p in pieces])
    # a stop string across two tokens: the last two characters of token k, the first two of k+1
    k = next(i for i in range(2, 20) if len(pieces[i]) >= 3 and len(pieces[i + 1]) >= 3
             and full.find(pieces[i][-2:] + pieces[i + 1][:2]) == ends[i] - 2
             and full.find(pieces[i + 1][1:3]) == ends[i] + 1)
    split = pieces[k][-2:] + pieces[k + 1][:2]
    inner = pieces[k + 1][1:3]                 # completed by the same token, but begins after split
    later = pieces[k + 3]
    assert full.find(later) > ends[k]
    never = full[-2:] + "\x00"                 # its start ends the text: held back, then released
    at_once = pieces[0]                        # the first token

    e = engines(n_parallel=4)
    reqs = {"split": e.submit(prompt, greedy(max_tokens=24, stop=[split])),
            "first": e.submit(prompt, greedy(max_tokens=24, stop=["\x01never", later, inner, split])),
            "never": e.submit(prompt, greedy(max_tokens=24, stop=[never])),
            "at_once": e.submit(prompt, greedy(max_tokens=24, stop=[at_once]))}
    e.start()
    got = {name: collect(r) for name, r in reqs.items()}

    events, done = got["split"]
    text = full[:ends[k] - 2]
    assert done.finish_reason == "stop" and "".join(streamed(events, done)) == text
    assert [ev.id for ev in events] == tokens[:k + 2]               # the token that completed it counts
    assert done.usage["completion_tokens"] == k + 2 and events[-1].text == ""
    sofar = ""
    for ev in events:                                                 # never a character of it early
        sofar += ev.text
        assert text.startswith(sofar)
    # token k's last two characters (the stop string's start) were held back, then dropped
    assert "".join(ev.text for ev in events[:k + 1]) == full[:ends[k] - 2]

    events, done = got["first"]               # the earliest of several, not the first listed
    assert done.finish_reason == "stop" and "".join(streamed(events, done)) == text

    events, done = got["never"]               # a false start is released at the end
    assert done.finish_reason == "length" and "".join(streamed(events, done)) == full
    assert done.text == full[-2:] and len(events) == 24

    events, done = got["at_once"]
    assert done.finish_reason == "stop" and streamed(events, done) == ["", ""] and len(events) == 1


class _Pieces:
    """A tokenizer with some tokens' pieces replaced (bytes a byte-level BPE vocabulary has: an
    ASCII end and the first byte of a character)."""

    def __init__(self, tokenizer, pieces):
        self._tk, self._pieces = tokenizer, pieces

    def token_to_piece(self, t):
        return self._pieces.get(t, self._tk.token_to_piece(t))

    def __getattr__(self, name):
        return getattr(self._tk, name)


def test_a_stop_string_ends_the_text_even_in_the_middle_of_a_character(model, engines):
    """The bytes after the stop string are dropped, not flushed as a replacement character."""
    tok = 500
    e = engines(n_parallel=1)
    e.tokenizer = _Pieces(model.tokenizer, {tok: b" END\xe4"})
    req = e.submit([1, 7, 8], greedy(max_tokens=4, stop=["END"], logit_bias={tok: 1e9}))
    e.start()
    events, done = collect(req)
    assert done.finish_reason == "stop" and [ev.id for ev in events] == [tok]
    assert streamed(events, done) == ["", " "]


# -- 5. lengths ----------------------------------------------------------------------------------------

def test_max_tokens_and_the_slot_context_end_with_length(model, engines):
    eos = model.tokenizer.eos_id
    rng = np.random.default_rng(5)
    e = engines(n_parallel=4)                      # 64 cells a slot
    assert e.n_ctx_slot == 64
    no_end = {eos: -INF}
    p = random_prompt(rng, 6)
    reqs = [e.submit(p, SamplingParams(max_tokens=7, seed=1, logit_bias=no_end)),
            e.submit(p, SamplingParams(max_tokens=0, seed=1)),
            e.submit(random_prompt(rng, 60), SamplingParams(seed=2, logit_bias=no_end)),         # no max_tokens
            e.submit(random_prompt(rng, 63), SamplingParams(max_tokens=50, seed=3, logit_bias=no_end))]
    e.start()
    (events, done), (events0, done0), (events60, done60), (events63, done63) = [collect(r) for r in reqs]
    assert done.finish_reason == "length" and len(events) == 7 == done.usage["completion_tokens"]
    # max_tokens 0: an empty answer, nothing sampled
    assert done0.finish_reason == "length" and events0 == [] and done0.text == ""
    assert done0.usage["completion_tokens"] == 0 and done0.usage["prompt_tokens"] == 6
    # the slot's context: every cell used (the last token sampled needs none)
    assert done60.finish_reason == "length" and len(events60) == 64 - 60 + 1 == done60.usage["completion_tokens"]
    assert done63.finish_reason == "length" and len(events63) == 2
    assert e.n_gen_tokens == (7 - 1) + (5 - 1) + (2 - 1)          # generated tokens decoded
    assert sorted(len(s.cache) for s in e.slots) == [6, 6 + 6, 64, 64]
    check_cells(model, e)


# -- 6. cancel, queue, bad requests --------------------------------------------------------------------

def long_request(model, engine, prompt):
    """A request that would run to the end of its slot's context (no end of generation)."""
    return engine.submit(prompt, SamplingParams(seed=0, logit_bias={model.tokenizer.eos_id: -INF}))


def test_cancel_frees_a_running_slot_and_drops_a_waiting_request(model, engines):
    e = engines(n_parallel=1).start()                   # 256 cells: ~250 steps to the end
    running = long_request(model, e, [1, 50, 60])
    waiting = long_request(model, e, [1, 70, 80])
    events = running.events(timeout=TIMEOUT)
    assert isinstance(next(events), Token)
    assert e.slot_states()[0]["id_task"] == running.id and list(e.waiting) == [waiting]

    waiting.cancel()                                     # ends without running
    assert collect(waiting) == ([], Done("cancelled"))
    assert e.slot_states()[0]["id_task"] == running.id
    running.cancel()
    rest = list(events)
    done = rest[-1]
    assert done.finish_reason == "cancelled" and done.text == ""
    assert done.usage["completion_tokens"] >= 1
    state = e.slot_states()[0]
    assert not state["is_processing"] and state["id_task"] is None
    # the slot serves the next request
    events, done = collect(e.submit([1, 90], greedy(max_tokens=3)))
    assert done.finish_reason == "length" and len(events) == 3
    assert e.n_requests["cancelled"] == 2
    check_cells(model, e)


def test_the_queue_is_full_at_max_queue_waiting_requests(model, engines):
    e = engines(n_parallel=2, max_queue=3)              # not started: nothing drains
    reqs = [e.submit([1, 5 + i]) for i in range(2 + 3)]  # two for the free slots, three wait
    with pytest.raises(QueueFull):
        e.submit([1, 5])
    assert len(e.waiting) == 5
    reqs[4].cancel()
    e.stop()                                             # everything that waits ends cancelled
    assert all(collect(r) == ([], Done("cancelled")) for r in reqs)


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt: no tokens"),
    ([1, 1024], "prompt: token ids [1024] are outside the vocabulary of 1024"),
    ([1, -1], "prompt: token ids [-1]"),
    ([1] * 64, "prompt: 64 tokens do not fit a slot's context of 64"),
], ids=["empty", "past_vocab", "negative", "too_long"])
def test_bad_prompts_are_refused(engines, prompt, message):
    e = engines(n_parallel=4)
    with pytest.raises(ValueError) as err:
        e.submit(prompt)
    assert message in str(err.value)
    assert not e.waiting
    e.submit([1] * 63)                                   # the longest that fits


@pytest.mark.parametrize("field, value", [
    ("max_tokens", -1), ("temperature", -0.1), ("temperature", float("nan")), ("temperature", INF),
    ("top_p", 1.5), ("top_p", -0.1), ("min_p", 1.01), ("min_p", -1.0),
    ("repeat_penalty", 0.0), ("repeat_penalty", float("nan")),
    ("frequency_penalty", 2.5), ("frequency_penalty", float("nan")), ("presence_penalty", -2.5),
    ("repeat_last_n", -2), ("seed", -1), ("seed", 2 ** 64),
    ("logit_bias", {1024: 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: float("nan")}),
    ("logit_bias", {5: INF}),
    ("logprobs", MAX_LOGPROBS + 1), ("logprobs", -1), ("stop", [""]), ("stop", ["ok", 3]),
])
def test_bad_params_are_refused_naming_the_field(engines, field, value):
    e = engines(n_parallel=4)
    with pytest.raises(ValueError) as err:
        e.submit([1, 2], SamplingParams(**{field: value}))
    assert str(err.value).startswith(f"{field}: ")
    assert not e.waiting
    good = {"max_tokens": 0, "temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.5,
            "frequency_penalty": -2.0, "presence_penalty": 2.0, "repeat_last_n": -1, "seed": 2 ** 64 - 1,
            "logit_bias": {1023: -INF}, "logprobs": MAX_LOGPROBS, "stop": ["ok"]}
    e.submit([1, 2], SamplingParams(**{field: good[field]}))          # the edge of the range is fine


# -- 7. nothing leaks ------------------------------------------------------------------------------------

def test_cells_and_slots_are_accounted_for_and_stop_cancels_everything(model, engines):
    """Step by step: prompts in chunks, a request cancelled halfway through its prompt, another while
    generating, slots reused; after every step each slot's sequence holds exactly its cached tokens."""
    rng = np.random.default_rng(7)
    e = engines(n_parallel=3, n_batch=8)
    no_end = {model.tokenizer.eos_id: -INF}
    reqs = [e.submit(random_prompt(rng, n), greedy(max_tokens=k, logit_bias=no_end))
            for n, k in ((30, 4), (5, 9), (12, 3), (20, 6), (3, 5), (9, 2))]
    for step in range(200):
        if step == 1:
            reqs[0].cancel()              # 8 of its 30 prompt tokens decoded
        if step == 6:
            reqs[1].cancel()              # generating
        if not e.step() and not e.waiting:
            break
        check_cells(model, e)
    done = [collect(r)[1] for r in reqs]
    assert [d.finish_reason for d in done] == ["cancelled", "cancelled"] + ["length"] * 4
    assert 0 < done[1].usage["completion_tokens"] < 9
    assert all(not s["is_processing"] for s in e.slot_states()) and e.busy == 0
    check_cells(model, e)

    # stop() ends what runs and what waits, and the thread
    e2 = engines(n_parallel=1)
    running, waiting = long_request(model, e2, [1, 2, 3]), long_request(model, e2, [1, 4])
    e2.start()
    events = running.events(timeout=TIMEOUT)
    assert isinstance(next(events), Token)
    e2.stop()
    assert not e2._thread.is_alive()
    assert list(events)[-1].finish_reason == "cancelled"
    assert collect(waiting) == ([], Done("cancelled"))
    assert e2.busy == 0 and not e2.waiting
    check_cells(model, e2)


# -- 8. the request sampler ----------------------------------------------------------------------------

def spied(sampler):
    """The logits ``sampler`` hands its chain (after bias and penalties) at each ``sample``."""
    seen, sample = [], sampler.chain.sample

    def spy(x):
        seen.append(np.array(x, np.float32))
        return sample(x)
    sampler.chain.sample = spy
    return seen


def test_logit_bias_forces_and_bans_tokens():
    rng = np.random.default_rng(8)
    logits = rng.normal(0, 2, 1024).astype(np.float32)
    forced = int(np.argsort(logits)[100])                 # far from the top
    rs = RequestSampler(SamplingParams(temperature=1.0, seed=0, logit_bias={forced: 1e9}))
    assert [rs.sample(logits)[0] for _ in range(20)] == [forced] * 20

    order = np.argsort(-logits, kind="stable")
    for ban in (-INF, -1e9):
        rs = RequestSampler(SamplingParams(temperature=0.0, logit_bias={int(order[0]): ban}))
        assert rs.sample(logits)[0] == order[1]
    # at a high temperature, with no filter, the banned tokens (the five best) never come
    banned = order[:5].tolist()
    hot = logits.copy()
    hot[banned] += 5.0
    rs = RequestSampler(SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0, seed=1,
                                       logit_bias={t: -INF for t in banned}))
    before = hot.copy()
    draws = [rs.sample(hot)[0] for _ in range(300)]
    assert not set(draws) & set(banned) and len(set(draws)) > 50
    assert np.array_equal(hot, before)                        # the caller's row is left alone


def penalties_reference(logits, history, last_n, repeat, freq, presence):
    """llama.cpp's penalties sampler (``llama_sampler_penalties_apply``) in float64: a token seen c > 0
    times in the last ``last_n`` tokens (-1: all, 0: none) has its logit divided by ``repeat`` when
    positive, multiplied when not, then lowered by ``c * freq + presence``."""
    x = np.asarray(logits, np.float64).copy()
    window = [] if last_n == 0 else history if last_n == -1 else history[-last_n:]
    for tok, c in collections.Counter(window).items():
        x[tok] = x[tok] * repeat if x[tok] <= 0 else x[tok] / repeat
        x[tok] -= c * freq + presence
    return x


@pytest.mark.parametrize("last_n, repeat, freq, presence", [
    (16, 1.3, 0.0, 0.0), (16, 1.0, 0.4, 0.0), (16, 1.0, 0.0, 0.7), (16, 1.3, 0.4, -0.7),
    (-1, 1.1, 0.25, 0.5), (0, 1.3, 0.4, 0.7), (64, 0.8, -0.3, 0.2),
])
def test_penalties_are_llama_cpps(last_n, repeat, freq, presence):
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 3, 1024).astype(np.float32)        # both signs
    history = rng.integers(0, 40, 80).tolist()                 # repeats; tokens only seen long ago
    bias = {int(history[-1]): -4.0, int(history[-2]): 2.5, 1000: 1.5}
    params = SamplingParams(temperature=0.0, repeat_last_n=last_n, repeat_penalty=repeat,
                            frequency_penalty=freq, presence_penalty=presence, logit_bias=bias)
    rs = RequestSampler(params, history=history)
    seen = spied(rs)
    before = logits.copy()
    rs.sample(logits)
    assert np.array_equal(logits, before)                      # the caller's row is left alone
    biased = logits.astype(np.float64)
    for t, b in bias.items():                                  # the bias comes first (llama.cpp's order)
        biased[t] += b
    want = penalties_reference(biased, history, last_n, repeat, freq, presence)
    assert np.allclose(seen[0], want, rtol=1e-6, atol=1e-5)
    assert (last_n == 0) == np.allclose(seen[0], biased, rtol=1e-6, atol=1e-5)

    # accepted tokens join the window (and push the oldest out)
    new = [int(t) for t in rng.integers(0, 40, 5)] + [1001]
    for t in new:
        rs.accept(t)
    rs.sample(logits)
    want = penalties_reference(biased, history + new, last_n, repeat, freq, presence)
    assert np.allclose(seen[1], want, rtol=1e-6, atol=1e-5)


def test_logprobs_are_the_models_distribution_with_the_top_ids_in_order():
    rng = np.random.default_rng(10)
    logits = rng.normal(0, 2, 1024).astype(np.float32)
    logits[[3, 4]] = logits.max() + 1.0                        # a tie: the lower id first
    lp = log_softmax(logits)
    order = np.argsort(-lp, kind="stable")
    for n in (0, 1, 5, MAX_LOGPROBS):
        # a bias and a penalty change what is drawn, not the reported distribution
        rs = RequestSampler(SamplingParams(seed=n, logprobs=n, logit_bias={7: 3.0}, presence_penalty=1.0),
                            history=[3, 9])
        tok, got = rs.sample(logits)
        assert got["logprob"] == pytest.approx(lp[tok], abs=1e-12)
        assert [i for i, _ in got["top"]] == order[:n].tolist()
        assert np.allclose([v for _, v in got["top"]], lp[order[:n]], rtol=0, atol=1e-12)
    assert order[:2].tolist() == [3, 4]
    assert RequestSampler(SamplingParams(seed=0)).sample(logits)[1] is None


def test_the_same_seed_gives_the_same_draws():
    rng = np.random.default_rng(11)
    rows = rng.normal(0, 1, (60, 1024)).astype(np.float32)

    def draws(seed):
        rs = RequestSampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
        out = []
        for row in rows:
            out.append(rs.sample(row)[0])
            rs.accept(out[-1])
        return out
    assert draws(42) == draws(42)
    assert draws(42) != draws(43)
