"""Reading GGUF files without trusting them.

A GGUF file (``docs/gguf.md`` in GGML) is, in order, all little-endian:

* a header: the magic ``b"GGUF"``, a ``uint32`` version (2 or 3: both have 64-bit counts), a
  ``uint64`` tensor count and a ``uint64`` key/value count;
* the key/value metadata: each a string key, a ``uint32`` value type (``gguf.GGUFValueType``) and the
  value; strings are a ``uint64`` byte length then UTF-8 bytes; arrays are an element type, a
  ``uint64`` count and the elements;
* the tensor infos: each a name, a ``uint32`` dims count, that many ``uint64`` dims in GGML order
  (``ne[0]`` first, the contiguous one), a ``uint32`` GGML type id and a ``uint64`` offset relative to
  the data section;
* padding to ``general.alignment`` (default 32), then the data section.

``read_gguf(path)`` walks that structure once with every length, count and offset checked against the
file size before anything is allocated or trusted, so a malformed or hostile file gives a
``GGUFError`` naming the file and the field, never an ``IndexError`` from deep inside a parser, a hang
on a count of 2**63, or a multi-gigabyte allocation. The tensor data is not read: it stays in a
read-only ``numpy.memmap`` and ``GGUFFile.tensor_data(name)`` returns a view of it.

Why not ``gguf.GGUFReader``? It builds one NumPy array per string, which takes about 30 s for a
Llama 3 vocabulary (128k tokens, 280k merges), and it trusts array counts: a count past the end of the
file makes it loop on empty reads practically forever. Since validation has to walk every length
anyway, the walk here is the reader; the tests compare its results with ``GGUFReader`` on valid files.

``get_key`` and the typed getters below read metadata values with the same care; a model family's
hyper-parameters are read with them (``models/hparams.py``).
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGUFValueType

from .errors import GGUFError
from .types import Type, blck_size, type_name, type_size

__all__ = ["TensorInfo", "GGUFFile", "read_gguf", "get_key", "get_count", "get_per_layer",
           "get_positive_float"]

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # a tensor name, with its terminating NUL, must fit in ggml_tensor.name

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<B",
}
# the smallest encoding of one value of each type: bounds a count before anything is allocated
_MIN_VALUE_SIZE = {t: struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()}
_MIN_VALUE_SIZE[GGUFValueType.STRING] = 8
_U64 = struct.Struct("<Q").unpack_from
_MIN_KV_SIZE = 8 + 4 + 1           # key length, value type, a one-byte value
_MIN_TENSOR_INFO_SIZE = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: ``ne`` in GGML order (``ne[0]`` contiguous), ``offset`` the absolute
    byte offset of its data in the file, ``nbytes`` its size (GGML's ``ggml_nbytes``)."""
    name: str
    type: Type
    ne: tuple
    offset: int
    nbytes: int


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> Python value: ``int``, ``float``, ``bool``, ``str`` or a
    list of those), ``kv_types`` (key -> ``(GGUFValueType, element type or None)``), ``tensors``
    (name -> ``TensorInfo``, in file order), ``version``, ``alignment``, ``data_offset`` and ``mmap``,
    the whole file as a read-only ``uint8`` ``numpy.memmap``."""

    def __init__(self, path, version, metadata, kv_types, tensors, alignment, data_offset, mmap):
        self.path = str(path)
        self.version = version
        self.metadata = metadata
        self.kv_types = kv_types
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset
        self.mmap = mmap

    def tensor_data(self, name: str) -> np.ndarray:
        """The raw bytes of tensor ``name``: a read-only 1-D ``uint8`` view of the memory map."""
        info = self.tensors[name]
        return self.mmap[info.offset:info.offset + info.nbytes]

    def __repr__(self):
        return (f"GGUFFile({self.path!r}, version={self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")


class _Walker:
    """A cursor over the file's bytes; every read is bounds-checked and fails with a GGUFError."""

    def __init__(self, path, buf: memoryview):
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def error(self, field, message) -> GGUFError:
        return GGUFError(self.path, field, message)

    def need(self, n: int, field: str) -> None:
        if n > self.size - self.pos:
            raise self.error(field, f"needs {n} bytes at offset {self.pos}, but the file ends at "
                                    f"{self.size} (truncated?)")

    def scalar(self, vtype: GGUFValueType, field: str):
        fmt = _SCALAR_FORMATS[vtype]
        n = struct.calcsize(fmt)
        self.need(n, field)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return bool(v) if vtype == GGUFValueType.BOOL else v

    def u32(self, field):
        return self.scalar(GGUFValueType.UINT32, field)

    def u64(self, field):
        return self.scalar(GGUFValueType.UINT64, field)

    def string(self, field: str) -> str:
        return self._take_string(self.u64(f"{field} (string length)"), field)

    def _take_string(self, n: int, field: str, index=None) -> str:
        """The ``n`` UTF-8 bytes at the cursor as a str (``index``: its place in an array)."""
        if n > self.size - self.pos:
            where = field if index is None else f"{field}[{index}]"
            raise self.error(where, f"string length {n} at offset {self.pos - 8} runs past the end "
                                    f"of the file ({self.size} bytes)")
        end = self.pos + n
        try:
            s = str(self.buf[self.pos:end], "utf-8")
        except UnicodeDecodeError as e:
            where = field if index is None else f"{field}[{index}]"
            raise self.error(where, f"string is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        self.pos = end
        return s

    def _strings(self, n: int, field: str) -> list:
        """``n`` strings; ``string`` with less per-item work, as a vocabulary holds 100k+ of them."""
        out = [""] * n
        for i in range(n):
            if self.size - self.pos < 8:
                self.need(8, f"{field}[{i}] (string length)")
            length = _U64(self.buf, self.pos)[0]
            self.pos += 8
            out[i] = self._take_string(length, field, i)
        return out

    def value_type(self, field: str, allow_array=True) -> GGUFValueType:
        raw = self.u32(f"{field} (value type)")
        try:
            vtype = GGUFValueType(raw)
        except ValueError:
            raise self.error(field, f"unknown GGUF value type {raw}") from None
        if vtype == GGUFValueType.ARRAY and not allow_array:
            raise self.error(field, "arrays of arrays are not supported (nor by GGML's gguf.cpp)")
        return vtype

    def count(self, n: int, min_size: int, field: str, what: str) -> int:
        """Reject a count whose items cannot possibly fit in the rest of the file."""
        room = self.size - self.pos
        if n > room // min_size:
            raise self.error(field, f"{what} {n} is impossible: {n} items of at least {min_size} "
                                    f"bytes do not fit in the {room} bytes left in the file")
        return n

    def value(self, vtype: GGUFValueType, field: str):
        """A scalar or string value (arrays go through ``array``)."""
        return self.string(field) if vtype == GGUFValueType.STRING else self.scalar(vtype, field)

    def array(self, etype: GGUFValueType, field: str) -> list:
        n = self.count(self.u64(f"{field} (array length)"), _MIN_VALUE_SIZE[etype], field,
                       "array length")
        if etype == GGUFValueType.STRING:
            return self._strings(n, field)
        # numeric arrays: one vectorised read; the count check above bounds its size
        arr = np.frombuffer(self.buf, dtype=np.dtype(_SCALAR_FORMATS[etype]), count=n, offset=self.pos)
        self.pos += arr.nbytes
        return (arr != 0).tolist() if etype == GGUFValueType.BOOL else arr.tolist()


def _read_kv(w: _Walker, n_kv: int):
    metadata, kv_types = {}, {}
    for i in range(n_kv):
        key = w.string(f"kv[{i}] key")
        field = key or f"kv[{i}] (empty key)"
        if key in metadata:
            raise w.error(field, f"duplicate key (kv[{i}])")
        vtype = w.value_type(field)
        if vtype == GGUFValueType.ARRAY:
            etype = w.value_type(f"{field} (array element type)", allow_array=False)
            metadata[key] = w.array(etype, field)
        else:
            etype = None
            metadata[key] = w.value(vtype, field)
        kv_types[key] = (vtype, etype)
    return metadata, kv_types


def _alignment(w: _Walker, metadata, kv_types) -> int:
    if "general.alignment" not in metadata:
        return GGUF_DEFAULT_ALIGNMENT
    if kv_types["general.alignment"][0] != GGUFValueType.UINT32:
        raise w.error("general.alignment", f"must be a uint32, not {kv_types['general.alignment'][0].name}")
    a = metadata["general.alignment"]
    if a == 0 or a & (a - 1):
        raise w.error("general.alignment", f"{a} is not a power of two")
    return a


def _read_tensor_infos(w: _Walker, n_tensors: int, alignment: int):
    """Parse and check the tensor infos; offsets stay relative to the data section."""
    infos = []
    names = set()
    for i in range(n_tensors):
        name = w.string(f"tensor[{i}] name")
        field = f"tensor '{name}'"
        if len(name.encode()) >= GGML_MAX_NAME:
            raise w.error(field, f"name is longer than GGML's {GGML_MAX_NAME - 1} bytes")
        if name in names:
            raise w.error(field, f"duplicate tensor name (tensor[{i}])")
        names.add(name)
        n_dims = w.u32(f"{field} dims count")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise w.error(f"{field} dims count", f"{n_dims} dims; GGML tensors have 1 to {GGML_MAX_DIMS}")
        ne = tuple(w.u64(f"{field} ne[{d}]") for d in range(n_dims))
        for d, n in enumerate(ne):
            if not 0 < n < 2**63:
                raise w.error(f"{field} ne[{d}]", f"dimension {n} is not a positive int64")
        raw_type = w.u32(f"{field} type")
        try:
            ttype = Type(raw_type)
        except ValueError:
            raise w.error(f"{field} type", f"unsupported GGML type id {raw_type}") from None
        offset = w.u64(f"{field} offset")
        bs = blck_size(ttype)
        if ne[0] % bs:
            raise w.error(f"{field} ne[0]", f"{ne[0]} is not a multiple of {type_name(ttype)}'s block "
                                            f"size {bs}")
        if offset % alignment:
            raise w.error(f"{field} offset", f"{offset} is not a multiple of the alignment {alignment}")
        nbytes = ne[0] // bs * type_size(ttype) * math.prod(ne[1:])
        infos.append((name, ttype, ne, offset, nbytes))
    return infos


def _check_data_layout(w: _Walker, infos, data_offset: int):
    """Every tensor inside the file, none overlapping another."""
    for name, _, _, offset, nbytes in infos:
        end = data_offset + offset + nbytes
        if end > w.size:
            raise w.error(f"tensor '{name}' data", f"bytes {data_offset + offset}..{end} lie outside "
                                                   f"the file ({w.size} bytes)")
    by_offset = sorted(infos, key=lambda t: t[3])
    for a, b in zip(by_offset, by_offset[1:]):
        if a[3] + a[4] > b[3]:
            raise w.error(f"tensor '{b[0]}' data", f"overlaps the data of tensor '{a[0]}'")


def read_gguf(path) -> GGUFFile:
    """Parse and validate the GGUF file at ``path``; see the module docstring. Raises ``GGUFError``
    for anything malformed or unsupported (``OSError`` for a file that cannot be opened)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < 4:
        raise GGUFError(path, "magic", f"the file has only {size} bytes; not a GGUF file")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    w = _Walker(path, memoryview(mm))
    magic = bytes(w.buf[:4])
    if magic != GGUF_MAGIC:
        raise w.error("magic", f"{magic!r} is not {GGUF_MAGIC!r}; not a GGUF file")
    w.pos = 4
    version = w.u32("version")
    if version not in (2, 3):
        if version & 0xFFFF == 0:
            raise w.error("version", f"{version:#x} looks like a big-endian GGUF file, which is "
                                     f"not supported")
        raise w.error("version", f"GGUF version {version} is not supported (only 2 and 3)")
    n_tensors = w.u64("tensor count")
    n_kv = w.u64("kv count")
    w.count(n_kv, _MIN_KV_SIZE, "kv count", "key/value count")
    metadata, kv_types = _read_kv(w, n_kv)
    alignment = _alignment(w, metadata, kv_types)
    w.count(n_tensors, _MIN_TENSOR_INFO_SIZE, "tensor count", "tensor count")
    infos = _read_tensor_infos(w, n_tensors, alignment)
    data_offset = -(-w.pos // alignment) * alignment
    _check_data_layout(w, infos, data_offset)
    tensors = {name: TensorInfo(name, ttype, ne, data_offset + offset, nbytes)
               for name, ttype, ne, offset, nbytes in infos}
    return GGUFFile(path, version, metadata, kv_types, tensors, alignment, data_offset, mm)


# --- typed metadata: what a model's hyper-parameters are read with ----------------------------

_INT32_MAX = 2**31 - 1


def get_key(meta, path, key, kind, default=None, required=False):
    """``meta[key]`` checked to be a ``kind`` ("int", "float", "str" or "bool"), or ``default`` when
    absent (llama.cpp's ``get_key``); a GGUFError naming the key otherwise."""
    if key not in meta:
        if required:
            raise GGUFError(path, key, "required key is missing")
        return default
    v = meta[key]
    ok = {"int": isinstance(v, int) and not isinstance(v, bool),
          "float": isinstance(v, (int, float)) and not isinstance(v, bool),
          "str": isinstance(v, str),
          "bool": isinstance(v, bool)}[kind]
    if not ok:
        raise GGUFError(path, key, f"expected a {kind}, got {type(v).__name__} {_short(v)}")
    return float(v) if kind == "float" else v


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def get_count(meta, path, key, default=None, required=False, lo=1):
    """An int key in ``[lo, INT32_MAX]``, as llama.cpp's counts are."""
    v = get_key(meta, path, key, "int", default, required)
    if v is not None and not lo <= v <= _INT32_MAX:
        raise GGUFError(path, key, f"{v} is out of range [{lo}, {_INT32_MAX}]")
    return v


def get_per_layer(meta, path, key, n_layer, default=None, required=False):
    """A count that llama.cpp also accepts per layer (an array of ``n_layer`` values, its
    ``get_key_or_arr``); lazyggml runs uniform layers, so the values must all be equal."""
    v = meta.get(key)
    if isinstance(v, list):
        if len(v) != n_layer:
            raise GGUFError(path, key, f"has {len(v)} per-layer values for {n_layer} layers")
        if len(set(v)) > 1:
            raise GGUFError(path, key, f"per-layer values differ ({_short(v)}); not supported")
        meta = {key: v[0]}
    return get_count(meta, path, key, default, required)


def get_positive_float(meta, path, key, default=None, required=False, allow_zero=False):
    """A finite float key, positive (or zero with ``allow_zero``)."""
    v = get_key(meta, path, key, "float", default, required)
    if v is not None and not (math.isfinite(v) and (v > 0 or allow_zero and v == 0)):
        raise GGUFError(path, key, f"{v} is not a finite {'non-negative' if allow_zero else 'positive'} "
                                   f"number")
    return v
