// Batch-invariant tensor-core GEMM over quantized weights, dequantized in the tile load:
//
//   y[i, j] = sum_k x[i, k] * w[j, k],   w[j, k] = dequant(W)[j, k] as BF16
//
// the GEMM of kernels/gemm_tc.cu on the dequantized weights, bit for bit: the packed bytes
// of a stage are copied global -> shared with 16-byte cp.async (.cg) in a ring of STAGES
// stages (STAGES - 1 in flight, as gemm_tc.cu's W), then each thread dequantizes its
// 16-byte chunks of the stage into one BF16 buffer of gemm_tc.cu's swizzled layout, a
// __syncthreads, and the same ldmatrix / mma.sync.m16n8k16 steps in the same k order
// (kernels/gemm_tc_tile.cuh). So every argument of gemm_tc.cu's header carries over: y[i, j]
// depends on (x[i, :], W's row j, k) alone, whatever m, row offset or tile.
//
// Dequantization (one rounding to BF16 of an FP32 value; the twins in metrale/ops/gemm_q.py):
//   gemm_q4   w = bf16_rn(f32(q - z) * s): q the 4-bit code, z its group's zero point
//             (uint8), s its group's scale (FP16 bits, widened exactly). (q - z) * s is exact
//             in FP32 (5 x 11 significant bits), so the only rounding is the BF16 one.
//             Device layout (metrale/formats/quant_int4.py repacks GPTQ and AWQ into it):
//               q       uint32 [n, kp / 8], kp = k rounded up to 32: word w of row j holds
//                       k = 8w .. 8w + 7, code of k = 8w + e at bits 4e .. 4e + 3
//               scales  uint16 (FP16 bits) [n, groups]     zeros  uint8 [n, groups]
//               group of (j, k): gidx[gidx_row[j], k] (act-order: int32 tables [parts,
//                       k], one per fused part, gidx_row int32 [n]) or, when gidx is NULL,
//                       k / group_size (group_size % 8 == 0)
//             Restrictions: k % 8 == 0; q 16-byte aligned.
//   gemm_fp8  w = bf16_rn(f32(e4m3(q)) * s): the float8_e4m3fn code widened exactly (via
//             FP16: cvt.rn.f16x2.e4m3x2 on sm_89+), times its block's FP32 scale, rounded to
//             FP32 and then to BF16 (HF's dequantization to BF16). Device layout:
//               q          uint8 [n, kp], kp = k rounded up to 32
//               scales     float32 [scale rows, k_blocks]; the scale of (j, k) is
//                          scales[scale_row[j], k / block_k] (block_k % 8 == 0)
//               scale_row  int32 [n]: a row's scale row (fused q/k/v parts each keep their
//                          own grid of 128-row blocks; per-channel and per-tensor scales
//                          are grids too)
//             Restrictions: q 16-byte aligned; every product e4m3(q) * s a normal FP32
//             number, zero or NaN (the loader refuses scales below 2^-117), so that FTZ
//             (--use_fast_math) cannot change it, nor the CPU twin's.
//   Positions past k dequantize to +0 (the BF16 GEMM's zero fill), whatever the padding
//   codes hold.
//
// Shapes: x bf16 [m, k], y bf16 [m, n] (gemm_*_bf16_*) or float32 [m, n] (gemm_*_fp32_*).
// Tiles (one entry point per format, output type and tile; metrale/ops/gemm_tc.py's
// pick_tile chooses, for speed only):
//   tile      BM x BN   BK  warps  stages (q4 / fp8)  static smem (q4 / fp8)
//   16x16     16 x 16   64  1         18 / 15           45 / 45 KiB
//   64x32     64 x 32   64  2 x 2      4 / 4            40 / 44 KiB
//   128x128  128 x 128  32  2 x 4      3 / 3            38 / 44 KiB
// Launch: block = warps * 32 threads, grid (ceil(m / BM), ceil(n / BN)), no dynamic shared
// memory; ceil(n / BN) <= 65535. The 16x16 tile is the decode GEMV (kernels/
// gemm_q_decode.cuh: one warp, W dequantized into the MMA's registers, not through shared
// memory): n / 16 CTAs, each streaming 16 rows of packed W with 17 (14) stages of 512 B
// (1 KiB) in flight. The 64x32 and 128x128 tiles are gemm_tc_tile.cuh's with QuantRows.
#include <cuda_fp16.h>
#include "gemm_q_formats.cuh"
#include "gemm_q_decode.cuh"
#include "gemm_q_rows.cuh"
#include "gemm_tc_tile.cuh"

