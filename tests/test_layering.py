"""The house plan, checked: lazyggml's modules import only downward, along the layers below, with
no import cycle, and no backend package imports another (docs/architecture.md draws the layers).

Every ``import`` is read from the source with ``ast``, module-level and function-level alike, so a
function-local import cannot hide an upward dependency. (``KernelTable.load`` imports a backend's
kernel modules by name at run time; that is the one registration rule, not an import between
layers.)
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "lazyggml"

# From the bottom up. A module may import modules of its own layer or of any layer below it. A name
# ending in ".*" is a package with everything in it.
LAYERS = [
    ["lazyggml.cache", "lazyggml.compiling", "lazyggml.debug", "lazyggml.errors", "lazyggml.types"],   # leaves
    ["lazyggml.buffer"],          # memory: buffer types, buffers (backend interface levels 1-2)
    ["lazyggml.tensor"],
    ["lazyggml.ops"],
    ["lazyggml.dot"],
    ["lazyggml.graph"],
    ["lazyggml.alloc"],
    ["lazyggml.backend"],         # devices, backends, registries (levels 3-5), data wrappers
    ["lazyggml.sched"],
    ["lazyggml.backends.*"],      # one package per backend, and their shared kernel table
    ["lazyggml.registry"],        # device discovery over the backend packages
    ["lazyggml.quants", "lazyggml.gguf_io", "lazyggml.tokenizer", "lazyggml.sampling", "lazyggml.chat"],
    ["lazyggml.models.*", "lazyggml.testing", "lazyggml.op_cases"],
    ["lazyggml.warmup"],
    ["lazyggml.serving.*"],       # the OpenAI-compatible server over models/ (continuous batching)
    ["lazyggml"],                 # the public API
    ["lazyggml.cli"],
]
BACKENDS = ("cpu", "cuda", "opencl", "rpc")


def _modules():
    """{module name: (path, is_package)} for every Python file of the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _resolve(module, is_pkg, node):
    """The absolute names an ``ImportFrom``/``Import`` node reaches (modules, or packages)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level == 0:
        base = node.module
    else:
        parts = module.split(".")
        if not is_pkg:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    # `from pkg import name`: name may be a submodule
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def imports_of(module):
    path, is_pkg = MODULES[module]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(t for t in _resolve(module, is_pkg, node) if t == "lazyggml" or t.startswith("lazyggml."))
    found.discard(module)
    return found


def layer_of(module):
    for i, names in enumerate(LAYERS):
        for n in names:
            if module == n or (n.endswith(".*") and (module == n[:-2] or module.startswith(n[:-1]))):
                return i
    return None


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    upward = sorted(t for t in imports_of(module) if layer_of(t) > layer_of(module))
    assert upward == [], f"{module} (layer {layer_of(module)}) imports upward: {upward}"


def test_no_import_cycles():
    graph = {m: {t for t in imports_of(m) if t in MODULES} for m in MODULES}
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_packages_do_not_import_each_other(backend):
    own = f"lazyggml.backends.{backend}"
    others = tuple(f"lazyggml.backends.{b}" for b in BACKENDS if b != backend)
    bad = {m: sorted(t for t in imports_of(m) if t.startswith(others))
           for m in MODULES if m == own or m.startswith(own + ".")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_the_checker_sees_function_level_and_relative_imports():
    """The rules above would pass vacuously if imports were missed: the CPU backend's module imports
    the kernel table relatively, and the CLI imports the warm-up inside a function."""
    assert "lazyggml.backends.cpu.table" in imports_of("lazyggml.backends.cpu.backend")
    assert "lazyggml.warmup" in imports_of("lazyggml.cli")
    assert layer_of("lazyggml.backends.cpu.matmul") > layer_of("lazyggml.sched") > layer_of("lazyggml.tensor")
