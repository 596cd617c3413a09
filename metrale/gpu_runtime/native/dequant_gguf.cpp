// GGUF block formats -> BF16 at load (metrale/formats/gguf_quants.py holds the layouts, the
// numpy path and the argument for exactness), built into HostBackend's native library by
// metrale/gpu_runtime/native.py.
//
// Formula: each element's float32 value y (the exact real value of the block formula,
// rounded once: every product of scale and quant is exact in float32, so FMA contraction
// cannot change it), then BF16 round-to-nearest-even with NaN -> 0x7FFF (ops/bf16.py).
// The same bits as gguf_quants.dequantize_bf16's numpy path (tests compare every type).
// Entry: md_gguf_dequant_bf16(ggml_type, src, dst, n, threads): n elements (a whole
// number of blocks) from the stored bytes src into dst, split into contiguous block ranges
// over `threads` threads from 1M elements up (each element is written by one thread, so
// the bits do not depend on the split); returns 0, or -1 for a type not handled here.
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

inline float f16(const uint8_t *p) {
    const uint16_t h = uint16_t(p[0] | (p[1] << 8));
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {
        float f = float(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
        std::memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t bf16(float y) {
    uint32_t u;
    std::memcpy(&u, &y, 4);
    const uint16_t r = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FFF) : r;
}

inline uint32_t u32(const uint8_t *p) {
    return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1: 32 elements; `hasmin`: a min m after d; `high`: a u32 of
// fifth bits; offset: subtracted from q (8, 16 or 0).
template <bool hasmin, bool high>
void dequant32(const uint8_t *src, uint16_t *dst, int64_t nblocks, int size, float offset) {
    for (int64_t b = 0; b < nblocks; b++, src += size, dst += 32) {
        const float d = f16(src), m = hasmin ? f16(src + 2) : 0.0f;
        const uint8_t *p = src + (hasmin ? 4 : 2);
        const uint32_t qh = high ? u32(p) : 0;
        const uint8_t *qs = p + (high ? 4 : 0);
        for (int j = 0; j < 16; j++) {
            float lo = float((qs[j] & 15) | (high ? ((qh >> j) & 1) << 4 : 0));
            float hi = float((qs[j] >> 4) | (high ? ((qh >> (j + 16)) & 1) << 4 : 0));
            dst[j] = bf16(hasmin ? d * lo + m : d * (lo - offset));
            dst[j + 16] = bf16(hasmin ? d * hi + m : d * (hi - offset));
        }
    }
}

void q8_0(const uint8_t *src, uint16_t *dst, int64_t nblocks) {
    for (int64_t b = 0; b < nblocks; b++, src += 34, dst += 32) {
        const float d = f16(src);
        for (int j = 0; j < 32; j++) dst[j] = bf16(d * float(int8_t(src[2 + j])));
    }
}

inline void scale_min_k4(int j, const uint8_t *s, int &sc, int &mn) {
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Q4_K (high = false) and Q5_K (high = true): 256 elements in 8 sub-blocks of 32.
template <bool high>
void qk_45(const uint8_t *src, uint16_t *dst, int64_t nblocks) {
    const int size = high ? 176 : 144;
    for (int64_t b = 0; b < nblocks; b++, src += size, dst += 256) {
        const float d = f16(src), dmin = f16(src + 2);
        const uint8_t *scales = src + 4, *qh = src + 16, *qs = src + (high ? 48 : 16);
        for (int c = 0; c < 4; c++) {
            for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                int sc, mn;
                scale_min_k4(j, scales, sc, mn);
                const float d1 = d * float(sc), m1 = dmin * float(mn);
                uint16_t *y = dst + 32 * j;
                for (int l = 0; l < 32; l++) {
                    int q = h ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 15;
                    if (high) q |= ((qh[l] >> j) & 1) << 4;
                    y[l] = bf16(d1 * float(q) - m1);
                }
            }
        }
    }
}

void q6_k(const uint8_t *src, uint16_t *dst, int64_t nblocks) {
    for (int64_t b = 0; b < nblocks; b++, src += 210, dst += 256) {
        const float d = f16(src + 208);
        const int8_t *sc = reinterpret_cast<const int8_t *>(src + 192);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = src + 64 * half, *qh = src + 128 + 32 * half;
            uint16_t *y = dst + 128 * half;
            const int8_t *s = sc + 8 * half;
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = bf16(d * float(s[is]) * float(q1));
                y[l + 32] = bf16(d * float(s[is + 2]) * float(q2));
                y[l + 64] = bf16(d * float(s[is + 4]) * float(q3));
                y[l + 96] = bf16(d * float(s[is + 6]) * float(q4));
            }
        }
    }
}

// One type's loop over `nblocks` blocks; false for a type not handled here.
bool dequant(int ggml_type, const uint8_t *src, uint16_t *dst, int64_t nblocks) {
    switch (ggml_type) {
        case 0:  // F32 (a "block" is one element)
            for (int64_t i = 0; i < nblocks; i++) {
                float f;
                std::memcpy(&f, src + 4 * i, 4);
                dst[i] = bf16(f);
            }
            return true;
        case 1:  // F16
            for (int64_t i = 0; i < nblocks; i++) dst[i] = bf16(f16(src + 2 * i));
            return true;
        case 2: dequant32<false, false>(src, dst, nblocks, 18, 8.0f); return true;   // Q4_0
        case 3: dequant32<true, false>(src, dst, nblocks, 20, 0.0f); return true;    // Q4_1
        case 6: dequant32<false, true>(src, dst, nblocks, 22, 16.0f); return true;   // Q5_0
        case 7: dequant32<true, true>(src, dst, nblocks, 24, 0.0f); return true;     // Q5_1
        case 8: q8_0(src, dst, nblocks); return true;
        case 12: qk_45<false>(src, dst, nblocks); return true;                       // Q4_K
        case 13: qk_45<true>(src, dst, nblocks); return true;                        // Q5_K
        case 14: q6_k(src, dst, nblocks); return true;
        default: return false;
    }
}

// (elements, bytes) per block
bool block_of(int ggml_type, int64_t &qk, int64_t &size) {
    switch (ggml_type) {
        case 0: qk = 1; size = 4; return true;
        case 1: qk = 1; size = 2; return true;
        case 2: qk = 32; size = 18; return true;
        case 3: qk = 32; size = 20; return true;
        case 6: qk = 32; size = 22; return true;
        case 7: qk = 32; size = 24; return true;
        case 8: qk = 32; size = 34; return true;
        case 12: qk = 256; size = 144; return true;
        case 13: qk = 256; size = 176; return true;
        case 14: qk = 256; size = 210; return true;
        default: return false;
    }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int md_gguf_dequant_bf16(int ggml_type,
                                                                const uint8_t *src,
                                                                uint16_t *dst, int64_t n,
                                                                int threads) {
    int64_t qk, size;
    if (!block_of(ggml_type, qk, size)) return -1;
    const int64_t nblocks = n / qk;
    const int64_t nt = n < (int64_t(1) << 20) || threads < 2 ? 1 : threads;
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < nt; t++) {
        const int64_t lo = nblocks * t / nt, hi = nblocks * (t + 1) / nt;
        pool.emplace_back([=] { dequant(ggml_type, src + lo * size, dst + lo * qk, hi - lo); });
    }
    dequant(ggml_type, src, dst, nblocks / nt);
    for (auto &th : pool) th.join();
    return 0;
}

}  // extern "C"
