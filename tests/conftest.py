"""What the whole test run needs, checked once before any test runs."""
import importlib.util
import os
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
    _follow_the_oracles_simd()


def _follow_the_oracles_simd():
    """lazyggml's float sums follow the lane width of the GGML the oracles were built for: 8 lanes
    (AVX2) where ``tests/oracle_cflags.sh`` built them without AVX-512, 16 where they have it
    (``LAZYGGML_GGML_AVX512``, read when lazyggml is imported, so set here, before any test module
    imports it; child processes inherit it). ggml-python's build answers for both oracles, which
    README.md's test command builds with the same flags; ``llama_cpp_oracle.run_llama_cpp`` checks
    llama.cpp's."""
    import ggml
    assert "lazyggml" not in sys.modules, "lazyggml was imported before tests/conftest.py configured it"
    os.environ["LAZYGGML_GGML_AVX512"] = "1" if ggml.ggml_cpu_has_avx512() else "0"
