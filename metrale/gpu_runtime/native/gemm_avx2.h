// The native GEMM's tiles for x86 with AVX2 and FMA but no AVX-512 (16 ymm registers of 8
// float32 lanes), included by gemm_core.h. Same formula, same FMAs on the same operands in
// the same order per lane as gemm_core.h's `tile` with FmaStep, so the same bits (the tests
// compare this build with numpy); only the data layout and the register tiles differ.
//
// The formula's 16 lanes never meet before the lane tree, so a tile runs in two passes,
// lanes 0-7 then lanes 8-15 (lane half L), each over every step with R x C accumulators of
// one ymm each: R x C <= 12 plus the W operands, an x row and a constant fit in 16
// registers without spills (GCC's 64-byte generic vectors on AVX2 moved every operand
// through the stack: 0.3-3 GMAC/s instead of tens). The tree's first level adds lane l of
// the two passes; the rest is a fixed shuffle tree on 8 elements at once.
//
// x rows, and W in the panel path, are widened once to float32 in "half-major" order
// [L][steps][8] (step s = 2 b + h: block b's odd positions for h = 0, its even ones for
// h = 1), so each pass reads contiguous memory and a row's half stays in L1. W read in place
// (decode: m <= kDirectRows, W streamed once from DRAM and prefetched) comes from a source's
// half8<P, L, kTail>(row, blk, state): the 8 float32 lanes of step 2 blk + P, lane half L
// (WBits: the BF16 words masked or shifted; gemm_quant.cpp: dequantized in registers).
#pragma once

#if defined(MD_AVX2)

namespace md {
namespace {

// One 8-lane operand in a register: stops GCC from folding its load into each FMA as a
// memory operand (R x C loads instead of R + C per step).
inline void pin8(__m256 &v) { asm("" : "+x"(v)); }

// float32 lanes rounded to BF16 as float32 bit patterns (the dequantizing views')
inline __m256 bf16_round8(__m256 v) {   // nearest even, float32 bit pattern; NaN stays NaN
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// BF16 words (word i: positions 2i | 2i + 1 << 16) -> step P's float32 lanes: the odd
// positions (P = 0) are the high halves as they stand, the even ones shifted up.
template <int P>
inline __m256 widen_words(__m256i words) {
    if constexpr (P == 0)
        return _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(int(0xFFFF0000u))));
    else
        return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

// The offset of step s's block in row `row` of the tile after next (tiles of c rows,
// row_bytes apart, blocks of block_bytes; two steps a block): these tiles' prefetch, into
// L1. (This path reads each W block twice, once per lane half: gemm_core.h's stream into
// L2 made the quantized decode steps 11-18% slower here.)
inline int64_t tile_after_next(int64_t row, int64_t s, int c, int64_t row_bytes,
                               int64_t block_bytes) {
    return (row + 2 * c) * row_bytes + s / 2 * block_bytes;
}

// W rows as stored BF16 bits [n, k] (WBits' data).
struct Bits8 {
    const uint16_t *p;
    int64_t k;
    struct State {};
    int64_t chunk_end(int64_t, int64_t b1) const { return b1; }
    void refresh(int64_t, int64_t, State &) const {}
    Bits8 rows(int64_t r0) const { return {p + r0 * k, k}; }
    int64_t full_blocks() const { return k / 32; }
    void prefetch(int64_t row, int64_t s, int c) const {
        prefetch_at<3>(p, tile_after_next(row, s, c, 2 * k, 64));
    }
    template <int P, int L, bool kTail>
    __m256 half8(int64_t row, int64_t blk, State &) const {
        const int64_t pos = 32 * blk + 16 * L;   // of word 0
        __m256i words;
        if constexpr (!kTail) {
            words = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + row * k + pos));
        } else {   // the last partial block, zero-padded
            alignas(32) uint16_t t[16] = {};
            const int64_t have = std::min<int64_t>(16, k - pos);
            if (have > 0) std::memcpy(t, p + row * k + pos, size_t(have) * 2);
            words = _mm256_load_si256(reinterpret_cast<const __m256i *>(t));
        }
        return widen_words<P>(words);
    }
};

