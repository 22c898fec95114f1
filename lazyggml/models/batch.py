"""A batch of tokens from many sequences (llama.cpp's ``llama_batch`` and its ``llama_batch_allocr``).

A ``Batch`` is what ``Model.decode`` runs: tokens, each with its position, the sequence it extends
and whether its logits are wanted. Serving many users from one model is one batch per step: a
token for every sequence that is generating, plus chunks of the prompts that wait (issue 43).

``split(batch, n_batch)`` checks the batch against the KV cache (token ids in the vocabulary,
sequence ids in range, each sequence's positions continuing the ones the cache holds, without
gaps) and cuts it into micro-batches (``UBatch``) of at most ``n_batch`` tokens in batch order,
llama.cpp's ``split_simple`` for its unified cache: every token of a micro-batch sees the cells
of its own sequence (``KVCache``'s mask), so sequences never mix, whatever they share a graph with.

A token belongs to one sequence here; a prompt shared by several sequences is run for one and
given to the others with ``KVCache.seq_cp`` (no copy: the cells gain owners), which is what
llama.cpp's multi-sequence tokens do too.
"""
from __future__ import annotations

import numpy as np

from .inputs import UBatch

__all__ = ["Batch", "split"]


class Batch:
    """Tokens to decode: ``add(token, pos, seq_id, logits)`` one at a time (llama.cpp's
    ``common_batch_add``), or all at once from sequences of equal length (``Batch(tokens, pos,
    seq_id, logits)``). ``Model.decode`` returns the logits of the tokens with ``logits`` set, in
    batch order; ``output_rows()`` says which token each row is."""

    def __init__(self, tokens=(), pos=(), seq_id=(), logits=()):
        self.tokens = [int(t) for t in tokens]
        self.pos = [int(p) for p in pos]
        self.seq_id = [int(s) for s in seq_id] if len(seq_id) else [0] * len(self.tokens)
        self.logits = [bool(x) for x in logits] if len(logits) else [False] * len(self.tokens)
        if not len(self.tokens) == len(self.pos) == len(self.seq_id) == len(self.logits):
            raise ValueError(f"Batch: {len(self.tokens)} tokens, {len(self.pos)} positions, "
                             f"{len(self.seq_id)} sequence ids and {len(self.logits)} logits flags")

    def add(self, token, pos, seq_id=0, logits=False):
        """Append one token of sequence ``seq_id`` at position ``pos``; returns self."""
        self.tokens.append(int(token))
        self.pos.append(int(pos))
        self.seq_id.append(int(seq_id))
        self.logits.append(bool(logits))
        return self

    def clear(self):
        """No tokens (the batch is reused for the next step)."""
        self.tokens.clear()
        self.pos.clear()
        self.seq_id.clear()
        self.logits.clear()

    def __len__(self):
        return len(self.tokens)

    def output_rows(self):
        """For each row of ``Model.decode``'s logits, the index of its token in the batch."""
        return [i for i, x in enumerate(self.logits) if x]


def split(batch, n_batch, kv, n_vocab):
    """``batch`` checked against the KV cache ``kv`` and a vocabulary of ``n_vocab``, cut into
    ``UBatch``es of at most ``n_batch`` tokens (each with ``out_ids``: its tokens whose logits are
    wanted). ValueError naming the first bad token otherwise."""
    n = len(batch)
    if n == 0:
        raise ValueError("decode: the batch has no tokens")
    tokens = np.asarray(batch.tokens, np.int64)
    seq = np.asarray(batch.seq_id, np.int64)
    pos = np.asarray(batch.pos, np.int64)
    checks = (("token id", tokens, (tokens < 0) | (tokens >= n_vocab), f"the vocabulary of {n_vocab}"),
              ("sequence id", seq, (seq < 0) | (seq >= kv.n_seq_max), f"0..{kv.n_seq_max - 1} (n_seq_max)"),
              ("position", pos, pos < 0, "0 and up"))
    for what, values, bad, limit in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"decode: token {i} of the batch has {what} {int(values[i])}, outside {limit}")
    # each sequence's tokens continue its cells' positions one by one (llama.cpp's batch allocr check)
    next_pos = {}
    for i in range(n):
        s, p = int(seq[i]), int(pos[i])
        want = next_pos.get(s, int(kv.pos_max[s]) + 1)
        if p != want:
            raise ValueError(f"decode: token {i} of the batch is at position {p} of sequence {s}, whose next "
                             f"position is {want} (positions of a sequence continue the cache's without gaps)")
        next_pos[s] = p + 1
    if n > kv.size - kv.n_used:
        raise ValueError(f"decode: {n} tokens do not fit the KV cache ({kv.size - kv.n_used} of {kv.size} cells free)")
    wants = np.asarray(batch.logits, bool)
    out = []
    for i0 in range(0, n, n_batch):
        sl = slice(i0, i0 + n_batch)
        ids = np.flatnonzero(wants[sl]).astype(np.int32)
        out.append(UBatch(tokens[sl].astype(np.int32), pos[sl].astype(np.int32), seq[sl].astype(np.int32),
                          None if len(ids) == len(wants[sl]) else ids))
    return out
