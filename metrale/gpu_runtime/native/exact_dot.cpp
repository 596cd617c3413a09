// Exact BF16 dot products on the CPU: the fast path of HostBackend's tensor-core GEMM twin
// (metrale/ops/gemm_tc.py, `pairwise_dot_f32`), built and loaded by metrale/gpu_runtime/native.py.
//
// Formula: y[i, j] = f32(s[i, j]), s[i, j] = sum_t x[i, t] * w[j, t], for x [m, k] and
// w [n, k] BF16 bits (uint16, rows contiguous, any 2-byte alignment), y [m, n] float32.
// Every product of two BF16 values is exact in double. s is accumulated in double with
// FMAs, in an order that is NOT specified (16-element blocks split into even / odd lanes,
// then a horizontal sum, then the k % 16 tail): the result never depends on it because
// * where x_mag[i] * w_mag[j] <= 2^52 (the per-row grid magnitudes of gemm_tc.py) every
//   partial sum in any order is exact, so s is the exact sum;
// * elsewhere |s - exact| <= (k - 1) 2^-53 |x_i| |w_j| for any order, and f32(s) is kept
//   only when s - e and s + e round to the same float with
//   e = (k + 4) 2^-51 x_norm[i] w_norm[j] + |s| 2^-51; the remaining elements get
//   unsure[i, j] = 1 and the caller replaces them (numpy's fixed-order pairwise sum).
// Non-finite s (an Inf or NaN product) gives f32(s), never flagged. An exact zero is +0
// (accumulators start at +0.0; no -ffast-math anywhere).
//
// Threads: the n columns are split into contiguous ranges, one per pool thread; each
// element is computed by one thread from its two rows only, so the split never changes a
// bit. Restrictions: m, n, k >= 1; y and unsure must not overlap x or w.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

typedef double v8d __attribute__((vector_size(64)));
typedef double v8d_u __attribute__((vector_size(64), aligned(8), may_alias));
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint32_t v8u_u __attribute__((vector_size(32), aligned(2), may_alias));

#if defined(__AVX512F__)
constexpr int kWideRegs = 1;  // 32 vector registers of 8 doubles: bigger register tiles
#else
constexpr int kWideRegs = 0;
#endif

// 16 BF16 values at p -> doubles: even lanes (elements 0, 2, .., 14) and odd lanes.
// Reading the pairs as uint32 avoids a shuffle: bits << 16 is the even element's float,
// bits & 0xFFFF0000 the odd one's.
inline void bf16x16_to_f64(const uint16_t *p, v8d &even, v8d &odd) {
    v8u u = *reinterpret_cast<const v8u_u *>(p);
    v8f fe = reinterpret_cast<v8f>(u << 16);
    v8f fo = reinterpret_cast<v8f>(u & 0xFFFF0000u);
    even = __builtin_convertvector(fe, v8d);
    odd = __builtin_convertvector(fo, v8d);
}

