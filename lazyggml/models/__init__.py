"""Models built from lazyggml ops: ``runner.py`` (``load_model``: weights, KV cache, graphs per
batch shape, ``eval``, ``generate``, the same for every family), ``archs.py`` (the architectures by
``general.architecture``: tensors, RoPE type, graph function), ``builder.py`` (the blocks graphs
are built from), ``llama.py`` (the LLaMA graph, shared by Qwen2 and Qwen3), ``gemma3.py`` and
``phi3.py`` (the Gemma 3 and Phi-3 graphs) and ``hparams.py``
(hyper-parameters read from GGUF, and the tensor check)."""

from pathlib import Path

__all__ = ["default_model_path"]


def default_model_path():
    """The small LLaMA model shipped with the package (trained by scripts/train_default_model.py)."""
    return Path(__file__).resolve().parent.parent / "data" / "default.gguf"
