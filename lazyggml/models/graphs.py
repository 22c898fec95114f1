"""A model's graphs, kept per batch shape (llama.cpp's graph reuse).

A graph is built, split and allocated once per *shape class*: (tokens in the micro-batch, KV window,
rows of logits). Each kept graph has a scheduler and compute buffers of its own; later steps of the
same shape only fill its inputs. Rebuilding one (build, split, allocate, plan, and on a GPU the
first eager run and the CUDA graph capture) costs ~5 ms for the 3.7M model on the CPU and 50-150
ms for 1B-8B models on a GPU. Prompt micro-batches (``PROMPT_GRAPHS`` of them: a prompt's
micro-batches come back in the same shapes when a conversation starts over) and single-token steps
(``DECODE_GRAPHS``: a decode graph survives a prompt and a reset in between) are kept apart, least
recently used given up first.

The compute buffers are sized once, at load, for the largest micro-batch over the whole context
(``reserve``), as llama.cpp does, so that later graphs fit without reallocating (which would
synchronize).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..sched import Scheduler

__all__ = ["GraphCache", "StepGraph", "DECODE_GRAPHS", "PROMPT_GRAPHS"]

DECODE_GRAPHS = 4  # decode graphs kept (each with a scheduler and its small compute buffers)
PROMPT_GRAPHS = 4  # prompt micro-batch graphs kept (each with a scheduler and micro-batch-sized buffers)


@dataclass
class StepGraph:
    """A built and allocated graph: its scheduler, the graph, its inputs (``GraphInput``s) and the
    logits (a ``GraphTensor``)."""
    sched: Scheduler
    graph: object
    inputs: list
    logits: object


class GraphCache:
    """The graphs of a model whose layers run on ``backends``: ``build(sched, n_tokens, n_kv,
    n_outputs)`` makes one (a built ``GraphBuilder`` whose pins are set in ``sched``); compute
    buffers are reserved for ``n_batch`` tokens over ``n_ctx`` cells; ``parallel``: prompt
    schedulers run pipeline-parallel. ``sched`` is the first one, which the scheduler statistics
    are read from."""

    def __init__(self, backends, graph_size, parallel, n_batch, n_ctx, build):
        self.backends, self.graph_size, self.parallel = backends, graph_size, parallel
        self.n_batch, self.n_ctx, self.build = n_batch, n_ctx, build
        self.sched = Scheduler(backends, graph_size=graph_size, parallel=parallel)
        self.prompt, self.decode = OrderedDict(), OrderedDict()   # key -> StepGraph
        self.free = {False: [self.sched], True: [Scheduler(backends, graph_size=graph_size)]}
        for sched, n_tokens in ((self.sched, n_batch), (self.free[True][0], 1)):
            self.reserve(sched, n_tokens)

    def reserve(self, sched, n_tokens):
        if not sched.reserve(self.build(sched, n_tokens, self.n_ctx, 1).graph):
            raise RuntimeError("the scheduler could not reserve the compute buffers")

    def alloc(self, sched, key):
        """``sched`` given over to the graph of ``key``: built, allocated, its tensors bound."""
        sched.reset()
        b = self.build(sched, *key)
        if not sched.alloc_graph(b.graph):
            raise RuntimeError("the scheduler could not allocate the graph")
        for t in (*b.inputs, b.logits):
            t.bind()
        return StepGraph(sched, b.graph, b.inputs, b.logits)

    def get(self, n_tokens, n_kv, n_outputs):
        """The graph of this shape class: built the first time, then the least recently used one of
        its kind (prompt or decode) gives up its scheduler."""
        key = (n_tokens, n_kv, n_outputs)
        decode = n_tokens == 1
        cache, limit = (self.decode, DECODE_GRAPHS) if decode else (self.prompt, PROMPT_GRAPHS)
        hit = cache.get(key)
        if hit is None:
            if self.free[decode]:
                sched = self.free[decode].pop()
            elif len(cache) < limit:
                sched = Scheduler(self.backends, graph_size=self.graph_size, parallel=self.parallel and not decode)
                self.reserve(sched, 1 if decode else self.n_batch)
            else:
                sched = cache.popitem(last=False)[1].sched
            hit = cache[key] = self.alloc(sched, key)
        cache.move_to_end(key)
        return hit