typedef TcTile<64, 32, 64, 2, 2, 4> Q4Tile64x32;
typedef TcTile<128, 128, 32, 2, 4, 3> Q4Tile128x128;
typedef TcTile<64, 32, 64, 2, 2, 4> F8Tile64x32;
typedef TcTile<128, 128, 32, 2, 4, 3> F8Tile128x128;

#define GEMM_Q_SMEM(TILE, SRC)                                                                \
    __shared__ __align__(128) bf16 sa[TILE::STAGES * TILE::BM * TILE::BK];                    \
    __shared__ __align__(128) unsigned char sw[TILE::STAGES * SRC::STAGE_ELEMS];              \
    __shared__ __align__(128) bf16 sd[TILE::BN * TILE::BK]

#define GEMM_Q4_ENTRY(OUT, YT, YB, YF, NAME, TILE, MIN_BLOCKS)                                \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        gemm_q4_##OUT##_##NAME(YT *y, const bf16 *x, const unsigned int *q,                    \
                               const unsigned short *scales, const unsigned char *zeros,       \
                               const int *gidx, const int *gidx_row, int m, int n, int k,    \
                               int groups, int group_size) {                                  \
        typedef QuantRows<TILE, Int4Format> Src;                                              \
        GEMM_Q_SMEM(TILE, Src);                                                               \
        Src src;                                                                              \
        src.f = Int4Format{q, scales, zeros, gidx, gidx_row, groups, group_size,             \
                           ((k + 31) / 32) * 16, k};                                          \
        gemm_tc_tile<TILE>(sa, sw, sd, YB, YF, x, src, m, n, k, n);                           \
    }

#define GEMM_F8_ENTRY(OUT, YT, YB, YF, NAME, TILE, MIN_BLOCKS)                                \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        gemm_fp8_##OUT##_##NAME(YT *y, const bf16 *x, const unsigned char *q,                  \
                                const float *scales, const int *scale_row, int m, int n,      \
                                int k, int k_blocks, int block_k) {                           \
        typedef QuantRows<TILE, Fp8Format> Src;                                               \
        GEMM_Q_SMEM(TILE, Src);                                                               \
        Src src;                                                                              \
        src.f = Fp8Format{q, scales, scale_row, k_blocks, block_k, ((k + 31) / 32) * 32};    \
        gemm_tc_tile<TILE>(sa, sw, sd, YB, YF, x, src, m, n, k, n);                           \
    }

