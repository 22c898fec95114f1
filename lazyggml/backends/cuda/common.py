"""What every CUDA kernel shares: GGML's constants, ``dp4a``, warp reductions, ``roundf``, launch rules.

The same kernels run on a real GPU and on numba-cuda's simulator (``NUMBA_ENABLE_CUDASIM=1``, set
before numba is imported), which runs each CUDA thread as a Python thread. The simulator lacks two
things the GPU kernels use, so each of them is a small device helper with two bodies, chosen once
when this module is imported (``SIM``):

* **dp4a** (GGML's ``ggml_cuda_dp4a``): ``c + Σ a_k·b_k`` over the four signed bytes of two int32s.
  On the GPU it is the ``dp4a.s32.s32`` instruction, emitted as inline PTX. It can also be reached
  through ``dp4a.cu`` (one line of CUDA C calling ``__dp4a``) linked into each kernel that calls it
  (``LAZYGGML_CUDA_DP4A=link``): with nvJitLink's link-time optimisation the call is inlined and
  measured as fast on an H200, but numba-cuda cannot write a kernel with linked files to its disk
  cache, so inline PTX is the default. Under the simulator it is a loop over the four bytes.
* **warp reductions** (GGML's ``warp_reduce_sum`` / ``warp_reduce_max``): on the GPU a butterfly of
  ``shfl_xor_sync`` with offsets width/2 ... 1; under the simulator each lane publishes its value
  in shared memory and replays the same butterfly (two ``syncthreads`` in all), so results are
  bit-equal. The simulator releases a barrier once every live thread of the block waits at one,
  so a reduction called by a subset of warps works when the other warps have finished or wait at
  a barrier themselves: kernels call these either from all threads or at their very end.

The int8 tensor-core product ``mma_s8_16x8x32`` (inline PTX, GPU only) serves the fast mmq, and
the 16-bit float ones ``mma_f16_16x8x16`` and ``mma_bf16_16x8x16`` (with ``float2_half2`` and
``float2_bf162`` to pack their operands) the float products of many columns.

**Device functions** are declared with ``@device``: inlined into their callers on the GPU; under
the simulator called as plain Python where they do not touch ``cuda``, because the simulator's own
device-function call takes locks that stall a block's hundreds of Python threads
(``_SimDeviceFunction``).

**Wide accesses.** ``load_int2``/``load_int4`` read 2 or 4 consecutive int32s of an array's data
(flat C order, whatever the array's shape) with one 8- or 16-byte access, and ``store_int4``
writes 4: one instruction where numba would issue four. The element must be aligned to the access
size (the caller's layout guarantees it). ``half2_float2`` splits an int32 holding a ``half2``
into two float32s (the block headers of GGML's formats are ``half2``s).

Index arithmetic: numba computes with signed 64-bit integers and, for a signed index, adds the
array's length when it is negative (Python's wrap-around). In inner loops that costs more than the
work. Hot loops therefore build each index as ``base + constant``: ``base`` an ``np.uint32`` (which
the compiler knows to be non-negative, so the wrap-around check disappears) computed once per
block or tile, the constant folded into the load instruction's immediate offset. Integer products
that feed a float are wrapped in ``np.int32(...)``, else numba multiplies (and converts) in 64 bits.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import math
import os
import types as types_

import numba
import numpy as np
from llvmlite import ir
from numba import config, cuda
from numba.core import types
from numba.core.extending import intrinsic

from ... import compiling, debug

SIM = bool(config.ENABLE_CUDASIM)

# GGML launches small grids on purpose: a block per row of a tiny model's norms, decode's few
# mat-vec blocks. numba-cuda warns at every launch of fewer than 128 blocks ("Grid size N will
# likely result in GPU under-utilization"), which buried `lazyggml demo -ngl 99`'s output. Off for
# the process, unless the user set NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS themselves.
if not SIM and "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS" not in os.environ:
    for _config in ("numba.cuda.core.config", "numba.core.config"):   # numba-cuda 0.30's, older
        try:
            importlib.import_module(_config).CUDA_LOW_OCCUPANCY_WARNINGS = 0
        except ImportError:
            pass



if not SIM:   # numba-cuda's compiles and cache loads, in compiling.py's stream: a first run's CUDA
    # kernels are announced and left out of the speeds as the CPU's are, and warm-up lists them
    from numba.cuda.dispatcher import CUDADispatcher
    compiling.watch_dispatcher(CUDADispatcher, "cuda")

QK8_1 = 32              # values per q8_1 block
Q8_1_INTS = 9           # sizeof(block_q8_1) / 4: ds (half2) + 8 ints of quants
QK8_1_MMQ = 128         # values per block_q8_1_mmq (4 x q8_1 sharing one 16-byte header)
Q8_1_MMQ_INTS = 36      # sizeof(block_q8_1_mmq) / 4: 4 x half2 (d, s) + 32 ints of quants
MATRIX_ROW_PADDING = 512  # src1 rows are quantized padded to a multiple of this (zeros)

CU_DIR = os.path.dirname(os.path.abspath(__file__))

F32_ZERO = np.float32(0.0)
F32_ONE = np.float32(1.0)


def _uses_cuda(fn, seen):
    """Whether running ``fn`` under the simulator touches the ``cuda`` module: by name in its code
    (nested code included), or through a function it calls or closes over."""
    if fn in seen:
        return False
    seen.add(fn)
    names, codes = set(), [fn.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types_.CodeType))
    if "cuda" in names:
        return True
    callees = [fn.__globals__.get(n) for n in names] + [c.cell_contents for c in fn.__closure__ or ()]
    return any(_uses_cuda(f, seen) for f in (getattr(v, "__wrapped__", v) for v in callees)
               if isinstance(f, types_.FunctionType))


class _SimDeviceFunction:
    """A device function under the simulator, called as plain Python when it can be.

    numba-cuda's simulator runs a device function inside a context that swaps its module's ``cuda``
    for the running kernel's fake one, taking two locks per call. With the 128 to 256 Python
    threads of a CUDA block calling ``dp4a`` or ``load_int4`` in their inner loops, those locks
    convoy: a single call measured 0 to 0.2 s, and one simulated mmq launch 3.5 to 263 s from run
    to run. A function that never touches ``cuda`` (decided at its first call, when everything it
    calls is defined) needs no swap and is called directly: the same launch then took 5 to 6 s."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self._simulated = cuda.jit(device=True)(fn)
        self._call = None

    def __call__(self, *args):
        if self._call is None:
            self._call = self._simulated if _uses_cuda(self.__wrapped__, set()) else self.__wrapped__
        return self._call(*args)


