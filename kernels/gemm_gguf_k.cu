// Batch-invariant tensor-core GEMM over GGUF weights kept at their bytes, dequantized in the
// tile: the 256-element block types Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS (the 32-element
// types are kernels/gemm_gguf.cu, the same machinery: gemm_gguf.cuh).
//
//   y[i, j] = sum_k x[i, k] * w[j, k],   w[j, k] = dequant_bf16(W)[j, k]
//
// the GEMM of kernels/gemm_tc.cu on ops/gguf_planes.py's dequantized BF16 weights, bit for
// bit: w = bf16_rn(s * c) or bf16_rn(s * c + mn) per gguf_format.cuh, s and mn the element's
// sub-block scales (16 or 32 elements: ggml's 6-bit packed scales of Q3_K / Q4_K / Q5_K, the
// int8 scales of Q6_K, IQ4_XS's split 6-bit scales) times the block's d / dmin. The MMAs see
// BF16 W values in gemm_tc's layout and k order: gemm_tc.cu's batch-invariance argument.
//
// Shapes and layout (ops/gguf_planes.py; the launcher ops/gemm_gguf.py checks all of it):
//   x     bf16 [m, k], k % 256 == 0
//   q     uint8 [n, k * LOW / 8]  codes in k order, LOW bits each (Q2_K, Q3_K 2; else 4);
//                                 16-byte aligned
//   qh    uint8 [n, k * HIGH / 8] high bits (Q3_K, Q5_K 1; Q6_K 2); 16-byte aligned; NULL
//                                 for Q2_K, Q4_K, IQ4_XS
//   meta  uint8 [n, k / 256 * META]  each block's scale fields as stored: Q2_K scales[16], d,
//                                 dmin (20 B, 4-aligned) | Q3_K scales[12], d (14 B, 2) |
//                                 Q4_K / Q5_K d, dmin, scales[12] (16 B, 16) | Q6_K
//                                 scales[16], d (18 B, 2) | IQ4_XS d, scales_h, scales_l[4]
//                                 (8 B, 8): the base aligned so
//   y     bf16 or float32 [m, ldy], ldy >= n: the first n columns of each row written
// Entry points gemm_gguf_{q2_k,q3_k,q4_k,q5_k,q6_k,iq4_xs}_{bf16,fp32}_{16x16,64x32,128x128}
// (y, x, q, qh, meta, m, n, k, ldy); ops/gemm_tc.py's pick_tile chooses the tile, for speed
// only. Launch: block = warps * 32 threads, grid (ceil(m / BM), ceil(n / BN)), no dynamic
// shared memory; ceil(n / BN) <= 65535.
//   tile      BM x BN   BK  warps  stages (Q2_K / Q3_K / Q4_K, IQ4_XS / Q5_K / Q6_K)
//   16x16     16 x 16   64  1      20 / 18 / 18 / 17 / 16
//   64x32     64 x 32   64  2 x 2  4
//   128x128  128 x 128  32  2 x 4  3
//   static smem (KiB, same order): 16x16 45.5 / 43.2 / 45.2 / 44.9 / 44.5; 64x32 38 / 39 /
//   40 / 41 / 42; 128x128 35 / 36.5 / 38 / 39.5 / 41
// The 16x16 tile is the decode GEMV (gemm_q_decode.cuh with GgufFormat: one warp, W
// dequantized into the MMA's A' registers): n / 16 CTAs streaming 16 rows of packed W, q by
// 16-byte and qh by 8- or 16-byte cp.async, 15-19 stages in flight; per stage the 16 rows'
// 2 or 4 sub-block scales of its 64 positions are unpacked once each (one lane an entry)
// into a shared table the lanes read. The 64x32 and 128x128 tiles are gemm_tc_tile.cuh's
// with GgufRows: a raw ring of the stage's q and qh bytes, each thread dequantizing one
// 16-element run of a row (its sub-block's 6-bit scales unpacked once for the 16) into the
// BF16 stage the MMAs read. Meta by __ldg (Q4_K / Q5_K: one 128-bit load per block), its L1
// line prefetched when the stage's copies are issued. Restrictions: k % 256 == 0; the plane
// alignments above (the launcher refuses others).
#include "gemm_gguf.cuh"

GEMM_GGUF_ENTRIES(q2_k, GGML_Q2_K)
GEMM_GGUF_ENTRIES(q3_k, GGML_Q3_K)
GEMM_GGUF_ENTRIES(q4_k, GGML_Q4_K)
GEMM_GGUF_ENTRIES(q5_k, GGML_Q5_K)
GEMM_GGUF_ENTRIES(q6_k, GGML_Q6_K)
GEMM_GGUF_ENTRIES(iq4_xs, GGML_IQ4_XS)
