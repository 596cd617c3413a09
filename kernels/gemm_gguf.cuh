// The GEMM over GGUF weights kept at their bytes: the W operand of the two tile families
// for every ggml block type (kernels/gemm_gguf.cu and gemm_gguf_k.cu hold the entry
// points; their header has the contract, this file the machinery they share).
//
//   GgufFormat<TYPE>  the decode tile's operand (gemm_q_decode.cuh, the 16x16 entries): a
//                     stage is 64 k positions of 16 W rows, their q bytes (16 x RB) and qh
//                     bytes (16 x HI_BYTES) copied by cp.async; each lane dequantizes its A'
//                     fragment's 8 values of a row and k16 step straight into registers
//                     with the scales of the row's 2 or 4 sub-blocks of the stage (a
//                     shared table of the stage's 16 x 2 or 4 scales, each entry unpacked
//                     by one lane: fill_scales).
//   GgufRows<T, TYPE> the tensor-core tile's operand (gemm_tc_tile.cuh, the 64x32 and
//                     128x128 entries): a stage's q and qh bytes of BN rows copied by
//                     cp.async into a raw ring, then each thread dequantizes one 16-element
//                     run of one row (one sub-block's scales, unpacked once for the 16) into
//                     two 16-byte chunks of the BF16 stage buffer the MMAs read.
// Both give every element gguf_format.cuh's value, so both tiles compute gemm_tc's GEMM on
// dequant_bf16(W) bit for bit.
#pragma once
#include "gemm_q_decode.cuh"
#include "gemm_tc_tile.cuh"
#include "gguf_format.cuh"

// cp.async size for `bytes` of a stage row of the qh plane: 4 for the 32-element types
// (rows of 4 bytes a block), else up to 16 (K-quant rows are 32- or 64-byte multiples).
template <int TYPE>
__host__ __device__ constexpr int gguf_hi_unit(int bytes) {
    return GgufType<TYPE>::QK == 32 ? 4 : (bytes < 16 ? bytes : 16);
}

// The decode tile's W (gemm_q_decode.cuh's format interface, with the high-bit plane).
template <int TYPE>
struct GgufFormat {
    typedef GgufType<TYPE> Ty;
    static constexpr int BITS = Ty::LOW;
    static constexpr int RB = 64 * Ty::LOW / 8;              // q bytes of a stage row
    static constexpr int HI_BYTES = 64 * Ty::HIGH / 8;       // qh bytes of a stage row
    static constexpr int HI_UNIT = gguf_hi_unit<TYPE>(HI_BYTES);
    // scales of a stage row: two 32-element blocks, or 2 (4) sub-blocks of a K-quant block
    static constexpr int NSS = Ty::QK == 32 ? 2 : 64 / Ty::SUB;
    // stages: as many as ~45 KiB of shared memory holds (X 2 KiB + W a stage), at most 20
    static constexpr int STAGE_BYTES = 2048 + 16 * (RB + HI_BYTES);
    static constexpr int STAGES = 46080 / STAGE_BYTES < 20 ? 46080 / STAGE_BYTES : 20;

    static constexpr int TABLE = 2 * 16 * NSS;   // floats of the stage's scale table: s of
                                                 // entry e = (row, i) at e, mn at 16 NSS + e

    const unsigned char *q, *qh, *meta;
    float *table;   // shared: the stage's scales (TABLE)
    int row_bytes, hi_row_bytes, meta_row, k;

