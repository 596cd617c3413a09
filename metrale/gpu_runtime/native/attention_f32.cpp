// Paged split-K decode attention computed natively: HostBackend's fast path for the twins of
// kernels/attention.cu's decode kernels (metrale/ops/attention.py, `_decode_split_twin` and
// `decode_attention_combine_twin`), built and loaded by metrale/gpu_runtime/native.py.
//
// Shapes (the twin's arguments): out [n_seqs, H*D] BF16 bits; qkv [n_seqs, (H+2KV)*D] BF16
// (row s's first H*D values are sequence s's query); k_cache, v_cache [blocks, block_size,
// KV, D] BF16; block_tables int32 [n_seqs, max_blocks_per_seq]; kv_lens int32 [n_seqs];
// workspace float32: acc [n_seqs, H, max_splits, D], then (m, l) [n_seqs, H, max_splits, 2].
// Query head h reads kv head h / G, G = H / KV.
//
// Formula, per sequence s with kv_len = kv_lens[s] (the twin's structure, float32 throughout):
//   kv_len <= 0: the split writes a zero row, the combine skips the sequence.
//   start = kv_len - W if 0 < W < kv_len else 0 (W = sliding_window); first = start / 256;
//   n_splits = ceil(kv_len / 256) (attention.py `_decode_seq`); split i in [first, n_splits)
//   holds positions [max(256 i, start), min(256 i + 256, kv_len)).
//   q = f32(bf16 q) * sl2, one rounding, sl2 = f32(scale) * f32(log2 e) (the twin's `_LOG2E`);
//   per query head and split: s_t = dot(q, k_t) for each position t (below);
//     m = max_t s_t (NaN if any s_t is NaN, like numpy's max); p_t = exp2r(s_t - m) (below);
//     l = sum_t p_t: with j = t's index in the split, lane j % 8 adds p_t in order from +0,
//       then the lanes as dot's tree below; acc_d = sum_t p_t v_td, per element d in
//       position order, one FMA per step from +0;
//   one split (n_splits - first == 1): out = bf16(acc_d / l);
//   else the workspace gets acc, m and l of split i at [s, h, i].
//   dot(q, k): both zero-padded to D8 = D rounded up to a multiple of 8; lane j = 0..7:
//     a_j = +0, then a_j = fma(q[8c + j], k[8c + j], a_j) for c = 0, 1, ...;
//     s = ((a_0 + a_1) + (a_2 + a_3)) + ((a_4 + a_5) + (a_6 + a_7)).
//   combine, per query head of a sequence with n_splits - first > 1 (decode_attention_combine
//   twin's formula and order; no FMA: each product rounded before it is added, as numpy):
//     M = max_i m_i; lsum = 0, acc_d = 0; for i = first .. n_splits - 1 in order:
//     w = exp2f(m_i - M); lsum = lsum + w l_i; acc_d = acc_d + w acc_i,d;
//     out = bf16(acc_d * (1 / lsum)).
//   bf16(x): round to nearest even, every NaN -> 0x7FFF (ops/bf16.py, convert_bf16.cpp).
// The numpy twin computes the dot products and sums with BLAS, in another order, so the two
// agree within the tests' tolerance, not bit for bit; the combine is numpy's arithmetic step
// for step. A sequence's result depends on its own data alone (batch invariance): tasks are
// (sequence, kv head, split), each computed the same way on whichever of the pool's threads
// (pool.h) takes it, and threads only where there is work enough for them.
//
// How, per task (the G query heads of one kv head, one split):
//   x86 with AVX2 and FMA, D a multiple of 8 ("tiles"): K and V rows read in place through
//     the block table (prefetched ahead: the table scatters them) and widened in registers;
//     the scores of up to 3 heads x 4 positions, and p v of up to 3 heads x 32 columns, in
//     register tiles (16 ymm registers); exp2r in 8 lanes (exp2r_8, below).
//   otherwise ("rows", and everything with -DMD_PORTABLE, for the tests): the same FMAs and
//     sums one lane at a time over rows widened 8 positions at a time: the same bits.
//
// Errors: the entry points check every sequence before they write anything and return -1
// (nothing written) where the twin raises: kv_len over the capacity (max_blocks_per_seq *
// block_size or max_splits * 256), or a block table entry of the positions used that is
// negative or not below the blocks the cache allocation holds (k_blocks, v_blocks); the
// caller then runs the numpy twin, which raises with its own message. The caller has also
// bounds-checked out, qkv's query rows, the tables, the lengths and the workspace
// (attention.py). Restrictions: D even in [2, 256], H a multiple of KV, block_size >= 1,
// outputs not overlapping inputs; built without -ffast-math (NaN and infinities kept).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !defined(MD_PORTABLE)
#include <immintrin.h>
#define MD_ATTN_AVX2 1
#endif
// Loops over register tiles unrolled before GCC's scalar replacement, so the accumulator
// arrays stay in registers (else they go through the stack every step).
#define MD_ATTN_UNROLL _Pragma("GCC unroll 16")

