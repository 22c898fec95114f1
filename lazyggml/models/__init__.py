"""Model architectures built from lazyggml ops: ``llama.py`` (the LLaMA graph, its KV cache, the
runner and ``load_model``) and ``hparams.py`` (hyper-parameters read from GGUF, per family)."""

from pathlib import Path

__all__ = ["default_model_path"]


def default_model_path():
    """The small LLaMA model shipped with the package (trained by scripts/train_default_model.py)."""
    return Path(__file__).resolve().parent.parent / "data" / "default.gguf"
