// The norm family: RMSNorm (with an optional fused residual add) and LayerNorm.
//
// rmsnorm, residual == NULL:
//   n[c]   = bf16( x[c] * rsqrt(mean_c(x^2) + eps) )          (FP32 math)
//   out[c] = bf16( n[c] * w[c] )
// rmsnorm, residual != NULL (the pre-norm transformer step, fused):
//   residual[c] = bf16( residual[c] + x[c] )                  (stored back)
//   then the formula above on the stored (rounded) residual row.
// The two roundings mirror HF LlamaRMSNorm / Qwen2RMSNorm with BF16 weights:
// `weight * hidden_states.to(input_dtype)` normalizes in FP32, casts to BF16, then multiplies
// by the BF16 weight (one more BF16 rounding); HF's `residual + hidden_states` is a BF16 add.
// weight_mode (norm_row.cuh RMS_WEIGHT_*) picks the last step: 0 the two roundings above;
// 1 out = bf16(n_fp32 * w), one rounding (HF GptOssRMSNorm); 2 out = bf16(n_fp32 * (1 + w)),
// one rounding (HF Gemma2RMSNorm / Gemma3RMSNorm, zero-centred weights).
//
// layernorm:
//   mu = mean(x), var = mean((x - mu)^2)       (two-pass, FP32)
//   out[c] = bf16( (x[c] - mu) * rsqrt(var + eps) * w[c] + b[c] )   (one rounding, as
//   torch's LayerNorm kernel does for BF16 input)
//
// Shapes: x, out [n_rows, hidden]; weight, bias [hidden]; residual [n_rows, hidden].
// rmsnorm launch: grid (ceil(n_rows / 4)), block 128 = NORM_ROWS_PER_CTA warps, one warp per
// row, no shared memory and no block barriers. The sum of squares is kernels/norm_row.cuh's
// fixed per-warp order (lane l: 8-element chunks l, l + 32, ..., then the xor butterfly), the
// order the decode GEMM that normalizes its own X tiles (gemm_tc.cu) uses too, so the fused
// and the separate norm give a row the same bits. 128-bit accesses when hidden % 8 == 0 and
// the pointers are 16-byte aligned, one element per access otherwise (same order, same
// bits). out may equal x (each lane rewrites only the chunks it read; warp_sum orders every
// pass-1 read before any write).
// layernorm launch: grid (n_rows), one CTA per row, block = NORM threads chosen by the
// launcher (metrale/ops/rmsnorm.py::_threads: 32..1024, a multiple of 32, ~one 8-element
// vector per thread); each thread strides over the row, the row re-read from L1 for the
// second and third pass; vector path as above. Static shared memory: 32 floats of reduction
// scratch.
#include "norm_row.cuh"

#define NORM_MAX_THREADS 1024
#define NORM_ROWS_PER_CTA 4

extern "C" __global__ void __launch_bounds__(NORM_ROWS_PER_CTA * 32)
rmsnorm(bf16 *out, const bf16 *x, const bf16 *weight, bf16 *residual, int n_rows, int hidden,
        float eps, int weight_mode) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * NORM_ROWS_PER_CTA + (threadIdx.x >> 5);
    if (r >= n_rows) return;  // warp-uniform: a warp owns its row, no block barriers
    const long long off = (long long)r * hidden;
    const bf16 *xr = x + off;
    bf16 *o = out + off;
    bf16 *res = residual ? residual + off : nullptr;
    const bf16 *src = res ? res : xr;  // the row that gets normalized (after pass 1)
    const bool vec_in = (hidden & 7) == 0 && aligned16(xr) && (res == nullptr || aligned16(res));
    const float inv = rms_inv(row_sum_squares_warp(xr, res, hidden, vec_in, lane), hidden, eps);
    // pass 2 reads only chunks this lane read in pass 1 or (res) stored itself, and warp_sum
    // orders every lane's pass 1 before any lane's pass 2: out may equal x
    const int chunks = (hidden + 7) >> 3;
    if (vec_in && aligned16(o) && aligned16(weight)) {
        const bf16x8 *sv = reinterpret_cast<const bf16x8 *>(src);
        const bf16x8 *wv = reinterpret_cast<const bf16x8 *>(weight);
        bf16x8 *ov = reinterpret_cast<bf16x8 *>(o);
        for (int j = lane; j < chunks; j += 32) {
            float a[8], w[8];
            unpack8(sv[j], a);
            unpack8(wv[j], w);
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] = rms_weighted(a[e], inv, w[e], weight_mode);
            ov[j] = pack8(a);
        }
    } else {
        for (int j = lane; j < chunks; j += 32)
            for (int c = 8 * j; c < min(8 * j + 8, hidden); ++c)
                o[c] = f2bf(rms_weighted(bf2f(src[c]), inv, bf2f(weight[c]), weight_mode));
    }
}

extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS)
layernorm(bf16 *out, const bf16 *x, const bf16 *weight, const bf16 *bias, int n_rows,
          int hidden, float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const long long off = (long long)r * hidden;
    const bf16 *xr = x + off;
    bf16 *o = out + off;
    const bool vec = (hidden & 7) == 0 && aligned16(xr) && aligned16(o) && aligned16(weight) &&
                     aligned16(bias);
    const int nv = hidden >> 3;
    const bf16x8 *xv = reinterpret_cast<const bf16x8 *>(xr);
    float s = 0.f;
    if (vec) {
        for (int c = threadIdx.x; c < nv; c += blockDim.x) {
            float a[8];
            unpack8(xv[c], a);
#pragma unroll
            for (int e = 0; e < 8; ++e) s += a[e];
        }
    } else {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) s += bf2f(xr[c]);
    }
    const float mu = block_sum(s, scratch) / (float)hidden;
    float q = 0.f;
    if (vec) {
        for (int c = threadIdx.x; c < nv; c += blockDim.x) {
            float a[8];
            unpack8(xv[c], a);
#pragma unroll
            for (int e = 0; e < 8; ++e) q = fmaf(a[e] - mu, a[e] - mu, q);
        }
    } else {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
            const float d = bf2f(xr[c]) - mu;
            q = fmaf(d, d, q);
        }
    }
    const float inv = rsqrtf(block_sum(q, scratch) / (float)hidden + eps);
    if (vec) {
        const bf16x8 *wv = reinterpret_cast<const bf16x8 *>(weight);
        const bf16x8 *bv = reinterpret_cast<const bf16x8 *>(bias);
        bf16x8 *ov = reinterpret_cast<bf16x8 *>(o);
        for (int c = threadIdx.x; c < nv; c += blockDim.x) {
            float a[8], w[8], b[8];
            unpack8(xv[c], a);
            unpack8(wv[c], w);
            unpack8(bv[c], b);
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] = fmaf((a[e] - mu) * inv, w[e], b[e]);
            ov[c] = pack8(a);
        }
    } else {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x)
            o[c] = f2bf(fmaf((bf2f(xr[c]) - mu) * inv, bf2f(weight[c]), bf2f(bias[c])));
    }
}
