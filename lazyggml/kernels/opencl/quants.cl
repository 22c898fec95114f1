// Block layouts and dequantization (spec/quant-formats.md §1 to §3), for get_rows and mul_mat.
//
// Every weight type is read as "groups of 16 consecutive elements": dequant16_<type>(blk, j)
// returns elements 16j .. 16j+15 of the block at `blk` as one float16. A block holds QK_<type>
// elements in TS_<type> bytes, GPB_<type> = QK/16 groups. F32 and F16 have no blocks in GGML;
// here they get "virtual blocks" of 16 elements so the same kernels read them.
//
// Alignment: a Q8_0 block is 34 bytes and a Q6_K block 210, so inside a row their fields are
// only 2-byte aligned. Only byte loads (vloadN of uchar/char) and vload_half touch them.

#define QK_f32 16
#define TS_f32 64
#define GPB_f32 1
#define QK_f16 16
#define TS_f16 32
#define GPB_f16 1
#define QK_q8_0 32
#define TS_q8_0 34
#define GPB_q8_0 2
#define QK_q4_K 256
#define TS_q4_K 144
#define GPB_q4_K 16
#define QK_q6_K 256
#define TS_q6_K 210
#define GPB_q6_K 16

static inline float16 dequant16_f32(global const uchar *blk, int j) {
    return vload16(j, (global const float *)blk);
}

static inline float16 dequant16_f16(global const uchar *blk, int j) {
    return vload_half16(j, (global const half *)blk);
}

// block_q8_0 (34 bytes): d (fp16) @0, qs[32] (int8) @2.  x = d * q.
static inline float16 dequant16_q8_0(global const uchar *blk, int j) {
    const float d = vload_half(0, (global const half *)blk);
    return d * convert_float16(vload16(0, (global const char *)blk + 2 + 16 * j));
}

// block_q4_K (144 bytes): d (fp16) @0, dmin (fp16) @2, scales[12] @4, qs[128] @16.
// 8 sub-blocks of 32 with 6-bit scale sc and min m each (§2, get_scale_min_k4).
// Byte b of the 32-byte chunk c = qs[32c .. 32c+31] holds element 64c+b in its low nibble and
// element 64c+32+b in its high nibble. x = d*sc*q - dmin*m.
static inline uchar2 q4_K_scale_min(global const uchar *s, int j) {
    if (j < 4) return (uchar2)(s[j] & 63, s[j + 4] & 63);
    return (uchar2)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4));
}

static inline float16 dequant16_q4_K(global const uchar *blk, int j) {
    // group j: chunk j/4, bytes 16*(j%2) .. +15 of it, low nibbles for j%4 < 2, high otherwise
    const uchar2 sm = q4_K_scale_min(blk + 4, j / 2);
    const uchar16 q = vload16(0, blk + 16 + 32 * (j / 4) + 16 * (j % 2));
    const float d = vload_half(0, (global const half *)blk) * sm.x;
    const float m = vload_half(1, (global const half *)blk) * sm.y;
    return d * convert_float16((j & 2) ? q >> (uchar)4 : q & (uchar)0xF) - m;
}

// block_q6_K (210 bytes): ql[128] @0 (low 4 bits), qh[64] @128 (high 2 bits), scales[16] (int8)
// @192, d (fp16) @208; 16 sub-blocks of 16, x = d*sc*(q-32). In each half n of 128 elements,
// position l (0..31) of quarter qq (0..3) reads ql[64n + 32*(qq&1) + l] (low nibble for qq < 2,
// high for qq >= 2) and bits 2qq..2qq+1 of qh[32n + l], with scale sc[8n + l/16 + 2qq].
static inline float16 dequant16_q6_K(global const uchar *blk, int j) {
    const int n = j / 8, e = 16 * (j % 8), qq = e / 32, l0 = e % 32;
    const uchar16 ql = vload16(0, blk + 64 * n + 32 * (qq & 1) + l0);
    const uchar16 qh = vload16(0, blk + 128 + 32 * n + l0);
    const uchar16 lo = qq < 2 ? ql & (uchar)0xF : ql >> (uchar)4;
    const char16 q = as_char16(lo | (((qh >> (uchar)(2 * qq)) & (uchar)3) << (uchar)4)) - (char)32;
    const float d = vload_half(0, (global const half *)(blk + 208)) * ((global const char *)blk)[192 + 8 * n + l0 / 16 + 2 * qq];
    return d * convert_float16(q);
}
