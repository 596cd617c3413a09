// The small per-row twins of a decode step for HostBackend, built into the same library as
// gemm_f32.cpp by metrale/gpu_runtime/native.py: RMSNorm (metrale/ops/rmsnorm.py's twin),
// rotary embedding with the optional per-head q/k norm and the paged-cache write
// (ops/rope.py's rope_write_kv / apply_rope twins), and SiLU(gate) * up (ops/activation.py's
// act_mul twin for "silu"). In numpy each costs 100-200 us a call at a 135M model's size,
// almost all of it per-call overhead; here a few microseconds.
//
// Bits. Every step is the numpy twin's float32 operation in the twin's order, rounded as
// numpy rounds it (no FMA contraction: the pragma below), so RMSNorm and RoPE give the
// numpy twins' bits exactly: numpy's float32 sum (`np.sum(..., dtype=float32)` along a
// contiguous row) is its pairwise summation, reproduced by `np_sum` (8 accumulators over
// blocks of at most 128, halves split at a multiple of 8, added to the identity 0);
// native.py checks that on this machine's numpy at load and uses these routines only if it
// holds. SiLU needs exp: here exp_f32 (below: within 1 float32 ulp of the correctly rounded
// value, and vectorized), where numpy has its own SIMD exp (within 2); the BF16 result
// agrees but for values near a rounding boundary (the tests bound it by one BF16 ulp).
//
// Formulas (x, w, r BF16 widened exactly; every operation float32):
//   rmsnorm:  [residual: s = bf16(r + x), r = s, x = s]; inv = 1 / sqrt(sum(x*x) / h + eps);
//             mode 0 (llama): out = bf16(bf16(x * inv) * w); mode 1 (once):
//             out = bf16((x * inv) * w); mode 2 (offset): out = bf16((x * inv) * (w + offset))
//             (ops/rmsnorm.py's weight modes; ops/gated_norm.py's rmsnorm_offset)
//   rope:     per token t, head j of the q and k heads: [norm: x = bf16((x * inv) * w_qk)];
//             c, s = table[pos[t], :D/2], table[pos[t], D/2:];
//             out1 = bf16(x1*c - x2*s), out2 = bf16(x2*c + x1*s)   (in place in qkv)
//   write_kv: k_cache[slot[t]] = qkv[t, k heads], v_cache[slot[t]] = qkv[t, v heads] for
//             slot >= 0, token order (a repeated slot keeps the last token's row)
//   act_mul:  out = bf16((g / (exp_f32(-g) + 1)) * u)   with g, u = gate_up[:, :I], gate_up[:, I:]
//   add:      residual = bf16(residual + y)   (rmsnorm's residual add alone: the fused decode
//             GEMMs' epilogue, ops/gemm_fused.py)
// Shapes: x, out, residual [rows, hidden]; qkv [n_tokens, heads + 2*kv_heads, head_dim];
// caches [slots, kv_heads * head_dim]; gate_up [rows, 2*I], out [rows, I]. Restrictions:
// the Python side checks pointers, positions and slots first (these routines trust them);
// out may equal x (each row is read whole before it is written), other overlaps go to numpy.
#pragma GCC optimize("fp-contract=off")

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"

