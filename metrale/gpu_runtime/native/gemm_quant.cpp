// The dequantizing GEMM twin computed natively (metrale/ops/gemm_q.py): gemm_f32.cpp's
// formula on W = dequant(packed W), with the dequantization inside the tile's W loads, so
// W is read from memory as packed (4 bits or 1 byte a weight: decode on a CPU is bound by
// the bytes it reads, as on a GPU) and the same bits come out as gemm_f32.cpp on the
// dequantized BF16 W (tests/ops/test_gemm_q.py compares every build with numpy).
//
// Dequantization (the formulas of kernels/gemm_q.cu), for the 16 lanes of one step:
//   4-bit  w = bf16_rn((q - z) * s): the 16 bytes of a 32-position block hold positions 2l
//          (low nibble) and 2l + 1 (high nibble) in byte l, so lane l's code of the odd step
//          is byte l >> 4 and of the even step byte l & 15; (q - z) * s is exact in float32
//          (FP16 scale, 5-bit difference), so only the BF16 rounding rounds.
//   FP8    w = bf16_rn(f32_rn(e4m3(q) * s)): the 32 bytes of a block as 16 byte pairs, lane
//          l's code of the odd step the pair's high byte, of the even step its low byte;
//          e4m3 widened exactly (all its values are normal float32s), one float32 product.
// Both run inside the job's FlushScope: every value is a normal float32 or zero (4-bit: |s| >=
// 2^-24 as FP16; FP8: the loader refuses scales whose products could be subnormal), so FTZ
// and DAZ cannot change a bit. Positions past k give +0. Act-order (a group per position)
// takes a scalar path.
#include "gemm_dp_view.h"   // gemm_core.h, and the AVX-512 BF16 decode tiles

