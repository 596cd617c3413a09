// GGUF W with AVX-512 BF16 (VBMI), included by gemm_gguf.cpp: a 32-position step's BF16
// words from 512-bit lookups and conversions (dp_words), the same bits as
// gemm_gguf_types.h's step_words, and the decode view of gemm_dp_view.h's tiles.
//   4-bit and 5-bit codes, one scale for the step (Q4_0, Q4_1, IQ4_NL, Q4_K, IQ4_XS; Q5_0,
//     Q5_1, Q5_K): a table of the 16 (32) values bf16_rn(s c(r) + mn) from one FMA (two) and
//     one vcvtne2ps2bf16, then one vpermw on the codes as word indices (q4_nibble_words; the
//     fifth bit from the qh plane's 32 bits as a mask);
//   2-bit and 3-bit codes, two scales for the step (Q2_K, Q3_K: sub-blocks of 16): one table,
//     words 0-15 for the first sub-block, 16-31 for the second, the index's bit 4 the half;
//   Q8_0 and Q6_K (256 and 64 codes): the codes widened to float32, one product a lane.
// Finite scales only (their values are then finite: |s c + mn| < 2^27); a step whose scales
// are not takes step_words (NaN -> 0x7FFF), so the fast path needs no NaN fix.
#pragma once

#if defined(MD_DP)

namespace md {
namespace {

// vpmultishiftqb controls for 8 bytes widened to qwords: word i (< 4) of qword q gets the
// 2-bit field i of byte q at bits 0-1 (kTwoBits) or at bits 4-5 (kTwoBitsHigh, Q6_K's high
// bits), more bits above (masked), high bytes 0.
constexpr long long kTwoBits = 0x0806080408020800LL;
constexpr long long kTwoBitsHigh = 0x08020800083E083CLL;

inline __m512i two_bit_words(const uint8_t *p, long long control) {
    const __m512i bytes = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
    return _mm512_multishift_epi64_epi8(_mm512_set1_epi64(control), bytes);
}

// words 16-31: 16 (the second sub-block's half of a table)
struct HalfIndex {
    alignas(64) uint16_t w[32];
    constexpr HalfIndex() : w{} {
        for (int i = 16; i < 32; i++) w[i] = 16;
    }
};
constexpr HalfIndex kHalfIndex{};

// s c + mn (s c without a min: a zero keeps the sign of s c) for 16 float32 codes c
template <bool kMin>
inline __m512 scaled(__m512 c, float s, float mn) {
    if constexpr (kMin) return _mm512_fmadd_ps(c, _mm512_set1_ps(s), _mm512_set1_ps(mn));
    return _mm512_mul_ps(c, _mm512_set1_ps(s));
}

// 16 int16 words (the low or high half of w) as float32
template <int H>
inline __m512 words_f32(__m512i w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
        H == 0 ? _mm512_castsi512_si256(w) : _mm512_extracti64x4_epi64(w, 1)));
}

// Step t's 32 BF16 words for finite scales (s0, m0: positions 0-15; s1, m1: 16-31).
template <int kId>
__attribute__((always_inline)) inline v16f dp_words(const GgufRow &row, int64_t t, float s0,
                                                    float m0, float s1, float m1) {
    using T = Gguf<kId>;
    const float *cv = kCodeValues<kId>.f;
    __m512 lo, hi;
    if constexpr (kId == kQ8_0) {
        const __m128i *p = reinterpret_cast<const __m128i *>(row.q + 32 * t);
        lo = scaled<false>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))), s0, 0);
        hi = scaled<false>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))), s0, 0);
    } else if constexpr (kId == kQ6_K) {   // (lo | hi << 4) - 32, computed
        const __m512i r = _mm512_sub_epi16(
            _mm512_ternarylogic_epi32(q4_nibble_words(row.q + 16 * t), _mm512_set1_epi16(15),
                                      _mm512_and_si512(two_bit_words(row.qh + 8 * t, kTwoBitsHigh),
                                                       _mm512_set1_epi16(0x30)),
                                      0xEA),   // (a & b) | c
            _mm512_set1_epi16(32));
        lo = scaled<false>(words_f32<0>(r), s0, 0);
        hi = scaled<false>(words_f32<1>(r), s1, 0);
    } else {   // a table of 32 words and one vpermw
        __m512i idx;
        if constexpr (T::low == 4) {
            idx = q4_nibble_words(row.q + 16 * t);   // bit 4 the next nibble's: masked below
            lo = scaled<T::has_min>(_mm512_load_ps(cv), s0, m0);
            if constexpr (T::high == 1) {
                uint32_t bits;
                std::memcpy(&bits, row.qh + 4 * t, 4);
                idx = _mm512_ternarylogic_epi32(idx, _mm512_set1_epi16(15),
                                                _mm512_maskz_set1_epi16(__mmask32(bits), 16), 0xEA);
                hi = scaled<T::has_min>(_mm512_load_ps(cv + 16), s0, m0);
            } else {
                hi = lo;   // words 16-31 repeat 0-15: the stray bit 4 is harmless
            }
        } else {   // 2 low bits (and Q3_K's high bit as 4), sub-blocks of 16
            __m512i half = _mm512_load_si512(kHalfIndex.w);
            if constexpr (T::high == 1) {
                uint32_t bits;
                std::memcpy(&bits, row.qh + 4 * t, 4);
                half = _mm512_mask_add_epi16(half, __mmask32(bits), half, _mm512_set1_epi16(4));
            }
            idx = _mm512_ternarylogic_epi32(two_bit_words(row.q + 8 * t, kTwoBits),
                                            _mm512_set1_epi16(3), half, 0xEA);
            lo = scaled<T::has_min>(_mm512_load_ps(cv), s0, m0);
            hi = scaled<T::has_min>(_mm512_load_ps(cv), s1, m1);
        }
        const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
        return reinterpret_cast<v16f>(_mm512_permutexvar_epi16(idx, table));
    }
    return reinterpret_cast<v16f>(_mm512_cvtne2ps_pbh(hi, lo));
}

