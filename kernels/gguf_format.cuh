// llama.cpp's block formats kept at their bytes (metrale/ops/gguf_planes.py): the value of
// every element of a W row from its three planes, shared by kernels/gemm_gguf.cu (32-element
// blocks), gemm_gguf_k.cu (256-element K-quants and IQ4_XS) and embedding.cu.
//
//   y = bf16_rn(s * c)        (types without a min)     y = bf16_rn(s * c + mn) (with one)
//
// c the element's code (lo bits from the q plane | hi bits from the qh plane << LOW, minus
// OFF; Q8_0's int8 code; IQ4's KVALUES entry), s and mn its sub-block's scale and min from
// the block's meta bytes, as gguf_planes.py's docstring lists them. The bits:
//   - c is an integer of at most 8 bits: (2^23 + u) - (2^23 + OFF), with u the unsigned
//     code (Q8_0: code ^ 0x80, OFF 128; IQ4: KVALUES + 128 looked up with prmt, OFF 128), is
//     exact (a code equal to OFF gives +0, as numpy's integer difference does);
//   - s = d * sc and mn = -(dmin * m) are exact in FP32 (an f16 times an integer of at most
//     8 bits: at most 19 significant bits), as in the twin;
//   - types without a min: y = __fmul_rn(s, c), the twin's one FP32 rounding of s * c (Q6_K's
//     product can take 25 bits: that rounding is the twin's too), then RNE to BF16;
//   - types with a min (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K): s * c is exact (at most 11 + 6 + 5 =
//     22 significant bits, |s * c| < 2^28: no overflow), so fma(s, c, mn) rounds the exact
//     s * c + mn once, which is the twin's fl(fl(s * c) + mn) with fl(s * c) = s * c: one
//     instruction instead of two, the same bits, infinities and NaNs included (IEEE fma and
//     the separate product and sum agree on them when the product is exact).
//   No value is ever an FP32 subnormal (every nonzero s * c, mn and their sum is a multiple
//   of 2^-24, the f16 quantum), so FTZ (--use_fast_math) cannot change one. The sign of a
//   zero follows the formula: s * (+0) is -0 for a negative s, and + mn is added only where
//   the type has a min.
//
// Meta loads (__ldg, read-only path) at each block's natural alignment, which the launchers
// check on the plane's base (ops/gemm_gguf.py, plane_alignment): Q4_K / Q5_K one 128-bit
// load per block, IQ4_XS 64 bits, Q4_1 / Q5_1 / Q2_K 32 bits, Q3_K / Q6_K 16-bit pairs.
#pragma once
#include <cuda_fp16.h>

#include "common.cuh"

// ggml type ids (ggml.h), as ops/gguf_planes.PACKED keys them
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q5_0 6
#define GGML_Q5_1 7
#define GGML_Q8_0 8
#define GGML_Q2_K 10
#define GGML_Q3_K 11
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14
#define GGML_IQ4_NL 20
#define GGML_IQ4_XS 23

// The layout constants of one type (gguf_planes.PACKED): elements per block and per scale,
// code bits in the q / qh planes, meta bytes per block, a min, the code offset.
template <int QK_, int SUB_, int LOW_, int HIGH_, int META_, bool MIN_, int OFF_>
struct GgufLayout {
    static constexpr int QK = QK_, SUB = SUB_, LOW = LOW_, HIGH = HIGH_, META = META_;
    static constexpr int OFF = OFF_;   // c = u - OFF (u the unsigned code, see gguf_code)
    static constexpr bool MIN = MIN_;
    static constexpr unsigned LMASK = (1u << LOW) - 1u, HMASK = (1u << HIGH) - 1u;
};

