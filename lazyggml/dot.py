"""Graphviz drawing of a graph (in the spirit of micrograd's ``draw_dot``).

Nodes are records "name | op | type [shape]", leafs are ellipses, edges go from each source to its
consumer. Given a scheduler that split the graph, tensors are filled with their backend's colour,
each split is a box labelled with its backend and inputs, and the copies the scheduler made are
dashed ellipses fed by a dashed "copy" edge from the original.
"""
from __future__ import annotations

from .ops import op_desc
from .types import type_name

__all__ = ["graph_to_dot", "COLORS"]

COLORS = ("#a6cee3", "#fdbf6f", "#b2df8a", "#fb9a99", "#cab2d6", "#ffff99", "#1f78b4", "#33a02c")


def _q(s):
    """Text inside a quoted label."""
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _rec(s):
    """Text inside a record label, where braces, bars and angle brackets are fields and ports."""
    return "".join("\\" + c if c in "{}|<>" else c for c in _q(s))


def _shape(t):
    return "[" + ", ".join(str(n) for n in t.ne[:t.n_dims()]) + "]"


def graph_to_dot(g, sched=None):
    ids = {}

    def nid(t):
        return ids.setdefault(t, f"t{len(ids)}")

    # backend index per tensor; a scheduler copy takes the backend of the split that reads it
    where, copies, splits = {}, [], sched.splits if sched is not None else []
    if sched is not None:
        index = {id(b): i for i, b in enumerate(sched.backends)}
        for t in g.leafs + g.nodes:
            b = sched.get_tensor_backend(t)
            if b is not None:
                where[t] = index[id(b)]
        for split in splits:
            for inp in split.inputs:
                cpy = sched.get_tensor_copy(inp, split.backend_id, sched.cur_copy)
                where.setdefault(cpy, split.backend_id)
                copies.append((inp, cpy))

    def style(t, dashed=False):
        s = ["filled"] if t in where else []
        s += ["dashed"] if dashed else []
        color = f', fillcolor="{COLORS[where[t] % len(COLORS)]}"' if t in where else ""
        return f', style="{",".join(s)}"{color}' if s else ""

    lines = ["digraph G {", "  rankdir=LR;", '  node [fontname="Helvetica", fontsize=10];']
    for t in g.leafs:
        lines.append(f'  {nid(t)} [shape=ellipse, label="{_q(t.name)}\\n{type_name(t.type)} {_shape(t)}"{style(t)}];')
    for t in g.nodes:
        label = f"{_rec(t.name)} | {_rec(op_desc(t))} | {type_name(t.type)} {_shape(t)}"
        lines.append(f'  {nid(t)} [shape=record, label="{{{label}}}"{style(t)}];')
        for s in t.src:
            if s is None:
                continue
            if s not in ids:  # not in the graph: a copy the scheduler put there
                lines.append(f'  {nid(s)} [shape=ellipse, label="{_q(s.name)}"{style(s, dashed=True)}];')
            lines.append(f"  {nid(s)} -> {nid(t)};")
    for inp, cpy in copies:
        lines.append(f'  {nid(inp)} -> {nid(cpy)} [style=dashed, label="copy"];')
    for k, split in enumerate(splits):
        members = [nid(t) for t in g.nodes[split.i_start:split.i_end]]
        members += [nid(sched.get_tensor_copy(t, split.backend_id, sched.cur_copy)) for t in split.inputs]
        inputs = ", ".join(t.name for t in split.inputs) or "none"
        label = f"#{k} {sched.backends[split.backend_id].name}, inputs: {inputs}"
        lines.append(f'  subgraph cluster_{k} {{ label="{_q(label)}"; style=rounded; {"; ".join(members)}; }}')
    lines.append("}")
    return "\n".join(lines) + "\n"