// The words of a step whose scales are not all finite (noinline: rare, and its vectors
// would crowd the tile's registers)
template <int kId>
__attribute__((noinline)) v16f nonfinite_words(const GgufRow &row, int64_t t) {
    return reinterpret_cast<v16f>(step_words<kId>(row, t));
}

// Step t's words, scales decoded here (the panel path's loads)
template <int kId>
inline v16f dp_step_words_of(const GgufRow &row, int64_t t) {
    float s0, m0, s1, m1;
    step_scales<kId>(row.meta, t, s0, m0, s1, m1);
    if (!(finite(s0) && finite(m0) && finite(s1) && finite(m1)))
        return nonfinite_words<kId>(row, t);
    return dp_words<kId>(row, t, s0, m0, s1, m1);
}

// Decode through gemm_dp_view.h's tiles, a tile row's scales decoded once per chunk of
// steps: 32-blocks' f16 fields (d, or d and m) for 16 / (meta / 2) blocks widened by one
// vcvtph2ps (a masked load: no byte past the row's meta), the K-quants' 8 or 16 (s, mn) of
// a 256-block by block_scales. A chunk with a non-finite scale takes step_words throughout.
template <int kId>
struct GgufView {
    using T = Gguf<kId>;
    static constexpr int kHalves = T::meta / 2;            // 32-blocks: f16 fields a block
    static constexpr int kPer = T::qk == 32 ? 16 / kHalves : 8;   // steps a chunk
    WG<DpStep, kId> w;
    static constexpr bool kPerRow = true, kPairs = false;
    static constexpr int kBlocksPerLine = 16 / T::low;   // 64 bytes of q
    struct State {
        alignas(64) float s[16], mn[16];   // 32-blocks: the chunk's fields in s
        bool finite;
    };
    GgufView rows(int64_t r0) const { return {w.rows(r0)}; }
    bool shared(int) const { return true; }
    int64_t full_blocks() const { return w.k / 32; }
    int64_t chunk_end(int64_t blk, int64_t b1) const {
        return std::min(b1, (blk / kPer + 1) * kPer);
    }
    __attribute__((always_inline)) void refresh(int b, int64_t blk, State &st) const {
        const uint8_t *meta = w.row(b).meta;
        if constexpr (T::qk == 32) {
            const int64_t left = (full_blocks() - blk) * kHalves;
            const __mmask16 have = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
            const __m512 h = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(have, meta + blk * T::meta));
            _mm512_store_ps(st.s, h);
            st.finite = _mm512_fpclass_ps_mask(h, 0x99) == 0;   // NaN, +-inf
        } else {
            st.finite = block_scales<kId>(meta + blk / 8 * T::meta, st.s, st.mn);
        }
    }
    __attribute__((always_inline)) v16f block(int b, int64_t blk, const State &st) const {
        const GgufRow row = w.row(b);
        if (__builtin_expect(!st.finite, 0)) return nonfinite_words<kId>(row, blk);
        if constexpr (T::qk == 32) {
            const int i = int(blk % kPer) * kHalves;
            const float s = st.s[i], mn = T::has_min ? st.s[i + 1] : 0.0f;
            return dp_words<kId>(row, blk, s, mn, s, mn);
        } else {
            const int j = int(blk % 8) * (32 / T::sub);
            const int j1 = T::sub == 16 ? j + 1 : j;
            return dp_words<kId>(row, blk, st.s[j], st.mn[j], st.s[j1], st.mn[j1]);
        }
    }
};

template <int kId>
bool direct_quant(const Job<WG<DpStep, kId>> &job, int64_t j_lo, int64_t j_hi) {
    direct_view(job.x, job.m, job.steps, GgufView<kId>{job.w.rows(j_lo)}, job.out, j_lo, j_hi);
    return true;
}

}  // namespace
}  // namespace md

#endif  // MD_DP