def device(fn):
    """A device function: ``cuda.jit(device=True, inline=True)`` on the GPU (inlined into its
    callers, as GGML's ``static __device__ __forceinline__``); ``_SimDeviceFunction`` under the
    simulator."""
    return _SimDeviceFunction(fn) if SIM else cuda.jit(device=True, inline=True)(fn)


def _dp4a_impl():
    if SIM:
        return "sim"
    forced = debug.value("LAZYGGML_CUDA_DP4A")
    if forced in ("link", "ptx"):
        return forced
    return "ptx"   # cacheable (see the module docstring)


DP4A_IMPL = _dp4a_impl()

if DP4A_IMPL == "sim":
    @device
    def dp4a(a, b, c):
        s = int(c)
        ua, ub = int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF
        for k in range(4):
            xa = (ua >> (8 * k)) & 0xFF
            xb = (ub >> (8 * k)) & 0xFF
            s += (xa - 256 if xa > 127 else xa) * (xb - 256 if xb > 127 else xb)
        return np.int32(s)

elif DP4A_IMPL == "link":
    dp4a = cuda.declare_device("dp4a_s8", "int32(int32, int32, int32)",
                               link=[os.path.join(CU_DIR, "dp4a.cu")])

else:
    @intrinsic
    def dp4a(typingctx, a, b, c):
        sig = types.int32(types.int32, types.int32, types.int32)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)] * 3)
            asm = ir.InlineAsm(fnty, "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r")
            ints = [context.cast(builder, v, t, types.int32) for v, t in zip(args, signature.args)]
            # a pure function of its operands: the compiler may share one call between callers
            # (mmvq's two rows dot the same activation sums: 64 -> 48 dp4a per Q4_K lane in PTX)
            return builder.call(asm, ints, attrs=("readnone", "nounwind"))
        return sig, codegen


