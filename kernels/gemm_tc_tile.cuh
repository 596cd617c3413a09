// The CTA tile of the batch-invariant tensor-core GEMM, shared by kernels/gemm_tc.cu (BF16
// weights) and kernels/gemm_q.cu (quantized weights dequantized in the tile load): the
// pipeline, swizzle, fragment loads, MMA order and epilogue documented in gemm_tc.cu's header.
//
// The weight operand comes from a policy W (one member of the tile's argument list):
//   BF16Rows   W bf16 [n, k] copied with cp.async straight into the compute layout
//              (W::kDequant false: the ring slot is what the MMAs read);
//   QuantRows  (gemm_q.cu) the packed bytes of a stage copied with 16-byte cp.async into a
//              ring of raw bytes, then dequantized by the CTA into one BF16 stage buffer of
//              the same swizzled layout, with a second __syncthreads before the MMAs read it
//              (W::kDequant true).
// Either way the MMAs see BF16 W values in the same shared-memory layout and run the same
// k16 steps in the same order, so the batch-invariance argument of gemm_tc.cu holds for
// every policy, and a quantized GEMM gives exactly the bits of the BF16 GEMM run on the
// dequantized weights.
//
// The CTA's rows come from a policy R (gemm_tc_tile_rows): DenseRows, rows blockIdx.x * BM
// + [0, BM) of X and of Y (gemm_tc_tile: gemm_tc.cu, gemm_q.cu); moe_gemm.cu's ExpertRows
// gathers X rows through a routed pair list and scatters Y rows by pair. Which row a value
// sits in never enters its arithmetic, so that argument holds for every row policy too.
//
// What is fused around the tile (template argument XF, gemm_tc.cu's decode entries):
//   XF_NONE     X as stored.
//   XF_RMSNORM  X = rms_scale(x[r, c], inv[r], norm_w[c]) (kernels/norm_row.cuh): x is the
//               residual stream, inv[r] its row's RMSNorm factor computed by the CTA's warps
//               before the first stage is used, in norm_row.cuh's order.
//   XF_ACTMUL   X = bf16(act(x[r, c]) * x[r, k + c]) (kernels/activation.cuh): x is the
//               fused gate|up output [m, 2k].
// Either way the raw chunks land by cp.async as always (x into the X ring, norm_w / up into
// an aux ring of the same layout), and each thread rewrites the X chunks it copied itself,
// right after its cp.async wait and before the stage's barrier: no extra barrier, and the
// MMAs see X values with exactly the bits the separate rmsnorm / act_mul kernels store.
// RES: the epilogue stores Y = bf16(Y + bf16(acc)) (the residual add of the next rmsnorm).
#pragma once
#include "activation.cuh"
#include "mma.cuh"
#include "norm_row.cuh"

#define XF_NONE 0
#define XF_RMSNORM 1
#define XF_ACTMUL 2

// The run-time side of XF: the norm weight [k] and eps (XF_RMSNORM), the activation code
// (XF_ACTMUL), the aux ring ([STAGES][BM * BK] shared), inv ([BM] shared floats), and an
// optional bias [n] (XF != XF_NONE): Y = bf16(bf16(acc) + bias), elementwise.cu's add_bias.
struct XFuse {
    const bf16 *norm_w;
    float eps;
    int act;
    bf16 *aux;
    float *inv;
    const bf16 *bias;
};

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

// Element offset of 16-byte chunk `ch` of shared row `r` (see the swizzle in gemm_tc.cu).
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

// W bf16 [n, k] row-major: this thread's chunks of every stage, cp.async'd (or, without
// the vector path, filled synchronously) into the ring slot the MMAs read.
template <class T>
struct BF16Rows {
    static constexpr bool kDequant = false;
    static constexpr int STAGE_ELEMS = T::BN * T::BK;   // ring elements per stage
    typedef bf16 Ring;
    const bf16 *w;
    const bf16 *src[T::B_PER_THREAD];
    int dst[T::B_PER_THREAD], ch[T::B_PER_THREAD];

    __device__ __forceinline__ bool aligned() const { return aligned16(w); }
    // Rows past n (r >= cols) are not loaded (their readers are clamped).
    __device__ __forceinline__ void setup(int tid, int col0, int cols, int k) {
#pragma unroll
        for (int i = 0; i < T::B_PER_THREAD; ++i) {
            const int c = tid + i * T::THREADS, r = c / T::CH;
            ch[i] = r < cols ? c % T::CH : -1;
            src[i] = w + (long long)(col0 + min(r, cols - 1)) * k;
            dst[i] = smem_off<T>(r, c % T::CH);
        }
    }
    __device__ __forceinline__ void load(bf16 *slot, int kt, int k, bool vec) {
        const int k0 = kt * T::BK;
#pragma unroll
        for (int i = 0; i < T::B_PER_THREAD; ++i)
            if (ch[i] >= 0) fill_chunk(slot + dst[i], src[i], k0 + 8 * ch[i], k, vec);
    }
    __device__ __forceinline__ void dequant(bf16 *, const Ring *, int, int) {}
};

