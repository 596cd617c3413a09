// The GEMM twin's definition computed natively: HostBackend's fast path for the tensor-core
// GEMM twin (metrale/ops/gemm_tc.py, `pairwise_dot_f32`), built and loaded by
// metrale/gpu_runtime/native.py.
//
// Formula: y[i, j] = f32(G(x[i], w[j]) + 0.0) for x [m, k] and w [n, k] BF16 bits (uint16,
// rows contiguous, any 2-byte alignment), y [m, n] float32, where G is numpy's float64
// `np.sum(p, axis=1)` of the row p = x[i, :] * w[j, :] of exact products (a BF16 x BF16
// product is exact in double): its pairwise summation, replayed operation for operation
// (`Plan` below), so the bits are the numpy twin's, NaN and Inf included; + 0.0 makes an
// exact zero +0. tests/gpu_runtime/test_convert_cache.py compares the two on adversarial
// inputs (values from 2^-60 to 2^60, cancellations, NaN, Inf, subnormals).
//
// Vectorization never reorders a sum: the 8 accumulators r[0..7] of a numpy leaf are the 8
// lanes of one vector, multiply-adds are FMAs (exact products: the same rounding as a
// multiply then an add), and the horizontal and tail additions follow numpy's order.
// Threads: the n columns are split into contiguous ranges, one per pool thread; each
// element is computed by one thread from its two rows only. Restrictions: m, n, k >= 1;
// y must not overlap x or w. Built without -ffast-math (signed zeros, NaN, subnormals kept).
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

typedef double v8d __attribute__((vector_size(64)));
typedef double v8d_u __attribute__((vector_size(64), aligned(8), may_alias));
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v8h_u __attribute__((vector_size(16), aligned(2), may_alias));

#if defined(__AVX512F__)
constexpr int kWideRegs = 1;  // 32 vector registers of 8 doubles: bigger register tiles
#else
constexpr int kWideRegs = 0;
#endif

inline double bf16_to_f64(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline v8d load8(const double *p) { return *reinterpret_cast<const v8d_u *>(p); }

// numpy's pairwise summation (numpy/_core/src/umath/loops_utils.h.src, PW_BLOCKSIZE 128),
// which `np.sum(p, axis=1)` applies to each row p of products: n < 8: a sequential sum from
// 0; n <= 128: r[q] = sum of p[t] over t = q (mod 8), t < n - n % 8, in order of t, then
// ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the n % 8 tail added in order;
// n > 128: n2 = n / 2 rounded down to a multiple of 8, sum(p[:n2]) + sum(p[n2:]).
// A Plan lists the leaves (n <= 128) in order and a postfix program combining them.
struct Plan {
    std::vector<int64_t> lo, len;   // leaves
    std::vector<int8_t> prog;       // 0: push the next leaf, 1: add the top two
    int depth = 0;                  // stack slots the program needs
    explicit Plan(int64_t k) {
        int d = 0;
        build(0, k, d);
    }
    void build(int64_t lo0, int64_t n, int &d) {
        if (n <= 128) {
            lo.push_back(lo0);
            len.push_back(n);
            prog.push_back(0);
            depth = std::max(depth, ++d);
            return;
        }
        int64_t n2 = n / 2;
        n2 -= n2 % 8;
        build(lo0, n2, d);
        build(lo0 + n2, n - n2, d);
        prog.push_back(1);
        d--;
    }
};

constexpr int kMaxDepth = 64;  // log2(2^31 / 64) levels suffice

// 8 BF16 values at p -> 8 doubles in order (AVX-512: widen, shift, convert; compilers
// split the generic form into 128-bit halves).
inline v8d bf16x8_to_f64(const uint16_t *p) {
#if defined(__AVX512F__)
    __m256i u = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))), 16);
    return reinterpret_cast<v8d>(_mm512_cvtps_pd(_mm256_castsi256_ps(u)));
#else
    v8h h = *reinterpret_cast<const v8h_u *>(p);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    return __builtin_convertvector(reinterpret_cast<v8f>(u), v8d);
#endif
}

inline double pairwise8(v8d r) {
    return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
}

