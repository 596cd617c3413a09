// The native GEMM's machinery (the formula, its three step implementations, register tiles,
// the direct and panel paths, threads), included by gemm_f32.cpp (W as BF16 bits; its
// header documents the formula and the design) and gemm_quant.cpp (W dequantized in the
// tile). A W source gives a W row's step s as 16 float32 lanes (load), a source for the
// rows from r0 (rows) and prefetches (prefetch).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <atomic>
#include <functional>

#if (defined(__x86_64__) || defined(__i386__)) && !defined(MD_PORTABLE)
#include <immintrin.h>
#define MD_MXCSR 1   // the float32 flush is MXCSR's
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VBMI__)   // (gemm_quant_dp.h's byte permutes; Cooper Lake lacks VBMI)
#define MD_DP 1
#endif
#if defined(__FMA__) && defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define MD_AVX2 1   // float32 FMAs in gemm_avx2.h's tiles for 16 ymm registers
#endif
#endif

#include "pool.h"

namespace md {
namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint32_t v16u_u __attribute__((vector_size(64), aligned(2), may_alias));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef double v16d __attribute__((vector_size(128)));

#if defined(__AVX512F__)
// 24 accumulators + 4 w + 1 x of 32 vector registers. More rows than columns: x rows stay
// in L1 while W comes from L2 (6x4 on one Zen 4 core: 91-97 GF/s with float32 FMAs,
// 115-133 with VDPBF16PS; 4x4 FMAs: 47-65).
constexpr int MR = 6, NR = 4;
constexpr int kDirectRows = 8;  // up to 8 rows of x: R x direct_cols(R) tiles from W
constexpr int direct_cols(int r) { return r <= 2 ? 8 : r <= 4 ? 4 : 3; }   // <= 28 regs
#elif defined(MD_AVX2)
// gemm_avx2.h: 8-lane tiles of R x C ymm accumulators (<= 12 of the 16 registers, with
// the W operands, an x row and a constant); a 4 x 3 tile reads 7 ymm per 12 FMAs.
#ifndef MD_MR
#define MD_MR 3
#define MD_NR 3
#endif
constexpr int MR = MD_MR, NR = MD_NR;
constexpr int kDirectRows = 8;
constexpr int direct_cols(int r) { return r == 1 ? 8 : r == 2 ? 4 : r == 3 ? 3 : r <= 6 ? 2 : 1; }
#else
constexpr int MR = 2, NR = 2;   // generic vectors elsewhere (the float64 step)
constexpr int kDirectRows = 2;
constexpr int direct_cols(int) { return 2; }
#endif

constexpr float kMinNormal = 1.17549435e-38f;   // 2^-126

// Decode reads W from DRAM once, a tile's rows side by side: each row is a stream that the
// tile prefetches kAheadBytes ahead into L2 (past a row's end, in the row that continues
// its stream in the next tile). Prefetching into L1 two tiles ahead (up to 64 KiB at
// k = 4096, past L1) read 23-27 GB/s on a 2-core Zen 4 (BF16 Qwen2.5-0.5B linears); this
// reads 39-46 GB/s, FP8 23-27 (its tile's work bounds it), 1-4 KiB ahead alike.
constexpr int64_t kAheadBytes = 2048;
constexpr int64_t kMinChunk = 64;   // columns: gemm's smallest chunk
constexpr int kPrefetchL2 = 2;   // __builtin_prefetch's locality for prefetcht1

// A prefetch of base + offset, the address formed as an integer (no out-of-range pointer:
// prefetches never fault, so rows past W's end are harmless).
template <int kLocality = kPrefetchL2>
inline void prefetch_at(const void *base, int64_t offset) {
    __builtin_prefetch(reinterpret_cast<const void *>(reinterpret_cast<uintptr_t>(base) +
                                                      uintptr_t(offset)),
                       0, kLocality);
}

// The offset kAheadBytes ahead of block blk of row `row` (rows of `blocks` blocks of
// block_bytes, row_bytes apart), past the row's end in row + c: the tile's next row there.
inline int64_t stream_ahead(int64_t row, int64_t blk, int c, int64_t blocks,
                            int64_t block_bytes, int64_t row_bytes) {
    // (values, not std::min's references: GCC kept those in memory, ~15 scalar operations
    // a row's prefetch in the unrolled tiles)
    const int64_t ahead = kAheadBytes / block_bytes;
    const int64_t at = blk + (ahead < blocks ? ahead : blocks);
    const bool past = at >= blocks;
    return (row + (past ? c : 0)) * row_bytes + (at - (past ? blocks : 0)) * block_bytes;
}

inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The flush of float32 sums of two normals (exact when tiny, so any tininess rule agrees):
// MXCSR's job on x86, written out elsewhere.
inline v16f ftz(v16f v) {
#if defined(MD_MXCSR)
    return v;
#else
    const v16f mag = reinterpret_cast<v16f>(reinterpret_cast<v16u>(v) & 0x7FFFFFFFu);
    const v16i tiny = mag < kMinNormal;   // NaN: false
    return reinterpret_cast<v16f>(reinterpret_cast<v16u>(v) & ~reinterpret_cast<v16u>(tiny));
#endif
}

// MXCSR's FTZ and DAZ bits for the float32 work of one job on one thread, restored after.
struct FlushScope {
#if defined(MD_MXCSR)
    unsigned saved = _mm_getcsr();
    FlushScope() { _mm_setcsr(saved | 0x8040u); }
    ~FlushScope() { _mm_setcsr(saved); }
#endif
};

// One step of the formula on 16 lanes. x and w hold 64 bytes of a row each: kPerBlock
// steps cover one block of 32 positions. from_bits(words, h): step h of the block whose
// 32 BF16 bits are `words` (word l = positions 2l | 2l + 1 << 16).
#if defined(MD_DP)
struct DpStep {
    static constexpr const char *kName = "vdpbf16ps";
    static constexpr int kPerBlock = 1;
    static v16f from_bits(v16u words, int) { return reinterpret_cast<v16f>(words); }
    static v16f step(v16f a, v16f x, v16f w) {
        return reinterpret_cast<v16f>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(a),
                                                       reinterpret_cast<__m512bh>(x),
                                                       reinterpret_cast<__m512bh>(w)));
    }
};
#endif

