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
* ``output(x)``: the last token's (or every token's) hidden state, normed, times ``output.weight``.

The KV cache layout is the runner's (``runner.py``): K has an F16 row of ``n_embd_k_gqa`` per cell; V
too with flash attention, else V is stored transposed (row j holds element j of every cell), as
llama.cpp's ``v_trans``, so that ``v^T @ kq`` reads the window's rows in place.
"""
from __future__ import annotations

import math

from .. import ops
from ..graph import Graph
from ..tensor import Context, set_input, set_output
from ..types import Type

__all__ = ["GraphBuilder", "ROPE_FACTORS"]

#: RoPE's per-dimension frequency factors, one tensor for every layer: Llama 3.1's, Phi-3's long and
#: short ones (the runner gives each layer's device a copy: ``Model.w_on``)
ROPE_FACTORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class GraphBuilder:
    """One forward pass under construction for ``model`` (a ``runner.Model``): ``graph``, the
    ``inputs`` in the order ``runner.Model`` fills them (tokens, positions, KV cells, V cells or
    None, causal mask, sliding-window mask; a mask no layer uses is None) and, once ``output`` ran,
    ``logits``."""

    def __init__(self, model, n_tokens, n_kv, logits_all):
        self.hp, self.w, self.arch = model.hp, model.w, model.arch
        self.w_on, self.layer_backends, self.backends = model.w_on, model.layer_backends, model.backends
        self.k_cache, self.v_cache, self.flash_attn = model.k_cache, model.v_cache, model.flash_attn
        self.n_tokens, self.n_kv, self.logits_all, self.n_ctx = n_tokens, n_kv, logits_all, model.n_ctx
        self.ctx = Context()
        self.graph = Graph(model.sched.graph_size)
        self.logits = None
        self.pins = []    # (tensor, backend) the scheduler must keep where they are (layer_out)
        hp, ctx = self.hp, self.ctx
        with ctx:
            self.tokens = ctx.new_tensor_1d(Type.I32, n_tokens)
            self.pos = ctx.new_tensor_1d(Type.I32, n_tokens)
            self.kv_idxs = ctx.new_tensor_1d(Type.I64, n_tokens)
            self.v_idxs = None if self.flash_attn else ctx.new_tensor_1d(Type.I64, n_tokens * hp.n_embd_v_gqa)
            # the causal mask, and the sliding-window layers' (causal, and only the last n_swa
            # positions: Gemma 3), each where some layer uses it; F16 for flash attention, which
            # takes no other (llama.cpp's masks are F16 there too), F32 for soft_max_ext
            swa = [hp.is_swa(il) for il in range(hp.n_layer)]
            mtype = Type.F16 if self.flash_attn else Type.F32
            self.kq_mask = None if all(swa) else ctx.new_tensor_2d(mtype, n_kv, n_tokens)
            self.kq_mask_swa = ctx.new_tensor_2d(mtype, n_kv, n_tokens) if any(swa) else None
        for t, name in ((self.tokens, "inp_tokens"), (self.pos, "inp_pos"), (self.kv_idxs, "inp_kv_idxs"),
                        (self.v_idxs, "inp_v_idxs"), (self.kq_mask, "inp_kq_mask"),
                        (self.kq_mask_swa, "inp_kq_mask_swa")):
            if t is not None:
                t.name = name
                set_input(t)

    @property
    def inputs(self):
        return self.tokens, self.pos, self.kv_idxs, self.v_idxs, self.kq_mask, self.kq_mask_swa

    def build(self):
        """Run the architecture's graph builder inside this builder's context; returns self."""
        with self.ctx:
            self.arch.build(self)
        return self

    # -- blocks ---------------------------------------------------------------------------------------
    def embed(self):
        return ops.get_rows(self.w["token_embd.weight"], self.tokens)

    def layer_out(self, x, il):
        """Layer ``il``'s output (its last residual add), kept on the layer's backend. Without weights
        of its own the scheduler would give it to the next layer's backend, and where that is another
        device both its inputs (the FFN's output and the residual) would cross instead of it alone:
        twice the bytes between devices at every layer boundary (a GPU's, an RPC server's). Not
        where a backend offloads such a batch's ops from the CPU (CUDA, from 32 tokens): those run
        there anyway, and llama.cpp pins nothing then either."""
        if not any(b.offload_op(x) for b in self.backends):
            self.pins.append((x, self.layer_backends[il]))
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
            name = "rope_factors_long.weight" if self.n_ctx > self.hp.n_ctx_orig_yarn else "rope_factors_short.weight"
        return self.w_on.get((name, self.layer_backends[il]))

    def rope(self, x, il):
        """RoPE of layer ``il``: sliding-window layers rotate with their own base and scale."""
        hp = self.hp
        swa = hp.is_swa(il)
        ext_factor = 1.0 if hp.rope_scaling_type == "yarn" else 0.0
        return ops.rope_ext(x, self.pos, self.rope_factors(il), hp.n_rot, self.arch.rope_type, hp.n_ctx_orig_yarn,
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
        hp, g, n, n_kv = self.hp, self.graph, self.n_tokens, self.n_kv
        hd, n_head_kv = hp.n_embd_head_k, hp.n_head_kv
        kc, vc = self.k_cache[il], self.v_cache[il]
        scale = 1.0 / math.sqrt(hd) if scale is None else scale
        mask = self.kq_mask_swa if hp.is_swa(il) else self.kq_mask
        g.build_forward_expand(ops.set_rows(kc, ops.reshape_2d(k, hp.n_embd_k_gqa, n), self.kv_idxs))
        if self.flash_attn:
            g.build_forward_expand(ops.set_rows(vc, ops.reshape_2d(v, hp.n_embd_v_gqa, n), self.kv_idxs))
            k3 = ops.view_3d(kc, hd, n_kv, n_head_kv, kc.nb[1], kc.nb[1] // n_head_kv, 0)
            v3 = ops.view_3d(vc, hd, n_kv, n_head_kv, vc.nb[1], vc.nb[1] // n_head_kv, 0)
            fa = ops.flash_attn_ext(ops.permute(q, 0, 2, 1, 3), k3, v3, mask, scale)
            out = ops.reshape_2d(fa, hd * hp.n_head, n)                  # [hd, n_head, n_tokens]
        else:
            # V transposed: every element is a row of one (v_idxs: element j of token t goes to
            # cell pos_t of row j)
            g.build_forward_expand(ops.set_rows(ops.reshape_2d(vc, 1, vc.ne[0] * vc.ne[1]),
                                                ops.reshape_2d(v, 1, hp.n_embd_v_gqa * n), self.v_idxs))
            kv = ops.view_3d(kc, hd, n_head_kv, n_kv, kc.nb[1] // n_head_kv, kc.nb[1], 0)
            vt = ops.view_3d(vc, n_kv, hd, n_head_kv, vc.nb[1], vc.nb[1] * hd, 0)   # [n_kv, hd, n_head_kv]
            kq = ops.mul_mat(ops.permute(kv, 0, 2, 1, 3), ops.permute(q, 0, 2, 1, 3))
            kq = ops.soft_max_ext(kq, mask, scale, 0.0)
            kqv = ops.mul_mat(vt, kq)                                      # [hd, n_tokens, n_head]
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
        """The logits: of the last token only unless ``logits_all`` (the other rows are not needed
        for sampling), marked as the graph's output and expanded into it."""
        hp = self.hp
        if not self.logits_all:
            x = ops.view_2d(x, hp.n_embd, 1, x.nb[1], (self.n_tokens - 1) * x.nb[1])
        logits = self.linear(self.norm(x, "output_norm.weight"), "output")
        logits.name = "result_output"
        set_output(logits)
        self.graph.build_forward_expand(logits)
        self.logits = logits
        return logits
