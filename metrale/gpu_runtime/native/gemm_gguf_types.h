// The GGUF block formats of ops/gguf_planes.py for the native GEMM (gemm_gguf.cpp): each
// type's layout constants, its scales decoded exactly (scalar, per sub-block), and the
// generic dequantization of one 32-position step in portable vector code, the reference
// every faster path of gemm_gguf.cpp and gemm_gguf_dp.h agrees with bit for bit.
//
// A row of W is three planes (ops/gguf_planes.py): q (the low `low` bits of every code, in
// position order: 4 bits two a byte low nibble first, 2 bits four a byte from bit 0, 8 bits
// a byte), qh (the high `high` bits the same way, or none) and meta (each block's scale
// fields as stored). Step t of a row holds positions 32 t .. 32 t + 31: q bytes 4 low t ..,
// qh bytes 4 high t .., all in block b = 32 t / qk, sub-blocks (32 t % qk) / sub.
// A position's value is y = bf16_rn(s c) or bf16_rn(s c + mn) with c the code's value:
//   raw r = lo | hi << low, then c = r - offset, or int8(r) (Q8_0), or KVALUES[r] (IQ4_*),
// and s, mn the sub-block's (sub_scale). s c is exact in float32 and so is mn, so the float32
// s c + mn is rounded once, whatever the order or FMA contraction; BF16 round to nearest
// even, NaN -> 0x7FFF (a NaN or infinite scale: the only way to a non-finite value).
#pragma once

#include <cstdint>
#include <cstring>

#include "gemm_core.h"

