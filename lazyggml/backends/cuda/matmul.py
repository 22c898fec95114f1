"""Float ``mul_mat``: F32 or F16 src0 (and BF16 through a uint16 view, in ``mul_mat_vec_f``) times F32
src1, any strides, with GGML's broadcasting.

``dst[row, col, i2, i3] = Σ_k src0[k, row, i2/r2, i3/r3] · src1[k, col, i2, i3]`` where
``r2 = ne12/ne02`` and ``r3 = ne13/ne03``. All strides are in elements (k's too), so permuted and
transposed views (the attention products read the KV cache through them) need no copy.

* ``mul_mat_vec_f`` (few columns, GGML's mmvf idea): one block of 128 threads (one warp under the
  simulator) per (row, column); each thread strides over k, then a warp reduction and a
  shared-memory step across the warps. Half-width weights (F16, BF16) whose rows are packed and
  16-byte aligned, times packed aligned columns, take ``mul_mat_vec_h`` instead: one block per
  row for all the columns, so the row is read once; per step a thread takes 8 weights in one
  16-byte load and each column's 8 values in two. On an H200 (m=4096, k=14336, n=1) the first
  kernel (2-byte loads, the row read once per column) took 115 µs; 16-byte weight loads with
  scalar column loads 66 µs; with the column's loads 16 bytes wide too, 30 µs, GGML's time:
  the scalar loads, not the weights, had been the limit. Built with ``moe`` (``mul_mat_vec_f_id``),
  it computes MUL_MAT_ID: a block per (row, expert slot, token), the expert read from ``ids``
  (2-byte weight loads: the 115 µs kind of kernel, a first version for float experts).
* ``mul_mat_f`` (many columns): a classic shared-memory tiled GEMM. A block of 16×16 threads
  computes a 64×64 tile of dst; each k-step stages a 64×16 slab of src0 and of src1 in shared
  memory; thread (tx, ty) owns rows ``tx + 16·i`` and columns ``ty + 16·j`` (i, j < 4), so a
  warp's stores to dst (rows contiguous) coalesce and its reads of the src0 slab are consecutive.

* ``mul_mat_f_mma`` (many columns, F16 or BF16 src0 with packed rows; GPUs with tensor cores,
  sm_80+): the product on 16-bit tensor cores (``mma.sync.m16n8k16`` with float32 accumulators,
  ``common.mma_f16_16x8x16`` or ``mma_bf16_16x8x16``), what GGML gets from cuBLAS for these
  weights: src1 is rounded to the weights' type as it is staged, as GGML converts it before its GEMM. A block of 8 warps computes a
  128×64 tile of dst (warp ``w``: rows ``32·(w%4)``, columns ``32·(w/4)``, 2×4 MMA tiles); per
  k-step of 32 it stages 128 src0 rows (16-byte loads of 8 halves) and 64 src1 columns (floats,
  packed to ``half2``) in shared rows of 20 ints, a stride at which the fragment reads of a warp
  hit 32 different banks; the next k-step's loads are issued before this one's products.

Quantized src0 without an mmq kernel, past the columns mmvq takes (ops.py), goes through
``dequant.launch_dequantize`` into F16 first, then ``mul_mat_f_mma`` (F32 and ``mul_mat_f`` where
there are no tensor cores): GGML's dequantize-then-cuBLAS path.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from . import common
from .common import (bf16_to_float, device, half2_float2, int_as_float, jit_kernel, plane, F32_ZERO, SIM, cdiv,
                     load_int4, store_int4, tensor_cores, warp_reduce_sum)

MMVF_MAX_COLS = 8
MMVF_THREADS = 32 if SIM else 128   # one warp under the simulator (threads are costly there)
TILE = 64
TK = 16
TILE_PAD = TILE + 1   # shared rows padded by one float: no bank conflicts when threads walk k


def _make_vec_f(moe):
    MOE = moe     # a constant of the closure: the plain kernel has no ids code

    @jit_kernel()
    def mul_mat_vec_f(x, x_bf16, y, dst, ne00, ne01, s00, s01, s02, s03, s10, s11, s12, s13, ne12, r2, r3,
                      ids, ids_s0, ids_s1, ne02, n_b):
        row = cuda.blockIdx.x
        col = cuda.blockIdx.y
        i23 = cuda.blockIdx.z
        if MOE:   # MUL_MAT_ID: col = the token's expert slot, i23 = the token; the expert from ids
            expert = ids[col * ids_s0 + i23 * ids_s1]
            if expert < 0 or expert >= ne02:
                return      # an id out of range: nothing read, nothing written (GGML asserts)
            xb = expert * s02 + row * s01
            yb = i23 * s12 + (col % n_b) * s11    # b's row: the token's one, or the slot's
        else:
            i2 = i23 % ne12
            i3 = i23 // ne12
            xb = (i3 // r3) * s03 + (i2 // r2) * s02 + row * s01
            yb = i3 * s13 + i2 * s12 + col * s11
        tid = cuda.threadIdx.x
        s = F32_ZERO
        for k in range(tid, ne00, cuda.blockDim.x):
            v = x[xb + k * s00]
            s += (bf16_to_float(v) if x_bf16 else numba.float32(v)) * y[yb + k * s10]
        s = warp_reduce_sum(s, 32)
        part = cuda.shared.array(32, numba.float32)
        if tid % 32 == 0:
            part[tid // 32] = s
        cuda.syncthreads()
        s = part[tid % 32] if tid % 32 < cuda.blockDim.x // 32 else F32_ZERO
        s = warp_reduce_sum(s, 32)
        if tid == 0:
            dst[(i23 * cuda.gridDim.y + col) * ne01 + row] = s

    return mul_mat_vec_f


mul_mat_vec_f = _make_vec_f(False)
mul_mat_vec_f_id = _make_vec_f(True)


_vec_h = {}


def _make_vec_h(ncols):
    NC = ncols
    NPART = 32 * ncols     # shared sizes must be constants of the closure

    @jit_kernel()
    def mul_mat_vec_h(x32, x_bf16, y32, dst, ne00, ne01, s01, s02, s03, s11, s12, s13, ne12, r2, r3):
        """``mul_mat_vec_f`` for F16 or BF16 (``x_bf16``) rows and packed F32 columns, both read 16
        bytes at a time through int32 views; strides in values."""
        row = cuda.blockIdx.x
        i23 = cuda.blockIdx.z
        i2, i3 = plane(i23, ne12)
        xb = ((i3 // r3) * s03 + (i2 // r2) * s02 + row * s01) // 2
        yb = i3 * s13 + i2 * s12
        tid = cuda.threadIdx.x
        acc = cuda.local.array(NC, numba.float32)
        for c in range(NC):
            acc[c] = F32_ZERO
        k = 8 * tid
        while k < ne00:
            q4 = load_int4(x32, xb + k // 2)
            for c in range(NC):
                yo = yb + c * s11 + k
                y4 = load_int4(y32, yo)
                y8 = load_int4(y32, yo + 4)
                t = F32_ZERO
                for q in range(4):
                    v = q4[q]
                    if x_bf16:
                        a = int_as_float(np.uint32(v) << np.uint32(16))
                        b = int_as_float(np.uint32(v) & np.uint32(0xFFFF0000))
                    else:
                        a, b = half2_float2(v)
                    yq = y4 if q < 2 else y8
                    t += a * int_as_float(np.uint32(yq[2 * (q % 2)])) + b * int_as_float(np.uint32(yq[2 * (q % 2) + 1]))
                acc[c] += t
            k += 8 * cuda.blockDim.x
        # per column: a warp reduction, then one across the warps through shared memory
        part = cuda.shared.array(NPART, numba.float32)
        lane = tid % 32
        w = tid // 32
        for c in range(NC):
            t = warp_reduce_sum(acc[c], 32)
            if lane == 0:
                part[c * 32 + w] = t
        cuda.syncthreads()
        if w == 0:
            for c in range(NC):
                t = part[c * 32 + lane] if lane < cuda.blockDim.x // 32 else F32_ZERO
                t = warp_reduce_sum(t, 32)
                if lane == 0:
                    dst[(i23 * NC + c) * ne01 + row] = t

    return mul_mat_vec_h


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


MMA_BM, MMA_BN, MMA_BK = 128, 64, 32
MMA_NWARPS = 8
MMA_S = 20        # shared row stride in ints: 16 (32 halves) + 4


def _make_mma_kernel(bf16):
    if bf16:
        mma, pack = common.mma_bf16_16x8x16, common.float2_bf162
    else:
        mma, pack = common.mma_f16_16x8x16, common.float2_half2
    BM, BN, BK, S = MMA_BM, MMA_BN, MMA_BK, MMA_S
    nthreads = 32 * MMA_NWARPS
    n_as, n_bs = BM * S, BN * S      # shared sizes must be constants of the closure

    @device
    def load_pieces(x32, y, ra, rb, xr0, xr1, yc, k0, ne00, q, s10):
        """This thread's pieces of k-step ``k0``: 8 halves of each of its two src0 rows (zeros past
        ``ne00``, a multiple of 8) and 8 values of its src1 column as 4 ``half2``."""
        for h in range(2):
            if k0 + 8 * q < ne00:
                xo = (xr0 if h == 0 else xr1) + k0
                ra[4 * h], ra[4 * h + 1], ra[4 * h + 2], ra[4 * h + 3] = load_int4(x32, xo // 2)
            else:
                ra[4 * h] = ra[4 * h + 1] = ra[4 * h + 2] = ra[4 * h + 3] = 0
        for e in range(4):
            k = k0 + 8 * q + 2 * e
            rb[e] = pack(y[yc + k * s10] if k < ne00 else F32_ZERO,
                         y[yc + (k + 1) * s10] if k + 1 < ne00 else F32_ZERO)

    @jit_kernel(launch_bounds=(nthreads, 2))
    def mul_mat_f_mma(x32, y, dst, ne00, ne01, ne11, s01, s02, s03, s10, s11, s12, s13, ne12, r2, r3):
        lane = cuda.threadIdx.x
        w = cuda.threadIdx.y
        tid = 32 * w + lane
        g = lane // 4
        t = lane % 4
        row0 = BM * cuda.blockIdx.x
        col0 = BN * cuda.blockIdx.y
        i23 = cuda.blockIdx.z
        i2 = i23 % ne12
        i3 = i23 // ne12
        xb = (i3 // r3) * s03 + (i2 // r2) * s02          # in halves
        yb = i3 * s13 + i2 * s12

        As = cuda.shared.array(n_as, numba.int32)
        Bs = cuda.shared.array(n_bs, numba.int32)
        acc = cuda.local.array(32, numba.float32)         # [m-tile 2][n-tile 4][4]
        for e in range(32):
            acc[e] = F32_ZERO
        ra = cuda.local.array(8, numba.int32)             # the next k-step's pieces, in flight
        rb = cuda.local.array(4, numba.int32)
        # this thread's pieces: src0 rows tid/4 and 64 + tid/4, halves 8·(tid%4) ..; src1 column
        # tid/4, values 8·(tid%4) ..
        q = tid % 4
        xr0 = xb + min(row0 + tid // 4, ne01 - 1) * s01 + 8 * q
        xr1 = xb + min(row0 + 64 + tid // 4, ne01 - 1) * s01 + 8 * q
        yc = yb + min(col0 + tid // 4, ne11 - 1) * s11
        wm = np.uint32(32 * (w % 4) + g)
        wn = np.uint32(32 * (w // 4) + g)

        load_pieces(x32, y, ra, rb, xr0, xr1, yc, 0, ne00, q, s10)
        k0 = 0
        while k0 < ne00:
            for h in range(2):
                store_int4(As, (64 * h + tid // 4) * S + 4 * q, ra[4 * h], ra[4 * h + 1], ra[4 * h + 2],
                           ra[4 * h + 3])
            store_int4(Bs, (tid // 4) * S + 4 * q, rb[0], rb[1], rb[2], rb[3])
            cuda.syncthreads()
            kn = k0 + BK
            if kn < ne00:              # the next pieces, loaded while this k-step computes
                load_pieces(x32, y, ra, rb, xr0, xr1, yc, kn, ne00, q, s10)
            for ks in range(2):
                a = cuda.local.array(8, numba.int32)
                for mt in range(2):
                    ab = np.uint32((wm + 16 * mt) * S + 8 * ks + t)
                    a[4 * mt] = As[ab]
                    a[4 * mt + 1] = As[ab + 8 * S]
                    a[4 * mt + 2] = As[ab + 4]
                    a[4 * mt + 3] = As[ab + 8 * S + 4]
                for nt in range(4):
                    bb = np.uint32((wn + 8 * nt) * S + 8 * ks + t)
                    b0 = Bs[bb]
                    b1 = Bs[bb + 4]
                    for mt in range(2):
                        e = 4 * (4 * mt + nt)
                        acc[e], acc[e + 1], acc[e + 2], acc[e + 3] = mma(
                            a[4 * mt], a[4 * mt + 1], a[4 * mt + 2], a[4 * mt + 3], b0, b1,
                            acc[e], acc[e + 1], acc[e + 2], acc[e + 3])
            cuda.syncthreads()
            k0 = kn

        for mt in range(2):
            for nt in range(4):
                for hf in range(2):
                    r = row0 + 32 * (w % 4) + 16 * mt + g + 8 * hf
                    for c2 in range(2):
                        c = col0 + 32 * (w // 4) + 8 * nt + 2 * t + c2
                        if r < ne01 and c < ne11:
                            dst[(i23 * ne11 + c) * ne01 + r] = acc[4 * (4 * mt + nt) + 2 * hf + c2]

    return mul_mat_f_mma


_mma_kernels = {}   # by "src0 is BF16"


def aligned16(x):
    address = x._ary.ctypes.data if SIM else x.device_ctypes_pointer.value   # the simulator wraps a numpy array
    return address % 16 == 0


def packed16(x, s0, ne0):
    """Are the rows of ``x`` packed, a multiple of 8 values long and 16-byte aligned (8 half-width
    values or two groups of 4 floats per 16-byte load)?"""
    per16 = 16 // x.dtype.itemsize
    return s0[0] == 1 and ne0[0] % 8 == 0 and all(s % per16 == 0 for s in s0[1:]) and aligned16(x)


def use_mma(x, s0, ne0):
    """The tensor-core kernel for an F16 or BF16 (uint16 view) src0 whose rows are packed and
    16-byte aligned (sm_80+)."""
    return tensor_cores() and x.dtype.itemsize == 2 and packed16(x, s0, ne0)


def launch_mul_mat_f(stream, x, s0, ne0, y, src1, dst):
    """x: flat F32/F16 view of src0, whose shape is ``ne0`` and element strides ``s0``; y: flat view
    of the F32 src1; dst: contiguous F32."""
    ne00, ne01, ne02, ne03 = ne0
    ne11, ne12, ne13 = src1.ne[1], src1.ne[2], src1.ne[3]
    s1 = tuple(nb // 4 for nb in src1.nb)
    r2, r3 = ne12 // ne02, ne13 // ne03
    if ne11 <= MMVF_MAX_COLS and x.dtype.itemsize == 2 and packed16(x, s0, ne0) and packed16(y, s1, src1.ne):
        k = _vec_h.get(ne11)
        if k is None:
            k = _vec_h[ne11] = _make_vec_h(ne11)
        k[(ne01, 1, ne12 * ne13), MMVF_THREADS, stream](
            x[:x.size - x.size % 2].view(np.int32), x.dtype == np.uint16, y.view(np.int32), dst, ne00, ne01,
            *s0[1:], *s1[1:], ne12, r2, r3)
    elif ne11 <= MMVF_MAX_COLS:
        mul_mat_vec_f[(ne01, ne11, ne12 * ne13), MMVF_THREADS, stream](
            x, x.dtype == np.uint16, y, dst, ne00, ne01, *s0, *s1, ne12, r2, r3,
            dst, 0, 0, 0, 1)     # no ids (the plain kernel never reads them)
    elif use_mma(x, s0, ne0):
        bf16 = x.dtype == np.uint16
        if bf16 not in _mma_kernels:
            _mma_kernels[bf16] = _make_mma_kernel(bf16)
        x32 = x[:x.size - x.size % 2].view(np.int32)
        _mma_kernels[bf16][(cdiv(ne01, MMA_BM), cdiv(ne11, MMA_BN), ne12 * ne13), (32, MMA_NWARPS), stream](
            x32, y, dst, ne00, ne01, ne11, *s0[1:], *s1, ne12, r2, r3)
    else:
        mul_mat_f[(cdiv(ne01, TILE), cdiv(ne11, TILE), ne12 * ne13), (16, 16), stream](
            x, y, dst, ne00, ne01, ne11, *s0, *s1, ne12, r2, r3)


def launch_mul_mat_vec_f_id(stream, x, s0, ne0, y, src1, ids, ids_t, dst):
    """``dst = mul_mat_id(src0, src1, ids)`` for float src0 (flat view ``x``, shape ``ne0`` [k, m,
    n_expert], element strides ``s0``) and F32 src1 [k, n_b, n_tokens] (flat view ``y``), ids I32
    [n_used, n_tokens] (flat view ``ids``): ``mul_mat_vec_f`` over the grid (row, slot, token), each
    block on its pair's expert, whatever the number of tokens (GGML's ``mul_mat_f`` with ids tiles
    a prompt's tokens per expert)."""
    s1 = tuple(nb // 4 for nb in src1.nb)
    n_used, n_tokens = ids_t.ne[0], ids_t.ne[1]
    mul_mat_vec_f_id[(ne0[1], n_used, n_tokens), MMVF_THREADS, stream](
        x, x.dtype == np.uint16, y, dst, ne0[0], ne0[1], *s0, *s1, n_tokens, 1, 1,
        ids, ids_t.nb[0] // 4, ids_t.nb[1] // 4, ne0[2], src1.ne[1])
