// Grouped tensor-core GEMM over quantized routed experts (GPTQ / AWQ 4-bit, FP8 e4m3 with
// block, channel or tensor scales), dequantized inside the tile with gemm_q.cu's formulas:
//
//   for every expert e and every pair p in e's row list (kernels/moe_router.cu moe_route):
//     y[p, j] = sum_k x[p / row_div, k] * dequant(W_e)[j, k]
//
// kernels/moe_gemm.cu's grouped GEMM (same tiles, grid, row lists and ExpertRows gather:
// its header has the launch and the argument for batch invariance) with W read through
// gemm_q_rows.cuh QuantRows and kernels/gemm_q_formats.cuh's Int4Format / Fp8Format, as
// moe_gemm.cu's MXFP4 experts are. Each value is dequantized to BF16 exactly as gemm_q.cu
// dequantizes it, into the BF16 stage the MMAs read, so y[p, :] is bit for bit gemm_tc's
// row of x[p / row_div] against dequant(W_e): it depends on (x row, W_e, k) alone, never on
// which other tokens chose expert e, the tile or the batch.
//
// Device layout (ops/moe_gemm_q.py; per expert exactly gemm_q.cu's layout of one linear):
//   moe_gemm_q4_*   q uint32 [E, n, kp / 8] (kp = k rounded up to 32), scales uint16 (FP16
//                   bits) [E, n, groups], zeros uint8 [E, n, groups]; act-order: gidx int32
//                   [tables, k] shared by all experts and gidx_row int32 [E, n] (row j of
//                   expert e reads table gidx_row[e, j]), or both NULL (group k / group_size).
//                   k % 8 == 0; q 16-byte aligned.
//   moe_gemm_fp8_*  q uint8 [E, n, kp], scales float32 [rows, k_blocks] shared by all
//                   experts, scale_row int32 [E, n] (row j of expert e scales with
//                   scales[scale_row[e, j], k / block_k]); q 16-byte aligned.
// x bf16 [*, k]; y bf16 [n_pairs, n] (moe_gemm_{q4,fp8}_bf16_*: one RNE rounding) or float32
// (moe_gemm_{q4,fp8}_fp32_*); sorted_pairs, expert_offsets, tile_offsets as moe_gemm.cu.
#include "gemm_q_formats.cuh"
#include "gemm_q_rows.cuh"
#include "gemm_tc_tile.cuh"
#include "moe_expert_rows.cuh"

typedef TcTile<16, 16, 64, 1, 2, 12> MoeQTile16x16;
typedef TcTile<64, 32, 64, 2, 2, 4> MoeQTile64x32;
typedef TcTile<128, 128, 32, 2, 4, 3> MoeQTile128x128;

// The CTA's expert, its row tile and its W (the format `at(e)` gives), then gemm_tc's tile.
template <class T, class F, class At>
__device__ __forceinline__ void moe_q_tile(unsigned char *sw, bf16 *sa, bf16 *sd, bf16 *yb,
                                           float *yf, const bf16 *x, const At &at,
                                           const int *sorted_pairs, const int *expert_offsets,
                                           const int *tile_offsets, int num_experts, int n,
                                           int k, int row_div) {
    const int t = blockIdx.x;
    if (t >= tile_offsets[num_experts]) return;  // CTA-uniform: past the last row tile
    const int e = tile_expert(tile_offsets, num_experts, t);
    const int r0 = expert_offsets[e] + (t - tile_offsets[e]) * T::BM;
    const ExpertRows rows{sorted_pairs + r0, min(T::BM, expert_offsets[e + 1] - r0), row_div,
                          nullptr};
    QuantRows<T, F> src;
    src.f = at(e);
    gemm_tc_tile_rows<T>(sa, sw, sd, yb, yf, x, src, rows, n, k, n);
}

