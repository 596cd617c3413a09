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
#include "mma.cuh"

template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct TcTile {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = STAGES_;
    static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_;
    static constexpr int THREADS = WARPS_M * WARPS_N * 32;
    static constexpr int CH = BK / 8;                 // 16-byte chunks per shared row
    static constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
    static constexpr int MT = WTM / 16, NT = WTN / 8;  // m16 / n8 MMA tiles per warp
    static constexpr int A_PER_THREAD = BM * CH / THREADS, B_PER_THREAD = BN * CH / THREADS;
    static_assert(BK == 32 || BK == 64, "swizzle assumes 64- or 128-byte shared rows");
    static_assert(WTM % 16 == 0 && WTN % 8 == 0 && (NT == 1 || NT % 2 == 0), "warp tile");
    static_assert(BM * CH % THREADS == 0 && BN * CH % THREADS == 0, "chunks per thread");
    static_assert(STAGES >= 2, "pipeline");
};

typedef TcTile<16, 16, 64, 1, 2, 12> Tile16x16;
typedef TcTile<64, 32, 64, 2, 2, 4> Tile64x32;
typedef TcTile<128, 128, 32, 2, 4, 3> Tile128x128;

// Element offset of 16-byte chunk `ch` of shared row `r` (see the swizzle above).
template <class T>
__device__ __forceinline__ int smem_off(int r, int ch) {
    return r * T::BK + ((ch ^ ((r * T::CH >> 3) & (T::CH - 1))) << 3);
}

