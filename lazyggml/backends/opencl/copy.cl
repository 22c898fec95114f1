// Data movement: CPY/DUP/CONT (F32 <-> F16), CONCAT, PAD and REPEAT (any 2- or 4-byte type).

// CPY, DUP, CONT: element n of src0 in row-major order (i0 fastest) goes to element n of dst in
// row-major order, whatever the two shapes and strides are (GGML's dup semantics; the element
// counts match). One work-group per src0 row. F16 is written rounded to nearest even.
#define DEFINE_CPY(NAME, LOAD, STORE)                                                               \
kernel void kernel_cpy_##NAME(global const char *src0, tensor_t a, global char *dst, tensor_t d) {  \
    ROW_IDS;                                                                                       \
    const long first = (((long)i3 * a.ne[2] + i2) * a.ne[1] + i1) * a.ne[0];                       \
    for (int i0 = lane; i0 < a.ne[0]; i0 += nl) {                                                  \
        long n = first + i0;                                                                       \
        const int j0 = n % d.ne[0]; n /= d.ne[0];                                                  \
        const int j1 = n % d.ne[1]; n /= d.ne[1];                                                  \
        const int j2 = n % d.ne[2], j3 = n / d.ne[2];                                              \
        global const char *p = T_PTR(src0, a, i0, i1, i2, i3);                                     \
        global char *q = T_PTR(dst, d, j0, j1, j2, j3);                                            \
        STORE(LOAD);                                                                               \
    }                                                                                              \
}
#define LOAD_F32 (*(global const float *)p)
#define LOAD_F16 vload_half(0, (global const half *)p)
#define STORE_F32(v) (*(global float *)q = (v))
#define STORE_F16(v) vstore_half_rte((v), 0, (global half *)q)
DEFINE_CPY(f32_f32, LOAD_F32, STORE_F32)
DEFINE_CPY(f32_f16, LOAD_F32, STORE_F16)
DEFINE_CPY(f16_f32, LOAD_F16, STORE_F32)
DEFINE_CPY(f16_f16, LOAD_F16, STORE_F16)

// CONCAT, PAD and REPEAT move whole elements, so they are written once per element size: _4 for
// F32/I32, _2 for F16/BF16 (the bits are copied; PAD's zero is all-zero bits in every type).
#define ELEM(base, t, i0, i1, i2, i3) (*(global E *)T_PTR(base, t, i0, i1, i2, i3))
#define DEFINE_MOVES(SZ, E_TYPE)                                                                    \
/* CONCAT along dim: dst is src0 followed by src1 along that dim. One work-group per dst row. */     \
kernel void kernel_concat_##SZ(global const char *src0, tensor_t a, global const char *src1, tensor_t b, \
                               global char *dst, tensor_t d, int dim) {                            \
    typedef E_TYPE E;                                                                              \
    ROW_IDS;                                                                                       \
    for (int i0 = lane; i0 < d.ne[0]; i0 += nl) {                                                  \
        int i[4] = {i0, i1, i2, i3};                                                               \
        E v;                                                                                       \
        if (i[dim] < a.ne[dim]) {                                                                  \
            v = ELEM(src0, a, i[0], i[1], i[2], i[3]);                                             \
        } else {                                                                                   \
            i[dim] -= a.ne[dim];                                                                   \
            v = ELEM(src1, b, i[0], i[1], i[2], i[3]);                                             \
        }                                                                                          \
        ELEM(dst, d, i0, i1, i2, i3) = v;                                                          \
    }                                                                                              \
}                                                                                                  \
/* PAD: src0 placed at (lp0, lp1, lp2, lp3) inside a zero dst. One work-group per dst row. */      \
kernel void kernel_pad_##SZ(global const char *src0, tensor_t a, global char *dst, tensor_t d,     \
                            int lp0, int lp1, int lp2, int lp3) {                                  \
    typedef E_TYPE E;                                                                              \
    ROW_IDS;                                                                                       \
    const int j1 = i1 - lp1, j2 = i2 - lp2, j3 = i3 - lp3;                                         \
    const bool row_in = j1 >= 0 && j1 < a.ne[1] && j2 >= 0 && j2 < a.ne[2] && j3 >= 0 && j3 < a.ne[3]; \
    for (int i0 = lane; i0 < d.ne[0]; i0 += nl) {                                                  \
        const int j0 = i0 - lp0;                                                                   \
        ELEM(dst, d, i0, i1, i2, i3) = row_in && j0 >= 0 && j0 < a.ne[0] ? ELEM(src0, a, j0, j1, j2, j3) : 0; \
    }                                                                                              \
}                                                                                                  \
/* REPEAT: dst tiled with copies of src0. One work-group per dst row. */                           \
kernel void kernel_repeat_##SZ(global const char *src0, tensor_t a, global char *dst, tensor_t d) { \
    typedef E_TYPE E;                                                                              \
    ROW_IDS;                                                                                       \
    for (int i0 = lane; i0 < d.ne[0]; i0 += nl)                                                    \
        ELEM(dst, d, i0, i1, i2, i3) = ELEM(src0, a, i0 % a.ne[0], i1 % a.ne[1], i2 % a.ne[2], i3 % a.ne[3]); \
}
DEFINE_MOVES(4, uint)
DEFINE_MOVES(2, ushort)
