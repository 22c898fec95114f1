"""Batches of many sequences (``Model.decode``, ``models/batch.py``): B sequences in one batch give
the logits of B separate runs, prompts of different lengths, sequences that end and free their
cells, a prompt shared by several sequences, and bad batches refused with nothing changed.

Bits: in GGML's per-column configuration (``repack=False``, tiled and llamafile orders off) a
token's products do not depend on the other tokens of its batch, and flash attention visits a
query's cells one by one in cell order, skipping masked ones; so where a sequence's cells are in
the same order as in its run alone, its logits are the same bits. Without flash attention, the
soft-max and ``V^T @ KQ`` sum a row over the whole window in vector lanes, masked cells adding
zeros, so where the cells sit changes the rounding: those runs, and llama.cpp's other orders, are
compared within a tight tolerance (a token that saw another sequence's cells is off by orders of
magnitude more)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import lazyggml as lg
from lazyggml.backends.cpu import matmul, tiled

DEFAULT_GGUF = lg.models.default_model_path()
PROMPT_LENS = (7, 3, 11, 5)       # 26 tokens: one micro-batch, under flash attention's 64-row tiles
N_STEPS = 4
TOL = 1e-6                         # NMSE against the run alone where bits are not promised (mixing: ~0.1)


def nmse(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


@pytest.fixture
def per_column(monkeypatch):
    """GGML's vec_dot order for every product (as ``test_llama_cpp``'s reference configuration)."""
    monkeypatch.setattr(tiled, "TILED", False)
    monkeypatch.setattr(matmul, "LLAMAFILE", False)


def load(flash_attn, repack=False):
    return lg.load_model(DEFAULT_GGUF, n_threads=2, flash_attn=flash_attn, repack=repack)


def scripts(seed=0):
    """Each sequence's prompt and the tokens it is then given one step at a time."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 1024, n).tolist() for n in PROMPT_LENS]
    steps = [rng.integers(0, 1024, N_STEPS).tolist() for _ in PROMPT_LENS]
    return prompts, steps


def alone(model, prompt, steps):
    """The logits of one sequence run by itself from an empty cache: its prompt's, then a step's each."""
    model.reset()
    return np.concatenate([model.eval(prompt)] + [model.eval([t]) for t in steps])


def together(model, prompts, steps):
    """The same sequences in one batch: every prompt in one ``decode``, then one token of each per step;
    each sequence's logits in its own order."""
    model.reset()
    out = [[] for _ in prompts]
    batch = lg.Batch()
    for s, prompt in enumerate(prompts):
        for i, t in enumerate(prompt):
            batch.add(t, i, s, logits=True)
    rows = model.decode(batch)
    for r, i in zip(rows, batch.output_rows()):
        out[batch.seq_id[i]].append(r)
    for k in range(N_STEPS):
        batch.clear()
        for s, prompt in enumerate(prompts):
            batch.add(steps[s][k], len(prompt) + k, s, logits=True)
        for s, r in enumerate(model.decode(batch)):
            out[s].append(r)
    return [np.stack(rows) for rows in out]


@pytest.mark.parametrize("flash_attn", [True, False], ids=["fa", "no_fa"])
def test_b_sequences_in_one_batch_give_the_logits_of_b_runs_alone(per_column, flash_attn):
    model = load(flash_attn)
    prompts, steps = scripts()
    ref = [alone(model, p, st) for p, st in zip(prompts, steps)]
    got = together(model, prompts, steps)
    assert model.kv.n_used == sum(PROMPT_LENS) + N_STEPS * len(PROMPT_LENS)
    for s, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape == (PROMPT_LENS[s] + N_STEPS, model.hp.n_vocab)
        if flash_attn:
            assert np.array_equal(g, r), f"sequence {s}: not the bits of its run alone"
        else:
            assert nmse(g, r) < TOL, f"sequence {s}"


def test_as_shipped_orders_stay_within_tolerance():
    """llama.cpp's repacked and tiled orders (the default) depend on how many columns a product has,
    so a batch's sums differ from a run alone's in rounding, which the Q8_K activations and the F16
    cache can turn into a changed level: NMSE up to ~1e-5 here, as between the two orders on one
    sequence alone (5.6e-6 and 8.1e-6 for sequences 2 and 3), while another sequence's logits are
    0.2-0.3 away."""
    model = load(True, repack=True)
    prompts, steps = scripts(1)
    ref = [alone(model, p, st) for p, st in zip(prompts, steps)]
    for s, (g, r) in enumerate(zip(together(model, prompts, steps), ref)):
        assert nmse(g, r) < 1e-4, f"sequence {s}"
        assert (g.argmax(1) == r.argmax(1)).mean() > 0.9


