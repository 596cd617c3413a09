// The flash-attention tile shared by prefill_attention (attention.cu, paged KV) and
// dense_attention (dense_attention.cu, contiguous KV). Header only.
//
// One CTA of ATT_TILE_WARPS (4) warps, ATT_TILE_THREADS (128) threads, holds BQ query rows,
// RT per warp (tile_rows<MAXP>: RT = 8 for MAXP 1 and 2, 4 for MAXP 4; BQ = 4 * RT), of one
// query head, and walks the keys in tiles of ATT_TILE_KEYS (32). MAXP = bf16 pairs of the
// head dimension per lane = ceil(D/64), so D <= 64 * MAXP; D even.
//
// Shared memory, D * (4 * BQ + 128) bytes (the launchers' smem_bytes):
//   sQ [BQ][D]  fp32 query rows, unscaled; rows past the tile's last row are zero
//   sK [DP][32] the tile's K as bf16 pairs (DP = D/2), transposed: pair dp of key j at
//               column j ^ (dp & 31), so the 32 lanes reading pair dp hit 32 banks
//   sV [32][DP] the tile's V as bf16 pairs
//
// Per tile (keys kt .. kt+31), tile_attend: lane j scores key kt + j against the warp's RT
// rows (fp32 fma over the pairs in order), scales to base 2 (s * scale * log2 e; masked keys
// -inf), then the online softmax per row: m = max(m, warp max), p = exp2(s - m),
// l = l * exp2(m_old - m) + p (a per-lane partial sum), acc *= exp2(m_old - m); a fully
// masked row keeps m = -inf and uses 0 as the reference (no NaN). Then acc += p_j * v_j over
// the 32 keys, lane l owning output pairs l, l + 32, ... tile_store: out = acc / warp_sum(l)
// rounded once to bf16 (0 for a row with no visible key).
// Options of the paged prefill (attention.cu; dense_attention.cu leaves them off):
//   soft-capping (Gemma 2): the base-2 score is cap_l2 * tanh(s_raw * cap_in) with
//     cap_in = scale / cap, cap_l2 = cap * log2 e (cap * tanh(s_raw * scale / cap), base 2)
//     instead of s_raw * sl2; on when cap_l2 > 0.
//   a learned sink (gpt-oss): a per-head logit s (base 2: sink2 = s * log2 e) that joins
//     the softmax's denominator only: with M = max(m, sink2),
//     out = acc 2^(m-M) / (l 2^(m-M) + 2^(sink2-M)); off when sink2 = -inf.
// Twin of both: metrale/ops/attention_tile.py (`softcap_base2`, `attend_base2`'s sink).
// Twin: metrale/ops/attention_tile.py (`attend_base2`, the closed form these tiles compute).
#pragma once
#include "common.cuh"

#define ATT_TILE_THREADS 128
#define ATT_TILE_WARPS 4
#define ATT_TILE_KEYS 32
#define ATT_LOG2E 1.4426950408889634f

// Query rows per warp for a MAXP instance (its BQ = ATT_TILE_WARPS * tile_rows<MAXP>()).
template <int MAXP> __host__ __device__ constexpr int tile_rows() { return MAXP == 4 ? 4 : 8; }

// Index of pair dp of tile key j in the swizzled sK.
__device__ __forceinline__ int tile_k_index(int dp, int j) { return dp * 32 + (j ^ (dp & 31)); }

// Q rows 0 .. BQ-1 -> sQ (fp32), 32-bit loads of bf16 pairs: rows < rows_here from
// q_row(r) (a `const unsigned int *` to the row's pairs), the rest zero.
template <int BQ, class QRow>
__device__ __forceinline__ void tile_load_q_pairs(float *sQ, int D, int rows_here, QRow q_row) {
    const int DP = D >> 1;
    for (int i = threadIdx.x; i < BQ * DP; i += ATT_TILE_THREADS) {
        const int r = i / DP, dp = i - r * DP;
        unsigned int w = 0;
        if (r < rows_here) w = __ldg(q_row(r) + dp);
        sQ[r * D + 2 * dp] = bf_lo(w);
        sQ[r * D + 2 * dp + 1] = bf_hi(w);
    }
}

