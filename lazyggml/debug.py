"""The environment switches: every ``LAZYGGML_*`` variable lazyggml reads, declared in one table,
and the debug log.

A module reads a switch through ``flag``, ``value`` or ``level`` below, never through
``os.environ``, and a name missing from ``SWITCHES`` raises, so a misspelt switch fails loudly
instead of reading as unset. ``tests/test_switches.py`` checks that every ``LAZYGGML_`` name in the
sources is declared here, that no other module reads one directly, and that README.md's
"Environment switches" table lists exactly these. Each module reads its switches when it always
has: some once, at import (``LAZYGGML_SIMD`` picks the kernels' instructions then), others at
every call (``LAZYGGML_DEBUG``), so that a test can set them with ``monkeypatch.setenv``.

``LAZYGGML_DEBUG=1`` logs the allocator's memory report and the OpenCL compiler's build log and
warnings (hidden otherwise); ``LAZYGGML_SCHED_DEBUG=1|2`` logs the
scheduler's splits (and every node at 2). Both go through the ``logging`` logger ``"lazyggml"``.

This module is a leaf: it imports the standard library only, because ``cache.py`` reads
``LAZYGGML_CACHE_DIR`` through it before Numba is imported.
"""
import logging
import os
import re
from typing import NamedTuple, Optional

log = logging.getLogger("lazyggml")


class Switch(NamedTuple):
    """One environment switch. ``kind`` says how its text is read (and which accessor reads it):

    * ``"flag"``: unset or empty is ``default``; ``"0"`` is off; any other text is on;
    * ``"level"``: the leading integer, as C's ``atoi`` reads it (GGML reads its switches so); 0 if none;
    * ``"value"``: the text as it is, ``default`` when unset.
    """
    name: str
    default: object
    kind: str
    doc: str


_TABLE = [
    # debugging
    Switch("LAZYGGML_DEBUG", 0, "level", "1: log the allocator's memory report and the OpenCL compiler's build log"),
    Switch("LAZYGGML_SCHED_DEBUG", 0, "level", "1: log the scheduler's splits in GGML's format; 2: every node too"),
    Switch("LAZYGGML_SCHED_DEBUG_REALLOC", 0, "level",
           "1: raise on a scheduler re-reservation that nothing explains; 2: on any re-reservation"),
    Switch("LAZYGGML_TEST_SEED", None, "value", "the seed of the op cases' random data (random per process when unset)"),
    # devices
    Switch("LAZYGGML_DISABLE_CUDA", False, "flag", "1: leave the CUDA backend out of device discovery"),
    Switch("LAZYGGML_DISABLE_OPENCL", False, "flag", "1: leave the OpenCL backend out of device discovery"),
    Switch("LAZYGGML_OPENCL_DEVICE", "", "value", "keep only the OpenCL device of this index, or whose name contains this"),
    Switch("LAZYGGML_CUDA_SIM", "", "value", "N: offer N simulated CUDA devices (under NUMBA_ENABLE_CUDASIM=1)"),
    # CPU kernels
    Switch("LAZYGGML_CACHE_DIR", None, "value", "the kernel cache's directory (else NUMBA_CACHE_DIR, else the user cache)"),
    Switch("LAZYGGML_SIMD", "auto", "value", "portable: CPU kernels without AVX2/F16C/AVX-512 instructions"),
    Switch("LAZYGGML_GGML_AVX512", True, "flag",
           "0: on an AVX-512 CPU, float sums in the order of GGML built for AVX2 (8 lanes), not for AVX-512 (16)"),
    Switch("LAZYGGML_CPU_REPLAY", True, "flag", "0: call each CPU kernel from Python instead of replaying the plan natively"),
    Switch("LAZYGGML_LLAMAFILE", True, "flag", "0: float products in GGML's vec_dot order, not llamafile's sgemm order"),
    Switch("LAZYGGML_TILED_MM", True, "flag", "0: quantized products in vec_dot's order, not GGML's tiled matmul order"),
    # CUDA kernels
    Switch("LAZYGGML_CUDA_GRAPHS", True, "flag", "0: launch every kernel, never capture or replay CUDA graphs"),
    Switch("LAZYGGML_CUDA_MMQ", "", "value", "dp4a: quantized products with dp4a instead of int8 tensor cores"),
    Switch("LAZYGGML_CUDA_DP4A", "", "value", "link: dp4a through linked CUDA C instead of inline PTX"),
]
#: Every switch by name.
SWITCHES = {s.name: s for s in _TABLE}


def _switch(name, kind):
    s = SWITCHES.get(name)
    if s is None:
        raise KeyError(f"{name} is not a lazyggml switch: declare it in lazyggml/debug.py's SWITCHES")
    if s.kind != kind:
        raise TypeError(f"{name} is a {s.kind} switch: read it with debug.{s.kind}()")
    return s


def flag(name) -> bool:
    """Switch ``name`` as on/off: unset or empty is its default, ``"0"`` off, any other text on."""
    s = _switch(name, "flag")
    text = os.environ.get(name)
    return s.default if not text else text != "0"


def value(name) -> Optional[str]:
    """Switch ``name``'s text, or its default when unset (an empty text is returned as it is)."""
    return os.environ.get(name, _switch(name, "value").default)


def level(name) -> int:
    """Switch ``name`` read as C's ``atoi`` (GGML reads its switches so): 0 when unset or not a number."""
    _switch(name, "level")
    m = re.match(r"\s*([+-]?\d+)", os.environ.get(name) or "")
    return int(m.group(1)) if m else 0


def enable_log():
    """Make DEBUG records visible: GGML prints them to stderr unconditionally. A handler is added
    only when the application configured none, so nothing is printed twice."""
    if log.level == logging.NOTSET or log.level > logging.DEBUG:
        log.setLevel(logging.DEBUG)
    if not log.hasHandlers():
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