namespace md {
namespace {

typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef uint16_t v8h __attribute__((vector_size(16)));

// The dequantization works on two 8-lane halves (one AVX2 register each), stored and loaded
// back as the 16 lanes of a step (store-to-load forwarded): GCC lowers 16-lane vectors
// built from narrower loads, or joined with a shuffle, into scalar inserts and extracts on
// AVX2 (3-6x slower end to end).
inline v16u join(v8u lo, v8u hi) {
    alignas(64) v8u buf[2] = {lo, hi};
    v16u r;
    std::memcpy(&r, buf, 64);
    return r;
}

// 8 bytes / 8 little-endian uint16 at p, zero-extended to 8 lanes.
inline v8u widen8_u8(const uint8_t *p) {
#if defined(__AVX2__) && defined(MD_MXCSR)
    return reinterpret_cast<v8u>(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
#else
    v8b b;
    std::memcpy(&b, p, 8);
    return __builtin_convertvector(b, v8u);
#endif
}

inline v8u widen8_u16(const uint8_t *p) {
#if defined(__AVX2__) && defined(MD_MXCSR)
    return reinterpret_cast<v8u>(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
#else
    v8h h;
    std::memcpy(&h, p, 16);
    return __builtin_convertvector(h, v8u);
#endif
}

// FP16 bits -> float32, exactly (inlined: a call inside a tile would spill its registers).
__attribute__((always_inline)) inline float half_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {
        int e = 113;
        while ((mant & 0x400u) == 0) {
            mant <<= 1;
            --e;
        }
        bits = sign | (uint32_t(e) << 23) | ((mant & 0x3FFu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// float32 lanes rounded to BF16 (nearest even), as float32 bit patterns (low 16 bits 0);
// with kNaN, a NaN becomes 0x7FFF0000 (the canonical BF16 NaN; 4-bit values are finite).
template <bool kNaN>
inline v8u bf16_high(v8f v) {
    const v8u u = reinterpret_cast<v8u>(v);
    const v8u r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    if constexpr (!kNaN) return r;
    const v8u nan = reinterpret_cast<v8u>(reinterpret_cast<v8i>(u & 0x7FFFFFFFu) >
                                          int32_t(0x7F800000));
    return (r & ~nan) | (0x7FFF0000u & nan);
}

inline v8u blend(v8u mask, v8u a, v8u b) { return (a & mask) | (b & ~mask); }
inline v8f splat(float f) { return v8f{} + f; }

// Lanes whose position 32 blk + 2l + (H == 0) is at or past k set to +0.
template <int H>
inline v16u mask_past_k(v16u hb, int64_t blk, int64_t k) {
    if (32 * blk + 32 <= k) return hb;
    v16u keep;
    for (int l = 0; l < 16; l++) keep[l] = 32 * blk + 2 * l + (H == 0) < k ? ~0u : 0u;
    return hb & keep;
}


#if defined(MD_DP)
// a / d for a >= 0: a shift when d is a power of two (group and block sizes are; a 64-bit
// division per block and column cost more than the block's dequantization)
inline int64_t div_pow2(int64_t a, int64_t d) {
    return (d & (d - 1)) == 0 ? a >> __builtin_ctzll(uint64_t(d)) : a / d;
}

// AVX-512 BF16 (DpStep: a step is a whole 32-position block as BF16 words, word l =
// positions 2l | 2l + 1 << 16): the block's words from 512-bit permutes and conversions
// instead of four 8-lane dequantizations, with the same bits (RNE to BF16 of the same
// float32 value; the tests compare this build with numpy).

// c - z for every uint8 zero z: the 16 floats from 255 - z are -z .. 15 - z (exact).
struct CodeMinusZero {
    float f[271];
    constexpr CodeMinusZero() : f{} {
        for (int i = 0; i < 271; i++) f[i] = float(i - 255);
    }
};
constexpr CodeMinusZero kCodeMinusZero{};

// 4-bit, one (row, group): its 16 values bf16_rn((c - z) s) as words c and c + 16 of a
// table (c - z in one load, s widened from FP16 in every lane, both halves from one
// vcvtne2ps2bf16). (c - z) s is finite and exact, so the RNE is the only rounding.
inline __m512i q4_table(uint16_t scale_bits, uint8_t zero) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(kCodeMinusZero.f + 255 - zero),
                                   _mm512_cvtph_ps(_mm256_set1_epi16(int16_t(scale_bits))));
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v, v));
}

// The block of 32 codes at p through its group's q4_table: q4_nibble_words as word indices
// (vpermw reads 5 bits: the next nibble's lowest bit rides along, and the table's copy at
// + 16 makes it harmless), one vpermw (3 operations; shift-and-or of widened bytes took 4,
// ~10% slower at m = 1).
inline v16u q4_block_words(const uint8_t *p, __m512i table) {
    return reinterpret_cast<v16u>(_mm512_permutexvar_epi16(q4_nibble_words(p), table));
}

// FP8, one scale for the block: e4m3 -> FP16 bits in place (gemm_avx2 F8x8's mapping, 2^-8
// times the value, subnormals included), widened exactly, times 256 (exact), times s (the
// one float32 rounding), RNE to BF16 by vcvtne2ps2bf16; NaN codes give 0x7FFF as
// bf16_high<true> does.
inline v16u fp8_block_words(const uint8_t *p, float s) {
    const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
    const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi16(0x7F));
    const __m512i h = _mm512_or_si512(
        _mm512_slli_epi16(mag, 7), _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8));
    const __m512 k256 = _mm512_set1_ps(256.f), sv = _mm512_set1_ps(s);
    const __m512 lo = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), k256), sv);
    const __m512 hi = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), k256), sv);
    const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);   // lo's 16 words first
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F));
    return reinterpret_cast<v16u>(_mm512_mask_mov_epi16(w, nan, _mm512_set1_epi16(0x7FFF)));
}
#endif

#if defined(MD_AVX2)
// AVX2 + FMA: gemm_avx2.h's tiles take W through a view of each source (Q4x8, F8x8 below)
// that gives the 8 float32 lanes of one step and lane half, dequantized in registers. Each
// lane step is the same FMA on the same operands as in `tile`, so the bits are the same
// (the tests compare this build with numpy).

