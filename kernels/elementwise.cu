// Elementwise BF16 updates, in place, FP32 math, one RNE rounding per stored element.
//
//   add_bias:    x[r, c] = bf16(float(x[r, c]) + float(bias[c]))   x [n_rows, width], bias [width]
//   add_inplace: x[i]    = bf16(float(x[i]) + float(y[i]))         x, y [n]
//   scale_inplace: x[i]  = bf16(float(x[i]) * s)                    x [n]; Gemma's embedding
//                scale (HF multiplies by the normalizer cast to the weights' dtype: s is that
//                BF16 value)
//   softcap_inplace: x[i] = tanh(x[i] / cap) * cap                  x [n] BF16 (one rounding)
//                or FP32 (is_fp32 != 0); Gemma 2/3's final_logit_softcapping on the logits
//
// add_bias launch: grid (n_rows), block EW_THREADS (256); each CTA strides over its row
//   (common.cuh's row_stride_x8).
//   Vector path (128-bit: 8 bf16 per access) when width % 8 == 0 and x, bias are 16-byte
//   aligned; otherwise one element per access. Any width >= 1.
// add_inplace, scale_inplace, softcap_inplace launch: 1-D grid-stride (common.cuh's
//   grid_stride_x8; softcap_inplace's FP32 rows one element per thread and step), block 256,
//   grid min(ceil(ceil(n/8)/256), 8192).
//   Vector path when x and y are 16-byte aligned; the last n % 8 elements one by one.
// Restrictions: n_rows, width, n in [1, 2^31) (row offsets are 64-bit, so n_rows * width
// may exceed 2^31). x and y must not partially overlap (x == y is fine).
#include "common.cuh"

#define EW_THREADS 256

extern "C" __global__ void __launch_bounds__(EW_THREADS)
add_bias(bf16 *x, const bf16 *bias, int n_rows, int width) {
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    bf16 *row = x + (long long)r * width;
    bf16x8 *rv = reinterpret_cast<bf16x8 *>(row);
    const bf16x8 *bv = reinterpret_cast<const bf16x8 *>(bias);
    row_stride_x8(
        width, (width & 7) == 0 && aligned16(row) && aligned16(bias),
        [&](int c) { rv[c] = map8(rv[c], bv[c], [](float a, float b) { return a + b; }); },
        [&](int c) { row[c] = f2bf(bf2f(row[c]) + bf2f(bias[c])); });
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
add_inplace(bf16 *x, const bf16 *y, int n) {
    bf16x8 *xv = reinterpret_cast<bf16x8 *>(x);
    const bf16x8 *yv = reinterpret_cast<const bf16x8 *>(y);
    grid_stride_x8(
        n, aligned16(x) && aligned16(y),
        [&](long long i) { xv[i] = map8(xv[i], yv[i], [](float a, float b) { return a + b; }); },
        [&](long long i) { x[i] = f2bf(bf2f(x[i]) + bf2f(y[i])); });
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
scale_inplace(bf16 *x, float s, int n) {
    bf16x8 *xv = reinterpret_cast<bf16x8 *>(x);
    grid_stride_x8(
        n, aligned16(x),
        [&](long long i) { xv[i] = map8(xv[i], [&](float a) { return a * s; }); },
        [&](long long i) { x[i] = f2bf(bf2f(x[i]) * s); });
}

__device__ __forceinline__ float softcap_f(float a, float cap) { return tanhf(a / cap) * cap; }

extern "C" __global__ void __launch_bounds__(EW_THREADS)
softcap_inplace(void *x, float cap, int n, int is_fp32) {
    if (is_fp32) {
        float *f = reinterpret_cast<float *>(x);
        const long long step = (long long)gridDim.x * blockDim.x;
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
            f[i] = softcap_f(f[i], cap);
        return;
    }
    bf16 *b = reinterpret_cast<bf16 *>(x);
    bf16x8 *bv = reinterpret_cast<bf16x8 *>(x);
    grid_stride_x8(
        n, aligned16(x),
        [&](long long i) { bv[i] = map8(bv[i], [&](float a) { return softcap_f(a, cap); }); },
        [&](long long i) { b[i] = f2bf(softcap_f(bf2f(b[i]), cap)); });
}
