// Row reductions on F32: SUM_ROWS and MEAN, ARGMAX, NORM, RMS_NORM, SOFT_MAX, and SUM (the whole
// tensor). One work-group per row of src0 (ROW_IDS); the lanes stride along the row and meet in
// local memory (wg_sum / wg_max). GGML's CPU kernels add in double; float sums of partial sums
// in a tree stay far inside the 1e-7 NMSE the tests allow.

// dst[0, i1, i2, i3] = sum (or mean) of row (i1, i2, i3)
kernel void kernel_sum_rows(global const char *src0, tensor_t a, global char *dst, tensor_t d, int mean) {
    local float scratch[MAX_LANES];
    ROW_IDS;
    float s = 0.0f;
    for (int i0 = lane; i0 < a.ne[0]; i0 += nl) s += T_F32(src0, a, i0, i1, i2, i3);
    s = wg_sum(s, scratch);
    if (lane == 0) T_F32(dst, d, 0, i1, i2, i3) = mean ? s / a.ne[0] : s;
}

// dst[0] = sum of every element; one work-group walks the tensor in flat element order
kernel void kernel_sum(global const char *src0, tensor_t a, global char *dst, tensor_t d) {
    local float scratch[MAX_LANES];
    const int lane = get_local_id(0), nl = get_local_size(0);
    const long n = (long)a.ne[0] * a.ne[1] * a.ne[2] * a.ne[3];
    float s = 0.0f;
    for (long i = lane; i < n; i += nl) {
        const int i0 = i % a.ne[0], i1 = (i / a.ne[0]) % a.ne[1];
        const int i2 = (i / ((long)a.ne[0] * a.ne[1])) % a.ne[2], i3 = i / ((long)a.ne[0] * a.ne[1] * a.ne[2]);
        s += T_F32(src0, a, i0, i1, i2, i3);
    }
    s = wg_sum(s, scratch);
    if (lane == 0) T_F32(dst, d, 0, 0, 0, 0) = s;
}

// dst[i1] = index of the maximum of row i1 (I32); of equal maxima the LAST, as GGML's CPU loop
// (max = MAX(max, x); if (max == x) idx = i) returns
kernel void kernel_argmax(global const char *src0, tensor_t a, global char *dst, tensor_t d) {
    local float best[MAX_LANES];
    local int where[MAX_LANES];
    ROW_IDS;
    float m = -INFINITY;
    int im = 0;
    for (int i0 = lane; i0 < a.ne[0]; i0 += nl) {
        const float v = T_F32(src0, a, i0, i1, i2, i3);
        if (v >= m) { m = v; im = i0; }
    }
    best[lane] = m;
    where[lane] = im;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = nl / 2; s > 0; s >>= 1) {
        if (lane < s) {
            const float o = best[lane + s];
            const int io = where[lane + s];
            if (o > best[lane] || (o == best[lane] && io > where[lane])) { best[lane] = o; where[lane] = io; }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lane == 0) *(global int *)T_PTR(dst, d, i1, 0, 0, 0) = where[0];
}

// NORM: (x - mean) / sqrt(var + eps); RMS_NORM: x / sqrt(mean(x^2) + eps)
kernel void kernel_norm(global const char *src0, tensor_t a, global char *dst, tensor_t d, float eps, int rms) {
    local float scratch[MAX_LANES];
    ROW_IDS;
    const int n = a.ne[0];
    float mean = 0.0f;
    if (!rms) {
        float s = 0.0f;
        for (int i0 = lane; i0 < n; i0 += nl) s += T_F32(src0, a, i0, i1, i2, i3);
        mean = wg_sum(s, scratch) / n;
    }
    float s2 = 0.0f;
    for (int i0 = lane; i0 < n; i0 += nl) {
        const float v = T_F32(src0, a, i0, i1, i2, i3) - mean;
        s2 += v * v;
    }
    const float scale = 1.0f / sqrt(wg_sum(s2, scratch) / n + eps);
    for (int i0 = lane; i0 < n; i0 += nl)
        T_F32(dst, d, i0, i1, i2, i3) = (T_F32(src0, a, i0, i1, i2, i3) - mean) * scale;
}

// SOFT_MAX (GGML's soft_max_ext): dst = softmax(x*scale + slope*mask) per row. The mask (F32 or
// F16, mask_type 1 or 2; 0 = none) has row i1 for dst row i1 and is broadcast over dims 2 and 3.
// slope is ALiBi's per-head factor for head h = i2 when max_bias > 0 (m0, m1, n_head_log2 come
// from the host, as GGML computes them), else 1.
static inline float soft_max_in(global const char *src0, tensor_t a, global const char *mask, tensor_t m,
                                int mask_type, float scale, float slope, int i0, int i1, int i2, int i3) {
    float v = T_F32(src0, a, i0, i1, i2, i3) * scale;
    if (mask_type) {
        global const char *p = T_PTR(mask, m, i0, i1, i2 % m.ne[2], i3 % m.ne[3]);
        v += slope * (mask_type == 1 ? *(global const float *)p : vload_half(0, (global const half *)p));
    }
    return v;
}

kernel void kernel_soft_max(global const char *src0, tensor_t a, global const char *mask, tensor_t m,
                            global char *dst, tensor_t d, int mask_type, float scale, float max_bias,
                            float m0, float m1, int n_head_log2) {
    local float scratch[MAX_LANES];
    ROW_IDS;
    float slope = 1.0f;
    if (max_bias > 0.0f)
        slope = i2 < n_head_log2 ? pow(m0, (float)(i2 + 1)) : pow(m1, (float)(2 * (i2 - n_head_log2) + 1));
    float mx = -INFINITY;
    for (int i0 = lane; i0 < a.ne[0]; i0 += nl)
        mx = fmax(mx, soft_max_in(src0, a, mask, m, mask_type, scale, slope, i0, i1, i2, i3));
    mx = wg_max(mx, scratch);
    float s = 0.0f;
    for (int i0 = lane; i0 < a.ne[0]; i0 += nl) {
        const float e = exp(soft_max_in(src0, a, mask, m, mask_type, scale, slope, i0, i1, i2, i3) - mx);
        T_F32(dst, d, i0, i1, i2, i3) = e;
        s += e;
    }
    const float inv = 1.0f / wg_sum(s, scratch);
    for (int i0 = lane; i0 < a.ne[0]; i0 += nl) T_F32(dst, d, i0, i1, i2, i3) *= inv;
}