    static __device__ __forceinline__ GgufFormat make(const unsigned char *q,
                                                      const unsigned char *qh,
                                                      const unsigned char *meta, float *table,
                                                      int k) {
        typedef GgufRowBytes<TYPE> B;
        return {q, qh, meta, table, B::q(k), B::qh(k), B::meta(k), k};
    }
    __device__ __forceinline__ const unsigned char *row_bytes_at(int j) const {
        return q + (long long)j * row_bytes;
    }
    __device__ __forceinline__ const unsigned char *hi_row_at(int j) const {
        return qh + (long long)j * hi_row_bytes;
    }
    // 8-bit codes: chunk c of row r at c ^ ((r / 2) % 4), as gemm_q.cu's Fp8Format
    static __device__ __forceinline__ int swz(int r, int ch) {
        return Ty::LOW == 8 ? ch ^ ((r >> 1) & 3) : ch;
    }
    struct Row {
        int r;   // the tile row (0..15) of W row j
    };
    __device__ __forceinline__ Row row(int j) const { return {j & 15}; }   // col0 % 16 == 0
    __device__ __forceinline__ void prefetch(int j, int kt) const {
        prefetch_l1(meta + (long long)j * meta_row + (kt * 64 / Ty::QK) * Ty::META);
    }
    // The stage's scale table: entry (r, i) = the scales of tile row r's i-th block (32-
    // element types: block 2 kt + i; one past k is not read, its positions never are) or
    // sub-block (K-quants: NSS (kt % 4) + i of block kt / 4), each unpacked by one lane.
    // Rows past n are left alone (their readers are clamped to live rows).
    __device__ __forceinline__ void fill_scales(int lane, int col0, int cols, int kt) const {
        static_assert(16 * NSS % 32 == 0, "whole entries per lane");
#pragma unroll
        for (int u = 0; u < 16 * NSS / 32; ++u) {
            const int e = lane + 32 * u, r = e / NSS, i = e % NSS;
            if (r >= cols) continue;
            const unsigned char *mr = meta + (long long)(col0 + r) * meta_row;
            float s[1] = {0.f}, mn[1] = {0.f};
            if constexpr (Ty::QK == 32) {
                if ((2 * kt + i) * 32 < k)
                    gguf_scales<TYPE, 1>(mr + (2 * kt + i) * Ty::META, 0, s, mn);
            } else {
                gguf_scales<TYPE, 1>(mr + (kt >> 2) * Ty::META, (kt & 3) * NSS + i, s, mn);
            }
            table[e] = s[0];   // 32 lanes, 32 consecutive words: no bank conflict
            if constexpr (Ty::MIN) table[16 * NSS + e] = mn[0];
        }
    }
    struct Scale {
        float s[NSS], mn[NSS];
    };
    // Row r's scales of the stage, from the table fill_scales wrote (one 8- or 16-byte load
    // of the s values, and one of the mn values for a type with a min).
    __device__ __forceinline__ Scale scale(const Row &r, int) const {
        Scale sc;
#pragma unroll
        for (int i = 0; i < NSS; ++i) sc.mn[i] = 0.f;
        load_row(table + r.r * NSS, sc.s);
        if constexpr (Ty::MIN) load_row(table + 16 * NSS + r.r * NSS, sc.mn);
        return sc;
    }
    static __device__ __forceinline__ void load_row(const float *p, float (&v)[NSS]) {
        if constexpr (NSS == 2) {
            const float2 w = *reinterpret_cast<const float2 *>(p);
            v[0] = w.x;
            v[1] = w.y;
        } else {
            const float4 w = *reinterpret_cast<const float4 *>(p);
            v[0] = w.x;
            v[1] = w.y;
            v[2] = w.z;
            v[3] = w.w;
        }
    }
    // The two values of codes packed at bits [0, LOW) and [LOW, 2 LOW) of l (hi bits at
    // [0, HIGH) and [HIGH, 2 HIGH) of h) as a BF16 pair.
    static __device__ __forceinline__ unsigned int pair(unsigned int l, unsigned int h, float s,
                                                        float mn) {
        unsigned int u0 = l & Ty::LMASK, u1 = (l >> Ty::LOW) & Ty::LMASK;
        if constexpr (Ty::HIGH > 0) {
            u0 |= (h & Ty::HMASK) << Ty::LOW;
            u1 |= ((h >> Ty::HIGH) & Ty::HMASK) << Ty::LOW;
        }
        return pack_bf2(gguf_value<TYPE>(u0, s, mn), gguf_value<TYPE>(u1, s, mn));
    }
    // A' registers of W row `row` for k16 step ks of the stage (srow: its q bytes, hrow: its
    // qh bytes): lo = positions 2t, 2t + 1 of the step, hi = 2t + 8, 2t + 9. k % 32 == 0, so
    // a step the tile runs lies inside k.
    __device__ __forceinline__ void frag(const unsigned char *srow, const unsigned char *hrow,
                                         int row, int ks, int t, const Scale &sc,
                                         unsigned int &lo, unsigned int &hi) const {
        unsigned int la, lb, ha = 0u, hb = 0u;
        if constexpr (Ty::LOW == 4) {        // 8 bytes a step: byte t of each word
            const uint2 w = *reinterpret_cast<const uint2 *>(srow + 8 * ks);
            la = w.x >> (8 * t);
            lb = w.y >> (8 * t);
        } else if constexpr (Ty::LOW == 2) { // 4 bytes a step: bits 4t.., 16 + 4t..
            const unsigned int w =
                *reinterpret_cast<const unsigned int *>(srow + 4 * ks) >> (4 * t);
            la = w;
            lb = w >> 16;
        } else {                             // 16 bytes a step, swizzled: bytes 2t.., 8 + 2t..
            const unsigned char *c = srow + 16 * swz(row, ks) + 4 * (t >> 1);
            const int sh = 16 * (t & 1);
            la = *reinterpret_cast<const unsigned int *>(c) >> sh;
            lb = *reinterpret_cast<const unsigned int *>(c + 8) >> sh;
        }
        if constexpr (Ty::HIGH == 1) {       // 2 bytes a step: bits 2t.., 8 + 2t..
            const unsigned int h =
                *reinterpret_cast<const unsigned short *>(hrow + 2 * ks) >> (2 * t);
            ha = h;
            hb = h >> 8;
        } else if constexpr (Ty::HIGH == 2) {   // 4 bytes a step: bits 4t.., 16 + 4t..
            const unsigned int h =
                *reinterpret_cast<const unsigned int *>(hrow + 4 * ks) >> (4 * t);
            ha = h;
            hb = h >> 16;
        }
        const int i = ks * NSS / 4;          // the step's block / sub-block of the stage
        lo = pair(la, ha, sc.s[i], sc.mn[i]);
        hi = pair(lb, hb, sc.s[i], sc.mn[i]);
    }
};

