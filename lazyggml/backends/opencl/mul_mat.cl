// MUL_MAT: dst[i01, i11, i12, i13] = dot(row i01 of src0[., ., i02, i03], row i11 of src1[., ., i12, i13])
// with src0 = the weights (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K),
// src1 = F32 activations, dst = F32, and
// GGML's broadcasting over dims 2 and 3: i02 = i12 / (ne12/ne02), i03 = i13 / (ne13/ne03).
// Rows of src0 and src1 must be contiguous (nb00 = type size, nb10 = 4); everything else is
// strided, so permuted views (attention's K and Q) need no copy.
//
// A CPU device (PoCL) runs the work-items of a work-group one after the other, as a loop, so a
// work-item is a stretch of one core's time and its SIMD lanes are the components of float16
// vectors; values it keeps across a barrier go to memory (one copy per work-item). A GPU runs
// work-items side by side. So each product has two layouts, picked by the host:
// * kernel_mul_mv_<T>_f32_<R>x<NC>  (CPU, ne11 <= MV_MAX_COLS): one work-item computes R rows x
//   NC columns, walking the whole rows: each block is dequantized once into registers and
//   multiplied with the NC columns, R rows sharing each load of the activations.
//   kernel_mul_mv_<T>_f32_lanes  (GPU): `lanes` work-items share a row (every lanes-th block)
//   and add up in local memory.
// * kernel_mul_mm_<T>_f32  (CPU, more columns): GGML's CPU cache blocking. A work-group of one
//   work-item dequantizes a tile of MM_BM rows x MM_KS weights into local memory and reuses it
//   for MM_CB*MM_TC columns, in register tiles of MM_TR rows x MM_TC columns whose sums wait in
//   private memory from one k-step to the next.
//   kernel_mul_mm_<T>_f32_lanes  (GPU): the work-items of a group dequantize the tile together,
//   transposed so that one float16 load gives 16 rows at one k, and each accumulates those rows
//   against MM_NC columns (an outer product per k).
// * kernel_mul_mat_<T>_f32_naive: F32/F16 weights whose rows are not a multiple of 16 long; one
//   work-item per result element, a plain loop (GGML's "_generic" reference idea).
//
// Measured on PoCL (2 cores, m=4096, k=14336, Q4_K): bench/results/opencl.md's notes.

#define MV_MAX_COLS 8
#define MV_ROWS 4         // rows of src0 per work-group of the lanes mat-vec (local size dim 1)
#define MV_MAX_LANES 32   // work-items per row of the mat-vec (local size dim 0), at most
#define MM_BM 32          // rows of src0 per tile
#define MM_KS 256         // weights per row in one tile step (a K-quant super-block)
#define MM_TR 4           // CPU tiled kernel: register tile of MM_TR rows x MM_TC columns,
#define MM_TC 6           //   24 float16 sums of the 32 vector registers of AVX-512
#define MM_CB 10          //   and MM_CB such column blocks per work-item
#define MM_NC 8           // GPU tiled kernel: columns of src1 per work-item

// The batch indices of dst's dims 2-3 and of src0's (broadcast), from a global id.
#define BATCH_IDS(batch)                                                                            \
    const int i12 = (batch) % b.ne[2], i13 = (batch) / b.ne[2];                                     \
    const int i02 = i12 / (b.ne[2] / a.ne[2]), i03 = i13 / (b.ne[3] / a.ne[3])

