// Elementwise BF16 updates, in place, FP32 math, one RNE rounding per stored element.
//
//   add_bias:    x[r, c] = bf16(float(x[r, c]) + float(bias[c]))   x [n_rows, width], bias [width]
//   add_inplace: x[i]    = bf16(float(x[i]) + float(y[i]))         x, y [n]
//
// add_bias launch: grid (n_rows), block EW_THREADS (256); each CTA strides over its row.
//   Vector path (128-bit: 8 bf16 per access) when width % 8 == 0 and x, bias are 16-byte
//   aligned; otherwise one element per access. Any width >= 1.
// add_inplace launch: 1-D grid-stride, block 256, grid min(ceil(ceil(n/8)/256), 8192).
//   Vector path when x and y are 16-byte aligned; the last n % 8 elements one by one.
// Restrictions: n_rows, width, n in [1, 2^31) (row offsets are 64-bit, so n_rows * width
// may exceed 2^31). x and y must not partially overlap (x == y is fine).
#include "common.cuh"

#define EW_THREADS 256

__device__ __forceinline__ bool aligned16(const void *p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
add_bias(bf16 *x, const bf16 *bias, int n_rows, int width) {
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    bf16 *row = x + (long long)r * width;
    if ((width & 7) == 0 && aligned16(row) && aligned16(bias)) {
        bf16x8 *rv = reinterpret_cast<bf16x8 *>(row);
        const bf16x8 *bv = reinterpret_cast<const bf16x8 *>(bias);
        for (int c = threadIdx.x; c < (width >> 3); c += blockDim.x) {
            float a[8], b[8];
            unpack8(rv[c], a);
            unpack8(bv[c], b);
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] += b[e];
            rv[c] = pack8(a);
        }
    } else {
        for (int c = threadIdx.x; c < width; c += blockDim.x)
            row[c] = f2bf(bf2f(row[c]) + bf2f(bias[c]));
    }
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
add_inplace(bf16 *x, const bf16 *y, int n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if (aligned16(x) && aligned16(y)) {
        const long long n8 = n >> 3;
        bf16x8 *xv = reinterpret_cast<bf16x8 *>(x);
        const bf16x8 *yv = reinterpret_cast<const bf16x8 *>(y);
        for (long long i = tid; i < n8; i += stride) {
            float a[8], b[8];
            unpack8(xv[i], a);
            unpack8(yv[i], b);
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] += b[e];
            xv[i] = pack8(a);
        }
        done = n8 << 3;
    }
    for (long long i = done + tid; i < n; i += stride) x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
}