template <int TYPE> struct GgufType;
template <> struct GgufType<GGML_Q4_0> : GgufLayout<32, 32, 4, 0, 2, false, 8> {};
template <> struct GgufType<GGML_Q4_1> : GgufLayout<32, 32, 4, 0, 4, true, 0> {};
template <> struct GgufType<GGML_Q5_0> : GgufLayout<32, 32, 4, 1, 2, false, 16> {};
template <> struct GgufType<GGML_Q5_1> : GgufLayout<32, 32, 4, 1, 4, true, 0> {};
template <> struct GgufType<GGML_Q8_0> : GgufLayout<32, 32, 8, 0, 2, false, 128> {};
template <> struct GgufType<GGML_IQ4_NL> : GgufLayout<32, 32, 4, 0, 2, false, 128> {};
template <> struct GgufType<GGML_Q2_K> : GgufLayout<256, 16, 2, 0, 20, true, 0> {};
template <> struct GgufType<GGML_Q3_K> : GgufLayout<256, 16, 2, 1, 14, false, 4> {};
template <> struct GgufType<GGML_Q4_K> : GgufLayout<256, 32, 4, 0, 16, true, 0> {};
template <> struct GgufType<GGML_Q5_K> : GgufLayout<256, 32, 4, 1, 16, true, 0> {};
template <> struct GgufType<GGML_Q6_K> : GgufLayout<256, 16, 4, 2, 18, false, 32> {};
template <> struct GgufType<GGML_IQ4_XS> : GgufLayout<256, 32, 4, 0, 8, false, 128> {};

__device__ __forceinline__ float f16_bits(unsigned int h) {  // exact widening (inf, NaN too)
    return __half2float(__ushort_as_half((unsigned short)(h & 0xFFFFu)));
}
__device__ __forceinline__ unsigned int ldg_u16(const unsigned char *p) {
    return __ldg(reinterpret_cast<const unsigned short *>(p));
}
__device__ __forceinline__ unsigned int ldg_u32(const unsigned char *p) {
    return __ldg(reinterpret_cast<const unsigned int *>(p));
}
// 4 bytes from a 2-byte aligned address (Q3_K / Q6_K meta: 14- and 18-byte blocks)
__device__ __forceinline__ unsigned int ldg_u32_a2(const unsigned char *p) {
    return ldg_u16(p) | (ldg_u16(p + 2) << 16);
}

// float(u) - off for an integer u in [0, 2^23): (2^23 + u) - (2^23 + off), exact; one OR and
// one FADD, where a conversion instruction (I2F) runs at a quarter of the FP32 rate.
__device__ __forceinline__ float small_int(unsigned int u, int off = 0) {
    return __uint_as_float(0x4B000000u | u) - (8388608.f + (float)off);
}

// The float code c of an unsigned code u (see the header): one OR and one FADD, exact.
template <int TYPE>
__device__ __forceinline__ float gguf_code(unsigned int u) {
    typedef GgufType<TYPE> Ty;
    if constexpr (TYPE == GGML_IQ4_NL || TYPE == GGML_IQ4_XS) {
        // KVALUES + 128 (ggml-common.h kvalues_iq4nl), 4 bytes a word, picked by prmt
        const unsigned int sel = u & 7u;
        u = (u & 8u) ? __byte_perm(0xA6998D81u, 0xF1D9C5B5u, sel)
                     : __byte_perm(0x3F2D1801u, 0x766A5D4Fu, sel);
        u &= 0xFFu;
    } else if constexpr (TYPE == GGML_Q8_0) {
        u ^= 0x80u;   // int8 code + 128
    }
    return small_int(u, Ty::OFF);
}

// y of unsigned code u with its sub-block's (s, mn): the formula's one FP32 rounding
template <int TYPE>
__device__ __forceinline__ float gguf_value(unsigned int u, float s, float mn) {
    const float c = gguf_code<TYPE>(u);
    if constexpr (GgufType<TYPE>::MIN) return __fmaf_rn(s, c, mn);   // s * c exact: see above
    else return __fmul_rn(s, c);
}