if not SIM:
    @intrinsic
    def mma_s8_16x8x32(typingctx, a0, a1, a2, a3, b0, b1):
        """One warp-wide int8 tensor-core product (PTX ``mma.sync.aligned.m16n8k32.row.col``,
        sm_80+): a 16x32 int8 tile A times a 32x8 tile B, int32 result, accumulator zero.

        Fragments, with ``g = lane/4`` and ``t = lane%4`` (four int8 per int32 register):
        A: ``a0`` = A[g][4t..4t+3], ``a1`` = A[g+8][4t..], ``a2`` = A[g][16+4t..], ``a3`` = A[g+8][16+4t..];
        B: ``b0`` = B[4t..4t+3][g], ``b1`` = B[16+4t..][g];
        returns C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1].
        """
        sig = types.UniTuple(types.int32, 4)(*([types.int32] * 6))

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32] * 10)
            asm = ir.InlineAsm(
                fnty, "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                      "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r")
            ins = [context.cast(builder, v, t, types.int32) for v, t in zip(args, signature.args)]
            res = builder.call(asm, ins + [ir.Constant(i32, 0)] * 4)
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_value(res, i) for i in range(4)])
        return sig, codegen


    def _mma_16x8x16(kind):
        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            sig = types.UniTuple(types.float32, 4)(*([types.int32] * 6 + [types.float32] * 4))

            def codegen(context, builder, signature, args):
                i32, f32 = ir.IntType(32), ir.FloatType()
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                asm = ir.InlineAsm(
                    fnty, f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                          "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                    "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                ins = [context.cast(builder, v, t, types.int32) for v, t in zip(args[:6], signature.args[:6])]
                ins += [context.cast(builder, v, t, types.float32) for v, t in zip(args[6:], signature.args[6:])]
                res = builder.call(asm, ins)
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(res, i) for i in range(4)])
            return sig, codegen
        return mma

    # One warp-wide tensor-core product of 16-bit floats with a float32 accumulator (PTX
    # ``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}...``, sm_80+): C += A·B, A a 16x16 and B a
    # 16x8 tile, C 16x8 floats. Fragments, with ``g = lane/4`` and ``t = lane%4`` (two values per
    # int32 register, the lower k first): A: ``a0`` = A[g][2t, 2t+1], ``a1`` = A[g+8][2t, 2t+1],
    # ``a2`` = A[g][8+2t, ..], ``a3`` = A[g+8][8+2t, ..]; B: ``b0`` = B[2t, 2t+1][g], ``b1`` =
    # B[8+2t, ..][g]; C as ``mma_s8_16x8x32``'s: C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1], in and out.
    mma_f16_16x8x16 = _mma_16x8x16("f16")
    mma_bf16_16x8x16 = _mma_16x8x16("bf16")

    @intrinsic
    def float2_half2(typingctx, x, y):
        """Two float32s rounded to halves and packed in an int32, ``x`` in the low half (a ``half2``)."""
        sig = types.int32(types.float32, types.float32)

        def codegen(context, builder, signature, args):
            vty = ir.VectorType(ir.HalfType(), 2)
            vec = ir.Constant(vty, ir.Undefined)
            for k in range(2):
                f = context.cast(builder, args[k], signature.args[k], types.float32)
                vec = builder.insert_element(vec, builder.fptrunc(f, ir.HalfType()), ir.Constant(ir.IntType(32), k))
            return builder.bitcast(vec, ir.IntType(32))
        return sig, codegen

    @intrinsic
    def float2_bf162(typingctx, x, y):
        """Two float32s rounded to nearest-even bfloat16s and packed in an int32, ``x`` in the low
        half (PTX ``cvt.rn.bf16x2.f32``, sm_80+, whose first source fills the high half)."""
        sig = types.int32(types.float32, types.float32)

        def codegen(context, builder, signature, args):
            i32, f32 = ir.IntType(32), ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(i32, [f32, f32]), "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f")
            fs = [context.cast(builder, v, t, types.float32) for v, t in zip(args, signature.args)]
            return builder.call(asm, fs, attrs=("readnone", "nounwind"))
        return sig, codegen

