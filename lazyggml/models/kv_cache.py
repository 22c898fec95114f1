"""The KV cache: GGML's unified cache (llama.cpp's ``llama_kv_cache``), its memory and its cells.

**Memory.** Per layer, on the layer's backend, K holds an F16 row of ``n_embd_k_gqa`` per cell. V
holds one too with flash attention; without it V is stored transposed (``v_trans``: row j holds
element j of every cell, llama.cpp's ``v_trans``), so that ``v^T @ kq`` reads the window's rows in
place. The cache owns that choice: its views (``get_k``, ``get_v``), its writes (``cpy_k``,
``cpy_v``: ``set_rows`` at the micro-batch's cells) and the inputs they read follow it.

**Cells.** Each cell has a position (-1: empty) and the set of sequences that own it (a bit per
sequence, ``n_seq_max`` up to 64), so sequences can share a prefix's cells (``seq_cp``), lose
some (``seq_rm``, ``seq_keep``) or move (``seq_add``: a context shift; the keys are rotated again by
the difference before the next batch, ``has_shift``), as llama.cpp's ``llama_memory_seq_*``. A
micro-batch takes empty cells from ``head`` on (``prepare``, llama.cpp's ``find_slot`` and
``apply_ubatch``); attention reads the first ``n_kv`` cells (every used one, padded so that graphs
repeat) under a mask that shows token i the cells of its sequence at positions up to its own (and,
on sliding-window layers, fewer than ``n_swa`` back). A single sequence that only grows takes cells
0, 1, 2 ... at positions 0, 1, 2 ...

**Cells per sequence.** ``split_cells(n)`` gives sequences 0..n-1 a range of ``size // n`` cells
each (a server's slots): a sequence's tokens then take the first empty cells of its own range.
Flash attention adds a query's cells in cell order (into an F16 accumulator, as GGML does), so a
sequence whose cells are not in position order gets different rounding (logits off by up to ~0.05);
in the shared cache, cells another sequence freed would be handed to whichever sequence asks next.
Within its own range, a sequence that only loses its tail (``seq_rm(s, p, -1)``, what a server's
prompt cache does) keeps its cells in position order, so its logits are those of its run alone.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..alloc import alloc_ctx_tensors_from_buft
from ..tensor import Context
from ..types import Type
from .inputs import GraphInput

__all__ = ["KVCache", "KVInput", "N_SEQ_MAX"]

N_SEQ_MAX = 64   # sequences a cell can belong to: one bit each in a uint64


class KVInput:
    """The attention inputs of one graph (llama.cpp's ``llm_graph_input_attn_kv``): where the
    micro-batch's keys and values go (``k_idxs``; ``v_idxs`` for a transposed V) and the masks, the
    causal one (``kq_mask``) and the sliding-window layers' (``kq_mask_swa``), each None where no
    layer needs it. ``inputs`` lists those that exist, for the graph's step loop."""

    def __init__(self, kv, ctx, n_tokens, n_kv, mask_type):
        hp = kv.hp
        swa = [hp.is_swa(il) for il in range(hp.n_layer)]
        self.k_idxs = GraphInput(ctx.new_tensor_1d(Type.I64, n_tokens), "inp_kv_idxs", kv.set_input_k_idxs)
        self.v_idxs = (GraphInput(ctx.new_tensor_1d(Type.I64, n_tokens * hp.n_embd_v_gqa), "inp_v_idxs",
                                  kv.set_input_v_idxs) if kv.v_trans else None)
        self.kq_mask = None if all(swa) else GraphInput(ctx.new_tensor_2d(mask_type, n_kv, n_tokens),
                                                        "inp_kq_mask", kv.set_input_kq_mask)
        self.kq_mask_swa = GraphInput(ctx.new_tensor_2d(mask_type, n_kv, n_tokens), "inp_kq_mask_swa",
                                      kv.set_input_kq_mask_swa) if any(swa) else None
        self.inputs = [i for i in (self.k_idxs, self.v_idxs, self.kq_mask, self.kq_mask_swa) if i is not None]

    def mask(self, swa):
        """The mask tensor of a layer (sliding-window or not)."""
        return (self.kq_mask_swa if swa else self.kq_mask).tensor


class KVCache:
    """The KV cache of a model of hyper-parameters ``hp``: ``size`` cells, layer ``il``'s on
    ``layer_backends[il]``, V transposed when ``v_trans`` (attention without flash attention)."""

    def __init__(self, hp, size, layer_backends, v_trans, n_seq_max=1):
        if not 1 <= n_seq_max <= N_SEQ_MAX:
            raise ValueError(f"n_seq_max must be 1 to {N_SEQ_MAX}, got {n_seq_max}")
        self.hp, self.size, self.v_trans, self.n_seq_max = hp, size, v_trans, n_seq_max
        ctxs = {}
        self.k, self.v = [], []
        for il in range(hp.n_layer):
            ctx = ctxs.setdefault(layer_backends[il], Context())
            k = ctx.new_tensor_2d(Type.F16, hp.n_embd_k_gqa, size)
            v = (ctx.new_tensor_2d(Type.F16, size, hp.n_embd_v_gqa) if v_trans else
                 ctx.new_tensor_2d(Type.F16, hp.n_embd_v_gqa, size))
            k.name, v.name = f"cache_k_l{il}", f"cache_v_l{il}"
            self.k.append(k)
            self.v.append(v)
        self.buffers = [alloc_ctx_tensors_from_buft(ctx, b.get_default_buffer_type()) for b, ctx in ctxs.items()]
        self.pos = np.empty(size, np.int32)       # each cell's position, -1 when empty
        self.seqs = np.empty(size, np.uint64)     # bit s: sequence s owns the cell
        self.shift = np.empty(size, np.int32)     # positions moved by seq_add since the keys were rotated
        self.ranges = None                        # per sequence [c0, c1) of its cells (split_cells), or None
        self.clear()

    @staticmethod
    def layer_bytes(hp, size):
        """Bytes of one layer's K and V for ``size`` cells (both F16)."""
        return 2 * size * (hp.n_embd_k_gqa + hp.n_embd_v_gqa)

    # -- cells (llama.cpp's llama_memory_seq_*) ----------------------------------------------------------
    def clear(self, data=True):
        """Every cell empty; with ``data`` the memory zeroed too (llama.cpp's ``llama_memory_clear``)."""
        self.pos[:] = -1
        self.seqs[:] = 0
        self.shift[:] = 0
        self.has_shift = False
        self.head = 0
        self.n_used = 0
        self.used_max_p1 = 0
        self.pos_max = np.full(self.n_seq_max, -1, np.int64)   # each sequence's largest position
        # the sequence whose positions 0, 1, 2 ... are exactly the used cells 0, 1, 2 ..., while one
        # does (a growing sequence): its masks are then prefixes, written without a pass over the cells
        self.linear = None
        if data:
            for buf in self.buffers:
                buf.clear(0)

    def _seq_bit(self, seq_id):
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"KV cache: sequence {seq_id} is outside 0..{self.n_seq_max - 1} (n_seq_max)")
        return np.uint64(1) << np.uint64(seq_id)

    def _owned(self, seq_id):
        return (self.seqs & self._seq_bit(seq_id)) != 0

    def _in(self, p0, p1):
        """Cells at positions in [p0, p1) (p0 < 0: from 0; p1 < 0: to the end)."""
        p0 = max(p0, 0)
        p1 = np.iinfo(np.int32).max if p1 < 0 else p1
        return (self.pos >= p0) & (self.pos < p1)

    def _changed(self, emptied):
        """Cells changed owners or positions, and those in the mask ``emptied`` are empty now: the
        next search for room starts at the first of them (llama.cpp's ``new_head``); the counts are
        taken again (these operations are rare; a micro-batch updates them as it goes)."""
        self.pos[emptied] = -1
        self.seqs[emptied] = 0
        self.shift[emptied] = 0
        freed = np.flatnonzero(emptied)
        if len(freed):
            self.head = min(self.head, int(freed[0]))
        used = np.flatnonzero(self.pos >= 0)
        self.n_used = len(used)
        self.used_max_p1 = int(used[-1]) + 1 if len(used) else 0
        for s in range(self.n_seq_max):
            p = self.pos[self._owned(s)]
            self.pos_max[s] = p.max() if len(p) else -1
        owners = np.unique(self.seqs[used])
        owner = int(owners[0]) if len(owners) == 1 else 0          # one sequence's bit, or several
        # cell = position for every used cell: cells 0, 1, 2 ... hold positions 0, 1, 2 ... and no other
        linear = owner & (owner - 1) == 0 and (used == np.arange(len(used))).all() and (
            self.pos[used] == np.arange(len(used))).all()
        self.linear = owner.bit_length() - 1 if owner and linear else None

    def seq_rm(self, seq_id, p0=-1, p1=-1):
        """Sequence ``seq_id`` (every sequence when -1) leaves its cells at positions [p0, p1); a
        cell no sequence owns becomes empty."""
        sel = self._in(p0, p1)
        if seq_id >= 0:
            bit = self._seq_bit(seq_id)
            sel &= (self.seqs & bit) != 0
            self.seqs[sel] &= ~bit
            sel &= self.seqs == 0
        self._changed(sel)

    def seq_cp(self, seq_src, seq_dst, p0=-1, p1=-1):
        """Sequence ``seq_dst`` shares ``seq_src``'s cells at positions [p0, p1) (no copy: the
        cache is unified)."""
        self.seqs[self._in(p0, p1) & self._owned(seq_src)] |= self._seq_bit(seq_dst)
        self._changed(np.zeros(self.size, bool))

    def seq_keep(self, seq_id):
        """Only sequence ``seq_id`` remains: other cells become empty."""
        mine = self._owned(seq_id)
        self.seqs[mine] = self._seq_bit(seq_id)
        self._changed(~mine & (self.pos >= 0))

    def seq_add(self, seq_id, p0, p1, delta):
        """Move sequence ``seq_id``'s cells at positions [p0, p1) by ``delta`` positions (a context
        shift); a cell moved below position 0 becomes empty. The keys are rotated by ``delta`` before
        the next batch reads them (``has_shift``)."""
        if delta == 0 or (p0 == p1 and p0 >= 0):
            return
        sel = self._in(p0, p1) & self._owned(seq_id)
        self.pos[sel] += delta
        self.shift[sel] += delta
        self.has_shift |= bool(sel.any())
        gone = sel & (self.pos < 0)
        self.head = self.size   # llama.cpp: from the first emptied cell, else from cell 0
        self._changed(gone)
        if self.head == self.size:
            self.head = 0

    def seq_pos_min(self, seq_id):
        """The smallest position of sequence ``seq_id`` in the cache, -1 if it has none."""
        p = self.pos[self._owned(seq_id)]
        return int(p.min()) if len(p) else -1

    def seq_pos_max(self, seq_id):
        """The largest position of sequence ``seq_id`` in the cache, -1 if it has none."""
        self._seq_bit(seq_id)
        return int(self.pos_max[seq_id])

    def split_cells(self, n_seq):
        """Sequences 0..n_seq-1 each take cells only from a range of ``size // n_seq`` of their own
        (the module's docstring says why); ``None``: the shared cache again. The cache must be empty."""
        if self.n_used:
            raise ValueError(f"KV cache: split_cells needs an empty cache ({self.n_used} cells are used)")
        if n_seq is None:
            self.ranges = None
            return
        if not 1 <= n_seq <= self.n_seq_max:
            raise ValueError(f"KV cache: split_cells({n_seq}): 1..{self.n_seq_max} sequences")
        step = self.size // n_seq
        self.ranges = [(s * step, (s + 1) * step) for s in range(n_seq)]

    def _find_in_ranges(self, ub):
        """Each token's cell in its sequence's range: the first empty ones, in the batch's order."""
        cells = np.empty(ub.n_tokens, np.int64)
        for s in np.unique(ub.seq_id):
            if s >= len(self.ranges):
                raise ValueError(f"KV cache: sequence {s} has no cells (split_cells gave {len(self.ranges)} "
                                 f"sequences a range)")
            c0, c1 = self.ranges[s]
            mine = np.flatnonzero(ub.seq_id == s)
            empty = np.flatnonzero(self.pos[c0:c1] < 0)
            if len(empty) < len(mine):
                return None
            cells[mine] = empty[:len(mine)] + c0
        return cells

    # -- a micro-batch --------------------------------------------------------------------------------
    def find_slot(self, n_tokens):
        """The cells for ``n_tokens`` new tokens (llama.cpp's ``find_slot``, not contiguous): the
        first empty ones from ``head`` on, round the end; from cell 0 when enough cells before
        ``head`` are free. None when fewer are empty. (A run of empty cells at the start is the
        common case, taken without a pass over the cache.)"""
        start = 0 if self.head > self.n_used + 2 * n_tokens else self.head
        if n_tokens == 1 and start < self.size and self.pos[start] < 0:
            return np.array([start], np.int64)
        if start + n_tokens <= self.size and (self.pos[start:start + n_tokens] < 0).all():
            return np.arange(start, start + n_tokens, dtype=np.int64)
        empty = np.flatnonzero(self.pos < 0)
        if len(empty) < n_tokens:
            return None
        i = np.searchsorted(empty, start)
        return np.concatenate([empty[i:], empty[:i]])[:n_tokens].astype(np.int64)

    def prepare(self, ub, pad):
        """Give micro-batch ``ub`` its cells (they are its tokens' from now on) and the window of
        cells its graph reads: every used cell, rounded up to ``pad``."""
        cells = self.find_slot(ub.n_tokens) if self.ranges is None else self._find_in_ranges(ub)
        if cells is None:
            where = "" if self.ranges is None else " in their sequences' ranges (split_cells)"
            raise ValueError(f"KV cache: no room for {ub.n_tokens} tokens{where} ({self.size - self.n_used} of "
                             f"{self.size} cells free)")
        s, n = ub.one_seq, ub.n_tokens
        in_place = int(cells[0]) == int(ub.pos[0]) if n == 1 else (cells == ub.pos).all()   # cell = position
        if (self.n_used and s != self.linear) or not in_place:
            self.linear = None
        elif not self.n_used:
            self.linear = s
        if n == 1:               # a decode step: scalars
            c, p = int(cells[0]), int(ub.pos[0])
            self.pos[c], self.seqs[c] = p, 1 << s
            self.pos_max[s] = max(self.pos_max[s], p)
            self.used_max_p1 = max(self.used_max_p1, c + 1)
        else:
            self.pos[cells] = ub.pos
            if s is not None:    # the usual batch: one sequence
                self.seqs[cells] = 1 << s
                self.pos_max[s] = max(self.pos_max[s], ub.pos.max())
            else:
                self.seqs[cells] = np.left_shift(np.uint64(1), ub.seq_id.astype(np.uint64))
                np.maximum.at(self.pos_max, ub.seq_id, ub.pos)
            self.used_max_p1 = max(self.used_max_p1, int(cells.max()) + 1)
        self.n_used += n
        self.head = int(cells[-1]) + 1
        ub.cells = cells
        ub.n_kv = min(self.size, -(-self.used_max_p1 // pad) * pad)
        return ub

    # -- the graph ------------------------------------------------------------------------------------
    def build_input(self, ctx, n_tokens, n_kv, mask_type):
        """A graph's ``KVInput`` for ``n_tokens`` tokens over ``n_kv`` cells, masks of ``mask_type``."""
        return KVInput(self, ctx, n_tokens, n_kv, mask_type)

    def get_k(self, il, n_kv):
        """Layer ``il``'s keys of the window: ``[head size, n_kv, n_head_kv]`` (a head's cells are rows)."""
        hp, k = self.hp, self.k[il]
        return ops.view_3d(k, hp.n_embd_head_k, n_kv, hp.n_head_kv, k.nb[1], k.nb[1] // hp.n_head_kv, 0)

    def get_v(self, il, n_kv):
        """Layer ``il``'s values of the window: as ``get_k``, or transposed ``[n_kv, head size,
        n_head_kv]`` (a head's elements are rows)."""
        hp, v, hd = self.hp, self.v[il], self.hp.n_embd_head_v
        if self.v_trans:
            return ops.view_3d(v, n_kv, hd, hp.n_head_kv, v.nb[1], v.nb[1] * hd, 0)
        return ops.view_3d(v, hd, n_kv, hp.n_head_kv, v.nb[1], v.nb[1] // hp.n_head_kv, 0)

    def cpy_k(self, il, k_cur, inp):
        """The node writing the batch's keys ``k_cur`` into their cells."""
        return ops.set_rows(self.k[il], ops.reshape_2d(k_cur, self.hp.n_embd_k_gqa, inp.k_idxs.tensor.ne[0]),
                            inp.k_idxs.tensor)

    def cpy_v(self, il, v_cur, inp):
        """The node writing the batch's values ``v_cur`` (``[n_embd_v_gqa, n_tokens]``, contiguous)
        into their cells; transposed, every element is a row of one (``v_idxs``: element j of token t
        goes to cell c_t of row j)."""
        v, n_v = self.v[il], self.hp.n_embd_v_gqa
        if self.v_trans:
            return ops.set_rows(ops.reshape_2d(v, 1, v.ne[0] * v.ne[1]), ops.reshape_2d(v_cur, 1, v_cur.ne[0] * v_cur.ne[1]),
                                inp.v_idxs.tensor)
        return ops.set_rows(v, ops.reshape_2d(v_cur, n_v, inp.k_idxs.tensor.ne[0]), inp.k_idxs.tensor)

    # -- inputs, filled from a micro-batch (llama.cpp's set_input_*) ----------------------------------------
    def set_input_k_idxs(self, inp, ub):
        inp.write(ub.cells)

    def set_input_v_idxs(self, inp, ub):
        inp.write(ub.cells[:, None] + self.size * np.arange(self.hp.n_embd_v_gqa))

    def _mask(self, inp, ub, n_swa):
        """Token i sees cell j when j belongs to its sequence at a position up to its own and, with
        ``n_swa``, fewer than ``n_swa`` positions back (llama.cpp's is_masked_swa, standard type)."""
        n_kv, s = ub.n_kv, ub.one_seq
        if s is not None and s == self.linear and ub.n_tokens == 1 and inp.view is not None:
            p = int(ub.pos[0])   # a growing sequence's decode step: cells (positions) lo .. p
            lo = max(p + 1 - n_swa, 0) if n_swa else 0
            inp.view[:] = -np.inf
            inp.view[lo:p + 1] = 0.0
            return
        # Per sequence of the batch, its cells (the window's cells grouped by owner set: one sort,
        # not a bit test of every cell per token), then its tokens' rows over those cells only: a
        # decode step of 32 sequences over 17,408 cells took 2.3 ms as one [tokens, cells] test
        # and 0.7 ms so; in F16, flash attention's mask type, so that its write converts nothing.
        owners = self.seqs[:n_kv]
        order = np.argsort(owners, kind="stable")
        sets, start = np.unique(owners[order], return_index=True)
        end = np.append(start[1:], n_kv)
        out = np.full((ub.n_tokens, n_kv), -np.inf, np.float16)
        for seq in ([s] if s is not None else np.unique(ub.seq_id).tolist()):
            groups = np.flatnonzero(sets & self._seq_bit(seq))
            cells = np.concatenate([order[start[g]:end[g]] for g in groups]) if len(groups) else order[:0]
            rows = np.arange(ub.n_tokens) if s is not None else np.flatnonzero(ub.seq_id == seq)
            cell_pos, pos = self.pos[cells][None, :], ub.pos[rows, None]
            seen = cell_pos <= pos
            if n_swa:
                seen &= pos - cell_pos < n_swa
            out[rows[:, None], cells[None, :]] = np.where(seen, np.float16(0), np.float16(-np.inf))
        inp.write(out)

    def set_input_kq_mask(self, inp, ub):
        self._mask(inp, ub, 0)

    def set_input_kq_mask_swa(self, inp, ub):
        self._mask(inp, ub, self.hp.n_swa)

    # -- the context shift ------------------------------------------------------------------------------
    def build_shift_input(self, ctx):
        """The K shift's input: each cell's pending position change (llama.cpp's ``inp_k_shift``)."""
        return GraphInput(ctx.new_tensor_1d(Type.I32, self.size), "inp_k_shift",
                          lambda inp, ub: inp.write(self.shift))

    def k_rows(self, il):
        """Layer ``il``'s keys, every cell: ``[head size, n_head_kv, size]`` (what the shift rotates)."""
        hp, k = self.hp, self.k[il]
        return ops.view_3d(k, hp.n_embd_head_k, hp.n_head_kv, self.size, k.nb[1] // hp.n_head_kv, k.nb[1], 0)

    def shift_done(self):
        self.shift[:] = 0
        self.has_shift = False