// One 16-byte chunk of a shared row: x/w elements [kk, kk + 8) of `src`, zeros past k.
__device__ __forceinline__ void fill_chunk(bf16 *dst, const bf16 *src, int kk, int k, bool vec) {
    if (vec) {
        const bool in = kk < k;  // k % 8 == 0: a chunk is wholly inside or wholly past k
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

// sa: [STAGES][BM * BK], sb: [STAGES][BN * BK] shared (128-byte aligned), declared by the
// entry point (a static local of a function template is not where the emulator's shared
// memory lives).
template <class T>
__device__ __forceinline__ void gemm_tc_tile(bf16 *sa, bf16 *sb, bf16 *yb, float *yf,
                                             const bf16 *x, const bf16 *w, int m, int n,
                                             int k) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row0 = blockIdx.x * T::BM, col0 = blockIdx.y * T::BN;
    const int rows = min(T::BM, m - row0), cols = min(T::BN, n - col0);
    const bool vec = (k & 7) == 0 && aligned16(x) && aligned16(w);
    const int kt_count = (k + T::BK - 1) / T::BK;

    // This thread's chunks of every stage: row r = c / CH, chunk c % CH. Rows past m / n are
    // not loaded (their readers are clamped below).
    const bf16 *a_src[T::A_PER_THREAD], *b_src[T::B_PER_THREAD];
    int a_dst[T::A_PER_THREAD], b_dst[T::B_PER_THREAD], a_ch[T::A_PER_THREAD],
        b_ch[T::B_PER_THREAD];
#pragma unroll
    for (int i = 0; i < T::A_PER_THREAD; ++i) {
        const int c = tid + i * T::THREADS, r = c / T::CH;
        a_ch[i] = r < rows ? c % T::CH : -1;
        a_src[i] = x + (long long)(row0 + min(r, rows - 1)) * k;
        a_dst[i] = smem_off<T>(r, c % T::CH);
    }
#pragma unroll
    for (int i = 0; i < T::B_PER_THREAD; ++i) {
        const int c = tid + i * T::THREADS, r = c / T::CH;
        b_ch[i] = r < cols ? c % T::CH : -1;
        b_src[i] = w + (long long)(col0 + min(r, cols - 1)) * k;
        b_dst[i] = smem_off<T>(r, c % T::CH);
    }
    auto load_stage = [&](int slot, int kt) {
        const int k0 = kt * T::BK;
        bf16 *a = sa + slot * T::BM * T::BK, *b = sb + slot * T::BN * T::BK;
#pragma unroll
        for (int i = 0; i < T::A_PER_THREAD; ++i)
            if (a_ch[i] >= 0) fill_chunk(a + a_dst[i], a_src[i], k0 + 8 * a_ch[i], k, vec);
#pragma unroll
        for (int i = 0; i < T::B_PER_THREAD; ++i)
            if (b_ch[i] >= 0) fill_chunk(b + b_dst[i], b_src[i], k0 + 8 * b_ch[i], k, vec);
    };

    // Warp tile and the shared rows its ldmatrix lanes read (clamped to the live rows).
    const int wr0 = (warp / T::WARPS_N) * T::WTM, wc0 = (warp % T::WARPS_N) * T::WTN;
    const bool live = wr0 < rows && wc0 < cols;  // warp-uniform: a dead warp only loads
    int a_row[T::MT], b_row[T::NT];
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt) a_row[mt] = min(wr0 + mt * 16 + (lane & 15), rows - 1);
#pragma unroll
    for (int nt = 0; nt < T::NT; ++nt) {
        // x4 over n8 tiles (nt, nt + 1): lanes 8q..8q+7 address matrix q = (n half, k half)
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
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

    auto compute_stage = [&](int slot, int kt) {
        const bf16 *a = sa + slot * T::BM * T::BK, *b = sb + slot * T::BN * T::BK;
#pragma unroll
        for (int ks = 0; ks < T::BK / 16; ++ks) {
            if (kt * T::BK + ks * 16 >= k) break;  // CTA-uniform: no all-zero k16 steps
            unsigned int af[T::MT][4], bfr[T::NT][2];
#pragma unroll
            for (int mt = 0; mt < T::MT; ++mt)
                ldmatrix_x4(af[mt], a + smem_off<T>(a_row[mt], 2 * ks + a_khalf));
            if (T::NT == 1) {
                ldmatrix_x2(bfr[0], b + smem_off<T>(b_row[0], 2 * ks + b_khalf));
            } else {
#pragma unroll
                for (int nt = 0; nt < T::NT; nt += 2) {
                    unsigned int r4[4];
                    ldmatrix_x4(r4, b + smem_off<T>(b_row[nt], 2 * ks + b_khalf));
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

    // Prologue: STAGES - 1 stages in flight (one commit group each, empty past k).
#pragma unroll
    for (int s = 0; s < T::STAGES - 1; ++s) {
        if (s < kt_count) load_stage(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < kt_count; ++kt) {
        cp_async_wait<T::STAGES - 2>();  // stage kt has landed (this thread's copies) ...
        __syncthreads();                 // ... everyone's; and stage kt - 1 is consumed
        const int next = kt + T::STAGES - 1;
        if (next < kt_count) load_stage(next % T::STAGES, next);
        cp_async_commit();
        if (live) compute_stage(kt % T::STAGES, kt);
    }
    cp_async_wait<0>();

    if (!live) return;
    // Epilogue: acc[mt][nt] = rows (g, g + 8) x columns (2t, 2t + 1) of the 16x8 tile.
    const int g = lane >> 2, t = lane & 3;
    const bool pairs = (n & 1) == 0 && (yf ? ((unsigned long long)yf & 7) == 0
                                            : ((unsigned long long)yb & 3) == 0);
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + wr0 + mt * 16 + g + 8 * h;
            if (r >= m) continue;
#pragma unroll
            for (int nt = 0; nt < T::NT; ++nt) {
                const int c = col0 + wc0 + nt * 8 + 2 * t;
                const float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1];
                const long long o = (long long)r * n + c;
                if (c + 1 < n && pairs) {
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

#define GEMM_TC_SMEM(TILE)                                                                    \
    __shared__ __align__(128) bf16 sa[TILE::STAGES * TILE::BM * TILE::BK];                    \
    __shared__ __align__(128) bf16 sb[TILE::STAGES * TILE::BN * TILE::BK]

#define GEMM_TC_ENTRY(NAME, TILE, MIN_BLOCKS)                                                 \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        gemm_tc_bf16_##NAME(bf16 *y, const bf16 *x, const bf16 *w, int m, int n, int k) {     \
        GEMM_TC_SMEM(TILE);                                                                   \
        gemm_tc_tile<TILE>(sa, sb, y, nullptr, x, w, m, n, k);                                \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(TILE::THREADS, MIN_BLOCKS)                    \
        gemm_tc_fp32_##NAME(float *y, const bf16 *x, const bf16 *w, int m, int n, int k) {    \
        GEMM_TC_SMEM(TILE);                                                                   \
        gemm_tc_tile<TILE>(sa, sb, nullptr, y, x, w, m, n, k);                                \
    }

GEMM_TC_ENTRY(16x16, Tile16x16, 1)
GEMM_TC_ENTRY(64x32, Tile64x32, 1)
GEMM_TC_ENTRY(128x128, Tile128x128, 2)