def test_a_sequence_that_ends_frees_its_cells_for_the_next(per_column):
    model = load(True)
    prompts, steps = scripts(2)
    together(model, prompts, steps)
    used = model.kv.n_used
    model.kv.seq_rm(1)                                     # sequence 1 ends
    assert model.kv.n_used == used - PROMPT_LENS[1] - N_STEPS
    assert model.kv.seq_pos_max(1) == -1
    new_prompt = list(range(40, 49))                       # a new request takes sequence 1 again
    batch = lg.Batch(new_prompt, range(len(new_prompt)), [1] * len(new_prompt), [True] * len(new_prompt))
    for s in (0, 2, 3):                                    # beside a step of every other sequence
        batch.add(steps[s][0], PROMPT_LENS[s] + N_STEPS, s, logits=True)
    rows = model.decode(batch)
    assert model.kv.n_used == used - PROMPT_LENS[1] - N_STEPS + len(batch)
    ref = alone(model, new_prompt, [])
    assert nmse(rows[:len(new_prompt)], ref) < TOL         # its cells are the freed ones, and fresh ones
    assert (rows[:len(new_prompt)].argmax(1) == ref.argmax(1)).all()


def test_a_shared_prompt_is_copied_to_several_sequences(per_column):
    model = load(True)
    prompt = list(range(100, 113))
    nexts = [5, 17, 300]
    ref = [alone(model, prompt, [t])[-1] for t in nexts]
    model.reset()
    last = model.decode(lg.Batch(prompt, range(len(prompt)), [0] * len(prompt), [False] * 12 + [True]))
    assert last.shape == (1, model.hp.n_vocab)
    for s in (1, 2):
        model.kv.seq_cp(0, s)                              # no copy: the cells gain owners
    assert model.kv.n_used == len(prompt)
    batch = lg.Batch()
    for s, t in enumerate(nexts):
        batch.add(t, len(prompt), s, logits=True)
    got = model.decode(batch)
    for s in range(3):
        assert np.array_equal(got[s], ref[s]), f"sequence {s}"


def test_decode_of_one_sequence_is_eval(per_column):
    model = load(True)
    prompt = list(range(200, 230))
    ref = alone(model, prompt, [7, 8])
    model.reset()
    got = [model.decode(lg.Batch(prompt, range(30), [0] * 30, [True] * 30))]
    got += [model.decode(lg.Batch([t], [30 + i], [0], [True])) for i, t in enumerate((7, 8))]
    assert np.array_equal(np.concatenate(got), ref)
    assert model.n_past == 32


def test_a_batch_without_logits_returns_none_and_runs():
    model = load(True)
    out = model.decode(lg.Batch(range(10), range(10), [3] * 10))
    assert out.shape == (0, model.hp.n_vocab)
    assert model.kv.seq_pos_max(3) == 9 and model.kv.n_used == 10


@pytest.mark.parametrize("bad, message", [
    (lg.Batch(), "no tokens"),
    (lg.Batch([1, 5000], [3, 4]), "token 1 of the batch has token id 5000, outside the vocabulary of 1024"),
    (lg.Batch([1, 2], [3, 0], [0, 64]), "token 1 of the batch has sequence id 64, outside 0..63 (n_seq_max)"),
    (lg.Batch([1], [-1]), "token 0 of the batch has position -1, outside 0 and up"),
    (lg.Batch([1, 2], [3, 5]), "token 1 of the batch is at position 5 of sequence 0, whose next position is 4"),
    (lg.Batch([1, 2], [1, 2], [5, 5]), "token 0 of the batch is at position 1 of sequence 5, whose next position is 0"),
    (lg.Batch([1] * 300, range(3, 303)), "300 tokens do not fit the KV cache (253 of 256 cells free)"),
], ids=["empty", "token", "sequence", "negative", "gap", "new_sequence", "full"])
def test_a_bad_batch_is_refused_and_changes_nothing(bad, message):
    model = load(True)
    model.decode(lg.Batch([1, 2, 3], [0, 1, 2], [0, 0, 0], [False, False, True]))
    before = model.kv.pos.copy(), model.kv.seqs.copy(), model.kv.n_used
    with pytest.raises(ValueError) as e:
        model.decode(bad)
    assert message in str(e.value)
    assert np.array_equal(model.kv.pos, before[0]) and np.array_equal(model.kv.seqs, before[1])
    assert model.kv.n_used == before[2]
    assert model.decode(lg.Batch([4], [3], [0], [True])).shape == (1, 1024)   # and the model goes on


def test_batch_fields_must_agree():
    with pytest.raises(ValueError, match="3 tokens, 2 positions"):
        lg.Batch([1, 2, 3], [0, 1])


def test_the_readme_example_runs():
    readme = Path(__file__).resolve().parent.parent / "README.md"
    code = next(b for b in re.findall(r"```python\n(.*?)```", readme.read_text(), re.S) if "lg.Batch()" in b)
    env = {}
    exec(code, env)
    assert env["logits"].shape == (2, 1024)
    assert env["model"].kv.seq_pos_max(0) == 2 and env["model"].kv.seq_pos_max(1) == -1
