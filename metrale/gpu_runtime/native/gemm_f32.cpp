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
// With AVX2 but no AVX-512 (16 registers of 8 lanes) FmaStep runs gemm_avx2.h's tiles
// instead: lanes 0-7 then 8-15 in two passes with one register per accumulator, the same
// FMAs in the same order per lane (64-byte generic vectors spill there: ~1 GMAC/s).
// Threads split the n columns into contiguous ranges (pool.h). Built without -ffast-math.
// Restrictions: m, n, k >= 1; y must not overlap x or w.
#include "gemm_core.h"

namespace md {
namespace {

void gemm_bits(const uint16_t *x, const uint16_t *w, int64_t m, int64_t n, int64_t k, Out out) {
    gemm_any(x, m, n, k, out, [&](auto step) {
        return WBits<decltype(step)>{w, k, k / 32 * 32};
    });
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
    md::gemm_bits(x, w, m, n, k, md::Out{y, nullptr, n});
}

// y [m, n] BF16 bits: the float32 result rounded to nearest even, NaN -> 0x7FFF.
__attribute__((visibility("default"))) void md_gemm_bf16(const uint16_t *x, const uint16_t *w,
                                                         int64_t m, int64_t n, int64_t k,
                                                         uint16_t *y) {
    md::gemm_bits(x, w, m, n, k, md::Out{nullptr, y, n});
}

}  // extern "C"