// The tensor-core tile's W (gemm_tc_tile.cuh's policy interface, as gemm_q.cu's QuantRows):
// per stage, row r's q bytes at r * RBQ and qh bytes at BN * RBQ + r * RBH of the ring slot.
template <class T, int TYPE>
struct GgufRows {
    typedef GgufType<TYPE> Ty;
    static constexpr bool kDequant = true;
    static constexpr int RBQ = T::BK * Ty::LOW / 8, RBH = T::BK * Ty::HIGH / 8;
    static constexpr int UQ = RBQ < 16 ? RBQ : 16;              // q copy size (8 or 16)
    static constexpr int UH = RBH ? gguf_hi_unit<TYPE>(RBH) : 4;  // qh copy size
    static constexpr int NQ = T::BN * RBQ / UQ, NH = T::BN * RBH / UH;   // copies a stage
    static constexpr int QPT = (NQ + T::THREADS - 1) / T::THREADS;
    static constexpr int HPT = (NH + T::THREADS - 1) / T::THREADS;
    static constexpr int STAGE_ELEMS = T::BN * (RBQ + RBH);    // ring bytes a stage
    static constexpr int RUNS = T::BK / 16;                    // 16-element runs of a row
    static_assert(T::BN * RUNS == T::THREADS, "one run of a stage per thread");
    static_assert(STAGE_ELEMS % 16 == 0 && (T::BN * RBQ) % 16 == 0, "16-byte ring slots");
    typedef unsigned char Ring;

