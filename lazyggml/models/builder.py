"""What every architecture's graph is made of (llama.cpp's ``llm_graph_context``).

A ``GraphBuilder`` holds one forward pass under construction: a micro-batch of ``n_tokens`` tokens
after those in the KV cache, attending to a window of ``n_kv`` cells. It makes the graph's inputs,
and gives an architecture's builder (``archs.py`` says which function builds which family) the
blocks that families share:

* ``embed()``: the tokens' rows of ``token_embd.weight`` (``get_rows``);
* ``norm(x, name)``: RMS norm times a weight; ``linear(x, name)``: ``name.weight @ x``, plus
  ``name.bias`` when the file has one;
* ``qkv(il, h)``: the layer's query, key and value heads, each with its bias and, for keys and queries,
  its per-head RMS norm when the file has them, then RoPE on queries and keys;
* ``rope(x, il)``: RoPE of layer ``il`` (sliding-window layers have their own base and scale), with
  the file's frequency factors (``rope_factors(il)``: Llama 3.1's, or Phi-3's long or short ones);
* ``attn(il, q, k, v)``: the batch's keys and values written into the layer's KV cache, attention
  over the window (``flash_attn_ext``, or ``mul_mat``/``soft_max_ext``/``mul_mat``) under the
  causal mask, or on sliding-window layers (Gemma 3) the mask that also hides cells ``n_swa`` or
  more positions back, then the output projection;
* ``ffn(il, h)``: the gated feed-forward network, ``down @ (silu(gate @ h) * (up @ h))``;
* ``output(x)``: the hidden states of the tokens whose logits are wanted (every token's, or those
  ``inp_out_ids`` lists), normed, times ``output.weight``.

The graph's inputs are ``GraphInput`` objects (``inputs.py``) that fill themselves from a micro-batch:
the builder makes the tokens' and positions', the KV cache (``kv_cache.py``) its cell indices and
masks, and owns its layout (V transposed without flash attention) and the nodes that write and read
it. ``build_shift`` makes the graph that rotates the cached keys after ``KVCache.seq_add``.
"""
from __future__ import annotations

import math

from .. import ops
from ..graph import Graph
from ..tensor import Context, set_output
from ..types import Type
from .inputs import GraphInput, GraphTensor

__all__ = ["GraphBuilder"]