// out[e] = pairwise8(a[e]) for e < E: eight at a time as vector additions after a
// transpose (level 1 pairs lanes 0+1, 2+3, 4+5, 6+7; level 2 adds those pairs; level 3 the
// halves: the same additions of the same operands as pairwise8), the rest one by one.
template <int E>
inline void pairwise8_all(const v8d *a, double *out) {
    int e = 0;
#if defined(__AVX512F__)
    for (; e + 8 <= E; e += 8) {
        __m512d b[4], c[2];
        for (int q = 0; q < 4; q++) {
            __m512d lo = reinterpret_cast<__m512d>(a[e + 2 * q]);
            __m512d hi = reinterpret_cast<__m512d>(a[e + 2 * q + 1]);
            b[q] = _mm512_add_pd(_mm512_unpacklo_pd(lo, hi), _mm512_unpackhi_pd(lo, hi));
        }
        for (int q = 0; q < 2; q++)
            c[q] = _mm512_add_pd(_mm512_shuffle_f64x2(b[2 * q], b[2 * q + 1], 0x88),
                                 _mm512_shuffle_f64x2(b[2 * q], b[2 * q + 1], 0xDD));
        __m512d sum = _mm512_add_pd(_mm512_shuffle_f64x2(c[0], c[1], 0x88),
                                    _mm512_shuffle_f64x2(c[0], c[1], 0xDD));
        _mm512_storeu_pd(out + e, sum);
    }
#endif
    for (; e < E; e++) out[e] = pairwise8(a[e]);
}

// W rows for a tile: BF16 bits (converted in registers) or doubles (a converted panel).
struct WBits {
    const uint16_t *p;
    int64_t ld;
    v8d load(int64_t row, int64_t t) const { return bf16x8_to_f64(p + row * ld + t); }
    double at(int64_t row, int64_t t) const { return bf16_to_f64(p[row * ld + t]); }
    WBits rows(int64_t r0) const { return {p + r0 * ld, ld}; }
};
struct WF64 {
    const double *p;
    int64_t ld;
    v8d load(int64_t row, int64_t t) const { return load8(p + row * ld + t); }
    double at(int64_t row, int64_t t) const { return p[row * ld + t]; }
    WF64 rows(int64_t r0) const { return {p + r0 * ld, ld}; }
};

// r[a * NR + b] = numpy's leaf sum over [lo, lo + n) of x[a, :] * w[b, :] (x: doubles,
// row stride k). Products of BF16 values are exact, so FMAs give the same sums as numpy's
// separate multiply and add.
template <int MR, int NR, class W>
inline void leaf_sums(const double *x, int64_t k, const W &w, int64_t lo, int64_t n,
                      double *r) {
    constexpr int E = MR * NR;
    const int64_t end = n < 8 ? 0 : n - n % 8;
    if (n < 8) {
        for (int e = 0; e < E; e++) r[e] = 0.0;
    } else {
        v8d acc[E];
        {
            v8d wv[NR];
            for (int b = 0; b < NR; b++) wv[b] = w.load(b, lo);
            for (int a = 0; a < MR; a++) {
                v8d xv = load8(x + a * k + lo);
                for (int b = 0; b < NR; b++) acc[a * NR + b] = xv * wv[b];
            }
        }
        for (int64_t t = lo + 8; t < lo + end; t += 8) {
            v8d wv[NR];
            for (int b = 0; b < NR; b++) wv[b] = w.load(b, t);
            for (int a = 0; a < MR; a++) {
                v8d xv = load8(x + a * k + t);
                for (int b = 0; b < NR; b++) acc[a * NR + b] += xv * wv[b];
            }
        }
        pairwise8_all<E>(acc, r);
    }
    for (int64_t t = lo + end; t < lo + n; t++)   // the tail, in order
        for (int a = 0; a < MR; a++)
            for (int b = 0; b < NR; b++) r[a * NR + b] += x[a * k + t] * w.at(b, t);
}

// G x T register tiles at once: tile (g, t) is x rows [g MR, g MR + MR) by w rows
// [t NR, t NR + NR). Every leaf is done for all tiles before the next (the leaf's slices of
// x and w stay in L1 meanwhile), then the plan's additions. s[(g T + t) MR NR + a NR + b].
template <int MR, int NR, class W>
void tiles(const Plan &plan, const double *x, int64_t k, const W &w, int G, int T, double *s,
           std::vector<double> &stack) {
    constexpr int E = MR * NR;
    const int C = G * T * E;
    stack.resize(size_t(plan.depth) * C);
    int sp = 0;
    size_t leaf = 0;
    for (int8_t op : plan.prog) {
        if (op == 1) {
            double *lo = stack.data() + (sp - 2) * C, *hi = lo + C;
            for (int c = 0; c < C; c++) lo[c] = lo[c] + hi[c];
            sp--;
            continue;
        }
        const int64_t lo = plan.lo[leaf], n = plan.len[leaf];
        leaf++;
        double *r = stack.data() + (sp++) * C;
        for (int g = 0; g < G; g++)
            for (int t = 0; t < T; t++)
                leaf_sums<MR, NR>(x + g * MR * k, k, w.rows(t * NR), lo, n, r + (g * T + t) * E);
    }
    std::memcpy(s, stack.data(), sizeof(double) * C);
}