// -- the mat-vec step: acc[r][c] += (block ib of row x[r]) . (column c's matching 16-float slices) --
// y is column 0 of src1 at element 0, ys the column stride in floats; columns c >= nc are left
// alone (in the CPU kernels nc is NC and the test folds away).
#define DEFINE_MV_STEP(T, R, NC)                                                                    \
static inline void mv_step_##T##_##R##x##NC(global const uchar *const *x, int ib, global const float *y, \
                                            ulong ys, int nc, float16 acc[R][NC]) {                 \
    float s[R][16];                                                                                \
    _Pragma("unroll") for (int r = 0; r < R; r++) block_scales_##T(x[r] + ib * TS_##T, s[r]);       \
    _Pragma("unroll") for (int j = 0; j < GPB_##T; j++) {                                          \
        float16 w[R];                                                                              \
        _Pragma("unroll") for (int r = 0; r < R; r++) w[r] = dequant16_##T(x[r] + ib * TS_##T, s[r], j); \
        _Pragma("unroll") for (int c = 0; c < NC; c++) {                                           \
            if (c < nc) {                                                                          \
                const float16 yv = vload16(0, y + c * ys + ib * QK_##T + 16 * j);                  \
                _Pragma("unroll") for (int r = 0; r < R; r++) acc[r][c] += w[r] * yv;              \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

// -- the mat-vec kernels ---------------------------------------------------------------------------
// CPU: global = (ceil(ne01/R) rounded up to the work-group size, ne12*ne13), local = (16, 1).
// The pragmas matter: PoCL's compiler left these small loops rolled, and the tile went to memory.
#define DEFINE_MUL_MV(T, R, NC)                                                                     \
DEFINE_MV_STEP(T, R, NC)                                                                           \
kernel void kernel_mul_mv_##T##_f32_##R##x##NC(global const char *src0, tensor_t a, global const char *src1, \
                                               tensor_t b, global char *dst, tensor_t d) {          \
    const int r0 = get_global_id(0) * R;                                                           \
    if (r0 >= a.ne[1]) return;                                                                     \
    BATCH_IDS(get_global_id(1));                                                                   \
    global const uchar *x[R];  /* rows past ne01 re-read the last one and are not written */       \
    _Pragma("unroll") for (int r = 0; r < R; r++)                                                   \
        x[r] = (global const uchar *)T_PTR(src0, a, 0, min(r0 + r, a.ne[1] - 1), i02, i03);         \
    global const float *y = (global const float *)T_PTR(src1, b, 0, 0, i12, i13);                  \
    float16 acc[R][NC];                                                                            \
    _Pragma("unroll") for (int r = 0; r < R; r++) _Pragma("unroll") for (int c = 0; c < NC; c++) acc[r][c] = 0.0f; \
    for (int ib = 0; ib < a.ne[0] / QK_##T; ib++) mv_step_##T##_##R##x##NC(x, ib, y, b.nb[1] / 4, b.ne[1], acc); \
    _Pragma("unroll") for (int r = 0; r < R; r++) _Pragma("unroll") for (int c = 0; c < NC; c++)  \
        if (r0 + r < a.ne[1] && c < b.ne[1]) T_F32(dst, d, r0 + r, c, i12, i13) = hsum16(acc[r][c]); \
}

// GPU: `lanes` work-items per row take every lanes-th block and add up in local memory.
// global = (lanes, ceil(ne01/MV_ROWS)*MV_ROWS, ne12*ne13), local = (lanes, MV_ROWS, 1).
// (PoCL 3 miscomputes this kernel when lanes = 1: the CPU layout is the kernel above.)
#define DEFINE_MUL_MV_LANES(T)                                                                      \
DEFINE_MV_STEP(T, 1, MV_MAX_COLS)                                                                  \
kernel void kernel_mul_mv_##T##_f32_lanes(global const char *src0, tensor_t a, global const char *src1, \
                                          tensor_t b, global char *dst, tensor_t d) {               \
    local float red[MV_ROWS * MV_MAX_COLS * MV_MAX_LANES];                                          \
    const int lane = get_local_id(0), nl = get_local_size(0), lr = get_local_id(1);                \
    const int i01 = get_global_id(1), ncols = b.ne[1];                                             \
    BATCH_IDS(get_global_id(2));                                                                   \
    /* padding rows (i01 >= ne01) redo the last row, so that all reach the barrier the same way */ \
    global const uchar *x[1] = {(global const uchar *)T_PTR(src0, a, 0, min(i01, a.ne[1] - 1), i02, i03)}; \
    global const float *y = (global const float *)T_PTR(src1, b, 0, 0, i12, i13);                 \
    float16 acc[1][MV_MAX_COLS];                                                                   \
    for (int c = 0; c < MV_MAX_COLS; c++) acc[0][c] = 0.0f;                                        \
    for (int ib = lane; ib < a.ne[0] / QK_##T; ib += nl)                                           \
        mv_step_##T##_1x##MV_MAX_COLS(x, ib, y, b.nb[1] / 4, ncols, acc);                          \
    local float *r = red + lr * MV_MAX_COLS * MV_MAX_LANES;                                        \
    for (int c = 0; c < ncols; c++) r[c * MV_MAX_LANES + lane] = hsum16(acc[0][c]);                \
    barrier(CLK_LOCAL_MEM_FENCE);                                                                  \
    for (int c = lane; i01 < a.ne[1] && c < ncols; c += nl) {  /* lane l adds up columns l, l+nl.. */ \
        float s = 0.0f;                                                                            \
        for (int l = 0; l < nl; l++) s += r[c * MV_MAX_LANES + l];                                 \
        T_F32(dst, d, i01, c, i12, i13) = s;                                                       \
    }                                                                                              \
}

// -- the tiled kernels -----------------------------------------------------------------------------
// CPU: global = (ceil(ne01/MM_BM), ceil(ne11/(MM_CB*MM_TC)), ne12*ne13), local = (1, 1, 1).
// Per k-step a work-item reads MM_BM*MM_KS weights (32 KB as floats, in the L1 cache) and
// MM_CB*MM_TC columns of MM_KS activations, and does MM_BM*MM_KS*MM_CB*MM_TC multiply-adds.
#define DEFINE_MUL_MM(T)                                                                            \
kernel void kernel_mul_mm_##T##_f32(global const char *src0, tensor_t a, global const char *src1,   \
                                    tensor_t b, global char *dst, tensor_t d) {                     \
    local float tile[MM_BM * MM_KS];  /* tile[r*MM_KS + k]: weight k0+k of row r0+r */             \
    float16 sums[MM_BM / MM_TR][MM_CB][MM_TR][MM_TC];                                              \
    const int r0 = get_group_id(0) * MM_BM, c0 = get_group_id(1) * MM_CB * MM_TC;                  \
    const int ncb = min(MM_CB, (b.ne[1] - c0 + MM_TC - 1) / MM_TC);  /* column blocks with columns */ \
    BATCH_IDS(get_global_id(2));                                                                   \
    for (int rb = 0; rb < MM_BM / MM_TR; rb++) for (int cb = 0; cb < ncb; cb++)                     \
        _Pragma("unroll") for (int r = 0; r < MM_TR; r++)                                           \
            _Pragma("unroll") for (int c = 0; c < MM_TC; c++) sums[rb][cb][r][c] = 0.0f;           \
    for (int k0 = 0; k0 < a.ne[0]; k0 += MM_KS) {                                                  \
        const int kn = min(MM_KS, a.ne[0] - k0);                                                   \
        for (int r = 0; r < MM_BM; r++) {  /* rows past ne01 re-read the last one */               \
            global const uchar *x = (global const uchar *)T_PTR(src0, a, 0, min(r0 + r, a.ne[1] - 1), i02, i03); \
            for (int e = 0; e < kn; e += QK_##T) {                                                 \
                global const uchar *blk = x + (k0 + e) / QK_##T * TS_##T;                          \
                float s[16];                                                                       \
                block_scales_##T(blk, s);                                                          \
                _Pragma("unroll") for (int j = 0; j < GPB_##T; j++)                                 \
                    vstore16(dequant16_##T(blk, s, j), e / 16 + j, tile + r * MM_KS);              \
            }                                                                                      \
        }                                                                                          \
        for (int cb = 0; cb < ncb; cb++) {  /* columns past ne11 re-read the last one */           \
            global const float *y[MM_TC];                                                          \
            _Pragma("unroll") for (int c = 0; c < MM_TC; c++)                                       \
                y[c] = (global const float *)T_PTR(src1, b, k0, min(c0 + cb * MM_TC + c, b.ne[1] - 1), i12, i13); \
            for (int rb = 0; rb < MM_BM / MM_TR; rb++) {                                           \
                float16 acc[MM_TR][MM_TC];                                                         \
                _Pragma("unroll") for (int r = 0; r < MM_TR; r++)                                   \
                    _Pragma("unroll") for (int c = 0; c < MM_TC; c++) acc[r][c] = sums[rb][cb][r][c]; \
                for (int kk = 0; kk < kn / 16; kk++) {                                             \
                    float16 w[MM_TR];                                                              \
                    _Pragma("unroll") for (int r = 0; r < MM_TR; r++) w[r] = vload16(kk, tile + (rb * MM_TR + r) * MM_KS); \
                    _Pragma("unroll") for (int c = 0; c < MM_TC; c++) {                             \
                        const float16 yv = vload16(kk, y[c]);                                      \
                        _Pragma("unroll") for (int r = 0; r < MM_TR; r++) acc[r][c] += w[r] * yv;  \
                    }                                                                              \
                }                                                                                  \
                _Pragma("unroll") for (int r = 0; r < MM_TR; r++)                                   \
                    _Pragma("unroll") for (int c = 0; c < MM_TC; c++) sums[rb][cb][r][c] = acc[r][c]; \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int rb = 0; rb < MM_BM / MM_TR; rb++) for (int cb = 0; cb < ncb; cb++)                     \
        for (int r = 0; r < MM_TR; r++) for (int c = 0; c < MM_TC; c++) {                          \
            const int i01 = r0 + rb * MM_TR + r, i11 = c0 + cb * MM_TC + c;                        \
            if (i01 < a.ne[1] && i11 < b.ne[1]) T_F32(dst, d, i01, i11, i12, i13) = hsum16(sums[rb][cb][r][c]); \
        }                                                                                          \
}

// GPU: global = (ceil(ne01/MM_BM)*nw, ceil(ne11/(MM_NC*nw)), ne12*ne13), local = (nw, 1, 1).
// Row tiles run along dim 0, so work-groups that run one after the other share their columns
// and differ in their weights.
#define DEFINE_MUL_MM_LANES(T)                                                                      \
kernel void kernel_mul_mm_##T##_f32_lanes(global const char *src0, tensor_t a, global const char *src1, \
                                          tensor_t b, global char *dst, tensor_t d) {               \
    local float tile[MM_KS * MM_BM];  /* tile[k*MM_BM + r]: weight k of tile row r */              \
    const int lane = get_local_id(0), nw = get_local_size(0);                                      \
    const int r0 = get_group_id(0) * MM_BM;                                                        \
    const int c0 = (get_group_id(1) * nw + lane) * MM_NC;                                          \
    BATCH_IDS(get_global_id(2));                                                                   \
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
                global const uchar *blk = (global const uchar *)(x0 + min(r0 + r, a.ne[1] - 1) * a.nb[1]) \
                                          + (g / GPB_##T) * TS_##T;                                \
                float s[16];                                                                       \
                block_scales_##T(blk, s);                                                          \
                w = dequant16_##T(blk, s, g % GPB_##T);                                            \
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

// The CPU mat-vec tiles (R rows x NC columns) by column count; ops.py's MV_TILES
// lists the same.
#define DEFINE_MUL_MAT(T)                                                                           \
DEFINE_MUL_MV(T, 2, 1)                                                                             \
DEFINE_MUL_MV(T, 2, 2)                                                                             \
DEFINE_MUL_MV(T, 2, 4)                                                                             \
DEFINE_MUL_MV(T, 2, 8)                                                                             \
DEFINE_MUL_MV_LANES(T)                                                                             \
DEFINE_MUL_MM(T)                                                                                   \
DEFINE_MUL_MM_LANES(T)
DEFINE_MUL_MAT(f32)
DEFINE_MUL_MAT(f16)
DEFINE_MUL_MAT(bf16)
DEFINE_MUL_MAT(q8_0)
DEFINE_MUL_MAT(q4_K)
DEFINE_MUL_MAT(q6_K)
DEFINE_MUL_MAT(q4_0)
DEFINE_MUL_MAT(q4_1)
DEFINE_MUL_MAT(q5_0)
DEFINE_MUL_MAT(q5_1)
DEFINE_MUL_MAT(q5_K)
DEFINE_MUL_MAT(q2_K)
DEFINE_MUL_MAT(q3_K)
DEFINE_MUL_MAT(iq4_nl)
DEFINE_MUL_MAT(iq4_xs)

// -- F32/F16/BF16 weights with rows that are not a multiple of 16 -------------------------------------
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
DEFINE_MUL_MAT_NAIVE(bf16, as_float((uint)((global const ushort *)x)[k] << 16))
