// The GEMM over GGUF weights kept at their bytes (metrale/ops/gemm_gguf.py's twin) computed
// natively: gemm_f32.cpp's formula on W = ops/gguf_planes.py's dequant_bf16 of the planes,
// with the dequantization inside the tiles' W loads, never the whole W, so decode reads W
// as stored (0.56-1.06 bytes a weight against BF16's 2) and the bits are those of the BF16
// GEMM on the dequantized W (tests/ops/test_gemm_gguf_native.py compares every build, type
// and thread count with numpy).
//
// Every path computes gemm_gguf_types.h's value of each position (step_words is the
// reference; its header gives the formula and why it is rounded once):
//   AVX-512 BF16 (MD_DP)   decode (m <= 8): gemm_dp_view.h's tiles through GgufView
//                          (gemm_gguf_dp.h: per-step tables and vpermw, or Q8_0's and Q6_K's
//                          codes widened), the K-quants' scales decoded once per 256-block
//                          and tile row; prefill: the panel of gemm_core.h filled by the same
//                          dp_words.
//   AVX2 + FMA (MD_AVX2)   gemm_avx2.h's 8-lane tiles through G8 below: a step's 16 positions
//                          of one lane half as code pairs (position 2i in the low word of
//                          lane i, 2i + 1 in the high word), then per step half one float32
//                          conversion, product (and min) and BF16 rounding.
//   other                  the float32 or float64 steps of gemm_core.h on step_words.
// Non-finite scales (a NaN or infinite d) take step_words on every path.
// Entry: md_gemm_gguf(type, x, q, qh, meta, m, n, k, ldy, y32, ybf16): y rows ldy elements
// apart (ldy >= n), float32 or BF16 bits; returns -1 for a type not kept packed.
#include <type_traits>

#include "gemm_dp_view.h"
#include "gemm_gguf_types.h"

namespace md {
namespace {

#if defined(MD_DP)
template <int kId> v16f dp_step_words(const GgufRow &row, int64_t t);
#endif

// W's planes as gemm_core.h's W source: load(row, step), rows(r0), prefetch.
template <class S, int kId>
struct WG {
    using T = Gguf<kId>;
    static constexpr int64_t kQStep = 4 * T::low, kHStep = 4 * T::high;   // bytes a step
    GgufRow base;   // row 0
    int64_t q_row, qh_row, meta_row, k;

    GgufRow row(int64_t r) const {
        return {base.q + r * q_row, T::high ? base.qh + r * qh_row : nullptr,
                base.meta + r * meta_row};
    }
    WG rows(int64_t r0) const { return {row(r0), q_row, qh_row, meta_row, k}; }
    v16f load(int64_t r, int64_t s) const {
        const int64_t t = s / S::kPerBlock;
#if defined(MD_DP)
        if constexpr (std::is_same_v<S, DpStep>) return dp_step_words<kId>(row(r), t);
#endif
        return S::from_bits(step_words<kId>(row(r), t), int(s % S::kPerBlock));
    }
    // the step `ahead` steps past s's (past the row's end: in row + c, the tile's next row
    // there), in each plane (q's stream, and the qh and meta bytes of the same positions)
    template <int kLocality>
    void prefetch_planes(int64_t r, int64_t blk, int64_t ahead, int c) const {
        const int64_t steps = k / 32;
        int64_t at = blk + (ahead < steps ? ahead : steps);
        const bool past = at >= steps;
        r += past ? c : 0;
        at -= past ? steps : 0;
        prefetch_at<kLocality>(base.q, r * q_row + at * kQStep);
        if constexpr (T::high > 0) prefetch_at<kLocality>(base.qh, r * qh_row + at * kHStep);
        prefetch_at<kLocality>(base.meta, r * meta_row + at * 32 / T::qk * T::meta);
    }
    void prefetch(int64_t r, int64_t s, int c) const {
        prefetch_planes<kPrefetchL2>(r, s / S::kPerBlock, kAheadBytes / kQStep, c);
    }
};

}  // namespace
}  // namespace md

#include "gemm_gguf_dp.h"   // dp_step_words, GgufView, direct_quant for WG<DpStep, *>

