// Memory-bound, batch-invariant GEMV/skinny GEMM for decode (usable in CUDA-graph capture).
//
//   y[i, j] = sum_k x[i, k] * w[j, k]      (Y[m, n] = X[m, k] @ W[n, k]^T, nn.Linear layout)
//
// Shapes: x bf16 [m, k], w bf16 [n, k], y bf16 [m, n] (gemv_bf16, one RNE rounding) or
// float32 [m, n] (gemv_fp32, FP32 logits). FP32 accumulation.
//
// Launch: block GEMV_THREADS (256 = 8 warps), grid (ceil(m / GEMV_ROWS), ceil(n / 16)):
// grid.x is the row tile (fastest-varying, so the tiles that share a weight slice run
// together and the re-reads of W for m > 8 hit L2), grid.y the column block.
// Each warp owns GEMV_COLS = 2 output columns (16 columns per CTA) and up to GEMV_ROWS = 8
// rows of x. Lane l walks the 16-byte chunks l, l+32, l+64, ... of its two weight rows with
// 128-bit ld.global.nc.L1::no_allocate loads, GEMV_UNROLL = 4 chunks per column issued
// before any is used (8 x 16 B = 128 B of weight in flight per lane, 4 KiB per warp; the
// PTX shows the 8 loads grouped ahead of the FMAs), loads the matching x chunk of each of
// its rows once (128-bit __ldg, L1-resident: every warp of the CTA reads the same x) and
// reuses it for both columns, and accumulates with fmaf in chunk order; a remainder loop
// continues chunk by chunk in the same order. Then one fixed xor-butterfly (warp_sum) per
// (row, column). Bytes per CTA per pass: 16 * k * 2 of weight (128 KiB at k = 4096) plus
// rows * k * 2 of x (from L1/L2). ptxas: 78 (sm_80) / 80 (sm_90) registers, no spills ->
// 3 CTAs = 24 warps per SM, ~96 KiB of weight loads in flight per SM, well above what
// Little's law asks of HBM3 (~25 KiB per SM at 3.35 TB/s and ~1 us).
//
// BATCH INVARIANCE: the value of y[i, j] depends only on x[i, :], w[j, :] and k: its lane
// partial sums always see the same chunks in the same order, its reduction tree is fixed,
// and rows beyond the tile are handled by further row tiles (grid.x) with identical per-row
// code; row i's math never depends on m or on the other rows of its tile (rows >= m are
// skipped with warp-uniform branches, never mixed in).
//
// m <= 8 reads W exactly once (one pass): lm_head n=128256, k=4096 -> 8016 CTAs; down_proj
// n=4096, k=14336 -> 256 CTAs, every CTA resident at once on 132 SMs.
//
// Vector path: k % 8 == 0 and x, w 16-byte aligned. Otherwise a scalar path (one element per
// lane per step, same invariance argument). Restrictions: m, n, k >= 1; n <= 65535 * 16.
#include "common.cuh"

#define GEMV_THREADS 256
#define GEMV_WARPS (GEMV_THREADS / 32)
#define GEMV_ROWS 8
#define GEMV_COLS 2
#define GEMV_UNROLL 4

// Weights are streamed once: do not let them evict x from L1. (Without __CUDA_ARCH__, i.e.
// in the EmuBackend's g++ build, a plain 16-byte load with the same result.)
__device__ __forceinline__ uint4 ld_weight(const void *p) {
#ifdef __CUDA_ARCH__
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
#else
    return *reinterpret_cast<const uint4 *>(p);
#endif
}

