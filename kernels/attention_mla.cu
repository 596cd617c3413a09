// Multi-head latent attention (DeepSeek-V2/V3 MLA) over the paged latent KV cache, in the
// absorbed form: the caller folds W_UK into the queries (mla_project.cu: mla_absorb_q) and
// applies W_UV after (mla_expand_v), so every head attends over the same cached rows.
//
//   row_t = cache[table[t / bs] * bs + t % bs]           bf16 [R + rope] (latent | roped key)
//   out[r, h, :] = bf16( sum_t softmax_t(scale * qa[r, h] . row_t) * row_t[:R] ),  t < L_r
//
// Shapes: qa bf16 [n_rows, H, R + rope]; cache bf16 [blocks, bs, R + rope]; block_tables int32
// [seqs, max_blocks]; kv_lens int32 [seqs]; out bf16 [n_rows, H, R]; workspace float32
// acc [n_rows, H, max_splits, R] then (m, l) [n_rows, H, max_splits, 2].
// Rows and sequences: without qo_indptr row r is sequence r (decode); with it (int32
// [n_seqs + 1], prefill / verify) launch row r is query row g = row_base + r of the sequence
// s with qo_indptr[s] <= g < qo_indptr[s + 1] and sees L = kv_lens[s] - (qo_indptr[s + 1] - 1
// - g) positions (causal).
//
// Split-K as the decode attention (attention.cu): each row's positions are cut into fixed
// MLA_SPLIT (256)-token pieces of absolute positions, so a row's number of splits and every
// sum depend only on its own length: its bits do not depend on the batch or on which path
// (decode, verify, prefill) computes it.
//   attention_mla_split: grid (max_splits, n_rows, ceil(H / MLA_HEADS)), block 256 (8 warps).
//     The CTA stages its MLA_HEADS (8) heads' queries (float32, shared) and reads each of the
//     split's latent rows once for all of them: warp w takes tokens 4w..4w+3, then 32 later,
//     ...; a lane multiplies its elements d = lane, lane + 32, ... of the 4 rows into 4 x 8
//     per-head sums (each staged query element read once for 4 tokens; butterfly-reduced),
//     giving the base-2 scores s = scale * log2(e) * qa . row. Warp j
//     then takes head j: m = max s, p = exp2(s - m), l = sum p (lane-strided, butterfly).
//     Last, thread c accumulates acc[j][c] = sum_t p[j][t] * row_t[c] for c = tid, tid + 256,
//     ... < R in increasing t (the weights of 4 tokens in one 16-byte broadcast load): the
//     split's rows are read a second time here, from L1/L2 (a split is 256 rows of at most
//     2 KB). A split past the row's length writes nothing.
//   attention_mla_combine: grid (n_rows, H), block 256: M = max m_s, L = sum_s l_s 2^(m_s - M)
//     and out[c] = bf16(sum_s acc_s[c] 2^(m_s - M) / L), splits in increasing order.
// Limits (checked by the launcher, ops/attention_mla.py): R + rope <= 1024, R % 32 == 0.
#include "common.cuh"

#define MLA_SPLIT 256
#define MLA_HEADS 8
#define MLA_THREADS 256
#define MLA_MAX_DIM 1024
#define MLA_TOK 4       // tokens a warp scores at once

__device__ __forceinline__ int mla_row_seq(const int *kv_lens, const int *qo_indptr,
                                           int n_seqs, int row_base, int r, int *len) {
    if (!qo_indptr) {
        *len = kv_lens[r];
        return r;
    }
    const int g = row_base + r;
    int s = 0;
    while (s + 1 < n_seqs && qo_indptr[s + 1] <= g) ++s;
    *len = kv_lens[s] - (qo_indptr[s + 1] - 1 - g);
    return s;
}