// The CTA's `rows` (<= BM) tile rows r: X row x_row(r) in, Y row y_row(r) out. A row policy
// with `kBias = true` (moe_gemm.cu's ExpertRows) holds a bias row `bias` [n] (or NULL) that
// the epilogue adds to the FP32 accumulator before the one rounding: y = bf16(acc + bias[c]);
// a policy without the member has none (RowBias).
template <class R, class = void>
struct RowBias { static constexpr bool value = false; };
template <class R>
struct RowBias<R, decltype((void)R::kBias, void())> { static constexpr bool value = R::kBias; };

struct DenseRows {
    int row0, rows;
    __device__ __forceinline__ long long x_row(int r) const { return row0 + r; }
    __device__ __forceinline__ long long y_row(int r) const { return row0 + r; }
};

// sa: [STAGES][BM * BK] shared, sw: [STAGES][W::STAGE_ELEMS] shared (the weight ring), sd:
// [BN * BK] shared (the dequantized stage; unused without W::kDequant), all 128-byte
// aligned and declared by the entry point (a static local of a function template is not
// where the emulator's shared memory lives). rmap: the CTA's rows (DenseRows or a policy
// with the same members); columns blockIdx.y * BN + [0, BN) of n. Y rows are `ldy` elements
// apart (>= n; the columns past n are never written).
template <class T, class W, class R, int XF = XF_NONE, bool RES = false>
__device__ __forceinline__ void gemm_tc_tile_rows(bf16 *sa, typename W::Ring *sw, bf16 *sd,
                                                  bf16 *yb, float *yf, const bf16 *x,
                                                  W &wsrc, const R &rmap, int n, int k,
                                                  int ldy, const XFuse &xf = XFuse{}) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int col0 = blockIdx.y * T::BN;
    const int rows = rmap.rows, cols = min(T::BN, n - col0);
    const long long lda = XF == XF_ACTMUL ? 2LL * k : (long long)k;  // x's row stride
    const bool vec = (k & 7) == 0 && aligned16(x) && wsrc.aligned() &&
                     (XF != XF_RMSNORM || aligned16(xf.norm_w));
    const int kt_count = (k + T::BK - 1) / T::BK;

    // This thread's chunks of X in every stage: row r = c / CH, chunk c % CH. Rows past m
    // are not loaded (their readers are clamped below).
    const bf16 *a_src[T::A_PER_THREAD];
    int a_dst[T::A_PER_THREAD], a_ch[T::A_PER_THREAD];
