// Rotary position embedding, NeoX (rotate-half) layout, in place on the q and k heads of the
// fused projection buffer, with Qwen3's optional per-head RMSNorm first.
//
//   x = qkv[t, head, :]  (head < H: q head, H <= head < H+KV: k head; v heads untouched)
//   if w (q_norm for q heads, k_norm for k heads) is not NULL:
//       x = bf16( x * rsqrt(sum(x^2)/D + eps) * w )                (fp32 math, one rounding)
//   c = table[pos, j], s = table[pos, D/2 + j], pos = positions[t], j < D/2
//   x[j]       = bf16( x[j]*c - x[j+D/2]*s )
//   x[j + D/2] = bf16( x[j+D/2]*c + x[j]*s )
//
// Shapes: qkv [n_tokens, (H + 2*KV) * D] bf16; positions [n_tokens] int32;
//         table [max_positions, D] fp32 (cos | sin, attention factor folded in);
//         q_norm, k_norm [D] bf16 or NULL.
// Launch: grid (n_tokens, ceil((H+KV)/4)), block 128 = 4 warps, one warp per head;
//         lane l handles pairs j = l, l+32, l+64, l+96 (D <= 256).
// Restrictions: D even, 2 <= D <= 256. A position outside [0, max_positions) leaves the
//         token untouched (no out-of-bounds read); callers check positions on the host.
#include "common.cuh"

#define ROPE_WARPS 4
#define ROPE_MAX_PAIRS_PER_LANE 4  // D/2 <= 128

extern "C" __global__ void __launch_bounds__(ROPE_WARPS * 32)
apply_rope(bf16 *qkv, const int *positions, const float *table, const bf16 *q_norm,
           const bf16 *k_norm, int n_tokens, int num_heads, int num_kv_heads, int head_dim,
           int max_positions, float norm_eps) {
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.y * ROPE_WARPS + warp;
    if (t >= n_tokens || head >= num_heads + num_kv_heads) return;
    const int pos = positions[t];
    if (pos < 0 || pos >= max_positions) return;
    const int half = head_dim >> 1;
    bf16 *x = qkv + (long long)t * (num_heads + 2 * num_kv_heads) * head_dim
                  + (long long)head * head_dim;
    const bf16 *w = head < num_heads ? q_norm : k_norm;

    float x1[ROPE_MAX_PAIRS_PER_LANE], x2[ROPE_MAX_PAIRS_PER_LANE];
#pragma unroll
    for (int k = 0; k < ROPE_MAX_PAIRS_PER_LANE; ++k) {
        const int j = lane + 32 * k;
        x1[k] = j < half ? bf2f(x[j]) : 0.f;
        x2[k] = j < half ? bf2f(x[j + half]) : 0.f;
    }
    if (w != nullptr) {
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < ROPE_MAX_PAIRS_PER_LANE; ++k) ss += x1[k] * x1[k] + x2[k] * x2[k];
        ss = warp_sum(ss);
        const float r = rsqrtf(ss / (float)head_dim + norm_eps);
#pragma unroll
        for (int k = 0; k < ROPE_MAX_PAIRS_PER_LANE; ++k) {
            const int j = lane + 32 * k;
            if (j < half) {
                x1[k] = bf2f(f2bf((x1[k] * r) * bf2f(w[j])));
                x2[k] = bf2f(f2bf((x2[k] * r) * bf2f(w[j + half])));
            }
        }
    }
    const float *cs = table + (long long)pos * head_dim;
#pragma unroll
    for (int k = 0; k < ROPE_MAX_PAIRS_PER_LANE; ++k) {
        const int j = lane + 32 * k;
        if (j < half) {
            const float c = __ldg(cs + j), s = __ldg(cs + half + j);
            x[j] = f2bf(x1[k] * c - x2[k] * s);
            x[j + half] = f2bf(x2[k] * c + x1[k] * s);
        }
    }
}
