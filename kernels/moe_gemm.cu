// Grouped tensor-core GEMM over the routed experts of a MoE layer (prefill, decode and
// verify alike), with gemm_tc's per-element arithmetic.
//
//   for every expert e and every pair p in e's row list (kernels/moe_router.cu moe_route):
//     y[p, j] = sum_k x[p / row_div, k] * w[e, j, k]      (Y = X_gathered @ W_e^T)
//
// Shapes: x bf16 [*, k] (gate_up: the tokens' normed hidden states, row_div = top_k, so
// pair p reads token p / top_k; down: the pairs' activations, row_div = 1); w bf16
// [num_experts, n, k] (each expert's nn.Linear weight, stacked); y bf16 [n_pairs, n]
// (moe_gemm_bf16_*: one RNE rounding) or float32 (moe_gemm_fp32_*: the accumulator);
// sorted_pairs int32 [n_pairs], expert_offsets / tile_offsets int32 [num_experts + 1] from
// moe_route with block_m = the tile's BM. Any n, k >= 1.
//
// Launch: block = the tile's threads, grid (max_tiles, ceil(n / BN)) with max_tiles >= the
// row tiles moe_route counted (tile_offsets[E]); ops/moe_gemm.py sizes it from n_pairs and
// num_experts alone (sum_e ceil(c_e / BM) <= (n_pairs + min(E, n_pairs) (BM - 1)) / BM), so
// the launch needs no device-to-host read and can be captured in a CUDA graph. CTA (t, c):
// e = the expert whose tiles hold t (binary search in tile_offsets), rows
// expert_offsets[e] + (t - tile_offsets[e]) * BM + [0, BM) of its list; CTAs past the last
// tile return at once. Tiles (the same three as kernels/gemm_tc.cu, picked for speed only):
//   tile      BM x BN   BK  warps  stages  static smem   use
//   16x16     16 x 16   64  1 x 2    12    48 KiB        decode: a few rows per expert
//   64x32     64 x 32   64  2 x 2     4    48 KiB        mid-size batches
//   128x128  128 x 128  32  2 x 4     3    48 KiB        prefill: many rows per expert
// The 16-row tile is the decode path (the "gather-GEMV"): a CUDA-core GEMV would sum each
// row in another order than the tensor cores, and a token's bits would then depend on
// whether its batch was small enough for it. The CTA tile is gemm_tc's own
// (kernels/gemm_tc_tile.cuh: pipeline, swizzle, clamped edges, the scalar fallback when
// k % 8 != 0 or x / w are not 16-byte aligned), run with the row policy ExpertRows: A rows
// gathered through sorted_pairs, W = expert e's slice (BF16Rows), output row p of y (pairs
// never collide: no atomics).
//
// BATCH INVARIANCE: y[p, j] is the FP32 accumulator of ceil(k / 16) mma.sync.m16n8k16 steps
// in ascending k order from +0.0f over x[p / row_div, :] and w[e, j, :] -- exactly
// gemm_tc's element (its header has the argument): the same bits as gemm_tc of that x row
// against W_e, for every tile, every row position in the tile and every other token in the
// launch. Which tokens share an expert changes only which CTA computes a row, never its
// value. The twin is therefore gemm_tc's (ops/gemm_tc.dot_f32 per expert).
#include "gemm_tc_tile.cuh"

// gemm_tc.cu's three tiles (same sizes and stages: ops/moe_gemm.py TILES = gemm_tc.TILES)
typedef TcTile<16, 16, 64, 1, 2, 12> MoeTile16x16;
typedef TcTile<64, 32, 64, 2, 2, 4> MoeTile64x32;
typedef TcTile<128, 128, 32, 2, 4, 3> MoeTile128x128;

// One row tile of an expert's list: tile row r is pair p = pairs[r], which reads X row
// p / row_div (its token for gate_up, itself for down) and writes Y row p.
struct ExpertRows {
    const int *pairs;
    int rows, row_div;
    __device__ __forceinline__ long long x_row(int r) const { return pairs[r] / row_div; }
    __device__ __forceinline__ long long y_row(int r) const { return pairs[r]; }
};

// The expert whose row tiles hold tile t: the last e with tile_offsets[e] <= t.
__device__ __forceinline__ int tile_expert(const int *tile_offsets, int num_experts, int t) {
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tile_offsets[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

template <class T>
__device__ __forceinline__ void moe_gemm_tile(bf16 *sa, bf16 *sb, bf16 *yb, float *yf,
                                              const bf16 *x, const bf16 *w,
                                              const int *sorted_pairs,
                                              const int *expert_offsets,
                                              const int *tile_offsets, int num_experts, int n,
                                              int k, int row_div) {
    const int t = blockIdx.x;
    if (t >= tile_offsets[num_experts]) return;  // CTA-uniform: past the last row tile
    const int e = tile_expert(tile_offsets, num_experts, t);
    const int r0 = expert_offsets[e] + (t - tile_offsets[e]) * T::BM;
    const ExpertRows rows{sorted_pairs + r0, min(T::BM, expert_offsets[e + 1] - r0), row_div};
    BF16Rows<T> src{w + (long long)e * n * k};
    gemm_tc_tile_rows<T>(sa, sb, nullptr, yb, yf, x, src, rows, n, k, n);
}

#define MOE_GEMM_SMEM(TILE)                                                                   \
    __shared__ __align__(128) bf16 sa[TILE::STAGES * TILE::BM * TILE::BK];                    \
    __shared__ __align__(128) bf16 sb[TILE::STAGES * TILE::BN * TILE::BK]

#define MOE_GEMM_ARGS                                                                         \
    const bf16 *x, const bf16 *w, const int *sorted_pairs, const int *expert_offsets,         \
        const int *tile_offsets, int num_experts, int n, int k, int row_div

#define MOE_GEMM_ENTRY(NAME, TILE, MIN_BLOCKS)                                                \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        moe_gemm_bf16_##NAME(bf16 *y, MOE_GEMM_ARGS) {                                        \
        MOE_GEMM_SMEM(TILE);                                                                  \
        moe_gemm_tile<TILE>(sa, sb, y, nullptr, x, w, sorted_pairs, expert_offsets,           \
                            tile_offsets, num_experts, n, k, row_div);                        \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        moe_gemm_fp32_##NAME(float *y, MOE_GEMM_ARGS) {                                       \
        MOE_GEMM_SMEM(TILE);                                                                  \
        moe_gemm_tile<TILE>(sa, sb, nullptr, y, x, w, sorted_pairs, expert_offsets,           \
                            tile_offsets, num_experts, n, k, row_div);                        \
    }

MOE_GEMM_ENTRY(16x16, MoeTile16x16, 1)
MOE_GEMM_ENTRY(64x32, MoeTile64x32, 1)
MOE_GEMM_ENTRY(128x128, MoeTile128x128, 2)
