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
#include <cuda_fp8.h>

#include "gemm_q_decode.cuh"
#include "gemm_q_rows.cuh"
#include "gemm_tc_tile.cuh"

__device__ __forceinline__ unsigned int bf2_bits(float lo, float hi) { return pack_bf2(lo, hi); }

// 4-bit codes: 8 values of one row from one 32-bit word of the stage (k0 = its first k).
struct Int4Format {
    static constexpr int BITS = 4;
    const unsigned int *q;
    const unsigned short *scales;
    const unsigned char *zeros;
    const int *gidx, *gidx_row;
    int groups, group_size, row_bytes, k;

    struct Row {   // the row index only: pointers are formed per chunk (registers: the
        int j;     // 128x128 tile keeps two of these per thread and spilled with three
    };             // pointers each on sm_80)
    __device__ __forceinline__ const unsigned char *row_bytes_at(int j) const {
        return reinterpret_cast<const unsigned char *>(q) + (long long)j * row_bytes;
    }
    __device__ __forceinline__ Row row(int j) const { return {j}; }
    __device__ __forceinline__ uint4 dequant8(const unsigned char *raw, const Row &r, int k0,
                                              int) const {  // k % 8 == 0: no partial chunk
        const unsigned int w = *reinterpret_cast<const unsigned int *>(raw);
        const unsigned short *rs = scales + (long long)r.j * groups;
        const unsigned char *rz = zeros + (long long)r.j * groups;
        float v[8];
        if (gidx == nullptr) {  // one group for the 8 values (group_size % 8 == 0)
            const int g = k0 / group_size;
            const float s = __half2float(__ushort_as_half(__ldg(rs + g)));
            const float zf = 8388608.f + (float)__ldg(rz + g);  // 2^23 + z, exact
#pragma unroll
            for (int e = 0; e < 8; ++e)  // (2^23 + q) - (2^23 + z) = q - z exactly
                v[e] = __fmul_rn(__uint_as_float(0x4B000000u | ((w >> (4 * e)) & 15u)) - zf, s);
        } else {                // act-order: each k its own group (the row's part's table)
            const int *rg = gidx + (long long)__ldg(gidx_row + r.j) * k;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int g = __ldg(rg + k0 + e);
                const float s = __half2float(__ushort_as_half(__ldg(rs + g)));
                const float zf = 8388608.f + (float)__ldg(rz + g);
                v[e] = __fmul_rn(__uint_as_float(0x4B000000u | ((w >> (4 * e)) & 15u)) - zf, s);
            }
        }
        return make_uint4(bf2_bits(v[0], v[1]), bf2_bits(v[2], v[3]), bf2_bits(v[4], v[5]),
                          bf2_bits(v[6], v[7]));
    }

    // The decode tile's side (gemm_q_decode.cuh): a stage row is 32 bytes, read in place.
    static __device__ __forceinline__ int swz(int, int ch) { return ch; }
    struct Scale {   // the stage's group when one group spans every stage (uniform())
        float s, zf;
    };
    __device__ __forceinline__ bool uniform() const {
        return gidx == nullptr && group_size % 64 == 0;
    }
    __device__ __forceinline__ Scale scale(const Row &r, int kt) const {
        if (!uniform()) return {0.f, 0.f};
        const long long g = (long long)r.j * groups + kt * 64 / group_size;
        return {__half2float(__ushort_as_half(__ldg(scales + g))),
                8388608.f + (float)__ldg(zeros + g)};
    }
    // dequant8's values at positions p, p + 1 (codes c & 15, (c >> 4) & 15); p >= k: the
    // zero chunk (k % 8 == 0, so a pair is past k exactly when its chunk is). kFull: the
    // k16 step lies inside k (no edge checks).
    template <bool kFull>
    __device__ __forceinline__ unsigned int pair(unsigned int c, const Row &r, const Scale &sc,
                                                 int p, int k) const {
        if (!kFull && p >= k) return 0u;
        float s[2], zf[2];
        if (uniform()) {
            s[0] = s[1] = sc.s;
            zf[0] = zf[1] = sc.zf;
        } else {
            const int *rg = gidx ? gidx + (long long)__ldg(gidx_row + r.j) * k : nullptr;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const long long g =
                    (long long)r.j * groups + (rg ? __ldg(rg + p + e) : p / group_size);
                s[e] = __half2float(__ushort_as_half(__ldg(scales + g)));
                zf[e] = 8388608.f + (float)__ldg(zeros + g);
            }
        }
        return bf2_bits(__fmul_rn(__uint_as_float(0x4B000000u | (c & 15u)) - zf[0], s[0]),
                        __fmul_rn(__uint_as_float(0x4B000000u | ((c >> 4) & 15u)) - zf[1], s[1]));
    }
    // A' registers of W row `row` (stage bytes srow), k16 step ks at k position kk: lo =
    // positions kk + 2t, +1, hi = kk + 8 + 2t, +1 (one 64-bit load: the step's two words)
    template <bool kFull>
    __device__ __forceinline__ void frag(const unsigned char *srow, int, int ks, int t,
                                         const Row &r, const Scale &sc, int kk, int k,
                                         unsigned int &lo, unsigned int &hi) const {
        const uint2 w = *reinterpret_cast<const uint2 *>(srow + 8 * ks);
        lo = pair<kFull>(w.x >> (8 * t), r, sc, kk + 2 * t, k);
        hi = pair<kFull>(w.y >> (8 * t), r, sc, kk + 8 + 2 * t, k);
    }
};

