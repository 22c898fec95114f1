"""The environment switches: one table (``lazyggml/debug.py``'s ``SWITCHES``), read through its accessors.

* every ``LAZYGGML_*`` name in lazyggml's sources (code, messages, docstrings, comments) is in the
  table, spelt out in full: a name built at run time (``f"LAZYGGML_DISABLE_{x}"``) would escape
  this check, so there is none;
* no module but debug.py reads ``os.environ`` for a ``LAZYGGML_`` name;
* README.md's "Environment switches" table lists exactly the table's names;
* ``flag``, ``value`` and ``level`` read as the modules did before the table existed, and refuse
  a name that is not in it.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re

import pytest

from lazyggml import cache, debug

ROOT = pathlib.Path(debug.__file__).resolve().parent
README = ROOT.parent / "README.md"
NAME = re.compile(r"LAZYGGML_[A-Z0-9_]+")
SOURCES = sorted(ROOT.rglob("*.py"))


def test_every_name_in_the_sources_is_a_switch():
    unknown = {f"{p.relative_to(ROOT.parent)}: {n}" for p in SOURCES for n in NAME.findall(p.read_text())
               if n not in debug.SWITCHES}
    assert sorted(unknown) == [], "declare these in lazyggml/debug.py's SWITCHES (and README.md)"


def _environ_reads(source):
    """Line numbers of the calls, subscripts and ``in`` tests that touch ``environ``/``getenv``
    with a ``LAZYGGML_`` string (f-strings included) among their parts."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Call, ast.Subscript, ast.Compare)):
            parts = list(ast.walk(node))
            touches = any(getattr(n, "attr", getattr(n, "id", None)) in ("environ", "getenv") for n in parts)
            if touches and any(isinstance(n, ast.Constant) and "LAZYGGML_" in str(n.value) for n in parts):
                yield node.lineno


def test_only_debug_reads_the_environment_for_switches():
    direct = [f"{p.relative_to(ROOT.parent)}:{line}" for p in SOURCES if p.name != "debug.py" or p.parent != ROOT
              for line in _environ_reads(p.read_text())]
    assert direct == [], "read these through lazyggml.debug's flag/value/level"


def test_the_environment_check_sees_direct_reads():
    snippets = ['os.environ.get("LAZYGGML_X", "1")', 'os.getenv(f"LAZYGGML_{name}")', '"LAZYGGML_X" in os.environ',
                'environ["LAZYGGML_X"]']
    assert [len(list(_environ_reads(s))) for s in snippets] == [1, 1, 1, 1]
    assert list(_environ_reads('debug.value("LAZYGGML_X") or os.environ.get("NUMBA_CACHE_DIR")')) == []


def test_readme_lists_exactly_the_switches():
    text = README.read_text()
    section = text.split("\n## Environment switches\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(LAZYGGML_[A-Z0-9_]+)` \|", section, re.M)
    assert sorted(listed) == sorted(debug.SWITCHES), "README.md's Environment switches table is out of date"
    assert set(NAME.findall(text)) <= set(debug.SWITCHES)   # the prose names no other


def test_the_table_is_well_formed():
    for name, s in debug.SWITCHES.items():
        assert name == s.name and name.startswith("LAZYGGML_") and s.doc
        assert {"flag": isinstance(s.default, bool), "level": s.default == 0,
                "value": s.default is None or isinstance(s.default, str)}[s.kind], name


@pytest.mark.parametrize("text", [None, "", "0", "1", "no", " 0", "false"])
def test_flags_read_as_before(monkeypatch, text):
    """A flag on by default was ``get(name, "1") != "0"``; one off by default (``LAZYGGML_DISABLE_*``)
    was on unless ``get(name, "0") in ("", "0")``."""
    for name in ("LAZYGGML_CPU_REPLAY", "LAZYGGML_DISABLE_CUDA"):
        if text is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, text)
    assert debug.flag("LAZYGGML_CPU_REPLAY") == (os.environ.get("LAZYGGML_CPU_REPLAY", "1") != "0")
    assert debug.flag("LAZYGGML_DISABLE_CUDA") == (os.environ.get("LAZYGGML_DISABLE_CUDA", "0") not in ("", "0"))


def test_values_and_levels(monkeypatch, tmp_path):
    for name in ("LAZYGGML_SIMD", "LAZYGGML_TEST_SEED", "LAZYGGML_OPENCL_DEVICE", "LAZYGGML_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    assert (debug.value("LAZYGGML_SIMD"), debug.value("LAZYGGML_TEST_SEED"), debug.value("LAZYGGML_OPENCL_DEVICE")) == \
        ("auto", None, "")
    monkeypatch.setenv("LAZYGGML_SIMD", "")
    assert debug.value("LAZYGGML_SIMD") == ""   # set but empty is not the default (simd.py refuses it)
    assert debug.level("LAZYGGML_DEBUG") == 0
    for text, want in (("2", 2), (" 3x", 3), ("-1", -1), ("on", 0), ("", 0)):   # C's atoi
        monkeypatch.setenv("LAZYGGML_DEBUG", text)
        assert debug.level("LAZYGGML_DEBUG") == want, text
    # the cache directory: LAZYGGML_CACHE_DIR when non-empty, else NUMBA_CACHE_DIR
    monkeypatch.setenv("LAZYGGML_CACHE_DIR", "")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    assert cache.cache_dir() == str(tmp_path / "numba")
    monkeypatch.setenv("LAZYGGML_CACHE_DIR", str(tmp_path / "ours"))
    assert cache.cache_dir() == str(tmp_path / "ours")


def test_unknown_names_and_wrong_kinds_raise():
    for read in (debug.flag, debug.value, debug.level):
        with pytest.raises(KeyError, match="LAZYGGML_NO_SUCH_SWITCH is not a lazyggml switch"):
            read("LAZYGGML_NO_SUCH_SWITCH")
    with pytest.raises(TypeError, match="LAZYGGML_SIMD is a value switch"):
        debug.flag("LAZYGGML_SIMD")
    with pytest.raises(TypeError, match="LAZYGGML_DEBUG is a level switch"):
        debug.value("LAZYGGML_DEBUG")
