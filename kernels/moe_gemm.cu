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
// whether its batch was small enough for it. Pipeline, swizzle, clamped edges and the
// scalar fallback (k % 8 != 0 or x / w not 16-byte aligned) are gemm_tc.cu's; the only
// differences are where A rows come from (a gather through sorted_pairs), which W (expert
// e's slice) and where output rows go (row p of y: pairs never collide, no atomics).
//
// BATCH INVARIANCE: y[p, j] is the FP32 accumulator of ceil(k / 16) mma.sync.m16n8k16 steps
// in ascending k order from +0.0f over x[p / row_div, :] and w[e, j, :] -- exactly
// gemm_tc's element (its header has the argument): the same bits as gemm_tc of that x row
// against W_e, for every tile, every row position in the tile and every other token in the
// launch. Which tokens share an expert changes only which CTA computes a row, never its
// value. The twin is therefore gemm_tc's (ops/gemm_tc.dot_f32 per expert).
#include "mma.cuh"

template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct MoeTile {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = STAGES_;
    static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_;
    static constexpr int THREADS = WARPS_M * WARPS_N * 32;
    static constexpr int CH = BK / 8;
    static constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
    static constexpr int MT = WTM / 16, NT = WTN / 8;
    static constexpr int A_PER_THREAD = BM * CH / THREADS, B_PER_THREAD = BN * CH / THREADS;
    static_assert(BK == 32 || BK == 64, "swizzle assumes 64- or 128-byte shared rows");
    static_assert(WTM % 16 == 0 && WTN % 8 == 0 && (NT == 1 || NT % 2 == 0), "warp tile");
    static_assert(BM * CH % THREADS == 0 && BN * CH % THREADS == 0, "chunks per thread");
};

typedef MoeTile<16, 16, 64, 1, 2, 12> MoeTile16x16;
typedef MoeTile<64, 32, 64, 2, 2, 4> MoeTile64x32;
typedef MoeTile<128, 128, 32, 2, 4, 3> MoeTile128x128;

template <class T>
__device__ __forceinline__ int moe_smem_off(int r, int ch) {
    return r * T::BK + ((ch ^ ((r * T::CH >> 3) & (T::CH - 1))) << 3);
}

// 16 bytes of a shared row: elements [kk, kk + 8) of `src`, zeros past k.
__device__ __forceinline__ void moe_fill_chunk(bf16 *dst, const bf16 *src, int kk, int k,
                                               bool vec) {
    if (vec) {
        const bool in = kk < k;
        cp_async_16(dst, in ? src + kk : src, in ? 16 : 0);
    } else {
        unsigned short v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e)
            v[e] = kk + e < k ? __bfloat16_as_ushort(src[kk + e]) : (unsigned short)0;
        uint4 u;
        u.x = v[0] | ((unsigned int)v[1] << 16);
        u.y = v[2] | ((unsigned int)v[3] << 16);
        u.z = v[4] | ((unsigned int)v[5] << 16);
        u.w = v[6] | ((unsigned int)v[7] << 16);
        *reinterpret_cast<uint4 *>(dst) = u;
    }
}

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
    const int rows = min(T::BM, expert_offsets[e + 1] - r0);
    const int *pairs = sorted_pairs + r0;
    const bf16 *we = w + (long long)e * n * k;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int col0 = blockIdx.y * T::BN;
    const int cols = min(T::BN, n - col0);
    const bool vec = (k & 7) == 0 && aligned16(x) && aligned16(w);
    const int kt_count = (k + T::BK - 1) / T::BK;

    // This thread's chunks of every stage; A rows gathered through the pair list.
    const bf16 *a_src[T::A_PER_THREAD], *b_src[T::B_PER_THREAD];
    int a_dst[T::A_PER_THREAD], b_dst[T::B_PER_THREAD], a_ch[T::A_PER_THREAD],
        b_ch[T::B_PER_THREAD];
#pragma unroll
    for (int i = 0; i < T::A_PER_THREAD; ++i) {
        const int c = tid + i * T::THREADS, r = c / T::CH;
        a_ch[i] = r < rows ? c % T::CH : -1;
        a_src[i] = x + (long long)(pairs[min(r, rows - 1)] / row_div) * k;
        a_dst[i] = moe_smem_off<T>(r, c % T::CH);
    }
