// MUL_MAT: dst[i01, i11, i12, i13] = dot(row i01 of src0[., ., i02, i03], row i11 of src1[., ., i12, i13])
// with src0 = the weights (F32, F16, Q8_0, Q4_K, Q6_K), src1 = F32 activations, dst = F32, and
// GGML's broadcasting over dims 2 and 3: i02 = i12 / (ne12/ne02), i03 = i13 / (ne13/ne03).
// Rows of src0 and src1 must be contiguous (nb00 = type size, nb10 = 4); everything else is
// strided, so permuted views (attention's K and Q) need no copy.
//
// Three kernels, picked by the host:
// * kernel_mul_mv_<T>_f32  (ne11 <= MV_MAX_COLS): the weights are read once, dequantized on the
//   fly, and each block is dotted with every column. One work-item walks a whole row of blocks;
//   kernel_mul_mv_<T>_f32_lanes lets `lanes` work-items share a row (every lanes-th block) and
//   add up in local memory, for GPUs. The SIMD lanes are the components of float16 vectors
//   inside a work-item: on a CPU device (PoCL) that beat GGML's "8 work-items per super-block"
//   layout about ten times, because PoCL runs the work-items of a group one after the other.
// * kernel_mul_mm_<T>_f32  (more columns): a work-group dequantizes a tile of MM_BM rows x MM_KS
//   weights into local memory, transposed so that one float16 load gives 16 rows at one k, and
//   each work-item accumulates those rows against MM_NC columns (an outer product per k).
// * kernel_mul_mat_<T>_f32_naive: F32/F16 weights whose rows are not a multiple of 16 long; one
//   work-item per result element, a plain loop (GGML's "_generic" reference idea).

#define MV_MAX_COLS 8
#define MV_ROWS 4         // rows of src0 per work-group of the lanes mat-vec (local size dim 1)
#define MV_MAX_LANES 32   // work-items per row of the mat-vec (local size dim 0), at most
#define MM_BM 32          // rows of src0 per tile: two float16 vectors
#define MM_NC 8           // columns of src1 per work-item
#define MM_KS 256         // weights per row in one tile step (a K-quant super-block)

// -- mat-vec blocks: acc[c] += (dequantized block) * (column c's matching 16-float slices) -----------
// y points at the block's first activation in column 0; ys is the column stride in floats.
#define DEFINE_MV_BLOCK(T)                                                                          \
static inline void mv_block_##T(global const uchar *blk, global const float *y, ulong ys, int ncols, \
                                float16 *acc) {                                                    \
    _Pragma("unroll")                                                                                \
    for (int j = 0; j < GPB_##T; j++) {                                                            \
        const float16 w = dequant16_##T(blk, j);                                                   \
        for (int c = 0; c < ncols; c++) acc[c] += w * vload16(j, y + c * ys);                      \
    }                                                                                              \
}
DEFINE_MV_BLOCK(f32)
DEFINE_MV_BLOCK(f16)
DEFINE_MV_BLOCK(q8_0)
DEFINE_MV_BLOCK(q6_K)