#pragma unroll
    for (int i = 0; i < T::A_PER_THREAD; ++i) {
        const int c = tid + i * T::THREADS, r = c / T::CH;
        a_ch[i] = r < rows ? c % T::CH : -1;
        a_src[i] = x + rmap.x_row(min(r, rows - 1)) * lda;
        a_dst[i] = smem_off<T>(r, c % T::CH);
    }
    wsrc.setup(tid, col0, cols, k);
    auto load_stage = [&](int slot, int kt) {
        const int k0 = kt * T::BK;
        bf16 *a = sa + slot * T::BM * T::BK;
#pragma unroll
        for (int i = 0; i < T::A_PER_THREAD; ++i)
            if (a_ch[i] >= 0) {
                fill_chunk(a + a_dst[i], a_src[i], k0 + 8 * a_ch[i], k, vec);
                if constexpr (XF != XF_NONE)   // the norm weight, or the row's up half
                    fill_chunk(xf.aux + slot * T::BM * T::BK + a_dst[i],
                               XF == XF_RMSNORM ? xf.norm_w : a_src[i] + k, k0 + 8 * a_ch[i],
                               k, vec);
            }
        wsrc.load(sw + slot * W::STAGE_ELEMS, kt, k, vec);
    };
    // This thread's X chunks of stage kt (landed: its own copies) rewritten in place.
    auto fuse_stage = [&](int slot, int kt) {
        bf16 *a = sa + slot * T::BM * T::BK;
        const bf16 *aux = xf.aux + slot * T::BM * T::BK;
#pragma unroll
        for (int i = 0; i < T::A_PER_THREAD; ++i) {
            if (a_ch[i] < 0 || kt * T::BK + 8 * a_ch[i] >= k) continue;
            float v[8], u[8];
            unpack8(*reinterpret_cast<const bf16x8 *>(a + a_dst[i]), v);
            unpack8(*reinterpret_cast<const bf16x8 *>(aux + a_dst[i]), u);
            if constexpr (XF == XF_RMSNORM) {
                const float inv = xf.inv[(tid + i * T::THREADS) / T::CH];
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = rms_scale(v[e], inv, u[e]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = gated_act_f(v[e], xf.act) * u[e];
            }
            *reinterpret_cast<bf16x8 *>(a + a_dst[i]) = pack8(v);
        }
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

    auto compute_stage = [&](const bf16 *a, const bf16 *b, int kt) {
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
    if constexpr (XF == XF_RMSNORM) {
        // each warp the RMSNorm factor of rows warp, warp + warps, ... (the stages fly)
        for (int r = warp; r < rows; r += T::THREADS / 32) {
            const bf16 *xr = x + rmap.x_row(r) * lda;
            const float ss = row_sum_squares_warp(xr, nullptr, k, (k & 7) == 0 && aligned16(xr),
                                                  lane);
            if (lane == 0) xf.inv[r] = rms_inv(ss, k, xf.eps);
        }
        __syncthreads();
    }
    for (int kt = 0; kt < kt_count; ++kt) {
        cp_async_wait<T::STAGES - 2>();  // stage kt has landed (this thread's copies) ...
        if constexpr (XF != XF_NONE) fuse_stage(kt % T::STAGES, kt);
        __syncthreads();                 // ... everyone's; and stage kt - 1 is consumed
        const int next = kt + T::STAGES - 1;
        if (next < kt_count) load_stage(next % T::STAGES, next);
        cp_async_commit();
        const int slot = kt % T::STAGES;
        const bf16 *a = sa + slot * T::BM * T::BK;
        if constexpr (W::kDequant) {
            // every thread dequantizes its chunks of stage kt (dead warps too), then the
            // MMAs read the BF16 stage; the next iteration's barrier keeps it until then
            wsrc.dequant(sd, sw + slot * W::STAGE_ELEMS, kt, k);
            __syncthreads();
            if (live) compute_stage(a, sd, kt);
        } else {
            if (live) compute_stage(a, reinterpret_cast<const bf16 *>(sw + slot * W::STAGE_ELEMS), kt);
        }
    }
    cp_async_wait<0>();

    if (!live) return;
    // Epilogue: acc[mt][nt] = rows (g, g + 8) x columns (2t, 2t + 1) of the 16x8 tile.
    const int g = lane >> 2, t = lane & 3;
    const bool pairs = (ldy & 1) == 0 && (yf ? ((unsigned long long)yf & 7) == 0
                                            : ((unsigned long long)yb & 3) == 0);
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wr0 + mt * 16 + g + 8 * h;
            if (r >= rows) continue;
            const long long yrow = rmap.y_row(r) * ldy;
#pragma unroll
            for (int nt = 0; nt < T::NT; ++nt) {
                const int c = col0 + wc0 + nt * 8 + 2 * t;
                float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1];
                const long long o = yrow + c;
                if constexpr (RowBias<R>::value) {   // y = bf16(acc + bias[c]) (FP32: the sum)
                    if (rmap.bias) {
                        v0 = c < n ? v0 + bf2f(rmap.bias[c]) : v0;
                        v1 = c + 1 < n ? v1 + bf2f(rmap.bias[c + 1]) : v1;
                    }
                }
                if constexpr (XF != XF_NONE) {   // y = bf16(bf16(acc) + bias[c])
                    if (xf.bias) {
                        v0 = c < n ? bf2f(f2bf(v0)) + bf2f(xf.bias[c]) : v0;
                        v1 = c + 1 < n ? bf2f(f2bf(v1)) + bf2f(xf.bias[c + 1]) : v1;
                    }
                }
                if constexpr (RES) {   // y = bf16(y + bf16(acc)): read, then rewritten below
                    v0 = c < n ? bf2f(yb[o]) + bf2f(f2bf(v0)) : v0;
                    v1 = c + 1 < n ? bf2f(yb[o + 1]) + bf2f(f2bf(v1)) : v1;
                }
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

// Rows blockIdx.x * BM + [0, BM) of X [m, k] and Y [m, ldy] (gemm_tc.cu, gemm_q.cu,
// gemm_gguf*.cu).
template <class T, class W, int XF = XF_NONE, bool RES = false>
__device__ __forceinline__ void gemm_tc_tile(bf16 *sa, typename W::Ring *sw, bf16 *sd,
                                             bf16 *yb, float *yf, const bf16 *x, W &wsrc,
                                             int m, int n, int k, int ldy,
                                             const XFuse &xf = XFuse{}) {
    const int row0 = blockIdx.x * T::BM;
    gemm_tc_tile_rows<T, W, DenseRows, XF, RES>(sa, sw, sd, yb, yf, x, wsrc,
                                                DenseRows{row0, min(T::BM, m - row0)}, n, k,
                                                ldy, xf);
}
