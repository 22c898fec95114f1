"""A graph's inputs and outputs as objects (llama.cpp's ``llm_graph_input_i`` and ``llama_ubatch``).

A micro-batch (``UBatch``) is the tokens one graph computes: each token's id, position and
sequence, and, once the KV cache found room for them, the cell each one's key and value go to
(``cells``) and the window of cells attention reads (``n_kv``).

A ``GraphInput`` is one input tensor of a graph together with how a micro-batch fills it
(``fill(inp, ubatch)``, which writes through ``inp.write`` or the host view ``inp.view``), so a step
is ``for inp in inputs: inp.set_input(ubatch)``: the graph's builder makes the token and position
inputs, the KV cache its cell indices and masks (``kv_cache.py``). A ``GraphTensor`` is read or
written in place where the scheduler put it in host memory: a decode step writes a few small
inputs and reads one row of logits, and through ``tensor_set`` / ``tensor_get`` (checks,
conversions, copies) that cost ~70 µs, an eighth of the 3.7M model's step. A tensor on a device
goes through them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import host_layout, host_view, tensor_get, tensor_set
from ..tensor import set_input

__all__ = ["UBatch", "GraphTensor", "GraphInput"]


@dataclass
class UBatch:
    """The tokens of one graph (llama.cpp's ``llama_ubatch``): ``tokens``, ``pos`` and ``seq_id``
    (int32, one sequence per token), ``out_ids`` (int32: the tokens whose logits the graph computes,
    in order; None for every token), then the KV cache's ``cells`` (int64, where each token's key and
    value go) and ``n_kv`` (the window of cells attention reads), set by ``KVCache.prepare``."""
    tokens: np.ndarray
    pos: np.ndarray
    seq_id: np.ndarray
    out_ids: np.ndarray = None
    cells: np.ndarray = None
    n_kv: int = 0

    def __post_init__(self):
        self.n_tokens = len(self.tokens)
        s = int(self.seq_id[0])
        #: the one sequence of every token, or None when they belong to several
        self.one_seq = s if self.n_tokens == 1 or (self.seq_id == s).all() else None

    @property
    def n_outputs(self):
        """Rows of logits the graph computes."""
        return self.n_tokens if self.out_ids is None else len(self.out_ids)


class GraphTensor:
    """A graph tensor written or read in place in host memory once the graph is allocated (``bind``)."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.view = None   # a flat host view, when the tensor is contiguous in host memory

    def bind(self):
        """Take the host view of the tensor where the scheduler allocated it (after ``alloc_graph``)."""
        t = self.tensor
        v = host_view(t) if t.data_buffer().is_host() else None
        self.view = v.reshape(-1) if v is not None and v.flags.c_contiguous else None
        return self

    def write(self, data):
        """The tensor = the elements of ``data`` in order, converted to the tensor's element type."""
        if self.view is not None:     # one NumPy call for a row (a decode step writes four)
            self.view[:] = data.reshape(-1) if data.ndim > 1 else data
        else:
            tensor_set(self.tensor, np.asarray(data, host_layout(self.tensor)[2]))

    def read(self):
        """The tensor as a 4-D array: the host view itself (copy what you keep), or a copy."""
        if self.view is not None:
            return self.view.reshape(host_layout(self.tensor)[0])
        return tensor_get(self.tensor)


class GraphInput(GraphTensor):
    """Input tensor ``tensor`` (named ``name``, flagged as a graph input) that ``fill(self, ubatch)``
    fills from each micro-batch."""

    def __init__(self, tensor, name, fill):
        super().__init__(tensor)
        tensor.name = name
        set_input(tensor)
        self.fill = fill

    def set_input(self, ubatch):
        self.fill(self, ubatch)
