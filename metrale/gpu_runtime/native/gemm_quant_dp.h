// Decode (m <= kDirectRows) on quantized W with AVX-512 BF16, included by gemm_quant.cpp:
// the same DpStep tile as gemm_core.h's `tile` (the same VDPBF16PS on the same operands in
// the same order, so the same bits), with W's blocks looked up in a table instead of
// dequantized one by one. A table holds every value one scale can produce, so it is built
// once per chunk of blocks that share the scale and reused for each block of the chunk:
//   4-bit  the 16 values bf16_rn((c - z) s) of a (row, group), gemm_quant.cpp's q4_table:
//          one table per tile row, rebuilt every group_size / 32 blocks; a block is then
//          q4_block_words, 2 operations on its 16 bytes (32 word indices) and one vpermw.
//   FP8    bf16_rn(f32_rn(e4m3(c) s)) for the 128 magnitudes c of a scale block, as
//          fp8_block_words rounds them, kept as the low and the high bytes of the words
//          (two 128-byte tables): shared by the tile's rows when they have one scale row
//          (128-row blocks: all but the tiles that straddle a block's edge, which take the
//          per-block loads), rebuilt every block_k / 32 blocks. Two blocks (64 codes) at a
//          time: one byte permute, two vpermi2b, the sign, two unpacks. The code's sign bit
//          flips the value's (RNE and e4m3 are symmetric, zeros included; a NaN code gives
//          a NaN either way).
// At m = 1 on one Zen 4 core the per-block dequantization cost 2-3x the VDPBF16PS; with the
// tables a 4-bit block is 4 vector operations with its VDPBF16PS instead of ~14, an FP8
// block 3-4 instead of ~15.
#pragma once

#include "gemm_dp_view.h"

#if defined(MD_DP)