#include "pool.h"

namespace md {
namespace {

constexpr int64_t kSplitTokens = 256;              // attention.py DECODE_SPLIT_TOKENS
constexpr float kLog2e = 1.4426950408889634f;     // attention.py _LOG2E
// Threads only when each gets at least about this many multiply-adds of q.k and p.v.
constexpr int64_t kWorkPerThread = int64_t(1) << 16;
// K and V rows are prefetched this many positions ahead of their use.
constexpr int64_t kPrefetchRows = 16;
constexpr int kRows = 8;   // positions widened together on the rows path

struct SeqSplits {
    int64_t start, first, n_splits;
};

// `_decode_seq`: false where kv_len exceeds the capacity (the twin raises).
inline bool seq_splits(int64_t kv_len, int64_t block_size, int64_t max_blocks_per_seq,
                       int64_t max_splits, int64_t sliding_window, SeqSplits &r) {
    if (kv_len > max_blocks_per_seq * block_size || kv_len > max_splits * kSplitTokens)
        return false;
    r.start = sliding_window > 0 && sliding_window < kv_len ? kv_len - sliding_window : 0;
    r.first = r.start / kSplitTokens;
    r.n_splits = (kv_len + kSplitTokens - 1) / kSplitTokens;
    return true;
}

inline uint16_t to_bf16(float f) {   // convert_bf16.cpp's rule
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float from_bf16(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// NaN-propagating max (numpy's): once m is NaN it stays NaN.
inline float max_nan(float m, float s) { return (s > m || s != s) ? s : m; }

// v rounded to float32 here: keeps -ffp-contract from fusing it into a following add.
inline float rounded(float v) {
#if defined(__x86_64__) || defined(__i386__)
    asm("" : "+x"(v));
#else
    asm("" : "+m"(v));
#endif
    return v;
}

inline void prefetch_row(const uint16_t *row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64)
        __builtin_prefetch(reinterpret_cast<const char *>(row) + o);
}

// The formula's dot tree over 8 lanes.
inline float tree8(const float *a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// ------------------------------------------------------------------------------------------
// exp2 of the softmax, the same bits one lane or 8 at a time
// ------------------------------------------------------------------------------------------
// exp2r(x) = float(2^k * P(r)): x widened to double, clamped to [-200, 200] (the float result
// is 0 below -150 and inf from 128 on either way), k = x rounded to nearest even, r = x - k
// (exact, |r| <= 1/2), P(r) = sum_{i<=8} (r ln 2)^i / i! by Horner, one FMA per step in
// double (truncation below 3e-10 relative), 2^k exact, one rounding to float at the end
// (within an ulp of 2^x; NaN -> x + x). It is not the C library's exp2f: numpy's twin uses
// its own exp2 too, and the tests compare the two within the tolerance table.
constexpr double kLn2 = 0.6931471805599453094;
constexpr int kExp2Degree = 8;
struct Exp2Coeffs {
    double c[kExp2Degree + 1];
    constexpr Exp2Coeffs() : c() {
        double t = 1.0;
        for (int i = 0; i <= kExp2Degree; i++) {
            c[i] = t;
            t = t * kLn2 / double(i + 1);
        }
    }
};
constexpr Exp2Coeffs kExp2{};

inline float exp2r(float x) {
    if (x != x) return x + x;
    const double xd = std::min(std::max(double(x), -200.0), 200.0);
    const double k = std::nearbyint(xd), r = xd - k;
    double p = kExp2.c[kExp2Degree];
    for (int i = kExp2Degree - 1; i >= 0; i--) p = std::fma(p, r, kExp2.c[i]);
    const uint64_t bits = uint64_t(int64_t(k) + 1023) << 52;
    double two_k;
    std::memcpy(&two_k, &bits, 8);
    return float(p * two_k);
}

#if defined(MD_ATTN_AVX2)
inline __m128 exp2r_4(__m256d xd) {
    xd = _mm256_min_pd(_mm256_max_pd(xd, _mm256_set1_pd(-200.0)), _mm256_set1_pd(200.0));
    const __m256d k = _mm256_round_pd(xd, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256d r = _mm256_sub_pd(xd, k);
    __m256d p = _mm256_set1_pd(kExp2.c[kExp2Degree]);
    for (int i = kExp2Degree - 1; i >= 0; i--)
        p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(kExp2.c[i]));
    // k as an integer: the low bits of k + 1.5 * 2^52, less those of 1.5 * 2^52
    const __m256d magic = _mm256_set1_pd(0x1.8p52);
    const __m256i ki = _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(k, magic)),
                                        _mm256_castpd_si256(magic));
    const __m256i two_k = _mm256_slli_epi64(_mm256_add_epi64(ki, _mm256_set1_epi64x(1023)), 52);
    return _mm256_cvtpd_ps(_mm256_mul_pd(p, _mm256_castsi256_pd(two_k)));
}

inline __m256 exp2r_8(__m256 x) {
    const __m256 r = _mm256_set_m128(exp2r_4(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))),
                                     exp2r_4(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
    return _mm256_blendv_ps(r, _mm256_add_ps(x, x), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

// One split's m = max s (NaN if any is), p = exp2r(s - m) in place of s [n], and
// l = sum p in the formula's 8 lanes and tree. s has room for n rounded up to a multiple of
// 8 (the entries past n are overwritten).
inline void softmax_part(float *s, int64_t n, float &m_out, float &l_out) {
    const int64_t n8 = (n + 7) / 8 * 8;
    for (int64_t j = n; j < n8; j++) s[j] = -INFINITY;   // not the max; p = 0 below
    float m = -INFINITY;   // (which zero when +0 and -0 tie: p and l are the same)
    bool nan = false;
    float lane[8] = {};
#if defined(MD_ATTN_AVX2)
    __m256 mv = _mm256_set1_ps(-INFINITY), nv = _mm256_setzero_ps();
    for (int64_t j = 0; j < n8; j += 8) {
        const __m256 sj = _mm256_loadu_ps(s + j);
        mv = _mm256_max_ps(sj, mv);   // sj > mv ? sj : mv
        nv = _mm256_or_ps(nv, _mm256_cmp_ps(sj, sj, _CMP_UNORD_Q));
    }
    alignas(32) float m8[8];
    _mm256_store_ps(m8, mv);
    for (int j = 0; j < 8; j++) m = m8[j] > m ? m8[j] : m;
    nan = _mm256_movemask_ps(nv) != 0;
#else
    for (int64_t j = 0; j < n; j++) {
        m = s[j] > m ? s[j] : m;
        nan |= s[j] != s[j];
    }
#endif
    if (nan) m = NAN;
#if defined(MD_ATTN_AVX2)
    {
        const __m256 m_all = _mm256_set1_ps(m);
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256 lv = _mm256_setzero_ps();
        for (int64_t j = 0; j < n8; j += 8) {
            __m256 pj = exp2r_8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m_all));
            if (j + 8 > n)   // the padding: p = +0
                pj = _mm256_and_ps(pj, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                           _mm256_set1_epi32(int(n - j)), lanes)));
            _mm256_storeu_ps(s + j, pj);
            lv = _mm256_add_ps(lv, pj);
        }
        _mm256_storeu_ps(lane, lv);
    }
#else
    for (int64_t j = 0; j < n8; j++) {   // the same adds, one lane at a time
        s[j] = j < n ? exp2r(s[j] - m) : 0.0f;
        lane[j % 8] += s[j];
    }
#endif
    m_out = m;
    l_out = tree8(lane);
}