#define GEMM_Q_ENTRIES(NAME, MIN_BLOCKS)                                                      \
    GEMM_Q4_ENTRY(bf16, bf16, y, nullptr, NAME, Q4Tile##NAME, MIN_BLOCKS)                      \
    GEMM_Q4_ENTRY(fp32, float, nullptr, y, NAME, Q4Tile##NAME, MIN_BLOCKS)                     \
    GEMM_F8_ENTRY(bf16, bf16, y, nullptr, NAME, F8Tile##NAME, MIN_BLOCKS)                      \
    GEMM_F8_ENTRY(fp32, float, nullptr, y, NAME, F8Tile##NAME, MIN_BLOCKS)

GEMM_Q_ENTRIES(64x32, 1)
GEMM_Q_ENTRIES(128x128, 2)

// The 16x16 entries: gemm_q_decode.cuh's one-warp tile (same arguments as the others),
// and the decode entries with fused neighbours (gemm_tc.cu's DECODE ENTRIES WITH FUSED
// NEIGHBOURS, on quantized W; ops/gemm_fused.py), BF16 out:
//   gemm_{q4,fp8}_bf16_16x16_rmsnorm(y, x, <W>, norm_weight, bias, m, n, k, <W scalars>, eps)
//   gemm_{q4,fp8}_bf16_16x16_actmul_res(y, x, <W>, m, n, k, <W scalars>, act)
//   gemm_{q4,fp8}_bf16_16x16_res(y, x, <W>, m, n, k, <W scalars>)
// (the aux ring of norm-weight / up chunks takes shared memory from the stages)
// Per format FMT (q4, fp8): FMT_F its format type, FMT_W_PARAMS / FMT_W_SCALARS W's
// parameters, FMT_FORMAT the format object, FMT_STAGES / FMT_FUSED_STAGES the rings.
#define q4_F Int4Format
#define q4_STAGES 18          // x 2 KiB + W 512 B a stage: 45 KiB
#define q4_FUSED_STAGES 10    // x + aux 4 KiB + W 512 B a stage: 45 KiB
#define q4_W_PARAMS                                                                           \
    const unsigned int *q, const unsigned short *scales, const unsigned char *zeros,          \
        const int *gidx, const int *gidx_row
#define q4_W_SCALARS int groups, int group_size
#define q4_FORMAT                                                                             \
    Int4Format { q, scales, zeros, gidx, gidx_row, groups, group_size, ((k + 31) / 32) * 16, k }
#define fp8_F Fp8Format
#define fp8_STAGES 15         // x 2 KiB + W 1 KiB a stage: 45 KiB
#define fp8_FUSED_STAGES 9    // x + aux 4 KiB + W 1 KiB a stage: 45 KiB
#define fp8_W_PARAMS const unsigned char *q, const float *scales, const int *scale_row
#define fp8_W_SCALARS int k_blocks, int block_k
#define fp8_FORMAT Fp8Format { q, scales, scale_row, k_blocks, block_k, ((k + 31) / 32) * 32 }

#define GEMM_Q_DECODE_SMEM(F, STAGES)                                                         \
    __shared__ __align__(128) bf16 sx[STAGES * 16 * 64];                                      \
    __shared__ __align__(128) unsigned char sw[STAGES * 16 * 64 * F::BITS / 8]
#define GEMM_Q_FUSED_SMEM(F, STAGES)                                                          \
    GEMM_Q_DECODE_SMEM(F, STAGES);                                                            \
    __shared__ __align__(128) bf16 saux[STAGES * 16 * 64];                                    \
    __shared__ float sinv[16]

#define GEMM_Q_DECODE_ENTRY(FMT, OUT, YT, YB, YF)                                             \
    extern "C" __global__ void __launch_bounds__(32, 4) gemm_##FMT##_##OUT##_16x16(           \
        YT *y, const bf16 *x, FMT##_W_PARAMS, int m, int n, int k, FMT##_W_SCALARS) {         \
        GEMM_Q_DECODE_SMEM(FMT##_F, FMT##_STAGES);                                            \
        const FMT##_F f = FMT##_FORMAT;                                                       \
        gemm_q_decode<FMT##_F, FMT##_STAGES>(sx, sw, YB, YF, x, f, m, n, k, n);               \
    }

#define GEMM_Q_DECODE_ENTRIES(FMT)                                                            \
    GEMM_Q_DECODE_ENTRY(FMT, bf16, bf16, y, nullptr)                                          \
    GEMM_Q_DECODE_ENTRY(FMT, fp32, float, nullptr, y)                                         \
    extern "C" __global__ void __launch_bounds__(32, 4) gemm_##FMT##_bf16_16x16_rmsnorm(      \
        bf16 *y, const bf16 *x, FMT##_W_PARAMS, const bf16 *norm_weight, const bf16 *bias,   \
        int m, int n, int k, FMT##_W_SCALARS, float eps) {                                    \
        GEMM_Q_FUSED_SMEM(FMT##_F, FMT##_FUSED_STAGES);                                       \
        const FMT##_F f = FMT##_FORMAT;                                                       \
        const XFuse xf{norm_weight, eps, 0, saux, sinv, bias};                                \
        gemm_q_decode<FMT##_F, FMT##_FUSED_STAGES, XF_RMSNORM>(sx, sw, y, nullptr, x, f, m,   \
                                                               n, k, n, xf);                  \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(32, 4) gemm_##FMT##_bf16_16x16_actmul_res(  \
        bf16 *y, const bf16 *x, FMT##_W_PARAMS, int m, int n, int k, FMT##_W_SCALARS,        \
        int act) {                                                                            \
        GEMM_Q_FUSED_SMEM(FMT##_F, FMT##_FUSED_STAGES);                                       \
        const FMT##_F f = FMT##_FORMAT;                                                       \
        const XFuse xf{nullptr, 0.f, act, saux, sinv, nullptr};                               \
        gemm_q_decode<FMT##_F, FMT##_FUSED_STAGES, XF_ACTMUL, true>(sx, sw, y, nullptr, x, f, \
                                                                    m, n, k, n, xf);          \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(32, 4) gemm_##FMT##_bf16_16x16_res(         \
        bf16 *y, const bf16 *x, FMT##_W_PARAMS, int m, int n, int k, FMT##_W_SCALARS) {       \
        GEMM_Q_DECODE_SMEM(FMT##_F, FMT##_STAGES);                                            \
        const FMT##_F f = FMT##_FORMAT;                                                       \
        gemm_q_decode<FMT##_F, FMT##_STAGES, XF_NONE, true>(sx, sw, y, nullptr, x, f, m, n,   \
                                                            k, n);                            \
    }

GEMM_Q_DECODE_ENTRIES(q4)
GEMM_Q_DECODE_ENTRIES(fp8)
