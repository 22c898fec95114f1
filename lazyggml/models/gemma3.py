"""The Gemma 3 graph (llama.cpp's ``llama_model_gemma3`` graph, with sliding-window layers).

One forward pass over a micro-batch of tokens:

    x = get_rows(token_embd, tokens) * sqrt(n_embd)
    for each layer:
        h = rms_norm(x) * attn_norm
        q, k, v = wq @ h, wk @ h, wv @ h                           -> heads
        q, k = rms_norm(q) * q_norm, rms_norm(k) * k_norm         (per head)
        rope on q and k: base rope.freq_base and the file's rope scaling on global layers,
                         base 10000 and no scaling on sliding-window layers
        q = q * f_attention_scale                                 (1/sqrt(head size); 27B: 1/sqrt(n_embd/n_head))
        k, v written into the layer's KV cache (set_rows)
        a = wo @ attention(q, k_cache, v_cache, mask, scale 1)    mask: causal on global layers, causal
                                                                  and the last n_swa positions on the others
        x = x + rms_norm(a) * post_attention_norm
        h = rms_norm(x) * ffn_norm
        f = w_down @ (gelu(w_gate @ h) * (w_up @ h))              (GGML's GEGLU)
        x = x + rms_norm(f) * post_ffw_norm
    logits = output @ (rms_norm(x) * output_norm)                 (output tied to token_embd in Gemma's files)

Which layers slide: ``HParams.swa_layers`` (of every 6 layers, the first 5, unless the file says
otherwise). Gemma's RMS norms multiply by ``1 + w``; llama.cpp's converter stores ``1 + w`` in the
file, so every norm here is the plain ``rms_norm(x) * w``. No final logit soft-capping (Gemma 2 had
it; llama.cpp's sliding-window gemma3 graph has none).
"""
from __future__ import annotations

import numpy as np

from .. import ops

__all__ = ["build_gemma3"]


def build_gemma3(b):
    """The graph of ``b`` (a ``GraphBuilder``): every layer, then the logits."""
    hp = b.hp
    x = ops.scale(b.embed(), float(np.sqrt(np.float32(hp.n_embd))))   # sqrtf, as llama.cpp
    for il in range(hp.n_layer):
        blk = f"blk.{il}."
        q, k, v = b.qkv(il, b.norm(x, blk + "attn_norm.weight"))
        # the queries scaled before attention, as llama.cpp does (not in the softmax: other rounding)
        a = b.attn(il, ops.scale(q, hp.f_attention_scale), k, v, scale=1.0)
        x = ops.add(b.norm(a, blk + "post_attention_norm.weight"), x)
        h = b.norm(x, blk + "ffn_norm.weight")
        f = b.linear(ops.geglu_split(b.linear(h, blk + "ffn_gate"), b.linear(h, blk + "ffn_up")), blk + "ffn_down")
        x = b.layer_out(ops.add(b.norm(f, blk + "post_ffw_norm.weight"), x), il)
    return b.output(x)
