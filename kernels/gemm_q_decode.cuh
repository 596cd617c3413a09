// The decode tile of kernels/gemm_q.cu (its 16x16 entries): one warp computes Y for 16 X
// rows and 16 W rows, with the MMA's operands swapped and W dequantized straight into
// registers, so the dequantized BF16 W never goes through shared memory.
//
//   D'[j][i] = sum_k W[j, k] X[i, k]     (A' = 16 W rows, m16; B' = X^T, n8 per 8 X rows)
//
// Why: a decode GEMV reads each weight once, and the general tile (gemm_tc_tile.cuh with
// QuantRows) pays per weight a 16-byte shared store of the dequantized BF16 stage and an
// ldmatrix of it, and per k16 step two ldmatrix.x4 of X (one per warp): by the emulator's
// counters (check-kernels --profile) 20 shared-memory wavefronts per 256 FP8 weights, more
// than the 14 SM clocks their 256 bytes take from HBM on an H200. Here the packed bytes land
// by cp.async and each lane reads its A' fragment's codes from them (FP8: two 32-bit loads a
// row, conflict-free under the swizzle below; 4-bit: one 64-bit load a row) and X^T comes
// from one ldmatrix.x2 (.x4 for 9-16 X rows): 6 (4-bit: 4) wavefronts per 256 weights.
//
// Bits: an A' register holds W[j][2t, 2t + 1] (or + 8) of k16 step s, exactly the values
// QuantRows' dequant8 writes for those positions (F::frag: the same formula, the same
// zeroing past k), and B' the X values gemm_tc_tile's X ring holds (fill_chunk, zeros past
// k). mma.sync computes every D element from its own row and column (products of BF16 values
// are exact, so which operand holds W does not matter), the k16 steps run in ascending order
// from +0.0f and a step wholly past k is skipped: y[i, j] is the same function of (x[i, :],
// W's row j, k) as in every other tile (gemm_tc.cu's batch-invariance argument).
//
// Fused neighbours (XF, RES: gemm_tc_tile.cuh's meaning, the gemm_q *_16x16_rmsnorm /
// _actmul_res / _res entries): each lane rewrites the X chunks it copied itself right after
// its cp.async wait (the RMSNorm factor of the row from norm_row.cuh's warp order, or
// act(gate) * up), before the __syncwarp that publishes the stage, and the epilogue adds the
// bias / residual, so the fused rows have the bits of the separate kernels.
//
// Launch: 32 threads (one warp), grid (ceil(m / 16), ceil(n / 16)), no dynamic shared
// memory. A warp waits for its own cp.async groups and orders its lanes with __syncwarp: no
// __syncthreads. Shared memory per stage: X ring 16 x 64 BF16 (2 KiB, gemm_tc's swizzled
// layout) + W 16 rows x RB bytes (RB = 64 for FP8 and 8-bit codes, 32 for 4-bit, 16 for
// 2-bit); an 8-bit row's 16-byte chunk c is stored at chunk c ^ ((r / 2) % 4), so the 8 rows
// of one 32-bit load fall in 8 distinct bank groups. Formats with a high-bit plane (GGUF's
// qh: gemm_gguf.cuh) add 16 rows x HI_BYTES bytes after the W rows of a stage, copied by
// cp.async of HI_UNIT bytes with the stage (a quarter of Q6_K's bytes: read per stage with
// __ldg it would put a global load's latency on every stage).
// Y rows are `ldy` elements apart (>= n; the columns past n are never written).
#pragma once
#include "gemm_tc_tile.cuh"

// Whether F has the high-bit plane interface (HI_BYTES, HI_UNIT, hi_row_bytes,
// hi_row_at(j), prefetch(j, kt), fill_scales(lane, col0, cols, kt) -- the stage's scale
// table in shared memory, each entry unpacked by one lane, which scale() then reads -- and
// frag with the stage's high-bit row): gemm_gguf.cuh's GgufFormat. gemm_q.cu's formats have
// none.
template <class F, class = void>
struct DecodeHi {
    static constexpr bool ext = false;
    static constexpr int BYTES = 0;
};
template <class F>
struct DecodeHi<F, decltype(void(F::HI_BYTES))> {
    static constexpr bool ext = true;
    static constexpr int BYTES = F::HI_BYTES;
};

