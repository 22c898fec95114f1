// Block layouts and dequantization (docs/quant-formats.md §1 to §3), for get_rows and mul_mat.
//
// Every weight type is read as "groups of 16 consecutive elements" in two steps:
// block_scales_<type>(blk, s) unpacks what every group of the block at `blk` needs (its scales,
// up to 16 floats) into s once per block, and dequant16_<type>(blk, s, j) returns elements
// 16j .. 16j+15 of the block as one float16. A block holds QK_<type> elements in TS_<type> bytes,
// GPB_<type> = QK/16 groups: program.py defines them ahead of this file, from types.py. F32, F16
// and BF16 have no blocks in GGML; here they get "virtual blocks" of 16 elements (and no scales)
// so the same kernels read them.
//
// Alignment: Q8_0, Q6_K, Q2_K, Q3_K and the 32-element types have blocks of 34, 210, 84, 110, 18,
// 20, 22 and 24 bytes,
// so inside a row their fields are only 2-byte aligned: only byte loads (vloadN of uchar/char)
// and vload_half touch them. Q4_K and Q5_K blocks (144 and 176 bytes) are read with 16-byte loads
// (uint4): PoCL turns vload16 of uchar into eight 2-byte loads, which made its mat-vec
// compute-bound. The host only sends Q4_K and Q5_K tensors whose blocks start 16-byte aligned
// (ops.py, _blocks_aligned).

static inline void block_scales_none(global const uchar *blk, float *s) {}
#define block_scales_f32 block_scales_none
#define block_scales_f16 block_scales_none
#define block_scales_bf16 block_scales_none

static inline float16 dequant16_f32(global const uchar *blk, const float *s, int j) {
    return vload16(j, (global const float *)blk);
}

static inline float16 dequant16_f16(global const uchar *blk, const float *s, int j) {
    return vload_half16(j, (global const half *)blk);
}

// BF16: the top 16 bits of an F32 (exact: a shift)
static inline float16 dequant16_bf16(global const uchar *blk, const float *s, int j) {
    return as_float16(convert_uint16(vload16(j, (global const ushort *)blk)) << 16);
}

// block_q8_0 (34 bytes): d (fp16) @0, qs[32] (int8) @2.  x = d * q.
static inline void block_scales_q8_0(global const uchar *blk, float *s) {
    s[0] = vload_half(0, (global const half *)blk);
}

static inline float16 dequant16_q8_0(global const uchar *blk, const float *s, int j) {
    return s[0] * convert_float16(vload16(0, (global const char *)blk + 2 + 16 * j));
}

// Two fp16 values packed in a uint (low half first) as floats, finite values only (scales are):
// the bits moved into float's place and rebiased by a multiplication with 2^112, exact for normal
// and subnormal halves. PoCL's vload_half is a scalar emulation of about 17 instructions.
static inline float2 half2_to_float2(uint h) {
    const uint2 v = (uint2)(h & 0xffff, h >> 16);
    const float2 f = as_float2((v & 0x7fff) << 13) * 0x1p112f;
    return as_float2(as_uint2(f) | ((v & 0x8000) << 16));
}

// block_q4_K (144 bytes): d (fp16) @0, dmin (fp16) @2, scales[12] @4, qs[128] @16.
// 8 sub-blocks of 32 with 6-bit scale sc and min m each (§2, get_scale_min_k4), x = d*sc*q - dmin*m.
// The scales are unpacked all 8 at once with the 32-bit form of get_scale_min_k4: s[i] = d*sc_i,
// s[8+i] = dmin*m_i (unpacking per group instead measured twice as slow on PoCL).
static inline void block_scales_q4_K(global const uchar *blk, float *s) {
    const uint4 h = *(global const uint4 *)blk;  // d, dmin | scales 0-3 | 4-7 | 8-11
    const float2 dm = half2_to_float2(h.x);  // d, dmin
    const float d = dm.x, dmin = dm.y;
    const uint sc_lo = h.y & 0x3f3f3f3f, sc_hi = (h.w & 0x0f0f0f0f) | (((h.y >> 6) & 0x03030303) << 4);
    const uint m_lo = h.z & 0x3f3f3f3f, m_hi = ((h.w >> 4) & 0x0f0f0f0f) | (((h.z >> 6) & 0x03030303) << 4);
    vstore8(d * convert_float8((uchar8)(as_uchar4(sc_lo), as_uchar4(sc_hi))), 0, s);
    vstore8(dmin * convert_float8((uchar8)(as_uchar4(m_lo), as_uchar4(m_hi))), 1, s);
}

// Byte b of the 32-byte chunk c = qs[32c .. 32c+31] holds element 64c+b in its low nibble and
// element 64c+32+b in its high nibble: group j is chunk j/4, bytes 16*(j%2) .. +15 of it, low
// nibbles for j%4 < 2 (sub-block 2*(j/4)), high ones otherwise (sub-block 2*(j/4)+1).
static inline float16 dequant16_q4_K(global const uchar *blk, const float *s, int j) {
    const uchar16 q = as_uchar16(((global const uint4 *)(blk + 16))[2 * (j / 4) + j % 2]);
    const int sb = 2 * (j / 4) + (j / 2) % 2;
    return s[sb] * convert_float16((j & 2) ? q >> (uchar)4 : q & (uchar)0xF) - s[8 + sb];
}

