// Decode (m <= kDirectRows) on quantized W with AVX-512 BF16, included by gemm_quant.cpp:
// the same DpStep tile as gemm_core.h's `tile` (the same VDPBF16PS on the same operands in
// the same order, so the same bits), with W's blocks looked up in a table instead of
// dequantized one by one. A table holds every value one scale can produce, so it is built
// once per chunk of blocks that share the scale and reused for each block of the chunk:
//   4-bit  the 16 values bf16_rn((c - z) s) of a (row, group): one table per tile row,
//          rebuilt every group_size / 32 blocks; a block is then 3 operations on its 16
//          bytes (32 word indices) and one vpermw.
//   FP8    the 128 magnitudes bf16_rn(f32_rn(e4m3(c) s)) of a scale block (4 x 32 words,
//          q4_block_words' and fp8_block_words' own formulas on the codes 0..127), shared by
//          the tile's rows when they have one scale row (128-row blocks: all but the tiles
//          that straddle a block's edge, which take the per-block loads); rebuilt every
//          block_k / 32 blocks. A block is two vpermi2w, a blend on the code's bit 6 and the
//          sign: the code's sign bit flips the value's (RNE and e4m3 are symmetric, zeros
//          included; a NaN code gives a NaN either way).
// At m = 1 on one Zen 4 core the per-block dequantization cost 2-3x the VDPBF16PS; with the
// tables a 4-bit block is 5 vector operations with its VDPBF16PS instead of ~14.
#pragma once

#if defined(MD_DP)

namespace md {
namespace {

// 4-bit W without act-order, group_size % 32 == 0: one table per row.
struct Q4View {
    WQ4<DpStep> w;
    static constexpr bool kPerRow = true;
    static constexpr int kBlocksPerLine = 4;   // 16 bytes a block
    struct State {
        __m512i table;   // words 0..15: bf16_rn((c - z) s) for c = 0..15
    };
    Q4View rows(int64_t r0) const { return {w.rows(r0)}; }
    bool shared(int) const { return true; }
    int64_t full_blocks() const { return w.k / 32; }
    int64_t chunk_end(int64_t blk, int64_t b1) const {
        const int64_t per = w.group_size / 32;
        return std::min(b1, (blk / per + 1) * per);
    }
    __attribute__((always_inline)) void refresh(int b, int64_t blk, State &st) const {
        const int64_t g = b * w.groups + div_pow2(32 * blk, w.group_size);
        const __m512 v = _mm512_mul_ps(
            _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                          _mm512_set1_ps(float(w.zeros[g]))),
            _mm512_set1_ps(_cvtsh_ss(w.scales[g])));
        st.table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
    }
    // the block's 32 codes as word indices (dword l = byte l's low nibble | high << 16)
    __attribute__((always_inline)) v16f block(int b, int64_t blk, const State &st) const {
        const __m512i c = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i *>(w.q + b * w.row_bytes + 16 * blk)));
        const __m512i idx = _mm512_and_si512(_mm512_or_si512(c, _mm512_slli_epi32(c, 12)),
                                             _mm512_set1_epi32(0x000F000F));
        return reinterpret_cast<v16f>(_mm512_permutexvar_epi16(idx, st.table));
    }
    void prefetch(int64_t row, int64_t blk) const { w.prefetch(row, blk); }
};

// The FP8 codes 0..127, the table's arguments.
struct Codes128 {
    alignas(64) uint8_t c[128];
    constexpr Codes128() : c{} {
        for (int i = 0; i < 128; i++) c[i] = uint8_t(i);
    }
};
constexpr Codes128 kCodes128{};

// FP8 W, block_k % 32 == 0: one table for the tile when its rows share a scale row.
struct F8View {
    WF8<DpStep> w;
    static constexpr bool kPerRow = false;
    static constexpr int kBlocksPerLine = 2;   // 32 bytes a block
    struct State {
        __m512i t[4];   // words of magnitudes 0..31, 32..63, 64..95, 96..127
    };
    F8View rows(int64_t r0) const { return {w.rows(r0)}; }
    bool shared(int rows) const {
        for (int b = 1; b < rows; b++)
            if (w.scale_row[b] != w.scale_row[0]) return false;
        return true;
    }
    int64_t full_blocks() const { return w.k / 32; }
    int64_t chunk_end(int64_t blk, int64_t b1) const {
        const int64_t per = w.block_k / 32;
        return std::min(b1, (blk / per + 1) * per);
    }
    void refresh(int, int64_t blk, State &st) const {
        const float s = w.scales[int64_t(w.scale_row[0]) * w.k_blocks + div_pow2(32 * blk, w.block_k)];
        for (int i = 0; i < 4; i++)
            st.t[i] = reinterpret_cast<__m512i>(fp8_block_words(kCodes128.c + 32 * i, s));
    }
    __attribute__((always_inline)) v16f block(int b, int64_t blk, const State &st) const {
        const __m512i c = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w.q + b * w.row_bytes + 32 * blk)));
        const __m512i lo = _mm512_permutex2var_epi16(st.t[0], c, st.t[1]);   // index bits 0-5
        const __m512i hi = _mm512_permutex2var_epi16(st.t[2], c, st.t[3]);
        const __m512i mag = _mm512_mask_blend_epi16(
            _mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40)), lo, hi);
        const __m512i sign = _mm512_and_si512(_mm512_slli_epi16(c, 8), _mm512_set1_epi16(int16_t(0x8000)));
        return reinterpret_cast<v16f>(_mm512_xor_si512(mag, sign));
    }
    void prefetch(int64_t row, int64_t blk) const { w.prefetch(row, blk); }
};

