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
PoCL's kernel cache in folders of its own (``backends/opencl/backend.py``'s ``cache_dir``), the
binaries through ``read_entry`` / ``write_entry``.

A cache that is damaged, shared or read-only must not stop a run. Importing this module patches
Numba's cache files (``numba.core.caching``; the user's own cached functions in this process get the
same) so that:

* a truncated or corrupt index (``.nbi``) or data file (``.nbc``) is a miss: the kernel compiles
  and the save that follows replaces the file (Numba would raise from ``pickle``);
* saves are safe between processes: each save holds a lock on ``.lock`` in its folder, reads the
  index afresh, and writes the code before the index entry that names it. Numba reads the index,
  adds the entry and writes it back unlocked, so two processes saving signatures of one kernel at
  once lose an entry or pair a key with another signature's code;
* a cache that cannot be written is read all the same, and what compiles stays in memory, said
  once per process on stderr (``warn_not_writable``). Numba would test at every decoration that
  the folder can be written, creating it, and fall back to ``__pycache__`` or a folder of its own
  choosing when it cannot; here a folder is made by the first save into it, so a run that compiles
  nothing (``lazyggml warmup --check``) writes nothing.

``lazyggml warmup`` fills the cache ahead of time (``warmup.py``).
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import re
import sys

from . import debug
from .debug import log

try:
    import fcntl
except ImportError:     # Windows: no flock, so saves there are unlocked, as Numba's own are
    fcntl = None


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
    chosen = debug.value("LAZYGGML_CACHE_DIR") or os.environ.get("NUMBA_CACHE_DIR")
    if chosen:
        return os.path.abspath(os.path.expanduser(chosen))
    return os.path.join(user_cache_root(), "lazyggml", VERSION)


CACHE_DIR = cache_dir()


def _point_numba_here() -> None:
    os.environ["NUMBA_CACHE_DIR"] = CACHE_DIR
    for name in ("numba.core.config", "numba.cuda.core.config"):
        config = sys.modules.get(name)
        if config is not None:
            config.CACHE_DIR = CACHE_DIR


_point_numba_here()


_said_not_writable = False


def warn_not_writable(path):
    """Say, once per process, that ``path`` in the cache cannot be written; the caller goes on
    without saving."""
    global _said_not_writable
    if not _said_not_writable:
        _said_not_writable = True
        log.warning(f"lazyggml: warning: the kernel cache {CACHE_DIR} is not writable ({path}): "
                    "kernels compiled now are kept in memory only")


def writable(folder):
    """Whether ``folder`` can be written, or created, by this process; nothing is written to find out."""
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)


def read_entry(path):
    """The bytes that ``write_entry`` saved at ``path``; None when the file is missing, truncated or corrupt."""
    try:
        with open(path, "rb") as f:
            digest, data = f.read(32), f.read()
    except OSError:
        return None
    return data if hashlib.sha256(data).digest() == digest else None


def write_entry(path, data):
    """Save ``data`` at ``path`` behind its SHA-256, atomically: a reader, in any process, finds the
    old file or the whole new one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(hashlib.sha256(data).digest() + data)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        warn_not_writable(e.filename or path)


def _make_numba_cache_safe():
    """The patches of the module docstring, on Numba's classes."""
    from numba.core import caching

    # the locator of NUMBA_CACHE_DIR: no test at decoration (our save makes the folder)
    locator = getattr(caching, "UserProvidedCacheLocator", None) or caching._UserProvidedCacheLocator  # older Numba
    locator.ensure_cache_path = lambda self: None
    files = caching.IndexDataCacheFile
    load, load_index = files.load, files._load_index

    def safe_load(self, key):
        try:
            return load(self, key)
        except Exception:   # a truncated or corrupt data file
            return None

    def safe_load_index(self):
        try:
            return load_index(self)
        except Exception:   # a truncated or corrupt index: as if there were none
            return {}

    def locked_save(self, key, data):
        try:
            os.makedirs(self._cache_path, exist_ok=True)
            with open(os.path.join(self._cache_path, ".lock"), "a") as lock:
                if fcntl:
                    fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
                overloads = self._load_index()
                name = overloads.get(key) or next(n for n in map(self._data_name, itertools.count(1))
                                                  if n not in overloads.values())
                self._save_data(name, data)
                overloads[key] = name
                self._save_index(overloads)
        except OSError as e:
            warn_not_writable(e.filename or self._cache_path)

    files.load, files._load_index, files.save = safe_load, safe_load_index, locked_save


_make_numba_cache_safe()


def tie_cache(namespace: dict, salt: str, *paths: str) -> None:
    """Make the on-disk cache of every cached ``@njit`` function in ``namespace`` depend on the
    source files ``paths`` and on ``salt`` (the CPU kernels pass their instruction-set choice,
    ``simd.ISA``).

    Numba keys a cached function on ITS OWN source file only: a kernel in matmul.py that inlines
    code from type_k.py would otherwise keep running stale machine code after type_k.py changes,
    and a cache written with ``LAZYGGML_SIMD=portable`` would be reused without it. We fold a hash
    of the dependencies into each function's cache stamp (numba's ``IndexDataCacheFile``), so any
    change invalidates the entry. If a future Numba renames these internals, this does nothing.
    tests/test_cache_deps.py checks each CPU module's list against the code its kernels reach.
    """
    h = hashlib.sha256(salt.encode())
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    digest = h.hexdigest()
    objs = list(namespace.values())
    for obj in objs + [getattr(o, "run", None) for o in objs]:   # parallel_kernel's pool drivers
        cache_file = getattr(getattr(obj, "_cache", None), "_cache_file", None)
        if cache_file is not None and hasattr(cache_file, "_source_stamp"):
            cache_file._source_stamp = (cache_file._source_stamp, digest)