if SIM:
    @device
    def load_int2(a, i):
        f = a.reshape(-1)
        return f[i], f[i + 1]

    @device
    def load_int4(a, i):
        f = a.reshape(-1)
        return f[i], f[i + 1], f[i + 2], f[i + 3]

    @device
    def store_int4(a, i, v0, v1, v2, v3):
        f = a.reshape(-1)
        f[i], f[i + 1], f[i + 2], f[i + 3] = v0, v1, v2, v3

    @device
    def half2_float2(x):
        h = np.array([x], np.int32).view(np.float16)
        return np.float32(h[0]), np.float32(h[1])

    @device
    def int_as_float(x):
        return np.array([x], np.uint32).view(np.float32)[0]

    @device
    def float_as_int(x):
        return np.array([x], np.float32).view(np.uint32)[0]

else:
    def _int_vector_load(n):
        @intrinsic
        def load(typingctx, ary, idx):
            if not (isinstance(ary, types.Array) and ary.dtype == types.int32 and ary.layout == "C"
                    and isinstance(idx, types.Integer)):
                return None
            sig = types.UniTuple(types.int32, n)(ary, idx)

            def codegen(context, builder, signature, args):
                a = context.make_array(signature.args[0])(context, builder, args[0])
                ptr = builder.gep(a.data, [context.cast(builder, args[1], signature.args[1], types.intp)])
                vec = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(32), n).as_pointer()), align=4 * n)
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_element(vec, ir.Constant(ir.IntType(32), k)) for k in range(n)])
            return sig, codegen
        return load

    load_int2 = _int_vector_load(2)
    load_int4 = _int_vector_load(4)

    @intrinsic
    def store_int4(typingctx, ary, idx, v0, v1, v2, v3):
        if not (isinstance(ary, types.Array) and ary.dtype == types.int32 and ary.layout == "C"
                and isinstance(idx, types.Integer)):
            return None
        sig = types.none(ary, idx, types.int32, types.int32, types.int32, types.int32)

        def codegen(context, builder, signature, args):
            a = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.gep(a.data, [context.cast(builder, args[1], signature.args[1], types.intp)])
            vty = ir.VectorType(ir.IntType(32), 4)
            vec = ir.Constant(vty, ir.Undefined)
            for k in range(4):
                vec = builder.insert_element(vec, context.cast(builder, args[2 + k], signature.args[2 + k], types.int32),
                                             ir.Constant(ir.IntType(32), k))
            builder.store(vec, builder.bitcast(ptr, vty.as_pointer()), align=16)
            return context.get_dummy_value()
        return sig, codegen

    def _bitcast(src, dst):
        @intrinsic
        def cast(typingctx, x):
            sig = dst(x)

            def codegen(context, builder, signature, args):
                v = context.cast(builder, args[0], signature.args[0], src)
                return builder.bitcast(v, context.get_value_type(dst))
            return sig, codegen
        return cast

    int_as_float = _bitcast(types.uint32, types.float32)    # the float whose bits are x
    float_as_int = _bitcast(types.float32, types.uint32)    # the bits of float x

    @intrinsic
    def half2_float2(typingctx, x):
        sig = types.UniTuple(types.float32, 2)(x)

        def codegen(context, builder, signature, args):
            h2 = builder.bitcast(context.cast(builder, args[0], signature.args[0], types.int32),
                                 ir.VectorType(ir.HalfType(), 2))
            f = [builder.fpext(builder.extract_element(h2, ir.Constant(ir.IntType(32), k)), ir.FloatType())
                 for k in range(2)]
            return context.make_tuple(builder, signature.return_type, f)
        return sig, codegen


if SIM:
    @device
    def _block_tid():
        return cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)

    def _butterfly(x, width, op):
        """Every lane publishes its value; each then replays the whole butterfly of its group of
        ``width`` lanes (offsets width/2 ... 1) on a copy: the GPU's order, with two barriers."""
        buf = cuda.shared.array(1024, numba.float32)
        tid = _block_tid()
        buf[tid] = x
        cuda.syncthreads()
        base = tid - tid % width
        vals = [buf[base + i] for i in range(width)]
        off = width >> 1
        while off > 0:
            vals = [op(vals[i], vals[i ^ off]) for i in range(width)]
            off >>= 1
        cuda.syncthreads()
        return vals[tid % width]

    @device
    def warp_reduce_sum(x, width):
        return _butterfly(x, width, lambda a, b: a + b)

    @device
    def warp_reduce_max(x, width):
        return _butterfly(x, width, max)

    @device
    def roundf(x):
        """C's roundf: halves away from zero (exact: |x| + 0.5 is exact in float64)."""
        return np.float32(math.copysign(math.floor(abs(float(x)) + 0.5), float(x)))

    @device
    def rsqrtf(x):
        return np.float32(1.0 / math.sqrt(float(x)))

