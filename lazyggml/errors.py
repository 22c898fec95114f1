"""The errors lazyggml raises for bad input, one small hierarchy.

Every one is a ``LazyGGMLError``, so ``except lg.LazyGGMLError`` catches all that lazyggml itself
reports, and each also derives from the built-in exception it always was (``ValueError``,
``MemoryError``, ...), so code that caught those keeps working::

    LazyGGMLError
    ├── GGUFError            (ValueError)           a malformed or unsupported GGUF file
    ├── ShapeError           (ValueError)           shapes an op or a copy cannot take
    ├── TensorTypeError      (ValueError)           a tensor type or NumPy dtype that does not fit
    ├── UnsupportedOpError   (NotImplementedError)  no backend (or not the chosen one) runs a node
    ├── ChatTemplateError    (ValueError)           a chat template missing, unparsable or failing
    └── AllocationError      (RuntimeError)         a tensor without memory where it needs some
        └── OutOfMemoryError (MemoryError)          a buffer or device too small for what it must hold

A message names the function or op, the tensor (by name, or by its op when it has none), and what
was expected against what was given. Misuse of Python itself (a wrong argument type, an unknown
keyword) stays a plain ``TypeError``/``ValueError``.
"""
from __future__ import annotations

__all__ = ["LazyGGMLError", "GGUFError", "ShapeError", "TensorTypeError", "UnsupportedOpError",
           "ChatTemplateError", "AllocationError", "OutOfMemoryError"]


class LazyGGMLError(Exception):
    """The base of every error lazyggml raises for bad input or an impossible request."""


class GGUFError(LazyGGMLError, ValueError):
    """A malformed or unsupported GGUF file. ``path`` and ``field`` say where."""

    def __init__(self, path, field: str, message: str):
        self.path = str(path)
        self.field = field
        self.message = message
        super().__init__(f"{self.path}: {field}: {message}")

    def __reduce__(self):  # pickles (for multiprocessing) with its three arguments
        return type(self), (self.path, self.field, self.message)


class ShapeError(LazyGGMLError, ValueError):
    """Shapes (or byte sizes) that an op, a view or a copy cannot take."""


class TensorTypeError(LazyGGMLError, ValueError):
    """A tensor type an op does not take, or NumPy data whose dtype does not match a tensor's."""


class UnsupportedOpError(LazyGGMLError, NotImplementedError):
    """A graph node that no backend can run (or not the backend it was assigned to)."""


class ChatTemplateError(LazyGGMLError, ValueError):
    """A chat template that is missing, does not parse, or fails while rendering; the message names
    where it came from (the GGUF file and ``tokenizer.chat_template``, or ``--chat-template``)."""


class AllocationError(LazyGGMLError, RuntimeError):
    """A tensor used without memory: computed, read or written before any allocator placed it."""


class OutOfMemoryError(AllocationError, MemoryError):
    """A buffer, context or device with too little memory for what it was asked to hold."""
