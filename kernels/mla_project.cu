// The per-token steps of DeepSeek's multi-head latent attention around attention_mla.cu.
//
// mla_rope_cache: grid (n_tokens), block 128. Token t at position p = positions[t]:
//   the qk_rope tail of every head of q [n, H, nope + rope] turned in place, and the shared
//   key kr [n, rope] turned into the cache row [c | kr'] at slot_mapping[t] (< 0: not
//   written), c [n, R] the normalized latent copied as is. cos/sin: table float32
//   [max_positions, rope] (cos in [:rope/2], sin in [rope/2:]). Pair i is (x[2i], x[2i+1])
//   with `pairs_adjacent`, else (x[i], x[i + rope/2]):
//       x' = a cos - b sin,  y' = b cos + a sin    (each * and - / + one float32 rounding)
//   A thread turns whole pairs, so the in-place update reads nothing another thread writes.
// mla_absorb_q: grid (n_tokens, H), block 128. qa[t, h, c] = bf16(sum_d q[t, h, d] *
//   kv_b[h * (nope + v) + d, c]) for c < R (d < nope in order, float32), then
//   qa[t, h, R + i] = q[t, h, nope + i]. Thread c reads column c of W_UK_h: coalesced.
// mla_expand_v: grid (n_tokens, H), block 128 (4 warps). o[t, h, v] = bf16(sum_j lat[t, h, j]
//   * kv_b[h * (nope + v_dim) + nope + v, j]): warp w takes v = w, w + 4, ...; lane-strided
//   products, butterfly sum.
// Every output is a function of its own token's row and the weights: batch-invariant.
#include "common.cuh"

#define MLA_PROJECT_THREADS 128
#define MLA_PROJECT_MAX_NOPE 1024

extern "C" __global__ void __launch_bounds__(MLA_PROJECT_THREADS)
mla_rope_cache(bf16 *q, const bf16 *c, const bf16 *kr, const int *positions,
               const float *table, bf16 *cache, const int *slot_mapping, int n_tokens,
               int num_heads, int nope, int rope, int R, int max_positions,
               int pairs_adjacent) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int p = positions[t], half = rope / 2;
    if (p < 0 || p >= max_positions) return;   // the launcher's caller checks positions
    const float *cs = table + (long long)p * rope;
    const int qd = nope + rope;
    // q: pairs of every head
    for (int i = threadIdx.x; i < num_heads * half; i += MLA_PROJECT_THREADS) {
        const int h = i / half, k = i % half;
        bf16 *x = q + ((long long)t * num_heads + h) * qd + nope;
        const int ia = pairs_adjacent ? 2 * k : k, ib = pairs_adjacent ? 2 * k + 1 : k + half;
        const float a = bf2f(x[ia]), b = bf2f(x[ib]), co = cs[k], si = cs[half + k];
        x[ia] = f2bf(__fsub_rn(__fmul_rn(a, co), __fmul_rn(b, si)));
        x[ib] = f2bf(__fadd_rn(__fmul_rn(b, co), __fmul_rn(a, si)));
    }
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    bf16 *row = cache + (long long)slot * (R + rope);
    for (int i = threadIdx.x; i < R; i += MLA_PROJECT_THREADS) row[i] = c[(long long)t * R + i];
    for (int k = threadIdx.x; k < half; k += MLA_PROJECT_THREADS) {
        const bf16 *x = kr + (long long)t * rope;
        const int ia = pairs_adjacent ? 2 * k : k, ib = pairs_adjacent ? 2 * k + 1 : k + half;
        const float a = bf2f(x[ia]), b = bf2f(x[ib]), co = cs[k], si = cs[half + k];
        row[R + ia] = f2bf(__fsub_rn(__fmul_rn(a, co), __fmul_rn(b, si)));
        row[R + ib] = f2bf(__fadd_rn(__fmul_rn(b, co), __fmul_rn(a, si)));
    }
}

extern "C" __global__ void __launch_bounds__(MLA_PROJECT_THREADS)
mla_absorb_q(bf16 *qa, const bf16 *q, const bf16 *kv_b, int n_tokens, int num_heads,
             int nope, int rope, int v_dim, int R) {
    __shared__ float qn[MLA_PROJECT_MAX_NOPE];
    const int t = blockIdx.x, h = blockIdx.y;
    if (t >= n_tokens) return;
    const bf16 *qh = q + ((long long)t * num_heads + h) * (nope + rope);
    for (int d = threadIdx.x; d < nope; d += MLA_PROJECT_THREADS) qn[d] = bf2f(qh[d]);
    __syncthreads();
    const bf16 *w = kv_b + (long long)h * (nope + v_dim) * R;
    bf16 *out = qa + ((long long)t * num_heads + h) * (R + rope);
    for (int col = threadIdx.x; col < R; col += MLA_PROJECT_THREADS) {
        float acc = 0.f;
        for (int d = 0; d < nope; ++d) acc += qn[d] * bf2f(w[(long long)d * R + col]);
        out[col] = f2bf(acc);
    }
    for (int i = threadIdx.x; i < rope; i += MLA_PROJECT_THREADS) out[R + i] = qh[nope + i];
}

extern "C" __global__ void __launch_bounds__(MLA_PROJECT_THREADS)
mla_expand_v(bf16 *o, const bf16 *lat, const bf16 *kv_b, int n_tokens, int num_heads,
             int nope, int v_dim, int R) {
    const int t = blockIdx.x, h = blockIdx.y;
    if (t >= n_tokens) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bf16 *l = lat + ((long long)t * num_heads + h) * R;
    const bf16 *w = kv_b + ((long long)h * (nope + v_dim) + nope) * R;
    for (int v = warp; v < v_dim; v += MLA_PROJECT_THREADS / 32) {
        float acc = 0.f;
        for (int j = lane; j < R; j += 32) acc += bf2f(l[j]) * bf2f(w[(long long)v * R + j]);
        acc = warp_sum(acc);
        if (lane == 0) o[((long long)t * num_heads + h) * v_dim + v] = f2bf(acc);
    }
}
