"""The KV cache (``models/kv_cache.py``): its cells as llama.cpp's unified cache keeps them, the
masks and indices it gives a graph, and a context shift (``seq_rm`` + ``seq_add``, whose keys are
rotated again before the next batch) against llama.cpp's on the same file."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import lazyggml as lg
from lazyggml.backends.cpu import simd
from lazyggml.models.inputs import UBatch
from lazyggml.models.kv_cache import KVCache
from llama_cpp_oracle import nmse, run_llama_cpp

DEFAULT_GGUF = lg.models.default_model_path()


@pytest.fixture(scope="module")
def hp():
    return lg.HParams.from_metadata(lg.read_gguf(DEFAULT_GGUF).metadata)


def cache(hp, size=16, n_seq_max=4, v_trans=False):
    cpu = lg.backend_cpu_init()
    return KVCache(hp, size, [cpu] * (hp.n_layer + 1), v_trans, n_seq_max)


def batch(kv, pos, seq=0, pad=4):
    pos = np.asarray(pos, np.int32)
    return kv.prepare(UBatch(np.zeros(len(pos), np.int32), pos, np.full(len(pos), seq, np.int32)), pad)


class _Capture:
    """A stand-in input in host memory (``view``, or None): what a ``set_input_*`` writes."""
    def __init__(self, n=None):
        self.view = None if n is None else np.full(n, np.nan)

    def write(self, data):
        self.data = np.asarray(data)
        if self.view is not None:
            self.view[...] = self.data.reshape(-1)


def mask_of(kv, ub, swa=False):
    """The mask written in place (a decode step of a growing sequence writes only the cells it
    changes), the same as written whole."""
    inp, whole = _Capture(ub.n_tokens * ub.n_kv), _Capture()
    fill = kv.set_input_kq_mask_swa if swa else kv.set_input_kq_mask
    fill(inp, ub)
    fill(whole, ub)
    mask = inp.view.reshape(ub.n_tokens, ub.n_kv)
    assert np.array_equal(mask, whole.data.reshape(mask.shape))
    return mask


def test_a_growing_sequence_takes_cells_in_order_and_sees_its_past(hp):
    kv = cache(hp)
    ub = batch(kv, [0, 1, 2])
    assert ub.cells.tolist() == [0, 1, 2] and ub.n_kv == 4
    assert mask_of(kv, ub).tolist() == [[0, -np.inf, -np.inf, -np.inf], [0, 0, -np.inf, -np.inf], [0, 0, 0, -np.inf]]
    ub = batch(kv, [3, 4])
    assert ub.cells.tolist() == [3, 4] and ub.n_kv == 8
    assert kv.seq_pos_max(0) == 4 and kv.seq_pos_min(0) == 0 and kv.n_used == 5
    idx = _Capture()
    kv.set_input_k_idxs(idx, ub)
    assert idx.data.tolist() == [3, 4]


def test_seq_rm_frees_cells_that_the_next_batch_takes_first(hp):
    """llama.cpp's find_slot: from the first freed cell on, the free cells in order (not contiguous)."""
    kv = cache(hp)
    batch(kv, range(8))
    kv.seq_rm(0, 2, 4)
    assert kv.pos[:8].tolist() == [0, 1, -1, -1, 4, 5, 6, 7] and kv.head == 2 and kv.n_used == 6
    ub = batch(kv, [8, 9, 10])
    assert ub.cells.tolist() == [2, 3, 8]
    kv.seq_rm(0, 5, -1)
    assert kv.seq_pos_max(0) == 4 and kv.used_max_p1 == 5


def test_split_cells_keeps_each_sequence_in_its_range_in_position_order(hp):
    """A server's slots (``split_cells``): cells another sequence freed below a sequence's own are not
    handed to it, so its cells stay in position order; a full range is refused though others are free."""
    kv = cache(hp, size=16, n_seq_max=4)
    kv.split_cells(2)                                   # sequence 0: cells 0-7, sequence 1: cells 8-15
    mixed = UBatch(np.zeros(5, np.int32), np.array([0, 0, 1, 1, 2], np.int32), np.array([1, 0, 1, 0, 1], np.int32))
    assert kv.prepare(mixed, 4).cells.tolist() == [8, 0, 9, 1, 10]
    kv.seq_rm(0, 1, -1)                                 # sequence 0 keeps its first token only
    assert batch(kv, [3], seq=1).cells.tolist() == [11]          # not cell 1, freed below its own
    assert batch(kv, [1, 2, 3], seq=0).cells.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="no room for 5 tokens in their sequences' ranges"):
        batch(kv, [4, 5, 6, 7, 8], seq=1)               # 4 cells left in its range, 4 in the other's
    with pytest.raises(ValueError, match="needs an empty cache"):
        kv.split_cells(4)
    kv.clear()
    kv.split_cells(None)                                # the shared cache again
    assert batch(kv, [0, 1], seq=1).cells.tolist() == [0, 1]
    with pytest.raises(ValueError, match="sequence 3 has no cells"):
        kv.clear()
        kv.split_cells(2)
        batch(kv, [0], seq=3)