// Q4_K gets its own: the 8 scales and mins of a super-block are unpacked at once with the bulk
// 32-bit form of get_scale_min_k4 (spec §2), instead of once per group of 16 as dequant16_q4_K
// does. Measured on PoCL: about half the time of the generic block above.
static inline void mv_block_q4_K(global const uchar *blk, global const float *y, ulong ys, int ncols,
                                 float16 *acc) {
    const float d = vload_half(0, (global const half *)blk), dmin = vload_half(1, (global const half *)blk);
    const uint u0 = as_uint(vload4(0, blk + 4)), u1 = as_uint(vload4(0, blk + 8)), u2 = as_uint(vload4(0, blk + 12));
    const uint sc_lo = u0 & 0x3f3f3f3f, sc_hi = (u2 & 0x0f0f0f0f) | (((u0 >> 6) & 0x03030303) << 4);
    const uint m_lo = u1 & 0x3f3f3f3f, m_hi = ((u2 >> 4) & 0x0f0f0f0f) | (((u1 >> 6) & 0x03030303) << 4);
    float sc[8], mn[8];  // d*sc and dmin*m of the 8 sub-blocks
    vstore8(d * convert_float8((uchar8)(as_uchar4(sc_lo), as_uchar4(sc_hi))), 0, sc);
    vstore8(dmin * convert_float8((uchar8)(as_uchar4(m_lo), as_uchar4(m_hi))), 0, mn);
    global const uchar *qs = blk + 16;
    _Pragma("unroll")
    for (int ch = 0; ch < 4; ch++) {  // chunk ch: sub-blocks 2ch (low nibbles) and 2ch+1 (high)
        const uchar16 qa = vload16(0, qs + 32 * ch), qb = vload16(0, qs + 32 * ch + 16);
        // the 64 weights of the chunk, dequantized once for all the columns
        const float16 w0 = sc[2 * ch] * convert_float16(qa & (uchar)0xF) - mn[2 * ch];
        const float16 w1 = sc[2 * ch] * convert_float16(qb & (uchar)0xF) - mn[2 * ch];
        const float16 w2 = sc[2 * ch + 1] * convert_float16(qa >> (uchar)4) - mn[2 * ch + 1];
        const float16 w3 = sc[2 * ch + 1] * convert_float16(qb >> (uchar)4) - mn[2 * ch + 1];
        for (int c = 0; c < ncols; c++) {
            global const float *yc = y + c * ys + 64 * ch;
            acc[c] += w0 * vload16(0, yc) + w1 * vload16(1, yc) + w2 * vload16(2, yc) + w3 * vload16(3, yc);
        }
    }
}

// -- the mat-vec kernels ---------------------------------------------------------------------------
// MV_PROLOGUE: the batch indices (broadcasting src0 over dims 2 and 3), src0's row, src1's first column.
#define MV_PROLOGUE(i01, batch)                                                                     \
    const int i12 = (batch) % b.ne[2], i13 = (batch) / b.ne[2];                                     \
    const int i02 = i12 / (b.ne[2] / a.ne[2]), i03 = i13 / (b.ne[3] / a.ne[3]);                     \
    const int ncols = b.ne[1];                                                                      \
    global const uchar *x = (global const uchar *)T_PTR(src0, a, 0, i01, i02, i03);                \
    global const float *y = (global const float *)T_PTR(src1, b, 0, 0, i12, i13);                  \
    const ulong ys = b.nb[1] / 4;                                                                   \
    float16 acc[MV_MAX_COLS];                                                                       \
    for (int c = 0; c < MV_MAX_COLS; c++) acc[c] = 0.0f