// Lanes of positions at or past k set to +0 (pos0: the position of lane 0, step 2).
inline __m256 zero_past_k(__m256 v, int64_t pos0, int64_t k) {
    const __m256i pos = _mm256_add_epi32(_mm256_set1_epi32(int(pos0)),
                                         _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(k)), pos)));
}
#endif

// Step s of a row from a source's half_bits<H>(row, blk) (BF16 bits of the block's odd
// (H = 0) or even (H = 1) positions in the high halves of the lanes): DpStep takes both
// halves as one block of BF16 pairs, the float32 steps the one they need.
template <class S, class Src>
inline v16f step_of(const Src &src, int64_t row, int64_t s) {
    if constexpr (S::kPerBlock == 1) {
        const v16u odd = src.template half_bits<0>(row, s), even = src.template half_bits<1>(row, s);
        return S::from_bits((even >> 16) | odd, 0);
    } else {
        const int64_t blk = s >> 1;
        if (s & 1) return S::from_bits(src.template half_bits<1>(row, blk) >> 16, 1);
        return S::from_bits(src.template half_bits<0>(row, blk), 0);
    }
}

// 4-bit W: q [n, row_bytes] (32 codes per 16 bytes), scales FP16 [n, groups], zeros uint8
// [n, groups]; act-order: gidx int32 [parts, k] with gidx_row int32 [n] (row j's groups
// are gidx[gidx_row[j]]), or both null (group k / group_size, group_size % 8 == 0).
template <class S>
struct WQ4 {
    const uint8_t *q;
    const uint16_t *scales;
    const uint8_t *zeros;
    const int32_t *gidx, *gidx_row;
    int64_t row_bytes, groups, group_size, k;

    WQ4 rows(int64_t r0) const {
        return {q + r0 * row_bytes, scales + r0 * groups, zeros + r0 * groups, gidx,
                gidx_row ? gidx_row + r0 : nullptr, row_bytes, groups, group_size, k};
    }
    const int32_t *table(int64_t row) const {
        return gidx ? gidx + int64_t(gidx_row[row]) * k : nullptr;
    }
    // row's stream ahead of step s, in a tile of c rows
    void prefetch(int64_t row, int64_t s, int c) const {
        prefetch_at(q, stream_ahead(row, s / S::kPerBlock, c, (k + 31) / 32, 16, row_bytes));
    }
    // (q - z) * s of 8 lanes (bytes b: position 2l in the low nibble, 2l + 1 in the high)
    template <int H>
    static v8u dq8(v8u b, v8f z, v8f sc) {
        const v8u codes = H == 0 ? (b >> 4) : (b & 15u);
        return bf16_high<false>((__builtin_convertvector(reinterpret_cast<v8i>(codes), v8f) - z) * sc);
    }
    template <int H>
    v16u half_bits(int64_t row, int64_t blk) const {
        const uint8_t *p = q + row * row_bytes + 16 * blk;
        const uint16_t *srow = scales + row * groups;
        const uint8_t *zrow = zeros + row * groups;
        v16u hb;
        if (gidx == nullptr && group_size % 32 == 0) {   // one group for the block
            const int64_t g = 32 * blk / group_size;
            const v8f sc = splat(half_to_f32(srow[g])), z = splat(float(zrow[g]));
            hb = join(dq8<H>(widen8_u8(p), z, sc), dq8<H>(widen8_u8(p + 8), z, sc));
        } else {                                          // a group per lane
            alignas(32) float sc[16], z[16];
            for (int l = 0; l < 16; l++) {
                const int64_t pos = std::min(32 * blk + 2 * l + (H == 0), k - 1);
                const int64_t g = gidx ? int64_t(table(row)[pos]) : pos / group_size;
                sc[l] = half_to_f32(srow[g]);
                z[l] = float(zrow[g]);
            }
            v8f s0, s1, z0, z1;
            std::memcpy(&s0, sc, 32);
            std::memcpy(&s1, sc + 8, 32);
            std::memcpy(&z0, z, 32);
            std::memcpy(&z1, z + 8, 32);
            hb = join(dq8<H>(widen8_u8(p), z0, s0), dq8<H>(widen8_u8(p + 8), z1, s1));
        }
        return mask_past_k<H>(hb, blk, k);   // (q - z) * s exact: one rounding, to BF16
    }
    // (the fast path inlined into the tile, the general one called: inlined as well, its
    // registers and stack frame made every load a heavy call)
    __attribute__((noinline)) v16f load_general(int64_t row, int64_t s) const {
        return step_of<S>(*this, row, s);
    }
    __attribute__((always_inline)) v16f load(int64_t row, int64_t s) const {
#if defined(MD_DP)
        if constexpr (std::is_same_v<S, DpStep>)   // a whole block, one group: q4_block_words
            if (gidx == nullptr && group_size % 32 == 0 && 32 * s + 32 <= k) {
                const int64_t g = row * groups + div_pow2(32 * s, group_size);
                return S::from_bits(q4_block_words(q + row * row_bytes + 16 * s,
                                                   q4_table(scales[g], zeros[g])), 0);
            }
#endif
        return load_general(row, s);
    }

};

