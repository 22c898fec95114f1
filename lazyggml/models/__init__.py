"""Model architectures built from lazyggml ops."""

from pathlib import Path


def default_model_path():
    """The small LLaMA model shipped with the package (trained by scripts/train_default_model.py)."""
    return Path(__file__).resolve().parent.parent / "data" / "default.gguf"
