"""The architectures lazyggml runs, by ``general.architecture``: one table, as llama.cpp's
``llm_arch`` switch in its loader and graph builder.

An ``Arch`` says what a family's files hold and how its graph is built:

* ``tensors(hp)``: ``(required, optional)`` dicts of tensor name -> ``ne`` (GGML order), the
  tensors llama.cpp's loader creates for that architecture (``create_tensor``, with
  ``TENSOR_NOT_REQUIRED`` for the optional ones). A missing ``output.weight`` ties the output
  projection to ``token_embd.weight`` in every family (llama.cpp's ``TENSOR_DUPLICATED``);
* ``rope_type``: GGML's RoPE mode for queries and keys;
* ``build(b)``: the graph, from a ``builder.GraphBuilder``.

``TENSOR_OPS`` says which op the graph makes of each kind of tensor (llama.cpp's ``LLM_TENSOR_INFOS``):
the loader asks a backend whether it runs that op on the weight before placing it there
(``loader.py``), so placement never guesses from names; a tensor kind missing from it is an error.

A new family adds its row here, its graph function in a module of its own when LLaMA's does not
serve, and its hyper-parameter keys in ``hparams.py`` when it has any beyond the common ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import GGUFError
from ..ops import ROPE_TYPE_NEOX, ROPE_TYPE_NORMAL
from ..types import Op
from .gemma3 import build_gemma3
from .llama import build_llama
from .phi3 import build_phi3

__all__ = ["Arch", "ARCHITECTURES", "TENSOR_OPS", "get_arch", "tensor_op"]

#: The op each kind of tensor feeds (the name without ``blk.N.``): token embeddings are gathered, norms
#: and Gemma's post-norms multiply a hidden state, biases are added to one, RoPE's frequency factors
#: scale its angles, experts' stacked matrices multiply it through the router's choice, every other
#: matrix multiplies it.
TENSOR_OPS = {
    "token_embd.weight": Op.GET_ROWS,
    "output_norm.weight": Op.MUL, "output.weight": Op.MUL_MAT,
    "rope_freqs.weight": Op.ROPE, "rope_factors_long.weight": Op.ROPE, "rope_factors_short.weight": Op.ROPE,
    "attn_norm.weight": Op.MUL, "attn_q_norm.weight": Op.MUL, "attn_k_norm.weight": Op.MUL,
    "post_attention_norm.weight": Op.MUL, "ffn_norm.weight": Op.MUL, "post_ffw_norm.weight": Op.MUL,
    "attn_q.weight": Op.MUL_MAT, "attn_k.weight": Op.MUL_MAT, "attn_v.weight": Op.MUL_MAT,
    "attn_qkv.weight": Op.MUL_MAT, "attn_output.weight": Op.MUL_MAT,
    "attn_q.bias": Op.ADD, "attn_k.bias": Op.ADD, "attn_v.bias": Op.ADD, "attn_output.bias": Op.ADD,
    "ffn_gate.weight": Op.MUL_MAT, "ffn_up.weight": Op.MUL_MAT, "ffn_down.weight": Op.MUL_MAT,
    "ffn_gate_inp.weight": Op.MUL_MAT,
    "ffn_gate_exps.weight": Op.MUL_MAT_ID, "ffn_up_exps.weight": Op.MUL_MAT_ID, "ffn_down_exps.weight": Op.MUL_MAT_ID,
}


def tensor_op(name):
    """The op the graph makes of tensor ``name`` (``TENSOR_OPS``, by its kind)."""
    kind = name.split(".", 2)[2] if name.startswith("blk.") else name
    op = TENSOR_OPS.get(kind)
    if op is None:
        raise KeyError(f"tensor {name!r}: its kind {kind!r} has no op in archs.TENSOR_OPS")
    return op


@dataclass(frozen=True)
class Arch:
    name: str
    rope_type: int
    layer_required: Callable      # hp -> {suffix after "blk.N.": ne}
    layer_optional: Callable
    optional: Callable            # hp -> {name: ne}, beside the tied-or-not output
    build: Callable
    experts: str = ""             # mixture of experts: "" none, "optional", "required" (``expert_count``)

    def tensors(self, hp) -> tuple:
        """``(required, optional)``: tensor name -> ``ne`` for a model of hyper-parameters ``hp``."""
        required = {"token_embd.weight": (hp.n_embd, hp.n_vocab), "output_norm.weight": (hp.n_embd,)}
        optional = {"output.weight": (hp.n_embd, hp.n_vocab), **self.optional(hp)}
        for into, per_layer in ((required, self.layer_required(hp)), (optional, self.layer_optional(hp))):
            for i in range(hp.n_layer):
                into.update({f"blk.{i}.{suffix}": ne for suffix, ne in per_layer.items()})
        return required, optional


def _decoder(hp):
    """LLaMA's block: norms, the four attention projections, the gated FFN (or its experts)."""
    q_dim = hp.n_embd_head_k * hp.n_head
    return {
        "attn_norm.weight": (hp.n_embd,),
        "attn_q.weight": (hp.n_embd, q_dim),
        "attn_k.weight": (hp.n_embd, hp.n_embd_k_gqa),
        "attn_v.weight": (hp.n_embd, hp.n_embd_v_gqa),
        "attn_output.weight": (q_dim, hp.n_embd),
        "ffn_norm.weight": (hp.n_embd,),
        **_ffn(hp),
    }