namespace md {
namespace {

// 4-bit W without act-order, group_size % 32 == 0: one table per row.
struct Q4View {
    WQ4<DpStep> w;
    static constexpr bool kPerRow = true, kPairs = false;
    static constexpr int kBlocksPerLine = 4;   // 16 bytes a block
    struct State {
        __m512i table;   // q4_table of the row's group
    };
    Q4View rows(int64_t r0) const { return {w.rows(r0)}; }
    bool shared(int) const { return true; }
    int64_t full_blocks() const { return w.k / 32; }
    int64_t chunk_end(int64_t blk, int64_t b1) const {
        const int64_t per = w.group_size / 32;
        return std::min(b1, (div_pow2(blk, per) + 1) * per);
    }
    __attribute__((always_inline)) void refresh(int b, int64_t blk, State &st) const {
        const int64_t g = b * w.groups + div_pow2(32 * blk, w.group_size);
        st.table = q4_table(w.scales[g], w.zeros[g]);
    }
    __attribute__((always_inline)) v16f block(int b, int64_t blk, const State &st) const {
        return reinterpret_cast<v16f>(q4_block_words(w.q + b * w.row_bytes + 16 * blk, st.table));
    }
};

// 4-bit W with act-order (a group per position, gidx), at most 64 x kTables64 groups (1, 2
// or 4: up to 256): no table of values (a block's positions have up to 32 groups), but one of
// the groups' FP16 scales and zero points per row, looked up for the block's 32 positions by
// vpermi2w on the groups' word indices (one per 64 groups, then blends on the index's bits
// 6 and 7), then (c - z) s computed exactly as half_bits does, rounded by one
// vcvtne2ps2bf16. About 20 operations a block up to 64 groups, 30 up to 256 (the scalar
// path: ~40x that).
// gidx of a tile's part as word indices, built when a tile of another part starts (one
// thread's)
struct ActGroups {
    std::vector<uint16_t> of_pos;
    int64_t part = -1;
};

template <int kTables64>
struct Q4ActView {
    WQ4<DpStep> w;
    ActGroups *groups;
    static constexpr int kTables = 2 * kTables64;
    struct State {
        __m512i s[kTables], z[kTables];   // FP16 scale and zero of groups 32 t .. 32 t + 31
    };
    static constexpr bool kPerRow = true, kPairs = false;
    static constexpr int kBlocksPerLine = 4;   // 16 bytes a block
    Q4ActView rows(int64_t r0) const { return {w.rows(r0), groups}; }
    bool shared(int rows) const {   // one part (gidx table) for the tile
        for (int b = 1; b < rows; b++)
            if (w.gidx_row[b] != w.gidx_row[0]) return false;
        return true;
    }
    int64_t full_blocks() const { return w.k / 32; }
    int64_t chunk_end(int64_t, int64_t b1) const { return b1; }
    // the first n of 32 lanes (n <= 0: none; masked-off lanes are not read)
    static __mmask32 first(int64_t n) {
        return n >= 32 ? ~__mmask32(0) : n <= 0 ? __mmask32(0) : __mmask32((1u << n) - 1);
    }
    // the FP16 scales of 32 groups from p, n of them there (zero words past them)
    static __m512i half_words(const uint16_t *p, int64_t n) {
        return _mm512_maskz_loadu_epi16(first(n), p);
    }
    static __m512i zero_words(const uint8_t *p, int64_t n) {   // uint8 zeros as FP16 (exact)
        const __m512i z = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(first(n), p));
        const __m256i lo = _mm512_cvtps_ph(
            _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(z))), _MM_FROUND_TO_NEAREST_INT);
        const __m256i hi = _mm512_cvtps_ph(
            _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(z, 1))),
            _MM_FROUND_TO_NEAREST_INT);
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    void refresh(int b, int64_t, State &st) const {
        if (b == 0 && groups->part != w.gidx_row[0]) {
            groups->part = w.gidx_row[0];
            groups->of_pos.resize(size_t(w.k));
            const int32_t *g = w.table(0);
            for (int64_t i = 0; i < w.k; i++) groups->of_pos[size_t(i)] = uint16_t(g[i]);
        }
        const uint16_t *sr = w.scales + b * w.groups;
        const uint8_t *zr = w.zeros + b * w.groups;
        for (int t = 0; t < kTables; t++) {   // (no pointer formed past the groups)
            const bool any = w.groups > 32 * t;
            st.s[t] = any ? half_words(sr + 32 * t, w.groups - 32 * t) : _mm512_setzero_si512();
            st.z[t] = any ? zero_words(zr + 32 * t, w.groups - 32 * t) : _mm512_setzero_si512();
        }
    }
    // the words of groups g (word indices) from tables t[]
    static __m512i lookup(__m512i g, const __m512i *t) {
        __m512i r[kTables64];   // groups 64 p .. 64 p + 63 by index bits 0-5
        MD_DP_UNROLL for (int p = 0; p < kTables64; p++)
            r[p] = _mm512_permutex2var_epi16(t[2 * p], g, t[2 * p + 1]);
        if constexpr (kTables64 == 1) return r[0];
        const __mmask32 bit6 = _mm512_test_epi16_mask(g, _mm512_set1_epi16(64));
        const __m512i lo = _mm512_mask_blend_epi16(bit6, r[0], r[1]);
        if constexpr (kTables64 == 2) return lo;
        const __m512i hi = _mm512_mask_blend_epi16(bit6, r[kTables64 - 2], r[kTables64 - 1]);
        return _mm512_mask_blend_epi16(_mm512_test_epi16_mask(g, _mm512_set1_epi16(128)), lo, hi);
    }
    // (c - z) s of 16 positions: codes, zero and scale words in the low (h = 0) or high half
    template <int H>
    static __m512 half_values(__m512i codes, __m512i z, __m512i s) {
        const auto half = [](__m512i v) {
            return H == 0 ? _mm512_castsi512_si256(v) : _mm512_extracti64x4_epi64(v, 1);
        };
        const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(half(codes)));
        return _mm512_mul_ps(_mm512_sub_ps(c, _mm512_cvtph_ps(half(z))), _mm512_cvtph_ps(half(s)));
    }
    __attribute__((always_inline)) v16f block(int b, int64_t blk, const State &st) const {
        const __m512i g = _mm512_loadu_si512(groups->of_pos.data() + 32 * blk);
        const __m512i s = lookup(g, st.s), z = lookup(g, st.z);
        const __m512i codes = _mm512_and_si512(   // the 32 codes in position order, as words
            q4_nibble_words(w.q + b * w.row_bytes + 16 * blk), _mm512_set1_epi16(15));
        return reinterpret_cast<v16f>(_mm512_cvtne2ps_pbh(half_values<1>(codes, z, s),
                                                          half_values<0>(codes, z, s)));
    }
};

