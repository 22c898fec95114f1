"""CONCAT, PAD and REPEAT on the CPU: pure data movement, so one kernel each serves every type
(the elements are moved as raw bits, see ``copy.as_bits``).

* CONCAT (``ops.concat_dim``): ``dst`` is ``a`` followed by ``b`` along ``dim``. Any type,
  quantized included (GGML's ``concat_any``: along dim 0 a quantized row is whole blocks, so the
  row bytes are simply laid end to end).
* PAD (``ops.pad_params``: ``lp0, rp0, .., lp3, rp3`` of ``pad_ext``): ``a`` placed at
  offset ``lpN`` in each dim of a zero-filled ``dst`` (GGML's non-circular ``pad_f32``).
* REPEAT: ``dst[i3, i2, i1, i0] = a[i3 % ne03, i2 % ne02, i1 % ne01, i0 % ne00]``.

The kernels are serial: this is memory-bound movement, and each ``parallel=True`` signature would
cost about 2 s more to compile.
"""
from __future__ import annotations

from numba import njit

from ...cache import tie_cache
from ...ops import Op, concat_dim, pad_params
from ...types import is_quantized
from . import common, simd
from .table import forward
from .common import as_bits, unravel_row

_kernel = njit(cache=True, error_model="numpy")


@_kernel
def concat(a, b, dim, dst):
    """``dim`` in NumPy order (3 - GGML's dim)."""
    n3, n2, n1, _ = dst.shape
    o = a.shape[dim]
    na0 = a.shape[3]
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = unravel_row(r, n1, n2)
        d = dst[i3, i2, i1]
        if dim == 3:
            d[:na0] = a[i3, i2, i1]
            d[na0:] = b[i3, i2, i1]
        elif (dim == 2 and i1 < o) or (dim == 1 and i2 < o) or (dim == 0 and i3 < o):
            d[:] = a[i3, i2, i1]
        else:
            j3, j2, j1 = i3 - o * (dim == 0), i2 - o * (dim == 1), i1 - o * (dim == 2)
            d[:] = b[j3, j2, j1]


@_kernel
def pad(a, lp3, lp2, lp1, lp0, dst):
    """``lpN`` in NumPy order: the left padding of axis N."""
    n3, n2, n1, _ = dst.shape
    m3, m2, m1, m0 = a.shape
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = unravel_row(r, n1, n2)
        d = dst[i3, i2, i1]
        d[:] = 0
        j3, j2, j1 = i3 - lp3, i2 - lp2, i1 - lp1
        if 0 <= j3 < m3 and 0 <= j2 < m2 and 0 <= j1 < m1:
            d[lp0:lp0 + m0] = a[j3, j2, j1]


@_kernel
def repeat(a, dst):
    n3, n2, n1, n0 = dst.shape
    m3, m2, m1, m0 = a.shape
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = unravel_row(r, n1, n2)
        s, d = a[i3 % m3, i2 % m2, i1 % m1], dst[i3, i2, i1]
        for k in range(n0 // m0):
            d[k * m0:(k + 1) * m0] = s


def _concat_supported(node):
    a, b = node.src[0], node.src[1]
    return a.type == b.type == node.type


@forward(Op.CONCAT, supports=_concat_supported)
def concat_forward(node, dst, srcs, params):
    # GGML's dim d is axis 3 - d of the NumPy view
    return [(concat, (as_bits(srcs[0]), as_bits(srcs[1]), 3 - concat_dim(node), as_bits(dst)))]


def _plain_supported(node):
    return node.src[0].type == node.type and not is_quantized(node.type)


@forward(Op.PAD, supports=_plain_supported)
def pad_forward(node, dst, srcs, params):
    p = pad_params(node)
    return [(pad, (as_bits(srcs[0]), p.lp3, p.lp2, p.lp1, p.lp0, as_bits(dst)))]


@forward(Op.REPEAT, supports=_plain_supported)
def repeat_forward(node, dst, srcs, params):
    return [(repeat, (as_bits(srcs[0]), as_bits(dst)))]


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, common.__file__, __file__)