    const unsigned char *q, *qh, *meta;
    int q_row, qh_row, meta_row;
    const unsigned char *qsrc[QPT];
    int qdst[QPT];                 // -1: no copy (past the rows or the copy count)
    const unsigned char *hsrc[HPT > 0 ? HPT : 1];
    int hdst[HPT > 0 ? HPT : 1];
    int col0, cols;

    __device__ __forceinline__ void init(const unsigned char *q_, const unsigned char *qh_,
                                         const unsigned char *meta_, int k) {
        typedef GgufRowBytes<TYPE> B;
        q = q_;
        qh = qh_;
        meta = meta_;
        q_row = B::q(k);
        qh_row = B::qh(k);
        meta_row = B::meta(k);
    }
    __device__ __forceinline__ bool aligned() const { return true; }  // the launcher checks
    __device__ __forceinline__ void setup(int tid, int col0_, int cols_, int) {
        col0 = col0_;
        cols = cols_;
#pragma unroll
        for (int i = 0; i < QPT; ++i) {
            const int c = tid + i * T::THREADS, r = c / (RBQ / UQ), u = c % (RBQ / UQ);
            const bool in = c < NQ && r < cols;
            qdst[i] = in ? r * RBQ + u * UQ : -1;
            qsrc[i] = q + (long long)(col0 + (in ? r : 0)) * q_row + u * UQ;
        }
        if constexpr (HPT > 0) {
#pragma unroll
            for (int i = 0; i < HPT; ++i) {
                const int c = tid + i * T::THREADS, r = c / (RBH / UH), u = c % (RBH / UH);
                const bool in = c < NH && r < cols;
                hdst[i] = in ? T::BN * RBQ + r * RBH + u * UH : -1;
                hsrc[i] = qh + (long long)(col0 + (in ? r : 0)) * qh_row + u * UH;
            }
        }
    }
    // Stage kt's bytes of this thread's copies; past the (padded) row: zero-filled. The
    // thread with a row's first q copy prefetches the L1 line of the row's stage scales.
    __device__ __forceinline__ void load(unsigned char *slot, int kt, int, bool) {
#pragma unroll
        for (int i = 0; i < QPT; ++i) {
            if (qdst[i] < 0) continue;
            const bool in = kt * RBQ + qdst[i] % RBQ < q_row;
            cp_async_n<UQ>(slot + qdst[i], in ? qsrc[i] + kt * RBQ : qsrc[i], in ? UQ : 0);
            if (qdst[i] % RBQ == 0)
                prefetch_l1(meta + (long long)(col0 + qdst[i] / RBQ) * meta_row +
                            (kt * T::BK / Ty::QK) * Ty::META);
        }
        if constexpr (HPT > 0) {
#pragma unroll
            for (int i = 0; i < HPT; ++i) {
                if (hdst[i] < 0) continue;
                const bool in = kt * RBH + (hdst[i] - T::BN * RBQ) % RBH < qh_row;
                cp_async_n<UH>(slot + hdst[i], in ? hsrc[i] + kt * RBH : hsrc[i], in ? UH : 0);
            }
        }
    }
    // This thread's run of stage kt: row tid / RUNS, elements 16 (tid % RUNS) .. + 15 of the
    // stage (zeros past k; k % 32 == 0, so a run is wholly inside or past it).
    __device__ __forceinline__ void dequant(bf16 *sd, const unsigned char *slot, int kt, int k) {
        const int r = threadIdx.x / RUNS, p = threadIdx.x % RUNS;
        if (r >= cols) return;   // rows past n are never read (clamped)
        const int k0 = kt * T::BK + 16 * p;
        uint4 o0 = make_uint4(0u, 0u, 0u, 0u), o1 = o0;
        if (k0 < k) {
            float s[1], mn[1] = {0.f};
            gguf_scales<TYPE, 1>(meta + (long long)(col0 + r) * meta_row + (k0 / Ty::QK) * Ty::META,
                                 (k0 % Ty::QK) / Ty::SUB, s, mn);
            const uint4 lo = gguf_lo_bits<Ty::LOW, false>(slot + r * RBQ, p);
            unsigned int hi = 0u;
            if constexpr (Ty::HIGH > 0)
                hi = gguf_hi_bits<Ty::HIGH, false>(slot + T::BN * RBQ + r * RBH, p);
            gguf_run16<TYPE>(lo, hi, s[0], mn[0], o0, o1);
        }
        *reinterpret_cast<uint4 *>(sd + smem_off<T>(r, 2 * p)) = o0;
        *reinterpret_cast<uint4 *>(sd + smem_off<T>(r, 2 * p + 1)) = o1;
    }
};

