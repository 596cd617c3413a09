// The GEMM twin computed natively: HostBackend's fast path for the tensor-core GEMM twin
// (metrale/ops/gemm_tc.py, `dot_f32`), built and loaded by metrale/gpu_runtime/native.py.
//
// Formula, for x [m, k] and w [n, k] BF16 bits (uint16, rows contiguous, 2-byte aligned)
// and y [m, n] (float32, or BF16 bits rounded to nearest even with NaN -> 0x7FFF):
//   k16 = k rounded up to a multiple of 16, both rows zero-padded to k16;
//   lane l = 0..15: a_l = +0; for t = l, l + 16, ..., < k16 in order:
//       a_l = f32(a_l + x[t] w[t])            (one rounding: the product is exact)
//   8 lanes: b_l = a_l + a_{l+8}; then 4: c_l = b_l + b_{l+4}; 2: d_l = c_l + c_{l+2};
//   y = (d_0 + d_1) + 0, every addition in float32; a NaN result is 0x7FC00000.
// One fixed order per element that depends on k alone, so a row's result never depends on
// m, its position, the thread split or the blocking: batch invariance by construction.
// The numpy path of gemm_tc.py computes the same bits (tests/ops/test_gemm_tc.py and
// tests/gpu_runtime/test_convert_cache.py compare them on adversarial inputs).
//
// Vectorization: the 16 lanes are one vector (AVX-512: one register) and a_l + x w is an
// FMA, which rounds once, as the formula says. Register tiles; W is read as BF16 and
// widened in registers when x has at most kDirectRows rows (decode: memory-bound, W read
// once), else W goes in blocks widened once into a float32 panel that stays in L2 while
// every MR-row group passes over it. Threads split the n columns into contiguous
// ranges. Built without -ffast-math: signed zeros, NaN, Inf and subnormals follow IEEE.
// Restrictions: m, n, k >= 1; y must not overlap x or w.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef float v16f_u __attribute__((vector_size(64), aligned(4), may_alias));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef float v2f __attribute__((vector_size(8)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint16_t v16h_u __attribute__((vector_size(32), aligned(2), may_alias));

#if defined(__AVX512F__)
// 24 accumulators + 4 w + 1 x of 32 vector registers. More rows than columns: x rows stay
// in L1 while W comes from the L2 panel (6x4: 91-97 GF/s on one Zen 4 core, 4x4: 47-65).
constexpr int MR = 6, NR = 4;
constexpr int kDirectRows = 8;  // up to 8 rows of x: R x direct_cols(R) tiles from BF16 W
constexpr int direct_cols(int r) { return r <= 2 ? 8 : r <= 4 ? 4 : 3; }   // <= 28 regs
#else
constexpr int MR = 2, NR = 2;   // AVX2: a 16-float vector is two of the 16 registers
constexpr int kDirectRows = 2;
constexpr int direct_cols(int) { return 2; }
#endif