class GraphBuilder:
    """One forward pass under construction: the model's ``weights`` (a ``loader.Weights``), its
    ``kv`` cache (a ``KVCache``), attention ``flash_attn`` or not, a micro-batch of ``n_tokens``
    tokens over a window of ``n_kv`` cells, the logits of ``n_outputs`` of them. ``build()``
    makes ``graph``, its ``inputs`` (``GraphInput``s, each filled from a ``UBatch``) and ``logits``
    (a ``GraphTensor``); ``pins`` are the (tensor, backend) pairs the scheduler must keep."""

    def __init__(self, weights, kv, flash_attn, graph_size, n_tokens, n_kv, n_outputs):
        self.weights, self.kv, self.flash_attn = weights, kv, flash_attn
        self.hp, self.w = weights.hp, weights.tensors
        self.n_tokens, self.n_kv, self.n_outputs = n_tokens, n_kv, n_outputs
        self.ctx = Context()
        self.graph = Graph(graph_size)
        self.logits = None
        self.pins = []    # (tensor, backend) the scheduler must keep where they are (layer_out)
        ctx = self.ctx
        with ctx:
            self.inp_tokens = GraphInput(ctx.new_tensor_1d(Type.I32, n_tokens), "inp_tokens",
                                         lambda inp, ub: inp.write(ub.tokens))
            self.inp_pos = GraphInput(ctx.new_tensor_1d(Type.I32, n_tokens), "inp_pos",
                                      lambda inp, ub: inp.write(ub.pos))
            # F16 masks for flash attention, which takes no other (llama.cpp's are F16 there too),
            # F32 for soft_max_ext
            self.inp_kv = kv.build_input(ctx, n_tokens, n_kv, Type.F16 if flash_attn else Type.F32)
            # which tokens' logits (llama.cpp's inp_out_ids), when not every token's
            self.inp_out_ids = (GraphInput(ctx.new_tensor_1d(Type.I32, n_outputs), "inp_out_ids",
                                           lambda inp, ub: inp.write(ub.out_ids)) if n_outputs < n_tokens else None)
        self.inputs = [self.inp_tokens, self.inp_pos, *self.inp_kv.inputs]
        if self.inp_out_ids is not None:
            self.inputs.append(self.inp_out_ids)

    def build(self):
        """Run the architecture's graph builder inside this builder's context; returns self."""
        with self.ctx:
            self.weights.arch.build(self)
        return self

    def build_shift(self):
        """The K shift's graph (llama.cpp's ``build_graph_shift``): every layer's cached keys rotated
        by their cells' pending position change, as RoPE rotated them (through F32, which the CPU's
        RoPE takes: the same rounding as GGML's F16 RoPE in place); ``inputs``: the shift."""
        inp = self.kv.build_shift_input(self.ctx)
        self.inputs = [inp]
        with self.ctx:
            for il in range(self.hp.n_layer):
                k = self.kv.k_rows(il)
                rotated = self.rope(ops.cpy(k, self.ctx.new_tensor(Type.F32, k.ne)), il, inp.tensor)
                self.graph.build_forward_expand(ops.cpy(rotated, k))
        return self

    # -- blocks ---------------------------------------------------------------------------------------
    def embed(self):
        return ops.get_rows(self.w["token_embd.weight"], self.inp_tokens.tensor)

    def layer_out(self, x, il):
        """Layer ``il``'s output (its last residual add), kept on the layer's backend. Without weights
        of its own the scheduler would give it to the next layer's backend, and where that is another
        device both its inputs (the FFN's output and the residual) would cross instead of it alone:
        twice the bytes between devices at every layer boundary (a GPU's, an RPC server's). Not
        where a backend offloads such a batch's ops from the CPU (CUDA, from 32 tokens): those run
        there anyway, and llama.cpp pins nothing then either."""
        if not any(b.offload_op(x) for b in self.weights.backends):
            self.pins.append((x, self.weights.layer_backends[il]))
        return x

    def norm(self, x, name):
        """``rms_norm(x) * w[name]``: over the first dimension (a row, or a head's row)."""
        return ops.mul(ops.rms_norm(x, self.hp.f_norm_rms_eps), self.w[name])

    def linear(self, x, name):
        """``w[name.weight] @ x``, plus ``w[name.bias]`` where the file has that bias."""
        y = ops.mul_mat(self.w[name + ".weight"], x)
        bias = self.w.get(name + ".bias")
        return y if bias is None else ops.add(y, bias)

    def rope_factors(self, il):
        """Layer ``il``'s per-dimension frequency factors (llama.cpp's ``get_rope_factors``), the copy
        on its device: ``rope_freqs``, else Phi-3's LongRoPE factors, the long ones when the context
        exceeds the original one; None when the file has none."""
        if "rope_freqs.weight" in self.w:
            name = "rope_freqs.weight"
        else:
            name = "rope_factors_long.weight" if self.kv.size > self.hp.n_ctx_orig_yarn else "rope_factors_short.weight"
        return self.weights.on.get((name, self.weights.layer_backends[il]))

    def rope(self, x, il, pos=None):
        """RoPE of layer ``il`` by the tokens' positions (or ``pos``): sliding-window layers rotate
        with their own base and scale."""
        hp = self.hp
        swa = hp.is_swa(il)
        ext_factor = 1.0 if hp.rope_scaling_type == "yarn" else 0.0
        return ops.rope_ext(x, self.inp_pos.tensor if pos is None else pos, self.rope_factors(il), hp.n_rot,
                            self.weights.arch.rope_type, hp.n_ctx_orig_yarn,
                            hp.rope_freq_base_swa if swa else hp.rope_freq_base,
                            hp.rope_freq_scale_swa if swa else hp.rope_freq_scale,
                            ext_factor, hp.rope_attn_factor, 32.0, 1.0)

    def qkv(self, il, h):
        """Queries ``[hd, n_head, n_tokens]`` and keys ``[hd, n_head_kv, n_tokens]`` (per-head RMS
        norms where the file has ``attn_q_norm``/``attn_k_norm``, then RoPE), values
        ``[n_embd_v_gqa, n_tokens]``."""
        hp, b, n = self.hp, f"blk.{il}.", self.n_tokens
        q = ops.reshape_3d(self.linear(h, b + "attn_q"), hp.n_embd_head_k, hp.n_head, n)
        k = ops.reshape_3d(self.linear(h, b + "attn_k"), hp.n_embd_head_k, hp.n_head_kv, n)
        v = self.linear(h, b + "attn_v")
        if b + "attn_q_norm.weight" in self.w:
            q = self.norm(q, b + "attn_q_norm.weight")
        if b + "attn_k_norm.weight" in self.w:
            k = self.norm(k, b + "attn_k_norm.weight")
        return self.rope(q, il), self.rope(k, il), v

    def attn(self, il, q, k, v, scale=None):
        """Write this batch's ``k`` and ``v`` (``v``: ``[n_embd_v_gqa, n_tokens]``, contiguous) into
        layer ``il``'s cache cells (before attention reads them), attend over the window with
        ``scale`` (default 1/sqrt(head size)) under the layer's mask (causal, or sliding-window),
        project by ``attn_output``."""
        hp, g, n, kv, inp = self.hp, self.graph, self.n_tokens, self.kv, self.inp_kv
        hd = hp.n_embd_head_k
        scale = 1.0 / math.sqrt(hd) if scale is None else scale
        mask = inp.mask(hp.is_swa(il))
        g.build_forward_expand(kv.cpy_k(il, k, inp))
        g.build_forward_expand(kv.cpy_v(il, v, inp))
        k, v = kv.get_k(il, self.n_kv), kv.get_v(il, self.n_kv)
        if self.flash_attn:
            fa = ops.flash_attn_ext(ops.permute(q, 0, 2, 1, 3), k, v, mask, scale)
            out = ops.reshape_2d(fa, hd * hp.n_head, n)                  # [hd, n_head, n_tokens]
        else:
            kq = ops.mul_mat(k, ops.permute(q, 0, 2, 1, 3))
            kq = ops.soft_max_ext(kq, mask, scale, 0.0)
            kqv = ops.mul_mat(v, kq)                                       # [hd, n_tokens, n_head]
            out = ops.cont_2d(ops.permute(kqv, 0, 2, 1, 3), hd * hp.n_head, n)
        return self.linear(out, f"blk.{il}.attn_output")

    def ffn(self, il, h):
        """The gated FFN, ``down @ (silu(gate @ h) * (up @ h))``, or its mixture of experts."""
        b = f"blk.{il}."
        if self.hp.n_expert:
            return self.moe_ffn(il, h)
        return self.linear(ops.swiglu_split(self.linear(h, b + "ffn_gate"), self.linear(h, b + "ffn_up")),
                           b + "ffn_down")

    def moe_ffn(self, il, h):
        """Mixture of experts (llama.cpp's ``build_moe_ffn`` with soft-max gating and normalized
        weights, as Mixtral and Qwen3-MoE use it): the router's probabilities over ``n_expert``
        experts, the ``n_expert_used`` largest per token, their weights renormalized to sum to 1;
        each chosen expert's gated FFN (``mul_mat_id``), weighted, and summed in the router's order."""
        hp, w, n, k, b = self.hp, self.w, self.n_tokens, self.hp.n_expert_used, f"blk.{il}."
        probs = ops.soft_max(self.linear(h, b + "ffn_gate_inp"))                 # [n_expert, n_tokens]
        chosen = ops.argsort_top_k(probs, k)                                     # [k, n_tokens] I32
        weights = ops.get_rows(ops.reshape_3d(probs, 1, hp.n_expert, n), chosen)  # [1, k, n_tokens]
        weights = ops.reshape_2d(weights, k, n)
        weights = ops.reshape_3d(ops.div(weights, ops.sum_rows(weights)), 1, k, n)
        x = ops.reshape_3d(h, hp.n_embd, 1, n)                                  # one row per token, for every expert
        up = ops.mul_mat_id(w[b + "ffn_up_exps.weight"], x, chosen)              # [n_ff_exp, k, n_tokens]
        gate = ops.mul_mat_id(w[b + "ffn_gate_exps.weight"], x, chosen)
        experts = ops.mul_mat_id(w[b + "ffn_down_exps.weight"], ops.swiglu_split(gate, up), chosen)
        experts = ops.mul(experts, weights)                                      # [n_embd, k, n_tokens]
        out = None
        for i in range(k):
            e = ops.view_2d(experts, hp.n_embd, n, experts.nb[2], i * experts.nb[1])
            out = e if out is None else ops.add(out, e)
        return ops.cont(out) if k == 1 else out

    def output(self, x):
        """The logits of the tokens ``inp_out_ids`` lists (every token's without it), marked as the
        graph's output and expanded into it. llama.cpp picks those rows before the last layer's FFN;
        here they are picked after the last layer, so that a prompt's last logits are the bits of
        llama.cpp's run with every token's logits (its ``logits_all``, what the tests compare with)."""
        if self.inp_out_ids is not None:
            x = ops.get_rows(x, self.inp_out_ids.tensor)
        logits = self.linear(self.norm(x, "output_norm.weight"), "output")
        logits.name = "result_output"
        set_output(logits)
        self.graph.build_forward_expand(logits)
        self.logits = GraphTensor(logits)
        return logits
