"""Each CPU kernel module's ``tie_cache`` list, checked against the code its kernels reach.

Numba keys a cached kernel on its own source file only, yet compiles into it what the kernel
reaches: the jitted functions and intrinsics it calls (inlined or linked into its machine code)
and the globals it reads as constants (numbers, tuples, enum members and NumPy tables are frozen
in). When one of those changes in another file, the kernel must be compiled afresh;
``tie_cache(globals(), salt, *paths)`` makes the cache entries of a module's kernels depend on the
files it is given (``lazyggml/cache.py``). The lists stay written by hand, so that each module
says what its kernels depend on; this test keeps them honest. The rule, for every module M under
``lazyggml/backends/cpu`` that calls ``tie_cache`` or has cached kernels:

1. **Start** from what Numba compiles for M: its jitted functions, its intrinsics (whose Python
   code writes the IR) and the pool drivers of its parallel kernels (``common.parallel_kernel``'s
   ``run``, whose code is common.py's).
2. **Follow what each reads**, at any depth. A function reads the global names in its code
   (``co_names``, nested code included), resolved in its own globals and closure; a module read so
   stands for those of its attributes that the same code names (``V.QK_K``). A jitted function,
   intrinsic or plain function reached (an intrinsic's helper, a table builder) is followed
   through its own code, a module-level value through the expression that assigns it. Python glue
   that no compiled code reads (the kernel table's ``forward``, a tuple read only by a ``supports``
   check) is not reached.
3. **Credit each thing reached to its file:** a function, class, enum member, dispatcher or
   intrinsic to its ``__module__`` (``UnaryOp``, read through ops.py, is types.py's); a plain value
   to the module that assigns it (``from X import name`` followed back). debug.py is left out: a
   switch that changes compiled code (``LAZYGGML_SIMD``) does so through its value, which the salt
   carries; no file would.
4. **Check:** M's list holds M and every file credited, and its salt is ``simd.ISA`` when simd.py
   is among them (``LAZYGGML_SIMD`` changes simd's code, not its file); a module whose cached
   kernels reach another file calls ``tie_cache``.

Following the code rather than the imports keeps the lists tight: closing over imported modules
(and their lists) would tie nearly every kernel to every file, since common.py imports convert.py
for a ``supports`` check and convert.py the whole dispatch. A list may hold more than the rule asks
(that file then costs a recompile when it changes); a missing file serves stale machine code.
Numba also compiles in ``@overload``s, which a kernel reaches without naming them: no CPU module
defines one (checked below). The CUDA kernels are cached by numba-cuda, which ``tie_cache`` does
not reach.
"""
from __future__ import annotations

import ast
import enum
import functools
import importlib
import pathlib
import sys
import types

import pytest
from numba.core.dispatcher import Dispatcher
from numba.core.extending import _Intrinsic

import lazyggml

ROOT = pathlib.Path(lazyggml.__file__).resolve().parent
CPU = ROOT / "backends" / "cpu"
SIMD = "lazyggml.backends.cpu.simd"


def _ours(name):
    return isinstance(name, str) and (name == "lazyggml" or name.startswith("lazyggml."))


def _module_name(path):
    parts = pathlib.Path(path).resolve().relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def _tree(module):
    return ast.parse(pathlib.Path(sys.modules[module].__file__).read_text())


