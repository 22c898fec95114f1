"""Every public callable has a docstring of its own (issue #16, first contact).

The public namespace is ``lazyggml.__all__`` when the package defines it, else every public
attribute of ``lazyggml`` that is a function, a class (enums included) or another callable defined
in lazyggml's code; then the public names of ``lazyggml.testing``. For each public class, its public
methods and properties defined in lazyggml (on the class or on a lazyggml base class) are checked
too; what comes from builtins, ``enum``, ``NamedTuple`` or ``dataclass`` machinery is not ours to
document.

A class's docstring must be written in lazyggml: a docstring inherited from ``object``, ``Enum`` or
any other base outside lazyggml does not count, nor does the signature line that ``NamedTuple`` and
``dataclass`` write when a class has none ("Foo(a, b)"); one inherited from a lazyggml base class does.
A method may inherit its docstring from the method it overrides (``inspect.getdoc``'s rule).
"""
from __future__ import annotations

import functools
import inspect
import re
import types

import lazyggml
import lazyggml.testing


def _ours(obj):
    """Defined in lazyggml's own code."""
    module = getattr(obj, "__module__", None) or ""
    return module == "lazyggml" or module.startswith("lazyggml.")


def _public_names(module):
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return list(names)


def _public_callables(module):
    """(qualified name, object) for each public callable of ``module`` defined in lazyggml."""
    for name in _public_names(module):
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType) or not callable(obj) or not _ours(obj):
            continue   # submodules, constants, enum members, re-exports of other packages' names
        if not inspect.isclass(obj) and not inspect.isroutine(obj) and not hasattr(obj, "__wrapped__"):
            continue   # callable instances are values, not API
        yield f"{module.__name__}.{name}", obj


def _auto_doc(cls, doc):
    """The signature line NamedTuple and dataclass write for an undocumented class."""
    return re.fullmatch(rf"{re.escape(cls.__name__)}\(.*\)", doc.strip()) is not None


def _class_doc_missing(cls):
    """The class has no docstring written in lazyggml."""
    for klass in cls.__mro__:
        doc = klass.__dict__.get("__doc__")
        if isinstance(doc, str) and doc.strip():
            return not _ours(klass) or _auto_doc(klass, doc)
    return True


_MEMBER_KINDS = (staticmethod, classmethod, property, functools.cached_property)


def _members(cls):
    """(defining class, name, attribute) for each public method or property of ``cls`` defined in
    lazyggml, on ``cls`` itself or on a lazyggml base."""
    for klass in cls.__mro__:
        if not _ours(klass):
            continue
        for name, raw in vars(klass).items():
            if name.startswith("_"):
                continue
            if inspect.isfunction(raw) or isinstance(raw, _MEMBER_KINDS):
                yield klass, name, raw


def _own_doc(raw):
    if isinstance(raw, (staticmethod, classmethod)):
        raw = raw.__func__
    doc = getattr(raw, "__doc__", None)
    if not doc and isinstance(raw, property) and raw.fget is not None:
        doc = raw.fget.__doc__
    if not doc and isinstance(raw, functools.cached_property):
        doc = raw.func.__doc__
    return doc if isinstance(doc, str) and doc.strip() else None


def _member_doc(klass, name, raw):
    """The member's docstring, or that of the member it overrides (``inspect.getdoc``'s rule,
    followed along ``klass``'s MRO so that it works for classes defined anywhere)."""
    doc = _own_doc(raw)
    for base in klass.__mro__[1:]:
        if doc:
            break
        if name in base.__dict__:
            doc = _own_doc(base.__dict__[name])
    return doc


def missing_docstrings(modules=(lazyggml, lazyggml.testing)):
    """Every public callable reachable from ``modules`` without a docstring, by qualified name."""
    missing, seen = [], set()
    for module in modules:
        for qualname, obj in _public_callables(module):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if inspect.isclass(obj):
                if _class_doc_missing(obj):
                    missing.append(qualname)
                for klass, name, raw in _members(obj):
                    key = (klass, name)
                    if key in seen:
                        continue
                    seen.add(key)
                    doc = _member_doc(klass, name, raw)
                    if not (doc and doc.strip()):
                        missing.append(f"{klass.__module__}.{klass.__qualname__}.{name}")
            else:
                doc = inspect.getdoc(obj)
                if not (doc and doc.strip()):
                    missing.append(qualname)
    return missing


def test_public_api_is_walked():
    """The walk sees the API it should (a walk that finds nothing would pass vacuously)."""
    names = {q for m in (lazyggml, lazyggml.testing) for q, _ in _public_callables(m)}
    for expected in ("lazyggml.add", "lazyggml.Tensor", "lazyggml.Type", "lazyggml.RopeParams",
                     "lazyggml.rope_yarn_corr_dims", "lazyggml.testing.make_tiny_llama"):
        assert expected in names
    assert "lazyggml.F32" not in names and "lazyggml.ops" not in names


def test_detector_flags_undocumented_things():
    """The checks themselves: undocumented functions, classes, methods, properties, NamedTuples,
    dataclasses and enums are caught; documented ones and inherited method docs pass."""
    import dataclasses
    import enum
    from typing import NamedTuple

    ns = types.ModuleType("lazyggml._docstring_probe")

    def bare(x):
        return x

    def documented(x):
        """Documented."""
        return x

    class Base:
        """A base."""

        def run(self):
            """Run it."""

        @property
        def size(self):
            """Its size."""
            return 0

    class Child(Base):
        def run(self):       # inherits Base.run's doc: fine
            pass

        @property
        def size(self):      # inherits Base.size's doc: fine
            return 1

        def bare_method(self):
            pass

        @property
        def bare_property(self):
            return 0

    class Pair(NamedTuple):
        a: int
        b: int

    @dataclasses.dataclass
    class Data:
        x: int

    class Colour(enum.Enum):
        RED = 1

    class Failure(ValueError):   # ValueError's docstring is not ours
        pass

    class Subclass(Base):        # Base's docstring is lazyggml's: fine
        pass

    for obj in (bare, documented, Base, Child, Pair, Data, Colour, Failure, Subclass):
        obj.__module__ = ns.__name__
    ns.__all__ = ["bare", "documented", "Base", "Child", "Pair", "Data", "Colour", "Failure", "Subclass"]
    for name in ns.__all__:
        setattr(ns, name, locals()[name])
    missing = missing_docstrings([ns])
    short = sorted(m.replace("lazyggml._docstring_probe.", "").split("<locals>.")[-1] for m in missing)
    assert short == sorted(["bare", "Child.bare_method", "Child.bare_property", "Pair", "Data", "Colour",
                            "Failure"]), short


def test_every_public_callable_has_a_docstring():
    missing = missing_docstrings()
    assert not missing, (f"{len(missing)} public callables have no docstring of their own:\n  "
                         + "\n  ".join(missing))
