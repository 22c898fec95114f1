"""How many places a weight type lives in, checked (issue 42): docs/architecture.md's "where new
work goes" says a new quantized type is 3 CPU files (plus the generated dispatch), 2 CUDA files
and 4 OpenCL files. These tests read the package's code (not its docstrings or comments) for each
type's name and fail when a type has spread further, or when the docs no longer say where it goes.
"""
from __future__ import annotations

import ast
import os
import re

import pytest

import lazyggml
from lazyggml.backends.cpu.traits import TYPE_TRAITS_CPU
from lazyggml.types import WEIGHT_TYPES, Type, is_quantized, type_name

ROOT = os.path.dirname(lazyggml.__file__)
DOCS = os.path.join(os.path.dirname(ROOT), "docs", "architecture.md")

# IQ4_XS, the last type added, is the template for the next ones (issue 47): every file it is named in.
NEW_TYPE = Type.IQ4_XS
NEW_TYPE_FILES = {
    "types.py",                       # its member and block layout
    "backends/cpu/type_iq.py",        # its family's kernels
    "backends/cpu/traits.py",         # its CPU row
    "backends/cpu/dispatch.py",       # generated from the row
    "backends/cpu/tiled.py",          # llama.cpp takes it in its tiled matmul, so lazyggml does
    "backends/cuda/dequant.py", "backends/cuda/mmvq.py",
    "backends/opencl/quants.h", "backends/opencl/ops.py", "backends/opencl/mul_mat.cl", "backends/opencl/rows.cl",
}
# Where any type may also appear: the other orders llama.cpp runs it in, SET_ROWS into a quantized KV
# cache on CUDA, its int8 tensor-core GEMM, and the places that pick a type as a default or an example.
OPTIONAL_FILES = {"backends/cpu/repack.py", "backends/cuda/setq.py", "backends/cuda/mmq.py", "backends/cuda/ops.py",
                  "op_cases.py", "testing.py", "cli.py"}


def _code_words(path):
    """The identifiers, attribute names and non-docstring string constants of a Python file, or a C
    file without its comments: what the program says, not what its prose says."""
    with open(path, encoding="utf-8") as f:
        src = f.read()
    if not path.endswith(".py"):
        return re.sub(r"//[^\n]*", " ", re.sub(r"/\*.*?\*/", " ", src, flags=re.S))
    tree = ast.parse(src)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            words.append(node.name)
        elif isinstance(node, ast.alias):
            words.append(node.asname or node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append(node.value)
    return " ".join(words)


_CODE = {os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/"): _code_words(os.path.join(d, f))
         for d, _, files in os.walk(ROOT) for f in files if f.endswith((".py", ".cl", ".h"))}


def files_naming(t):
    """The package files whose code names type ``t`` (``Q4_K``, ``q4_K``, ``dot_q4_K_q8_K``...)."""
    rx = re.compile(r"(?<![A-Za-z0-9])" + re.escape(type_name(t)) + r"(?![A-Za-z0-9])", re.I)
    return {path for path, words in _CODE.items() if rx.search(words)}


def test_the_scan_sees_code_and_skips_prose():
    """The footprint tests would pass vacuously if the scan missed names, and fail needlessly if it
    read prose: Q4_K is named in the code of the CUDA mmq kernels (as part of longer identifiers), and
    ``type_common.py`` names IQ4_XS only in its docstring."""
    assert "backends/cuda/mmq.py" in files_naming(Type.Q4_K)
    with open(os.path.join(ROOT, "backends", "cpu", "type_common.py"), encoding="utf-8") as f:
        assert "IQ4_XS" in f.read()
    assert "backends/cpu/type_common.py" not in files_naming(Type.IQ4_XS)


def test_the_newest_type_lives_where_the_docs_say():
    assert files_naming(NEW_TYPE) == NEW_TYPE_FILES
    with open(DOCS, encoding="utf-8") as f:
        row = next(line for line in f if line.startswith("| a quant type |"))
    for path in NEW_TYPE_FILES:
        assert os.path.basename(path) in row, f"docs/architecture.md's quant-type row does not name {path}"


@pytest.mark.parametrize("t", [t for t in WEIGHT_TYPES if is_quantized(t)], ids=type_name)
def test_each_weight_type_lives_in_its_family_and_the_tables(t):
    """Each quantized weight type: the layout table, its CPU row and family module, the generated
    dispatch, each GPU backend's kernels (or its declared gaps), and only the optional places besides.
    Other family modules name it only as their activations' format (IQ4_NL's dot takes Q8_0)."""
    family = _family(t)
    named = files_naming(t)
    assert {"types.py", "backends/cpu/traits.py", "backends/cpu/dispatch.py", family} <= named
    users = {_family(u) for u, tr in TYPE_TRAITS_CPU.items() if tr.vec_dot_type == t and u != t}
    stray = named - NEW_TYPE_FILES - OPTIONAL_FILES - {family} - users
    assert not stray, f"{type_name(t)} is also named in {sorted(stray)}"


def test_each_type_keeps_its_cpu_kernels_in_one_family_module():
    """A type's quantizer, dequantizer and dot products sit together (the orders of tiled.py and
    repack.py excepted, which hold one matmul order for many types)."""
    for t, tr in TYPE_TRAITS_CPU.items():
        kernels = [tr.from_float_ref, tr.from_float, tr.to_float, tr.vec_dot, tr.vec_dot_ref, tr.dot, tr.dot_cols,
                   tr.dot2, tr.dot_cols2, tr.tile]
        modules = {_module_of(k) for k in kernels if k is not None}
        assert len(modules) == 1 and next(iter(modules)).startswith("lazyggml.backends.cpu.type_"), \
            f"{type_name(t)}'s CPU kernels are spread over {sorted(modules)}"


def _module_of(fn):
    return getattr(fn, "py_func", fn).__module__


def _family(t):
    """The family module of type ``t``, as a path: where its dequantizer is defined."""
    return _module_of(TYPE_TRAITS_CPU[t].to_float).removeprefix("lazyggml.").replace(".", "/") + ".py"
