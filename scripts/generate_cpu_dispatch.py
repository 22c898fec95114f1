"""Write ``lazyggml/backends/cpu/dispatch.py``, the CPU backend's type switches, from its traits table
(``lazyggml/backends/cpu/traits.py``, ``TYPE_TRAITS_CPU``).

Jitted code cannot look a kernel up in a Python table by a run-time type id, and Numba compiles a
kernel passed as an argument once per function object, in every process, without caching it. So
a jitted driver that serves every type branches on the type id, in literal code: ``if tid == 12:
dot_q4_K_q8_K(...) elif ...``, each branch calling that type's ``@njit`` kernel. This script writes
those chains from the table, so that a type is added in one place. GGML generates its CUDA template
instances the same way (``ggml-cuda/template-instances/generate_cu_files.py``): the output is
committed, and ``tests/test_mul_mat_cpu.py`` checks that running this script gives the committed
file.

    python scripts/generate_cpu_dispatch.py           # rewrite dispatch.py
    python scripts/generate_cpu_dispatch.py --check   # exit 1 when dispatch.py is stale

Each switch is one ``Switch`` below: the traits field whose kernel its branches call, which types
it covers, its parameters and its ``@njit`` options. Every chain tests every one of its types, in
type-id order, and has no ``else``: an id it does not cover does nothing. That is also what keeps the matmul as fast as its hand-written chains were: with the
last type taking an ``else``, a Q4_K decode mat-vec came out ~10% slower (code layout, measured on
the dev machine), without it no slower.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from dataclasses import dataclass
from typing import Callable

from lazyggml.backends.cpu.traits import TYPE_TRAITS_CPU, types_with

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGET = ROOT / "lazyggml" / "backends" / "cpu" / "dispatch.py"
PACKAGE = "lazyggml.backends.cpu"


def _activation_types():
    """The vec_dot_types of the quantized weight types: what the matmul converts activations to."""
    return tuple(sorted({TYPE_TRAITS_CPU[t].vec_dot_type for t in types_with("dot_cols")}, key=int))


@dataclass(frozen=True)
class Switch:
    name: str                    # the generated function: name(tid, <params>)
    field: str                   # the TypeTraitsCpu field whose kernel each branch calls
    types: Callable[[], tuple]   # the types it covers
    params: str
    decorator: str               # one of the decorators the module defines (HEADER)
    doc: str
    body: str = ""               # a branch's lines around ``{kernel}`` (default: the call alone)
    pair_field: str = ""         # the field of a kernel for two rows at once, where a type has one ...
    pair_body: str = ""          # ... and the branch's lines for those types, around ``{kernel}`` and ``{pair}``
    #                              (taken where simd.HAVE_AVX512BW, else ``body``)
    tile_field: str = ""         # the field of a kernel for a whole tile, where a type has one: its call
    #                              replaces ``body`` (with ``sw.params``)


SWITCHES = [
    Switch("quantize_chunk", "from_float_ref", lambda: types_with("from_float_ref"), "x, y", "_chunk",
           "Quantize contiguous rows x (float32, flattened) of type id tid into y (bytes) with the\n"
           "    reference quantizers: GGML's ``ggml_quantize_chunk`` switch (``from_float_ref``). An id\n"
           "    without one (F32) does nothing."),
    Switch("dequantize_chunk", "to_float", lambda: types_with("from_float_ref"), "x, y", "_chunk",
           "Dequantize contiguous rows x (bytes, flattened) of type id tid into y (float32):\n"
           "    ``to_float``. The types of ``quantize_chunk``; another id (F32) does nothing."),
    Switch("from_float", "from_float", _activation_types, "x, y", "_kernel",
           "Quantize one activation row x (float32) into y (bytes) as GGML's CPU backend does\n"
           "    (``type_traits_cpu[tid].from_float``), for the vec_dot_types of the quantized weights."),
    Switch("dot_rows", "dot", lambda: types_with("dot"), "n, w4, j3, j2, r0, r1, y, yo, dst, i3, i2, c", "_kernel",
           "Weight rows r0..r1 of w4[j3, j2] (type id tid) each dotted with the activation column at\n"
           "    byte yo of y into dst[i3, i2, c] (the type's ``dot_*``, two rows at once with ``dot2_*``\n"
           "    where the type has it and the CPU AVX-512BW), for the quantized weight types. The row\n"
           "    loop sits inside each branch: with the chain inside the loop instead, a Q4_K row of one\n"
           "    super-block took 40 ns where the dot product alone takes 13. Each row asks for the bytes\n"
           "    PREFETCH_AHEAD on.",
           body="for r in range(r0, r1):\n"
                "    _prefetch_ahead(w4[j3, j2, r], 1)\n"
                "    dst[i3, i2, c, r] = {kernel}(n, w4[j3, j2, r], y, yo)",
           pair_field="dot2",
           pair_body="for r in range(r0, r1 - 1, 2):\n"
                     "    _prefetch_ahead(w4[j3, j2, r], 2)\n"
                     "    dst[i3, i2, c, r], dst[i3, i2, c, r + 1] = {pair}(n, w4[j3, j2, r], w4[j3, j2, r + 1], y, yo)\n"
                     "if (r1 - r0) % 2:\n"
                     "    dst[i3, i2, c, r1 - 1] = {kernel}(n, w4[j3, j2, r1 - 1], y, yo)"),
    Switch("dot_tile", "dot_cols", lambda: types_with("dot_cols"),
           "n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, acc, out, dst, i3, i2, c0", "_kernel",
           "Weight rows r0..r1 of w4[j3, j2] (type id tid) each dotted with the nc activation columns\n"
           "    from byte yo of y into dst[i3, i2, c0:c0 + nc] (the type's ``dot_cols_*``, two rows at once\n"
           "    with ``dot_cols2_*`` where the type has it and the CPU AVX-512BW), for the quantized\n"
           "    weight types; ``tile_*`` where the type has one.",
           body="for r in range(r0, r1):\n"
                "    {kernel}(n, w4[j3, j2, r], y, yo, ycs, ybs, nc, acc, out)\n"
                "    for k in range(nc):\n"
                "        dst[i3, i2, c0 + k, r] = out[k]",
           pair_field="dot_cols2",
           pair_body="for r in range(r0, r1 - 1, 2):\n"
                     "    {pair}(n, w4[j3, j2, r], w4[j3, j2, r + 1], y, yo, ycs, ybs, nc, acc, out)\n"
                     "    for k in range(nc):\n"
                     "        dst[i3, i2, c0 + k, r] = out[2 * k]\n"
                     "        dst[i3, i2, c0 + k, r + 1] = out[2 * k + 1]\n"
                     "if (r1 - r0) % 2:\n"
                     "    {kernel}(n, w4[j3, j2, r1 - 1], y, yo, ycs, ybs, nc, acc, out)\n"
                     "    for k in range(nc):\n"
                     "        dst[i3, i2, c0 + k, r1 - 1] = out[k]",
           tile_field="tile"),
    Switch("tiled_tile", "tiled_cols", lambda: types_with("tiled_cols"),
           "n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, acc, out, dst, i3, i2, c0", "_kernel",
           "``dot_tile`` in the order of GGML's tiled matmul (``tiled.tiled_cols_*``), for the types it\n"
           "    takes.",
           body="for r in range(r0, r1):\n"
                "    {kernel}(n, w4[j3, j2, r], y, yo, ycs, ybs, nc, acc, out)\n"
                "    for k in range(nc):\n"
                "        dst[i3, i2, c0 + k, r] = out[k]",
           tile_field="tile_tiled"),
    Switch("repack_rows", "repack_dot", lambda: types_with("repack_dot"),
           "n, w4, j3, j2, r0, r1, y, yo, dst, i3, i2, c", "_kernel",
           "``dot_rows`` of a repacked weight, in the order of GGML's repacked gemv\n"
           "    (``repack.repack_dot_*``).",
           body="for r in range(r0, r1):\n"
                "    _prefetch_ahead(w4[j3, j2, r], 1)\n"
                "    dst[i3, i2, c, r] = {kernel}(n, w4[j3, j2, r], y, yo)"),
    Switch("repack_tile", "repack_cols", lambda: types_with("repack_cols"),
           "n, w4, j3, j2, r0, r1, y, yo, ycs, ybs, nc, ngemm, acc, out, dst, i3, i2, c0", "_kernel",
           "``dot_tile`` of a repacked weight: its first ``ngemm`` columns in the order of GGML's\n"
           "    repacked gemm, the rest in its gemv's (``repack.repack_cols_*``).",
           body="for r in range(r0, r1):\n"
                "    {kernel}(n, w4[j3, j2, r], y, yo, ycs, ybs, nc, ngemm, acc, out)\n"
                "    for k in range(nc):\n"
                "        dst[i3, i2, c0 + k, r] = out[k]",
           tile_field="tile_repack"),
]

HEADER = '''\
"""The CPU backend's type switches: for each, one literal ``if``/``elif`` chain over GGML's type ids,
a branch per type calling that type's ``@njit`` kernel, as listed in ``traits.TYPE_TRAITS_CPU``.