// The e4m3 magnitudes 0..127 as float32 (exact: 2^(e - 7) (1 + m / 8), or m 2^-9 for e = 0;
// 127, the NaN code, as 0 here: its word is set to 0x7FFF after the conversion).
struct E4m3Magnitudes {
    alignas(64) float f[128];
    constexpr E4m3Magnitudes() : f{} {
        for (int c = 0; c < 127; c++) {
            const int e = c >> 3, m = c & 7;
            float v = e == 0 ? float(m) : float(8 + m);   // times 2^-9, or 2^(e - 10)
            for (int i = 0; i < (e == 0 ? 9 : 10 - e); i++) v *= 0.5f;
            for (int i = 0; i < e - 10; i++) v *= 2.f;
            f[c] = v;
        }
    }
};
constexpr E4m3Magnitudes kE4m3{};

// Byte indices: vpermt2b's picks of the low (even) and high (odd) bytes of 64 words, and
// kSpread, which puts the codes of two blocks where vpunpck{l,h}bw takes them in order:
// byte 16 L + i <- code 8 L + i (the first block), 16 L + 8 + i <- 32 + 8 L + i.
struct ByteIndices {
    alignas(64) uint8_t even[64], odd[64], spread[64];
    constexpr ByteIndices() : even{}, odd{}, spread{} {
        for (int i = 0; i < 64; i++) {
            even[i] = uint8_t(2 * i);
            odd[i] = uint8_t(2 * i + 1);
            spread[i] = uint8_t((i & 8 ? 32 : 0) + 8 * (i >> 4) + (i & 7));
        }
    }
};
constexpr ByteIndices kBytes{};

