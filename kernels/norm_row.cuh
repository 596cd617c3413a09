// RMSNorm of one row by one warp, in the project's one fixed order, shared by the rmsnorm
// kernel (kernels/rmsnorm.cu) and the decode GEMM that normalizes its X tiles
// (kernels/gemm_tc.cu, gemm_tc_bf16_16x16_rmsnorm): both give a row the same bits.
//
//   ss  = sum_c x[c]^2: lane l of the warp takes the 8-element chunks j = l, l + 32, ...
//         (elements 8j .. 8j + 7 in ascending order, one fmaf each), then warp_sum
//         (xor 16, 8, 4, 2, 1). The order depends on hidden alone: the vector path (whole
//         chunks through 128-bit loads) and the element path give the same bits.
//   inv = rsqrtf(ss / hidden + eps)
//   out[c] = bf16( bf16(x[c] * inv) * w[c] )           (rms_scale below)
// With `res` (the pre-norm residual step): res[c] = bf16(res[c] + x[c]) is stored back and
// the stored value is what gets squared and normalized.
#pragma once
#include "common.cuh"

// Sum of squares of row x [hidden] (after the optional residual add), the same value in
// every lane of the calling warp. vec: hidden % 8 == 0 and x (and res) 16-byte aligned.
__device__ __forceinline__ float row_sum_squares_warp(const bf16 *x, bf16 *res, int hidden,
                                                      bool vec, int lane) {
    float ss = 0.f;
    const int chunks = (hidden + 7) >> 3;
    for (int j = lane; j < chunks; j += 32) {
        float a[8];
        if (vec) {
            unpack8(reinterpret_cast<const bf16x8 *>(x)[j], a);
            if (res) {
                float b[8];
                bf16x8 *rv = reinterpret_cast<bf16x8 *>(res) + j;
                unpack8(*rv, b);
#pragma unroll
                for (int e = 0; e < 8; ++e) b[e] += a[e];
                const bf16x8 s = pack8(b);
                *rv = s;
                unpack8(s, a);
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) ss = fmaf(a[e], a[e], ss);
        } else {
            const int c1 = min(8 * j + 8, hidden);
            for (int c = 8 * j; c < c1; ++c) {
                float v = bf2f(x[c]);
                if (res) {
                    const bf16 s = f2bf(bf2f(res[c]) + v);
                    res[c] = s;
                    v = bf2f(s);
                }
                ss = fmaf(v, v, ss);
            }
        }
    }
    return warp_sum(ss);
}

__device__ __forceinline__ float rms_inv(float ss, int hidden, float eps) {
    return rsqrtf(ss / (float)hidden + eps);
}

// bf16( bf16(a * inv) * w ) as a float (exactly a BF16 value).
__device__ __forceinline__ float rms_scale(float a, float inv, float w) {
    return bf2f(f2bf(bf2f(f2bf(a * inv)) * w));
}

// The weight modes of the rmsnorm kernel (ops/rmsnorm.py WEIGHT_MODES):
//   RMS_WEIGHT_LLAMA   bf16( bf16(a * inv) * w )   (rms_scale; HF Llama, Qwen, Mistral, Phi-3)
//   RMS_WEIGHT_ONCE    bf16( (a * inv) * w )       (one rounding; HF GptOssRMSNorm)
//   RMS_WEIGHT_GEMMA   bf16( (a * inv) * (1 + w) ) (one rounding; HF Gemma2/3RMSNorm)
#define RMS_WEIGHT_LLAMA 0
#define RMS_WEIGHT_ONCE 1
#define RMS_WEIGHT_GEMMA 2

// rms_scale under `mode` (uniform across the launch), as a float holding a BF16 value.
__device__ __forceinline__ float rms_weighted(float a, float inv, float w, int mode) {
    if (mode == RMS_WEIGHT_LLAMA) return rms_scale(a, inv, w);
    return bf2f(f2bf((a * inv) * (mode == RMS_WEIGHT_GEMMA ? 1.0f + w : w)));
}