// Expert e's 4-bit W as gemm_q.cu's Int4Format of one linear.
struct Q4Experts {
    const unsigned int *q;
    const unsigned short *scales;
    const unsigned char *zeros;
    const int *gidx, *gidx_row;
    int n, k, groups, group_size;
    __device__ __forceinline__ Int4Format operator()(int e) const {
        const long long rows = (long long)e * n, rb = ((k + 31) / 32) * 16;
        return Int4Format{q + rows * (rb / 4), scales + rows * groups, zeros + rows * groups,
                          gidx, gidx_row ? gidx_row + rows : nullptr, groups, group_size,
                          (int)rb, k};
    }
};

// Expert e's FP8 W as gemm_q.cu's Fp8Format of one linear.
struct Fp8Experts {
    const unsigned char *q;
    const float *scales;
    const int *scale_row;
    int n, k, k_blocks, block_k;
    __device__ __forceinline__ Fp8Format operator()(int e) const {
        const long long rows = (long long)e * n, rb = ((k + 31) / 32) * 32;
        return Fp8Format{q + rows * rb, scales, scale_row + rows, k_blocks, block_k, (int)rb};
    }
};

#define MOE_Q_SMEM(TILE, F)                                                                   \
    typedef QuantRows<TILE, F> Src;                                                           \
    __shared__ __align__(128) bf16 sa[TILE::STAGES * TILE::BM * TILE::BK];                    \
    __shared__ __align__(128) unsigned char sw[TILE::STAGES * Src::STAGE_ELEMS];              \
    __shared__ __align__(128) bf16 sd[TILE::BN * TILE::BK]

#define MOE_LISTS                                                                             \
    const int *sorted_pairs, const int *expert_offsets, const int *tile_offsets,              \
        int num_experts, int n, int k, int row_div

#define MOE_Q4_ENTRY(OUT, YT, YB, YF, NAME, TILE, MIN_BLOCKS)                                 \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        moe_gemm_q4_##OUT##_##NAME(YT *y, const bf16 *x, const unsigned int *q,               \
                                   const unsigned short *scales, const unsigned char *zeros,  \
                                   const int *gidx, const int *gidx_row, MOE_LISTS,           \
                                   int groups, int group_size) {                              \
        MOE_Q_SMEM(TILE, Int4Format);                                                         \
        const Q4Experts at{q, scales, zeros, gidx, gidx_row, n, k, groups, group_size};       \
        moe_q_tile<TILE, Int4Format>(sw, sa, sd, YB, YF, x, at, sorted_pairs,                 \
                                     expert_offsets, tile_offsets, num_experts, n, k,         \
                                     row_div);                                                \
    }

#define MOE_FP8_ENTRY(OUT, YT, YB, YF, NAME, TILE, MIN_BLOCKS)                                \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        moe_gemm_fp8_##OUT##_##NAME(YT *y, const bf16 *x, const unsigned char *q,             \
                                    const float *scales, const int *scale_row, MOE_LISTS,     \
                                    int k_blocks, int block_k) {                              \
        MOE_Q_SMEM(TILE, Fp8Format);                                                          \
        const Fp8Experts at{q, scales, scale_row, n, k, k_blocks, block_k};                   \
        moe_q_tile<TILE, Fp8Format>(sw, sa, sd, YB, YF, x, at, sorted_pairs, expert_offsets,  \
                                    tile_offsets, num_experts, n, k, row_div);                \
    }

#define MOE_Q_ENTRIES(NAME, MIN_BLOCKS)                                                       \
    MOE_Q4_ENTRY(bf16, bf16, y, nullptr, NAME, MoeQTile##NAME, MIN_BLOCKS)                     \
    MOE_Q4_ENTRY(fp32, float, nullptr, y, NAME, MoeQTile##NAME, MIN_BLOCKS)                    \
    MOE_FP8_ENTRY(bf16, bf16, y, nullptr, NAME, MoeQTile##NAME, MIN_BLOCKS)                    \
    MOE_FP8_ENTRY(fp32, float, nullptr, y, NAME, MoeQTile##NAME, MIN_BLOCKS)

MOE_Q_ENTRIES(16x16, 1)
MOE_Q_ENTRIES(64x32, 1)
MOE_Q_ENTRIES(128x128, 2)
