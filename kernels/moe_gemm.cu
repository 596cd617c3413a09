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
// Option bias (bf16 [num_experts, n], gpt-oss's expert biases; NULL: none): y[p, j] =
// acc + bias[e, j] before the one rounding (FP32 y: the sum), in the epilogue.
//
// MXFP4 experts (moe_gemm_mxfp4_{bf16,fp32}_*, gpt-oss as released; ops/mxfp4.py): W given as
// blocks uint8 [num_experts, n, k / 2] (two e2m1 codes a byte, value 2j in the low nibble of
// byte j) and scales uint8 [num_experts, n, k / 32] (e8m0: 2^(s - 127) for 32 values, s in
// [2, 252], checked at load); k % 32 == 0. The tile loads the packed bytes (gemm_q_rows.cuh
// QuantRows, as gemm_q's 4-bit path) and dequantizes each value to code * 2^(s - 127), exact
// in FP32 and in BF16 (three significant bits, normal exponents), into the BF16 stage the
// MMAs read: the bits of this GEMM run on the dequantized BF16 weights.
//
// BATCH INVARIANCE: y[p, j] is the FP32 accumulator of ceil(k / 16) mma.sync.m16n8k16 steps
// in ascending k order from +0.0f over x[p / row_div, :] and w[e, j, :] -- exactly
// gemm_tc's element (its header has the argument): the same bits as gemm_tc of that x row
// against W_e, for every tile, every row position in the tile and every other token in the
// launch. Which tokens share an expert changes only which CTA computes a row, never its
// value. The twin is therefore gemm_tc's (ops/gemm_tc.dot_f32 per expert).
#include "gemm_q_rows.cuh"
#include "gemm_tc_tile.cuh"
#include "moe_expert_rows.cuh"

// gemm_tc.cu's three tiles (same sizes and stages: ops/moe_gemm.py TILES = gemm_tc.TILES)
typedef TcTile<16, 16, 64, 1, 2, 12> MoeTile16x16;
typedef TcTile<64, 32, 64, 2, 2, 4> MoeTile64x32;
typedef TcTile<128, 128, 32, 2, 4, 3> MoeTile128x128;

template <class T>
__device__ __forceinline__ void moe_gemm_tile(bf16 *sa, bf16 *sb, bf16 *yb, float *yf,
                                              const bf16 *x, const bf16 *w,
                                              const int *sorted_pairs,
                                              const int *expert_offsets,
                                              const int *tile_offsets, int num_experts, int n,
                                              int k, int row_div, const bf16 *bias) {
    const int t = blockIdx.x;
    if (t >= tile_offsets[num_experts]) return;  // CTA-uniform: past the last row tile
    const int e = tile_expert(tile_offsets, num_experts, t);
    const int r0 = expert_offsets[e] + (t - tile_offsets[e]) * T::BM;
    const ExpertRows rows{sorted_pairs + r0, min(T::BM, expert_offsets[e + 1] - r0), row_div,
                          bias ? bias + (long long)e * n : nullptr};
    BF16Rows<T> src{w + (long long)e * n * k};
    gemm_tc_tile_rows<T>(sa, sb, nullptr, yb, yf, x, src, rows, n, k, n);
}

#define MOE_GEMM_SMEM(TILE)                                                                   \
    __shared__ __align__(128) bf16 sa[TILE::STAGES * TILE::BM * TILE::BK];                    \
    __shared__ __align__(128) bf16 sb[TILE::STAGES * TILE::BN * TILE::BK]

#define MOE_GEMM_ARGS                                                                         \
    const bf16 *x, const bf16 *w, const int *sorted_pairs, const int *expert_offsets,         \
        const int *tile_offsets, int num_experts, int n, int k, int row_div, const bf16 *bias

#define MOE_GEMM_ENTRY(NAME, TILE, MIN_BLOCKS)                                                \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        moe_gemm_bf16_##NAME(bf16 *y, MOE_GEMM_ARGS) {                                        \
        MOE_GEMM_SMEM(TILE);                                                                  \
        moe_gemm_tile<TILE>(sa, sb, y, nullptr, x, w, sorted_pairs, expert_offsets,           \
                            tile_offsets, num_experts, n, k, row_div, bias);                  \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        moe_gemm_fp32_##NAME(float *y, MOE_GEMM_ARGS) {                                       \
        MOE_GEMM_SMEM(TILE);                                                                  \
        moe_gemm_tile<TILE>(sa, sb, nullptr, y, x, w, sorted_pairs, expert_offsets,           \
                            tile_offsets, num_experts, n, k, row_div, bias);                  \
    }

MOE_GEMM_ENTRY(16x16, MoeTile16x16, 1)
MOE_GEMM_ENTRY(64x32, MoeTile64x32, 1)
MOE_GEMM_ENTRY(128x128, MoeTile128x128, 2)

// ---- MXFP4 experts ----------------------------------------------------------------------
// e2m1 code c (sign, 2 exponent bits, 1 mantissa bit) as a float: +-{0, 0.5, 1, 1.5, 2, 3,
// 4, 6}; code 8 is -0.0, as transformers' table.
__device__ __forceinline__ float e2m1_f(unsigned int c) {
    const unsigned int e = (c >> 1) & 3u, m = c & 1u;
    const unsigned int mag = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3F000000u : 0u);
    return __uint_as_float(mag | ((c & 8u) << 28));
}

// One expert's MXFP4 W [n, k] for QuantRows: row j's k / 2 bytes at q + j * row_bytes, its
// k / 32 scales at scales + j * (k / 32).
struct Mxfp4Format {
    static constexpr int BITS = 4;
    const unsigned char *q, *scales;
    int row_bytes, k;
    struct Row {
        int j;
    };
    __device__ __forceinline__ const unsigned char *row_bytes_at(int j) const {
        return q + (long long)j * row_bytes;
    }
    __device__ __forceinline__ Row row(int j) const { return {j}; }
    __device__ __forceinline__ uint4 dequant8(const unsigned char *raw, const Row &r, int k0,
                                              int) const {  // k % 32 == 0: whole chunks
        const unsigned int w = *reinterpret_cast<const unsigned int *>(raw);
        const unsigned int s = __ldg(scales + (long long)r.j * (k >> 5) + (k0 >> 5));
        const float scale = __uint_as_float(s << 23);   // 2^(s - 127), a normal float
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(e2m1_f((w >> (4 * e)) & 15u), scale);
        return make_uint4(pack_bf2(v[0], v[1]), pack_bf2(v[2], v[3]), pack_bf2(v[4], v[5]),
                          pack_bf2(v[6], v[7]));
    }
};

template <class T>
__device__ __forceinline__ void moe_mxfp4_tile(unsigned char *sw, bf16 *sa, bf16 *sd, bf16 *yb,
                                               float *yf, const bf16 *x,
                                               const unsigned char *blocks,
                                               const unsigned char *scales,
                                               const int *sorted_pairs,
                                               const int *expert_offsets,
                                               const int *tile_offsets, int num_experts, int n,
                                               int k, int row_div, const bf16 *bias) {
    const int t = blockIdx.x;
    if (t >= tile_offsets[num_experts]) return;  // CTA-uniform: past the last row tile
    const int e = tile_expert(tile_offsets, num_experts, t);
    const int r0 = expert_offsets[e] + (t - tile_offsets[e]) * T::BM;
    const ExpertRows rows{sorted_pairs + r0, min(T::BM, expert_offsets[e + 1] - r0), row_div,
                          bias ? bias + (long long)e * n : nullptr};
    QuantRows<T, Mxfp4Format> src;
    src.f = Mxfp4Format{blocks + (long long)e * n * (k >> 1),
                        scales + (long long)e * n * (k >> 5), k >> 1, k};
    gemm_tc_tile_rows<T>(sa, sw, sd, yb, yf, x, src, rows, n, k, n);
}

#define MOE_MXFP4_ENTRY(OUT, YT, YB, YF, NAME, TILE, MIN_BLOCKS)                              \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        moe_gemm_mxfp4_##OUT##_##NAME(YT *y, const bf16 *x, const unsigned char *blocks,      \
                                      const unsigned char *scales, const int *sorted_pairs,   \
                                      const int *expert_offsets, const int *tile_offsets,     \
                                      int num_experts, int n, int k, int row_div,             \
                                      const bf16 *bias) {                                     \
        typedef QuantRows<TILE, Mxfp4Format> Src;                                             \
        __shared__ __align__(128) bf16 sa[TILE::STAGES * TILE::BM * TILE::BK];                \
        __shared__ __align__(128) unsigned char sw[TILE::STAGES * Src::STAGE_ELEMS];          \
        __shared__ __align__(128) bf16 sd[TILE::BN * TILE::BK];                               \
        moe_mxfp4_tile<TILE>(sw, sa, sd, YB, YF, x, blocks, scales, sorted_pairs,             \
                             expert_offsets, tile_offsets, num_experts, n, k, row_div, bias); \
    }

MOE_MXFP4_ENTRY(bf16, bf16, y, nullptr, 16x16, MoeTile16x16, 1)
MOE_MXFP4_ENTRY(bf16, bf16, y, nullptr, 64x32, MoeTile64x32, 1)
MOE_MXFP4_ENTRY(bf16, bf16, y, nullptr, 128x128, MoeTile128x128, 2)
MOE_MXFP4_ENTRY(fp32, float, nullptr, y, 16x16, MoeTile16x16, 1)
MOE_MXFP4_ENTRY(fp32, float, nullptr, y, 64x32, MoeTile64x32, 1)
MOE_MXFP4_ENTRY(fp32, float, nullptr, y, 128x128, MoeTile128x128, 2)