// The odd positions of a block (h = 0), then the even ones (h = 1), as float32.
inline v16f half_block(v16u words, int h) {
    v16u u = h == 0 ? (words & 0xFFFF0000u) : (words << 16);
#if !defined(MD_MXCSR)
    u &= ~reinterpret_cast<v16u>((u & 0x7F800000u) == 0u) | 0x80000000u;   // DAZ
#endif
    return reinterpret_cast<v16f>(u);
}

#if defined(MD_MXCSR) && defined(__FMA__)   // an unfused a + x w would flush a tiny x w
struct FmaStep {
    static constexpr const char *kName = "fma";
    static constexpr int kPerBlock = 2;
    static v16f from_bits(v16u words, int h) { return half_block(words, h); }
    static v16f step(v16f a, v16f x, v16f w) { return a + x * w; }   // one FMA, flushed
};
using FloatStep = FmaStep;
#else
struct F64Step {
    static constexpr const char *kName = "float64";
    static constexpr int kPerBlock = 2;
    static v16f from_bits(v16u words, int h) { return half_block(words, h); }
    static v16f step(v16f a, v16f x, v16f w) {
        // exact product; the sum exact wherever it is near 2^-126 or a rounding boundary
        // the float32 rounding could see (the numpy path's argument, gemm_tc.py)
        const v16d s = __builtin_convertvector(a, v16d) +
                       __builtin_convertvector(x, v16d) * __builtin_convertvector(w, v16d);
        const double tiny_below = 0x1p-126 - 0x1p-151;   // rounds up to 2^-126 from here
        const v16f r = __builtin_convertvector(s, v16f);
        const v16i keep =
            __builtin_convertvector((s < tiny_below) & (s > -tiny_below), v16i) == 0;
        return reinterpret_cast<v16f>(reinterpret_cast<v16u>(r) & reinterpret_cast<v16u>(keep));
    }
};
using FloatStep = F64Step;
#endif

