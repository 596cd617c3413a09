// Shared device helpers for every kernel file: BF16 conversion, warp and block reductions,
// 128-bit vector access. Header only; included by kernels/*.cu.
#pragma once
#include <cuda_bf16.h>

#define NEG_INF (-__int_as_float(0x7f800000))

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 f2bf(float x) { return __float2bfloat16_rn(x); }

// 8 BF16 values moved as one 128-bit load/store.
struct __align__(16) bf16x8 { __nv_bfloat162 h[4]; };

__device__ __forceinline__ void unpack8(const bf16x8 &v, float out[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(v.h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ bf16x8 pack8(const float in[8]) {
    bf16x8 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    return v;
}

// Butterfly sum over a full warp: every lane ends with the same total, the summation order
// is fixed (xor 16, 8, 4, 2, 1), and the twins reproduce it with pairwise sums.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). `scratch` holds 32
// floats of shared memory. Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}