// ------------------------------------------------------------------------------------------
// the tiles path: AVX2 + FMA, D a multiple of 8, K and V read in place
// ------------------------------------------------------------------------------------------
#if defined(MD_ATTN_AVX2)
inline __m256 widen8(const uint16_t *src) {   // 8 BF16 -> float32
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src))), 16));
}

// The formula's tree for 4 dot products' lanes at once: (s_0, s_1, s_2, s_3). hadd(x, y) =
// (x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7), so two levels leave
// (a0+a1)+(a2+a3) of each in the low half and (a4+a5)+(a6+a7) in the high one.
inline __m128 tree4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of GT heads (q [GT, d8]) and TT positions (K rows at cache + at[t]):
// s[g * S + t] = dot(q_g, k_t). GT x TT accumulators, GT q vectors and one widened vector
// fit in 16 registers for (GT, TT) = (3, 4), (2, 4), (1, 8).
template <int GT, int TT>
void scores_tile(const float *q, int64_t d8, const uint16_t *cache, const int64_t *at,
                 float *s, int64_t S) {
    __m256 a[GT][TT];
    MD_ATTN_UNROLL for (int g = 0; g < GT; g++)
        MD_ATTN_UNROLL for (int t = 0; t < TT; t++) a[g][t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d8; c += 8) {
        __m256 qc[GT];
        MD_ATTN_UNROLL for (int g = 0; g < GT; g++) qc[g] = _mm256_loadu_ps(q + g * d8 + c);
        MD_ATTN_UNROLL for (int t = 0; t < TT; t++) {
            const __m256 k = widen8(cache + at[t] + c);
            MD_ATTN_UNROLL for (int g = 0; g < GT; g++)
                a[g][t] = _mm256_fmadd_ps(qc[g], k, a[g][t]);
        }
    }
    MD_ATTN_UNROLL for (int g = 0; g < GT; g++)
        MD_ATTN_UNROLL for (int t = 0; t < TT; t += 4)
            _mm_storeu_ps(s + g * S + t,
                          tree4(a[g][t], a[g][t + 1], a[g][t + 2], a[g][t + 3]));
}

