// Shared device helpers for every kernel file: BF16 conversion, warp and block reductions,
// 128-bit vector access and the vectorised elementwise loops. Header only; included by
// kernels/*.cu.
#pragma once
#include <cuda_bf16.h>

#define NEG_INF (-__int_as_float(0x7f800000))

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 f2bf(float x) { return __float2bfloat16_rn(x); }

// A bf16 pair in one 32-bit word (low half = element 0): exact widening, RNE packing.
__device__ __forceinline__ float bf_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ unsigned int pack_bf2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<unsigned int *>(&h);
}

// 8 BF16 values moved as one 128-bit load/store.
struct __align__(16) bf16x8 { __nv_bfloat162 h[4]; };

// Takes the vector by value: a caller's `unpack8(p[i], ...)` is then one 128-bit load,
// whatever the compiler would make of four 32-bit reads through a reference.
__device__ __forceinline__ void unpack8(const bf16x8 v, float out[8]) {
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

// 8 packed values through an FP32 function, one RNE rounding each: bf16(f(x)), bf16(f(x, y)).
template <class F>
__device__ __forceinline__ bf16x8 map8(const bf16x8 x, F f) {
    float a[8];
    unpack8(x, a);
#pragma unroll
    for (int e = 0; e < 8; ++e) a[e] = f(a[e]);
    return pack8(a);
}

template <class F>
__device__ __forceinline__ bf16x8 map8(const bf16x8 x, const bf16x8 y, F f) {
    float a[8], b[8];
    unpack8(x, a);
    unpack8(y, b);
#pragma unroll
    for (int e = 0; e < 8; ++e) a[e] = f(a[e], b[e]);
    return pack8(a);
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

// ---- vectorised elementwise loops ---------------------------------------------------------
// They only decide which elements a thread visits and with which access width; the value of
// an element is whatever the caller's functors compute, the same on either path, so they
// have no numerics (and no twin) of their own: each kernel's twin computes its formula over
// the whole array.

__device__ __forceinline__ bool aligned16(const void *p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// Flat buffers of n elements, 1-D grid-stride. With `vector_ok` (the caller's 16-byte
// alignment test of every pointer), thread t calls vec8(i) for the 8-element chunks
// i = t, t + stride, ... < n / 8, then one(i) for the n % 8 tail elements; otherwise one(i)
// for every element. Indices are 64-bit.
template <class Vec8, class One>
__device__ __forceinline__ void grid_stride_x8(int n, bool vector_ok, Vec8 vec8, One one) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if (vector_ok) {
        const long long n8 = n >> 3;
        for (long long i = tid; i < n8; i += stride) vec8(i);
        done = n8 << 3;
    }
    for (long long i = done + tid; i < n; i += stride) one(i);
}

// One row of `width` elements per CTA, block-stride. With `vector_ok` (width % 8 == 0 and the
// caller's alignment test), thread t calls vec8(c) for chunks c = t, t + blockDim.x, ... <
// width / 8; otherwise one(c) for every element (no tail: the vector path needs width % 8 == 0).
template <class Vec8, class One>
__device__ __forceinline__ void row_stride_x8(int width, bool vector_ok, Vec8 vec8, One one) {
    if (vector_ok) {
        for (int c = threadIdx.x; c < (width >> 3); c += blockDim.x) vec8(c);
    } else {
        for (int c = threadIdx.x; c < width; c += blockDim.x) one(c);
    }
}
