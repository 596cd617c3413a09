// The row side of the grouped expert GEMMs (kernels/moe_gemm.cu: BF16 and MXFP4 experts;
// kernels/moe_gemm_q.cu: GPTQ / AWQ and FP8 experts): which expert a CTA's row tile belongs
// to, and the gathered rows of that tile (gemm_tc_tile.cuh's row policy). Header only.
#pragma once
#include "gemm_tc_tile.cuh"

// One row tile of an expert's list: tile row r is pair p = pairs[r], which reads X row
// p / row_div (its token for gate_up, itself for down) and writes Y row p.
struct ExpertRows {
    static constexpr bool kBias = true;
    const int *pairs;
    int rows, row_div;
    const bf16 *bias;   // expert e's bias row [n], or NULL
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