namespace {

inline float bf(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t to_bf(float f) {   // (a select, not a branch: loops of it vectorize)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t rounded = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FFF) : rounded;
}

inline float round_bf(float f) { return bf(to_bf(f)); }

inline float from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// e^x in float32 in straight-line code, so a loop of it vectorizes (the C library's expf is
// a call per element: most of silu_mul's time). Cephes' expf: n = x / ln 2 rounded to
// nearest (by adding 1.5 * 2^23, whose bits then hold n), r = x - n ln 2 (ln 2 in two
// parts), a degree-6 polynomial, times 2^n as two normal factors. Within 1 ulp of the
// correctly rounded e^x over the float32 range (measured on 3M points; numpy's SIMD exp:
// 2); x > 88.73 gives +inf, x < -103.98 gives 0, subnormal results within 1 subnormal ulp,
// NaN gives NaN.
inline float exp_f32(float x) {
    const float xc = x < -104.f ? -104.f : (x > 89.f ? 89.f : x);   // (NaN passes)
    const float big = xc * 1.44269504088896341f + 12582912.f;      // n + 1.5 * 2^23
    const float n = big - 12582912.f;
    const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * (r * r) + r + 1.0f;
    uint32_t big_bits;
    std::memcpy(&big_bits, &big, 4);
    const int32_t ni = int32_t(big_bits) - 0x4B400000;   // n, in [-150, 128]
    const int32_t n1 = ni / 2, n2 = ni - n1;              // each in [-75, 64]
    return e * from_bits(uint32_t(n1 + 127) << 23) * from_bits(uint32_t(n2 + 127) << 23);
}

// numpy's pairwise float32 sum of term(i), i in [lo, lo + n)
template <class Term>
float pairwise(const Term &term, int64_t lo, int64_t n) {
    if (n < 8) {
        float r = 0.f;
        for (int64_t i = 0; i < n; i++) r += term(lo + i);
        return r;
    }
    if (n <= 128) {
        float r[8];
        for (int j = 0; j < 8; j++) r[j] = term(lo + j);
        int64_t i = 8;
        for (; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += term(lo + i + j);
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += term(lo + i);
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise(term, lo, n2) + pairwise(term, lo + n2, n - n2);
}

// sum(x*x) of a float32 row as np.sum(x * x, axis=-1, dtype=float32) gives it
inline float np_sum_squares(const float *x, int64_t n) {
    return 0.f + pairwise([x](int64_t i) { return x[i] * x[i]; }, 0, n);
}

// rows [lo, hi) on one thread; buf: hidden floats
void rmsnorm_rows(uint16_t *out, const uint16_t *x, const uint16_t *w, uint16_t *residual,
                  int64_t lo, int64_t hi, int64_t hidden, float eps, int mode, float offset,
                  float *buf) {
    for (int64_t r = lo; r < hi; r++) {
        const uint16_t *xr = x + r * hidden;
        if (residual != nullptr) {
            uint16_t *rr = residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) buf[i] = bf(xr[i]);   // x read whole first
            for (int64_t i = 0; i < hidden; i++) {
                const uint16_t s = to_bf(bf(rr[i]) + buf[i]);
                rr[i] = s;
                buf[i] = bf(s);
            }
        } else {
            for (int64_t i = 0; i < hidden; i++) buf[i] = bf(xr[i]);
        }
        const float ss = np_sum_squares(buf, hidden);
        const float inv = 1.0f / std::sqrt(ss / float(hidden) + eps);
        uint16_t *o = out + r * hidden;
        if (mode == 0) {
            for (int64_t i = 0; i < hidden; i++) o[i] = to_bf(round_bf(buf[i] * inv) * bf(w[i]));
        } else if (mode == 1) {
            for (int64_t i = 0; i < hidden; i++) o[i] = to_bf((buf[i] * inv) * bf(w[i]));
        } else {
            for (int64_t i = 0; i < hidden; i++)
                o[i] = to_bf((buf[i] * inv) * (bf(w[i]) + offset));
        }
    }
}

// enough work per thread to be worth a wake-up
constexpr int64_t kRowsWork = 1 << 16;

template <class RowFn>
void over_rows(int64_t rows, int64_t per_row, const RowFn &fn) {
    const int nt = int(std::min<int64_t>(md::g_threads.load(),
                                         std::max<int64_t>(1, rows * per_row / kRowsWork)));
    if (nt <= 1) {
        fn(0, rows);
        return;
    }
    md::pool().run(nt, [&](int id) {
        fn(rows * id / nt, rows * (id + 1) / nt);
    });
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void md_rmsnorm(uint16_t *out, const uint16_t *x,
                                                       const uint16_t *weight,
                                                       uint16_t *residual, int64_t n_rows,
                                                       int64_t hidden, float eps, int32_t mode,
                                                       float offset) {
    over_rows(n_rows, hidden, [&](int64_t lo, int64_t hi) {
        std::vector<float> buf(static_cast<size_t>(hidden));
        rmsnorm_rows(out, x, weight, residual, lo, hi, hidden, eps, mode, offset, buf.data());
    });
}

// qkv [n_tokens, heads + 2 * kv_heads, head_dim] BF16 in place; positions int32 [n_tokens]
// (each in [0, max_positions)); table float32 [max_positions, head_dim]; q_norm / k_norm
// BF16 [head_dim] or null; k_cache / v_cache null (no cache write) or BF16 [slots, kv_heads *
// head_dim] with slot_mapping int32 [n_tokens].
__attribute__((visibility("default"))) void md_rope_write_kv(
    uint16_t *qkv, const int32_t *positions, const float *table, const uint16_t *q_norm,
    const uint16_t *k_norm, uint16_t *k_cache, uint16_t *v_cache,
    const int32_t *slot_mapping, int64_t n_tokens, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, float norm_eps) {
    const int64_t d = head_dim, half = d / 2, heads = num_heads + 2 * num_kv_heads;
    over_rows(n_tokens, (num_heads + num_kv_heads) * d, [&](int64_t lo, int64_t hi) {
        std::vector<float> x(static_cast<size_t>(d));
        for (int64_t t = lo; t < hi; t++) {
            const float *cs = table + int64_t(positions[t]) * d;
            for (int64_t j = 0; j < num_heads + num_kv_heads; j++) {
                uint16_t *p = qkv + (t * heads + j) * d;
                for (int64_t i = 0; i < d; i++) x[i] = bf(p[i]);
                const uint16_t *w = j < num_heads ? q_norm : k_norm;
                if (w != nullptr) {
                    const float ss = np_sum_squares(x.data(), d);
                    const float r = 1.0f / std::sqrt(ss / float(d) + norm_eps);
                    for (int64_t i = 0; i < d; i++) x[i] = round_bf((x[i] * r) * bf(w[i]));
                }
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = x[i], x2 = x[half + i], c = cs[i], s = cs[half + i];
                    const float a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s;
                    p[i] = to_bf(a - b);
                    p[half + i] = to_bf(e + f);
                }
            }
        }
    });
    if (k_cache == nullptr) return;
    const int64_t row = num_kv_heads * d;
    for (int64_t t = 0; t < n_tokens; t++) {   // token order: a repeated slot keeps the last
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const uint16_t *k = qkv + (t * heads + num_heads) * d;
        std::memcpy(k_cache + slot * row, k, size_t(row) * 2);
        std::memcpy(v_cache + slot * row, k + row, size_t(row) * 2);
    }
}

// o[i] = bf16(silu(g[i]) * u[i]), i < n (a loop that vectorizes: no aliasing, no calls)
static void silu_mul_row(uint16_t *__restrict o, const uint16_t *__restrict g,
                         const uint16_t *__restrict u, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float gv = bf(g[i]);
        const float e = exp_f32(-gv) + 1.0f;
        o[i] = to_bf((gv / e) * bf(u[i]));
    }
}

// out [n_rows, intermediate] = bf16(silu(gate) * up), gate_up [n_rows, 2 * intermediate]
__attribute__((visibility("default"))) void md_silu_mul(uint16_t *out, const uint16_t *gate_up,
                                                        int64_t n_rows, int64_t intermediate) {
    const int64_t I = intermediate;
    over_rows(n_rows, I * 4, [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; r++) {
            const uint16_t *g = gate_up + r * 2 * I;
            silu_mul_row(out + r * I, g, g + I, I);
        }
    });
}

// residual[i] = bf16(residual[i] + y[i]), i < count (no overlap)
__attribute__((visibility("default"))) void md_add_bf16(uint16_t *residual, const uint16_t *y,
                                                        int64_t count) {
    for (int64_t i = 0; i < count; i++) residual[i] = to_bf(bf(residual[i]) + bf(y[i]));
}

}  // extern "C"

extern "C" {

// sums[r] = np_sum_squares(x[r]) for x float32 [n_rows, n]: native.py compares it with
// numpy's own sum at load, the condition for using the routines above
__attribute__((visibility("default"))) void md_sum_squares(const float *x, int64_t n_rows,
                                                           int64_t n, float *sums) {
    for (int64_t r = 0; r < n_rows; r++) sums[r] = np_sum_squares(x + r * n, n);
}

}  // extern "C"
