"""The kernel cache's location (``lazyggml.cache``) and ``lazyggml warmup`` (``lazyggml.warmup``).

Everything that touches the cache runs in a fresh process with its own cache directory: a kernel
already in a process's memory is neither loaded nor compiled, and the user's cache must not be
touched. The warm-up tests run a few cheap cases (``--cases``) of a read-only copy of the package,
so they compile cold whatever the state of the repository's own cache. One test is the exception: it
runs two cases in this process, through ``warmup.run_cases`` as the command does, to see that they
run as the backend tests run them; it counts no hits or misses, and uses this session's cache as
``test_opencl.py`` does.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import lazyggml
from lazyggml import warmup
from lazyggml.types import Type

PACKAGE = Path(lazyggml.__file__).resolve().parent
CASES = "add,sum_rows"   # two cheap cases: four kernels, a few seconds cold


def _env(**overrides):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LAZYGGML_CACHE_DIR", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(LAZYGGML_DISABLE_OPENCL="1", LAZYGGML_DISABLE_CUDA="1")
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def _python(code, **env):
    r = subprocess.run([sys.executable, "-c", code], env=_env(**env), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _warmup(*args, cwd=None, pythonpath=None, **env):
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "lazyggml.cli", "warmup", *args], env=_env(**env), cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def _counts(r):
    m = re.search(r"^hits=(\d+) misses=(\d+)$", r.stdout, re.M)
    assert m and r.stdout.rstrip().endswith(m.group(0)), r.stdout + r.stderr
    return int(m.group(1)), int(m.group(2))


def _cached_files(root):
    return sorted(p for p in Path(root).rglob("*.nb[ic]"))


# -- where the cache lives ----------------------------------------------------------------------------
SHOW = "import lazyggml, numba, os; print(lazyggml.cache.CACHE_DIR, numba.config.CACHE_DIR, os.environ['NUMBA_CACHE_DIR'])"


def test_cache_dir_lazyggml_variable_wins(tmp_path):
    want = str(tmp_path / "mine")
    assert _python(SHOW, LAZYGGML_CACHE_DIR=want, NUMBA_CACHE_DIR=tmp_path / "numba").split() == [want] * 3


def test_cache_dir_follows_numba_variable(tmp_path):
    want = str(tmp_path / "numba")
    assert _python(SHOW, NUMBA_CACHE_DIR=want).split() == [want] * 3


def test_cache_dir_default_is_versioned_user_cache(tmp_path):
    want = str(tmp_path / "xdg" / "lazyggml" / lazyggml.__version__)
    assert _python(SHOW, XDG_CACHE_HOME=tmp_path / "xdg").split() == [want] * 3


def test_cache_dir_set_when_numba_was_imported_first(tmp_path):
    code = "import numba; " + SHOW.replace("import lazyggml, numba, os", "import lazyggml, os")
    want = str(tmp_path / "late")
    assert _python(code, LAZYGGML_CACHE_DIR=want).split() == [want] * 3


def test_cache_version_is_the_package_version():
    assert lazyggml.cache.VERSION == lazyggml.__version__


# -- the case table ------------------------------------------------------------------------------------
def test_case_names_are_unique_and_cover_every_weight_type():
    names = [c.name for c in warmup.CASES]
    assert len(names) == len(set(names))
    for t in warmup.WEIGHT_TYPES:
        assert any(c.family == "mul_mat" and t in c.types for c in warmup.CASES), t
        assert any(c.family == "rows" and t in c.types for c in warmup.CASES), t


def test_select_cases_by_type_and_pattern():
    q4 = warmup.select_cases([Type.Q4_K])
    assert all(not c.types or Type.Q4_K in c.types for c in q4)
    assert any(c.name.startswith("mul_mat(q4_K") for c in q4)
    assert not any(c.name.startswith("mul_mat(q8_0") for c in q4)
    assert [c.name for c in warmup.select_cases(None, ["add", "sum_rows"])] == ["add", "sum_rows"]


def test_unknown_backend_is_an_error(tmp_path):
    r = _warmup("--backend", "tpu", LAZYGGML_CACHE_DIR=tmp_path)
    assert r.returncode == 2 and "unknown backend 'tpu'" in r.stderr


# -- the warm-up itself --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def readonly_package(tmp_path_factory):
    """A copy of the package in a read-only folder, as in a system site-packages."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(PACKAGE, site / "lazyggml", ignore=shutil.ignore_patterns("__pycache__"))
    for p in [site / "lazyggml", *(site / "lazyggml").rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    yield str(site)
    for p in [site / "lazyggml", *(site / "lazyggml").rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)


def test_warmup_compiles_then_loads_then_checks(readonly_package, tmp_path):
    run = dict(cwd=tmp_path, pythonpath=readonly_package, XDG_CACHE_HOME=tmp_path / "xdg")
    cache = tmp_path / "xdg" / "lazyggml" / lazyggml.__version__

    empty = tmp_path / "empty"
    r = _warmup("--backend", "cpu", "--cases", CASES, "--check", **run, LAZYGGML_CACHE_DIR=empty)
    assert r.returncode == 1, r.stdout + r.stderr
    assert _counts(r)[1] > 0 and "would compile" in r.stdout
    assert not _cached_files(empty), "--check compiled something"

    r = _warmup("--backend", "cpu", "--cases", CASES, **run)
    assert r.returncode == 0, r.stdout + r.stderr
    hits, misses = _counts(r)
    assert misses >= 2 and f"kernel cache: {cache}" in r.stdout
    assert re.search(r"^  miss +\d+\.\d+ s +cpu +lazyggml\.backends\.cpu\.elementwise\.binary\(", r.stdout, re.M)
    assert _cached_files(cache), "nothing was written to the user cache directory"
    assert not _cached_files(readonly_package), "the package folder was written to"

    r = _warmup("--backend", "cpu", "--cases", CASES, **run)
    assert r.returncode == 0 and _counts(r)[1] == 0 and _counts(r)[0] >= 2, r.stdout

    r = _warmup("--backend", "cpu", "--cases", CASES, "--check", **run)
    assert r.returncode == 0 and _counts(r) == (_counts(r)[0], 0), r.stdout


def test_warmup_in_parallel_processes(readonly_package, tmp_path):
    run = dict(cwd=tmp_path, pythonpath=readonly_package, LAZYGGML_CACHE_DIR=tmp_path / "cache")
    r = _warmup("--backend", "cpu", "--cases", CASES + ",rms_norm", "--jobs", "2", **run)
    assert r.returncode == 0 and "in 2 processes" in r.stdout, r.stdout + r.stderr
    assert _counts(r)[1] >= 3
    r = _warmup("--backend", "cpu", "--cases", CASES + ",rms_norm", "--check", **run)
    assert r.returncode == 0, r.stdout


def test_check_writes_nothing(tmp_path):
    """--check on an empty cache, every backend there is (PoCL's cache left to lazyggml's default,
    inside the cache): misses reported, exit 1, and not a file or folder made."""
    cache = tmp_path / "cache"
    env = {k: v for k, v in _env(LAZYGGML_CACHE_DIR=cache, LAZYGGML_DISABLE_OPENCL=0).items() if k != "POCL_CACHE_DIR"}
    r = subprocess.run([sys.executable, "-m", "lazyggml.cli", "warmup", "--cases", CASES, "--check"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    hits, misses = _counts(r)
    assert hits == 0 and misses > 0
    if "OpenCL0" in r.stdout:
        assert re.search(r"^  would compile +0\.000 s +OpenCL0 +program$", r.stdout, re.M), r.stdout
    assert not cache.exists(), sorted(cache.rglob("*"))


# -- each case as the tests run it -----------------------------------------------------------------------
def test_opencl_launch_left_to_the_driver_runs_as_in_the_tests(monkeypatch):
    """The OpenCL backend only times a case's first launches for the warm-up's recorder: mul_mat's naive kernels, launched with the
    work-group size left to the driver (``lsize`` None), failed inside warm-up with a TypeError while
    ``op_cases.run_case`` passed (issue 41); their first launch is reported per global size."""
    if lazyggml.dev_by_name("OpenCL0") is None:
        pytest.skip("no OpenCL device")
    monkeypatch.setattr(lazyggml.dev_by_name("OpenCL0"), "launched", set())   # every first launch, reported
    names = [c.name for c in warmup.select_cases(None, ["mul_mat(f16, k=*, 70 columns*"])]
    outcomes = warmup.run_cases(["OpenCL0"], names)
    assert len(names) == 2 and [(o.case, o.ran, o.error) for o in outcomes] == [(n, True, "") for n in names]
    assert any(k.kernel == "kernel_mul_mat_f16_f32_naive" and k.signature == "(global size (20, 70, 4))"
               for k in outcomes[0].kernels), outcomes[0].kernels


# -- a damaged, read-only or shared cache --------------------------------------------------------------
def test_corrupt_cache_entries_are_recompiled(tmp_path):
    run = dict(cwd=tmp_path, LAZYGGML_CACHE_DIR=tmp_path / "cache")
    assert _warmup("--backend", "cpu", "--cases", "add", **run).returncode == 0
    for files, damage in (("*.nbi", lambda b: b[:len(b) // 2]), ("*.nbc", lambda b: b"garbage")):
        for p in (tmp_path / "cache").rglob(files):
            p.write_bytes(damage(p.read_bytes()))
        r = _warmup("--backend", "cpu", "--cases", "add", **run)
        assert r.returncode == 0 and _counts(r)[1] >= 2, r.stdout + r.stderr
        r = _warmup("--backend", "cpu", "--cases", "add", **run)
        assert r.returncode == 0 and _counts(r)[1] == 0, r.stdout + r.stderr


@contextlib.contextmanager
def _read_only(folder):
    """``folder`` and all in it read-only, for root too (which ignores permissions): immutable."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "-R", "+i", str(folder)], capture_output=True).returncode:
            pytest.skip("cannot make a folder immutable here (chattr)")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-R", "-i", str(folder)], check=True)
    else:
        paths = [folder, *folder.rglob("*")]
        for p in paths:
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        try:
            yield
        finally:
            for p in paths:
                p.chmod(p.stat().st_mode | stat.S_IWUSR)


def test_read_only_cache_is_read_and_compiles_in_memory(readonly_package, tmp_path):
    """A warm cache made read-only still serves its kernels; what is missing compiles in memory, said
    once on stderr; nothing is written, there or next to the package (Numba's fallback)."""
    cache = tmp_path / "cache"
    run = dict(cwd=tmp_path, pythonpath=readonly_package, LAZYGGML_CACHE_DIR=cache)
    assert _warmup("--backend", "cpu", "--cases", "add", **run).returncode == 0
    before = sorted(cache.rglob("*"))
    with _read_only(cache):
        r = _warmup("--backend", "cpu", "--cases", CASES, **run)
    assert r.returncode == 0, r.stdout + r.stderr
    hits, misses = _counts(r)
    assert hits >= 2 and misses >= 1, r.stdout
    warnings = [line for line in r.stderr.splitlines() if "not writable" in line]
    assert len(warnings) == 1 and str(cache) in warnings[0], r.stderr
    assert sorted(cache.rglob("*")) == before
    assert not _cached_files(readonly_package)


RACE = """
import os, sys, time
import lazyggml
from numba.core import caching
barrier, save_index = sys.argv[1], caching.IndexDataCacheFile._save_index

def meet_then_save_index(self, overloads):
    # both processes compiled the kernel binary (each a signature of its own): they meet here,
    # each before writing its index, for up to 5 s
    if self._index_name.startswith("binary-"):
        open(os.path.join(barrier, str(os.getpid())), "w").close()
        t0 = time.time()
        while len(os.listdir(barrier)) < 2 and time.time() - t0 < 5:
            time.sleep(0.05)
    save_index(self, overloads)

caching.IndexDataCacheFile._save_index = meet_then_save_index
from lazyggml.cli import main
sys.exit(main(["warmup", "--backend", "cpu", "--cases", sys.argv[2]]))
"""


def test_two_warmups_at_once_leave_a_valid_cache(tmp_path):
    """Two processes save signatures of one kernel at the same moment (Numba's unlocked save loses
    one of them there): both succeed, and a third run finds everything."""
    (tmp_path / "barrier").mkdir()
    env = _env(LAZYGGML_CACHE_DIR=tmp_path / "cache")
    cases = ("add", "add(permuted a, transposed b)")
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path / "barrier"), c], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cases]
    for p in procs:
        out = p.communicate(timeout=300)[0]
        assert p.returncode == 0, out
    r = _warmup("--backend", "cpu", "--cases", ",".join(cases), cwd=tmp_path, LAZYGGML_CACHE_DIR=tmp_path / "cache")
    assert r.returncode == 0 and _counts(r)[1] == 0, r.stdout + r.stderr