// W (or x) rows already widened, [rows][2][steps][8] floats.
struct Panel8 {
    const float *p;
    int64_t steps;
    struct State {};
    int64_t chunk_end(int64_t, int64_t b1) const { return b1; }
    void refresh(int64_t, int64_t, State &) const {}
    Panel8 rows(int64_t r0) const { return {p + r0 * steps * 16, steps}; }
    int64_t full_blocks() const { return steps / 2; }
    void prefetch(int64_t, int64_t, int) const {}   // in L2 already

    template <int P, int L, bool>
    __m256 half8(int64_t row, int64_t blk, State &) const {
        return _mm256_load_ps(p + ((row * 2 + L) * steps + 2 * blk + P) * 8);
    }
};

// f(the view of W this path reads): WBits as Bits8; gemm_quant.cpp's sources through
// their own visit8 overloads (one view type per dequantization path).
template <class S, class F>
void visit8(const WBits<S> &w, F &&f) { f(Bits8{w.p, w.k}); }

// A row of any source in [2][steps][8] order (zero past k).
template <class Src>
inline void widen_row(const Src &w, int64_t row, float *dst, int64_t steps) {
    const int64_t full = w.full_blocks(), blocks = steps / 2;
    typename Src::State st{};
    auto put = [&](auto l, auto tail, int64_t blk) {
        constexpr int L = decltype(l)::value;
        constexpr bool kTail = decltype(tail)::value;
        float *d = dst + (L * steps + 2 * blk) * 8;
        _mm256_store_ps(d, w.template half8<0, L, kTail>(row, blk, st));
        _mm256_store_ps(d + 8, w.template half8<1, L, kTail>(row, blk, st));
    };
    using L0 = std::integral_constant<int, 0>;
    using L1 = std::integral_constant<int, 1>;
    for (int64_t blk = 0; blk < blocks;) {
        const int64_t end = w.chunk_end(blk, blocks);
        w.refresh(row, blk, st);
        for (; blk < end; blk++) {
            if (blk < full) put(L0{}, std::false_type{}, blk), put(L1{}, std::false_type{}, blk);
            else put(L0{}, std::true_type{}, blk), put(L1{}, std::true_type{}, blk);
        }
    }
}

// Step 2 blk + P of lane half L into acc[a * C + b] (x: R rows of [2][steps][8]).
// Straight-line code (every loop unrolled before GCC's scalar replacement), so acc stays
// in registers.
#define MD_UNROLL _Pragma("GCC unroll 16")
template <int R, int C, int P, int L, bool kTail, class Src>
__attribute__((always_inline)) inline void step8(const Src &w, const float *x, int64_t steps,
                                                 int64_t blk, __m256 (&acc)[R * C],
                                                 typename Src::State (&st)[C]) {
    const float *xs = x + (L * steps + 2 * blk + P) * 8;
    if constexpr (R < C) {   // R x rows held, each W operand used as it comes
        __m256 xv[R];
        MD_UNROLL for (int a = 0; a < R; a++) {
            xv[a] = _mm256_load_ps(xs + a * 16 * steps);
            pin8(xv[a]);
        }
        MD_UNROLL for (int b = 0; b < C; b++) {
            __m256 wv = w.template half8<P, L, kTail>(b, blk, st[b]);
            pin8(wv);
            MD_UNROLL for (int a = 0; a < R; a++)
                acc[a * C + b] = _mm256_fmadd_ps(xv[a], wv, acc[a * C + b]);
        }
    } else {                 // C W operands held, each x row used as it comes
        __m256 wv[C];
        MD_UNROLL for (int b = 0; b < C; b++) {
            wv[b] = w.template half8<P, L, kTail>(b, blk, st[b]);
            pin8(wv[b]);
        }
        MD_UNROLL for (int a = 0; a < R; a++) {
            __m256 xv = _mm256_load_ps(xs + a * 16 * steps);
            pin8(xv);
            MD_UNROLL for (int b = 0; b < C; b++)
                acc[a * C + b] = _mm256_fmadd_ps(xv, wv[b], acc[a * C + b]);
        }
    }
}