namespace md {
namespace {

#if defined(MD_DP)
template <int kId> v16f dp_step_words(const GgufRow &row, int64_t t) {
    return dp_step_words_of<kId>(row, t);
}
#endif

#if defined(MD_AVX2)
// gemm_avx2.h's view of GGUF W (see the file header).
template <int kId>
struct G8 {
    using T = Gguf<kId>;
    WG<FmaStep, kId> w;
    struct State {
        __m256 s, mn;      // the scale (and min) of the step half
        __m256i pairs;     // its code pairs, c(r) as int16
        bool slow;         // not finite: step_words
        float ss[16], mm[16];   // K-quants: the 256-block's scales
        bool finite;
    };
    G8 rows(int64_t r0) const { return {w.rows(r0)}; }
    int64_t full_blocks() const { return w.k / 32; }
    void prefetch(int64_t row, int64_t s, int c) const {   // into L1, the tile after next
        w.template prefetch_planes<3>(row + 2 * c, s / 2, 0, 0);
    }
    int64_t chunk_end(int64_t blk, int64_t b1) const {
        if constexpr (T::qk == 32) return b1;
        return std::min(b1, (blk / 8 + 1) * 8);
    }
    void refresh(int64_t row, int64_t blk, State &st) const {
        if constexpr (T::qk == 256) {
            st.finite = block_scales<kId>(w.row(row).meta + blk / 8 * T::meta, st.ss, st.mm);
        }
    }
    // positions 16 L .. 16 L + 15 of step blk as pairs (lane i: 2i low word, 2i + 1 high)
    template <int L>
    static __m256i pairs_of(const GgufRow &r, int64_t blk) {
        const __m256i by4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        __m256i p;
        if constexpr (T::low == 4) {
            const __m256i b = _mm256_cvtepu8_epi32(
                _mm_loadl_epi64(reinterpret_cast<const __m128i *>(r.q + 16 * blk + 8 * L)));
            p = _mm256_and_si256(_mm256_or_si256(b, _mm256_slli_epi32(b, 12)),
                                 _mm256_set1_epi32(0x000F000F));
        } else if constexpr (T::low == 2) {
            uint32_t u;
            std::memcpy(&u, r.q + 8 * blk + 4 * L, 4);
            const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(int(u)), by4);
            p = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(3)),
                                _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(12)), 14));
        } else {
            p = _mm256_cvtepi8_epi16(
                _mm_loadu_si128(reinterpret_cast<const __m128i *>(r.q + 32 * blk + 16 * L)));
        }
        if constexpr (T::high == 1) {
            uint16_t u;
            std::memcpy(&u, r.qh + 4 * blk + 2 * L, 2);
            const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(u),
                                                _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
            const __m256i h = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(1)),
                                              _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(2)), 15));
            p = _mm256_or_si256(p, _mm256_slli_epi32(h, T::low));
        } else if constexpr (T::high == 2) {
            uint32_t u;
            std::memcpy(&u, r.qh + 8 * blk + 4 * L, 4);
            const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(int(u)), by4);
            const __m256i h = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(3)),
                                              _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(12)), 14));
            p = _mm256_or_si256(p, _mm256_slli_epi32(h, 4));
        }
        if constexpr (T::nonlinear) {   // KVALUES by byte, then each word sign-extended
            const __m256i grid = _mm256_broadcastsi128_si256(
                _mm_loadu_si128(reinterpret_cast<const __m128i *>(kKValues)));
            p = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_shuffle_epi8(grid, p), 8), 8);
        } else if constexpr (T::offset != 0) {
            p = _mm256_sub_epi16(p, _mm256_set1_epi16(T::offset));
        }
        return p;
    }
    // lanes 8L..8L+7 of step 2 blk + P (P = 0: the odd positions); half8<0, L> first
    template <int P, int L, bool kTail>
    __attribute__((always_inline)) __m256 half8(int64_t row, int64_t blk, State &st) const {
        if constexpr (P == 0) {
            const GgufRow r = w.row(row);
            float s, mn = 0.0f;
            bool ok;
            if constexpr (T::qk == 32) {
                uint16_t d, m = 0;
                std::memcpy(&d, r.meta + blk * T::meta, 2);
                if constexpr (T::has_min) std::memcpy(&m, r.meta + blk * T::meta + 2, 2);
                ok = ((d & 0x7C00) != 0x7C00) & ((m & 0x7C00) != 0x7C00);
                s = _cvtsh_ss(d);
                if constexpr (T::has_min) mn = _cvtsh_ss(m);
            } else {
                const int j = int(blk % 8) * (32 / T::sub) + (T::sub == 16 ? L : 0);
                s = st.ss[j];
                mn = st.mm[j];
                ok = st.finite;
            }
            st.slow = !ok;
            st.s = _mm256_set1_ps(s);
            st.mn = _mm256_set1_ps(mn);
            st.pairs = pairs_of<L>(r, blk);
        }
        if (__builtin_expect(st.slow, 0)) return slow_half8<P, L>(row, blk);
        const __m256i c = P == 0 ? _mm256_srai_epi32(st.pairs, 16)
                                 : _mm256_srai_epi32(_mm256_slli_epi32(st.pairs, 16), 16);
        const __m256 cf = _mm256_cvtepi32_ps(c);
        return bf16_round8(T::has_min ? _mm256_fmadd_ps(cf, st.s, st.mn) : _mm256_mul_ps(cf, st.s));
    }
    template <int P, int L>
    __attribute__((noinline)) __m256 slow_half8(int64_t row, int64_t blk) const {
        alignas(64) uint32_t words[16];
        const v16u sw = step_words<kId>(w.row(row), blk);
        std::memcpy(words, &sw, 64);
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i *>(words + 8 * L));
        return widen_words<P>(v);
    }
};

