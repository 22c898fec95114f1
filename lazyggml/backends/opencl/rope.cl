// ROPE (GGML's rope_ext), F32, modes normal (0) and NeoX (2), with YaRN scaling.
// src0 [head_dim, n_head, n_tokens, ne3], positions pos (I32) [n_tokens], optional frequency
// factors ff (F32) [n_dims/2]. One work-group per row (i1 = head, i2 = token, i3); lane pairs.
//
// Pair p (0 <= p < n_dims/2) rotates by theta = pos[i2] * theta_scale^p / ff[p], with theta_scale =
// freq_base^(-2/n_dims) computed once on the host (ops.rope_theta_scale, shared by every backend):
// normal mode rotates elements (2p, 2p+1), NeoX rotates (p, p + n_dims/2). Elements past n_dims
// are copied. GGML's CPU builds theta by repeated multiplication; here it is computed directly
// (as GGML's GPU backends do), which differs in the last bits only.

// YaRN (GGML's rope_yarn): mix interpolated and extrapolated angles over the ramp corr0..corr1
static inline float2 rope_yarn(float theta_extrap, float freq_scale, float corr0, float corr1, int i0,
                               float ext_factor, float mscale) {
    const float theta_interp = freq_scale * theta_extrap;
    float theta = theta_interp;
    if (ext_factor != 0.0f) {
        const float y = (i0 / 2 - corr0) / fmax(0.001f, corr1 - corr0);
        const float ramp_mix = (1.0f - fmin(1.0f, fmax(0.0f, y))) * ext_factor;
        theta = theta_interp * (1.0f - ramp_mix) + theta_extrap * ramp_mix;
        mscale *= 1.0f + 0.1f * log(1.0f / freq_scale);
    }
    return (float2)(cos(theta) * mscale, sin(theta) * mscale);
}

kernel void kernel_rope(global const char *src0, tensor_t a, global const char *pos, tensor_t p,
                        global const char *ff, tensor_t f, int has_ff, global char *dst, tensor_t d,
                        int n_dims, int neox, float theta_scale, float freq_scale, float ext_factor,
                        float attn_factor, float corr0, float corr1) {
    ROW_IDS;
    const float position = (float)*(global const int *)T_PTR(pos, p, i2, 0, 0, 0);
    const int half_dims = n_dims / 2;
    for (int ip = lane; ip < half_dims; ip += nl) {
        const int i0 = 2 * ip;
        const float factor = has_ff ? T_F32(ff, f, ip, 0, 0, 0) : 1.0f;
        const float2 cs = rope_yarn(position * pow(theta_scale, (float)ip) / factor, freq_scale, corr0, corr1,
                                    i0, ext_factor, attn_factor);
        const int ia = neox ? ip : i0, ib = neox ? ip + half_dims : i0 + 1;
        const float x0 = T_F32(src0, a, ia, i1, i2, i3), x1 = T_F32(src0, a, ib, i1, i2, i3);
        T_F32(dst, d, ia, i1, i2, i3) = x0 * cs.x - x1 * cs.y;
        T_F32(dst, d, ib, i1, i2, i3) = x0 * cs.y + x1 * cs.x;
    }
    for (int i0 = n_dims + lane; i0 < a.ne[0]; i0 += nl)
        T_F32(dst, d, i0, i1, i2, i3) = T_F32(src0, a, i0, i1, i2, i3);
}
