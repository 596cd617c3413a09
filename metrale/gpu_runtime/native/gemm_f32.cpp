// The GEMM twin computed natively: HostBackend's fast path for the tensor-core GEMM twin
// (metrale/ops/gemm_tc.py, `dot_f32`), built and loaded by metrale/gpu_runtime/native.py.
//
// Formula, for x [m, k] and w [n, k] BF16 bits (uint16, rows contiguous, 2-byte aligned)
// and y [m, n] (float32, or BF16 bits rounded to nearest even with NaN -> 0x7FFF):
//   a BF16 subnormal input counts as 0; k32 = k rounded up to a multiple of 32, both rows
//   zero-padded to k32;
//   lane l = 0..15: a_l = +0; for each block b = 0, 1, ... of 32 positions, in order:
//       a_l = ftz(f32(a_l + x[32b + 2l + 1] w[32b + 2l + 1]))   (the odd position first)
//       a_l = ftz(f32(a_l + x[32b + 2l] w[32b + 2l]))
//     one rounding each (the product is exact); ftz(v) = 0 when v is tiny after rounding
//     (v rounded to 24 bits with an unbounded exponent is below 2^-126: x86's rule);
//   8 lanes: b_l = a_l + a_{l+8}; then 4: c_l = b_l + b_{l+4}; 2: d_l = c_l + c_{l+2};
//   y = (d_0 + d_1) + 0, every addition in float32 and flushed the same way; a NaN result
//   is 0x7FC00000.
// One fixed order per element that depends on k alone, so a row's result never depends on
// m, its position, the thread split or the blocking: batch invariance by construction.
// It is what the AVX-512 BF16 instruction VDPBF16PS computes (16 lanes, one block per
// instruction, subnormals flushed), so CPUs that have it run one instruction per 32
// multiply-adds of a row pair, twice the float32 FMA rate.
//
// Three implementations of one formula (the numpy path of gemm_tc.py is a fourth; the tests
// compare them on adversarial inputs):
//   DpStep   VDPBF16PS on BF16 operands as stored. Used only after md_dp_selfcheck() found
//            this CPU's instruction equal to FmaStep, lane for lane (native.py does that at
//            load), since the formula, not the instruction, is the contract.
//   FmaStep  x86 without it: operands widened to float32, each block as its 16 odd then its
//            16 even positions, one FMA per step with MXCSR's flush-to-zero and
//            denormals-are-zero bits set for the duration of a job (x86 flushes by the
//            formula's rule).
//   F64Step  other CPUs, x86 without FMA (and -DMD_PORTABLE, for the tests): the step in
//            float64, which holds the exact product and, wherever the rounding can matter,
//            the exact sum; the flush written out (MXCSR's for the tree on x86).
// Register tiles: x rows stay in L1 while W rows come from L2. W is read as stored when x
// has at most kDirectRows rows (decode: memory-bound, W read once, prefetched); otherwise
// in blocks copied once into a panel in step order (DpStep: the bits, zero-padded; the
// float32 steps: widened), which stays in L2 while every MR-row group passes over it (a
// panel, not W in place: 1.7x faster, no tail checks or prefetches in the inner loop).
// Threads split the n columns into contiguous ranges (pool.h). Built without -ffast-math.
// Restrictions: m, n, k >= 1; y must not overlap x or w.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if (defined(__x86_64__) || defined(__i386__)) && !defined(MD_PORTABLE)
#include <immintrin.h>
#define MD_MXCSR 1   // the float32 flush is MXCSR's
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define MD_DP 1
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
#else
constexpr int MR = 2, NR = 2;   // AVX2: a 16-float vector is two of the 16 registers
constexpr int kDirectRows = 2;
constexpr int direct_cols(int) { return 2; }
#endif

constexpr float kMinNormal = 1.17549435e-38f;   // 2^-126

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
    // Prefetches never fault, so rows past W's end are harmless; the address is formed
    // as an integer (no out-of-range pointer). Decode streams W from DRAM: with it, 8 rows
    // over the 151936 x 896 LM head take 17 ms instead of 24.
    void prefetch(int64_t row, int64_t s) const {
        __builtin_prefetch(reinterpret_cast<const void *>(
            reinterpret_cast<uintptr_t>(p) + uintptr_t((row * k + s / S::kPerBlock * 32) * 2)));
    }
};

