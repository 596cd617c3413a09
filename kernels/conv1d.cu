// 1-D convolution over time-major rows (the Whisper conv stem), bias and optional GELU
// fused, FP32 accumulation, one BF16 rounding per stored element.
//
//   x   [length, c_in]                 bf16, time-major (row t = the c_in channels at t)
//   w   [c_out, kernel_size, c_in]     bf16 (HF's Conv1d weight [c_out, c_in, k] permuted
//                                      to (0, 2, 1) at load: tap-major, channels inner)
//   b   [c_out]                        bf16
//   out [l_out, c_out]                 bf16, l_out = (length + 2*padding - kernel_size)
//                                      / stride + 1
//   out[t, co] = act(b[co] + sum_{kk, ci} w[co, kk, ci] * x[t*stride - padding + kk, ci])
//   with x rows outside [0, length) read as zero; act = exact erf GELU when gelu != 0.
//
// It is a GEMM with an implicit im2col: M = l_out (time), N = c_out, K = kernel_size*c_in,
// reduction index r = kk*c_in + ci, so an 8-wide chunk of r is 8 contiguous channels of
// one input row when c_in % 8 == 0.
// Launch: grid (ceil(l_out/64), ceil(c_out/64)), block 256, static shared memory
// 2 * 16 * 64 * 4 = 8 KiB. Each CTA computes a 64 x 64 output tile; thread (ty, tx) owns a
// 4 x 4 micro-tile (rows ty*4.., columns tx*4..). The reduction runs over BK = 16 slices,
// A (gathered input) and B (weights) staged in shared memory as fp32, K-major.
// Vector path (VEC = 8, 128-bit loads) when c_in % 8 == 0 and x, w are 16-byte aligned;
// scalar path (VEC = 1) otherwise. Any sizes >= 1 with l_out * c_out < 2^31.
#include "common.cuh"

#define CV_THREADS 256
#define CV_BM 64
#define CV_BN 64
#define CV_BK 16

__device__ __forceinline__ float gelu_erf(float v) {
    return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
}

template <int VEC>
__device__ __forceinline__ void conv1d_impl(bf16 *__restrict__ out, const bf16 *__restrict__ x,
                                            const bf16 *__restrict__ w,
                                            const bf16 *__restrict__ bias, int c_in, int c_out,
                                            int length, int ksize, int stride, int padding,
                                            int l_out, int gelu) {
    __shared__ __align__(16) float sA[CV_BK][CV_BM];
    __shared__ __align__(16) float sB[CV_BK][CV_BN];
    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;
    const int m0 = blockIdx.x * CV_BM, n0 = blockIdx.y * CV_BN;
    const int K = ksize * c_in;

    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

    for (int k0 = 0; k0 < K; k0 += CV_BK) {
        if (VEC == 8) {
            // 64 rows x 2 chunks of 8 for A and for B: 128 + 128 loads, one per thread.
            const int which = tid >> 7;          // 0: A, 1: B
            const int idx = tid & 127;
            const int row = idx >> 1, chunk = idx & 1;
            const int r = k0 + chunk * 8;        // first reduction index of the chunk
            uint4 raw = make_uint4(0u, 0u, 0u, 0u);
            if (which == 0) {
                const int t = m0 + row;
                if (t < l_out && r < K) {
                    const int kk = r / c_in, ci = r - kk * c_in;
                    const int src = t * stride - padding + kk;
                    if (src >= 0 && src < length)
                        raw = __ldg(reinterpret_cast<const uint4 *>(
                            x + (long long)src * c_in + ci));
                }
            } else {
                const int co = n0 + row;
                if (co < c_out && r < K)
                    raw = __ldg(reinterpret_cast<const uint4 *>(w + (long long)co * K + r));
            }
            float f[8];
            unpack8(*reinterpret_cast<const bf16x8 *>(&raw), f);
            float(*dst)[CV_BM] = which == 0 ? sA : sB;
#pragma unroll
            for (int e = 0; e < 8; ++e) dst[chunk * 8 + e][row] = f[e];
        } else {
            for (int i = tid; i < CV_BK * CV_BM; i += CV_THREADS) {
                const int row = i / CV_BK, kl = i - row * CV_BK;
                const int r = k0 + kl;
                float va = 0.f, vb = 0.f;
                if (r < K) {
                    const int t = m0 + row;
                    if (t < l_out) {
                        const int kk = r / c_in, ci = r - kk * c_in;
                        const int src = t * stride - padding + kk;
                        if (src >= 0 && src < length) va = bf2f(x[(long long)src * c_in + ci]);
                    }
                    const int co = n0 + row;
                    if (co < c_out) vb = bf2f(w[(long long)co * K + r]);
                }
                sA[kl][row] = va;
                sB[kl][row] = vb;
            }
        }
        __syncthreads();
#pragma unroll
        for (int kl = 0; kl < CV_BK; ++kl) {
            const float4 a = *reinterpret_cast<const float4 *>(&sA[kl][ty * 4]);
            const float4 b = *reinterpret_cast<const float4 *>(&sB[kl][tx * 4]);
            const float av[4] = {a.x, a.y, a.z, a.w};
            const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }

#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int co = n0 + tx * 4 + j;
        if (co >= c_out) continue;
        const float bj = bf2f(bias[co]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int t = m0 + ty * 4 + i;
            if (t >= l_out) continue;
            float v = acc[i][j] + bj;
            if (gelu) v = gelu_erf(v);
            out[(long long)t * c_out + co] = f2bf(v);
        }
    }
}

extern "C" __global__ void __launch_bounds__(CV_THREADS)
conv1d_v8(bf16 *out, const bf16 *x, const bf16 *w, const bf16 *bias, int c_in, int c_out,
          int length, int kernel_size, int stride, int padding, int l_out, int gelu) {
    conv1d_impl<8>(out, x, w, bias, c_in, c_out, length, kernel_size, stride, padding, l_out,
                   gelu);
}

extern "C" __global__ void __launch_bounds__(CV_THREADS)
conv1d_v1(bf16 *out, const bf16 *x, const bf16 *w, const bf16 *bias, int c_in, int c_out,
          int length, int kernel_size, int stride, int padding, int l_out, int gelu) {
    conv1d_impl<1>(out, x, w, bias, c_in, c_out, length, kernel_size, stride, padding, l_out,
                   gelu);
}
