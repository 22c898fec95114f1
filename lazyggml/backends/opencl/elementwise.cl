// Element-wise ops on F32: one operand (GGML's unary ops, SQR..COS, SCALE, CLAMP), two operands
// with broadcasting (ADD, SUB, MUL, DIV; ADD1 is ADD of a broadcast scalar), the gated linear
// units (GLU), and DIAG_MASK_INF. All of them: one work-group per row of dst (ROW_IDS), sources
// read through their own strides, so non-contiguous views work everywhere.

#define GELU_COEF_A 0.044715f
#define GELU_QUICK_COEF -1.702f
#define SQRT_2_OVER_PI 0.79788456080286535587989211986876f
#define SQRT_2_INV 0.70710678118654752440084436210484f

static inline float gelu(float x) {
    return 0.5f * x * (1.0f + tanh(SQRT_2_OVER_PI * x * (1.0f + GELU_COEF_A * x * x)));
}

static inline float silu(float x) {
    return x / (1.0f + exp(-x));
}

// GGML's formulas (ggml-cpu vec.h / unary-ops.cpp); p0, p1 are SCALE's (s, b) and CLAMP's (min, max)
static inline float ew_apply(int op, float x, float p0, float p1) {
    switch (op) {
    case EW_ABS:         return fabs(x);
    case EW_SGN:         return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
    case EW_NEG:         return -x;
    case EW_STEP:        return x > 0.0f ? 1.0f : 0.0f;
    case EW_TANH:        return tanh(x);
    case EW_ELU:         return x > 0.0f ? x : expm1(x);
    case EW_RELU:        return x > 0.0f ? x : 0.0f;
    case EW_SIGMOID:     return 1.0f / (1.0f + exp(-x));
    case EW_GELU:        return gelu(x);
    case EW_GELU_QUICK:  return x * (1.0f / (1.0f + exp(GELU_QUICK_COEF * x)));
    case EW_SILU:        return silu(x);
    case EW_HARDSWISH:   return x * fmin(1.0f, fmax(0.0f, (x + 3.0f) / 6.0f));
    case EW_HARDSIGMOID: return fmin(1.0f, fmax(0.0f, (x + 3.0f) / 6.0f));
    case EW_EXP:         return exp(x);
    case EW_GELU_ERF:    return 0.5f * x * (1.0f + erf(x * SQRT_2_INV));
    case EW_SQR:         return x * x;
    case EW_SQRT:        return sqrt(x);
    case EW_LOG:         return log(x);
    case EW_SIN:         return sin(x);
    case EW_COS:         return cos(x);
    case EW_SCALE:       return x * p0 + p1;
    case EW_CLAMP:       return fmax(fmin(x, p1), p0);
    }
    return NAN;
}

// dst = f(src0); same shape
kernel void kernel_unary(global const char *src0, tensor_t a, global char *dst, tensor_t d,
                         int op, float p0, float p1) {
    ROW_IDS;
    for (int i0 = lane; i0 < d.ne[0]; i0 += nl)
        T_F32(dst, d, i0, i1, i2, i3) = ew_apply(op, T_F32(src0, a, i0, i1, i2, i3), p0, p1);
}

// dst = src0 op src1, src1 tiled over src0 (each src0.ne[i] a multiple of src1.ne[i])
kernel void kernel_binary(global const char *src0, tensor_t a, global const char *src1, tensor_t b,
                          global char *dst, tensor_t d, int op) {
    ROW_IDS;
    const int j1 = i1 % b.ne[1], j2 = i2 % b.ne[2], j3 = i3 % b.ne[3];
    for (int i0 = lane; i0 < d.ne[0]; i0 += nl) {
        const float x = T_F32(src0, a, i0, i1, i2, i3), y = T_F32(src1, b, i0 % b.ne[0], j1, j2, j3);
        float r;
        switch (op) {
        case OP_ADD: r = x + y; break;
        case OP_SUB: r = x - y; break;
        case OP_MUL: r = x * y; break;
        default:     r = x / y; break;  // OP_DIV
        }
        T_F32(dst, d, i0, i1, i2, i3) = r;
    }
}

// dst = f(x) * g. The host points x and g at the two halves of src0's rows (swapped or not), or
// at src0 and src1 for the split form.
kernel void kernel_glu(global const char *src0, tensor_t x, global const char *src1, tensor_t g,
                       global char *dst, tensor_t d, int op) {
    ROW_IDS;
    for (int i0 = lane; i0 < d.ne[0]; i0 += nl) {
        const float v = T_F32(src0, x, i0, i1, i2, i3), w = T_F32(src1, g, i0, i1, i2, i3);
        float r;
        switch (op) {
        case GLU_REGLU: r = v > 0.0f ? v * w : 0.0f; break;
        case GLU_GEGLU: r = gelu(v) * w; break;
        default:        r = silu(v) * w; break;  // GLU_SWIGLU
        }
        T_F32(dst, d, i0, i1, i2, i3) = r;
    }
}

// dst[.., i1, i0] = -inf where i0 > n_past + i1, else src0 (a causal mask)
kernel void kernel_diag_mask_inf(global const char *src0, tensor_t a, global char *dst, tensor_t d, int n_past) {
    ROW_IDS;
    for (int i0 = lane; i0 < d.ne[0]; i0 += nl)
        T_F32(dst, d, i0, i1, i2, i3) = i0 > n_past + i1 ? -INFINITY : T_F32(src0, a, i0, i1, i2, i3);
}
