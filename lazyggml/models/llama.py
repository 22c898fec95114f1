"""The LLaMA graph (llama.cpp's ``llm_build_llama``), which Qwen2 and Qwen3 share.

One forward pass over a micro-batch of tokens:

    x = get_rows(token_embd, tokens)
    for each layer:
        h = rms_norm(x) * attn_norm
        q, k, v = wq @ h (+ bq), wk @ h (+ bk), wv @ h (+ bv)    -> heads
        q, k = rms_norm(q) * q_norm, rms_norm(k) * k_norm         (per head; Qwen3)
        rope on q and k
        k, v written into the layer's KV cache at the tokens' cells (set_rows)
        x = x + wo @ attention(q, k_cache, v_cache, causal mask)   (grouped-query: KV heads broadcast)
        h = rms_norm(x) * ffn_norm
        x = x + w_down @ (silu(w_gate @ h) * (w_up @ h))
    logits = output @ (rms_norm(x) * output_norm)

The biases and the per-head norms are taken where a file has them (LLaMA's are optional, Qwen2's
biases and Qwen3's norms required: ``archs.py``); Qwen2 and Qwen3 rotate with GGML's NEOX RoPE,
LLaMA with the normal one. ``builder.py`` has the attention, with and without flash attention.
"""
from __future__ import annotations

from .. import ops

__all__ = ["build_llama"]


def build_llama(b):
    """The graph of ``b`` (a ``GraphBuilder``): every layer, then the logits."""
    x = b.embed()
    for il in range(b.hp.n_layer):
        blk = f"blk.{il}."
        x = ops.add(b.attn(il, *b.qkv(il, b.norm(x, blk + "attn_norm.weight"))), x)
        x = b.layer_out(ops.add(b.ffn(il, b.norm(x, blk + "ffn_norm.weight")), x), il)
    return b.output(x)