GENERATED by scripts/generate_cpu_dispatch.py from traits.TYPE_TRAITS_CPU: do not edit. After a
change to the table or the script, regenerate it:

    python scripts/generate_cpu_dispatch.py

(tests/test_mul_mat_cpu.py checks that regenerating gives this file, and that every type of the
table has its branches). Jitted code cannot index the table by a run-time type id: hence code.

* ``quantize_chunk`` / ``dequantize_chunk``: whole contiguous rows (``convert.py``, ``rows.py``);
* ``from_float``: the matmul's activation rows, to the weight type's vec_dot_type;
* ``dot_rows`` / ``dot_tile``: a task of the matmul (``matmul._task_fast``): its rows against one
  column (decode), or against a tile of columns;
* ``tiled_tile``, ``repack_rows`` / ``repack_tile``: the same in the orders of GGML's tiled matmul
  and repacked weights (``tiled.py``, ``repack.py``), where the matmul takes those.
"""
from __future__ import annotations

from numba import njit

from ... import types
from ...cache import tie_cache
from . import {imports}

_chunk = njit(cache=True, error_model="numpy")   # the options of the reference quantizers (type_common._kernel)
_kernel = njit(cache=True)

# A decode mat-vec reads its weight rows once, one after the other. The hardware prefetchers follow
# that stream only within a 4 KiB page and not far enough ahead to hide the latency of the last-level
# cache or memory: asking for the bytes 4 KiB ahead of each row made a 2048x768 Q4_K mat-vec whose
# weights are not in L2 ~1.5x faster on one thread (dev machine: 145 -> 93-101 µs; 2 KiB ahead 96-104,
# 8 KiB 99-104, 16 KiB 103-147).
PREFETCH_AHEAD = 4096


@njit(cache=True, inline="always")
def _prefetch_ahead(x, rows):
    """Prefetch the ``rows`` weight rows PREFETCH_AHEAD bytes past the start of row ``x`` (rows are
    contiguous; past the tensor's end a prefetch is simply wasted)."""
    for o in range(PREFETCH_AHEAD, PREFETCH_AHEAD + rows * x.shape[0], 64):
        simd.prefetch(x, o)


# The pair kernels (two weight rows at once, ``dot2_*`` / ``dot_cols2_*``) work on 512-bit vectors.
# Without AVX-512BW, LLVM splits every such operation in two and emulates the byte multiply-adds:
# on an AVX2-only CPU (AMD Zen 3) a Q6_K 1024x256 mat-vec took 54-59 µs through them against 25
# through the one-row kernels, and 16-column tiles ran 1.3-2.3x slower. So their branches take them
# only where ``simd.HAVE_AVX512BW`` (a constant of the compiled code: the other branch is dropped).

# The chains test GGML's type ids (enum ggml_type, types.Type) as literals, the type's name beside.
'''


def _kernel_name(fn, modules):
    """``module.name`` of a kernel of this package, as the generated module calls it."""
    module = fn.py_func.__module__
    package, _, alias = module.rpartition(".")
    if package != PACKAGE:
        raise SystemExit(f"{fn.__name__} is defined in {module}, outside {PACKAGE}")
    modules.add(alias)
    return f"{alias}.{fn.__name__}"


def _indent(text):
    return ["    " + line for line in text.split("\n")]


def _switch_code(sw, modules):
    """The source of one switch, and its {type: kernel name} (with ``+``, the pair kernel's)."""
    types = sorted(sw.types(), key=int)
    if not types:
        raise SystemExit(f"{sw.name}: no type of the table has {sw.field}")
    cases = {}
    lines = ["", "", f"@{sw.decorator}", f"def {sw.name}(tid, {sw.params}):", f'    """{sw.doc}"""']
    for i, t in enumerate(types):
        kernel = _kernel_name(getattr(TYPE_TRAITS_CPU[t], sw.field), modules)
        pair = getattr(TYPE_TRAITS_CPU[t], sw.pair_field) if sw.pair_field else None
        body = sw.body.format(kernel=kernel) if sw.body else f"{kernel}({sw.params})"
        tile = getattr(TYPE_TRAITS_CPU[t], sw.tile_field) if sw.tile_field else None
        if tile is not None:
            tile = _kernel_name(tile, modules)
            body = f"{tile}({sw.params})"
        if pair is not None:   # pair kernels only where 512-bit vectors are native (see PAIR_NOTE)
            pair = _kernel_name(pair, modules)
            body = "\n".join(["if simd.HAVE_AVX512BW:"] + _indent(sw.pair_body.format(kernel=kernel, pair=pair))
                              + ["else:"] + _indent(body))
        cases[t] = "+".join(k for k in (tile or kernel, pair) if k)
        lines += [f"    {'elif' if i else 'if'} tid == {int(t)}:  # {t.name}"] + [f"        {b}" for b in body.split("\n")]
    return lines, cases


def render() -> str:
    """The text of dispatch.py for the table as it is now."""
    modules = {"simd"}   # the SIMD kernels' instruction-set choice salts the cache (tie_cache)
    body, table = [], {}
    for sw in SWITCHES:
        lines, cases = _switch_code(sw, modules)
        body += lines
        table[sw.name] = cases
    out = HEADER.format(imports=", ".join(sorted(modules | {"type_common"}))).splitlines()
    out += body
    out += ["", "", "#: switch -> {type id: the kernel its branch calls}, in branch order", "SWITCHES = {"]
    for name, cases in table.items():
        out.append(f'    "{name}": {{')
        out += [f'        {int(t)}: "{kernel}",  # {t.name}' for t, kernel in cases.items()]
        out.append("    },")
    out.append("}")
    files = [f"{m}.__file__" for m in sorted(modules | {"type_common"})] + ["types.__file__"]
    out += ["", "#: the files of the kernels the switches call, and of what those reach: the cache of a driver",
            "#: that calls a switch depends on them (``tie_cache(globals(), salt, *KERNEL_FILES, ...)``)",
            f"KERNEL_FILES = ({', '.join(files[:4])},", f"                {', '.join(files[4:])})",
            "", "# the cache of every switch above also depends on those files (lazyggml.cache.tie_cache)",
            "tie_cache(globals(), simd.ISA, *KERNEL_FILES, __file__)"]
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when dispatch.py is stale")
    args = ap.parse_args(argv)
    text = render()
    current = TARGET.read_text() if TARGET.exists() else None
    if args.check:
        if current != text:
            print(f"{TARGET.relative_to(ROOT)} is stale: run scripts/generate_cpu_dispatch.py", file=sys.stderr)
            return 1
        return 0
    if current != text:
        TARGET.write_text(text)
        print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
