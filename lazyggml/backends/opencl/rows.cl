// GET_ROWS and SET_ROWS: gather and scatter whole rows by index (I32 or I64 indices, is64).
// An index outside [0, rows) of the tensor it indexes touches no memory: GET_ROWS writes a row of
// zeros, SET_ROWS writes nothing. GGML leaves such an index undefined; the CPU raises, but telling
// the host from here would cost a read-back per step, so the kernels only make it harmless, with
// one test per row.

// GET_ROWS: dst[:, i10, i11, i12] = row idx[i10, i11, i12] of src0[:, :, i11, i12], as F32.
// One work-group per dst row (ROW_IDS: i1 = i10, i2 = i11, i3 = i12).
#define DEFINE_GET_ROWS(T, LOAD)                                                                    \
kernel void kernel_get_rows_##T(global const char *src0, tensor_t a, global const char *idx, tensor_t b, \
                                int is64, global char *dst, tensor_t d) {                          \
    ROW_IDS;                                                                                       \
    const long r = read_index(idx, b, i1, i2, i3, is64);                                           \
    if (r < 0 || r >= a.ne[1]) {        /* out of range: a row of zeros */                         \
        for (int i0 = lane; i0 < d.ne[0]; i0 += nl) T_F32(dst, d, i0, i1, i2, i3) = 0.0f;          \
        return;                                                                                    \
    }                                                                                              \
    for (int i0 = lane; i0 < d.ne[0]; i0 += nl) {                                                  \
        global const char *p = T_PTR(src0, a, i0, r, i2, i3);                                      \
        T_F32(dst, d, i0, i1, i2, i3) = LOAD;                                                      \
    }                                                                                              \
}
DEFINE_GET_ROWS(f32, *(global const float *)p)
DEFINE_GET_ROWS(f16, vload_half(0, (global const half *)p))
DEFINE_GET_ROWS(bf16, as_float((uint)*(global const ushort *)p << 16))

// Quantized rows: the lanes take groups of 16 weights (quants.h) and write 16 floats each.
#define DEFINE_GET_ROWS_Q(T)                                                                        \
kernel void kernel_get_rows_##T(global const char *src0, tensor_t a, global const char *idx, tensor_t b, \
                                int is64, global char *dst, tensor_t d) {                          \
    ROW_IDS;                                                                                       \
    const long r = read_index(idx, b, i1, i2, i3, is64);                                           \
    global float *y = (global float *)T_PTR(dst, d, 0, i1, i2, i3);                                \
    if (r < 0 || r >= a.ne[1]) {        /* out of range: a row of zeros */                         \
        for (int g = lane; g < d.ne[0] / 16; g += nl) vstore16((float16)(0.0f), g, y);             \
        return;                                                                                    \
    }                                                                                              \
    global const uchar *x = (global const uchar *)T_PTR(src0, a, 0, r, i2, i3);                    \
    for (int g = lane; g < d.ne[0] / 16; g += nl) {                                                \
        global const uchar *blk = x + (g / GPB_##T) * TS_##T;                                      \
        float s[16];                                                                               \
        block_scales_##T(blk, s);                                                                  \
        vstore16(dequant16_##T(blk, s, g % GPB_##T), g, y);                                        \
    }                                                                                              \
}
DEFINE_GET_ROWS_Q(q8_0)
DEFINE_GET_ROWS_Q(q4_K)
DEFINE_GET_ROWS_Q(q6_K)
DEFINE_GET_ROWS_Q(q4_0)
DEFINE_GET_ROWS_Q(q4_1)
DEFINE_GET_ROWS_Q(q5_0)
DEFINE_GET_ROWS_Q(q5_1)
DEFINE_GET_ROWS_Q(q5_K)
DEFINE_GET_ROWS_Q(q2_K)
DEFINE_GET_ROWS_Q(q3_K)
DEFINE_GET_ROWS_Q(iq4_nl)
DEFINE_GET_ROWS_Q(iq4_xs)

// SET_ROWS: row (i01, i02, i03) of the F32 source b goes to row idx[i01, i02 % ne11, i03 % ne12]
// of dst[:, :, i02, i03] (F32, or F16 rounded to nearest even). One work-group per source row.
#define DEFINE_SET_ROWS(T, STORE)                                                                   \
kernel void kernel_set_rows_##T(global const char *src0, tensor_t b, global const char *idx, tensor_t c, \
                                int is64, global char *dst, tensor_t d) {                          \
    ROW_IDS;                                                                                       \
    const long r = read_index(idx, c, i1, i2 % c.ne[1], i3 % c.ne[2], is64);                       \
    if (r < 0 || r >= d.ne[1]) return;  /* out of range: nothing written */                        \
    for (int i0 = lane; i0 < b.ne[0]; i0 += nl) {                                                  \
        const float v = T_F32(src0, b, i0, i1, i2, i3);                                            \
        global char *q = T_PTR(dst, d, i0, r, i2, i3);                                             \
        STORE;                                                                                     \
    }                                                                                              \
}
DEFINE_SET_ROWS(f32, *(global float *)q = v)
DEFINE_SET_ROWS(f16, vstore_half_rte(v, 0, (global half *)q))