else:
    from numba.cuda import libdevice

    @device
    def warp_reduce_sum(x, width):
        off = width >> 1
        while off > 0:
            x += cuda.shfl_xor_sync(0xFFFFFFFF, x, off)
            off >>= 1
        return x

    @device
    def warp_reduce_max(x, width):
        off = width >> 1
        while off > 0:
            x = max(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, off))
            off >>= 1
        return x

    @device
    def roundf(x):
        return libdevice.roundf(x)

    @device
    def rsqrtf(x):
        return libdevice.rsqrtf(x)


@device
def alibi_slope(h, max_bias, m0, m1, n_head_log2):
    """ALiBi's slope of head ``h`` (1 without ALiBi), from ``ops.soft_max_alibi``'s float32 bases."""
    if max_bias <= F32_ZERO:
        return F32_ONE
    if h < n_head_log2:
        return np.float32(math.pow(m0, np.float32(h + 1)))
    return np.float32(math.pow(m1, np.float32(2 * (h - n_head_log2) + 1)))


def tensor_cores():
    """Does the current GPU have the ``mma.sync`` shapes the kernels use (sm_80+)? Never under the
    simulator, which runs the kernels without them."""
    return not SIM and cuda.get_current_device().compute_capability >= (8, 0)


SIM_MULTIPROCESSORS = 1   # under the simulator: one, so that a test's one-tile product is "too small"


def multiprocessors():
    """How many multiprocessors (SMs) the current GPU has: what a kernel's grid must fill. A driver
    query the first time; numba keeps the answer on its device object."""
    return SIM_MULTIPROCESSORS if SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT


def cdiv(a, b):
    return -(-a // b)


def round_up(a, b):
    return cdiv(a, b) * b


@device
def bf16_to_float(b):
    """A bfloat16 (its 16 bits, read through a uint16 view) as a float32: the top half of its bits."""
    return int_as_float(np.uint32(b) << np.uint32(16))


@device
def float_to_bf16(x):
    """The bits of ``x`` rounded to bfloat16, to nearest even; NaN stays a quiet NaN (GGML's
    ``ggml_compute_fp32_to_bf16``)."""
    u = float_as_int(x)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(64))
    return np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))


@device
def plane(i23, ne2):
    """(i2, i3) of plane ``i23 = i2 + ne2·i3``, for the kernels that walk a tensor as rows: without a
    division when i3 is 0 (nearly always). A 64-bit division costs dozens of instructions, more than
    an element's whole work, and a thread that does one element pays its setup in full."""
    if i23 < ne2:
        return i23, i23 - i23
    return i23 % ne2, i23 // ne2


@device
def wrap(i, n):
    """``i % n`` for the index of a broadcast source (GGML's repeat): without a division when the
    source is as large (``i < n``) or has one element along the dim."""
    if i < n:
        return i
    if n == 1:
        return i - i
    return i % n


