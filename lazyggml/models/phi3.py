"""The Phi-3 graph (llama.cpp's ``llama_model_phi3`` graph): Phi-3, Phi-3.5 and Phi-4-mini.

One forward pass over a micro-batch of tokens:

    x = get_rows(token_embd, tokens)
    for each layer:
        h = rms_norm(x) * attn_norm
        qkv = wqkv @ h;  q, k, v = its rows 0..n_embd, then n_embd_k_gqa, then n_embd_v_gqa (views)
        rope on q and k (NEOX), with the LongRoPE frequency factors where the file has them
        q = q / sqrt(head size)
        k, v written into the layer's KV cache (set_rows)
        x = x + wo @ attention(q, k_cache, v_cache, causal mask, scale 1)
        h = rms_norm(x) * ffn_norm
        gu = w_up @ h                                              (2 * n_ff rows: gate, then up)
        x = x + w_down @ (silu(gu[:n_ff]) * gu[n_ff:])            (GGML's one-tensor SWIGLU)
    logits = output @ (rms_norm(x) * output_norm)

LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): ``rope_factors_long`` when the context exceeds
``rope.scaling.original_context_length``, else ``rope_factors_short`` (``GraphBuilder.rope_factors``),
and RoPE's cos and sin scaled by ``rope.scaling.attn_factor``. Phi-3's files also carry
``attention.sliding_window``, but llama.cpp disables Phi's sliding window, and so does this.
"""
from __future__ import annotations

import numpy as np

from .. import ops

__all__ = ["build_phi3"]


def build_phi3(b):
    """The graph of ``b`` (a ``GraphBuilder``): every layer, then the logits."""
    hp, n = b.hp, b.n_tokens
    hd = hp.n_embd_head_k
    x = b.embed()
    for il in range(hp.n_layer):
        blk = f"blk.{il}."
        qkv = b.linear(b.norm(x, blk + "attn_norm.weight"), blk + "attn_qkv")
        es, row = qkv.nb[0], qkv.nb[1]
        q = ops.view_3d(qkv, hd, hp.n_head, n, hd * es, row, 0)
        k = ops.view_3d(qkv, hd, hp.n_head_kv, n, hd * es, row, hp.n_embd * es)
        v = ops.cont(ops.view_2d(qkv, hp.n_embd_v_gqa, n, row, (hp.n_embd + hp.n_embd_k_gqa) * es))
        # the queries scaled before attention, as llama.cpp does (not in the softmax: other rounding)
        q = ops.scale(b.rope(q, il), float(np.float32(1) / np.sqrt(np.float32(hd))))
        x = ops.add(b.attn(il, q, b.rope(k, il), v, scale=1.0), x)
        h = b.norm(x, blk + "ffn_norm.weight")
        x = b.layer_out(ops.add(b.linear(ops.swiglu(b.linear(h, blk + "ffn_up")), blk + "ffn_down"), x), il)
    return b.output(x)
