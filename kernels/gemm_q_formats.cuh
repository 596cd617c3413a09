// The quantized weight formats of kernels/gemm_q.cu (its header has the formulas and the
// device layouts): Int4Format (GPTQ / AWQ, repacked) and Fp8Format (float8_e4m3fn, block
// scales), each the W side of gemm_q_rows.cuh QuantRows and of gemm_q_decode.cuh's one-warp
// tile. Shared with kernels/moe_gemm_q.cu (the quantized experts), so the dense GEMM and
// the grouped expert GEMM dequantize with one formula. Header only.
#pragma once
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