struct Job {
    const Plan *plan;
    const double *x;     // [m, k] doubles
    const uint16_t *w;   // [n, k] BF16 bits
    float *y;            // [m, n]
    int64_t m, n, k;
};

inline void put(const Job &job, int64_t i, int64_t j, double v) {
    job.y[i * job.n + j] = static_cast<float>(v + 0.0);
}

// Rows [i0, i0 + MR) of y over the columns [j0, j1) (w: W's rows from j0), tile by tile.
template <int MR, int NR, class W>
void rows_tile(const Job &job, int64_t i0, const W &w, int64_t j0, int64_t j1,
               std::vector<double> &stack) {
    double s[MR * NR];
    int64_t j = j0;
    for (; j + NR <= j1; j += NR) {
        tiles<MR, NR>(*job.plan, job.x + i0 * job.k, job.k, w.rows(j - j0), 1, 1, s, stack);
        for (int a = 0; a < MR; a++)
            for (int b = 0; b < NR; b++) put(job, i0 + a, j + b, s[a * NR + b]);
    }
    for (; j < j1; j++) {
        tiles<MR, 1>(*job.plan, job.x + i0 * job.k, job.k, w.rows(j - j0), 1, 1, s, stack);
        for (int a = 0; a < MR; a++) put(job, i0 + a, j, s[a]);
    }
}

// Register tiles (MR rows of x by NR rows of w): MR * NR accumulators + NR w vectors + an
// x vector must fit the register file.
constexpr int kMaxMR = kWideRegs ? 8 : 4;

// Rows [0, m) over a widened panel of W (columns [j0, j1)): blocks of up to 16 rows by 16
// columns in 4 x 4 tiles sharing each leaf (`tiles`), the rows left over tile by tile.
int64_t panel_blocks(const Job &job, const WF64 &w, int64_t j0, int64_t j1,
                     std::vector<double> &stack) {
    constexpr int MR = 4, NR = 4, B = 4;
    std::vector<double> s(size_t(B * B * MR * NR));
    int64_t i = 0;
    for (; i + MR <= job.m; i += B * MR) {
        const int G = int(std::min<int64_t>(B, (job.m - i) / MR));
        for (int64_t j = j0; j < j1; j += B * NR) {
            const int T = int(std::min<int64_t>(B, (j1 - j) / NR));
            const double *x = job.x + i * job.k;
            if (T > 0) {
                tiles<MR, NR>(*job.plan, x, job.k, w.rows(j - j0), G, T, s.data(), stack);
                for (int g = 0; g < G; g++)
                    for (int t = 0; t < T; t++)
                        for (int a = 0; a < MR; a++)
                            for (int b = 0; b < NR; b++)
                                put(job, i + g * MR + a, j + t * NR + b,
                                    s[(g * T + t) * MR * NR + a * NR + b]);
            }
            const int64_t left = std::min<int64_t>(B * NR, j1 - j) - T * NR;
            const int64_t jl = j + T * NR;
            if (left > 0) {   // fewer than NR columns at the panel's end
                tiles<MR, 1>(*job.plan, x, job.k, w.rows(jl - j0), G, int(left), s.data(), stack);
                for (int g = 0; g < G; g++)
                    for (int t = 0; t < left; t++)
                        for (int a = 0; a < MR; a++) put(job, i + g * MR + a, jl + t, s[(g * left + t) * MR + a]);
            }
        }
        if (G < B) {
            i += G * MR;
            break;
        }
    }
    return i;
}