inline float bf16_to_f32(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline v16f load16(const float *p) { return *reinterpret_cast<const v16f_u *>(p); }

inline v16f widen16(const uint16_t *p) {
    v16h h = *reinterpret_cast<const v16h_u *>(p);
    return reinterpret_cast<v16f>(__builtin_convertvector(h, v16u) << 16);
}

// The formula's lane tree, then + 0 and the canonical NaN.
inline float reduce16(v16f a) {
    v8f b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    v2f d = __builtin_shufflevector(c, c, 0, 1) + __builtin_shufflevector(c, c, 2, 3);
    float y = (d[0] + d[1]) + 0.0f;
    if (y != y) {
        const uint32_t nan = 0x7FC00000u;
        std::memcpy(&y, &nan, 4);
    }
    return y;
}

// reduce16 of a[0..15] at once, into y[0..15]: each level adds the same operands as
// reduce16 (lanes l and l + 8, then l and l + 4, ...), several elements per vector:
// level 1 holds 2 elements x 8 lanes per vector, level 2 4 x 4, level 3 8 x 2, level 4
// 16 x 1 in element order.
inline void reduce16x16(const v16f *a, float *y) {
    v16f v[8], u[4], t[2];
    for (int i = 0; i < 8; i++)
        v[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        u[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(v[2 * j], v[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    for (int q = 0; q < 2; q++)
        t[q] = __builtin_shufflevector(u[2 * q], u[2 * q + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(u[2 * q], u[2 * q + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                       19, 22, 23, 26, 27, 30, 31);
    v16f r = __builtin_shufflevector(t[0], t[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                     24, 26, 28, 30) +
             __builtin_shufflevector(t[0], t[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                     27, 29, 31);
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

// W rows as BF16 bits (widened in registers; the last partial 16 from a zero-padded copy)
// or as a float32 panel already zero-padded to k16.
struct WBits {
    const uint16_t *p;
    int64_t k, k_full;   // k_full: k rounded down to a multiple of 16
    v16f load(int64_t row, int64_t t) const {
        const uint16_t *r = p + row * k;
        if (t < k_full) return widen16(r + t);
        alignas(64) uint16_t tail[16] = {};
        std::memcpy(tail, r + t, size_t(k - t) * 2);
        return widen16(tail);
    }
    WBits rows(int64_t r0) const { return {p + r0 * k, k, k_full}; }
    // Prefetches never fault, so rows past W's end are harmless; the address is formed
    // as an integer (no out-of-range pointer). Decode streams W from DRAM: with it, 8 rows
    // over the 151936 x 896 LM head take 17 ms instead of 24.
    void prefetch(int64_t row, int64_t t) const {
        __builtin_prefetch(reinterpret_cast<const void *>(
            reinterpret_cast<uintptr_t>(p) + uintptr_t((row * k + t) * 2)));
    }
};
struct WPanel {
    const float *p;
    int64_t k16;
    v16f load(int64_t row, int64_t t) const { return load16(p + row * k16 + t); }
    WPanel rows(int64_t r0) const { return {p + r0 * k16, k16}; }
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

// y[i0 + a, j + b] for a < R, b < C: x rows (float32, stride k16, zero-padded).
template <int R, int C, class W>
inline void tile(const float *x, int64_t k16, const W &w, const Out &out, int64_t i0,
                 int64_t j) {
    v16f acc[R * C];
    for (int e = 0; e < R * C; e++) acc[e] = v16f{};
    for (int64_t t = 0; t < k16; t += 16) {
        v16f wv[C];
        for (int b = 0; b < C; b++) {
            w.prefetch(b + 2 * C, t);   // the tile after next: DRAM latency is long
            wv[b] = w.load(b, t);
        }
        for (int a = 0; a < R; a++) {
            v16f xv = load16(x + a * k16 + t);
            pin(xv);
            for (int b = 0; b < C; b++) acc[a * C + b] += xv * wv[b];   // FMA
        }
    }
    float y[R * C];
    int e = 0;
    for (; e + 16 <= R * C; e += 16) reduce16x16(acc + e, y + e);
    for (; e < R * C; e++) y[e] = reduce16(acc[e]);
    for (int a = 0; a < R; a++)
        for (int b = 0; b < C; b++) out.put(i0 + a, j + b, y[a * C + b]);
}

// Rows [i0, i0 + R) over columns [j0, j1) in R x C tiles (w holds W's rows from j0).
template <int R, int C, class W>
void row_group(const float *x, int64_t k16, const W &w, const Out &out, int64_t i0,
               int64_t j0, int64_t j1) {
    int64_t j = j0;
    for (; j + C <= j1; j += C) tile<R, C>(x, k16, w.rows(j - j0), out, i0, j);
    for (; j < j1; j++) tile<R, 1>(x, k16, w.rows(j - j0), out, i0, j);
}

// Every row of a small x (m <= kDirectRows) in one R x direct_cols(R) tile pass over W,
// so each W element is read and widened once.
template <int R>
bool direct(const float *x, int64_t m, int64_t k16, const WBits &w, const Out &out,
            int64_t j0, int64_t j1) {
    if constexpr (R > 1)
        if (m < R) return direct<R - 1>(x, m, k16, w, out, j0, j1);
    if (m != R) return false;
    row_group<R, direct_cols(R)>(x, k16, w, out, 0, j0, j1);
    return true;
}

// The last m % MR rows (R of them) as one R x NR row group.
template <int R, class W>
void rest_rows(const float *x, int64_t r, int64_t k16, const W &w, const Out &out, int64_t i0,
               int64_t j0, int64_t j1) {
    if constexpr (R > 1)
        if (r < R) return rest_rows<R - 1>(x, r, k16, w, out, i0, j0, j1);
    if (r == R) row_group<R, NR>(x + i0 * k16, k16, w, out, i0, j0, j1);
}

template <class W>
void all_rows(const float *x, int64_t m, int64_t k16, const W &w, const Out &out, int64_t j0,
              int64_t j1) {
    int64_t i = 0;
    for (; i + MR <= m; i += MR) row_group<MR, NR>(x + i * k16, k16, w, out, i, j0, j1);
    if constexpr (MR > 1) rest_rows<MR - 1>(x, m - i, k16, w, out, i, j0, j1);
}

struct Job {
    const float *x;      // [m, k16] float32, zero-padded
    const uint16_t *w;   // [n, k] BF16 bits
    Out out;
    int64_t m, n, k, k16;
};

// Columns [j_lo, j_hi): W in blocks of about 192 KiB of float32 (a multiple of NR rows).
void columns(const Job &job, int64_t j_lo, int64_t j_hi) {
    const WBits wb{job.w, job.k, job.k / 16 * 16};
    if (job.m <= kDirectRows) {
        direct<kDirectRows>(job.x, job.m, job.k16, wb.rows(j_lo), job.out, j_lo, j_hi);
        return;
    }
    const int64_t jb = std::max<int64_t>(NR, (int64_t(192) << 10) / (job.k16 * 4) / NR * NR);
    std::vector<float> panel(size_t(jb * job.k16));
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += jb) {
        const int64_t j1 = std::min(j_hi, j0 + jb);
        for (int64_t r = 0; r < j1 - j0; r++)
            for (int64_t t = 0; t < job.k16; t += 16)
                *reinterpret_cast<v16f_u *>(panel.data() + r * job.k16 + t) =
                    wb.load(j0 + r, t);
        all_rows(job.x, job.m, job.k16, WPanel{panel.data(), job.k16}, job.out, j0, j1);
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

void gemm(const uint16_t *x, const uint16_t *w, int64_t m, int64_t n, int64_t k, Out out) {
    const int64_t k16 = (k + 15) / 16 * 16;
    std::vector<float> xf(size_t(m * k16), 0.0f);
    for (int64_t i = 0; i < m; i++)
        for (int64_t t = 0; t < k; t++) xf[i * k16 + t] = bf16_to_f32(x[i * k + t]);
    // Threads only when each gets at least ~256K multiply-adds; ranges in multiples of NR.
    int nt = int(std::min<int64_t>(g_threads.load(), (m * n * k16) >> 18));
    nt = int(std::min<int64_t>(std::max(nt, 1), (n + NR - 1) / NR));
    const int64_t per = ((n + nt - 1) / nt + NR - 1) / NR * NR;
    // Row blocks of about 2 MiB of x (at least 16 MR-row groups): every W panel block is
    // widened once per row block, and the x rows that pass over it come from L2/L3, not
    // DRAM (1024 rows at k = 4864: 115 -> 180 GF/s). Rows never interact: same bits.
    const int64_t x_block_rows = (int64_t(2) << 20) / (k16 * 4) / MR * MR;
    const int64_t rows = m <= kDirectRows ? m : std::max<int64_t>(16 * MR, x_block_rows);
    for (int64_t i0 = 0; i0 < m; i0 += rows) {
        const Out part{out.f32 ? out.f32 + i0 * n : nullptr,
                       out.bf16 ? out.bf16 + i0 * n : nullptr, n};
        const Job job{xf.data() + i0 * k16, w, part, std::min(rows, m - i0), n, k, k16};
        std::function<void(int)> run = [&](int t) {
            const int64_t lo = std::min(n, t * per), hi = std::min(n, lo + per);
            if (lo < hi) columns(job, lo, hi);
        };
        pool().run(nt, run);
    }
}

}  // namespace

extern "C" {

// Threads later calls may use (the caller passes the CPUs it may run on).
__attribute__((visibility("default"))) void md_set_threads(int n) {
    g_threads.store(std::max(1, n));
}

// y [m, n] float32 (see the file header).
__attribute__((visibility("default"))) void md_gemm_f32(const uint16_t *x, const uint16_t *w,
                                                        int64_t m, int64_t n, int64_t k,
                                                        float *y) {
    gemm(x, w, m, n, k, Out{y, nullptr, n});
}

// y [m, n] BF16 bits: the float32 result rounded to nearest even, NaN -> 0x7FFF.
__attribute__((visibility("default"))) void md_gemm_bf16(const uint16_t *x, const uint16_t *w,
                                                         int64_t m, int64_t n, int64_t k,
                                                         uint16_t *y) {
    gemm(x, w, m, n, k, Out{nullptr, y, n});
}

}  // extern "C"