def test_sequences_share_cells_and_see_only_their_own(hp):
    """seq_cp shares a prefix without copying; each token's mask shows its own sequence's cells;
    seq_keep drops every other sequence; a cell is empty once no sequence owns it."""
    kv = cache(hp)
    batch(kv, [0, 1, 2])
    kv.seq_cp(0, 1, 0, 2)                       # sequence 1 shares positions 0 and 1
    b1 = batch(kv, [2], seq=1)
    assert b1.cells.tolist() == [3]
    assert mask_of(kv, b1).tolist() == [[0, 0, -np.inf, 0]]
    b0 = batch(kv, [3], seq=0)
    assert mask_of(kv, b0).tolist() == [[0, 0, 0, -np.inf, 0, -np.inf, -np.inf, -np.inf]]
    kv.seq_rm(0)                                # cells 0 and 1 stay: sequence 1 owns them
    assert kv.pos[:5].tolist() == [0, 1, -1, 2, -1] and kv.seq_pos_max(0) == -1
    kv.seq_cp(1, 2)
    kv.seq_keep(2)
    assert kv.pos[:4].tolist() == [0, 1, -1, 2] and kv.seq_pos_max(1) == -1 and kv.seq_pos_max(2) == 2


def test_seq_add_moves_positions_and_records_the_shift(hp):
    kv = cache(hp)
    batch(kv, range(6))
    kv.seq_rm(0, 1, 3)
    kv.seq_add(0, 3, -1, -2)
    assert kv.pos[:6].tolist() == [0, -1, -1, 1, 2, 3] and kv.has_shift
    assert kv.shift[:6].tolist() == [0, 0, 0, -2, -2, -2]
    kv.seq_add(0, 0, 2, -1)                     # position 0 -> -1: gone; 1 -> 0
    assert kv.pos[:6].tolist() == [-1, -1, -1, 0, 2, 3] and kv.head == 0
    kv.shift_done()
    assert not kv.has_shift and not kv.shift.any()


def test_sliding_window_mask_hides_cells_n_swa_back(hp):
    kv = cache(dataclasses.replace(hp, n_swa=3))
    ub = batch(kv, range(5), pad=8)
    m = mask_of(kv, ub, swa=True)
    seen = [np.flatnonzero(row == 0).tolist() for row in m]
    assert seen == [[0], [0, 1], [0, 1, 2], [1, 2, 3], [2, 3, 4]]
    assert kv.linear == 0                       # a decode step's row, written in place
    assert np.flatnonzero(mask_of(kv, batch(kv, [5], pad=8), swa=True)[0] == 0).tolist() == [3, 4, 5]


def test_transposed_v_indices_are_a_row_per_element(hp):
    kv = cache(hp, v_trans=True)
    ub = batch(kv, [0, 1])
    inp = _Capture()
    kv.set_input_v_idxs(inp, ub)
    assert inp.data.shape == (2, hp.n_embd_v_gqa)
    assert inp.data[1, :3].tolist() == [1, 1 + kv.size, 1 + 2 * kv.size]


def test_a_full_cache_and_bad_sequences_are_refused(hp):
    kv = cache(hp, size=4, n_seq_max=2)
    batch(kv, range(3))
    with pytest.raises(ValueError, match="no room for 2 tokens"):
        batch(kv, [3, 4])
    with pytest.raises(ValueError, match="sequence 2 is outside"):
        kv.seq_cp(0, 2)
    with pytest.raises(ValueError, match="n_seq_max"):
        cache(hp, n_seq_max=65)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "rm", "cp", "keep", "shift"]), st.integers(0, 2),
                          st.integers(0, 2), st.integers(-1, 12), st.integers(-1, 12)), max_size=12))