// Heads in tiles of 3, or 2 where 3 would leave 1 (4 = 2 + 2).
inline int head_tile(int64_t heads_left) {
    return heads_left == 1 ? 1 : heads_left == 2 || heads_left == 4 ? 2 : 3;
}

// Scores s [G, S] of the n positions (at: n rounded up to 8 entries, the padding repeating
// a row, whose sums land past n). The first head tile prefetches K rows ahead and V rows.
void scores_cache(const float *q, int64_t d8, const uint16_t *k_cache,
                  const uint16_t *v_cache, const int64_t *at, int64_t n, float *s, int64_t S,
                  int64_t G, int64_t row_bytes) {
    for (int64_t g = 0, gt; g < G; g += gt) {
        gt = head_tile(G - g);
        const int64_t tt = gt == 1 ? 8 : 4;
        for (int64_t j0 = 0; j0 < n; j0 += tt) {
            for (int64_t j = j0; g == 0 && j < std::min(n, j0 + tt); j++) {
                if (j + kPrefetchRows < n)
                    prefetch_row(k_cache + at[j + kPrefetchRows], row_bytes);
                prefetch_row(v_cache + at[j], row_bytes);
            }
            const float *qg = q + g * d8;
            float *sg = s + g * S + j0;
            if (gt == 3) scores_tile<3, 4>(qg, d8, k_cache, at + j0, sg, S);
            if (gt == 2) scores_tile<2, 4>(qg, d8, k_cache, at + j0, sg, S);
            if (gt == 1) scores_tile<1, 8>(qg, d8, k_cache, at + j0, sg, S);
        }
    }
}