// Scales (s, mn) of the NS sub-blocks j0 .. j0 + NS - 1 of the block whose meta starts at mb
// (j0 % NS == 0 and NS <= 4; mn untouched for types without a min).
template <int TYPE, int NS>
__device__ __forceinline__ void gguf_scales(const unsigned char *mb, int j0, float (&s)[NS],
                                            float (&mn)[NS]) {
    if constexpr (TYPE == GGML_Q4_1 || TYPE == GGML_Q5_1) {
        const unsigned int w = ldg_u32(mb);   // d, m
        s[0] = f16_bits(w);
        mn[0] = f16_bits(w >> 16);
    } else if constexpr (GgufType<TYPE>::QK == 32) {   // Q4_0, Q5_0, Q8_0, IQ4_NL: d
        s[0] = f16_bits(ldg_u16(mb));
    } else if constexpr (TYPE == GGML_Q2_K) {   // scales[16] | d | dmin; sc = scales[j]
        const unsigned int dm = ldg_u32(mb + 16), sw = ldg_u32(mb + (j0 & ~3));
        const float d = f16_bits(dm), dmin = f16_bits(dm >> 16);
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            const unsigned int sc = (sw >> (8 * ((j0 + i) & 3))) & 0xFFu;
            s[i] = __fmul_rn(d, small_int(sc & 15u));
            mn[i] = -__fmul_rn(dmin, small_int(sc >> 4));
        }
    } else if constexpr (TYPE == GGML_Q3_K) {   // scales[12] | d; 6-bit sc = lo4 | hi2 << 4
        const float d = f16_bits(ldg_u16(mb + 12));
        const unsigned int lw = ldg_u32_a2(mb + ((j0 & 7) & ~3)), hw = ldg_u32_a2(mb + 8);
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            const int j = j0 + i;
            const unsigned int lo4 = (lw >> (8 * (j & 3) + 4 * (j >> 3))) & 15u;
            const unsigned int hi2 = (hw >> (8 * (j & 3) + 2 * (j >> 2))) & 3u;
            s[i] = __fmul_rn(d, small_int(lo4 | (hi2 << 4), 32));
        }
    } else if constexpr (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K) {
        // d | dmin | scales[12]: get_scale_min_k4 on the three words of scales
        const uint4 w = __ldg(reinterpret_cast<const uint4 *>(mb));
        const float d = f16_bits(w.x), dmin = f16_bits(w.x >> 16);
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            const int j = j0 + i, sh = 8 * (j & 3);
            const unsigned int a = (w.y >> sh) & 0xFFu, b = (w.z >> sh) & 0xFFu,
                               c = (w.w >> sh) & 0xFFu;   // scales[j&3], [+4], [+8]
            const unsigned int sc = j < 4 ? a & 63u : (c & 15u) | ((a >> 6) << 4);
            const unsigned int m = j < 4 ? b & 63u : (c >> 4) | ((b >> 6) << 4);
            s[i] = __fmul_rn(d, small_int(sc));
            mn[i] = -__fmul_rn(dmin, small_int(m));
        }
    } else if constexpr (TYPE == GGML_Q6_K) {   // scales[16] (int8) | d
        const float d = f16_bits(ldg_u16(mb + 16));
        const unsigned int sw = ldg_u32_a2(mb + (j0 & ~3));
#pragma unroll
        for (int i = 0; i < NS; ++i)
            s[i] = __fmul_rn(d, small_int(((sw >> (8 * ((j0 + i) & 3))) & 0xFFu) ^ 0x80u, 128));
    } else if constexpr (TYPE == GGML_IQ4_XS) {   // d | scales_h (u16) | scales_l[4]
        const uint2 w = __ldg(reinterpret_cast<const uint2 *>(mb));
        const float d = f16_bits(w.x);
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            const int j = j0 + i;
            const unsigned int ls = ((w.y >> (4 * j)) & 15u) | (((w.x >> (16 + 2 * j)) & 3u) << 4);
            s[i] = __fmul_rn(d, small_int(ls, 32));
        }
    }
}