def test_cells_follow_a_plain_model_of_them(hp, script):
    """Random sequences of batches and seq_* calls against a dictionary model of the cells (cell ->
    [pos, set of sequences]): the same positions and owners, and each token's mask is "its sequence,
    at a position up to its own"."""
    kv = cache(hp, size=24, n_seq_max=3)
    ref = {}
    for op, s, t, a, b in script:
        if op == "add":
            n = 1 + (a % 3)
            if kv.size - len(ref) < n:
                continue
            p0 = kv.seq_pos_max(s) + 1
            ub = batch(kv, range(p0, p0 + n), seq=s)
            for c, p in zip(ub.cells.tolist(), ub.pos.tolist()):
                assert c not in ref
                ref[c] = [p, {s}]
            m = mask_of(kv, ub)
            for i, p in enumerate(ub.pos.tolist()):
                want = [j < ub.n_kv and j in ref and s in ref[j][1] and ref[j][0] <= p for j in range(ub.n_kv)]
                assert (m[i] == 0).tolist() == want
        elif op == "rm":
            kv.seq_rm(s, a, b)
            for c in list(ref):
                if (a < 0 or ref[c][0] >= a) and (b < 0 or ref[c][0] < b):
                    ref[c][1].discard(s)
                    if not ref[c][1]:
                        del ref[c]
        elif op == "cp":
            kv.seq_cp(s, t, a, b)
            for c in ref:
                if s in ref[c][1] and (a < 0 or ref[c][0] >= a) and (b < 0 or ref[c][0] < b):
                    ref[c][1].add(t)
        elif op == "keep":
            kv.seq_keep(s)
            ref = {c: [p, {s}] for c, (p, seqs) in ref.items() if s in seqs}
        else:
            delta = a - 6
            kv.seq_add(s, 0, b, delta)
            if delta:
                for c in list(ref):
                    if s in ref[c][1] and (b < 0 or ref[c][0] < b):
                        ref[c][0] += delta
                        if ref[c][0] < 0:
                            del ref[c]
        assert {c: int(kv.pos[c]) for c in np.flatnonzero(kv.pos >= 0)} == {c: p for c, (p, _) in ref.items()}
        for c, (_, seqs) in ref.items():
            assert {q for q in range(3) if int(kv.seqs[c]) >> q & 1} == seqs
        for q in range(3):
            owned = [p for p, seqs in ref.values() if q in seqs]
            assert kv.seq_pos_max(q) == (max(owned) if owned else -1)


#: whether llama.cpp's GGML runs the AVX2 code lazyggml follows (test_llama_cpp.py): then its bits
BITS = simd.HAVE_AVX2 and "fma" in simd._FEATURES and not simd.HAVE_AVX512


@pytest.fixture(scope="module")
def shifted(tmp_path_factory):
    """llama.cpp's logits after a context shift on the embedded model, with and without flash
    attention: 40 tokens, the 16 after the first 4 removed and the rest moved back, then 8 more."""
    d = tmp_path_factory.mktemp("shift")
    rng = np.random.default_rng(7)
    case = dict(first=rng.integers(3, 1000, 40).tolist(), n_keep=4, n_discard=16, then=rng.integers(3, 1000, 8).tolist())
    out = {"case": case}
    for fa in (True, False):
        npy = str(d / f"fa{fa}.npy")
        run_llama_cpp(dict(reference=False, flash_attn=fa, shift=[dict(path=str(DEFAULT_GGUF), n_ctx=256, out=npy,
                                                                        **case)]), d, f"shift-fa{fa}")
        out[fa] = np.load(npy)
    return out


@pytest.mark.parametrize("flash_attn", [True, False])
def test_context_shift_matches_llama_cpp(shifted, flash_attn):
    """seq_rm + seq_add, then a batch: the moved keys rotated back by 16 positions (the K shift), the
    new tokens in the freed cells first: llama.cpp's logits, bit for bit where its build runs GGML's
    AVX2 code; without the shift they are far off."""
    case = shifted["case"]
    model = lg.load_model(DEFAULT_GGUF, n_ctx=256, n_threads=2, flash_attn=flash_attn)
    model.eval(case["first"])
    keep, discard = case["n_keep"], case["n_discard"]
    model.kv.seq_rm(0, keep, keep + discard)
    model.kv.seq_add(0, keep + discard, -1, -discard)
    assert model.n_past == len(case["first"]) - discard
    ours = model.eval(case["then"])
    theirs = shifted[flash_attn]
    if BITS:
        assert np.array_equal(ours, theirs), f"NMSE {nmse(ours, theirs):.3g}"
    else:
        assert nmse(ours, theirs) < 1e-5
    model.reset()                                # the same, but the keys left unrotated
    model.eval(case["first"])
    model.kv.seq_rm(0, keep, keep + discard)
    model.kv.seq_add(0, keep + discard, -1, -discard)
    model.kv.shift_done()
    assert nmse(model.eval(case["then"]), theirs) > 1e-4