// block_q6_K (210 bytes): ql[128] @0 (low 4 bits), qh[64] @128 (high 2 bits), scales[16] (int8)
// @192, d (fp16) @208; 16 sub-blocks of 16, x = d*sc*(q-32): s[i] = d*sc_i, group j = sub-block j.
// In each half n of 128 elements, position l (0..31) of quarter qq (0..3) reads
// ql[64n + 32*(qq&1) + l] (low nibble for qq < 2, high for qq >= 2) and bits 2qq..2qq+1 of
// qh[32n + l], with scale sc[8n + l/16 + 2qq].
static inline void block_scales_q6_K(global const uchar *blk, float *s) {
    const float d = vload_half(0, (global const half *)(blk + 208));
    vstore16(d * convert_float16(vload16(0, (global const char *)blk + 192)), 0, s);
}

static inline float16 dequant16_q6_K(global const uchar *blk, const float *s, int j) {
    const int n = j / 8, e = 16 * (j % 8), qq = e / 32, l0 = e % 32;
    const uchar16 ql = vload16(0, blk + 64 * n + 32 * (qq & 1) + l0);
    const uchar16 qh = vload16(0, blk + 128 + 32 * n + l0);
    const uchar16 lo = qq < 2 ? ql & (uchar)0xF : ql >> (uchar)4;
    const char16 q = as_char16(lo | (((qh >> (uchar)(2 * qq)) & (uchar)3) << (uchar)4)) - (char)32;
    return s[j] * convert_float16(q);
}

// The 32-element types (§1): group j = 0 holds the low nibbles of qs[0..15] (elements 0..15),
// j = 1 the high nibbles (elements 16..31). Q5_0/Q5_1 add bit i (element i) or bit 16 + i
// (element 16 + i) of the little-endian 32-bit qh as the nibble's fifth bit.
static inline uchar16 nibbles16(global const uchar *qs, int j) {
    const uchar16 q = vload16(0, qs);
    return j ? q >> (uchar)4 : q & (uchar)0xF;
}