// float8_e4m3fn codes: 8 values of one row from 8 bytes of the stage.
struct Fp8Format {
    static constexpr int BITS = 8;
    const unsigned char *q;
    const float *scales;
    const int *scale_row;
    int k_blocks, block_k, row_bytes;

    struct Row {
        const float *s;
    };
    __device__ __forceinline__ const unsigned char *row_bytes_at(int j) const {
        return q + (long long)j * row_bytes;
    }
    __device__ __forceinline__ Row row(int j) const {
        return {scales + (long long)__ldg(scale_row + j) * k_blocks};
    }
    __device__ __forceinline__ uint4 dequant8(const unsigned char *raw, const Row &r, int k0,
                                              int k) const {
        uint2 b = *reinterpret_cast<const uint2 *>(raw);
        if (k0 + 8 > k) {  // the chunk that straddles k: the codes past it count as +0
            const int live = k - k0;   // 1..7
            b.x &= live >= 4 ? 0xFFFFFFFFu : (1u << (8 * live)) - 1u;
            b.y &= live <= 4 ? 0u : (1u << (8 * (live - 4))) - 1u;
        }
        const float s = __ldg(r.s + k0 / block_k);
        unsigned int out[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const unsigned int word = p < 2 ? b.x : b.y;
            const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)(word >> (16 * (p & 1)));
            const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
            const float lo = __half2float(__ushort_as_half(h.x));
            const float hi = __half2float(__ushort_as_half(h.y));
            out[p] = bf2_bits(__fmul_rn(lo, s), __fmul_rn(hi, s));
        }
        return make_uint4(out[0], out[1], out[2], out[3]);
    }

    // The decode tile's side (gemm_q_decode.cuh): a stage row is 64 bytes in 4 chunks,
    // chunk ch of row r stored at ch ^ ((r / 2) % 4) (conflict-free 32-bit fragment loads).
    static __device__ __forceinline__ int swz(int r, int ch) { return ch ^ ((r >> 1) & 3); }
    struct Scale {   // the stage's scale when one block spans every stage (uniform())
        float s;
    };
    __device__ __forceinline__ bool uniform() const { return block_k % 64 == 0; }
    __device__ __forceinline__ Scale scale(const Row &r, int kt) const {
        return {uniform() ? __ldg(r.s + kt * 64 / block_k) : 0.f};
    }
    // dequant8's values at positions p, p + 1 (codes: the low and high byte of c): zero
    // when their 8-chunk is past k, codes at or past k masked to 0 in the chunk across k
    // (kFull: the k16 step lies inside k)
    template <bool kFull>
    __device__ __forceinline__ unsigned int pair(unsigned int c, const Row &r, const Scale &sc,
                                                 int p, int k) const {
        if constexpr (!kFull) {
            if ((p & ~7) >= k) return 0u;
            c &= p + 1 < k ? 0xFFFFu : p < k ? 0xFFu : 0u;
        }
        const float s = uniform() ? sc.s : __ldg(r.s + p / block_k);
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)c, __NV_E4M3);
        return bf2_bits(__fmul_rn(__half2float(__ushort_as_half(h.x)), s),
                        __fmul_rn(__half2float(__ushort_as_half(h.y)), s));
    }
    // A' registers of W row `row`, k16 step ks at k position kk (see Int4Format::frag): the
    // pair at byte 2t of the step's chunk and the one at byte 8 + 2t (two 32-bit loads)
    template <bool kFull>
    __device__ __forceinline__ void frag(const unsigned char *srow, int row, int ks, int t,
                                         const Row &r, const Scale &sc, int kk, int k,
                                         unsigned int &lo, unsigned int &hi) const {
        const unsigned char *c = srow + 16 * swz(row, ks) + 4 * (t >> 1);
        const int sh = 16 * (t & 1);
        lo = pair<kFull>(*reinterpret_cast<const unsigned int *>(c) >> sh, r, sc, kk + 2 * t, k);
        hi = pair<kFull>(*reinterpret_cast<const unsigned int *>(c + 8) >> sh, r, sc,
                         kk + 8 + 2 * t, k);
    }
};

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