namespace md {
namespace {

typedef uint8_t v8b __attribute__((vector_size(8)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef int8_t v32c __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));

// ggml type ids (ggml.h)
enum GgmlType : int {
    kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11,
    kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23,
};

// Layout of ggml type kId (ops/gguf_planes.py's PACKED): elements per block, code bits in
// the q and qh planes, scale bytes per block, elements per scale, a min, the code offset.
template <int kId> struct Gguf;
#define MD_GGUF(ID, QK, LOW, HIGH, META, SUB, MIN, OFFSET)                          \
    template <> struct Gguf<ID> {                                                   \
        static constexpr int qk = QK, low = LOW, high = HIGH, meta = META, sub = SUB, \
                             offset = OFFSET;                                       \
        static constexpr bool has_min = MIN, signed8 = ID == kQ8_0,                 \
                              nonlinear = ID == kIQ4_NL || ID == kIQ4_XS;           \
    };
MD_GGUF(kQ4_0, 32, 4, 0, 2, 32, false, 8)
MD_GGUF(kQ4_1, 32, 4, 0, 4, 32, true, 0)
MD_GGUF(kQ5_0, 32, 4, 1, 2, 32, false, 16)
MD_GGUF(kQ5_1, 32, 4, 1, 4, 32, true, 0)
MD_GGUF(kQ8_0, 32, 8, 0, 2, 32, false, 0)
MD_GGUF(kQ2_K, 256, 2, 0, 20, 16, true, 0)
MD_GGUF(kQ3_K, 256, 2, 1, 14, 16, false, 4)
MD_GGUF(kQ4_K, 256, 4, 0, 16, 32, true, 0)
MD_GGUF(kQ5_K, 256, 4, 1, 16, 32, true, 0)
MD_GGUF(kQ6_K, 256, 4, 2, 18, 16, false, 32)
MD_GGUF(kIQ4_NL, 32, 4, 0, 2, 32, false, 0)
MD_GGUF(kIQ4_XS, 256, 4, 0, 8, 32, false, 0)
#undef MD_GGUF

// IQ4_NL / IQ4_XS: the non-linear grid (ggml-common.h kvalues_iq4nl)
constexpr int8_t kKValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                 1,    13,   25,  38,  53,  69,  89,  113};

// c(r) for every raw code r < 64 of type kId, as float32 (exact)
template <int kId>
struct CodeValues {
    alignas(64) float f[64];
    constexpr CodeValues() : f{} {
        using T = Gguf<kId>;
        for (int r = 0; r < 64; r++)
            f[r] = T::nonlinear ? float(kKValues[r & 15])
                   : T::signed8 ? float(r)   // (Q8_0 is computed, not looked up)
                                : float(r - T::offset);
    }
};
template <int kId> constexpr CodeValues<kId> kCodeValues{};

// FP16 bits -> float32, exactly (subnormals by an exact product).
inline float f16_at(const uint8_t *p) {
    const uint32_t h = uint32_t(p[0]) | uint32_t(p[1]) << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {
        const float f = float(man) * 5.9604644775390625e-08f;   // man 2^-24
        std::memcpy(&bits, &f, 4);
        bits |= sign;
    } else {
        bits = sign | (exp == 0x1Fu ? 0x7F800000u : (exp + 112u) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// s and mn (0 without a min) of sub-block j of the block whose meta bytes start at mb
// (ops/gguf_planes.py's sub_scales, the same float32 products).
template <int kId>
inline void sub_scale(const uint8_t *mb, int j, float &s, float &mn) {
    mn = 0.0f;
    if constexpr (kId == kQ4_0 || kId == kQ5_0 || kId == kQ8_0 || kId == kIQ4_NL) {
        s = f16_at(mb);
    } else if constexpr (kId == kQ4_1 || kId == kQ5_1) {
        s = f16_at(mb);
        mn = f16_at(mb + 2);
    } else if constexpr (kId == kQ2_K) {
        s = f16_at(mb + 16) * float(mb[j] & 15);
        mn = -(f16_at(mb + 18) * float(mb[j] >> 4));
    } else if constexpr (kId == kQ3_K) {   // ggml's kmask unpacking of 12 bytes into 16
        const int lo = j < 8 ? mb[j] & 15 : mb[j - 8] >> 4;
        const int hi = (mb[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
        s = f16_at(mb + 12) * float((lo | hi << 4) - 32);
    } else if constexpr (kId == kQ4_K || kId == kQ5_K) {   // get_scale_min_k4
        const uint8_t *q = mb + 4;
        const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        const int m6 = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        s = f16_at(mb) * float(sc);
        mn = -(f16_at(mb + 2) * float(m6));
    } else if constexpr (kId == kQ6_K) {
        s = f16_at(mb + 16) * float(int8_t(mb[j]));
    } else {   // IQ4_XS: d, scales_h (u16), scales_l[4]
        const int sh = mb[2] | mb[3] << 8;
        const int ls = ((mb[4 + j / 2] >> (4 * (j & 1))) & 15) | ((sh >> (2 * j)) & 3) << 4;
        s = f16_at(mb) * float(ls - 32);
    }
}

inline bool finite(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return (u & 0x7F800000u) != 0x7F800000u;
}

// Every sub-block's s and mn (256 / sub of each) of the 256-block whose meta bytes start at
// mb, d and dmin widened once: sub_scale's products, in vectors. Returns whether all are
// finite.
template <int kId>
inline bool block_scales(const uint8_t *mb, float *s, float *mn) {
    using T = Gguf<kId>;
    static_assert(T::qk == 256, "K-quants and IQ4_XS");
    float d, dmin = 0.0f;
    if constexpr (T::sub == 32) {
        v8i sc, m6 = {};
        if constexpr (kId == kIQ4_XS) {
            const int sh = mb[2] | mb[3] << 8;
            const v8i j2 = {0, 2, 4, 6, 8, 10, 12, 14};
            const v8i lo = {mb[4], mb[4], mb[5], mb[5], mb[6], mb[6], mb[7], mb[7]};
            const v8i nib = {0, 4, 0, 4, 0, 4, 0, 4};
            sc = (((lo >> nib) & 15) | (((v8i{} + sh) >> j2) & 3) << 4) - 32;
            d = f16_at(mb);
        } else {   // Q4_K, Q5_K: get_scale_min_k4 on 12 bytes at mb + 4
            const uint8_t *q = mb + 4;
            const v8i a = {q[0], q[1], q[2], q[3], q[8], q[9], q[10], q[11]};
            const v8i b = {0, 0, 0, 0, q[0], q[1], q[2], q[3]};
            const v8i c = {q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11]};
            const v8i e = {0, 0, 0, 0, q[4], q[5], q[6], q[7]};
            const v8i low = {63, 63, 63, 63, 15, 15, 15, 15}, sh = {0, 0, 0, 0, 4, 4, 4, 4};
            sc = (a & low) | ((b >> 6) << 4);
            m6 = ((c >> sh) & low) | ((e >> 6) << 4);
            d = f16_at(mb);
            dmin = f16_at(mb + 2);
        }
        const v8f vs = d * __builtin_convertvector(sc, v8f);
        const v8f vm = -(dmin * __builtin_convertvector(m6, v8f));
        std::memcpy(s, &vs, 32);
        std::memcpy(mn, &vm, 32);
    } else {
        v16i sc, m4 = {};
        if constexpr (kId == kQ2_K) {
            v16b b;
            std::memcpy(&b, mb, 16);
            const v16i w = __builtin_convertvector(b, v16i);
            sc = w & 15;
            m4 = w >> 4;
            d = f16_at(mb + 16);
            dmin = f16_at(mb + 18);
        } else if constexpr (kId == kQ3_K) {
            v8b b;
            std::memcpy(&b, mb, 8);
            const v16i lo = __builtin_convertvector(
                __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7), v16i);
            const v16i hi = {mb[8], mb[9], mb[10], mb[11], mb[8], mb[9], mb[10], mb[11],
                             mb[8], mb[9], mb[10], mb[11], mb[8], mb[9], mb[10], mb[11]};
            const v16i nib = {0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4};
            const v16i two = {0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6};
            sc = (((lo >> nib) & 15) | ((hi >> two) & 3) << 4) - 32;
            d = f16_at(mb + 12);
        } else {   // Q6_K: int8 scales
            v32c b;
            std::memcpy(&b, mb, 16);   // (the low 16 lanes)
            sc = __builtin_convertvector(
                __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                v16i);
            d = f16_at(mb + 16);
        }
        const v16f vs = d * __builtin_convertvector(sc, v16f);
        const v16f vm = -(dmin * __builtin_convertvector(m4, v16f));
        std::memcpy(s, &vs, 64);
        std::memcpy(mn, &vm, 64);
    }
    return finite(d) && finite(dmin);   // then every product is finite
}

// One row of W's planes.
struct GgufRow {
    const uint8_t *q, *qh, *meta;
};

// s and mn of step t's positions 0-15 (s0, m0) and 16-31 (s1, m1).
template <int kId>
inline void step_scales(const uint8_t *meta, int64_t t, float &s0, float &m0, float &s1,
                        float &m1) {
    using T = Gguf<kId>;
    const int64_t pos = 32 * t;
    const uint8_t *mb = meta + pos / T::qk * T::meta;
    const int j = int(pos % T::qk / T::sub);
    sub_scale<kId>(mb, j, s0, m0);
    if constexpr (T::sub == 16) sub_scale<kId>(mb, j + 1, s1, m1);
    else s1 = s0, m1 = m0;
}

// 2-bit fields of 8 bytes (4 a byte from bit 0) for the even (lane l: position 2l) and odd
// positions of 32
inline void two_bit_fields(const uint8_t *p, v16u &even, v16u &odd) {
    v8b b;
    std::memcpy(&b, p, 8);
    const v16u w = __builtin_convertvector(
        __builtin_shufflevector(b, b, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), v16u);
    const v16u sh = {0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4};
    even = (w >> sh) & 3u;
    odd = (w >> (sh + 2u)) & 3u;
}

// Raw codes r of step t's even and odd positions (lane l: positions 2l, 2l + 1).
template <int kId>
inline void raw_codes(const GgufRow &row, int64_t t, v16i &even, v16i &odd) {
    using T = Gguf<kId>;
    v16u e, o;
    if constexpr (T::low == 4) {
        v16b b;
        std::memcpy(&b, row.q + 16 * t, 16);
        const v16u w = __builtin_convertvector(b, v16u);
        e = w & 15u;
        o = w >> 4;
    } else if constexpr (T::low == 2) {
        two_bit_fields(row.q + 8 * t, e, o);
    } else {   // 8 bits, signed
        v32c b;
        std::memcpy(&b, row.q + 32 * t, 32);
        even = __builtin_convertvector(__builtin_shufflevector(b, b, 0, 2, 4, 6, 8, 10, 12, 14,
                                                               16, 18, 20, 22, 24, 26, 28, 30),
                                       v16i);
        odd = __builtin_convertvector(__builtin_shufflevector(b, b, 1, 3, 5, 7, 9, 11, 13, 15,
                                                              17, 19, 21, 23, 25, 27, 29, 31),
                                      v16i);
        return;
    }
    if constexpr (T::high == 1) {
        uint32_t u;
        std::memcpy(&u, row.qh + 4 * t, 4);
        const v16u uu = v16u{} + u;
        const v16u sh = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
        e |= ((uu >> sh) & 1u) << T::low;
        o |= ((uu >> (sh + 1u)) & 1u) << T::low;
    } else if constexpr (T::high == 2) {
        v16u he, ho;
        two_bit_fields(row.qh + 8 * t, he, ho);
        e |= he << T::low;
        o |= ho << T::low;
    }
    even = reinterpret_cast<v16i>(e);
    odd = reinterpret_cast<v16i>(o);
}

// float32 lanes rounded to BF16 (nearest even) as float32 bit patterns, NaN -> 0x7FFF0000
inline v16u bf16_bits_hi(v16f v) {
    const v16u u = reinterpret_cast<v16u>(v);
    const v16u r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    const v16i nan = reinterpret_cast<v16i>(u & 0x7FFFFFFFu) > int32_t(0x7F800000);
    return (r & ~reinterpret_cast<v16u>(nan)) | (0x7FFF0000u & reinterpret_cast<v16u>(nan));
}

// Step t's 32 BF16 words (word l = position 2l | position 2l + 1 << 16): the reference.
template <int kId>
inline v16u step_words(const GgufRow &row, int64_t t) {
    using T = Gguf<kId>;
    v16i re, ro;
    raw_codes<kId>(row, t, re, ro);
    v16f ce, co;
    if constexpr (T::nonlinear) {
        const v16i grid = {-127, -104, -83, -65, -49, -35, -22, -10,
                           1,    13,   25,  38,  53,  69,  89,  113};
        ce = __builtin_convertvector(__builtin_shuffle(grid, re & 15), v16f);
        co = __builtin_convertvector(__builtin_shuffle(grid, ro & 15), v16f);
    } else {
        ce = __builtin_convertvector(re - T::offset, v16f);
        co = __builtin_convertvector(ro - T::offset, v16f);
    }
    float s0, m0, s1, m1;
    step_scales<kId>(row.meta, t, s0, m0, s1, m1);
    // lanes 0-7 hold positions 0-15, lanes 8-15 positions 16-31
    const v16f s = {s0, s0, s0, s0, s0, s0, s0, s0, s1, s1, s1, s1, s1, s1, s1, s1};
    v16f ye = s * ce, yo = s * co;
    if constexpr (T::has_min) {
        const v16f mn = {m0, m0, m0, m0, m0, m0, m0, m0, m1, m1, m1, m1, m1, m1, m1, m1};
        ye += mn;
        yo += mn;
    }
    return (bf16_bits_hi(ye) >> 16) | bf16_bits_hi(yo);
}

}  // namespace
}  // namespace md
