// Rotary position embedding, NeoX (rotate-half) layout, in place on the q and k heads of the
// fused projection buffer, with Qwen3's optional per-head RMSNorm first.
//
//   x = qkv[t, head, :]  (head < H: q head, H <= head < H+KV: k head; v heads untouched)
//   if w (q_norm for q heads, k_norm for k heads) is not NULL:
//       x = bf16( x * rsqrt(sum(x^2)/D + eps) * w )                (fp32 math, one rounding)
//       (gemma_norm != 0: * (1 + w), Gemma3's q/k RMSNorm)
//   R = rot_dim (= D, or less for a partial rotary embedding; even), pos = positions[t],
//   c = table[pos, j], s = table[pos, R/2 + j], j < R/2
//   x[j]       = bf16( x[j]*c - x[j+R/2]*s )
//   x[j + R/2] = bf16( x[j+R/2]*c + x[j]*s )
//   x[R..D) unrotated (normalized when w is given)
//
// Shapes: qkv [n_tokens, (H + 2*KV) * D] bf16; positions [n_tokens] int32;
//         table [max_positions, R] fp32 (cos | sin, attention factor folded in);
//         q_norm, k_norm [D] bf16 or NULL.
// Launch: grid (n_tokens, ceil((H+KV)/4)), block 128 = 4 warps, one warp per head;
//         lane l handles pairs j = l, l+32, l+64, l+96 (D <= 256).
// Restrictions: D even, 2 <= D <= 256; R even, 2 <= R <= D. A position outside [0, max_positions) leaves the
//         token untouched (no out-of-bounds read); callers check positions on the host.
//
// rope_write_kv: apply_rope and kv_cache.cu's write_kv in one launch (a decode step's two
// launch-bound kernels, by the EmuBackend's profile, become one):
//   as apply_rope on qkv, then with slot = slot_mapping[t] (< 0: no cache write):
//   k_cache[slot, kh*D : (kh+1)*D] = k head kh of qkv as apply_rope leaves it
//   v_cache[slot, kh*D : (kh+1)*D] = v head kh of qkv
// Shapes: as apply_rope, plus k_cache, v_cache [num_blocks, block_size, KV, D] bf16 (rows
//         [num_slots, KV*D]) and slot_mapping [n_tokens] int32.
// Launch: grid (n_tokens, ceil((H+2*KV)/4)), block 128, one warp per head: warps past the
//         H+KV q/k heads copy a v head, lane l the 32-bit words l, l+32, ... of it.
// Restrictions: as apply_rope; qkv and the caches 4-byte aligned; slots are not bounds-
//         checked here (the numpy twin checks them against the allocation). A position
//         outside the table leaves qkv untouched and writes the unrotated k, as apply_rope
//         followed by write_kv would.
#include "common.cuh"

#define ROPE_WARPS 4
#define ROPE_MAX_PAIRS_PER_LANE 4  // D/2 <= 128

// One q/k head of token t: optional RMSNorm, rotation, written back in place and, with
// k_dst (a k head's cache row), to the cache as well. Lane l: pairs j = l + 32k.
// gemma_norm: the norm's weight applies as (1 + w) (Gemma3RMSNorm) instead of w.
__device__ __forceinline__ void rope_head(bf16 *x, bf16 *k_dst, const bf16 *w, const float *cs,
                                          int head_dim, float norm_eps, int gemma_norm,
                                          int lane) {
    const int half = head_dim >> 1;
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
                const float w1 = bf2f(w[j]), w2 = bf2f(w[j + half]);
                x1[k] = bf2f(f2bf((x1[k] * r) * (gemma_norm ? 1.0f + w1 : w1)));
                x2[k] = bf2f(f2bf((x2[k] * r) * (gemma_norm ? 1.0f + w2 : w2)));
            }
        }
    }
#pragma unroll
    for (int k = 0; k < ROPE_MAX_PAIRS_PER_LANE; ++k) {
        const int j = lane + 32 * k;
        if (j < half) {
            const float c = __ldg(cs + j), s = __ldg(cs + half + j);
            const bf16 a = f2bf(x1[k] * c - x2[k] * s), b = f2bf(x2[k] * c + x1[k] * s);
            x[j] = a;
            x[j + half] = b;
            if (k_dst != nullptr) {
                k_dst[j] = a;
                k_dst[j + half] = b;
            }
        }
    }
}