@functools.lru_cache(maxsize=None)
def _module_level(module):
    """{name: its ``ImportFrom`` node, or the expression assigned to it} at the module's top level."""
    out = {}

    def visit(stmts):
        for node in stmts:
            if isinstance(node, ast.ImportFrom):
                out.update((a.asname or a.name, node) for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out.update((n.id, node.value) for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for field in ("body", "orelse", "handlers", "finalbody"):   # top-level if/try/for/with
                    visit(getattr(node, field, []))
    visit(_tree(module).body)
    return out


def _origin(module, name):
    """(module, name) that assigns the plain value ``module.name``: imports followed back; None outside lazyggml."""
    node = _module_level(module).get(name)
    if not isinstance(node, ast.ImportFrom):
        return module, name
    base = importlib.util.resolve_name("." * node.level + (node.module or ""), sys.modules[module].__package__)
    orig = next(a.name for a in node.names if (a.asname or a.name) == name)
    return _origin(base, orig) if _ours(base) else None


def _home(obj, module, name):
    """Rule 3: (module, name) where ``obj``, read as ``name`` in ``module``'s namespace, is defined."""
    fn = getattr(obj, "py_func", None) or getattr(obj, "_defn", None) or obj   # dispatcher, intrinsic
    if isinstance(fn, (types.FunctionType, type, enum.Enum)):
        return (fn.__module__, name) if _ours(fn.__module__) else None
    return _origin(module, name)


def _code_names(code):
    """The global and attribute names a code object and the code nested in it read."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _compiled(module):
    """Rule 1: the module's jitted functions and intrinsics, and its parallel kernels' pool drivers."""
    for v in vars(sys.modules[module]).values():
        if isinstance(v, (Dispatcher, _Intrinsic)) and _home(v, module, None)[0] == module:
            yield getattr(v, "py_func", None) or v._defn
            if getattr(v, "run", None) is not None:
                yield v.run.py_func


def reached(module):
    """Rules 1-3: the modules whose code or values ``module``'s compiled code reaches, itself included."""
    found, seen, todo = set(), set(), []   # todo: (namespace, names read in it)

    def follow(fn):
        cells = {f"<cell{i}>": c.cell_contents for i, c in enumerate(fn.__closure__ or ())}
        found.add(_module_name(fn.__code__.co_filename))
        todo.append(({**fn.__globals__, **cells}, _code_names(fn.__code__) | set(cells)))

    for fn in _compiled(module):
        follow(fn)
    while todo:
        namespace, names = todo.pop()
        for name in names & namespace.keys():
            obj = namespace[name]
            if isinstance(obj, types.ModuleType):
                if _ours(obj.__name__):   # ``V.QK_K``: the attributes this code names
                    todo.append((vars(obj), names))
                continue
            home = _home(obj, namespace["__name__"], name)
            if home is None or home[0] == "lazyggml.debug" or (home, id(obj)) in seen:
                continue
            seen.add((home, id(obj)))
            found.add(home[0])
            fn = getattr(obj, "py_func", None) or getattr(obj, "_defn", None) or obj
            if isinstance(fn, types.FunctionType):
                follow(fn)
            elif not isinstance(fn, type):   # a value: the expression that assigns it
                node = _module_level(home[0]).get(home[1])
                if isinstance(node, ast.expr):
                    todo.append((vars(sys.modules[home[0]]),
                                 {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                                  if isinstance(n, (ast.Name, ast.Attribute))}))
    return found


def tie_call(module):
    """(salt as written, tied module names) of the module's ``tie_cache`` call; None without one."""
    for node in _tree(module).body:
        call = getattr(node, "value", None)
        if isinstance(node, ast.Expr) and isinstance(call, ast.Call) and getattr(call.func, "id", None) == "tie_cache":
            paths = []
            for a in call.args[2:]:   # a path, or *paths (``dispatch.KERNEL_FILES``)
                value = eval(ast.unparse(a.value if isinstance(a, ast.Starred) else a), vars(sys.modules[module]))
                paths += list(value) if isinstance(a, ast.Starred) else [value]
            return ast.unparse(call.args[1]), {_module_name(p) for p in paths}
    return None


def _has_cached_kernels(module):
    """What ``tie_cache`` would stamp: a cached dispatcher defined in the module."""
    return any(isinstance(v, Dispatcher) and v.py_func.__module__ == module
               and getattr(getattr(v, "_cache", None), "_cache_file", None) is not None
               for v in vars(sys.modules[module]).values())


def _cpu_modules():
    names = [f"lazyggml.backends.cpu.{p.stem}" for p in sorted(CPU.glob("*.py")) if p.stem != "__init__"]
    for n in names:
        importlib.import_module(n)
    return names


CPU_MODULES = _cpu_modules()
MODULES = [n for n in CPU_MODULES if tie_call(n) is not None or _has_cached_kernels(n)]


@pytest.mark.parametrize("name", MODULES)
def test_tie_cache_lists_cover_what_the_kernels_reach(name):
    need = reached(name)
    call = tie_call(name)
    if call is None:
        assert need <= {name}, f"{name}'s cached kernels reach {sorted(need - {name})}: call tie_cache with them"
        return
    salt, tied = call
    missing = sorted(need - tied)
    assert not missing, f"{name}'s tie_cache lacks the files of {missing}"
    if SIMD in need:
        assert salt == "simd.ISA", f"{name} reaches simd.py: its tie_cache salt must be simd.ISA"


def test_no_cpu_module_defines_overloads():
    """Rule 2 finds code by the names a kernel reads; an ``@overload`` is reached without one."""
    hidden = {"overload", "overload_method", "overload_attribute", "register_jitable", "generated_jit", "lower_builtin"}
    for name in CPU_MODULES:
        used = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(_tree(name))
                if isinstance(n, (ast.Name, ast.Attribute))}
        assert not used & hidden, f"{name} uses {sorted(used & hidden)}: rule 2 of this test cannot see it"


def test_the_rule_sees_what_it_should():
    """The checks above would pass vacuously if the rule missed things: matmul's kernels reach
    type_k's (and through them simd's intrinsics and type_common's tables), elementwise's read
    ``UnaryOp`` through ops.py from types.py, replay's intrinsics call pool's ``_borrowed``; common.py
    reads convert.py only in a ``supports`` check, and nothing compiled reads the kernel table."""
    cpu = "lazyggml.backends.cpu."
    assert {cpu + "type_k", SIMD, cpu + "type_common"} <= reached(cpu + "matmul")
    assert "lazyggml.types" in reached(cpu + "elementwise")
    assert cpu + "pool" in reached(cpu + "replay")
    assert not {cpu + "convert", cpu + "table", "lazyggml.cache", "lazyggml.ops"} & reached(cpu + "common")
    assert len(MODULES) >= 19
