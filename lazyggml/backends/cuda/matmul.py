"""Float ``mul_mat``: F32 or F16 src0 times F32 src1, any strides, with GGML's broadcasting.

``dst[row, col, i2, i3] = Σ_k src0[k, row, i2/r2, i3/r3] · src1[k, col, i2, i3]`` where
``r2 = ne12/ne02`` and ``r3 = ne13/ne03``. All strides are in elements (k's too), so permuted and
transposed views (the attention products read the KV cache through them) need no copy.

* ``mul_mat_vec_f`` (few columns, GGML's mmvf idea): one block of 128 threads (one warp under the
  simulator) per (row, column); each thread strides over k, then a warp reduction and a
  shared-memory step across the warps.
* ``mul_mat_f`` (many columns): a classic shared-memory tiled GEMM. A block of 16×16 threads
  computes a 64×64 tile of dst; each k-step stages a 64×16 slab of src0 and of src1 in shared
  memory; thread (tx, ty) owns rows ``tx + 16·i`` and columns ``ty + 16·j`` (i, j < 4), so a
  warp's stores to dst (rows contiguous) coalesce and its reads of the src0 slab are consecutive.

Quantized src0 without an mmq kernel goes through ``dequant.launch_dequantize`` into F32 first,
then ``mul_mat_f``: GGML's dequantize-then-cuBLAS path.
"""
from __future__ import annotations

import numba
from numba import cuda

from .common import jit_kernel, F32_ZERO, SIM, cdiv, warp_reduce_sum

MMVF_MAX_COLS = 8
MMVF_THREADS = 32 if SIM else 128   # one warp under the simulator (threads are costly there)
TILE = 64
TK = 16
TILE_PAD = TILE + 1   # shared rows padded by one float: no bank conflicts when threads walk k


@jit_kernel()
def mul_mat_vec_f(x, y, dst, ne00, ne01, s00, s01, s02, s03, s10, s11, s12, s13, ne12, r2, r3):
    row = cuda.blockIdx.x
    col = cuda.blockIdx.y
    i23 = cuda.blockIdx.z
    i2 = i23 % ne12
    i3 = i23 // ne12
    xb = (i3 // r3) * s03 + (i2 // r2) * s02 + row * s01
    yb = i3 * s13 + i2 * s12 + col * s11
    tid = cuda.threadIdx.x
    s = F32_ZERO
    for k in range(tid, ne00, cuda.blockDim.x):
        s += numba.float32(x[xb + k * s00]) * y[yb + k * s10]
    s = warp_reduce_sum(s, 32)
    part = cuda.shared.array(32, numba.float32)
    if tid % 32 == 0:
        part[tid // 32] = s
    cuda.syncthreads()
    s = part[tid % 32] if tid % 32 < cuda.blockDim.x // 32 else F32_ZERO
    s = warp_reduce_sum(s, 32)
    if tid == 0:
        dst[(i23 * cuda.gridDim.y + col) * ne01 + row] = s


@jit_kernel()
def mul_mat_f(x, y, dst, ne00, ne01, ne11, s00, s01, s02, s03, s10, s11, s12, s13, ne12, r2, r3):
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    tid = 16 * ty + tx
    row0 = TILE * cuda.blockIdx.x
    col0 = TILE * cuda.blockIdx.y
    i23 = cuda.blockIdx.z
    i2 = i23 % ne12
    i3 = i23 // ne12
    xb = (i3 // r3) * s03 + (i2 // r2) * s02
    yb = i3 * s13 + i2 * s12

    xs = cuda.shared.array((TK, TILE_PAD), numba.float32)
    ysh = cuda.shared.array((TK, TILE_PAD), numba.float32)
    acc = cuda.local.array(16, numba.float32)
    for a in range(16):
        acc[a] = F32_ZERO

    for k0 in range(0, ne00, TK):
        # 1024 values of each slab, 4 per thread; consecutive threads walk along k (contiguous)
        for e in range(tid, TK * TILE, 256):
            kk = e % TK
            rr = e // TK
            k = k0 + kk
            r = row0 + rr
            c = col0 + rr
            xs[kk, rr] = numba.float32(x[xb + r * s01 + k * s00]) if k < ne00 and r < ne01 else F32_ZERO
            ysh[kk, rr] = y[yb + c * s11 + k * s10] if k < ne00 and c < ne11 else F32_ZERO
        cuda.syncthreads()
        for kk in range(TK):
            for i in range(4):
                xv = xs[kk, tx + 16 * i]
                for j in range(4):
                    acc[4 * i + j] += xv * ysh[kk, ty + 16 * j]
        cuda.syncthreads()

    for i in range(4):
        r = row0 + tx + 16 * i
        for j in range(4):
            c = col0 + ty + 16 * j
            if r < ne01 and c < ne11:
                dst[(i23 * ne11 + c) * ne01 + r] = acc[4 * i + j]


def launch_mul_mat_f(stream, x, s0, ne0, y, src1, dst):
    """x: flat F32/F16 view of src0, whose shape is ``ne0`` and element strides ``s0``; y: flat view
    of the F32 src1; dst: contiguous F32."""
    ne00, ne01, ne02, ne03 = ne0
    ne11, ne12, ne13 = src1.ne[1], src1.ne[2], src1.ne[3]
    s1 = tuple(nb // 4 for nb in src1.nb)
    r2, r3 = ne12 // ne02, ne13 // ne03
    if ne11 <= MMVF_MAX_COLS:
        mul_mat_vec_f[(ne01, ne11, ne12 * ne13), MMVF_THREADS, stream](
            x, y, dst, ne00, ne01, *s0, *s1, ne12, r2, r3)
    else:
        mul_mat_f[(cdiv(ne01, TILE), cdiv(ne11, TILE), ne12 * ne13), (16, 16), stream](
            x, y, dst, ne00, ne01, ne11, *s0, *s1, ne12, r2, r3)