// W rows already in step order, `steps` vectors a row (FloatStep's widened panel).
struct WPanel {
    const v16f *p;
    int64_t steps;
    v16f load(int64_t row, int64_t s) const { return p[row * steps + s]; }
    WPanel rows(int64_t r0) const { return {p + r0 * steps, steps}; }
    void prefetch(int64_t, int64_t) const {}   // the panel is in L2 already
};

struct Out {
    float *f32;      // one of the two
    uint16_t *bf16;
    int64_t n;
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

// y[i0 + a, j + b] for a < R, b < C: x rows of `steps` vectors each (see prepare_x).
template <class S, int R, int C, class W>
inline void tile(const v16f *x, int64_t steps, const W &w, const Out &out, int64_t i0,
                 int64_t j) {
    v16f acc[R * C];
    for (int e = 0; e < R * C; e++) acc[e] = v16f{};
    for (int64_t s = 0; s < steps; s++) {
        v16f wv[C];
        for (int b = 0; b < C; b++) {
            w.prefetch(b + 2 * C, s);   // the tile after next: DRAM latency is long
            wv[b] = w.load(b, s);
        }
        for (int a = 0; a < R; a++) {
            v16f xv = x[a * steps + s];
            pin(xv);
            for (int b = 0; b < C; b++) acc[a * C + b] = S::step(acc[a * C + b], xv, wv[b]);
        }
    }
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

// Rows [i0, i0 + R) over columns [j0, j1) in R x C tiles (w holds W's rows from j0).
template <class S, int R, int C, class W>
void row_group(const v16f *x, int64_t steps, const W &w, const Out &out, int64_t i0,
               int64_t j0, int64_t j1) {
    int64_t j = j0;
    for (; j + C <= j1; j += C) tile<S, R, C>(x, steps, w.rows(j - j0), out, i0, j);
    for (; j < j1; j++) tile<S, R, 1>(x, steps, w.rows(j - j0), out, i0, j);
}

// Every row of a small x (m <= kDirectRows) in one R x direct_cols(R) tile pass over W,
// so each W element is read once.
template <class S, int R>
bool direct(const v16f *x, int64_t m, int64_t steps, const WBits<S> &w, const Out &out,
            int64_t j0, int64_t j1) {
    if constexpr (R > 1)
        if (m < R) return direct<S, R - 1>(x, m, steps, w, out, j0, j1);
    if (m != R) return false;
    row_group<S, R, direct_cols(R)>(x, steps, w, out, 0, j0, j1);
    return true;
}

// The last m % MR rows (R of them) as one R x NR row group.
template <class S, int R, class W>
void rest_rows(const v16f *x, int64_t r, int64_t steps, const W &w, const Out &out,
               int64_t i0, int64_t j0, int64_t j1) {
    if constexpr (R > 1)
        if (r < R) return rest_rows<S, R - 1>(x, r, steps, w, out, i0, j0, j1);
    if (r == R) row_group<S, R, NR>(x + i0 * steps, steps, w, out, i0, j0, j1);
}

template <class S, class W>
void all_rows(const v16f *x, int64_t m, int64_t steps, const W &w, const Out &out, int64_t j0,
              int64_t j1) {
    int64_t i = 0;
    for (; i + MR <= m; i += MR) row_group<S, MR, NR>(x + i * steps, steps, w, out, i, j0, j1);
    if constexpr (MR > 1) rest_rows<S, MR - 1>(x, m - i, steps, w, out, i, j0, j1);
}

struct Job {
    const v16f *x;       // [m, steps] in S's step order
    const uint16_t *w;   // [n, k] BF16 bits
    Out out;
    int64_t m, n, k, steps;
};

// Columns [j_lo, j_hi) of one job, on one thread (noinline: the float work stays inside
// the caller's FlushScope).
template <class S>
__attribute__((noinline)) void columns(const Job &job, int64_t j_lo, int64_t j_hi) {
    const WBits<S> wb{job.w, job.k, job.k / 32 * 32};
    if (job.m <= kDirectRows) {
        direct<S, kDirectRows>(job.x, job.m, job.steps, wb.rows(j_lo), job.out, j_lo, j_hi);
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
                panel[size_t(r * job.steps + s)] = wb.load(j0 + r, s);
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

template <class S>
void gemm(const uint16_t *x, const uint16_t *w, int64_t m, int64_t n, int64_t k, Out out) {
    const int64_t steps = (k + 31) / 32 * S::kPerBlock;
    const std::vector<v16f> xs = prepare_x<S>(x, m, k, steps);
    // Threads only when each gets at least ~256K multiply-adds; ranges in multiples of NR.
    const int64_t k32 = (k + 31) / 32 * 32;
    int nt = int(std::min<int64_t>(g_threads.load(), (m * n * k32) >> 18));
    nt = int(std::min<int64_t>(std::max(nt, 1), (n + NR - 1) / NR));
    const int64_t per = ((n + nt - 1) / nt + NR - 1) / NR * NR;
    // Row blocks of about 2 MiB of x (at least 16 MR-row groups): every W block is read
    // once per row block, and the x rows that pass over it come from L2/L3, not DRAM
    // (1024 rows at k = 4864: 115 -> 180 GF/s of FMAs). Rows never interact: same bits.
    const int64_t x_block_rows = (int64_t(2) << 20) / (steps * 64) / MR * MR;
    const int64_t rows = m <= kDirectRows ? m : std::max<int64_t>(16 * MR, x_block_rows);
    for (int64_t i0 = 0; i0 < m; i0 += rows) {
        const Out part{out.f32 ? out.f32 + i0 * n : nullptr,
                       out.bf16 ? out.bf16 + i0 * n : nullptr, n};
        const Job job{xs.data() + i0 * steps, w, part, std::min(rows, m - i0), n, k, steps};
        std::function<void(int)> run = [&](int t) {
            const int64_t lo = std::min(n, t * per), hi = std::min(n, lo + per);
            [[maybe_unused]] FlushScope flush;
            if (lo < hi) columns<S>(job, lo, hi);
        };
        pool().run(nt, run);
    }
}

std::atomic<bool> g_use_dp{false};   // set by md_set_dp after the self-check

void gemm_any(const uint16_t *x, const uint16_t *w, int64_t m, int64_t n, int64_t k, Out out) {
#if defined(MD_DP)
    if (g_use_dp.load()) return gemm<DpStep>(x, w, m, n, k, out);
#endif
    gemm<FloatStep>(x, w, m, n, k, out);
}

#if defined(MD_DP)
// 16 lanes of one block through VDPBF16PS and through FloatStep's two steps; the lanes that
// differ (zeros of either sign are equal: the formula's + 0 makes every zero result +0).
__attribute__((noinline)) int selfcheck_block(const uint16_t *xb, const uint16_t *wb,
                                              const float *acc) {
    [[maybe_unused]] FlushScope flush;
    v16u xw, ww;
    v16f a;
    std::memcpy(&xw, xb, 64);
    std::memcpy(&ww, wb, 64);
    std::memcpy(&a, acc, 64);
    const v16f hw = DpStep::step(a, reinterpret_cast<v16f>(xw), reinterpret_cast<v16f>(ww));
    v16f ref = FloatStep::step(a, half_block(xw, 0), half_block(ww, 0));
    ref = FloatStep::step(ref, half_block(xw, 1), half_block(ww, 1));
    int bad = 0;
    for (int l = 0; l < 16; l++) {
        const float p = hw[l], q = ref[l];
        uint32_t u, v;
        std::memcpy(&u, &p, 4);
        std::memcpy(&v, &q, 4);
        const bool same = u == v || (p == 0.0f && q == 0.0f) || (p != p && q != q);
        bad += !same;
    }
    return bad;
}
#endif

}  // namespace
}  // namespace md

extern "C" {

// Threads later calls may use (the caller passes the CPUs it may run on).
__attribute__((visibility("default"))) void md_set_threads(int n) {
    md::g_threads.store(std::max(1, n));
}

// 1 when this build has the VDPBF16PS path.
__attribute__((visibility("default"))) int md_dp_compiled() {
#if defined(MD_DP)
    return 1;
#else
    return 0;
#endif
}

// Lanes (of `blocks` * 16 adversarial ones, plus a sweep of sums around 2^-126) where this
// CPU's VDPBF16PS differs from the formula; -1 without the path.
__attribute__((visibility("default"))) int64_t md_dp_selfcheck(int64_t blocks) {
#if defined(MD_DP)
    uint64_t state = 0x9E3779B97F4A7C15ull;
    auto next = [&state] {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        return state;
    };
    // BF16 classes: zero or subnormal, the smallest normals, huge, [2^-8, 2^8), anything
    auto bf16 = [&next] {
        const uint64_t r = next();
        const uint16_t sign_mant = uint16_t(r & 0x807Fu);
        switch ((r >> 16) % 6) {
            case 0: return sign_mant;
            case 1: return uint16_t(sign_mant | uint16_t((1 + (r >> 24) % 40) << 7));
            case 2: return uint16_t(sign_mant | uint16_t((0xF0 + (r >> 24) % 15) << 7));
            case 3: case 4: return uint16_t(sign_mant | uint16_t((119 + (r >> 24) % 16) << 7));
            default: return uint16_t(r >> 32);
        }
    };
    auto f32 = [](uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; };
    int64_t bad = 0;
    alignas(64) uint16_t xb[32], wb[32];
    alignas(64) float acc[16];
    for (int64_t i = 0; i < blocks; i++) {
        for (int t = 0; t < 32; t++) xb[t] = bf16(), wb[t] = bf16();
        for (int l = 0; l < 16; l++) {
            const uint64_t r = next();
            const uint32_t sign_mant = uint32_t(r) & 0x807FFFFFu;
            const uint32_t exp = (r >> 32) % 4 == 0 ? 1 + (r >> 40) % 40 : (r >> 40) % 254 + 1;
            acc[l] = (r >> 48) % 8 == 0 ? 0.0f : f32(sign_mant | exp << 23);
        }
        bad += md::selfcheck_block(xb, wb, acc);
    }
    // the rounding boundary at 2^-126: acc = +-2^-126 (1 + j / 8) plus products of either
    // sign from 2^-153 to 2^-146 with every BF16 mantissa (x = 2^-76 at the odd position)
    for (int j = 0; j < 8; j++)
        for (int e = -153; e <= -146; e++)
            for (int mant = 0; mant < 128; mant++) {
                std::memset(xb, 0, sizeof xb);
                std::memset(wb, 0, sizeof wb);
                for (int l = 0; l < 16; l++) {
                    const float a = std::ldexp(1.0f + j / 8.0f, -126) * ((l & 1) ? -1.0f : 1.0f);
                    acc[l] = a;
                    const uint32_t wbits = uint32_t((e + 76 + 127) << 7 | mant) |
                                           ((l & 2) ? 0x8000u : 0u);
                    xb[2 * l + 1] = uint16_t((127 - 76) << 7);
                    wb[2 * l + 1] = uint16_t(wbits);
                }
                bad += md::selfcheck_block(xb, wb, acc);
            }
    return bad;
#else
    (void)blocks;
    return -1;
#endif
}

// The step later calls use: "vdpbf16ps", "fma" or "float64".
__attribute__((visibility("default"))) const char *md_gemm_kind() {
#if defined(MD_DP)
    if (md::g_use_dp.load()) return md::DpStep::kName;
#endif
    return md::FloatStep::kName;
}

// Use VDPBF16PS (1) or the float32 steps (0); returns whether it is now used.
__attribute__((visibility("default"))) int md_set_dp(int on) {
#if defined(MD_DP)
    md::g_use_dp.store(on != 0);
    return on != 0;
#else
    (void)on;
    return 0;
#endif
}

// y [m, n] float32 (see the file header).
__attribute__((visibility("default"))) void md_gemm_f32(const uint16_t *x, const uint16_t *w,
                                                        int64_t m, int64_t n, int64_t k,
                                                        float *y) {
    md::gemm_any(x, w, m, n, k, md::Out{y, nullptr, n});
}

// y [m, n] BF16 bits: the float32 result rounded to nearest even, NaN -> 0x7FFF.
__attribute__((visibility("default"))) void md_gemm_bf16(const uint16_t *x, const uint16_t *w,
                                                         int64_t m, int64_t n, int64_t k,
                                                         uint16_t *y) {
    md::gemm_any(x, w, m, n, k, md::Out{nullptr, y, n});
}

}  // extern "C"