// The formula's lane tree, then + 0 and the canonical NaN, for 16 elements at once:
// y[e] from the lanes of a[e]. Each level adds lanes l and l + 8, then l and l + 4, ...,
// several elements per vector: level 1 holds 2 elements x 8 lanes per vector, level 2
// 4 x 4, level 3 8 x 2, level 4 16 x 1 in element order.
inline void reduce16x16(const v16f *a, float *y) {
    v16f v[8], u[4], t[2];
    for (int i = 0; i < 8; i++)
        v[i] = ftz(__builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16,
                                           17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14,
                                           15, 24, 25, 26, 27, 28, 29, 30, 31));
    for (int j = 0; j < 4; j++)
        u[j] = ftz(__builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16,
                                           17, 18, 19, 24, 25, 26, 27) +
                   __builtin_shufflevector(v[2 * j], v[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15,
                                           20, 21, 22, 23, 28, 29, 30, 31));
    for (int q = 0; q < 2; q++)
        t[q] = ftz(__builtin_shufflevector(u[2 * q], u[2 * q + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16,
                                           17, 20, 21, 24, 25, 28, 29) +
                   __builtin_shufflevector(u[2 * q], u[2 * q + 1], 2, 3, 6, 7, 10, 11, 14, 15,
                                           18, 19, 22, 23, 26, 27, 30, 31));
    v16f r = ftz(__builtin_shufflevector(t[0], t[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                         24, 26, 28, 30) +
                 __builtin_shufflevector(t[0], t[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23,
                                         25, 27, 29, 31));
    r = r + v16f{};
    for (int e = 0; e < 16; e++) {
        float f = r[e];
        if (f != f) {
            const uint32_t nan = 0x7FC00000u;
            std::memcpy(&f, &nan, 4);
        }
        y[e] = f;
    }
}

// W rows as stored BF16 bits; step s of row r comes from block s / kPerBlock (the last
// partial block from a zero-padded copy).
template <class S>
struct WBits {
    const uint16_t *p;
    int64_t k, k_full;   // k_full: k rounded down to a multiple of 32
    v16f load(int64_t row, int64_t s) const {
        const int64_t t = s / S::kPerBlock * 32;
        const uint16_t *r = p + row * k;
        v16u words;
        if (t < k_full) {
            words = *reinterpret_cast<const v16u_u *>(r + t);
        } else {
            alignas(64) uint16_t tail[32] = {};
            std::memcpy(tail, r + t, size_t(k - t) * 2);
            std::memcpy(&words, tail, 64);
        }
        return S::from_bits(words, int(s % S::kPerBlock));
    }
    WBits rows(int64_t r0) const { return {p + r0 * k, k, k_full}; }
    // row's stream ahead of step s, in a tile of c rows
    void prefetch(int64_t row, int64_t s, int c) const {
        prefetch_at(p, stream_ahead(row, s / S::kPerBlock, c, (k + 31) / 32, 64, 2 * k));
    }
};

// W rows already in step order, `steps` vectors a row (FloatStep's widened panel).
struct WPanel {
    const v16f *p;
    int64_t steps;
    v16f load(int64_t row, int64_t s) const { return p[row * steps + s]; }
    WPanel rows(int64_t r0) const { return {p + r0 * steps, steps}; }
    void prefetch(int64_t, int64_t, int) const {}   // the panel is in L2 already
};

struct Out {
    float *f32;      // one of the two
    uint16_t *bf16;
    int64_t n;       // elements between rows (ldy, at least the GEMM's n)
    void put(int64_t i, int64_t j, float v) const {
        if (f32) f32[i * n + j] = v;
        else bf16[i * n + j] = f32_to_bf16(v);
    }
};

// Keeps v in a register: without it GCC folds the x load into each of the C FMAs as a
// memory operand, R * C + C loads per R * C FMAs instead of R + C, and the loop is bound by
// loads, not FMAs (prefill shapes: 1.5-1.9x slower).
inline void pin(v16f &v) {
#if defined(__AVX512F__) && (defined(__x86_64__) || defined(__i386__))
    asm("" : "+v"(v));
#else
    (void)v;
#endif
}

// The lane tree of each accumulator of an R x C tile, stored at y[i0 + a, j + b].
template <int R, int C>
inline void store_tile(const v16f *acc, const Out &out, int64_t i0, int64_t j) {
    float y[R * C];
    int e = 0;
    for (; e + 16 <= R * C; e += 16) reduce16x16(acc + e, y + e);
    if constexpr (R * C % 16 != 0) {   // the rest through the same tree, zero-padded
        v16f rest[16] = {};
        float y16[16];
        for (int i = 0; e + i < R * C; i++) rest[i] = acc[e + i];
        reduce16x16(rest, y16);
        for (int i = 0; e + i < R * C; i++) y[e + i] = y16[i];
    }
    for (int a = 0; a < R; a++)
        for (int b = 0; b < C; b++) out.put(i0 + a, j + b, y[a * C + b]);
}

// y[i0 + a, j + b] for a < R, b < C: x rows of `steps` vectors each (see prepare_x).
template <class S, int R, int C, class W>
inline void tile(const v16f *x, int64_t steps, const W &w, const Out &out, int64_t i0,
                 int64_t j) {
    v16f acc[R * C];
    for (int e = 0; e < R * C; e++) acc[e] = v16f{};
    for (int64_t s = 0; s < steps; s++) {
        v16f wv[C];
        for (int b = 0; b < C; b++) {
            w.prefetch(b, s, C);   // a stream per row, ahead (DRAM latency is long)
            wv[b] = w.load(b, s);
        }
        for (int a = 0; a < R; a++) {
            v16f xv = x[a * steps + s];
            pin(xv);
            for (int b = 0; b < C; b++) acc[a * C + b] = S::step(acc[a * C + b], xv, wv[b]);
        }
    }
    store_tile<R, C>(acc, out, i0, j);
}

// f(std::integral_constant<int, m>) for 1 <= m <= R, nothing otherwise: a row count known
// at run time as the tile height of a compile-time shape (decode's and the last rows').
template <int R, class F>
inline void with_rows(int64_t m, F &&f) {
    if constexpr (R > 1)
        if (m < R) return with_rows<R - 1>(m, f);
    if (m == R) f(std::integral_constant<int, R>{});
}

// Rows [i0, i0 + R) over columns [j0, j1) in R x C tiles (w holds W's rows from j0).
template <class S, int R, int C, class W>
void row_group(const v16f *x, int64_t steps, const W &w, const Out &out, int64_t i0,
               int64_t j0, int64_t j1) {
    int64_t j = j0;
    for (; j + C <= j1; j += C) tile<S, R, C>(x, steps, w.rows(j - j0), out, i0, j);
    for (; j < j1; j++) tile<S, R, 1>(x, steps, w.rows(j - j0), out, i0, j);
}

// Every row of a small x (m <= kDirectRows) in one m x direct_cols(m) tile pass over W,
// so each W element is read once.
template <class S, class W>
void direct(const v16f *x, int64_t m, int64_t steps, const W &w, const Out &out, int64_t j0,
            int64_t j1) {
    with_rows<kDirectRows>(m, [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        row_group<S, R, direct_cols(R)>(x, steps, w, out, 0, j0, j1);
    });
}

template <class S, class W>
void all_rows(const v16f *x, int64_t m, int64_t steps, const W &w, const Out &out, int64_t j0,
              int64_t j1) {
    int64_t i = 0;
    for (; i + MR <= m; i += MR) row_group<S, MR, NR>(x + i * steps, steps, w, out, i, j0, j1);
    if constexpr (MR > 1)   // the last m % MR rows as one row group
        with_rows<MR - 1>(m - i, [&](auto rows) {
            row_group<S, decltype(rows)::value, NR>(x + i * steps, steps, w, out, i, j0, j1);
        });
}

// One GEMM: x rows in S's step order, W from a source (WBits, or a dequantizing source of
// gemm_quant.cpp) with load(row, s) / rows(r0) / prefetch(row, s).
template <class W>
struct Job {
    const v16f *x;       // [m, steps] in S's step order
    W w;                 // W's rows from row 0
    Out out;
    int64_t m, n, k, steps;
};

// Decode through a view of W that builds its values per chunk instead of per block: none
// here; gemm_quant_dp.h overloads it for quantized W (found at instantiation, by ADL).
template <class W>
bool direct_quant(const Job<W> &, int64_t, int64_t) { return false; }

// Columns [j_lo, j_hi) of one job, on one thread (noinline: the float work stays inside
// the caller's FlushScope).
template <class S, class W>
__attribute__((noinline)) void columns(const Job<W> &job, int64_t j_lo, int64_t j_hi) {
    if (job.m <= kDirectRows) {
        if (!direct_quant(job, j_lo, j_hi))   // gemm_quant_dp.h's overloads, if W has one
            direct<S>(job.x, job.m, job.steps, job.w.rows(j_lo), job.out, j_lo, j_hi);
        return;
    }
    // W in blocks of about 192 KiB as the steps read it (a multiple of NR rows), copied
    // (DpStep: the bits, zero-padded to k32) or widened (float32 steps) into a panel once
    const int64_t jb = std::max<int64_t>(NR, (int64_t(192) << 10) / (job.steps * 64) / NR * NR);
    std::vector<v16f> panel(size_t(jb * job.steps));
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += jb) {
        const int64_t j1 = std::min(j_hi, j0 + jb);
        for (int64_t r = 0; r < j1 - j0; r++)
            for (int64_t s = 0; s < job.steps; s++)
                panel[size_t(r * job.steps + s)] = job.w.load(j0 + r, s);
        all_rows<S>(job.x, job.m, job.steps, WPanel{panel.data(), job.steps}, job.out, j0, j1);
    }
}

// x [m, k] BF16 -> [m, steps] vectors in S's step order, zero-padded.
template <class S>
std::vector<v16f> prepare_x(const uint16_t *x, int64_t m, int64_t k, int64_t steps) {
    std::vector<v16f> xs(size_t(m * steps), v16f{});
    const WBits<S> rows{x, k, k / 32 * 32};
    for (int64_t i = 0; i < m; i++)
        for (int64_t s = 0; s < steps; s++) xs[size_t(i * steps + s)] = rows.load(i, s);
    return xs;
}

}  // namespace
}  // namespace md