// float8_e4m3fn W: q [n, row_bytes] (32 codes per 32 bytes), scales float32 [rows,
// k_blocks], scale_row int32 [n] (block_k % 8 == 0).
template <class S>
struct WF8 {
    const uint8_t *q;
    const float *scales;
    const int32_t *scale_row;
    int64_t row_bytes, k_blocks, block_k, k;

    WF8 rows(int64_t r0) const {
        return {q + r0 * row_bytes, scales, scale_row + r0, row_bytes, k_blocks, block_k, k};
    }
    // row's stream ahead of step s, in a tile of c rows
    void prefetch(int64_t row, int64_t s, int c) const {
        prefetch_at(q, stream_ahead(row, s / S::kPerBlock, c, (k + 31) / 32, 32, row_bytes));
    }
    // e4m3(code) * s of 8 lanes (byte pairs: position 2l low, 2l + 1 high), one rounding
    // to float32: normal 2^(e-7) (1 + m/8) as float32 bits, e = 0: m 2^-9 (a normal float32)
    template <int H>
    static v8u dq8(v8u pairs, v8f sc) {
        const v8u c = H == 0 ? (pairs >> 8) : (pairs & 0xFFu);
        const v8u sign = (c & 0x80u) << 24, e = (c >> 3) & 15u, m = c & 7u;
        const v8u normal = sign | ((e + 120u) << 23) | (m << 20);
        const v8f sub = __builtin_convertvector(reinterpret_cast<v8i>(m), v8f) * 0x1p-9f;
        v8u bits = blend(reinterpret_cast<v8u>(e == 0u), reinterpret_cast<v8u>(sub) | sign, normal);
        bits = blend(reinterpret_cast<v8u>((c & 0x7Fu) == 0x7Fu), v8u{} + 0x7FC00000u, bits);
        return bf16_high<true>(reinterpret_cast<v8f>(bits) * sc);
    }
    template <int H>
    v16u half_bits(int64_t row, int64_t blk) const {
        const uint8_t *p = q + row * row_bytes + 32 * blk;
        const float *srow = scales + int64_t(scale_row[row]) * k_blocks;
        v16u hb;
        if (block_k % 32 == 0) {
            const v8f sc = splat(srow[32 * blk / block_k]);
            hb = join(dq8<H>(widen8_u16(p), sc), dq8<H>(widen8_u16(p + 16), sc));
        } else {
            alignas(32) float sc[16];
            for (int l = 0; l < 16; l++) sc[l] = srow[std::min(32 * blk + 2 * l, k - 1) / block_k];
            v8f s0, s1;
            std::memcpy(&s0, sc, 32);
            std::memcpy(&s1, sc + 8, 32);
            hb = join(dq8<H>(widen8_u16(p), s0), dq8<H>(widen8_u16(p + 16), s1));
        }
        return mask_past_k<H>(hb, blk, k);
    }
    __attribute__((noinline)) v16f load_general(int64_t row, int64_t s) const {
        return step_of<S>(*this, row, s);
    }
    __attribute__((always_inline)) v16f load(int64_t row, int64_t s) const {
#if defined(MD_DP)
        if constexpr (std::is_same_v<S, DpStep>)   // a whole block, one scale: fp8_block_words
            if (block_k % 32 == 0 && 32 * s + 32 <= k)
                return S::from_bits(fp8_block_words(q + row * row_bytes + 32 * s,
                                                    scales[int64_t(scale_row[row]) * k_blocks +
                                                           div_pow2(32 * s, block_k)]), 0);
#endif
        return load_general(row, s);
    }

};