inline double bf16_to_f64(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline v8d load8(const double *p) { return *reinterpret_cast<const v8d_u *>(p); }

inline double hsum(v8d a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// x prepared once per call: per row, the k16 = k / 16 * 16 leading elements as doubles in
// the even/odd order of bf16x16_to_f64, then the k % 16 tail in natural order.
struct Rows {
    const std::vector<double> *xd;
    int64_t k, k16, stride;  // stride = k (doubles per prepared row)
    const uint16_t *w;
    int64_t n;
};

template <int MR, int NR>
void tile(const Rows &r, const double *x0, int64_t j0, double *s) {
    v8d acc[MR][NR] = {};
    const int64_t k = r.k, ld = r.stride;
    for (int64_t t = 0; t < r.k16; t += 16) {
        v8d we[NR], wo[NR];
        for (int b = 0; b < NR; b++) bf16x16_to_f64(r.w + (j0 + b) * k + t, we[b], wo[b]);
        for (int a = 0; a < MR; a++) {
            v8d xe = load8(x0 + a * ld + t), xo = load8(x0 + a * ld + t + 8);
            for (int b = 0; b < NR; b++) {
                acc[a][b] += xe * we[b];
                acc[a][b] += xo * wo[b];
            }
        }
    }
    for (int a = 0; a < MR; a++)
        for (int b = 0; b < NR; b++) {
            double v = hsum(acc[a][b]);
            const uint16_t *wr = r.w + (j0 + b) * k;
            for (int64_t t = r.k16; t < k; t++) v += x0[a * ld + t] * bf16_to_f64(wr[t]);
            s[a * NR + b] = v;
        }
}

struct Out {
    float *y;
    uint8_t *unsure;
    const double *x_norm, *x_mag, *w_norm, *w_mag;
    int64_t n, k;
};

// f32 rounding and the exactness / error-bound test of one element; returns 1 if unsure.
inline int64_t store(const Out &o, int64_t i, int64_t j, double s) {
    s = s + 0.0;
    o.y[i * o.n + j] = static_cast<float>(s);
    if (!std::isfinite(s) || o.x_mag[i] * o.w_mag[j] <= 0x1p52) return 0;
    double e = double(o.k + 4) * 0x1p-51 * o.x_norm[i] * o.w_norm[j] + std::fabs(s) * 0x1p-51;
    if (static_cast<float>(s - e) == static_cast<float>(s + e)) return 0;
    o.unsure[i * o.n + j] = 1;
    return 1;
}

template <int MR, int NR>
int64_t row_group(const Rows &r, const Out &o, int64_t i0, int64_t j_lo, int64_t j_hi) {
    const double *x0 = r.xd->data() + i0 * r.stride;
    double s[MR * NR];
    int64_t flagged = 0, j = j_lo;
    for (; j + NR <= j_hi; j += NR) {
        tile<MR, NR>(r, x0, j, s);
        for (int a = 0; a < MR; a++)
            for (int b = 0; b < NR; b++) flagged += store(o, i0 + a, j + b, s[a * NR + b]);
    }
    for (; j < j_hi; j++) {
        tile<MR, 1>(r, x0, j, s);
        for (int a = 0; a < MR; a++) flagged += store(o, i0 + a, j, s[a]);
    }
    return flagged;
}

// Register tiles (MR rows of x by NR rows of w): MR * NR accumulators + 2 NR converted w
// vectors + 2 x vectors must fit the register file.
template <int MR>
int64_t rows_of(const Rows &r, const Out &o, int64_t i0, int64_t j_lo, int64_t j_hi) {
    constexpr int NR = kWideRegs ? (MR <= 2 ? 4 : (MR <= 4 ? 3 : 2)) : (MR <= 2 ? 2 : 1);
    return row_group<MR, NR>(r, o, i0, j_lo, j_hi);
}

constexpr int kMaxMR = kWideRegs ? 8 : 4;

int64_t columns(const Rows &r, const Out &o, int64_t m, int64_t j_lo, int64_t j_hi) {
    // W in blocks of about 512 KiB, so each block stays in L2 while every group of rows
    // passes over it (m > kMaxMR); a decode row count streams W once.
    const int64_t jb = std::max<int64_t>(16, (int64_t(1) << 19) / (2 * r.k));
    int64_t flagged = 0;
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += jb) {
        const int64_t j1 = std::min(j_hi, j0 + jb);
        int64_t i = 0;
        for (; i + kMaxMR <= m; i += kMaxMR) flagged += rows_of<kMaxMR>(r, o, i, j0, j1);
        switch (m - i) {
#if defined(__AVX512F__)
            case 7: flagged += rows_of<7>(r, o, i, j0, j1); break;
            case 6: flagged += rows_of<6>(r, o, i, j0, j1); break;
            case 5: flagged += rows_of<5>(r, o, i, j0, j1); break;
            case 4: flagged += rows_of<4>(r, o, i, j0, j1); break;
#endif
            case 3: flagged += rows_of<3>(r, o, i, j0, j1); break;
            case 2: flagged += rows_of<2>(r, o, i, j0, j1); break;
            case 1: flagged += rows_of<1>(r, o, i, j0, j1); break;
            default: break;
        }
    }
    return flagged;
}

// A fixed set of worker threads that sleep on a condition variable between calls (no
// spinning next to numpy's own BLAS threads). run(nt, f) calls f(0..nt-1), f(0) on the
// caller's thread, and returns when all are done.
class Pool {
  public:
    void run(int nt, const std::function<void(int)> &f) {
        if (nt <= 1) {
            f(0);
            return;
        }
        std::lock_guard<std::mutex> one_call(call_mu_);  // callers from several threads
        {
            std::unique_lock<std::mutex> lk(mu_);
            while (int(workers_.size()) < nt - 1) {
                int id = int(workers_.size()) + 1;
                workers_.emplace_back([this, id] { loop(id); });
                workers_.back().detach();
            }
            job_ = &f;
            active_ = nt;
            pending_ = nt - 1;
            generation_++;
        }
        wake_.notify_all();
        f(0);
        std::unique_lock<std::mutex> lk(mu_);
        done_.wait(lk, [this] { return pending_ == 0; });
        job_ = nullptr;
    }

  private:
    void loop(int id) {
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(int)> *job;
            {
                std::unique_lock<std::mutex> lk(mu_);
                wake_.wait(lk, [&] { return generation_ != seen; });
                seen = generation_;
                if (id >= active_) continue;
                job = job_;
            }
            (*job)(id);
            std::lock_guard<std::mutex> lk(mu_);
            if (--pending_ == 0) done_.notify_one();
        }
    }
    std::mutex call_mu_, mu_;
    std::condition_variable wake_, done_;
    std::vector<std::thread> workers_;
    const std::function<void(int)> *job_ = nullptr;
    uint64_t generation_ = 0;
    int active_ = 0, pending_ = 0;
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

// y = f32 of the exact row dot products; see the file header. unsure [m, n] must be zeroed
// by the caller. Returns how many elements were flagged unsure.
__attribute__((visibility("default"))) int64_t md_exact_dot(
    const uint16_t *x, const uint16_t *w, int64_t m, int64_t n, int64_t k,
    const double *x_norm, const double *x_mag, const double *w_norm, const double *w_mag,
    float *y, uint8_t *unsure) {
    const int64_t k16 = k / 16 * 16;
    std::vector<double> xd(size_t(m * k));
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *src = x + i * k;
        double *dst = xd.data() + i * k;
        for (int64_t t = 0; t < k16; t += 16)
            for (int q = 0; q < 8; q++) {
                dst[t + q] = bf16_to_f64(src[t + 2 * q]);
                dst[t + 8 + q] = bf16_to_f64(src[t + 2 * q + 1]);
            }
        for (int64_t t = k16; t < k; t++) dst[t] = bf16_to_f64(src[t]);
    }
    const Rows r{&xd, k, k16, k, w, n};
    const Out o{y, unsure, x_norm, x_mag, w_norm, w_mag, n, k};
    // Threads only when each gets at least ~256K multiply-adds; ranges in multiples of 16.
    int nt = int(std::min<int64_t>(g_threads.load(), (m * n * k) >> 18));
    nt = int(std::min<int64_t>(std::max(nt, 1), (n + 15) / 16));
    const int64_t per = ((n + nt - 1) / nt + 15) / 16 * 16;
    std::vector<int64_t> flagged(size_t(std::max(nt, 1)), 0);
    std::function<void(int)> job = [&](int t) {
        const int64_t lo = t * per, hi = std::min(n, lo + per);
        if (lo < hi) flagged[t] = columns(r, o, m, lo, hi);
    };
    pool().run(nt, job);
    int64_t total = 0;
    for (int64_t f : flagged) total += f;
    return total;
}