// p v of GT heads and the U vectors of columns [c, c + 8U) over the n positions in order
// (V rows at cache + at[j]): acc[g * d8 + c + ...] += p[g * S + j] v_j, one FMA per element
// and position. GT x U accumulators, GT broadcast p and one widened vector fit in 16
// registers for (GT, U) = (3, 4), (2, 6), (1, 8): ten or more independent FMA chains.
template <int GT, int U>
void pv_tile(const float *p, int64_t S, const uint16_t *cache, const int64_t *at, int64_t n,
             int64_t c, float *acc, int64_t d8) {
    __m256 r[GT][U];
    MD_ATTN_UNROLL for (int g = 0; g < GT; g++)
        MD_ATTN_UNROLL for (int u = 0; u < U; u++)
            r[g][u] = _mm256_loadu_ps(acc + g * d8 + c + 8 * u);
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *row = cache + at[j] + c;
        __m256 pg[GT];
        MD_ATTN_UNROLL for (int g = 0; g < GT; g++) pg[g] = _mm256_broadcast_ss(p + g * S + j);
        MD_ATTN_UNROLL for (int u = 0; u < U; u++) {
            const __m256 v = widen8(row + 8 * u);
            MD_ATTN_UNROLL for (int g = 0; g < GT; g++)
                r[g][u] = _mm256_fmadd_ps(pg[g], v, r[g][u]);
        }
    }
    MD_ATTN_UNROLL for (int g = 0; g < GT; g++)
        MD_ATTN_UNROLL for (int u = 0; u < U; u++)
            _mm256_storeu_ps(acc + g * d8 + c + 8 * u, r[g][u]);
}

template <int GT, int U>   // every column of one head tile
void pv_heads(const float *p, int64_t S, const uint16_t *cache, const int64_t *at, int64_t n,
              float *acc, int64_t d8) {
    int64_t c = 0;
    for (; c + 8 * U <= d8; c += 8 * U) pv_tile<GT, U>(p, S, cache, at, n, c, acc, d8);
    for (; c < d8; c += 8) pv_tile<GT, 1>(p, S, cache, at, n, c, acc, d8);
}

// acc [G, d8] += p [G, S] v over the n positions.
void pv_cache(const float *p, int64_t S, const uint16_t *cache, const int64_t *at, int64_t n,
              float *acc, int64_t d8, int64_t G) {
    for (int64_t g = 0, gt; g < G; g += gt) {
        gt = head_tile(G - g);
        if (gt == 3) pv_heads<3, 4>(p + g * S, S, cache, at, n, acc + g * d8, d8);
        if (gt == 2) pv_heads<2, 6>(p + g * S, S, cache, at, n, acc + g * d8, d8);
        if (gt == 1) pv_heads<1, 8>(p + g * S, S, cache, at, n, acc + g * d8, d8);
    }
}
#endif

// ------------------------------------------------------------------------------------------
// the rows path: one lane at a time over rows widened to float32 (zero-padded to d8)
// ------------------------------------------------------------------------------------------
inline void widen(const uint16_t *src, float *dst, int64_t d, int64_t d8) {
    int64_t i = 0;
    for (; i < d; i++) dst[i] = from_bf16(src[i]);
    for (; i < d8; i++) dst[i] = 0.0f;
}

// s[j] = dot(q, rows[j]) for the 8 rows [8, d8].
inline void dot_rows(const float *q, const float *rows, int64_t d8, float *s) {
    for (int j = 0; j < kRows; j++) {
        float a[8] = {};
        for (int64_t c = 0; c < d8; c += 8)
            for (int l = 0; l < 8; l++) a[l] = std::fma(q[c + l], rows[j * d8 + c + l], a[l]);
        s[j] = tree8(a);
    }
}