// FP8 W, block_k % 32 == 0: one table for the tile when its rows share a scale row, as the
// low and high bytes of the 128 magnitudes' words (two vpermi2b of 128 entries each). Two
// blocks (64 codes) at a time: spread, the two lookups, the sign into the high bytes, and
// the bytes interleaved into the two blocks' words (6 operations for 64 weights).
struct F8View {
    WF8<DpStep> w;
    static constexpr bool kPerRow = false, kPairs = true;
    static constexpr int kBlocksPerLine = 2;   // 32 bytes a block
    struct State {
        __m512i lo0, lo1, hi0, hi1;   // bytes of magnitudes 0..63 and 64..127
    };
    F8View rows(int64_t r0) const { return {w.rows(r0)}; }
    bool shared(int rows) const {
        for (int b = 1; b < rows; b++)
            if (w.scale_row[b] != w.scale_row[0]) return false;
        return true;
    }
    int64_t full_blocks() const { return w.k / 32; }
    int64_t chunk_end(int64_t blk, int64_t b1) const {
        const int64_t per = w.block_k / 32;
        return std::min(b1, (div_pow2(blk, per) + 1) * per);
    }
    // bf16_rn(f32_rn(e4m3(c) s)) for c = 0..127, fp8_block_words' roundings (the NaN code
    // 0x7FFF as there)
    void refresh(int, int64_t blk, State &st) const {
        const __m512 s = _mm512_set1_ps(
            w.scales[int64_t(w.scale_row[0]) * w.k_blocks + div_pow2(32 * blk, w.block_k)]);
        __m512i t[4];
        for (int i = 0; i < 4; i++)
            t[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_load_ps(kE4m3.f + 32 * i + 16), s),
                                               _mm512_mul_ps(_mm512_load_ps(kE4m3.f + 32 * i), s));
        t[3] = _mm512_mask_mov_epi16(t[3], __mmask32(1u << 31), _mm512_set1_epi16(0x7FFF));
        const __m512i even = _mm512_load_si512(kBytes.even), odd = _mm512_load_si512(kBytes.odd);
        st.lo0 = _mm512_permutex2var_epi8(t[0], even, t[1]);
        st.hi0 = _mm512_permutex2var_epi8(t[0], odd, t[1]);
        st.lo1 = _mm512_permutex2var_epi8(t[2], even, t[3]);
        st.hi1 = _mm512_permutex2var_epi8(t[2], odd, t[3]);
    }
    // blocks blk and blk + 1 from their 64 codes (c: loaded, or the one block zero-extended)
    __attribute__((always_inline)) void words(__m512i c, const State &st, v16f &w0, v16f &w1) const {
        const __m512i p = _mm512_permutexvar_epi8(_mm512_load_si512(kBytes.spread), c);
        const __m512i lo = _mm512_permutex2var_epi8(st.lo0, p, st.lo1);   // index bits 0-6
        __m512i hi = _mm512_permutex2var_epi8(st.hi0, p, st.hi1);
        hi = _mm512_xor_si512(hi, _mm512_and_si512(p, _mm512_set1_epi8(int8_t(0x80))));   // the sign
        w0 = reinterpret_cast<v16f>(_mm512_unpacklo_epi8(lo, hi));
        w1 = reinterpret_cast<v16f>(_mm512_unpackhi_epi8(lo, hi));
    }
    __attribute__((always_inline)) void pair(int b, int64_t blk, const State &st, v16f &w0,
                                             v16f &w1) const {
        words(_mm512_loadu_si512(w.q + b * w.row_bytes + 32 * blk), st, w0, w1);
    }
    __attribute__((always_inline)) v16f block(int b, int64_t blk, const State &st) const {
        v16f w0, w1;
        words(_mm512_zextsi256_si512(_mm256_loadu_si256(
                  reinterpret_cast<const __m256i *>(w.q + b * w.row_bytes + 32 * blk))),
              st, w0, w1);
        return w0;
    }
};

// gemm_core.h's `columns` asks these first at m <= kDirectRows (false: no view for W).
bool direct_quant(const Job<WQ4<DpStep>> &job, int64_t j_lo, int64_t j_hi) {
    if (job.w.gidx != nullptr) {
        if (job.w.groups > 256) return false;
        ActGroups groups;
        const auto run = [&](auto view) {
            direct_view(job.x, job.m, job.steps, view, job.out, j_lo, j_hi);
        };
        if (job.w.groups <= 64) run(Q4ActView<1>{job.w.rows(j_lo), &groups});
        else if (job.w.groups <= 128) run(Q4ActView<2>{job.w.rows(j_lo), &groups});
        else run(Q4ActView<4>{job.w.rows(j_lo), &groups});
        return true;
    }
    if (job.w.group_size % 32 != 0) return false;
    direct_view(job.x, job.m, job.steps, Q4View{job.w.rows(j_lo)}, job.out, j_lo, j_hi);
    return true;
}

bool direct_quant(const Job<WF8<DpStep>> &job, int64_t j_lo, int64_t j_hi) {
    if (job.w.block_k % 32 != 0) return false;
    direct_view(job.x, job.m, job.steps, F8View{job.w.rows(j_lo)}, job.out, j_lo, j_hi);
    return true;
}

}  // namespace
}  // namespace md

#endif  // MD_DP
