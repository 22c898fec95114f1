"""NORM and RMS_NORM on the CPU (GGML's ``ggml_compute_forward_norm_f32`` / ``rms_norm_f32``).

Per row of ``ne0`` elements, with GGML's precisions: the sums are accumulated in double
(``ggml_float``) over float32 terms, the statistics are rounded to float32, and the row is scaled
by the float32 ``1/sqrtf(var + eps)``:

* NORM: ``mean = (float)sum(x) / n``, ``var = (float)(sum((x - mean)^2) / n)``,
  ``y = (x - mean) * scale``;
* RMS_NORM: the same with ``mean = 0``: ``ms = (float)(sum(x*x) / n)``, ``y = x * scale``.

``eps`` is ``ops.norm_eps(node)``. Rows may be strided; the result may alias the input (in place).
"""
from __future__ import annotations

import math

import numpy as np

from ...cache import tie_cache
from ...ops import Op, norm_eps
from ...types import Type
from . import common, pool, simd
from .table import forward
from .common import chunk, parallel_kernel, unravel_row

_NORM, _RMS_NORM = 0, 1


@parallel_kernel
def norm(ch, nch, mode, x, dst, eps):
    n3, n2, n1, n0 = x.shape
    eps32 = np.float32(eps)
    for r in chunk(n3 * n2 * n1, ch, nch):
        i3, i2, i1 = unravel_row(r, n1, n2)
        xr, yr = x[i3, i2, i1], dst[i3, i2, i1]
        mean = np.float32(0.0)
        if mode == _NORM:
            s = 0.0
            for i in range(n0):
                s += np.float64(xr[i])
            mean = np.float32(s) / np.float32(n0)
        s = 0.0  # sum of squares of the centred row (RMS_NORM: mean = 0)
        for i in range(n0):
            v = xr[i] - mean
            s += np.float64(v * v)
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(s / n0) + eps32))
        for i in range(n0):
            yr[i] = (xr[i] - mean) * scale


def _supports(node):
    return node.type == Type.F32 and node.src[0].type == Type.F32


@forward(Op.NORM, Op.RMS_NORM, supports=_supports)
def norm_forward(node, dst, srcs, params):
    mode = _NORM if node.op == Op.NORM else _RMS_NORM
    return [params.launch(norm, dst.size, mode, srcs[0], dst, float(norm_eps(node)))]


# the cache of every kernel above also depends on these files (see lazyggml.cache.tie_cache)
tie_cache(globals(), simd.ISA, simd.__file__, common.__file__, pool.__file__, __file__)
