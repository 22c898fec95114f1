"""Where lazyggml keeps its compiled kernels, decided once, before Numba is imported.

Numba compiles every ``@njit(cache=True)`` kernel on first use (0.1 to 0.5 s each) and stores the
machine code so that later processes load it instead (a few ms each). By default Numba writes that
code next to the source, in ``__pycache__``, which fails in a read-only ``site-packages`` (Numba then
falls back to a cache directory of its own choosing) and survives upgrades as dead files. lazyggml
points Numba's cache at one directory of its own instead:

1. ``LAZYGGML_CACHE_DIR`` when set;
2. else ``NUMBA_CACHE_DIR`` when set (the user already chose where Numba caches);
3. else ``<user cache dir>/lazyggml/<version>``: ``platformdirs.user_cache_dir`` when platformdirs
   is installed (pyopencl brings it), otherwise ``$XDG_CACHE_HOME`` or ``~/.cache``. The version
   in the path means an upgrade starts from an empty cache, and removing the old version's folder
   frees its space.

Importing this module sets ``NUMBA_CACHE_DIR`` to that directory, so it has to run before Numba
reads its configuration: ``lazyggml/__init__.py`` imports it first. Numba reads the variable at
its own import, so when Numba was imported earlier (by the user's code) the live ``CACHE_DIR``
settings of Numba and numba-cuda are set as well. Numba keeps the variable for every cached
function compiled in this process afterwards, the user's own too: they then share the directory,
and each entry still records its own source file.

Inside the directory Numba makes one folder per source folder, named after it and a hash of its
full path (e.g. ``<cache>/cpu_43619b2d...`` for ``lazyggml/backends/cpu``), holding an index file
per kernel (``.nbi``) and one data file per compiled signature (``.nbc``). An index entry is
valid while the kernel's source file keeps its modification time and size, on a CPU of the same
model and features; a clone in another folder, or an edited file, compiles afresh.
``tie_cache`` adds what Numba's key misses. The OpenCL backend keeps its program binaries and
PoCL's kernel cache in folders of its own (``backends/opencl/backend.py``'s ``cache_dir``).

``lazyggml warmup`` fills the cache ahead of time (``warmup.py``).
"""
from __future__ import annotations

import hashlib
import os
import re
import sys


def _version() -> str:
    """lazyggml's ``__version__``, read from the package's ``__init__.py`` without importing it
    (this module runs first, and ``importlib.metadata`` costs ~40 ms and misses source trees)."""
    init = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__init__.py")
    try:
        with open(init, encoding="utf-8") as f:
            m = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    except OSError:
        m = None
    return m.group(1) if m else "unknown"


VERSION = _version()


def user_cache_root() -> str:
    """The platform's per-user cache directory (``~/.cache`` on Linux)."""
    try:
        import platformdirs
    except ImportError:
        return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return platformdirs.user_cache_dir()


def cache_dir() -> str:
    """The kernel cache directory, as the module docstring orders the choices."""
    for var in ("LAZYGGML_CACHE_DIR", "NUMBA_CACHE_DIR"):
        if os.environ.get(var):
            return os.path.abspath(os.path.expanduser(os.environ[var]))
    return os.path.join(user_cache_root(), "lazyggml", VERSION)


CACHE_DIR = cache_dir()


def _point_numba_here() -> None:
    os.environ["NUMBA_CACHE_DIR"] = CACHE_DIR
    for name in ("numba.core.config", "numba.cuda.core.config"):
        config = sys.modules.get(name)
        if config is not None:
            config.CACHE_DIR = CACHE_DIR


_point_numba_here()


def tie_cache(namespace: dict, salt: str, *paths: str) -> None:
    """Make the on-disk cache of every cached ``@njit`` function in ``namespace`` depend on the
    source files ``paths`` and on ``salt`` (the CPU kernels pass their instruction-set choice,
    ``simd.ISA``).

    Numba keys a cached function on ITS OWN source file only: a kernel in matmul.py that inlines
    code from vec_dot.py would otherwise keep running stale machine code after vec_dot.py changes,
    and a cache written with ``LAZYGGML_SIMD=portable`` would be reused without it. We fold a hash
    of the dependencies into each function's cache stamp (numba's ``IndexDataCacheFile``), so any
    change invalidates the entry. If a future Numba renames these internals, this does nothing.
    """
    h = hashlib.sha256(salt.encode())
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    digest = h.hexdigest()
    objs = list(namespace.values())
    for obj in objs + [getattr(o, "serial", None) for o in objs]:   # parallel_kernel's serial twins
        cache_file = getattr(getattr(obj, "_cache", None), "_cache_file", None)
        if cache_file is not None and hasattr(cache_file, "_source_stamp"):
            cache_file._source_stamp = (cache_file._source_stamp, digest)
