// Decode (m <= kDirectRows) through a view of W with AVX-512 BF16, shared by the dequantizing
// GEMMs (gemm_quant_dp.h's 4-bit and FP8 views, gemm_gguf_dp.h's GGUF views): gemm_core.h's
// `tile` with DpStep (the same VDPBF16PS on the same operands in the same order, so the same
// bits), W's blocks from a view that builds what one scale can produce once per chunk of
// blocks sharing it and reuses it for each block of the chunk. A view V has:
//   kPerRow (a State per tile row, else one for the tile), kPairs (pair(): two blocks at a
//   time), kBlocksPerLine (32-position blocks per 64 bytes of its main stream: one prefetch
//   per line), State, rows(r0), shared(rows), full_blocks(), chunk_end(blk, b1),
//   refresh(b, blk, state), block(b, blk, state) -> the block's 32 BF16 words, and w (its
//   source: load for the blocks past full_blocks, prefetch).
#pragma once

#include "gemm_core.h"

#if defined(MD_DP)

// Every loop over a tile's rows and columns unrolled (as gemm_avx2.h's MD_UNROLL), so
// the accumulators stay in registers: a loop GCC leaves rolled indexes them in memory (a
// store and a load per VDPBF16PS: FP8 decode ran 1.3x slower that way).
#define MD_DP_UNROLL _Pragma("GCC unroll 16")

namespace md {
namespace {

// The block of 32 codes at p as words in position order: word 2l's low byte holds the low
// nibble of byte l in its bits 0-3, word 2l + 1's its high nibble, each with the next
// nibble's bits above (mask with 15 for the codes). Byte pairs widened to qwords, then one
// vpmultishiftqb puts the nibble at bit offset 4i of a qword into word i's low byte.
inline __m512i q4_nibble_words(const uint8_t *p) {
    const __m512i pairs =
        _mm512_cvtepu16_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    // control bytes 0, 2, 4, 6 of each qword: bit offsets 0, 4, 8, 12
    return _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x000C000800040000LL), pairs);
}

// acc[a * C + b] after step blk of x row a with W operand wv[b]
template <int R, int C>
__attribute__((always_inline)) inline void dp_step(v16f (&acc)[R * C], const v16f *x,
                                                   int64_t steps, int64_t blk,
                                                   const v16f (&wv)[C]) {
    MD_DP_UNROLL for (int a = 0; a < R; a++) {
        v16f xv = x[a * steps + blk];
        pin(xv);
        MD_DP_UNROLL for (int b = 0; b < C; b++)
            acc[a * C + b] = DpStep::step(acc[a * C + b], xv, wv[b]);
    }
}

// y[i0 + a, j + b] for a < R, b < C: gemm_core.h's `tile` with DpStep, W's full blocks from
// the view's tables (a chunk's tables built before its blocks; FP8 two blocks at a time,
// each accumulator still taking step blk before blk + 1), the partial last block from the
// source's own load.
template <int R, int C, class V>
inline void tile_view(const v16f *x, int64_t steps, const V &v, const Out &out, int64_t i0,
                      int64_t j) {
    constexpr int NS = V::kPerRow ? C : 1;
    v16f acc[R * C];
    MD_DP_UNROLL for (int e = 0; e < R * C; e++) acc[e] = v16f{};
    typename V::State st[NS];
    const int64_t full = v.full_blocks();
    for (int64_t blk = 0; blk < full;) {
        const int64_t end = v.chunk_end(blk, full);
        MD_DP_UNROLL for (int b = 0; b < NS; b++) v.refresh(b, blk, st[b]);
        // (A chunk of the usual length runs unrolled, not as a loop of 2 or 4 iterations
        // whose exit the branch predictor misses once per chunk: 4-10% of a decode GEMM.)
        if constexpr (V::kPairs) {
            auto two = [&](int64_t at) __attribute__((always_inline)) {   // one cache line a row
                MD_DP_UNROLL for (int b = 0; b < C; b++) v.w.prefetch(b, at, C);
                v16f w0[C], w1[C];
                MD_DP_UNROLL for (int b = 0; b < C; b++)
                    v.pair(b, at, st[V::kPerRow ? b : 0], w0[b], w1[b]);
                dp_step<R, C>(acc, x, steps, at, w0);
                dp_step<R, C>(acc, x, steps, at + 1, w1);
            };
            if (end - blk == 4) {   // FP8's 128-wide scale blocks
                two(blk);
                two(blk + 2);
                blk = end;
            }
            for (; blk + 2 <= end; blk += 2) two(blk);
        }
        auto one = [&](int64_t at) __attribute__((always_inline)) {
            if (at % V::kBlocksPerLine == 0)   // once a cache line
                MD_DP_UNROLL for (int b = 0; b < C; b++) v.w.prefetch(b, at, C);
            v16f wv[C];
            MD_DP_UNROLL for (int b = 0; b < C; b++) wv[b] = v.block(b, at, st[V::kPerRow ? b : 0]);
            dp_step<R, C>(acc, x, steps, at, wv);
        };
        if (end - blk == V::kBlocksPerLine) {   // 4-bit groups of 128
            MD_DP_UNROLL for (int u = 0; u < V::kBlocksPerLine; u++) one(blk + u);
            blk = end;
        }
        for (; blk < end; blk++) one(blk);
    }
    for (int64_t blk = full; blk < steps; blk++) {
        v16f wv[C];
        MD_DP_UNROLL for (int b = 0; b < C; b++) wv[b] = v.w.load(b, blk);
        dp_step<R, C>(acc, x, steps, blk, wv);
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
template <class V>
void direct_view(const v16f *x, int64_t m, int64_t steps, const V &v, const Out &out,
                 int64_t j0, int64_t j1) {
    with_rows<kDirectRows>(m, [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        row_group_view<R, direct_cols(R)>(x, steps, v, out, 0, j0, j1);
    });
}

}  // namespace
}  // namespace md

#endif  // MD_DP