static inline uchar16 fifth_bits16(global const uchar *qh, int j) {
    const uint h = (uint)qh[0] | ((uint)qh[1] << 8) | ((uint)qh[2] << 16) | ((uint)qh[3] << 24);
    const uint16 bits = (uint16)(h >> (16 * j)) >> (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return convert_uchar16((bits & 1u) << 4);
}

// block_q4_0 (18 bytes): d (fp16) @0, qs[16] @2. x = d * (q - 8).
static inline void block_scales_q4_0(global const uchar *blk, float *s) {
    s[0] = vload_half(0, (global const half *)blk);
}

static inline float16 dequant16_q4_0(global const uchar *blk, const float *s, int j) {
    return s[0] * (convert_float16(nibbles16(blk + 2, j)) - 8.0f);
}

// block_q4_1 (20 bytes): d (fp16) @0, m (fp16) @2, qs[16] @4. x = d * q + m.
static inline void block_scales_q4_1(global const uchar *blk, float *s) {
    s[0] = vload_half(0, (global const half *)blk);
    s[1] = vload_half(1, (global const half *)blk);
}

static inline float16 dequant16_q4_1(global const uchar *blk, const float *s, int j) {
    return s[0] * convert_float16(nibbles16(blk + 4, j)) + s[1];
}

// block_q5_0 (22 bytes): d (fp16) @0, qh[4] @2, qs[16] @6. x = d * (q5 - 16).
#define block_scales_q5_0 block_scales_q4_0

static inline float16 dequant16_q5_0(global const uchar *blk, const float *s, int j) {
    return s[0] * (convert_float16(nibbles16(blk + 6, j) | fifth_bits16(blk + 2, j)) - 16.0f);
}

// block_q5_1 (24 bytes): d (fp16) @0, m (fp16) @2, qh[4] @4, qs[16] @8. x = d * q5 + m.
#define block_scales_q5_1 block_scales_q4_1

static inline float16 dequant16_q5_1(global const uchar *blk, const float *s, int j) {
    return s[0] * convert_float16(nibbles16(blk + 8, j) | fifth_bits16(blk + 4, j)) + s[1];
}

// block_q5_K (176 bytes): d, dmin, scales[12] as Q4_K's @0, qh[32] @16, qs[128] @48. Element l
// (0..31) of sub-block sb is Q4_K's nibble plus 16 * bit sb of qh[l]; group j is half j%2 of
// sub-block j/2.
#define block_scales_q5_K block_scales_q4_K

static inline float16 dequant16_q5_K(global const uchar *blk, const float *s, int j) {
    const int sb = j / 2, l0 = 16 * (j % 2);
    const uchar16 q = as_uchar16(*(global const uint4 *)(blk + 48 + 32 * (sb / 2) + l0));
    const uchar16 h = as_uchar16(*(global const uint4 *)(blk + 16 + l0));
    const uchar16 q5 = ((sb & 1) ? q >> (uchar)4 : q & (uchar)0xF) | (((h >> (uchar)sb) & (uchar)1) << (uchar)4);
    return s[sb] * convert_float16(q5) - s[8 + sb];
}

// The 2-bit planes of Q2_K and Q3_K: in each half n of 128 elements, group e (0..7) of it reads
// bits 2*(e/2) .. +1 of bytes 16*(e%2) .. +15 of the half's 32 quant bytes.
static inline uchar16 crumbs16(global const uchar *qs, int j) {
    const int n = j / 8, e = j % 8;
    return (vload16(0, qs + 32 * n + 16 * (e % 2)) >> (uchar)(2 * (e / 2))) & (uchar)3;
}

// block_q2_K (84 bytes): scales[16] @0 (low nibble: scale, high nibble: min of group j), qs[64]
// @16, d (fp16) @80, dmin (fp16) @82. x = d*sc_j*q - dmin*m_j: s[j] = d*sc_j; the min is read
// again in dequant16 (s has room for 16 floats).
static inline void block_scales_q2_K(global const uchar *blk, float *s) {
    const float d = vload_half(40, (global const half *)blk);
    vstore16(d * convert_float16(vload16(0, blk) & (uchar)0xF), 0, s);
}

static inline float16 dequant16_q2_K(global const uchar *blk, const float *s, int j) {
    const float m = vload_half(41, (global const half *)blk) * (float)(blk[j] >> 4);
    return s[j] * convert_float16(crumbs16(blk + 16, j)) - m;
}

// block_q3_K (110 bytes): hmask[32] @0, qs[64] @32, scales[12] @96, d (fp16) @108. Sixteen
// 6-bit scales: the low 4 bits of scale i are nibble i%8 of bytes 0..7 (low nibbles first, then
// high), the top 2 bits are bits 2*(i/4) .. +1 of byte 8 + i%4; x = d*(sc - 32)*(q - 4*(1 - h)),
// h = bit 4n + e/2 of hmask[16*(e%2) + l] (the high bit, set: no -4).
static inline void block_scales_q3_K(global const uchar *blk, float *s) {
    const float d = vload_half(54, (global const half *)blk);
    const uchar8 lo = vload8(0, blk + 96);
    const uchar4 hi = vload4(0, blk + 104);
    const uchar16 low = (uchar16)(lo & (uchar)0xF, lo >> (uchar)4);
    const uchar16 top = (uchar16)((hi >> (uchar)0) & (uchar)3, (hi >> (uchar)2) & (uchar)3,
                                  (hi >> (uchar)4) & (uchar)3, (hi >> (uchar)6) & (uchar)3);
    vstore16(d * (convert_float16(low | (top << (uchar)4)) - 32.0f), 0, s);
}

static inline float16 dequant16_q3_K(global const uchar *blk, const float *s, int j) {
    const int n = j / 8, e = j % 8;
    const uchar16 h = (vload16(0, blk + 16 * (e % 2)) >> (uchar)(4 * n + e / 2)) & (uchar)1;
    return s[j] * (convert_float16(crumbs16(blk + 32, j)) - 4.0f * convert_float16((uchar)1 - h));
}

// IQ4_NL and IQ4_XS: 4-bit indices into 16 non-linear levels (GGML's kvalues_iq4nl), looked up by a
// byte shuffle.
constant char16 KVALUES_IQ4NL = (char16)(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);

static inline float16 levels16(uchar16 idx) {
    return convert_float16(shuffle(KVALUES_IQ4NL, idx));
}

// block_iq4_nl (18 bytes): d (fp16) @0, qs[16] @2 (elements as Q4_0's). x = d * level.
#define block_scales_iq4_nl block_scales_q4_0

static inline float16 dequant16_iq4_nl(global const uchar *blk, const float *s, int j) {
    return s[0] * levels16(nibbles16(blk + 2, j));
}

// block_iq4_xs (136 bytes): d (fp16) @0, scales_h (16 bits) @2, scales_l[4] @4, qs[128] @8. Sub-block
// ib (32 values, 16 bytes of qs at 8 + 16 ib, elements as Q4_0's) has the 6-bit scale ls: low 4 bits
// nibble ib%2 of scales_l[ib/2], high 2 bits bits 2 ib of scales_h; x = d*(ls - 32) * level:
// s[ib] = d*(ls - 32), group j is half j%2 of sub-block j/2.
static inline void block_scales_iq4_xs(global const uchar *blk, float *s) {
    const float d = vload_half(0, (global const half *)blk);
    const uint sh = (uint)blk[2] | ((uint)blk[3] << 8);
    for (int ib = 0; ib < 8; ++ib) {
        const int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
        s[ib] = d * (float)(ls - 32);
    }
}

static inline float16 dequant16_iq4_xs(global const uchar *blk, const float *s, int j) {
    return s[j / 2] * levels16(nibbles16(blk + 8 + 16 * (j / 2), j % 2));
}