template <class W>
void row_groups(const Job &job, const W &w, int64_t j0, int64_t j1, int64_t i,
                std::vector<double> &stack) {
    for (; i + kMaxMR <= job.m; i += kMaxMR)
        rows_tile<kMaxMR, kWideRegs ? 2 : 1>(job, i, w, j0, j1, stack);
    switch (job.m - i) {
#if defined(__AVX512F__)
        case 7: rows_tile<7, 2>(job, i, w, j0, j1, stack); break;
        case 6: rows_tile<6, 2>(job, i, w, j0, j1, stack); break;
        case 5: rows_tile<5, 2>(job, i, w, j0, j1, stack); break;
        case 4: rows_tile<4, 3>(job, i, w, j0, j1, stack); break;
        case 3: rows_tile<3, 4>(job, i, w, j0, j1, stack); break;
        case 2: rows_tile<2, 4>(job, i, w, j0, j1, stack); break;
        case 1: rows_tile<1, 4>(job, i, w, j0, j1, stack); break;
#else
        case 3: rows_tile<3, 1>(job, i, w, j0, j1, stack); break;
        case 2: rows_tile<2, 2>(job, i, w, j0, j1, stack); break;
        case 1: rows_tile<1, 2>(job, i, w, j0, j1, stack); break;
#endif
        default: break;
    }
}

// Columns [j_lo, j_hi) of y. W goes in blocks of about 256 KiB of BF16: with more rows
// of x than one register tile holds, each block is widened once into `panel` (doubles,
// L2-resident) and every group of rows passes over it; otherwise it streams through
// registers once.
void columns(const Job &job, int64_t j_lo, int64_t j_hi) {
    const int64_t jb = std::max<int64_t>(16, (int64_t(1) << 17) / job.k / 16 * 16);
    std::vector<double> panel, stack;
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += jb) {
        const int64_t j1 = std::min(j_hi, j0 + jb);
        const uint16_t *wb = job.w + j0 * job.k;
        if (job.m <= kMaxMR) {
            row_groups(job, WBits{wb, job.k}, j0, j1, 0, stack);
            continue;
        }
        const int64_t count = (j1 - j0) * job.k;
        panel.resize(size_t(count));
        int64_t e = 0;
        for (; e + 8 <= count; e += 8) {
            v8d v = bf16x8_to_f64(wb + e);
            std::memcpy(panel.data() + e, &v, sizeof v);
        }
        for (; e < count; e++) panel[e] = bf16_to_f64(wb[e]);
        const WF64 wp{panel.data(), job.k};
        row_groups(job, wp, j0, j1, panel_blocks(job, wp, j0, j1, stack), stack);
    }
}

// A fixed set of worker threads. run(nt, f) calls f(0..nt-1), f(0) on the caller's thread,
// and returns when all are done. Between calls a worker polls for about kSpinNs (the GEMMs
// of one decode step follow each other within microseconds; a futex wake-up per call
// would cost more than a small GEMM), then sleeps on a condition variable, so an idle
// process leaves the cores to others.
constexpr int64_t kSpinNs = 200000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

inline int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

class Pool {
  public:
    void run(int nt, const std::function<void(int)> &f) {
        if (nt <= 1) {
            f(0);
            return;
        }
        std::lock_guard<std::mutex> one_call(call_mu_);  // callers from several threads
        {
            std::lock_guard<std::mutex> lk(mu_);
            while (int(workers_.size()) < nt - 1) {
                int id = int(workers_.size()) + 1;
                workers_.emplace_back([this, id] { loop(id); });
                workers_.back().detach();
            }
            job_ = &f;
            active_ = nt;
            pending_.store(nt - 1, std::memory_order_relaxed);
            generation_.fetch_add(1, std::memory_order_release);
        }
        wake_.notify_all();
        f(0);
        const int64_t t0 = now_ns();
        while (pending_.load(std::memory_order_acquire) != 0) {
            if (now_ns() - t0 > kSpinNs) {
                std::unique_lock<std::mutex> lk(mu_);
                done_.wait(lk, [this] { return pending_.load() == 0; });
                break;
            }
            cpu_relax();
        }
    }

  private:
    void loop(int id) {
        uint64_t seen = 0;
        for (;;) {
            const int64_t t0 = now_ns();
            while (generation_.load(std::memory_order_acquire) == seen &&
                   now_ns() - t0 < kSpinNs)
                cpu_relax();
            const std::function<void(int)> *job;
            {
                std::unique_lock<std::mutex> lk(mu_);
                wake_.wait(lk, [&] { return generation_.load() != seen; });
                seen = generation_.load();
                if (id >= active_) continue;
                job = job_;
            }
            (*job)(id);
            if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                std::lock_guard<std::mutex> lk(mu_);   // the caller may be asleep
                done_.notify_one();
            }
        }
    }
    std::mutex call_mu_, mu_;
    std::condition_variable wake_, done_;
    std::vector<std::thread> workers_;
    const std::function<void(int)> *job_ = nullptr;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    int active_ = 0;
};