#pragma unroll
    for (int i = 0; i < T::B_PER_THREAD; ++i) {
        const int c = tid + i * T::THREADS, r = c / T::CH;
        b_ch[i] = r < cols ? c % T::CH : -1;
        b_src[i] = we + (long long)(col0 + min(r, cols - 1)) * k;
        b_dst[i] = moe_smem_off<T>(r, c % T::CH);
    }
    auto load_stage = [&](int slot, int kt) {
        const int k0 = kt * T::BK;
        bf16 *a = sa + slot * T::BM * T::BK, *b = sb + slot * T::BN * T::BK;
#pragma unroll
        for (int i = 0; i < T::A_PER_THREAD; ++i)
            if (a_ch[i] >= 0) moe_fill_chunk(a + a_dst[i], a_src[i], k0 + 8 * a_ch[i], k, vec);
#pragma unroll
        for (int i = 0; i < T::B_PER_THREAD; ++i)
            if (b_ch[i] >= 0) moe_fill_chunk(b + b_dst[i], b_src[i], k0 + 8 * b_ch[i], k, vec);
    };

    const int wr0 = (warp / T::WARPS_N) * T::WTM, wc0 = (warp % T::WARPS_N) * T::WTN;
    const bool live = wr0 < rows && wc0 < cols;  // warp-uniform
    int a_row[T::MT], b_row[T::NT];
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt) a_row[mt] = min(wr0 + mt * 16 + (lane & 15), rows - 1);
#pragma unroll
    for (int nt = 0; nt < T::NT; ++nt) {
        const int nrow = T::NT == 1 ? (lane & 7) : ((nt & ~1) + ((lane >> 4) & 1)) * 8 + (lane & 7);
        b_row[nt] = min(wc0 + nrow, cols - 1);
    }
    const int a_khalf = lane >> 4, b_khalf = (lane >> 3) & 1;

    float acc[T::MT][T::NT][4];
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < T::NT; ++nt)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mt][nt][q] = 0.f;

    auto compute_stage = [&](int slot, int kt) {
        const bf16 *a = sa + slot * T::BM * T::BK, *b = sb + slot * T::BN * T::BK;
#pragma unroll
        for (int ks = 0; ks < T::BK / 16; ++ks) {
            if (kt * T::BK + ks * 16 >= k) break;  // CTA-uniform: no all-zero k16 steps
            unsigned int af[T::MT][4], bfr[T::NT][2];
#pragma unroll
            for (int mt = 0; mt < T::MT; ++mt)
                ldmatrix_x4(af[mt], a + moe_smem_off<T>(a_row[mt], 2 * ks + a_khalf));
            if (T::NT == 1) {
                ldmatrix_x2(bfr[0], b + moe_smem_off<T>(b_row[0], 2 * ks + b_khalf));
            } else {
#pragma unroll
                for (int nt = 0; nt < T::NT; nt += 2) {
                    unsigned int r4[4];
                    ldmatrix_x4(r4, b + moe_smem_off<T>(b_row[nt], 2 * ks + b_khalf));
                    bfr[nt][0] = r4[0];
                    bfr[nt][1] = r4[1];
                    bfr[nt + 1][0] = r4[2];
                    bfr[nt + 1][1] = r4[3];
                }
            }
#pragma unroll
            for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < T::NT; ++nt)
                    mma_bf16_16816(acc[mt][nt], af[mt], bfr[nt], acc[mt][nt]);
        }
    };

#pragma unroll
    for (int s = 0; s < T::STAGES - 1; ++s) {
        if (s < kt_count) load_stage(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < kt_count; ++kt) {
        cp_async_wait<T::STAGES - 2>();
        __syncthreads();
        const int next = kt + T::STAGES - 1;
        if (next < kt_count) load_stage(next % T::STAGES, next);
        cp_async_commit();
        if (live) compute_stage(kt % T::STAGES, kt);
    }
    cp_async_wait<0>();

    if (!live) return;
    // Epilogue: acc[mt][nt] = tile rows (g, g + 8) x columns (2t, 2t + 1); row r -> y row
    // pairs[r].
    const int g = lane >> 2, tq = lane & 3;
    const bool pair_store = (n & 1) == 0 && (yf ? ((unsigned long long)yf & 7) == 0
                                                : ((unsigned long long)yb & 3) == 0);
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wr0 + mt * 16 + g + 8 * h;
            if (r >= rows) continue;
            const long long yrow = (long long)pairs[r] * n;
#pragma unroll
            for (int nt = 0; nt < T::NT; ++nt) {
                const int c = col0 + wc0 + nt * 8 + 2 * tq;
                const float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1];
                const long long o = yrow + c;
                if (c + 1 < n && pair_store) {
                    if (yf) *reinterpret_cast<float2 *>(yf + o) = make_float2(v0, v1);
                    else *reinterpret_cast<unsigned int *>(yb + o) = pack_bf2(v0, v1);
                } else {
                    if (c < n) {
                        if (yf) yf[o] = v0;
                        else yb[o] = f2bf(v0);
                    }
                    if (c + 1 < n) {
                        if (yf) yf[o + 1] = v1;
                        else yb[o + 1] = f2bf(v1);
                    }
                }
            }
        }
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