typedef TcTile<64, 32, 64, 2, 2, 4> GgufTile64x32;
typedef TcTile<128, 128, 32, 2, 4, 3> GgufTile128x128;

#define GEMM_GGUF_TILE_ENTRY(NAME, TYPE, OUT, YT, YB, YF, TNAME, MIN_BLOCKS)                 \
    extern "C" __global__ void __launch_bounds__(GgufTile##TNAME::THREADS, MIN_BLOCKS)        \
        gemm_gguf_##NAME##_##OUT##_##TNAME(YT *y, const bf16 *x, const unsigned char *q,      \
                                           const unsigned char *qh, const unsigned char *meta, \
                                           int m, int n, int k, int ldy) {                   \
        typedef GgufTile##TNAME Tile;                                                          \
        typedef GgufRows<Tile, TYPE> Src;                                                      \
        __shared__ __align__(128) bf16 sa[Tile::STAGES * Tile::BM * Tile::BK];                 \
        __shared__ __align__(128) unsigned char sw[Tile::STAGES * Src::STAGE_ELEMS];           \
        __shared__ __align__(128) bf16 sd[Tile::BN * Tile::BK];                                \
        Src src;                                                                               \
        src.init(q, qh, meta, k);                                                              \
        gemm_tc_tile<Tile>(sa, sw, sd, YB, YF, x, src, m, n, k, ldy);                          \
    }

#define GEMM_GGUF_DECODE_ENTRY(NAME, TYPE, OUT, YT, YB, YF)                                   \
    extern "C" __global__ void __launch_bounds__(32, 4) gemm_gguf_##NAME##_##OUT##_16x16(     \
        YT *y, const bf16 *x, const unsigned char *q, const unsigned char *qh,                \
        const unsigned char *meta, int m, int n, int k, int ldy) {                            \
        typedef GgufFormat<TYPE> F;                                                            \
        __shared__ __align__(128) bf16 sx[F::STAGES * 16 * 64];                                \
        __shared__ __align__(128) unsigned char sw[F::STAGES * 16 * (F::RB + F::HI_BYTES)];    \
        __shared__ __align__(16) float stab[F::TABLE];                                         \
        const F f = F::make(q, qh, meta, stab, k);                                             \
        gemm_q_decode<F, F::STAGES>(sx, sw, YB, YF, x, f, m, n, k, ldy);                       \
    }

// Every entry of one type: {bf16, fp32} x {16x16, 64x32, 128x128}.
#define GEMM_GGUF_ENTRIES(NAME, TYPE)                                                         \
    GEMM_GGUF_DECODE_ENTRY(NAME, TYPE, bf16, bf16, y, nullptr)                                \
    GEMM_GGUF_DECODE_ENTRY(NAME, TYPE, fp32, float, nullptr, y)                               \
    GEMM_GGUF_TILE_ENTRY(NAME, TYPE, bf16, bf16, y, nullptr, 64x32, 1)                        \
    GEMM_GGUF_TILE_ENTRY(NAME, TYPE, fp32, float, nullptr, y, 64x32, 1)                       \
    GEMM_GGUF_TILE_ENTRY(NAME, TYPE, bf16, bf16, y, nullptr, 128x128, 2)                      \
    GEMM_GGUF_TILE_ENTRY(NAME, TYPE, fp32, float, nullptr, y, 128x128, 2)