// acc[0, d8) += p[j] rows[j] for the nj rows, one FMA per element and row, rows in order.
inline void pv_rows(const float *p, const float *rows, int nj, int64_t d8, float *acc) {
    for (int j = 0; j < nj; j++)
        for (int64_t c = 0; c < d8; c++) acc[c] = std::fma(p[j], rows[j * d8 + c], acc[c]);
}

// ------------------------------------------------------------------------------------------
// the split and the combine
// ------------------------------------------------------------------------------------------
struct Decode {
    uint16_t *out;
    float *workspace;
    const uint16_t *qkv, *k_cache, *v_cache;
    const int32_t *block_tables, *kv_lens;
    int64_t n_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq,
        max_splits, sliding_window;
    float sl2;
};

struct Task {
    int64_t s, kvh, split, t0, t1;   // positions [t0, t1) of split `split`
    bool single;                     // the sequence's only split: out, not the workspace
};

// Scratch of one thread: q [G, D8], scores then p [G, 256], acc [G, D8], rows [8, D8], the
// split's row offsets [256].
struct Scratch {
    std::vector<float> q, p, acc, rows;
    std::vector<int64_t> at;
    Scratch(int64_t g, int64_t d8)
        : q(g * d8), p(g * kSplitTokens), acc(g * d8), rows(kRows * d8), at(kSplitTokens) {}
};

void run_task(const Decode &a, const Task &t, Scratch &w) {
    const int64_t H = a.num_heads, KV = a.num_kv_heads, D = a.head_dim, G = H / KV;
    const int64_t d8 = (D + 7) / 8 * 8, n = t.t1 - t.t0, S = kSplitTokens, bs = a.block_size;
    const int64_t row_bytes = D * 2;
    const int32_t *table = a.block_tables + t.s * a.max_blocks_per_seq;
    float *q = w.q.data(), *p = w.p.data(), *acc = w.acc.data(), *rows = w.rows.data();
    int64_t *at = w.at.data();
    const uint16_t *qs = a.qkv + t.s * (H + 2 * KV) * D + t.kvh * G * D;   // [G, D]
    for (int64_t g = 0; g < G; g++) {
        widen(qs + g * D, q + g * d8, D, d8);
        for (int64_t i = 0; i < D; i++) q[g * d8 + i] *= a.sl2;
    }
    // at [n]: where positions [t0, t1) of this kv head start in either cache
    for (int64_t j = 0, b = t.t0 / bs, o = t.t0 % bs; j < n; j++) {
        at[j] = (int64_t(table[b]) * bs + o) * KV * D + t.kvh * D;
        if (++o == bs) o = 0, b++;
    }
    for (int64_t j = 0; j < std::min(n, kPrefetchRows); j++)
        prefetch_row(a.k_cache + at[j], row_bytes);
    bool tiles = false;
#if defined(MD_ATTN_AVX2)
    tiles = D == d8;
    if (tiles) {
        for (int64_t j = n; j < (n + 7) / 8 * 8; j++) at[j] = at[n - 1];
        scores_cache(q, d8, a.k_cache, a.v_cache, at, n, p, S, G, row_bytes);
    }
#endif
    for (int64_t j0 = 0; !tiles && j0 < n; j0 += kRows) {   // scores, 8 positions at a time
        const int nj = int(std::min<int64_t>(kRows, n - j0));
        for (int j = 0; j < nj; j++) {
            if (j0 + j + kPrefetchRows < n)
                prefetch_row(a.k_cache + at[j0 + j + kPrefetchRows], row_bytes);
            prefetch_row(a.v_cache + at[j0 + j], row_bytes);
            widen(a.k_cache + at[j0 + j], rows + j * d8, D, d8);
        }
        // rows past nj hold earlier rows: their sums land past n, where softmax_part pads
        for (int64_t g = 0; g < G; g++) dot_rows(q + g * d8, rows, d8, p + g * S + j0);
    }
    std::vector<float> m(G), l(G);
    for (int64_t g = 0; g < G; g++) softmax_part(p + g * S, n, m[g], l[g]);
    std::fill(acc, acc + G * d8, 0.0f);
#if defined(MD_ATTN_AVX2)
    if (tiles) pv_cache(p, S, a.v_cache, at, n, acc, d8, G);
#endif
    for (int64_t j0 = 0; !tiles && j0 < n; j0 += kRows) {   // p v, 8 positions at a time
        const int nj = int(std::min<int64_t>(kRows, n - j0));
        for (int j = 0; j < nj; j++) widen(a.v_cache + at[j0 + j], rows + j * d8, D, d8);
        for (int64_t g = 0; g < G; g++) pv_rows(p + g * S + j0, rows, nj, d8, acc + g * d8);
    }
    const int64_t h0 = t.kvh * G;
    if (t.single) {
        uint16_t *o = a.out + t.s * H * D + h0 * D;
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < D; i++) o[g * D + i] = to_bf16(acc[g * d8 + i] / l[g]);
        return;
    }
    const int64_t msp = a.max_splits;
    float *ws_acc = a.workspace;                           // [n_seqs, H, msp, D]
    float *ws_ml = a.workspace + a.n_seqs * H * msp * D;   // [n_seqs, H, msp, 2]
    for (int64_t g = 0; g < G; g++) {
        const int64_t hs = (t.s * H + h0 + g) * msp + t.split;
        std::memcpy(ws_acc + hs * D, acc + g * d8, size_t(D) * 4);
        ws_ml[hs * 2] = m[g];
        ws_ml[hs * 2 + 1] = l[g];
    }
}