// The 32 keys kt .. kt+31 -> sK / sV, 32-bit loads: warp w loads keys w, w+4, ...; lanes over
// the pairs (coalesced 128 B). Key kp is read at element offset key_base(kp) of k and v when
// key_valid(kp) (never touching other rows), else zeros.
template <int MAXP, class KeyValid, class KeyBase>
__device__ __forceinline__ void tile_load_kv_pairs(unsigned int *sK, unsigned int *sV,
                                                   const bf16 *k, const bf16 *v, int kt,
                                                   int D, int lane, int warp, KeyValid key_valid,
                                                   KeyBase key_base) {
    const int DP = D >> 1;
#pragma unroll
    for (int jj = 0; jj < ATT_TILE_KEYS / ATT_TILE_WARPS; ++jj) {
        const int j = warp + jj * ATT_TILE_WARPS;
        const int kp = kt + j;
        const bool valid = key_valid(kp);
        const long long base = valid ? key_base(kp) : 0;
        const unsigned int *kr = reinterpret_cast<const unsigned int *>(k + base);
        const unsigned int *vr = reinterpret_cast<const unsigned int *>(v + base);
#pragma unroll
        for (int p = 0; p < MAXP; ++p) {
            const int dp = lane + 32 * p;
            if (dp < DP) {
                unsigned int kw = 0, vw = 0;
                if (valid) { kw = __ldg(kr + dp); vw = __ldg(vr + dp); }
                sK[tile_k_index(dp, j)] = kw;
                sV[j * DP + dp] = vw;
            }
        }
    }
}

// Running state of the warp's RT rows: max m (warp-uniform), per-lane partial sum l, and
// the lane's output pairs acc[row][p] = (x, y) of pair lane + 32p.
template <int RT, int MAXP>
struct TileRows {
    float m[RT], l[RT], acc[RT][MAXP][2];
};

template <int RT, int MAXP>
__device__ __forceinline__ void tile_rows_init(TileRows<RT, MAXP> &t) {
#pragma unroll
    for (int i = 0; i < RT; ++i) {
        t.m[i] = NEG_INF;
        t.l[i] = 0.f;
#pragma unroll
        for (int p = 0; p < MAXP; ++p) t.acc[i][p][0] = t.acc[i][p][1] = 0.f;
    }
}

// A raw score q.k as a base-2 logit: s * sl2, or soft-capped cap_l2 * tanh(s * cap_in)
// when cap_l2 > 0 (see the header).
__device__ __forceinline__ float att_logit2(float s, float sl2, float cap_in, float cap_l2) {
    return cap_l2 > 0.f ? cap_l2 * tanhf(s * cap_in) : s * sl2;
}

// 1 / denominator of a finished row: row max m, lane-summed l, the sink's base-2 logit
// sink2 (-inf: none); the factor to multiply acc by (0 for a row with no visible key).
__device__ __forceinline__ float att_out_scale(float m, float lt, float sink2) {
    if (sink2 == NEG_INF) return lt > 0.f ? 1.f / lt : 0.f;
    if (m == NEG_INF) return 0.f;
    const float M = fmaxf(m, sink2), a = exp2f(m - M);
    return a / (lt * a + exp2f(sink2 - M));
}