template <int kId, class F>
void visit8(const WG<FmaStep, kId> &w, F &&f) {
    f(G8<kId>{w});
}
#endif

template <int kId>
void gemm_gguf(const uint16_t *x, const uint8_t *q, const uint8_t *qh, const uint8_t *meta,
               int64_t m, int64_t n, int64_t k, Out out) {
    using T = Gguf<kId>;
    const int64_t q_row = (k * T::low / 8 + 15) / 16 * 16, qh_row = k * T::high / 8,
                  meta_row = k / T::qk * T::meta;
    gemm_any(x, m, n, k, out, [&](auto step) {
        return WG<decltype(step), kId>{{q, qh, meta}, q_row, qh_row, meta_row, k};
    });
}

}  // namespace
}  // namespace md

extern "C" {

// y [m, :n] (rows ldy apart) = x [m, k] @ dequant(W)^T, W [n, k] in ggml type `ggml_type`'s
// planes (q [n, q_row], qh [n, qh_row] or null, meta [n, meta_row]: ops/gguf_planes.py),
// k a multiple of the type's block: float32 into y32 or BF16 bits into ybf16 (one of the
// two non-null). Returns 0, or -1 (nothing written) for a type not kept packed.
__attribute__((visibility("default"))) int md_gemm_gguf(
    int ggml_type, const uint16_t *x, const uint8_t *q, const uint8_t *qh, const uint8_t *meta,
    int64_t m, int64_t n, int64_t k, int64_t ldy, float *y32, uint16_t *ybf16) {
    const md::Out out{y32, ybf16, ldy};
    switch (ggml_type) {
        case md::kQ4_0: md::gemm_gguf<md::kQ4_0>(x, q, qh, meta, m, n, k, out); return 0;
        case md::kQ4_1: md::gemm_gguf<md::kQ4_1>(x, q, qh, meta, m, n, k, out); return 0;
        case md::kQ5_0: md::gemm_gguf<md::kQ5_0>(x, q, qh, meta, m, n, k, out); return 0;
        case md::kQ5_1: md::gemm_gguf<md::kQ5_1>(x, q, qh, meta, m, n, k, out); return 0;
        case md::kQ8_0: md::gemm_gguf<md::kQ8_0>(x, q, qh, meta, m, n, k, out); return 0;
        case md::kQ2_K: md::gemm_gguf<md::kQ2_K>(x, q, qh, meta, m, n, k, out); return 0;
        case md::kQ3_K: md::gemm_gguf<md::kQ3_K>(x, q, qh, meta, m, n, k, out); return 0;
        case md::kQ4_K: md::gemm_gguf<md::kQ4_K>(x, q, qh, meta, m, n, k, out); return 0;
        case md::kQ5_K: md::gemm_gguf<md::kQ5_K>(x, q, qh, meta, m, n, k, out); return 0;
        case md::kQ6_K: md::gemm_gguf<md::kQ6_K>(x, q, qh, meta, m, n, k, out); return 0;
        case md::kIQ4_NL: md::gemm_gguf<md::kIQ4_NL>(x, q, qh, meta, m, n, k, out); return 0;
        case md::kIQ4_XS: md::gemm_gguf<md::kIQ4_XS>(x, q, qh, meta, m, n, k, out); return 0;
        default: return -1;
    }
}

}  // extern "C"