Pool *g_pool = nullptr;   // leaked on purpose: never destroyed under a sleeping worker
std::atomic<int> g_threads{1};

void forget_pool_in_child() { g_pool = nullptr; }  // a forked child has no workers

Pool &pool() {
    static bool registered = (pthread_atfork(nullptr, nullptr, forget_pool_in_child), true);
    (void)registered;
    if (g_pool == nullptr) g_pool = new Pool();
    return *g_pool;
}

}  // namespace

extern "C" {

// Threads later calls may use (the caller passes the CPUs it may run on).
__attribute__((visibility("default"))) void md_set_threads(int n) {
    g_threads.store(std::max(1, n));
}

// y[i, j] = f32(G(x[i], w[j])), G numpy's pairwise float64 sum of the exact products
// (see the file header). Threads split the columns.
__attribute__((visibility("default"))) void md_pairwise_dot(const uint16_t *x,
                                                            const uint16_t *w, int64_t m,
                                                            int64_t n, int64_t k, float *y) {
    std::vector<double> xd(size_t(m * k));
    for (int64_t e = 0; e < m * k; e++) xd[e] = bf16_to_f64(x[e]);
    const Plan plan(k);
    const Job job{&plan, xd.data(), w, y, m, n, k};
    // Threads only when each gets at least ~256K multiply-adds; ranges in multiples of 16.
    int nt = int(std::min<int64_t>(g_threads.load(), (m * n * k) >> 18));
    nt = int(std::min<int64_t>(std::max(nt, 1), (n + 15) / 16));
    const int64_t per = ((n + nt - 1) / nt + 15) / 16 * 16;
    std::function<void(int)> run = [&](int t) {
        const int64_t lo = std::min(n, t * per), hi = std::min(n, lo + per);
        if (lo < hi) columns(job, lo, hi);
    };
    pool().run(nt, run);
}

// y[e] = f32(G(x[ii[e]], w[jj[e]])) for e < count: the listed elements only (those the
// float64-matmul path of the twin could not certify).
__attribute__((visibility("default"))) void md_pairwise_at(const uint16_t *x,
                                                           const uint16_t *w, int64_t k,
                                                           const int64_t *ii,
                                                           const int64_t *jj, int64_t count,
                                                           float *y) {
    const Plan plan(k);
    int nt = int(std::min<int64_t>(g_threads.load(), std::max<int64_t>((count * k) >> 18, 1)));
    const int64_t per = (count + nt - 1) / nt;
    std::function<void(int)> run = [&](int t) {
        std::vector<double> xd(static_cast<size_t>(k)), stack;
        const int64_t lo = std::min(count, t * per), hi = std::min(count, lo + per);
        int64_t row = -1;
        for (int64_t e = lo; e < hi; e++) {
            if (ii[e] != row) {
                row = ii[e];
                for (int64_t q = 0; q < k; q++) xd[q] = bf16_to_f64(x[row * k + q]);
            }
            double v;
            tiles<1, 1>(plan, xd.data(), k, WBits{w + jj[e] * k, k}, 1, 1, &v, stack);
            y[e] = static_cast<float>(v + 0.0);
        }
    };
    pool().run(nt, run);
}

// The float64-matmul path's rounding and test (metrale/ops/gemm_tc.py, pairwise_dot_f32):
// y[i, j] = f32(s[i, j] + 0.0); an element is listed in `unsure` (flat index i n + j) when
// s is finite, x_mag[i] w_mag[j] > 2^52 and s - e, s + e round to different floats,
// e = (k + 4) 2^-51 x_norm[i] w_norm[j] + |s| 2^-51. Returns how many were listed
// (`unsure` holds room for m n).
__attribute__((visibility("default"))) int64_t md_round_certified(
    const double *s, int64_t m, int64_t n, int64_t k, const double *x_norm,
    const double *x_mag, const double *w_norm, const double *w_mag, float *y,
    int64_t *unsure) {
    int64_t count = 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            const double v = s[i * n + j] + 0.0;
            y[i * n + j] = static_cast<float>(v);
            if (!(std::fabs(v) <= 1.7976931348623157e308) || x_mag[i] * w_mag[j] <= 0x1p52)
                continue;
            const double e = double(k + 4) * 0x1p-51 * (x_norm[i] * w_norm[j]) +
                             std::fabs(v) * 0x1p-51;
            if (static_cast<float>(v - e) != static_cast<float>(v + e)) unsure[count++] = i * n + j;
        }
    return count;
}

}  // extern "C"