// One 32-key tile (sK / sV filled, keys kt .. kt+31) for the warp's rows wr0 .. wr0+RT-1.
// visible(i, kp): whether row wr0 + i sees key kp. sl2 = scale * log2(e); cap_in / cap_l2:
// soft-capping (cap_l2 <= 0: off; see the header).
template <int RT, int MAXP, class Visible>
__device__ __forceinline__ void tile_attend(TileRows<RT, MAXP> &t, const float *sQ,
                                            const unsigned int *sK, const unsigned int *sV,
                                            int D, int lane, int wr0, int kt, float sl2,
                                            Visible visible, float cap_in = 0.f,
                                            float cap_l2 = 0.f) {
    const int DP = D >> 1;
    // scores: lane = key kt + lane, RT rows of this warp
    float sc[RT];
#pragma unroll
    for (int i = 0; i < RT; ++i) sc[i] = 0.f;
#pragma unroll 4
    for (int dp = 0; dp < DP; ++dp) {
        const unsigned int kw = sK[tile_k_index(dp, lane)];
        const float kx = bf_lo(kw), ky = bf_hi(kw);
#pragma unroll
        for (int i = 0; i < RT; ++i) {
            const float2 qq = *reinterpret_cast<const float2 *>(sQ + (wr0 + i) * D + 2 * dp);
            sc[i] = fmaf(qq.x, kx, sc[i]);
            sc[i] = fmaf(qq.y, ky, sc[i]);
        }
    }
    const int kp = kt + lane;
    float pr[RT];
#pragma unroll
    for (int i = 0; i < RT; ++i) {
        const float sv = visible(i, kp) ? att_logit2(sc[i], sl2, cap_in, cap_l2) : NEG_INF;
        const float mn = fmaxf(t.m[i], warp_max(sv));
        const float mu = (mn == NEG_INF) ? 0.f : mn;
        const float alpha = exp2f(t.m[i] - mu);
        pr[i] = exp2f(sv - mu);
        t.l[i] = t.l[i] * alpha + pr[i];  // per-lane partial sum, reduced in tile_store
        t.m[i] = mn;
#pragma unroll
        for (int p = 0; p < MAXP; ++p) { t.acc[i][p][0] *= alpha; t.acc[i][p][1] *= alpha; }
    }
    // P.V: lane owns output pairs lane + 32p
#pragma unroll 4
    for (int j = 0; j < ATT_TILE_KEYS; ++j) {
        float vx[MAXP], vy[MAXP];
#pragma unroll
        for (int p = 0; p < MAXP; ++p) {
            const int dp = lane + 32 * p;
            const unsigned int vw = dp < DP ? sV[j * DP + dp] : 0u;
            vx[p] = bf_lo(vw);
            vy[p] = bf_hi(vw);
        }
#pragma unroll
        for (int i = 0; i < RT; ++i) {
            const float pj = __shfl_sync(0xffffffffu, pr[i], j);
#pragma unroll
            for (int p = 0; p < MAXP; ++p) {
                t.acc[i][p][0] = fmaf(pj, vx[p], t.acc[i][p][0]);
                t.acc[i][p][1] = fmaf(pj, vy[p], t.acc[i][p][1]);
            }
        }
    }
}

// out row wr0 + i (< rows_here) = acc / sum over lanes of l, as bf16 pairs at out_row(r)
// (an `unsigned int *` to the row's pairs of this head). Every lane of the warp must call it.
// sink2: the head's sink logit in base 2 (-inf: none; see the header).
template <int RT, int MAXP, class OutRow>
__device__ __forceinline__ void tile_store(const TileRows<RT, MAXP> &t, int D, int lane, int wr0,
                                           int rows_here, OutRow out_row,
                                           float sink2 = NEG_INF) {
    const int DP = D >> 1;
#pragma unroll
    for (int i = 0; i < RT; ++i) {
        const float lt = warp_sum(t.l[i]);
        const int r = wr0 + i;
        if (r < rows_here) {
            const float inv = att_out_scale(t.m[i], lt, sink2);
            unsigned int *o = out_row(r);
#pragma unroll
            for (int p = 0; p < MAXP; ++p) {
                const int dp = lane + 32 * p;
                if (dp < DP) o[dp] = pack_bf2(t.acc[i][p][0] * inv, t.acc[i][p][1] * inv);
            }
        }
    }
}
