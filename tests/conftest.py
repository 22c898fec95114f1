"""What the whole test run needs, checked once before any test runs."""
import importlib.util
import sys
from pathlib import Path

import pytest


def pytest_configure(config):
    """llama.cpp's RPC backend, the other end of the RPC tests: without it they abort in C, one by
    one. pip reuses a llama-cpp-python wheel it built before, perhaps without RPC, so the run stops
    here, at once, with one line saying what to run. Found by its library beside llama_cpp's
    (``lib/libggml-rpc.so``), without loading llama.cpp."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not any((Path(spec.origin).parent / "lib").glob("*ggml-rpc*")):
        pip = f"{sys.executable} -m pip"
        raise pytest.UsageError(
            f"llama-cpp-python with its RPC backend (CMAKE_ARGS=-DGGML_RPC=ON), the llama.cpp oracle of the tests, "
            f"is missing from {sys.prefix} (pip may have reused a wheel built without it): run "
            f"`{pip} uninstall -y llama-cpp-python && {pip} cache remove llama_cpp_python`, then README.md's "
            f"test command again")