// F (gemm_q.cu's Int4Format / Fp8Format, gemm_gguf.cuh's GgufFormat) provides BITS,
// row_bytes, row_bytes_at(j), swz(r, ch), a per-row Row (row(j)) with scale(kt) for the
// stage's scales, and frag(...) that dequantizes one row's two A' registers of a k16 step.
// sx: [STAGES][16 * 64] bf16, sw: [STAGES][16 * (RB + HI_BYTES)] bytes, and with XF !=
// XF_NONE xf.aux [STAGES][16 * 64] bf16 and xf.inv [16] floats, all shared.
template <class F, int STAGES, int XF = XF_NONE, bool RES = false>
__device__ __forceinline__ void gemm_q_decode(bf16 *sx, unsigned char *sw, bf16 *yb,
                                              float *yf, const bf16 *x, const F &f, int m,
                                              int n, int k, int ldy,
                                              const XFuse &xf = XFuse{}) {
    typedef TcTile<16, 16, 64, 1, 1, STAGES> T;        // the X ring's layout (smem_off)
    constexpr int RB = 64 * F::BITS / 8, RCH = RB / 16;   // W bytes / chunks of a stage row
    constexpr int HB = DecodeHi<F>::BYTES;                // high-bit bytes of a stage row
    constexpr int SWS = 16 * (RB + HB);                   // W bytes of a stage
    static_assert(16 * RCH % 32 == 0 || 16 * RCH < 32, "whole W chunks per lane");
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * 16, rows = min(16, m - row0);
    const int col0 = blockIdx.y * 16, cols = min(16, n - col0);
    const long long lda = XF == XF_ACTMUL ? 2LL * k : (long long)k;   // x's row stride
    const bool vec = (k & 7) == 0 && aligned16(x) && (XF != XF_RMSNORM || aligned16(xf.norm_w));
    const int kt_count = (k + 63) / 64;
    const bf16 *xs = x + row0 * lda;

    auto load_stage = [&](int slot, int kt) {
        bf16 *xa = sx + slot * 16 * 64;
        for (int c = lane; c < rows * 8; c += 32) {   // X rows past m are not loaded
            const bf16 *xr = xs + (c >> 3) * lda;
            fill_chunk(xa + smem_off<T>(c >> 3, c & 7), xr, kt * 64 + 8 * (c & 7), k, vec);
            if constexpr (XF != XF_NONE)   // the norm weight, or the row's up half
                fill_chunk(xf.aux + slot * 16 * 64 + smem_off<T>(c >> 3, c & 7),
                           XF == XF_RMSNORM ? xf.norm_w : xr + k, kt * 64 + 8 * (c & 7), k, vec);
        }
        unsigned char *wa = sw + slot * SWS;
#pragma unroll
        for (int i = 0; i < (16 * RCH + 31) / 32; ++i) {
            const int c = lane + 32 * i, r = c / RCH, ch = c % RCH;
            if (r >= cols) continue;                     // W rows past n: never read (2-bit
                                                         // codes: lanes 16-31 have none)
            const int b0 = kt * RB + 16 * ch;
            const bool in = b0 < f.row_bytes;            // past the padded row: zero-filled
            const unsigned char *src = f.row_bytes_at(col0 + r);
            cp_async_16(wa + r * RB + 16 * F::swz(r, ch), in ? src + b0 : src, in ? 16 : 0);
        }
        if constexpr (DecodeHi<F>::ext) {
            if constexpr (HB > 0) {   // the high bits of the stage, HI_UNIT bytes a copy
                constexpr int U = F::HI_UNIT, UR = HB / U;   // copies per row
#pragma unroll
                for (int i = 0; i < (16 * UR + 31) / 32; ++i) {
                    const int c = lane + 32 * i, r = c / UR, u = c % UR;
                    if (r >= cols) continue;
                    const int b0 = kt * HB + U * u;
                    const bool in = b0 < f.hi_row_bytes;   // past the row: zero-filled
                    const unsigned char *src = f.hi_row_at(col0 + r) + U * u;
                    cp_async_n<U>(wa + 16 * RB + r * HB + U * u, in ? src + kt * HB : src,
                                  in ? U : 0);
                }
            }
            if (lane < cols) f.prefetch(col0 + lane, kt);   // the scales' L1 line
        }
    };

    // This lane's W rows (g, g + 8) and X ldmatrix row, clamped to the live ones: the dead
    // outputs they feed are never stored.
    const int wr[2] = {min(g, cols - 1), min(g + 8, cols - 1)};
    const typename F::Row frow[2] = {f.row(col0 + wr[0]), f.row(col0 + wr[1])};
    const int xrow = min((lane & 7) + 8 * (lane >> 4), rows - 1), xkh = (lane >> 3) & 1;
    const bool two = rows > 8;   // CTA-uniform: a second n8 tile of X rows 8-15

    // This lane's X chunks of stage kt (landed: its own copies) rewritten in place.
    auto fuse_stage = [&](int slot, int kt) {
        bf16 *xa = sx + slot * 16 * 64;
        const bf16 *aux = xf.aux + slot * 16 * 64;
        for (int c = lane; c < rows * 8; c += 32) {
            if (kt * 64 + 8 * (c & 7) >= k) continue;
            const int off = smem_off<T>(c >> 3, c & 7);
            float v[8], u[8];
            unpack8(*reinterpret_cast<const bf16x8 *>(xa + off), v);
            unpack8(*reinterpret_cast<const bf16x8 *>(aux + off), u);
            if constexpr (XF == XF_RMSNORM) {
                const float inv = xf.inv[c >> 3];
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = rms_scale(v[e], inv, u[e]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = gated_act_f(v[e], xf.act) * u[e];
            }
            *reinterpret_cast<bf16x8 *>(xa + off) = pack8(v);
        }
    };

    float acc[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[h][e] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < kt_count) load_stage(s, s);
        cp_async_commit();
    }
    if constexpr (XF == XF_RMSNORM) {   // the rows' RMSNorm factors while the stages fly
        for (int r = 0; r < rows; ++r) {
            const bf16 *xr = xs + r * lda;
            const float ss = row_sum_squares_warp(xr, nullptr, k, (k & 7) == 0 && aligned16(xr),
                                                  lane);
            if (lane == 0) xf.inv[r] = rms_inv(ss, k, xf.eps);
        }
        __syncwarp();
    }
    for (int kt = 0; kt < kt_count; ++kt) {
        cp_async_wait<STAGES - 2>();   // stage kt has landed (this lane's copies) ...
        if constexpr (XF != XF_NONE) fuse_stage(kt % STAGES, kt);
        __syncwarp();                  // ... every lane's; and stage kt - 1 is consumed
        const int next = kt + STAGES - 1;
        if (next < kt_count) load_stage(next % STAGES, next);
        cp_async_commit();
        const int slot = kt % STAGES;
        const bf16 *xa = sx + slot * 16 * 64;
        const unsigned char *wa = sw + slot * SWS;
        if constexpr (DecodeHi<F>::ext) {   // the stage's scales, one lane per entry
            f.fill_scales(lane, col0, cols, kt);   // (its readers of stage kt - 1 are past
            __syncwarp();                          // the __syncwarp above)
        }
        const typename F::Scale sc[2] = {f.scale(frow[0], kt), f.scale(frow[1], kt)};
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            const int kk = kt * 64 + 16 * ks;
            if (kk >= k) break;   // warp-uniform: no all-zero k16 steps
            unsigned int a[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {   // a[h]: W row g + 8h at 2t, a[h + 2] at 2t + 8
                const unsigned char *srow = wa + wr[h] * RB;
                if constexpr (DecodeHi<F>::ext) {   // k % 32 == 0: every step lies inside k
                    f.frag(srow, wa + 16 * RB + wr[h] * HB, wr[h], ks, t, sc[h], a[h],
                           a[h + 2]);
                } else if (kk + 16 <= k) {   // warp-uniform: inside k, no edge checks
                    f.template frag<true>(srow, wr[h], ks, t, frow[h], sc[h], kk, k, a[h],
                                          a[h + 2]);
                } else {
                    f.template frag<false>(srow, wr[h], ks, t, frow[h], sc[h], kk, k, a[h],
                                           a[h + 2]);
                }
            }
            if (two) {
                unsigned int b4[4];
                ldmatrix_x4(b4, xa + smem_off<T>(xrow, 2 * ks + xkh));
                const unsigned int b0[2] = {b4[0], b4[1]}, b1[2] = {b4[2], b4[3]};
                mma_bf16_16816(acc[0], a, b0, acc[0]);
                mma_bf16_16816(acc[1], a, b1, acc[1]);
            } else {
                unsigned int b2[2];
                ldmatrix_x2(b2, xa + smem_off<T>(xrow, 2 * ks + xkh));
                mma_bf16_16816(acc[0], a, b2, acc[0]);
            }
        }
    }
    cp_async_wait<0>();

    // acc[h][2 hw + e] = D'[W row g + 8 hw][X row 8 h + 2t + e]
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int hw = 0; hw < 2; ++hw)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int r = 8 * h + 2 * t + e, c = g + 8 * hw;
                if (r >= rows || c >= cols) continue;
                const long long o = (long long)(row0 + r) * ldy + col0 + c;
                float v = acc[h][2 * hw + e];
                if constexpr (XF != XF_NONE)   // y = bf16(bf16(acc) + bias[c])
                    if (xf.bias) v = bf2f(f2bf(v)) + bf2f(xf.bias[col0 + c]);
                if constexpr (RES) v = bf2f(yb[o]) + bf2f(f2bf(v));   // y = bf16(y + bf16(acc))
                if (yf) yf[o] = v;
                else yb[o] = f2bf(v);
            }
}