// One work-item per row of src0, all of its blocks, no local memory: the CPU layout.
// global = (ne01 rounded up to the work-group size, ne12*ne13), local = (16, 1) on PoCL: 16 rows per
// group measured 15-20% faster than 4 (m=4096, k=14336, 2 cores).
#define DEFINE_MUL_MV(T)                                                                            \
kernel void kernel_mul_mv_##T##_f32(global const char *src0, tensor_t a, global const char *src1,   \
                                    tensor_t b, global char *dst, tensor_t d) {                     \
    const int i01 = get_global_id(0);                                                              \
    if (i01 >= a.ne[1]) return;                                                                    \
    MV_PROLOGUE(i01, get_global_id(1));                                                            \
    for (int ib = 0; ib < a.ne[0] / QK_##T; ib++)                                                  \
        mv_block_##T(x + ib * TS_##T, y + ib * QK_##T, ys, ncols, acc);                           \
    for (int c = 0; c < ncols; c++) T_F32(dst, d, i01, c, i12, i13) = hsum16(acc[c]);              \
}                                                                                                  \
/* `lanes` work-items per row take every lanes-th block and add up in local memory: the GPU      \
   layout. global = (lanes, ceil(ne01/MV_ROWS)*MV_ROWS, ne12*ne13), local = (lanes, MV_ROWS, 1).   \
   (PoCL 3 miscomputes this kernel when lanes = 1, hence the separate kernel above.) */           \
kernel void kernel_mul_mv_##T##_f32_lanes(global const char *src0, tensor_t a, global const char *src1, \
                                          tensor_t b, global char *dst, tensor_t d) {               \
    local float red[MV_ROWS * MV_MAX_COLS * MV_MAX_LANES];                                          \
    const int lane = get_local_id(0), nl = get_local_size(0), lr = get_local_id(1);                \
    const int i01 = get_global_id(1);                                                              \
    /* padding rows (i01 >= ne01) redo the last row, so that all reach the barrier the same way */ \
    MV_PROLOGUE(min(i01, a.ne[1] - 1), get_global_id(2));                                          \
    for (int ib = lane; ib < a.ne[0] / QK_##T; ib += nl)                                           \
        mv_block_##T(x + ib * TS_##T, y + ib * QK_##T, ys, ncols, acc);                           \
    local float *r = red + lr * MV_MAX_COLS * MV_MAX_LANES;                                        \
    for (int c = 0; c < ncols; c++) r[c * MV_MAX_LANES + lane] = hsum16(acc[c]);                   \
    barrier(CLK_LOCAL_MEM_FENCE);                                                                  \
    for (int c = lane; i01 < a.ne[1] && c < ncols; c += nl) {  /* lane l adds up columns l, l+nl.. */ \
        float s = 0.0f;                                                                            \
        for (int l = 0; l < nl; l++) s += r[c * MV_MAX_LANES + l];                                 \
        T_F32(dst, d, i01, c, i12, i13) = s;                                                       \
    }                                                                                              \
}

// -- the tiled kernel ------------------------------------------------------------------------------
// global = (ceil(ne01/MM_BM)*nw, ceil(ne11/(MM_NC*nw)), ne12*ne13), local = (nw, 1, 1).
// Row tiles run along dim 0, so work-groups that run one after the other share their columns
// (which then stay in the CPU's caches) and differ in their weights.
#define DEFINE_MUL_MM(T)                                                                            \
kernel void kernel_mul_mm_##T##_f32(global const char *src0, tensor_t a, global const char *src1,   \
                                    tensor_t b, global char *dst, tensor_t d) {                     \
    local float tile[MM_KS * MM_BM];  /* tile[k*MM_BM + r]: weight k of tile row r */              \
    const int lane = get_local_id(0), nw = get_local_size(0);                                      \
    const int r0 = get_group_id(0) * MM_BM;                                                        \
    const int c0 = (get_group_id(1) * nw + lane) * MM_NC;                                          \
    const int i12 = get_global_id(2) % b.ne[2], i13 = get_global_id(2) / b.ne[2];                 \
    const int i02 = i12 / (b.ne[2] / a.ne[2]), i03 = i13 / (b.ne[3] / a.ne[3]);                    \
    const int ngroups = a.ne[0] / 16;                                                              \
    global const char *x0 = T_PTR(src0, a, 0, 0, i02, i03);                                        \
    global const float *y[MM_NC];  /* columns past ne11 re-read the last one and are not written */ \
    for (int c = 0; c < MM_NC; c++)                                                                \
        y[c] = (global const float *)T_PTR(src1, b, 0, min(c0 + c, b.ne[1] - 1), i12, i13);        \
    float16 acc0[MM_NC], acc1[MM_NC];  /* rows r0..r0+15 and r0+16..r0+31 */                       \
    for (int c = 0; c < MM_NC; c++) acc0[c] = acc1[c] = 0.0f;                                      \
    for (int k0 = 0; k0 < a.ne[0]; k0 += MM_KS) {                                                  \
        /* dequantize: MM_BM rows x 16 groups of 16 weights, stored transposed */                  \
        for (int p = lane; p < MM_BM * (MM_KS / 16); p += nw) {                                    \
            const int r = p % MM_BM, jg = p / MM_BM, g = k0 / 16 + jg;                             \
            float16 w = 0.0f;                                                                      \
            if (g < ngroups) {                                                                     \
                global const uchar *x = (global const uchar *)(x0 + min(r0 + r, a.ne[1] - 1) * a.nb[1]); \
                w = dequant16_##T(x + (g / GPB_##T) * TS_##T, g % GPB_##T);                        \
            }                                                                                      \
            local float *t = tile + 16 * jg * MM_BM + r;                                           \
            t[0 * MM_BM] = w.s0;  t[1 * MM_BM] = w.s1;  t[2 * MM_BM] = w.s2;  t[3 * MM_BM] = w.s3;    \
            t[4 * MM_BM] = w.s4;  t[5 * MM_BM] = w.s5;  t[6 * MM_BM] = w.s6;  t[7 * MM_BM] = w.s7;    \
            t[8 * MM_BM] = w.s8;  t[9 * MM_BM] = w.s9;  t[10 * MM_BM] = w.sa; t[11 * MM_BM] = w.sb;   \
            t[12 * MM_BM] = w.sc; t[13 * MM_BM] = w.sd; t[14 * MM_BM] = w.se; t[15 * MM_BM] = w.sf;   \
        }                                                                                          \
        barrier(CLK_LOCAL_MEM_FENCE);                                                              \
        const int kn = min(MM_KS, a.ne[0] - k0);                                                   \
        for (int kk = 0; kk < kn; kk++) {                                                          \
            const float16 w0 = vload16(0, tile + kk * MM_BM), w1 = vload16(0, tile + kk * MM_BM + 16); \
            for (int c = 0; c < MM_NC; c++) {                                                      \
                const float yv = y[c][k0 + kk];                                                    \
                acc0[c] += w0 * yv;                                                                \
                acc1[c] += w1 * yv;                                                                \
            }                                                                                      \
        }                                                                                          \
        barrier(CLK_LOCAL_MEM_FENCE);                                                              \
    }                                                                                              \
    for (int c = 0; c < MM_NC && c0 + c < b.ne[1]; c++) {                                          \
        float rows[MM_BM];                                                                         \
        vstore16(acc0[c], 0, rows);                                                                \
        vstore16(acc1[c], 1, rows);                                                                \
        for (int r = 0; r < MM_BM && r0 + r < a.ne[1]; r++) T_F32(dst, d, r0 + r, c0 + c, i12, i13) = rows[r]; \
    }                                                                                              \
}