// dst[i] = double(BF16 src[i]) for count elements (cache fills and slice conversions).
__attribute__((visibility("default"))) void md_bf16_to_f64(const uint16_t *src, int64_t count,
                                                           double *dst) {
    int nt = int(std::min<int64_t>(g_threads.load(), std::max<int64_t>(count >> 20, 1)));
    const int64_t per = ((count + nt - 1) / nt + 15) / 16 * 16;
    std::function<void(int)> job = [&](int t) {
        const int64_t lo = std::min(count, t * per), hi = std::min(count, lo + per);
        int64_t i = lo;
        for (; i + 16 <= hi; i += 16) {
            v8d e, o;
            bf16x16_to_f64(src + i, e, o);
            for (int q = 0; q < 8; q++) {
                dst[i + 2 * q] = e[q];
                dst[i + 2 * q + 1] = o[q];
            }
        }
        for (; i < hi; i++) dst[i] = bf16_to_f64(src[i]);
    };
    pool().run(nt, job);
}

// Per row of BF16 bits [rows, k]: norm = sqrt(sum of squares) and the grid magnitude of
// gemm_tc.py's `_grid_magnitude`, mag = norm * 2^(134 - max(E, 1)) with E the smallest
// exponent field of the row's nonzero elements (255 when there are none, giving 0).
__attribute__((visibility("default"))) void md_row_stats(const uint16_t *bits, int64_t rows,
                                                         int64_t k, double *norm, double *mag) {
    int nt = int(std::min<int64_t>(g_threads.load(), std::max<int64_t>((rows * k) >> 20, 1)));
    const int64_t per = (rows + nt - 1) / nt;
    std::function<void(int)> job = [&](int t) {
        const int64_t lo = std::min(rows, t * per), hi = std::min(rows, lo + per);
        for (int64_t r = lo; r < hi; r++) {
            const uint16_t *p = bits + r * k;
            const int64_t k16 = k / 16 * 16;
            v8d sq = {};
            v8u lowest = {255, 255, 255, 255, 255, 255, 255, 255};
            for (int64_t t = 0; t < k16; t += 16) {
                v8d e, o;
                bf16x16_to_f64(p + t, e, o);
                sq += e * e;
                sq += o * o;
                v8u u = *reinterpret_cast<const v8u_u *>(p + t);
                v8u lo_e = (u >> 7) & 0xFFu, hi_e = (u >> 23) & 0xFFu;
                v8u lo_z = (u & 0x7FFFu) == 0, hi_z = (u & 0x7FFF0000u) == 0;  // all ones if zero
                lo_e = (lo_e & ~lo_z) | (255u & lo_z);
                hi_e = (hi_e & ~hi_z) | (255u & hi_z);
                lowest = lowest < lo_e ? lowest : lo_e;
                lowest = lowest < hi_e ? lowest : hi_e;
            }
            double s = hsum(sq);
            uint32_t e_min = 255;
            for (int q = 0; q < 8; q++) e_min = std::min(e_min, lowest[q]);
            for (int64_t t = k16; t < k; t++) {
                double v = bf16_to_f64(p[t]);
                s += v * v;
                if (p[t] & 0x7FFF) e_min = std::min<uint32_t>(e_min, (p[t] >> 7) & 0xFF);
            }
            norm[r] = std::sqrt(s);
            mag[r] = std::ldexp(norm[r], 134 - int(std::max<uint32_t>(e_min, 1)));
        }
    };
    pool().run(nt, job);
}

}  // extern "C"
