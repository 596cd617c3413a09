// Batch-invariant tensor-core GEMM over GGUF weights kept at their bytes, dequantized in the
// tile: the 32-element block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL (the 256-element
// K-quants and IQ4_XS are kernels/gemm_gguf_k.cu, the same machinery: gemm_gguf.cuh).
//
//   y[i, j] = sum_k x[i, k] * w[j, k],   w[j, k] = dequant_bf16(W)[j, k]
//
// the GEMM of kernels/gemm_tc.cu on ops/gguf_planes.py's dequantized BF16 weights, bit for
// bit: w = bf16_rn(s * c) or bf16_rn(s * c + mn) per gguf_format.cuh (the formula, and why
// the kernel's FP32 arithmetic gives exactly the twin's bits, FMA and FTZ included). The
// MMAs see BF16 W values in gemm_tc's layout and k order, so y[i, j] depends on (x[i, :], W's
// row j, k) alone, whatever m, row offset or tile (gemm_tc.cu's batch-invariance argument).
//
// Shapes and layout (ops/gguf_planes.py; the launcher ops/gemm_gguf.py checks all of it):
//   x     bf16 [m, k], k % 32 == 0
//   q     uint8 [n, q_row]   codes in k order, LOW bits each (4; Q8_0 8), q_row = k * LOW / 8
//                            rounded up to 16; 16-byte aligned
//   qh    uint8 [n, k / 8]   Q5_0 / Q5_1's fifth bits (bit e % 8 of byte e / 8); 4-byte
//                            aligned; NULL for the others
//   meta  uint8 [n, k / 32 * META]  each block's d (f16; Q4_1 / Q5_1: d, m), META 2 or 4;
//                            META-byte aligned
//   y     bf16 (gemm_gguf_*_bf16_*) or float32 (gemm_gguf_*_fp32_*) [m, ldy], ldy >= n: the
//         first n columns of each row written, the rest untouched
// Entry points gemm_gguf_{q4_0,q4_1,q5_0,q5_1,q8_0,iq4_nl}_{bf16,fp32}_{16x16,64x32,128x128}
// (y, x, q, qh, meta, m, n, k, ldy); ops/gemm_tc.py's pick_tile chooses the tile, for speed
// only. Launch: block = warps * 32 threads, grid (ceil(m / BM), ceil(n / BN)), no dynamic
// shared memory; ceil(n / BN) <= 65535.
//   tile      BM x BN   BK  warps  stages (4-bit / Q5_* / Q8_0)  static smem (KiB)
//   16x16     16 x 16   64  1      18 / 17 / 15                 45.2 / 44.9 / 45.2
//   64x32     64 x 32   64  2 x 2  4                            40 / 41 / 44
//   128x128  128 x 128  32  2 x 4  3                            38 / 39.5 / 44
// The 16x16 tile is the decode GEMV (gemm_q_decode.cuh with GgufFormat: one warp, W
// dequantized into the MMA's A' registers): n / 16 CTAs, each streaming 16 rows of packed W
// and their qh bits through a ring of 16-byte (q) and 4-byte (qh) cp.async copies, 14-17
// stages in flight; per stage each lane unpacks one of the 16 rows x 2 blocks' scales into a
// shared table the lanes then read. The 64x32 and 128x128 tiles are gemm_tc_tile.cuh's with
// GgufRows: a raw ring of the stage's q and qh bytes, each thread dequantizing one
// 16-element run of a row (its block's scale read once for the 16) into the BF16 stage the
// MMAs read. Scales come by __ldg at the block's alignment, their L1 line prefetched when
// the stage's copies are issued. Restrictions: k % 32 == 0; the plane alignments above (the
// launcher refuses others).
#include "gemm_gguf.cuh"

GEMM_GGUF_ENTRIES(q4_0, GGML_Q4_0)
GEMM_GGUF_ENTRIES(q4_1, GGML_Q4_1)
GEMM_GGUF_ENTRIES(q5_0, GGML_Q5_0)
GEMM_GGUF_ENTRIES(q5_1, GGML_Q5_1)
GEMM_GGUF_ENTRIES(q8_0, GGML_Q8_0)
GEMM_GGUF_ENTRIES(iq4_nl, GGML_IQ4_NL)
