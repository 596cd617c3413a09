// Register tiles shared by the recurrent-layer kernels (gated_delta_rule.cu, mamba2_ssd.cu):
// a 4 x 4 Gram tile of BF16 rows (q.k, k.k, C.B products within a chunk) from 128-bit row
// loads, and 4-element BF16 vector loads and stores. Header only; no numerics of its own (an
// FP32 FMA chain over the row in ascending order, 8 elements per load): the kernels' twins
// compute the same dot products with numpy.
#pragma once
#include "common.cuh"

// acc[ii][jj] = sum_d a[ra + ii][d] * b[rb + jj][d] over d < dim (dim % 8 == 0, rows 16-byte
// aligned), rows a[r >= na] and b[r >= nb] read as zero (never loaded). The 8 rows of a step
// stay packed (4 registers each) and widen on use: the tile costs ~50 registers, not ~80.
__device__ __forceinline__ void gram4x4(const bf16 *a, int na, const bf16 *b, int nb,
                                        long long stride, int ra, int rb, int dim,
                                        float acc[4][4]) {
#pragma unroll
    for (int ii = 0; ii < 4; ++ii)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) acc[ii][jj] = 0.f;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int d = 0; d < dim; d += 8) {
        uint4 pa[4], pb[4];
#pragma unroll
        for (int ii = 0; ii < 4; ++ii)
            pa[ii] = ra + ii < na ? *reinterpret_cast<const uint4 *>(a + (ra + ii) * stride + d)
                                  : zero;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
            pb[jj] = rb + jj < nb ? *reinterpret_cast<const uint4 *>(b + (rb + jj) * stride + d)
                                  : zero;
#pragma unroll
        for (int w = 0; w < 4; ++w) {       // 32-bit word w: elements 2w (low), 2w + 1 (high)
#pragma unroll
            for (int ii = 0; ii < 4; ++ii) {
                const unsigned int wa = (&pa[ii].x)[w];
                const float a0 = bf_lo(wa), a1 = bf_hi(wa);
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const unsigned int wb = (&pb[jj].x)[w];
                    acc[ii][jj] = fmaf(a0, bf_lo(wb), acc[ii][jj]);
                    acc[ii][jj] = fmaf(a1, bf_hi(wb), acc[ii][jj]);
                }
            }
        }
    }
}

// 4 BF16 values (8 bytes, 8-byte aligned) to FP32 and back (RNE).
__device__ __forceinline__ void load4_bf16(const bf16 *p, float f[4]) {
    const uint2 raw = *reinterpret_cast<const uint2 *>(p);
    f[0] = bf_lo(raw.x);
    f[1] = bf_hi(raw.x);
    f[2] = bf_lo(raw.y);
    f[3] = bf_hi(raw.y);
}

__device__ __forceinline__ void store4_bf16(bf16 *p, const float f[4]) {
    *reinterpret_cast<uint2 *>(p) = make_uint2(pack_bf2(f[0], f[1]), pack_bf2(f[2], f[3]));
}

__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }
