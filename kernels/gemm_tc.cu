// Batch-invariant tensor-core GEMM for every linear layer of decode, verify and prefill.
//
//   y[i, j] = sum_k x[i, k] * w[j, k]      (Y[m, n] = X[m, k] @ W[n, k]^T, nn.Linear layout)
//
// Shapes: x bf16 [m, k], w bf16 [n, k] (row-major), y bf16 [m, n] (gemm_tc_bf16_*: one RNE
// rounding of the FP32 accumulator) or float32 [m, n] (gemm_tc_fp32_*: the accumulator
// itself, for FP32 logits). Any m, n, k >= 1.
//
// Three CTA tile configurations, one entry point per (output type, tile); the launcher
// (metrale/ops/gemm_tc.py) picks the tile from (m, n) for speed only:
//   tile      BM x BN   BK  warps (M x N)  warp tile  stages  static smem  CTAs/SM bound
//   16x16     16 x 16   64  1 x 2 =  64 t   16 x 8      12    48 KiB       smem
//   64x32     64 x 32   64  2 x 2 = 128 t   32 x 16      4    48 KiB       smem
//   128x128  128 x 128  32  2 x 4 = 256 t   64 x 32      3    48 KiB       regs (<= 128)
// Launch: block = warps * 32 threads, grid (ceil(m / BM), ceil(n / BN)), no dynamic shared
// memory. grid.x is the row tile (fastest-varying), so CTAs that share a slice of W run
// together and its re-reads for m > BM hit L2. Restriction: ceil(n / BN) <= 65535.
//
// Pipeline: a CTA walks k in stages of BK. Each stage of X (BM x BK) and W (BN x BK) goes
// global -> shared with 16-byte cp.async (.cg, L1 bypassed) into a ring of STAGES buffers;
// STAGES - 1 stages are in flight while one is computed (one __syncthreads per stage). A
// shared-memory row of BK bf16 is BK / 8 16-byte chunks; chunk c of row r is stored at
// chunk c ^ ((r * (BK / 8) / 8) % (BK / 8)), the XOR swizzle under which the 8 row addresses
// of one ldmatrix phase (8 consecutive rows, same logical chunk) fall in 8 distinct 16-byte
// bank groups: no bank conflicts for ldmatrix nor for the cp.async stores. Each warp loads
// its A fragments with ldmatrix.x4 (16 rows x 16 k) and its B fragments with ldmatrix.x4 /
// .x2 (W is n-major, so the non-transposed form yields the col-major B operand directly) and
// issues mma.sync.m16n8k16 (BF16 in, FP32 accumulate). The 16x16 tile is for m <= 16
// (decode): its many small CTAs (n / 16, e.g. 8016 for a 128256-row lm_head) stream W at
// HBM speed with 11 stages x 2 KiB of W in flight per CTA, several CTAs per SM.
//
// Edges without branches in the hot loop: rows of X beyond m and rows of W beyond n are
// never loaded; the ldmatrix lanes that would read them read the last valid row instead
// (clamped), so the dead outputs are copies that are never stored. K beyond k is zero-filled
// (cp.async src-size 0) in both operands. Vector path: k % 8 == 0 and x, w 16-byte aligned.
// Otherwise a scalar path fills the same shared-memory layout with guarded 2-byte loads and
// 16-byte shared stores (synchronous, same ring and barriers), so its arithmetic is
// identical.
//
// BATCH INVARIANCE (the property the model relies on): every output element y[i, j] is the
// FP32 accumulator of exactly ceil(k / 16) mma.sync.m16n8k16 steps, s = 0, 1, 2, ... in
// ascending order, starting from +0.0f, step s adding the products of x[i, 16s .. 16s + 15]
// and w[j, 16s .. 16s + 15] (zeros past k). A k16 step entirely past k is skipped, never
// issued as an all-zero MMA, so a tile's BK does not change the number of steps. mma.sync
// computes each D element from its own A row, B column and C element only: the value does
// not depend on the other rows or columns of the fragment, on the lane holding it, on the
// warp or CTA, or on the tile configuration. There is no split-K and no cross-warp or
// cross-CTA reduction. Hence y[i, j] is a function of (x[i, :], w[j, :], k) alone: the same
// bits whether row i is launched alone, inside any m, at any row offset, with any of the
// three tiles. The BF16 output is the RNE rounding of that same FP32 value, so the FP32 and
// BF16 variants agree too. (The CUDA-core GEMV of kernels/gemv.cu sums in another order:
// the model must not mix it with this kernel for rows whose bits must agree.)
//
// DECODE ENTRIES WITH FUSED NEIGHBOURS (16x16 tile, grid (ceil(m / 16), ceil(n / 16)),
// 64 threads; any m, n, k >= 1): each takes over the work of a separate launch, with the
// same bits as the separate kernels, because X reaches the MMAs with the exact values those
// kernels would have stored (gemm_tc_tile.cuh, XF / RES):
//   gemm_tc_bf16_16x16_rmsnorm(y, x, w, norm_weight, bias, m, n, k, eps)
//       Y = rmsnorm(X; norm_weight, eps) @ W^T     x: the residual stream [m, k]
//       (+ bias [n] unless NULL: bf16(bf16(acc) + bias), add_bias's formula)
//       (7 stages: the aux ring of norm-weight chunks shares the 48 KiB)
//   gemm_tc_bf16_16x16_actmul_res(y, x, w, m, n, k, act)
//       Y = bf16(Y + bf16(act_mul(X) @ W^T))       x: gate|up [m, 2k], y: the residual [m, n]
//       (7 stages, the aux ring holds the up chunks)
//   gemm_tc_bf16_16x16_res(y, x, w, m, n, k)
//       Y = bf16(Y + bf16(X @ W^T))                y: the residual [m, n] (12 stages)
// y must not overlap x. The residual add is the one rmsnorm.cu does (bf16 of the float sum of
// two BF16 values), so a decode step that runs these instead of rmsnorm / act_mul launches
// gives every row the bits of the unfused sequence (ops/gemm_fused.py, tests/ops/
// test_gemm_fused.py compare them bit for bit on the emulator).
//
// The tile itself is kernels/gemm_tc_tile.cuh (shared with the dequantizing GEMM of
// kernels/gemm_q.cu); here W is read by its BF16Rows policy.
#include "gemm_tc_tile.cuh"