extern "C" __global__ void __launch_bounds__(MLA_THREADS)
attention_mla_split(float *workspace, const bf16 *qa, const bf16 *cache, const int *block_tables,
                 const int *kv_lens, const int *qo_indptr, int n_seqs, int row_base,
                 int n_rows, int num_heads, int R, int rope, int block_size,
                 int max_blocks, float scale_log2, int max_splits) {
    __shared__ float q_s[MLA_HEADS][MLA_MAX_DIM];
    __shared__ __align__(16) float p_s[MLA_HEADS][MLA_SPLIT];
    const int split = blockIdx.x, r = blockIdx.y, h0 = blockIdx.z * MLA_HEADS;
    const int D = R + rope, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int L;
    const int s = mla_row_seq(kv_lens, qo_indptr, n_seqs, row_base, r, &L);
    const int t0 = split * MLA_SPLIT;
    if (t0 >= L) return;
    const int nt = min(MLA_SPLIT, L - t0);
    const int nh = min(MLA_HEADS, num_heads - h0);
    for (int i = threadIdx.x; i < MLA_HEADS * D; i += MLA_THREADS) {
        const int j = i / D, d = i % D;
        q_s[j][d] = j < nh ? bf2f(qa[((long long)r * num_heads + h0 + j) * D + d]) : 0.f;
    }
    __syncthreads();
    const int *table = block_tables + (long long)s * max_blocks;
    // scores: a warp takes MLA_TOK tokens at a time (w * MLA_TOK, + 8 * MLA_TOK, ...), every
    // head from the same read of each row, each staged query element used MLA_TOK times
    for (int t = warp * MLA_TOK; t < nt; t += (MLA_THREADS / 32) * MLA_TOK) {
        const int cnt = min(MLA_TOK, nt - t);
        const bf16 *rows[MLA_TOK];
#pragma unroll
        for (int u = 0; u < MLA_TOK; ++u) {
            const int pos = t0 + t + (u < cnt ? u : 0);
            rows[u] = cache + ((long long)table[pos / block_size] * block_size +
                               pos % block_size) * D;
        }
        float acc[MLA_TOK][MLA_HEADS];
#pragma unroll
        for (int u = 0; u < MLA_TOK; ++u)
#pragma unroll
            for (int j = 0; j < MLA_HEADS; ++j) acc[u][j] = 0.f;
        for (int d = lane; d < D; d += 32) {
            float v[MLA_TOK];
#pragma unroll
            for (int u = 0; u < MLA_TOK; ++u) v[u] = bf2f(rows[u][d]);
#pragma unroll
            for (int j = 0; j < MLA_HEADS; ++j) {
                const float qv = q_s[j][d];
#pragma unroll
                for (int u = 0; u < MLA_TOK; ++u) acc[u][j] += qv * v[u];
            }
        }
        for (int u = 0; u < cnt; ++u) {
#pragma unroll
            for (int j = 0; j < MLA_HEADS; ++j) {
                const float sc = warp_sum(acc[u][j]);
                if (lane == 0) p_s[j][t + u] = sc * scale_log2;
            }
        }
    }
    __syncthreads();
    // per head: the split's max, exp2 and sum (warp j: head j)
    const long long base = ((long long)r * num_heads + h0) * max_splits + split;
    float *ws_acc = workspace;
    float *ws_ml = workspace + (long long)n_rows * num_heads * max_splits * R;
    if (warp < nh) {
        float m = NEG_INF;
        for (int t = lane; t < nt; t += 32) m = fmaxf(m, p_s[warp][t]);
        m = warp_max(m);
        float l = 0.f;
        for (int t = lane; t < nt; t += 32) {
            const float p = exp2f(p_s[warp][t] - m);
            p_s[warp][t] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            ws_ml[(base + (long long)warp * max_splits) * 2] = m;
            ws_ml[(base + (long long)warp * max_splits) * 2 + 1] = l;
        }
    }
    __syncthreads();
    // the weighted latent: thread c sums its columns over the split's tokens in order
    for (int c = threadIdx.x; c < R; c += MLA_THREADS) {
        float acc[MLA_HEADS];
#pragma unroll
        for (int j = 0; j < MLA_HEADS; ++j) acc[j] = 0.f;
        int t = 0;
        for (; t + 4 <= nt; t += 4) {   // four tokens' weights in one 16-byte shared load
            float v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int pos = t0 + t + u;
                v[u] = bf2f(cache[((long long)table[pos / block_size] * block_size +
                                   pos % block_size) * D + c]);
            }
#pragma unroll
            for (int j = 0; j < MLA_HEADS; ++j) {
                const float4 p = *reinterpret_cast<const float4 *>(&p_s[j][t]);
                acc[j] += p.x * v[0];
                acc[j] += p.y * v[1];
                acc[j] += p.z * v[2];
                acc[j] += p.w * v[3];
            }
        }
        for (; t < nt; ++t) {
            const int pos = t0 + t;
            const float v = bf2f(cache[((long long)table[pos / block_size] * block_size +
                                        pos % block_size) * D + c]);
#pragma unroll
            for (int j = 0; j < MLA_HEADS; ++j) acc[j] += p_s[j][t] * v;
        }
        for (int j = 0; j < nh; ++j) ws_acc[(base + (long long)j * max_splits) * R + c] = acc[j];
    }
}

extern "C" __global__ void __launch_bounds__(MLA_THREADS)
attention_mla_combine(bf16 *out, const float *workspace, const int *kv_lens,
                   const int *qo_indptr, int n_seqs, int row_base, int n_rows,
                   int num_heads, int R, int max_splits) {
    const int r = blockIdx.x, h = blockIdx.y;
    int L;
    mla_row_seq(kv_lens, qo_indptr, n_seqs, row_base, r, &L);
    const int k = (L + MLA_SPLIT - 1) / MLA_SPLIT;
    const long long base = ((long long)r * num_heads + h) * max_splits;
    const float *ws_ml = workspace + (long long)n_rows * num_heads * max_splits * R;
    float M = NEG_INF;
    for (int s = 0; s < k; ++s) M = fmaxf(M, ws_ml[(base + s) * 2]);
    float total = 0.f;
    for (int s = 0; s < k; ++s)
        total += ws_ml[(base + s) * 2 + 1] * exp2f(ws_ml[(base + s) * 2] - M);
    for (int c = threadIdx.x; c < R; c += MLA_THREADS) {
        float o = 0.f;
        for (int s = 0; s < k; ++s)
            o += workspace[(base + s) * R + c] * exp2f(ws_ml[(base + s) * 2] - M);
        out[((long long)r * num_heads + h) * R + c] = f2bf(o / total);
    }
}