#if defined(MD_AVX2)
// gemm_avx2.h's view of 4-bit W. kTable (no act-order, group_size % 32 == 0): the 16
// values of a (row, group), (c - z) * s exact, rounded to BF16 once, kept as two vpshufb
// tables (their low and high bytes); a block's lane half becomes BF16 word pairs (lane i:
// position 2i low, 2i + 1 high, as W's own BF16 bits) in 10 operations for 16 weights,
// and each step takes its half as Bits8 does. Otherwise (act-order, other group sizes)
// the values are computed per lane. A view per path, so the tile's loop carries no
// branch to the other.
template <bool kTable>
struct Q4x8 {
    WQ4<FmaStep> w;
    float *rows_f32 = nullptr;   // !kTable: 8 slots of a row's scales and zeros as float32
    struct State {
        __m256i tl, th;   // kTable: low and high bytes of the 16 values, in both 128-bit lanes
        __m256i pairs;    // the word pairs of the (blk, L) of the last half8<0, L>
        const float *s = nullptr, *z = nullptr;   // !kTable: the row's groups, in rows_f32
    };
    Q4x8 rows(int64_t r0) const { return {w.rows(r0), rows_f32}; }
    int64_t full_blocks() const { return w.k / 32; }
    void prefetch(int64_t row, int64_t s, int c) const {
        prefetch_at<3>(w.q, tile_after_next(row, s, c, w.row_bytes, 16));
    }
    // the blocks from blk that share one group (kTable), else all of them
    int64_t chunk_end(int64_t blk, int64_t b1) const {
        return kTable ? std::min(b1, (32 * blk / w.group_size + 1) * w.group_size / 32) : b1;
    }
    __attribute__((always_inline)) void refresh(int64_t row, int64_t blk, State &st) const {
        if constexpr (kTable) {
            const int64_t g = row * w.groups + 32 * blk / w.group_size;
            const __m256 sc = _mm256_set1_ps(half_to_f32(w.scales[g]));
            const __m256 cz = _mm256_sub_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_ps(float(w.zeros[g])));
            const __m256i lo = _mm256_castps_si256(bf16_round8(_mm256_mul_ps(cz, sc)));
            const __m256i hi = _mm256_castps_si256(
                bf16_round8(_mm256_mul_ps(_mm256_add_ps(cz, _mm256_set1_ps(8.f)), sc)));
            // BF16 words of codes 0-3, 8-11 | 4-7, 12-15 -> 0-7 | 8-15 -> bytes: low bytes
            // of 0-7, high bytes of 0-7 | the same of 8-15 -> [low 0-15 | high 0-15]
            __m256i words = _mm256_packus_epi32(_mm256_srli_epi32(lo, 16), _mm256_srli_epi32(hi, 16));
            words = _mm256_permute4x64_epi64(words, 0xD8);
            const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                   0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
            const __m256i bytes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(words, split), 0xD8);
            st.tl = _mm256_permute2x128_si256(bytes, bytes, 0x00);
            st.th = _mm256_permute2x128_si256(bytes, bytes, 0x11);
        } else {   // the row's groups widened once (slot row % 8: a tile has <= 8 rows)
            float *d = rows_f32 + (row & 7) * 2 * w.groups;
            for (int64_t g = 0; g < w.groups; g++) {
                d[g] = half_to_f32(w.scales[row * w.groups + g]);
                d[w.groups + g] = float(w.zeros[row * w.groups + g]);
            }
            st.s = d;
            st.z = d + w.groups;
        }
    }
    // lanes 8L..8L+7 of step 2 blk + P: bytes 8L..8L+7 of the block, high nibbles (P = 0)
    // or low. half8<0, L> before half8<1, L> of the same block (the tile's order).
    template <int P, int L, bool kTail>
    __attribute__((always_inline)) __m256 half8(int64_t row, int64_t blk, State &st) const {
        const uint8_t *p = w.q + row * w.row_bytes + 16 * blk + 8 * L;
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
        __m256 v;
        if constexpr (kTable) {
            if constexpr (P == 0) {   // vpshufb indices [lo, -, hi, -] and [-, lo, -, hi]
                const __m256i t = _mm256_or_si256(b, _mm256_slli_epi32(b, 12));
                const __m256i il = _mm256_or_si256(_mm256_and_si256(t, _mm256_set1_epi32(0x000F000F)),
                                                   _mm256_set1_epi32(int(0x80008000u)));
                const __m256i ih = _mm256_or_si256(_mm256_slli_epi32(il, 8), _mm256_set1_epi32(0x80));
                st.pairs = _mm256_or_si256(_mm256_shuffle_epi8(st.tl, il), _mm256_shuffle_epi8(st.th, ih));
            }
            v = widen_words<P>(st.pairs);
        } else {   // a group per lane: (c - z) * s computed, s and z gathered by group
            const __m256i c = P == 0 ? _mm256_srli_epi32(b, 4) : b;
            __m256i pos = _mm256_add_epi32(_mm256_set1_epi32(int(32 * blk + 16 * L + (P == 0))),
                                           _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
            if constexpr (kTail) pos = _mm256_min_epi32(pos, _mm256_set1_epi32(int(w.k - 1)));
            __m256i g;
            if (w.gidx) {
                g = _mm256_i32gather_epi32(w.table(row), pos, 4);
            } else {
                alignas(32) int32_t gl[8];
                _mm256_store_si256(reinterpret_cast<__m256i *>(gl), pos);
                for (int l = 0; l < 8; l++) gl[l] = int32_t(gl[l] / w.group_size);
                g = _mm256_load_si256(reinterpret_cast<const __m256i *>(gl));
            }
            const __m256 cf = _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15)));
            v = bf16_round8(_mm256_mul_ps(_mm256_sub_ps(cf, _mm256_i32gather_ps(st.z, g, 4)),
                                          _mm256_i32gather_ps(st.s, g, 4)));
        }
        if constexpr (kTail) v = zero_past_k(v, 32 * blk + 16 * L + (P == 0), w.k);
        return v;
    }
};