def _ffn(hp):
    """The gated FFN, or with ``n_expert``: the router (``ffn_gate_inp``) and the experts' three
    matrices, stacked one per expert (Mixtral-style ``_exps`` tensors)."""
    if not hp.n_expert:
        return {"ffn_gate.weight": (hp.n_embd, hp.n_ff), "ffn_up.weight": (hp.n_embd, hp.n_ff),
                "ffn_down.weight": (hp.n_ff, hp.n_embd)}
    return {"ffn_gate_inp.weight": (hp.n_embd, hp.n_expert),
            "ffn_gate_exps.weight": (hp.n_embd, hp.n_ff_exp, hp.n_expert),
            "ffn_up_exps.weight": (hp.n_embd, hp.n_ff_exp, hp.n_expert),
            "ffn_down_exps.weight": (hp.n_ff_exp, hp.n_embd, hp.n_expert)}


def _qkv_biases(hp):
    return {"attn_q.bias": (hp.n_embd_head_k * hp.n_head,), "attn_k.bias": (hp.n_embd_k_gqa,),
            "attn_v.bias": (hp.n_embd_v_gqa,)}


def _qk_norms(hp):
    return {"attn_q_norm.weight": (hp.n_embd_head_k,), "attn_k_norm.weight": (hp.n_embd_head_k,)}


def _none(hp):
    return {}


def _gemma3(hp):
    """LLaMA's block with per-head Q/K norms and a norm after attention and after the FFN."""
    return {**_decoder(hp), **_qk_norms(hp), "post_attention_norm.weight": (hp.n_embd,),
            "post_ffw_norm.weight": (hp.n_embd,)}


def _phi3(hp):
    """Q, K and V in one matrix (rows: Q, then K, then V), gate and up in one (gate first)."""
    return {
        "attn_norm.weight": (hp.n_embd,),
        "attn_qkv.weight": (hp.n_embd, hp.n_embd + 2 * hp.n_embd_k_gqa),
        "attn_output.weight": (hp.n_embd, hp.n_embd),
        "ffn_norm.weight": (hp.n_embd,),
        "ffn_up.weight": (hp.n_embd, 2 * hp.n_ff),
        "ffn_down.weight": (hp.n_ff, hp.n_embd),
    }


ARCHITECTURES = {a.name: a for a in (
    # LLaMA 1/2/3, Mistral, TinyLlama, SmolLM, and Mixtral's experts; biases where a file has them;
    # rope_freqs: per-dimension frequency factors (Llama 3.1 and later), GGML's rope_ext ``c`` argument
    Arch("llama", ROPE_TYPE_NORMAL, _decoder,
         lambda hp: {**_qkv_biases(hp), "attn_output.bias": (hp.n_embd,)},
         lambda hp: {"rope_freqs.weight": (hp.n_rot // 2,)}, build_llama, experts="optional"),
    # Qwen2, Qwen2.5: biases on Q, K and V
    Arch("qwen2", ROPE_TYPE_NEOX, lambda hp: {**_decoder(hp), **_qkv_biases(hp)}, _none, _none, build_llama),
    # Qwen3: an RMS norm on each query and key head, no biases
    Arch("qwen3", ROPE_TYPE_NEOX, lambda hp: {**_decoder(hp), **_qk_norms(hp)}, _none, _none, build_llama),
    # Qwen3's mixture of experts (Qwen3-30B-A3B ...): Qwen3 with experts in every layer
    Arch("qwen3moe", ROPE_TYPE_NEOX, lambda hp: {**_decoder(hp), **_qk_norms(hp)}, _none, _none, build_llama,
         experts="required"),
    # Gemma 3: scaled embeddings, post-norms, GELU-gated FFN, sliding-window layers
    Arch("gemma3", ROPE_TYPE_NEOX, _gemma3, _none, _none, build_gemma3),
    # Phi-3, Phi-3.5, Phi-4-mini: fused QKV and gate/up; LongRoPE frequency factors for the long
    # context (rope_factors_long) and the original one (rope_factors_short)
    Arch("phi3", ROPE_TYPE_NEOX, _phi3, _none,
         lambda hp: {"rope_factors_long.weight": (hp.n_rot // 2,), "rope_factors_short.weight": (hp.n_rot // 2,)},
         build_phi3),
)}


def get_arch(name, path="<metadata>") -> Arch:
    """The architecture called ``name``; a ``GGUFError`` naming it and the supported ones if none is."""
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise GGUFError(path, "general.architecture",
                        f"unsupported architecture {name!r}; lazyggml runs {', '.join(sorted(ARCHITECTURES))}")
    return arch
