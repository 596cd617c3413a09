// QuantRows: the quantized W operand of gemm_tc_tile.cuh's CTA tile (gemm_q.cu's 4-bit and
// FP8 formats, moe_gemm.cu's MXFP4 experts): a raw ring of packed bytes per stage, which the
// CTA dequantizes into one BF16 stage buffer of the compute layout (W::kDequant). A format
// F provides BITS, row_bytes, row_bytes_at(j), row(j) and dequant8(raw, row, k0, k) (eight
// values k0 .. k0 + 7 of row j as four BF16 pairs). Header only.
#pragma once
#include "gemm_tc_tile.cuh"

// The quantized W operand of gemm_tc_tile: raw ring of packed bytes, dequantized per stage.
template <class T, class F>
struct QuantRows {
    static constexpr bool kDequant = true;
    static constexpr int RB = T::BK * F::BITS / 8;       // packed bytes of a row per stage
    static constexpr int RCH = RB / 16;                    // 16-byte chunks of them
    static constexpr int STAGE_ELEMS = T::BN * RB;
    static constexpr int RAW_PER_THREAD = (T::BN * RCH + T::THREADS - 1) / T::THREADS;
    static constexpr int DQ_PER_THREAD = T::BN * T::CH / T::THREADS;
    static constexpr int BYTES8 = 8 * F::BITS / 8;         // packed bytes of 8 values
    static_assert(RB % 16 == 0, "a stage row is whole 16-byte chunks");
    typedef unsigned char Ring;
    F f;
    const unsigned char *src[RAW_PER_THREAD];
    int raw_off[RAW_PER_THREAD];   // -1: no chunk (past the tile's rows or the chunk count)
    int col0, cols;                // the dequantized chunks' rows are recomputed from the
                                   // thread index (registers: the 128x128 tile spilled)

    __device__ __forceinline__ bool aligned() const { return true; }  // the launcher checks q
    __device__ __forceinline__ void setup(int tid, int col0_, int cols_, int) {
        col0 = col0_;
        cols = cols_;
#pragma unroll
        for (int i = 0; i < RAW_PER_THREAD; ++i) {
            const int c = tid + i * T::THREADS, r = c / RCH;
            const bool in = c < T::BN * RCH && r < cols;
            raw_off[i] = in ? r * RB + 16 * (c % RCH) : -1;
            src[i] = f.row_bytes_at(col0 + (in ? r : 0)) + 16 * (c % RCH);
        }
    }
    // Stage kt's packed bytes of this thread's chunks; past the (padded) row: zero-filled.
    __device__ __forceinline__ void load(unsigned char *slot, int kt, int, bool) {
#pragma unroll
        for (int i = 0; i < RAW_PER_THREAD; ++i) {
            if (raw_off[i] < 0) continue;
            const int b0 = kt * RB + (raw_off[i] % RB);
            const bool in = b0 < f.row_bytes;
            cp_async_16(slot + raw_off[i], in ? src[i] + kt * RB : src[i], in ? 16 : 0);
        }
    }
    __device__ __forceinline__ void dequant(bf16 *sd, const unsigned char *slot, int kt, int k) {
#pragma unroll
        for (int i = 0; i < DQ_PER_THREAD; ++i) {
            const int c = threadIdx.x + i * T::THREADS, r = c / T::CH, ch = c % T::CH;
            if (r >= cols) continue;   // rows past n are never read (clamped)
            const int k0 = kt * T::BK + 8 * ch;
            const uint4 v = k0 < k ? f.dequant8(slot + r * RB + BYTES8 * ch, f.row(col0 + r),
                                                k0, k)
                                   : make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4 *>(sd + smem_off<T>(r, ch)) = v;
        }
    }
};