DEFINE_MUL_MV(f32)
DEFINE_MUL_MV(f16)
DEFINE_MUL_MV(q8_0)
DEFINE_MUL_MV(q4_K)
DEFINE_MUL_MV(q6_K)
DEFINE_MUL_MM(f32)
DEFINE_MUL_MM(f16)
DEFINE_MUL_MM(q8_0)
DEFINE_MUL_MM(q4_K)
DEFINE_MUL_MM(q6_K)

// -- F32/F16 weights with rows that are not a multiple of 16 -------------------------------------
// global = (ne01, ne11, ne12*ne13), local chosen by the implementation
#define DEFINE_MUL_MAT_NAIVE(T, LOAD)                                                               \
kernel void kernel_mul_mat_##T##_f32_naive(global const char *src0, tensor_t a, global const char *src1, \
                                           tensor_t b, global char *dst, tensor_t d) {              \
    const int i01 = get_global_id(0), i11 = get_global_id(1);                                      \
    const int i12 = get_global_id(2) % b.ne[2], i13 = get_global_id(2) / b.ne[2];                  \
    const int i02 = i12 / (b.ne[2] / a.ne[2]), i03 = i13 / (b.ne[3] / a.ne[3]);                    \
    global const char *x = T_PTR(src0, a, 0, i01, i02, i03);                                       \
    global const float *y = (global const float *)T_PTR(src1, b, 0, i11, i12, i13);                \
    float s = 0.0f;                                                                                \
    for (int k = 0; k < a.ne[0]; k++) s += LOAD * y[k];                                            \
    T_F32(dst, d, i01, i11, i12, i13) = s;                                                         \
}
DEFINE_MUL_MAT_NAIVE(f32, ((global const float *)x)[k])
DEFINE_MUL_MAT_NAIVE(f16, vload_half(k, (global const half *)x))
