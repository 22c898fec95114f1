"""Models built from lazyggml ops: ``runner.py`` (``load_model``: a ``Model`` puts the rest together,
``eval``, ``decode``, ``generate``), ``batch.py`` (a batch of tokens from many sequences, checked and
cut into micro-batches), ``loader.py`` (weights placed by the op each tensor feeds, and loaded),
``kv_cache.py`` (the KV cache: cells with positions and sequences, its layout and inputs),
``inputs.py`` (micro-batches and graph inputs that fill themselves from one), ``builder.py`` (the
blocks graphs are built from), ``graphs.py`` (graphs kept per batch shape), ``archs.py`` (the
architectures by ``general.architecture``: tensors and the ops they feed, RoPE type, graph
function), ``llama.py`` (the LLaMA graph, shared by Qwen2 and Qwen3), ``gemma3.py`` and ``phi3.py``
(the Gemma 3 and Phi-3 graphs) and ``hparams.py`` (hyper-parameters read from GGUF, and the tensor
check)."""

from pathlib import Path

__all__ = ["default_model_path"]


def default_model_path():
    """The small LLaMA model shipped with the package (trained by scripts/train_default_model.py)."""
    return Path(__file__).resolve().parent.parent / "data" / "default.gguf"