#include "gemm_avx2.h"

namespace md {
namespace {

template <class S, class W>
void gemm(const uint16_t *x, const W &w, int64_t m, int64_t n, int64_t k, Out out) {
    const int64_t steps = (k + 31) / 32 * S::kPerBlock;
#if defined(MD_AVX2)   // FmaStep, the only step of this build, in 8-lane tiles
    const std::vector<v16f> xs = prepare_x8(x, m, k, steps);
#else
    const std::vector<v16f> xs = prepare_x<S>(x, m, k, steps);
#endif
    // Threads only when each gets at least ~256K multiply-adds; ranges in multiples of NR.
    const int64_t k32 = (k + 31) / 32 * 32;
    int nt = int(std::min<int64_t>(g_threads.load(), (m * n * k32) >> 18));
    nt = int(std::min<int64_t>(std::max(nt, 1), (n + NR - 1) / NR));
    // Columns in chunks taken in turn from a shared counter, guided: each a 1 / (2 nt)
    // of the columns left (at least kMinChunk), so a thread that starts late (a worker's
    // wake-up, ~5-20 us against a decode GEMM's 30-300) or runs slow (a shared core) takes
    // less, where a fixed split waited for it; few chunks, so W's prefetch streams rarely
    // restart. (Decode: multiples of 16 columns, so tiles of 8 or 4 rows start on the
    // edges of FP8's 128-row scale blocks, and share their tables; the bits never depend
    // on the split.)
    const int64_t align = m <= kDirectRows ? 16 : NR;
    const int64_t min_chunk = std::max<int64_t>(align, kMinChunk / align * align);
    // Row blocks of about 2 MiB of x (at least 16 MR-row groups): every W block is read
    // once per row block, and the x rows that pass over it come from L2/L3, not DRAM
    // (1024 rows at k = 4864: 115 -> 180 GF/s of FMAs). Rows never interact: same bits.
    const int64_t x_block_rows = (int64_t(2) << 20) / (steps * 64) / MR * MR;
    const int64_t rows = m <= kDirectRows ? m : std::max<int64_t>(16 * MR, x_block_rows);
    for (int64_t i0 = 0; i0 < m; i0 += rows) {
        const Out part{out.f32 ? out.f32 + i0 * out.n : nullptr,   // (out.n: Y's row stride)
                       out.bf16 ? out.bf16 + i0 * out.n : nullptr, out.n};
        const Job<W> job{xs.data() + i0 * steps, w, part, std::min(rows, m - i0), n, k, steps};
        std::atomic<int64_t> next{0};
        std::function<void(int)> run = [&](int) {
            [[maybe_unused]] FlushScope flush;
            for (int64_t lo = next.load(std::memory_order_relaxed); lo < n;) {
                const int64_t left = n - lo;
                const int64_t chunk =
                    nt == 1 ? left : std::max(min_chunk, left / (2 * nt) / align * align);
                const int64_t hi = std::min(n, lo + chunk);
                if (!next.compare_exchange_weak(lo, hi, std::memory_order_relaxed)) continue;
#if defined(MD_AVX2)
                columns8(job, lo, hi);
#else
                columns<S>(job, lo, hi);
#endif
                lo = next.load(std::memory_order_relaxed);
            }
        };
        pool().run(nt, run);
    }
}

}  // namespace

// Set by md_set_dp after the self-check (shared by every source file of the library).
inline std::atomic<bool> g_use_dp{false};

namespace {

// The GEMM with the step this library uses now: make(step) builds the W source for that
// step type (WBits<S>, or a dequantizing source).
template <class Make>
void gemm_any(const uint16_t *x, int64_t m, int64_t n, int64_t k, Out out, Make make) {
#if defined(MD_DP)
    if (g_use_dp.load()) return gemm<DpStep>(x, make(DpStep{}), m, n, k, out);
#endif
    gemm<FloatStep>(x, make(FloatStep{}), m, n, k, out);
}

}  // namespace
}  // namespace md