typedef TcTile<16, 16, 64, 1, 2, 12> Tile16x16;
typedef TcTile<64, 32, 64, 2, 2, 4> Tile64x32;
typedef TcTile<128, 128, 32, 2, 4, 3> Tile128x128;

#define GEMM_TC_SMEM(TILE)                                                                    \
    __shared__ __align__(128) bf16 sa[TILE::STAGES * TILE::BM * TILE::BK];                    \
    __shared__ __align__(128) bf16 sb[TILE::STAGES * TILE::BN * TILE::BK]

#define GEMM_TC_ENTRY(NAME, TILE, MIN_BLOCKS)                                                 \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        gemm_tc_bf16_##NAME(bf16 *y, const bf16 *x, const bf16 *w, int m, int n, int k) {     \
        GEMM_TC_SMEM(TILE);                                                                   \
        BF16Rows<TILE> src{w};                                                                \
        gemm_tc_tile<TILE>(sa, sb, nullptr, y, nullptr, x, src, m, n, k, n);                  \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        gemm_tc_fp32_##NAME(float *y, const bf16 *x, const bf16 *w, int m, int n, int k) {    \
        GEMM_TC_SMEM(TILE);                                                                   \
        BF16Rows<TILE> src{w};                                                                \
        gemm_tc_tile<TILE>(sa, sb, nullptr, nullptr, y, x, src, m, n, k, n);                  \
    }

GEMM_TC_ENTRY(16x16, Tile16x16, 1)
GEMM_TC_ENTRY(64x32, Tile64x32, 1)
GEMM_TC_ENTRY(128x128, Tile128x128, 2)

typedef TcTile<16, 16, 64, 1, 2, 7> Tile16x16Fused;   // + an aux ring of the same size

#define GEMM_TC_FUSED_SMEM                                                                    \
    GEMM_TC_SMEM(Tile16x16Fused);                                                             \
    __shared__ __align__(128) bf16 saux[Tile16x16Fused::STAGES * 16 * 64];                    \
    __shared__ float sinv[16]

extern "C" __global__ void __launch_bounds__(Tile16x16Fused::THREADS, 1)
gemm_tc_bf16_16x16_rmsnorm(bf16 *y, const bf16 *x, const bf16 *w, const bf16 *norm_weight,
                           const bf16 *bias, int m, int n, int k, float eps) {
    GEMM_TC_FUSED_SMEM;
    BF16Rows<Tile16x16Fused> src{w};
    gemm_tc_tile<Tile16x16Fused, BF16Rows<Tile16x16Fused>, XF_RMSNORM, false>(
        sa, sb, nullptr, y, nullptr, x, src, m, n, k, n,
        XFuse{norm_weight, eps, 0, saux, sinv, bias});
}

extern "C" __global__ void __launch_bounds__(Tile16x16Fused::THREADS, 1)
gemm_tc_bf16_16x16_actmul_res(bf16 *y, const bf16 *x, const bf16 *w, int m, int n, int k,
                              int act) {
    GEMM_TC_FUSED_SMEM;
    BF16Rows<Tile16x16Fused> src{w};
    gemm_tc_tile<Tile16x16Fused, BF16Rows<Tile16x16Fused>, XF_ACTMUL, true>(
        sa, sb, nullptr, y, nullptr, x, src, m, n, k, n,
        XFuse{nullptr, 0.f, act, saux, sinv, nullptr});
}

extern "C" __global__ void __launch_bounds__(Tile16x16::THREADS, 1)
gemm_tc_bf16_16x16_res(bf16 *y, const bf16 *x, const bf16 *w, int m, int n, int k) {
    GEMM_TC_SMEM(Tile16x16);
    BF16Rows<Tile16x16> src{w};
    gemm_tc_tile<Tile16x16, BF16Rows<Tile16x16>, XF_NONE, true>(sa, sb, nullptr, y, nullptr, x,
                                                                src, m, n, k, n);
}