// 16 consecutive elements of one sub-block (a 16-aligned run): lo = their q-plane bits
// (16 * LOW bits in lo.x, .y, ...), hi = their qh-plane bits (16 * HIGH), (s, mn) the
// sub-block's scales -> 16 BF16 values in two 16-byte chunks.
template <int TYPE>
__device__ __forceinline__ void gguf_run16(const uint4 &lo, unsigned int hi, float s, float mn,
                                           uint4 &out0, uint4 &out1) {
    typedef GgufType<TYPE> Ty;
    const unsigned int lw[4] = {lo.x, lo.y, lo.z, lo.w};
    unsigned int o[8];
#pragma unroll
    for (int e = 0; e < 16; e += 2) {
        float v[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int b = (e + h) * Ty::LOW;
            unsigned int u = (lw[b / 32] >> (b % 32)) & Ty::LMASK;
            if constexpr (Ty::HIGH > 0) u |= ((hi >> ((e + h) * Ty::HIGH)) & Ty::HMASK) << Ty::LOW;
            v[h] = gguf_value<TYPE>(u, s, mn);
        }
        o[e / 2] = pack_bf2(v[0], v[1]);
    }
    out0 = make_uint4(o[0], o[1], o[2], o[3]);
    out1 = make_uint4(o[4], o[5], o[6], o[7]);
}

// The q-plane bits of run r (elements 16 r .. 16 r + 15) of a row at `row` (16-byte aligned
// rows): 2 * LOW bytes, one 32-, 64- or 128-bit load; GLOBAL selects shared (plain) or global
// (__ldg) memory.
template <int LOW, bool GLOBAL>
__device__ __forceinline__ uint4 gguf_lo_bits(const unsigned char *row, int r) {
    const unsigned char *p = row + 2 * LOW * r;
    if constexpr (LOW == 8) {
        return GLOBAL ? __ldg(reinterpret_cast<const uint4 *>(p))
                      : *reinterpret_cast<const uint4 *>(p);
    } else if constexpr (LOW == 4) {
        const uint2 v = GLOBAL ? __ldg(reinterpret_cast<const uint2 *>(p))
                               : *reinterpret_cast<const uint2 *>(p);
        return make_uint4(v.x, v.y, 0u, 0u);
    } else {
        return make_uint4(GLOBAL ? ldg_u32(p) : *reinterpret_cast<const unsigned int *>(p), 0u,
                          0u, 0u);
    }
}

// The qh-plane bits of run r: 2 * HIGH bytes (a 16- or 32-bit load), 0 without a qh plane.
template <int HIGH, bool GLOBAL>
__device__ __forceinline__ unsigned int gguf_hi_bits(const unsigned char *row, int r) {
    const unsigned char *p = row + 2 * HIGH * r;
    if constexpr (HIGH == 1)
        return GLOBAL ? ldg_u16(p) : *reinterpret_cast<const unsigned short *>(p);
    else if constexpr (HIGH == 2)
        return GLOBAL ? ldg_u32(p) : *reinterpret_cast<const unsigned int *>(p);
    else
        return 0u;
}

// Row geometry of a W [n, k] in its planes (gguf_planes.plane_bytes).
template <int TYPE>
struct GgufRowBytes {
    typedef GgufType<TYPE> Ty;
    static __device__ __forceinline__ int q(int k) { return (k * Ty::LOW / 8 + 15) / 16 * 16; }
    static __device__ __forceinline__ int qh(int k) { return k * Ty::HIGH / 8; }
    static __device__ __forceinline__ int meta(int k) { return k / Ty::QK * Ty::META; }
};

// Elements [16 r, 16 r + 16) of W row j (run r of the row), from global memory.
template <int TYPE>
__device__ __forceinline__ void gguf_row_run16(const unsigned char *q, const unsigned char *qh,
                                               const unsigned char *meta, long long j, int k,
                                               int r, uint4 &out0, uint4 &out1) {
    typedef GgufType<TYPE> Ty;
    typedef GgufRowBytes<TYPE> RB;
    const int e0 = 16 * r;
    float s[1], mn[1] = {0.f};
    gguf_scales<TYPE, 1>(meta + j * RB::meta(k) + (e0 / Ty::QK) * Ty::META,
                         (e0 % Ty::QK) / Ty::SUB, s, mn);
    unsigned int hi = 0u;
    if constexpr (Ty::HIGH > 0) hi = gguf_hi_bits<Ty::HIGH, true>(qh + j * RB::qh(k), r);
    gguf_run16<TYPE>(gguf_lo_bits<Ty::LOW, true>(q + j * RB::q(k), r), hi, s[0], mn[0], out0,
                     out1);
}