template <class F>
void visit8(const WQ4<FmaStep> &w, F &&f) {
    if (w.gidx == nullptr && w.group_size % 32 == 0) return f(Q4x8<true>{w});
    std::vector<float> rows_f32(size_t(16 * w.groups));   // this thread's 8 slots
    f(Q4x8<false>{w, rows_f32.data()});
}

// gemm_avx2.h's view of FP8 W. e4m3 -> FP16 bits in place (sign, then the 7 bits below it
// as FP16 exponent and mantissa: 2^-8 times the value, subnormals included), widened
// exactly by vcvtph2ps, times 256 (exact), times s (the one FP32 rounding), to BF16.
// kBlock (block_k % 32 == 0): one scale per chunk of blocks, else one per lane.
template <bool kBlock>
struct F8x8 {
    WF8<FmaStep> w;
    struct State {
        __m256 s;
    };
    F8x8 rows(int64_t r0) const { return {w.rows(r0)}; }
    int64_t full_blocks() const { return w.k / 32; }
    void prefetch(int64_t row, int64_t s, int c) const {
        prefetch_at<3>(w.q, tile_after_next(row, s, c, w.row_bytes, 32));
    }
    int64_t chunk_end(int64_t blk, int64_t b1) const {
        return kBlock ? std::min(b1, (32 * blk / w.block_k + 1) * w.block_k / 32) : b1;
    }
    __attribute__((always_inline)) void refresh(int64_t row, int64_t blk, State &st) const {
        if constexpr (kBlock)
            st.s = _mm256_set1_ps(
                w.scales[int64_t(w.scale_row[row]) * w.k_blocks + 32 * blk / w.block_k]);
    }
    // lanes 8L..8L+7 of step 2 blk + P: byte pairs 8L..8L+7 of the block, high bytes
    // (P = 0) or low
    template <int P, int L, bool kTail>
    __attribute__((always_inline)) __m256 half8(int64_t row, int64_t blk, State &st) const {
        const __m128i pr = _mm_loadu_si128(reinterpret_cast<const __m128i *>(
            w.q + row * w.row_bytes + 32 * blk + 16 * L));
        const __m128i c = P == 0 ? _mm_srli_epi16(pr, 8) : _mm_and_si128(pr, _mm_set1_epi16(0xFF));
        const __m128i mag = _mm_and_si128(c, _mm_set1_epi16(0x7F));
        __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7),
                                 _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8));
        h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F)));
        __m256 sc;
        if constexpr (kBlock) {
            sc = st.s;
        } else {
            const float *srow = w.scales + int64_t(w.scale_row[row]) * w.k_blocks;
            alignas(32) float s8[8];
            for (int l = 0; l < 8; l++)
                s8[l] = srow[std::min(32 * blk + 16 * L + 2 * l, w.k - 1) / w.block_k];
            sc = _mm256_load_ps(s8);
        }
        __m256 v = bf16_round8(_mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(h),
                                                           _mm256_set1_ps(256.f)), sc));
        if constexpr (kTail) v = zero_past_k(v, 32 * blk + 16 * L + (P == 0), w.k);
        return v;
    }
};

