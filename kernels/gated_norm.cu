// The norms and gates of the hybrid families (Qwen3-Next / Qwen3.5, Nemotron-H): the
// one-rounding RMSNorms (zero-centred or not), the gated RMSNorms of the linear-attention /
// Mamba outputs, the sigmoid output gate of the gated full attention and the squared ReLU of
// Nemotron-H's MLP. FP32 math, BF16 storage.
//
// rmsnorm_offset (HF's `x * rsqrt(mean(x^2) + eps) * (offset + w)` in FP32 with one
// rounding: offset 1 for Qwen3NextRMSNorm / Qwen3_5RMSNorm, 0 for NemotronHRMSNorm):
//   rows r = (t, h), t < n_tokens, h < heads_a + heads_b, each `dim` elements at
//   x + t * stride + h * dim (out and residual alike); heads h < heads_a use weight w_a,
//   the others w_b (q and k heads of one qkv row in one launch; a plain row: heads_a = 1,
//   heads_b = 0, dim = stride = hidden).
//   residual != NULL: residual = bf16(residual + x) is stored back first and the stored row
//   is normalized (HF's BF16 `residual + hidden_states`).
//   out[c] = bf16( x[c] * rsqrt(ss / dim + eps) * (offset + w[c]) )
// rmsnorm_gated, per token t and group g (width = groups * group elements a token):
//   norm_first = 1 (Qwen3NextRMSNormGated; group = head_v_dim, w_len = group):
//     out[c] = bf16( bf16( bf16(x[c] * inv) * w[c % w_len] ) * silu(z[c]) ),  inv over x
//   norm_first = 0 (NemotronHRMSNormGated; group = intermediate / n_groups, w_len = width):
//     h[c] = x[c] * silu(z[c]) (FP32, not rounded); out[c] = bf16( bf16(h[c] * inv) * w[c] ),
//     inv over h
//   x, out: [n_tokens, width] contiguous; z: row t at z + t * z_stride.
// sigmoid_gate_mul (the output gate of Qwen3NextAttention, `attn * torch.sigmoid(gate)` in
// BF16): x[t, c] = bf16( x[t, c] * bf16(sigmoid(g[t * g_stride + c])) ), in place.
// relu2 (HF ReLUSquaredActivation in BF16: relu is exact, the square rounds once):
//   x[i] = bf16( max(x[i], 0)^2 ), in place, n elements.
//
// The sum of squares of a row is kernels/norm_row.cuh's order (lane l: 8-element chunks l,
// l + 32, ..., one fmaf each, then the xor butterfly), so it depends on `dim` alone.
// Launch (norms): grid (ceil(rows / 4)), block 128, one warp per row; in place allowed (a
// lane rewrites only the chunks it read, warp_sum orders the reads first). sigmoid_gate_mul:
// grid (n_tokens), block 256, one CTA per token row. relu2: grid (ceil(n / 256)) capped,
// block 256, grid-strided.
#include "norm_row.cuh"
#include "activation.cuh"

#define GN_ROWS_PER_CTA 4

__device__ __forceinline__ float sigmoid_f(float g) { return 1.0f / (1.0f + expf(-g)); }

extern "C" __global__ void __launch_bounds__(GN_ROWS_PER_CTA * 32)
rmsnorm_offset(bf16 *out, const bf16 *x, const bf16 *w_a, const bf16 *w_b, bf16 *residual,
               int n_tokens, int heads_a, int heads_b, int dim, int stride, float eps,
               float offset) {
    const int lane = threadIdx.x & 31;
    const int heads = heads_a + heads_b;
    // rows < 2^31 (the launcher checks): 32-bit division (a 64-bit one spills on sm_80)
    const int r = blockIdx.x * GN_ROWS_PER_CTA + (threadIdx.x >> 5);
    if (r >= n_tokens * heads) return;  // warp-uniform: a warp owns its row
    const int t = r / heads, h = r % heads;
    const long long off = (long long)t * stride + (long long)h * dim;
    const bf16 *xr = x + off;
    bf16 *o = out + off;
    bf16 *res = residual ? residual + off : nullptr;
    const bf16 *src = res ? res : xr;
    const bf16 *w = h < heads_a ? w_a : w_b;
    const bool vec = (dim & 7) == 0 && aligned16(xr) && (res == nullptr || aligned16(res));
    const float inv = rms_inv(row_sum_squares_warp(xr, res, dim, vec, lane), dim, eps);
    const int chunks = (dim + 7) >> 3;
    for (int j = lane; j < chunks; j += 32)
        for (int c = 8 * j; c < min(8 * j + 8, dim); ++c)
            o[c] = f2bf(bf2f(src[c]) * inv * (offset + bf2f(w[c])));
}

extern "C" __global__ void __launch_bounds__(GN_ROWS_PER_CTA * 32)
rmsnorm_gated(bf16 *out, const bf16 *x, const bf16 *z, const bf16 *w, int n_tokens,
              int width, int group, int w_len, int z_stride, float eps, int norm_first) {
    const int lane = threadIdx.x & 31;
    const int groups = width / group;
    const long long r = (long long)blockIdx.x * GN_ROWS_PER_CTA + (threadIdx.x >> 5);
    if (r >= (long long)n_tokens * groups) return;
    const int t = (int)(r / groups), g = (int)(r % groups);
    const bf16 *xr = x + (long long)t * width + (long long)g * group;
    const bf16 *zr = z + (long long)t * z_stride + (long long)g * group;
    bf16 *o = out + (long long)t * width + (long long)g * group;
    const int chunks = (group + 7) >> 3;
    float ss = 0.f;
    for (int j = lane; j < chunks; j += 32)
        for (int c = 8 * j; c < min(8 * j + 8, group); ++c) {
            const float v = norm_first ? bf2f(xr[c]) : bf2f(xr[c]) * silu_f(bf2f(zr[c]));
            ss = fmaf(v, v, ss);
        }
    const float inv = rms_inv(warp_sum(ss), group, eps);
    for (int j = lane; j < chunks; j += 32)
        for (int c = 8 * j; c < min(8 * j + 8, group); ++c) {
            const int wc = (g * group + c) % w_len;
            const float s = silu_f(bf2f(zr[c]));
            float y;
            if (norm_first) {
                y = bf2f(f2bf(bf2f(f2bf(bf2f(xr[c]) * inv)) * bf2f(w[wc]))) * s;
            } else {
                y = bf2f(f2bf(bf2f(xr[c]) * s * inv)) * bf2f(w[wc]);
            }
            o[c] = f2bf(y);
        }
}

extern "C" __global__ void __launch_bounds__(256)
sigmoid_gate_mul(bf16 *x, const bf16 *g, int n_tokens, int width, int g_stride) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    bf16 *xr = x + (long long)t * width;
    const bf16 *gr = g + (long long)t * g_stride;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        const float s = bf2f(f2bf(sigmoid_f(bf2f(gr[c]))));
        xr[c] = f2bf(bf2f(xr[c]) * s);
    }
}

extern "C" __global__ void __launch_bounds__(256)
relu2(bf16 *x, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = fmaxf(bf2f(x[i]), 0.0f);
        x[i] = f2bf(v * v);
    }
}
