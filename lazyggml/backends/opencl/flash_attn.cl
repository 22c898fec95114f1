// FLASH_ATTN_EXT (GGML's flash_attn_ext): softmax(scale * q.k + slope * mask) . v per query and
// head, the scores never written out. One work-group of FA_LANES lanes per output row (head i1,
// query i2, i3 of dst [Dv, n_head, n_q, ne3]). The window is walked in chunks of FA_LANES cells:
// lane l scores cell c0 + l (a dot product over D; a -inf mask entry skips it), the chunk's
// maximum updates the running maximum M (the sum L and the accumulator are rescaled by
// exp(M_old - M)), the chunk's probabilities go to local memory, and each lane adds them times V
// to its elements of the output (d = lane, lane + FA_LANES, ...: Dv <= FA_LANES * FA_DV_PER_LANE).
// A query whose every cell is masked gets zeros. K and V are F16 (vload_half) or F32 (kv_f16);
// the mask is F16, as GGML's op requires (has_mask).
#define FA_LANES 64
#define FA_DV_PER_LANE 4

static inline float fa_load(global const char *base, tensor_t t, int i0, int i1, int i2, int i3, int f16) {
    global const char *p = T_PTR(base, t, i0, i1, i2, i3);
    return f16 ? vload_half(0, (global const half *)p) : *(global const float *)p;
}

kernel void kernel_flash_attn_ext(global const char *qb, tensor_t q, global const char *kb, tensor_t k,
                                  global const char *vb, tensor_t v, global const char *mb, tensor_t m,
                                  global char *dst, tensor_t d, int kv_f16, int has_mask, float scale,
                                  float softcap, float max_bias, float m0, float m1, int n_head_log2) {
    local float scratch[FA_LANES];
    local float probs[FA_LANES];
    const int h = get_group_id(0), iq = get_global_id(1), i3 = get_global_id(2);
    const int lane = get_local_id(0);
    const int hk = h / (q.ne[2] / k.ne[2]), i3k = i3 / (q.ne[3] / k.ne[3]);
    const int D = q.ne[0], Dv = v.ne[0], n_kv = k.ne[1];
    float slope = 1.0f;
    if (max_bias > 0.0f)
        slope = h < n_head_log2 ? pow(m0, (float)(h + 1)) : pow(m1, (float)(2 * (h - n_head_log2) + 1));

    float acc[FA_DV_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    float M = -INFINITY, L = 0.0f;
    for (int c0 = 0; c0 < n_kv; c0 += FA_LANES) {
        const int c = c0 + lane;
        float s = -INFINITY;
        if (c < n_kv) {
            float mv = 0.0f;
            if (has_mask)
                mv = slope * vload_half(0, (global const half *)T_PTR(mb, m, c, iq, h % m.ne[2], i3 % m.ne[3]));
            if (mv != -INFINITY) {
                float dot = 0.0f;
                for (int i = 0; i < D; i++)
                    dot += T_F32(qb, q, i, iq, h, i3) * fa_load(kb, k, i, c, hk, i3k, kv_f16);
                s = dot * scale;
                if (softcap != 0.0f) s = softcap * tanh(s);
                s += mv;
            }
        }
        const float Mn = fmax(M, wg_max(s, scratch));
        const float alpha = Mn == -INFINITY ? 1.0f : exp(M - Mn);
        const float p = (Mn == -INFINITY || s == -INFINITY) ? 0.0f : exp(s - Mn);
        probs[lane] = p;
        L = L * alpha + wg_sum(p, scratch);    // its barriers also publish probs
        const int nc = min(FA_LANES, n_kv - c0);
        for (int j = 0; j < FA_DV_PER_LANE; j++) {
            const int e = lane + FA_LANES * j;
            if (e >= Dv) break;
            float a = acc[j] * alpha;
            for (int cc = 0; cc < nc; cc++)
                a += probs[cc] * fa_load(vb, v, e, c0 + cc, hk, i3k, kv_f16);
            acc[j] = a;
        }
        M = Mn;
        barrier(CLK_LOCAL_MEM_FENCE);          // probs are read before the next chunk writes them
    }
    for (int j = 0; j < FA_DV_PER_LANE; j++) {
        const int e = lane + FA_LANES * j;
        if (e < Dv) T_F32(dst, d, e, h, iq, i3) = L > 0.0f ? acc[j] / L : 0.0f;
    }
}
