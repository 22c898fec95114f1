"""Sampling: each filter of llama.cpp's chain on hand-computed cases, the chain's order, seeds, and the
distribution of the draws."""
import numpy as np
import pytest

from lazyggml.sampling import Sampler, greedy, min_p, softmax, temperature, top_k, top_p

PROBS = np.array([0.05, 0.5, 0.15, 0.3])  # sorted: ids 1, 3, 2, 0
LOGITS = np.log(PROBS).astype(np.float32)
IDS = np.arange(4)


def test_greedy_and_softmax():
    assert greedy(LOGITS) == 1
    assert greedy(np.array([1.0, 3.0, 3.0])) == 1  # first of equal maxima
    np.testing.assert_allclose(softmax(LOGITS), PROBS, rtol=1e-6)
    np.testing.assert_array_equal(softmax(np.array([0.0, -np.inf])), [1.0, 0.0])


def test_top_k():
    ids, logits = top_k(IDS, LOGITS, 2)
    assert ids.tolist() == [1, 3] and logits.tolist() == LOGITS[[1, 3]].tolist()
    assert top_k(IDS, LOGITS, 0)[0].tolist() == [1, 3, 2, 0]   # k <= 0: all, sorted
    assert top_k(IDS, LOGITS, 10)[0].tolist() == [1, 3, 2, 0]
    assert top_k(IDS, np.array([1.0, 2.0, 2.0, 0.0]), 2)[0].tolist() == [1, 2]  # ties: lower id first
    assert top_k(IDS, np.array([2.0, 1.0, 1.0, 1.0]), 3)[0].tolist() == [0, 1, 2]
    big = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    ids, logits = top_k(np.arange(big.size), big, 40)
    assert ids.tolist() == np.argsort(-big, kind="stable")[:40].tolist()


@pytest.mark.parametrize("p, kept", [(0.4, [1]), (0.5, [1]), (0.75, [1, 3]), (0.81, [1, 3, 2]),
                                     (0.99, [1, 3, 2, 0]), (1.0, [1, 3, 2, 0]), (0.0, [1])])
def test_top_p(p, kept):
    assert top_p(IDS, LOGITS, p)[0].tolist() == kept


@pytest.mark.parametrize("p, kept", [(0.0, [1, 3, 2, 0]), (0.09, [1, 3, 2, 0]), (0.11, [1, 3, 2]),
                                     (0.35, [1, 3]), (0.7, [1]), (1.0, [1])])
def test_min_p(p, kept):
    # keeps probability >= p * 0.5
    assert min_p(IDS, LOGITS, p)[0].tolist() == kept


def test_temperature():
    ids, logits = temperature(IDS, LOGITS, 2.0)
    assert ids.tolist() == [1, 3, 2, 0]
    np.testing.assert_allclose(logits, LOGITS[[1, 3, 2, 0]] / 2)
    assert temperature(IDS, LOGITS, 0.0)[0].tolist() == [1]
    assert temperature(IDS, LOGITS, -1.0)[0].tolist() == [1]


def test_chain_order_top_p_before_temperature():
    """A high temperature flattens the distribution, but over the tokens top-p chose on the raw
    logits (llama.cpp's order), so the unlikely tokens stay out."""
    s = Sampler(temp=100.0, top_k=0, top_p=0.75, min_p=0.0, seed=0)
    assert s.candidates(LOGITS)[0].tolist() == [1, 3]
    draws = {s.sample(LOGITS) for _ in range(200)}
    assert draws == {1, 3}
    s = Sampler(temp=1.0, top_k=3, top_p=1.0, min_p=0.35, seed=0)
    assert s.candidates(LOGITS)[0].tolist() == [1, 3]


def test_greedy_sampler_and_seeds():
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((20, 50)).astype(np.float32)
    g = Sampler(temp=0.0, seed=1)
    assert [g.sample(r) for r in rows] == [int(np.argmax(r)) for r in rows]
    assert g.sample(np.array([1.0, 3.0, 3.0, -np.inf], np.float32)) == 1    # the first of equal maxima
    assert Sampler(top_k=1, seed=3).sample(rows[0]) == int(np.argmax(rows[0]))
    a, b, c = (Sampler(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=s) for s in (7, 7, 8))
    seq_a = [a.sample(r) for r in rows]
    assert seq_a == [b.sample(r) for r in rows] != [c.sample(r) for r in rows]


def test_draws_follow_the_distribution():
    s = Sampler(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    n = 10000
    counts = np.bincount([s.sample(LOGITS) for _ in range(n)], minlength=4)
    np.testing.assert_allclose(counts / n, PROBS, atol=0.02)
    # temperature 0.5 squares the probabilities (renormalised)
    s = Sampler(temp=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=43)
    counts = np.bincount([s.sample(LOGITS) for _ in range(n)], minlength=4)
    np.testing.assert_allclose(counts / n, PROBS**2 / (PROBS**2).sum(), atol=0.02)


def test_defaults_and_errors():
    s = Sampler()
    assert (s.temp, s.top_k, s.top_p, s.min_p) == (0.8, 40, 0.95, 0.05)  # llama.cpp's defaults
    assert s.sample(np.array([0.0, -np.inf, 1.0], dtype=np.float32)) in (0, 2)
    for bad in ([], [np.nan, 1.0], [-np.inf, -np.inf]):
        with pytest.raises(ValueError, match="logits"):
            Sampler().sample(np.array(bad, dtype=np.float32))
    with pytest.raises(ValueError, match="top_p"):
        Sampler(top_p=1.5)
    with pytest.raises(ValueError, match="temp"):
        Sampler(temp=float("inf"))


def _numpy_chain(sampler, x):
    """The chain and the draw written with NumPy calls alone (the form before they were compiled)."""
    ids, logits = top_k(np.arange(x.size), x, sampler.top_k)
    if sampler.top_p < 1.0:
        n = max(1, int(np.searchsorted(np.cumsum(softmax(logits)), sampler.top_p)) + 1)
        ids, logits = ids[:n], logits[:n]
    if sampler.min_p > 0.0:
        n = max(1, int(np.count_nonzero(logits >= logits[0] + np.float32(np.log(sampler.min_p)))))
        ids, logits = ids[:n], logits[:n]
    if sampler.temp <= 0.0 or len(ids) == 1:
        return int(ids[0])
    cdf = np.cumsum(softmax(logits / np.float32(sampler.temp)))
    return int(ids[min(int(np.searchsorted(cdf, sampler.rng.random() * cdf[-1], side="right")), len(ids) - 1)])


def test_sample_equals_the_chain_in_numpy():
    """``sample`` (the chain's arithmetic compiled) picks the token that the chain written with NumPy
    picks, with the same seed: over temperatures, k, p, min-p, ties, and the cases that keep one
    candidate."""
    rng = np.random.default_rng(3)
    for trial in range(300):
        x = (rng.standard_normal(512) * rng.uniform(0.5, 6)).astype(np.float32)
        if trial % 5 == 0:
            x[rng.integers(0, 512, 20)] = x.max()
        kw = dict(temp=float(rng.choice([0.0, 0.3, 0.8, 1.5])), top_k=int(rng.choice([0, 1, 5, 40, 2000])),
                  top_p=float(rng.choice([0.5, 0.95, 1.0])), min_p=float(rng.choice([0.0, 0.05, 0.3])))
        a, b = Sampler(seed=trial, **kw), Sampler(seed=trial, **kw)
        for _ in range(3):
            assert a.sample(x) == _numpy_chain(b, x), (trial, kw)