int decode_split(const Decode &a, int64_t k_blocks, int64_t v_blocks) {
    const int64_t bs = a.block_size, cap = std::min(k_blocks, v_blocks);
    std::vector<Task> tasks;
    int64_t work = 0;
    for (int64_t s = 0; s < a.n_seqs; s++) {   // every sequence checked before any write
        const int64_t kv_len = a.kv_lens[s];
        if (kv_len <= 0) continue;
        SeqSplits q;
        if (!seq_splits(kv_len, bs, a.max_blocks_per_seq, a.max_splits, a.sliding_window, q))
            return -1;
        const int32_t *table = a.block_tables + s * a.max_blocks_per_seq;
        for (int64_t b = q.start / bs; b <= (kv_len - 1) / bs; b++)
            if (table[b] < 0 || table[b] >= cap) return -1;
        for (int64_t i = q.first; i < q.n_splits; i++)
            for (int64_t kvh = 0; kvh < a.num_kv_heads; kvh++)
                tasks.push_back({s, kvh, i, std::max(i * kSplitTokens, q.start),
                                 std::min(i * kSplitTokens + kSplitTokens, kv_len),
                                 q.n_splits - q.first == 1});
        work += (kv_len - q.start) * a.num_heads * a.head_dim * 2;
    }
    for (int64_t s = 0; s < a.n_seqs; s++)   // padding rows: zeros
        if (a.kv_lens[s] <= 0)
            std::memset(a.out + s * a.num_heads * a.head_dim, 0,
                        size_t(a.num_heads * a.head_dim) * 2);
    const int64_t n_tasks = int64_t(tasks.size());
    if (n_tasks == 0) return 0;
    const int64_t G = a.num_heads / a.num_kv_heads, d8 = (a.head_dim + 7) / 8 * 8;
    const int nt = int(std::max<int64_t>(
        1, std::min<int64_t>({int64_t(g_threads.load()), n_tasks, work / kWorkPerThread})));
    std::atomic<int64_t> next{0};
    std::function<void(int)> run = [&](int) {   // tasks handed out in order, one at a time
        Scratch w(G, d8);
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_tasks;)
            run_task(a, tasks[size_t(i)], w);
    };
    pool().run(nt, run);
    return 0;
}