__device__ __forceinline__ void unpack_u4(const uint4 v, float f[8]) {
    const unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(u[i] << 16);
        f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ void store_y(bf16 *y, long long i, float v) { y[i] = f2bf(v); }
__device__ __forceinline__ void store_y(float *y, long long i, float v) { y[i] = v; }

// acc[r][c] += dot(w chunk c, x[r] chunk) for the tile's live rows, in element order.
__device__ __forceinline__ void fma_chunk(float (&acc)[GEMV_ROWS][GEMV_COLS],
                                          const uint4 (&wv)[GEMV_COLS], const bf16 *xt, int k,
                                          int ch, int rows) {
    float wf[GEMV_COLS][8];
#pragma unroll
    for (int c = 0; c < GEMV_COLS; ++c) unpack_u4(wv[c], wf[c]);
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        if (r < rows) {
            const uint4 xv = __ldg(reinterpret_cast<const uint4 *>(xt + (long long)r * k) + ch);
            float xf[8];
            unpack_u4(xv, xf);
#pragma unroll
            for (int c = 0; c < GEMV_COLS; ++c)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][c] = fmaf(wf[c][e], xf[e], acc[r][c]);
        }
    }
}

template <typename TOut>
__device__ __forceinline__ void gemv_tile(TOut *y, const bf16 *x, const bf16 *w, int m, int n,
                                          int k) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int row0 = blockIdx.x * GEMV_ROWS;
    const int rows = min(GEMV_ROWS, m - row0);
    const int col0 = (blockIdx.y * GEMV_WARPS + warp) * GEMV_COLS;
    if (rows <= 0 || col0 >= n) return;  // whole warp; no block-wide barrier follows

    float acc[GEMV_ROWS][GEMV_COLS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int c = 0; c < GEMV_COLS; ++c) acc[r][c] = 0.f;

    // A column past n reads the last valid row (never stored): no guards in the hot loop.
    const bf16 *wc[GEMV_COLS];
#pragma unroll
    for (int c = 0; c < GEMV_COLS; ++c) wc[c] = w + (long long)min(col0 + c, n - 1) * k;
    const bf16 *xt = x + (long long)row0 * k;

    if ((k & 7) == 0 && aligned16(x) && aligned16(w)) {
        const int nch = k >> 3;
        int ch = lane;
        // Main loop: GEMV_UNROLL chunks per column loaded before any is used. The remainder
        // loop continues with the next chunk, so each lane still sees its chunks in order.
        for (; ch + 32 * (GEMV_UNROLL - 1) < nch; ch += 32 * GEMV_UNROLL) {
            uint4 wv[GEMV_UNROLL][GEMV_COLS];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
                for (int c = 0; c < GEMV_COLS; ++c)
                    wv[u][c] = ld_weight(wc[c] + 8 * (long long)(ch + 32 * u));
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) fma_chunk(acc, wv[u], xt, k, ch + 32 * u, rows);
        }
        for (; ch < nch; ch += 32) {
            uint4 wv[GEMV_COLS];
#pragma unroll
            for (int c = 0; c < GEMV_COLS; ++c) wv[c] = ld_weight(wc[c] + 8 * (long long)ch);
            fma_chunk(acc, wv, xt, k, ch, rows);
        }
    } else {
        for (int i = lane; i < k; i += 32) {
            float wf[GEMV_COLS];
#pragma unroll
            for (int c = 0; c < GEMV_COLS; ++c) wf[c] = bf2f(wc[c][i]);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                if (r < rows) {
                    const float xf = bf2f(xt[(long long)r * k + i]);
#pragma unroll
                    for (int c = 0; c < GEMV_COLS; ++c) acc[r][c] = fmaf(wf[c], xf, acc[r][c]);
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        if (r < rows) {
#pragma unroll
            for (int c = 0; c < GEMV_COLS; ++c) {
                const float s = warp_sum(acc[r][c]);
                if (lane == 0 && col0 + c < n) store_y(y, (long long)(row0 + r) * n + col0 + c, s);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
gemv_bf16(bf16 *y, const bf16 *x, const bf16 *w, int m, int n, int k) {
    gemv_tile<bf16>(y, x, w, m, n, k);
}

extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
gemv_fp32(float *y, const bf16 *x, const bf16 *w, int m, int n, int k) {
    gemv_tile<float>(y, x, w, m, n, k);
}