@device
def coords(i, ne0, ne1, ne2):
    """The 4-D coordinates (i0, i1, i2, i3) of flat element ``i`` of a contiguous tensor of shape ne."""
    return i % ne0, (i // ne0) % ne1, (i // (ne0 * ne1)) % ne2, i // (ne0 * ne1 * ne2)


@device
def block_reduce_sum(v, part):
    """Sum over the whole (1-D) block: warp butterflies, then one more across the warps' results
    in ``part`` (shared, 32 floats). Every thread of the block must call it; all get the total."""
    v = warp_reduce_sum(v, 32)
    nw = cuda.blockDim.x // 32
    if nw > 1:
        lane = cuda.threadIdx.x % 32
        if lane == 0:
            part[cuda.threadIdx.x // 32] = v
        cuda.syncthreads()
        v = part[lane] if lane < nw else F32_ZERO
        v = warp_reduce_sum(v, 32)
        cuda.syncthreads()      # part may be reused at once by the caller's next reduction
    return v


@device
def block_reduce_max(v, part):
    v = warp_reduce_max(v, 32)
    nw = cuda.blockDim.x // 32
    if nw > 1:
        lane = cuda.threadIdx.x % 32
        if lane == 0:
            part[cuda.threadIdx.x // 32] = v
        cuda.syncthreads()
        v = part[lane] if lane < nw else np.float32(-np.inf)
        v = warp_reduce_max(v, 32)
        cuda.syncthreads()
    return v


def row_block_size(ne0, nrows):
    """Threads per row for the row kernels (norms, soft_max): a warp for short rows (GGML's rule);
    for long ones 256, or 1024 when there are too few rows to fill the GPU. A thread's loads are
    a chain of waits, so a lone row wants as many threads as it can get: a 4096-value row took
    10 µs with 256 threads (16 loads each), and a decode step has 65 of them; with many rows
    (a prompt) 256 is faster. 256 under the simulator, where every thread costs a Python thread."""
    if ne0 < 1024:
        return 32
    return 1024 if nrows < FEW_ROWS and not SIM else 256


FEW_ROWS = 256


def row_grid(nrows):
    """Blocks for the row kernels, which loop over rows ``blockIdx.x, + gridDim.x, ...``: one block
    per row on a GPU; two under the simulator, where every thread costs a Python thread."""
    return max(1, min(nrows, 2 if SIM else 1 << 30))


def jit_kernel(**gpu_options):
    """``cuda.jit`` for a kernel: compiled once per signature into the on-disk cache (lazyggml's
    kernel cache, which ``lazyggml warmup`` fills), with the options the simulator does not take
    (``launch_bounds``) dropped there; keyed by ``_StableClosureCache``."""
    if SIM:
        return cuda.jit
    def jit(fn):
        kernel = cuda.jit(**gpu_options)(fn)
        kernel._cache = _StableClosureCache(kernel.py_func)   # what cache=True would do, our key
        return kernel
    return jit


def _describe(fn):
    """What a function compiles to, the same in every process: its name, bytecode and constants,
    and what it closes over (device functions described in turn, other values by ``repr``)."""
    code = fn.__code__
    consts = tuple(c.co_code if hasattr(c, "co_code") else repr(c) for c in code.co_consts)
    cells = tuple(c.cell_contents for c in fn.__closure__ or ())
    return (fn.__qualname__, code.co_code, consts,
            tuple(_describe(v.py_func) if hasattr(v, "py_func") else
                  getattr(v, "__qualname__", None) or repr(v) for v in cells))


try:
    from numba.cuda.dispatcher import CUDACache
except ImportError:         # the simulator's numba-cuda layout: no disk cache there anyway
    CUDACache = object


class _StableClosureCache(CUDACache):
    """numba-cuda's disk cache with a closure key that is the same in every process.

    numba keys a cached kernel by its bytecode and a pickle of the values it closes over. The
    kernels our factories make close over device functions (a type's ``vec_dot``, mmq's tile
    loader), and their pickle differs from one process to the next, so such a kernel's key never
    comes back. Here the closure hash is replaced by a hash of ``_describe``.

    The key's layout is numba-cuda's and changes between versions (0.30 inserted its version
    before the hashes), so the hash pair is found by its first member, the bytecode's hash, rather
    than by position; a layout without it is an error, not a cache that silently never hits."""

    def _index_key(self, sig, codegen):
        key = super()._index_key(sig, codegen)
        code_hash = hashlib.sha256(self._py_func.__code__.co_code).hexdigest()
        stable = hashlib.sha256(repr(_describe(self._py_func)).encode()).hexdigest()
        new = tuple((code_hash, stable) if isinstance(k, tuple) and len(k) == 2 and k[0] == code_hash else k
                    for k in key)
        if new == key:
            raise RuntimeError(f"numba-cuda's cache key has no (bytecode, closure) hash pair: {key!r}; "
                               "lazyggml.backends.cuda.common._StableClosureCache needs updating")
        return new