int decode_combine(uint16_t *out, const float *workspace, const int32_t *kv_lens,
                   int64_t n_seqs, int64_t num_heads, int64_t head_dim, int64_t block_size,
                   int64_t max_blocks_per_seq, int64_t max_splits, int64_t sliding_window) {
    const int64_t H = num_heads, D = head_dim, msp = max_splits;
    std::vector<SeqSplits> seqs(static_cast<size_t>(n_seqs));
    for (int64_t s = 0; s < n_seqs; s++)   // every sequence checked before any write
        if (kv_lens[s] > 0 && !seq_splits(kv_lens[s], block_size, max_blocks_per_seq, msp,
                                          sliding_window, seqs[size_t(s)]))
            return -1;
    const float *ws_acc = workspace;                         // [n_seqs, H, msp, D]
    const float *ws_ml = workspace + n_seqs * H * msp * D;   // [n_seqs, H, msp, 2]
    std::vector<float> acc(static_cast<size_t>(D));
    for (int64_t s = 0; s < n_seqs; s++) {
        const SeqSplits &q = seqs[size_t(s)];
        if (kv_lens[s] <= 0 || q.n_splits - q.first <= 1) continue;
        for (int64_t h = 0; h < H; h++) {
            const int64_t hs = (s * H + h) * msp;
            float big_m = ws_ml[(hs + q.first) * 2];
            for (int64_t i = q.first + 1; i < q.n_splits; i++)
                big_m = max_nan(big_m, ws_ml[(hs + i) * 2]);
            float lsum = 0.0f;
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t i = q.first; i < q.n_splits; i++) {   // fixed order, like the kernel
                const float wgt = exp2f(ws_ml[(hs + i) * 2] - big_m);
                lsum = lsum + rounded(wgt * ws_ml[(hs + i) * 2 + 1]);
                const float *ai = ws_acc + (hs + i) * D;
                for (int64_t d = 0; d < D; d++) acc[size_t(d)] += rounded(wgt * ai[d]);
            }
            const float inv = 1.0f / lsum;
            uint16_t *o = out + (s * H + h) * D;
            for (int64_t d = 0; d < D; d++) o[d] = to_bf16(acc[size_t(d)] * inv);
        }
    }
    return 0;
}

}  // namespace
}  // namespace md

extern "C" {

// 0, or -1 having written nothing (see the opening comment): then run the numpy twin.
__attribute__((visibility("default"))) int md_decode_attention_split(
    uint16_t *out, float *workspace, const uint16_t *qkv, const uint16_t *k_cache,
    const uint16_t *v_cache, const int32_t *block_tables, const int32_t *kv_lens,
    int64_t n_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks_per_seq, int64_t max_splits, float scale,
    int64_t sliding_window, int64_t k_blocks, int64_t v_blocks) {
    const md::Decode a{out, workspace, qkv, k_cache, v_cache, block_tables, kv_lens,
                       n_seqs, num_heads, num_kv_heads, head_dim, block_size,
                       max_blocks_per_seq, max_splits, sliding_window, scale * md::kLog2e};
    return md::decode_split(a, k_blocks, v_blocks);
}

// 0, or -1 having written nothing where a length exceeds the capacity.
__attribute__((visibility("default"))) int md_decode_attention_combine(
    uint16_t *out, const float *workspace, const int32_t *kv_lens, int64_t n_seqs,
    int64_t num_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks_per_seq,
    int64_t max_splits, int64_t sliding_window) {
    return md::decode_combine(out, workspace, kv_lens, n_seqs, num_heads, head_dim,
                              block_size, max_blocks_per_seq, max_splits, sliding_window);
}

}  // extern "C"

extern "C" {

// out[i] = exp2r(x[i]) through the path the softmax uses (8 lanes where built, then one at
// a time for the tail): for the tests of exp2r's accuracy
__attribute__((visibility("default"))) void md_exp2r(const float *x, int64_t n, float *out) {
    int64_t i = 0;
#if defined(MD_ATTN_AVX2)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, md::exp2r_8(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) out[i] = md::exp2r(x[i]);
}

}  // extern "C"
