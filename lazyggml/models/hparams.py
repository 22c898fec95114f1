"""The hyper-parameters of a model, read from GGUF metadata as llama.cpp reads them, and the check
of its tensors against what its architecture's loader expects.

``HParams.from_metadata`` reads the keys llama.cpp reads for every decoder (``llama_model::load_hparams``),
under the prefix of ``general.architecture`` (``llama.``, ``qwen2.`` ...), which must be one of
``archs.ARCHITECTURES``; ``check_tensors`` checks a file's tensor names and shapes against that
architecture's table (``Arch.tensors``). ``_arch_hparams`` reads the keys of one family beyond the
common ones (Gemma 3's sliding window and attention scale).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import GGUFError
from ..gguf_io import get_count, get_key, get_per_layer, get_positive_float
from ..types import WEIGHT_TYPES, type_name
from .archs import get_arch

__all__ = ["ROPE_SCALING_TYPES", "HParams", "WEIGHT_TYPES", "tensor_shapes", "check_tensors"]

ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


@dataclass(frozen=True)
class HParams:
    """The hyper-parameters of a model, named as llama.cpp's ``llama_hparams``; ``arch`` is its
    ``general.architecture``."""
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_rot: int
    f_norm_rms_eps: float
    rope_freq_base: float
    rope_scaling_type: str
    rope_freq_scale: float  # 1 / rope.scaling.factor (1 when absent)
    n_ctx_orig_yarn: int
    rope_attn_factor: float = 1.0      # rope.scaling.attn_factor: scales RoPE's cos and sin (Phi-3 LongRoPE)
    # mixture of experts: each layer's FFN is n_expert FFNs of n_ff_exp (expert_feed_forward_length,
    # by default n_ff), of which each token uses n_expert_used (0: a dense FFN)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    f_attention_scale: float = 0.0     # the queries' scale; 0: 1 / sqrt(head size)
    # sliding-window attention (Gemma 3): the window, and per layer whether it slides; those layers
    # rotate with their own base and scale
    n_swa: int = 0
    swa_layers: tuple = ()
    rope_freq_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0

    def is_swa(self, il) -> bool:
        """Whether layer ``il`` attends over a sliding window of ``n_swa`` positions (llama.cpp's ``is_swa``)."""
        return bool(self.swa_layers) and self.swa_layers[il]

    @property
    def n_gqa(self) -> int:
        """Query heads per key/value head (grouped-query attention; 1 for plain multi-head attention)."""
        return self.n_head // self.n_head_kv

    @property
    def n_embd_k_gqa(self) -> int:
        """Width of one token's keys over all key/value heads: ``n_embd_head_k * n_head_kv``."""
        return self.n_embd_head_k * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        """Width of one token's values over all key/value heads: ``n_embd_head_v * n_head_kv``."""
        return self.n_embd_head_v * self.n_head_kv

    @classmethod
    def from_metadata(cls, meta: dict, path="<metadata>") -> "HParams":
        """Read and check the keys llama.cpp's ``load_hparams`` reads for the file's architecture."""
        arch = get_arch(get_key(meta, path, "general.architecture", "str", required=True), path).name
        p = arch + "."
        n_layer = get_count(meta, path, p + "block_count", required=True)
        n_embd = get_count(meta, path, p + "embedding_length", required=True)
        n_head = get_per_layer(meta, path, p + "attention.head_count", n_layer, required=True)
        n_head_kv = get_per_layer(meta, path, p + "attention.head_count_kv", n_layer, default=n_head)
        n_ff = get_per_layer(meta, path, p + "feed_forward_length", n_layer, required=True)
        if n_head % n_head_kv:
            raise GGUFError(path, p + "attention.head_count_kv",
                            f"{n_head} heads cannot be shared by {n_head_kv} KV heads")
        n_expert = get_count(meta, path, p + "expert_count", default=0, lo=0)
        experts = get_arch(arch).experts
        if n_expert and not experts:
            raise GGUFError(path, p + "expert_count", f"mixture-of-experts {arch} models are not supported")
        if experts == "required" and not n_expert:
            raise GGUFError(path, p + "expert_count", f"required key is missing or 0 for a {arch} model")
        n_expert_used = get_count(meta, path, p + "expert_used_count", required=True) if n_expert else 0
        if n_expert_used > n_expert:
            raise GGUFError(path, p + "expert_used_count", f"{n_expert_used} experts used of {n_expert}")
        if (p + "attention.key_length" not in meta or p + "attention.value_length" not in meta) \
                and n_embd % n_head:
            raise GGUFError(path, p + "attention.head_count",
                            f"n_embd {n_embd} is not a multiple of {n_head} heads")
        n_embd_head_k = get_count(meta, path, p + "attention.key_length", default=n_embd // n_head)
        n_embd_head_v = get_count(meta, path, p + "attention.value_length", default=n_embd // n_head)
        n_rot = get_count(meta, path, p + "rope.dimension_count", default=n_embd_head_k)
        if n_rot != n_embd_head_k or n_rot % 2:  # llama.cpp: "invalid n_rot" (llama), an assert (qwen2/3)
            raise GGUFError(path, p + "rope.dimension_count",
                            f"{n_rot} must equal the head size {n_embd_head_k} and be even")
        scaling = get_key(meta, path, p + "rope.scaling.type", "str", "linear")
        if scaling not in ROPE_SCALING_TYPES:
            raise GGUFError(path, p + "rope.scaling.type",
                            f"unknown rope scaling {scaling!r}; expected one of {ROPE_SCALING_TYPES}")
        factor_key = p + "rope.scaling.factor" if p + "rope.scaling.factor" in meta else p + "rope.scale_linear"
        factor = get_positive_float(meta, path, factor_key, 0.0, allow_zero=True)
        n_ctx_train = get_count(meta, path, p + "context_length", required=True)
        # llama.cpp shapes the tensors by the token list (vocab.n_tokens()); vocab_size serves files
        # without a vocabulary
        tokens = meta.get("tokenizer.ggml.tokens")
        n_vocab = get_count(meta, path, p + "vocab_size")
        if isinstance(tokens, list) and tokens:
            if n_vocab is not None and n_vocab != len(tokens):
                raise GGUFError(path, p + "vocab_size", f"{n_vocab} disagrees with the {len(tokens)} "
                                                        f"entries of tokenizer.ggml.tokens")
            n_vocab = len(tokens)
        elif n_vocab is None:
            raise GGUFError(path, p + "vocab_size",
                            "missing, and there is no tokenizer.ggml.tokens list to count")
        return cls(
            arch=arch, n_vocab=n_vocab, n_ctx_train=n_ctx_train, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff,
            n_head=n_head, n_head_kv=n_head_kv, n_embd_head_k=n_embd_head_k, n_embd_head_v=n_embd_head_v,
            n_rot=n_rot,
            f_norm_rms_eps=get_positive_float(meta, path, p + "attention.layer_norm_rms_epsilon",
                                               required=True),
            rope_freq_base=get_positive_float(meta, path, p + "rope.freq_base", 10000.0),
            rope_scaling_type=scaling,
            rope_freq_scale=1.0 if factor == 0 else 1.0 / factor,
            n_ctx_orig_yarn=get_count(meta, path, p + "rope.scaling.original_context_length",
                                       default=n_ctx_train),
            rope_attn_factor=get_positive_float(meta, path, p + "rope.scaling.attn_factor", 1.0),
            n_expert=n_expert, n_expert_used=n_expert_used,
            n_ff_exp=_n_ff_exp(arch, meta, path, n_ff, n_expert_used) if n_expert else 0,
            **_arch_hparams(arch, meta, path, n_layer, n_embd, n_head, n_embd_head_k),
        )


def _arch_hparams(arch, meta, path, n_layer, n_embd, n_head, n_embd_head_k) -> dict:
    """The keys one family reads beyond the common ones (llama.cpp's ``load_arch_hparams``)."""
    p = arch + "."
    if arch != "gemma3":
        # phi3 files carry attention.sliding_window too, but llama.cpp turns Phi's SWA off
        return {}
    # Gemma 3: the queries scaled by 1/sqrt(head size), but 1/sqrt(n_embd / n_head) for the 27B
    # model, which llama.cpp recognizes by its 62 layers
    head = n_embd // n_head if n_layer == 62 else n_embd_head_k
    out = {"f_attention_scale": float(np.float32(1) / np.sqrt(np.float32(head)))}
    n_swa = get_count(meta, path, p + "attention.sliding_window", default=0, lo=0)
    if n_swa == 0:   # no window: every layer global, as llama.cpp's non-SWA gemma3 graph
        if get_positive_float(meta, path, p + "final_logit_softcapping", 0.0, allow_zero=True):
            raise GGUFError(path, p + "final_logit_softcapping", "final logit soft-capping is not supported")
        return out
    # which layers slide (llama.cpp's load_swa_pattern): a per-layer array, else a period n
    # (default 6) in which the first n - 1 layers slide and the last is global
    key = p + "attention.sliding_window_pattern"
    pattern = meta.get(key)
    if isinstance(pattern, list):
        if len(pattern) != n_layer or not all(isinstance(v, (bool, int)) for v in pattern):
            raise GGUFError(path, key, f"expected {n_layer} per-layer flags, got {str(pattern)[:60]}")
        swa = tuple(bool(v) for v in pattern)
    else:
        n = get_count(meta, path, key, default=6, lo=0)
        swa = tuple(n == 0 or il % n < n - 1 for il in range(n_layer))
    return {**out, "n_swa": n_swa, "swa_layers": swa}


def _n_ff_exp(arch, meta, path, n_ff, n_expert_used):
    """An expert's FFN width: LLaMA's experts (Mixtral) are ``n_ff`` wide, as llama.cpp builds them
    whatever else the file says; the other families read ``expert_feed_forward_length``, by default
    ``n_ff / n_expert_used`` (llama.cpp's qwen3moe)."""
    if arch == "llama":
        return n_ff
    return get_count(meta, path, arch + ".expert_feed_forward_length", default=max(n_ff // n_expert_used, 1))


def tensor_shapes(hp: HParams) -> tuple:
    """``(required, optional)``: dicts of tensor name -> ``ne`` (GGML order) that llama.cpp's loader
    creates for ``hp.arch`` (``archs.py``). ``output.weight`` is optional in every family: without
    it the output projection is tied to ``token_embd.weight``."""
    return get_arch(hp.arch).tensors(hp)


def check_tensors(hp: HParams, tensors: dict, path="<tensors>") -> dict:
    """Check a file's tensors (name -> ``TensorInfo``) against the layout of ``hp``'s architecture:
    every required tensor present with its shape and a weight type, no tensor the model would not
    use (llama.cpp fails such a file with "wrong number of tensors"). Returns name -> ``TensorInfo``
    for the model's tensors, with ``output.weight`` mapped to the ``token_embd.weight`` info when the
    output is tied (llama.cpp's ``TENSOR_DUPLICATED``)."""
    required, optional = tensor_shapes(hp)
    for name in tensors:
        if name not in required and name not in optional:
            raise GGUFError(path, f"tensor '{name}'", f"unexpected tensor for a {hp.n_layer}-layer "
                                                      f"{hp.arch} model")
    found = {}
    for name, ne in {**required, **optional}.items():
        info = tensors.get(name)
        if info is None:
            if name in required:
                raise GGUFError(path, f"tensor '{name}'", "required tensor is missing")
            continue
        if tuple(info.ne) != ne:
            raise GGUFError(path, f"tensor '{name}'", f"has shape {list(info.ne)}, the metadata "
                                                      f"implies {list(ne)}")
        if info.type not in WEIGHT_TYPES:
            raise GGUFError(path, f"tensor '{name}'", f"type {type_name(info.type)} cannot hold a weight")
        found[name] = info
    found.setdefault("output.weight", found["token_embd.weight"])
    return found