template <class F>
void visit8(const WF8<FmaStep> &w, F &&f) {
    if (w.block_k % 32 == 0) f(F8x8<true>{w});
    else f(F8x8<false>{w});
}
#endif

Out out_of(float *y32, uint16_t *ybf16, int64_t n) { return Out{y32, ybf16, n}; }

}  // namespace
}  // namespace md

#include "gemm_quant_dp.h"   // decode with AVX-512 BF16: W's values from per-chunk tables

extern "C" {

// y [m, n] = x [m, k] @ dequant_q4(W)^T: float32 into y32, or BF16 bits into ybf16 (one of
// the two non-null). q: [n, (k + 31) / 32 * 16] bytes; gidx, gidx_row null unless
// act-order.
__attribute__((visibility("default"))) void md_gemm_q4(
    const uint16_t *x, const uint8_t *q, const uint16_t *scales, const uint8_t *zeros,
    const int32_t *gidx, const int32_t *gidx_row, int64_t m, int64_t n, int64_t k,
    int64_t groups, int64_t group_size, float *y32, uint16_t *ybf16) {
    const int64_t row_bytes = (k + 31) / 32 * 16;
    md::gemm_any(x, m, n, k, md::out_of(y32, ybf16, n), [&](auto step) {
        return md::WQ4<decltype(step)>{q, scales, zeros, gidx, gidx_row, row_bytes, groups,
                                       group_size, k};
    });
}

// y [m, n] = x [m, k] @ dequant_fp8(W)^T (as md_gemm_q4). q: [n, (k + 31) / 32 * 32] bytes.
__attribute__((visibility("default"))) void md_gemm_fp8(
    const uint16_t *x, const uint8_t *q, const float *scales, const int32_t *scale_row,
    int64_t m, int64_t n, int64_t k, int64_t k_blocks, int64_t block_k, float *y32,
    uint16_t *ybf16) {
    const int64_t row_bytes = (k + 31) / 32 * 32;
    md::gemm_any(x, m, n, k, md::out_of(y32, ybf16, n), [&](auto step) {
        return md::WF8<decltype(step)>{q, scales, scale_row, row_bytes, k_blocks, block_k, k};
    });
}

}  // extern "C"
