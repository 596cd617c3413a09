// Elementwise BF16 updates, in place, FP32 math, one RNE rounding per stored element.
//
//   add_bias:    x[r, c] = bf16(float(x[r, c]) + float(bias[c]))   x [n_rows, width], bias [width]
//   add_inplace: x[i]    = bf16(float(x[i]) + float(y[i]))         x, y [n]
//
// add_bias launch: grid (n_rows), block EW_THREADS (256); each CTA strides over its row
//   (common.cuh's row_stride_x8).
//   Vector path (128-bit: 8 bf16 per access) when width % 8 == 0 and x, bias are 16-byte
//   aligned; otherwise one element per access. Any width >= 1.
// add_inplace launch: 1-D grid-stride (common.cuh's grid_stride_x8), block 256, grid
//   min(ceil(ceil(n/8)/256), 8192).
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