// Blocks [b0, b1) of lane half L into acc_io.
template <int R, int C, int L, bool kTail, class Src>
inline void run_blocks(const Src &w, const float *x, int64_t steps, int64_t b0, int64_t b1,
                       __m256 *acc_io, typename Src::State (&st)[C]) {
    __m256 acc[R * C];   // a local copy: __m256 may alias x, so stores through acc_io
    MD_UNROLL for (int e = 0; e < R * C; e++) acc[e] = acc_io[e];   // would stay in the loop
    for (int64_t blk = b0; blk < b1;) {
        const int64_t end = w.chunk_end(blk, b1);   // a source's state holds until end
        MD_UNROLL for (int b = 0; b < C; b++) w.refresh(b, blk, st[b]);
        for (; blk < end; blk++) {
            if constexpr (L == 0 && !kTail)
                MD_UNROLL for (int b = 0; b < C; b++) w.prefetch(b, 2 * blk, C);
            step8<R, C, 0, L, kTail>(w, x, steps, blk, acc, st);   // the odd positions,
            step8<R, C, 1, L, kTail>(w, x, steps, blk, acc, st);   // then the even ones
        }
    }
    MD_UNROLL for (int e = 0; e < R * C; e++) acc_io[e] = acc[e];
}

// The lane tree's levels 2-4 (c_l = b_l + b_{l+4}, d_l = c_l + c_{l+2}, d_0 + d_1), + 0
// and the canonical NaN for 8 elements whose level-1 sums are b[0..7]; y[e] for element e.
// (Additions commute bit for bit; MXCSR flushes each like the formula.)
inline void tree8(const __m256 *b, float *y) {
    __m256 t[4], u[2];
    for (int i = 0; i < 4; i++)   // [e 2i: c_0..3 | e 2i+1: c_0..3]
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(b[2 * i], b[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(b[2 * i], b[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)   // [e 4i: d_0 d_1, e 4i+2: d_0 d_1 | e 4i+1, e 4i+3]
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88),   // [e 0 2 4 6 | 1 3 5 7]
                             _mm256_shuffle_ps(u[0], u[1], 0xDD));
    r = _mm256_add_ps(r, _mm256_setzero_ps());
    const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
    r = _mm256_blendv_ps(r, nan, _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
    r = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_ps(y, r);
}

// y[i0 + a, j + b] from the two passes' accumulators (lanes[L][a * C + b]).
template <int R, int C>
inline void store8(const __m256 (*lanes)[R * C], const Out &out, int64_t i0, int64_t j) {
    constexpr int E = (R * C + 7) / 8 * 8;
    __m256 b[E];
    for (int e = 0; e < E; e++)
        b[e] = e < R * C ? _mm256_add_ps(lanes[0][e], lanes[1][e]) : _mm256_setzero_ps();
    float y[E];
    for (int e = 0; e < E; e += 8) tree8(b + e, y + e);
    for (int a = 0; a < R; a++)
        for (int c = 0; c < C; c++) out.put(i0 + a, j + c, y[a * C + c]);
}

// y[i0 + a, j + b] for a < R, b < C (x: R rows of [2][steps][8], w: C rows from j).
template <int R, int C, class Src>
inline void tile8(const float *x, int64_t steps, const Src &w, const Out &out, int64_t i0,
                  int64_t j) {
    __m256 lanes[2][R * C];
    const int64_t full = w.full_blocks(), blocks = steps / 2;
    typename Src::State st[C]{};
    for (int e = 0; e < R * C; e++) lanes[0][e] = lanes[1][e] = _mm256_setzero_ps();
    run_blocks<R, C, 0, false>(w, x, steps, 0, full, lanes[0], st);
    run_blocks<R, C, 0, true>(w, x, steps, full, blocks, lanes[0], st);
    run_blocks<R, C, 1, false>(w, x, steps, 0, full, lanes[1], st);
    run_blocks<R, C, 1, true>(w, x, steps, full, blocks, lanes[1], st);
    store8<R, C>(lanes, out, i0, j);
}

// Rows [i0, i0 + R) over columns [j0, j1) in R x C tiles (w holds W's rows from j0).
template <int R, int C, class Src>
void row_group8(const float *x, int64_t steps, const Src &w, const Out &out, int64_t i0,
                int64_t j0, int64_t j1) {
    int64_t j = j0;
    for (; j + C <= j1; j += C) tile8<R, C>(x, steps, w.rows(j - j0), out, i0, j);
    for (; j < j1; j++) tile8<R, 1>(x, steps, w.rows(j - j0), out, i0, j);
}


// Columns [j_lo, j_hi) of one job on one thread through the view src of its W.
template <class W, class Src>
void columns8_of(const Job<W> &job, const Src &src, int64_t j_lo, int64_t j_hi) {
    const float *x = reinterpret_cast<const float *>(job.x);
    if (job.m <= kDirectRows) {
        with_rows<kDirectRows>(job.m, [&](auto rows) {   // one m x direct_cols(m) tile pass
            constexpr int R = decltype(rows)::value;      // over W in place
            row_group8<R, direct_cols(R)>(x, job.steps, src.rows(j_lo), job.out, 0, j_lo, j_hi);
        });
        return;
    }
    // W in blocks of about 192 KiB, widened once into a panel that stays in L2 while every
    // MR-row group passes over it
    const int64_t jb = std::max<int64_t>(NR, (int64_t(192) << 10) / (job.steps * 64) / NR * NR);
    std::vector<v16f> panel(size_t(jb * job.steps));
    float *pf = reinterpret_cast<float *>(panel.data());
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += jb) {
        const int64_t j1 = std::min(j_hi, j0 + jb);
        for (int64_t r = 0; r < j1 - j0; r++)
            widen_row(src, j0 + r, pf + r * job.steps * 16, job.steps);
        const Panel8 w{pf, job.steps};
        int64_t i = 0;
        for (; i + MR <= job.m; i += MR)
            row_group8<MR, NR>(x + i * job.steps * 16, job.steps, w, job.out, i, j0, j1);
        with_rows<MR - 1>(job.m - i, [&](auto rows) {   // the last m % MR rows
            row_group8<decltype(rows)::value, NR>(x + i * job.steps * 16, job.steps, w, job.out,
                                                  i, j0, j1);
        });
    }
}

// Columns [j_lo, j_hi) of one job on one thread (gemm_core.h's `columns` for this path).
// (noinline: the float work stays inside the caller's FlushScope)
template <class W>
__attribute__((noinline)) void columns8(const Job<W> &job, int64_t j_lo, int64_t j_hi) {
    visit8(job.w, [&](const auto &src) { columns8_of(job, src, j_lo, j_hi); });
}

// x [m, k] BF16 -> [m][2][steps][8] float32 (as v16f storage), zero-padded.
inline std::vector<v16f> prepare_x8(const uint16_t *x, int64_t m, int64_t k, int64_t steps) {
    std::vector<v16f> xs(size_t(m * steps));
    const Bits8 rows{x, k};
    float *d = reinterpret_cast<float *>(xs.data());
    for (int64_t i = 0; i < m; i++) widen_row(rows, i, d + i * steps * 16, steps);
    return xs;
}

}  // namespace
}  // namespace md

#endif  // MD_AVX2