// y[i0 + a, j + b] for a < R, b < C: gemm_core.h's `tile` with DpStep, W's full blocks from
// the view's tables (a chunk's tables built before its blocks), the partial last block from
// the source's own load.
template <int R, int C, class V>
inline void tile_view(const v16f *x, int64_t steps, const V &v, const Out &out, int64_t i0,
                      int64_t j) {
    constexpr int NS = V::kPerRow ? C : 1;
    v16f acc[R * C];
    for (int e = 0; e < R * C; e++) acc[e] = v16f{};
    typename V::State st[NS];
    auto run = [&](int64_t blk, const v16f (&wv)[C]) {
        for (int a = 0; a < R; a++) {
            v16f xv = x[a * steps + blk];
            pin(xv);
            for (int b = 0; b < C; b++) acc[a * C + b] = DpStep::step(acc[a * C + b], xv, wv[b]);
        }
    };
    const int64_t full = v.full_blocks();
    for (int64_t blk = 0; blk < full;) {
        const int64_t end = v.chunk_end(blk, full);
        for (int b = 0; b < NS; b++) v.refresh(b, blk, st[b]);
        for (; blk < end; blk++) {
            if (blk % V::kBlocksPerLine == 0)   // one prefetch a cache line
                for (int b = 0; b < C; b++) v.prefetch(b + 2 * C, blk);   // the tile after next
            v16f wv[C];
            for (int b = 0; b < C; b++) wv[b] = v.block(b, blk, st[V::kPerRow ? b : 0]);
            run(blk, wv);
        }
    }
    for (int64_t blk = full; blk < steps; blk++) {
        v16f wv[C];
        for (int b = 0; b < C; b++) wv[b] = v.w.load(b, blk);
        run(blk, wv);
    }
    store_tile<R, C>(acc, out, i0, j);
}

// Rows [i0, i0 + R) over columns [j0, j1) (v holds W's rows from j0); a tile whose rows do
// not share a table takes gemm_core.h's per-block tile.
template <int R, int C, class V>
void row_group_view(const v16f *x, int64_t steps, const V &v, const Out &out, int64_t i0,
                    int64_t j0, int64_t j1) {
    int64_t j = j0;
    for (; j + C <= j1; j += C) {
        const V t = v.rows(j - j0);
        if (t.shared(C)) tile_view<R, C>(x, steps, t, out, i0, j);
        else tile<DpStep, R, C>(x, steps, t.w, out, i0, j);
    }
    for (; j < j1; j++) tile_view<R, 1>(x, steps, v.rows(j - j0), out, i0, j);
}

// gemm_core.h's `direct` through a view.
template <int R, class V>
void direct_view(const v16f *x, int64_t m, int64_t steps, const V &v, const Out &out,
                 int64_t j0, int64_t j1) {
    if constexpr (R > 1)
        if (m < R) return direct_view<R - 1>(x, m, steps, v, out, j0, j1);
    row_group_view<R, direct_cols(R)>(x, steps, v, out, 0, j0, j1);
}

// gemm_core.h's `columns` asks these first at m <= kDirectRows (false: no view for W).
bool direct_quant(const Job<WQ4<DpStep>> &job, int64_t j_lo, int64_t j_hi) {
    if (job.w.gidx != nullptr || job.w.group_size % 32 != 0) return false;
    direct_view<kDirectRows>(job.x, job.m, job.steps, Q4View{job.w.rows(j_lo)}, job.out, j_lo,
                             j_hi);
    return true;
}

bool direct_quant(const Job<WF8<DpStep>> &job, int64_t j_lo, int64_t j_hi) {
    if (job.w.block_k % 32 != 0) return false;
    direct_view<kDirectRows>(job.x, job.m, job.steps, F8View{job.w.rows(j_lo)}, job.out, j_lo,
                             j_hi);
    return true;
}

}  // namespace
}  // namespace md

#endif  // MD_DP