// rope_head with partial rotary (rot_dim < head_dim, both even): the first rot_dim elements
// rotate as pairs (j, j + rot_dim/2) with cs = [cos | sin] of rot_dim/2 each, the others pass
// through (normalized first when w is given: the norm covers the whole head). Lane l holds
// the pairs j = l + 32k and the passed elements rot_dim + l + 32k.
__device__ __forceinline__ void rope_head_partial(bf16 *x, bf16 *k_dst, const bf16 *w,
                                                  const float *cs, int head_dim, int rot_dim,
                                                  float norm_eps, int gemma_norm, int lane) {
    const int half = rot_dim >> 1, rest = head_dim - rot_dim;
    float x1[ROPE_MAX_PAIRS_PER_LANE], x2[ROPE_MAX_PAIRS_PER_LANE];
    float xp[2 * ROPE_MAX_PAIRS_PER_LANE];
#pragma unroll
    for (int k = 0; k < ROPE_MAX_PAIRS_PER_LANE; ++k) {
        const int j = lane + 32 * k;
        x1[k] = j < half ? bf2f(x[j]) : 0.f;
        x2[k] = j < half ? bf2f(x[j + half]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < 2 * ROPE_MAX_PAIRS_PER_LANE; ++k) {
        const int e = lane + 32 * k;
        xp[k] = e < rest ? bf2f(x[rot_dim + e]) : 0.f;
    }
    if (w != nullptr) {
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < ROPE_MAX_PAIRS_PER_LANE; ++k) ss += x1[k] * x1[k] + x2[k] * x2[k];
#pragma unroll
        for (int k = 0; k < 2 * ROPE_MAX_PAIRS_PER_LANE; ++k) ss += xp[k] * xp[k];
        ss = warp_sum(ss);
        const float r = rsqrtf(ss / (float)head_dim + norm_eps);
        auto normed = [&](float v, int i) {
            const float wi = bf2f(w[i]);
            return bf2f(f2bf((v * r) * (gemma_norm ? 1.0f + wi : wi)));
        };
#pragma unroll
        for (int k = 0; k < ROPE_MAX_PAIRS_PER_LANE; ++k) {
            const int j = lane + 32 * k;
            if (j < half) {
                x1[k] = normed(x1[k], j);
                x2[k] = normed(x2[k], j + half);
            }
        }
#pragma unroll
        for (int k = 0; k < 2 * ROPE_MAX_PAIRS_PER_LANE; ++k) {
            const int e = lane + 32 * k;
            if (e < rest) xp[k] = normed(xp[k], rot_dim + e);
        }
    }
#pragma unroll
    for (int k = 0; k < ROPE_MAX_PAIRS_PER_LANE; ++k) {
        const int j = lane + 32 * k;
        if (j < half) {
            const float c = __ldg(cs + j), s = __ldg(cs + half + j);
            const bf16 a = f2bf(x1[k] * c - x2[k] * s), b = f2bf(x2[k] * c + x1[k] * s);
            x[j] = a;
            x[j + half] = b;
            if (k_dst != nullptr) {
                k_dst[j] = a;
                k_dst[j + half] = b;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < 2 * ROPE_MAX_PAIRS_PER_LANE; ++k) {
        const int e = lane + 32 * k;
        if (e < rest) {
            const bf16 v = f2bf(xp[k]);
            x[rot_dim + e] = v;
            if (k_dst != nullptr) k_dst[rot_dim + e] = v;
        }
    }
}

// One q/k head at position row `pos` of the table (rot_dim floats a row).
__device__ __forceinline__ void rope_any(bf16 *x, bf16 *k_dst, const bf16 *w, const float *table,
                                         int pos, int head_dim, int rot_dim, float norm_eps,
                                         int gemma_norm, int lane) {
    const float *cs = table + (long long)pos * rot_dim;
    if (rot_dim == head_dim)
        rope_head(x, k_dst, w, cs, head_dim, norm_eps, gemma_norm, lane);
    else
        rope_head_partial(x, k_dst, w, cs, head_dim, rot_dim, norm_eps, gemma_norm, lane);
}

// A head copied as 32-bit words (D even, both rows 4-byte aligned).
__device__ __forceinline__ void copy_head(bf16 *dst, const bf16 *src, int head_dim, int lane) {
    const unsigned int *s = reinterpret_cast<const unsigned int *>(src);
    unsigned int *d = reinterpret_cast<unsigned int *>(dst);
    for (int i = lane; i < (head_dim >> 1); i += 32) d[i] = s[i];
}

extern "C" __global__ void __launch_bounds__(ROPE_WARPS * 32)
apply_rope(bf16 *qkv, const int *positions, const float *table, const bf16 *q_norm,
           const bf16 *k_norm, int n_tokens, int num_heads, int num_kv_heads, int head_dim,
           int max_positions, float norm_eps, int rot_dim, int gemma_norm) {
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.y * ROPE_WARPS + warp;
    if (t >= n_tokens || head >= num_heads + num_kv_heads) return;
    const int pos = positions[t];
    if (pos < 0 || pos >= max_positions) return;
    bf16 *x = qkv + (long long)t * (num_heads + 2 * num_kv_heads) * head_dim
                  + (long long)head * head_dim;
    rope_any(x, nullptr, head < num_heads ? q_norm : k_norm, table, pos, head_dim, rot_dim,
             norm_eps, gemma_norm, lane);
}

extern "C" __global__ void __launch_bounds__(ROPE_WARPS * 32)
rope_write_kv(bf16 *qkv, const int *positions, const float *table, const bf16 *q_norm,
              const bf16 *k_norm, bf16 *k_cache, bf16 *v_cache, const int *slot_mapping,
              int n_tokens, int num_heads, int num_kv_heads, int head_dim, int max_positions,
              float norm_eps, int rot_dim, int gemma_norm) {
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.y * ROPE_WARPS + warp;
    if (t >= n_tokens || head >= num_heads + 2 * num_kv_heads) return;
    const int slot = slot_mapping[t];
    const int pos = positions[t];
    const bool rotate = pos >= 0 && pos < max_positions;
    bf16 *x = qkv + (long long)t * (num_heads + 2 * num_kv_heads) * head_dim
                  + (long long)head * head_dim;
    const long long row = (long long)num_kv_heads * head_dim;  // a cache slot
    if (head < num_heads) {                                     // q head: rotate only
        if (rotate)
            rope_any(x, nullptr, q_norm, table, pos, head_dim, rot_dim, norm_eps, gemma_norm,
                     lane);
        return;
    }
    const bool kv = head < num_heads + num_kv_heads;            // else a v head
    const int kh = head - num_heads - (kv ? 0 : num_kv_heads);
    bf16 *dst = slot < 0 ? nullptr
                         : (kv ? k_cache : v_cache) + (long long)slot * row
                               + (long long)kh * head_dim;
    if (kv && rotate)
        rope_any(x, dst, k_norm, table, pos, head_dim, rot_dim, norm_eps, gemma_norm, lane);
    else if (dst != nullptr)
        copy_head(dst, x, head_dim, lane);
}
