// Definitions shared by every lazyggml OpenCL kernel (the files are concatenated into one program,
// headers first, this one before quants.h; see program.py).
//
// OpenCL C 1.2, no extensions: halves are read with vload_half/vload_halfN and written with
// vstore_half_rte (round to nearest even, as GGML's fp32->fp16), so cl_khr_fp16 is not needed.
//
// The op codes used below (OP_ADD, EW_SILU, GLU_SWIGLU...) are not written here: the host passes
// them as -D build options generated from lazyggml's Python enums, so the two can't drift apart.

// A tensor as a kernel sees it: the cl buffer comes as a separate `global char *` argument and
// this struct (passed by value) says where the tensor lives inside it and how it is laid out.
// A sub-buffer per tensor would need offsets aligned to CL_DEVICE_MEM_BASE_ADDR_ALIGN; a byte
// offset in the kernel does not. Views (permuted, transposed, strided) are just other ne/nb.
typedef struct {
    ulong off;     // byte offset of element [0,0,0,0] inside the buffer
    int   ne[4];   // GGML's ne: elements along each dim, ne[0] innermost
    ulong nb[4];   // GGML's nb: bytes between neighbours along each dim
} tensor_t;

// Byte address of element (i0, i1, i2, i3) of tensor t stored in buffer `base`.
#define T_PTR(base, t, i0, i1, i2, i3) ((base) + (t).off + (ulong)(i0) * (t).nb[0] + (ulong)(i1) * (t).nb[1] \
                                        + (ulong)(i2) * (t).nb[2] + (ulong)(i3) * (t).nb[3])
#define T_F32(base, t, i0, i1, i2, i3) (*(global float *)T_PTR(base, t, i0, i1, i2, i3))

// Most kernels give one work-group to one row (i1, i2, i3) of their output: the host launches
// global = (lanes * ne1, ne2, ne3), local = (lanes, 1, 1), and the lanes stride along ne0.
#define ROW_IDS int i1 = get_group_id(0), i2 = get_global_id(1), i3 = get_global_id(2); \
                int lane = get_local_id(0), nl = get_local_size(0)

// Largest work-group along dim 0 that the row kernels are launched with (the size of their
// local scratch arrays); the host never asks for more.
#define MAX_LANES 256

// Sum of v over the work-group's lanes (dim 0); every lane gets the result. `scratch` holds one
// float per lane; the lane count must be a power of two.
static inline float wg_sum(float v, local float *scratch) {
    const int lane = get_local_id(0);
    scratch[lane] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = get_local_size(0) / 2; s > 0; s >>= 1) {
        if (lane < s) scratch[lane] += scratch[lane + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);  // scratch may be reused right away
    return r;
}

static inline float wg_max(float v, local float *scratch) {
    const int lane = get_local_id(0);
    scratch[lane] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = get_local_size(0) / 2; s > 0; s >>= 1) {
        if (lane < s) scratch[lane] = fmax(scratch[lane], scratch[lane + s]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

// Horizontal sum of a float16 (a work-item's vector accumulator).
static inline float hsum16(float16 v) {
    const float8 a = v.lo + v.hi;
    const float4 b = a.lo + a.hi;
    return (b.x + b.y) + (b.z + b.w);
}

// An index tensor's element (I32 or I64, GGML's two index types) as a long.
static inline long read_index(global const char *base, tensor_t t, int i0, int i1, int i2, int is64) {
    global const char *p = T_PTR(base, t, i0, i1, i2, 0);
    return is64 ? *(global const long *)p : (long)*(global const int *)p;
}
