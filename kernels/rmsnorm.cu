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
//
// layernorm:
//   mu = mean(x), var = mean((x - mu)^2)       (two-pass, FP32)
//   out[c] = bf16( (x[c] - mu) * rsqrt(var + eps) * w[c] + b[c] )   (one rounding, as
//   torch's LayerNorm kernel does for BF16 input)
//
// Shapes: x, out [n_rows, hidden]; weight, bias [hidden]; residual [n_rows, hidden].
// Launch: grid (n_rows), one CTA per row, block = NORM threads chosen by the launcher
// (metrale/ops/rmsnorm.py::_threads: 32..1024, a multiple of 32, ~one 8-element vector per
// thread). Each thread strides over the row; the row is re-read from L1 for the second
// (and third) pass instead of being cached in registers, so any hidden works. The vector
// path (128-bit accesses, 8 bf16) is taken when hidden % 8 == 0 and every pointer is
// 16-byte aligned; otherwise one element per access. out may equal x (every pass-1 read
// happens before the block reduction's barrier, and each thread rewrites only what it read).
// Static shared memory: 32 floats of reduction scratch.
#include "common.cuh"

#define NORM_MAX_THREADS 1024

extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS)
rmsnorm(bf16 *out, const bf16 *x, const bf16 *weight, bf16 *residual, int n_rows, int hidden,
        float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const long long off = (long long)r * hidden;
    const bf16 *xr = x + off;
    bf16 *o = out + off;
    bf16 *res = residual ? residual + off : nullptr;
    const bf16 *src = res ? res : xr;  // the row that gets normalized (after pass 1)
    const bool vec = (hidden & 7) == 0 && aligned16(xr) && aligned16(o) && aligned16(weight) &&
                     (res == nullptr || aligned16(res));
    float ss = 0.f;
    if (vec) {
        const int nv = hidden >> 3;
        const bf16x8 *xv = reinterpret_cast<const bf16x8 *>(xr);
        bf16x8 *rv = reinterpret_cast<bf16x8 *>(res);
        for (int c = threadIdx.x; c < nv; c += blockDim.x) {
            float a[8];
            unpack8(xv[c], a);
            if (res) {
                float b[8];
                unpack8(rv[c], b);
#pragma unroll
                for (int e = 0; e < 8; ++e) b[e] += a[e];
                const bf16x8 s = pack8(b);
                rv[c] = s;
                unpack8(s, a);  // normalize the stored (rounded) value
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) ss = fmaf(a[e], a[e], ss);
        }
    } else {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
            float a = bf2f(xr[c]);
            if (res) {
                const bf16 s = f2bf(bf2f(res[c]) + a);
                res[c] = s;
                a = bf2f(s);
            }
            ss = fmaf(a, a, ss);
        }
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)hidden + eps);
    if (vec) {
        const int nv = hidden >> 3;
        const bf16x8 *sv = reinterpret_cast<const bf16x8 *>(src);
        const bf16x8 *wv = reinterpret_cast<const bf16x8 *>(weight);
        bf16x8 *ov = reinterpret_cast<bf16x8 *>(o);
        for (int c = threadIdx.x; c < nv; c += blockDim.x) {
            float a[8], w[8];
            unpack8(sv[c], a);
            unpack8(wv[c], w);
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] = bf2f(f2bf(a[e] * inv)) * w[e];
            ov[c] = pack8(a);
        }
    } else {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x)
            o[c] = f2bf(bf2f(f2bf(bf2f(src[c]) * inv)) * bf2f(weight[c]));
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
