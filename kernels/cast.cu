// BF16 <-> FP32 conversion of flat buffers.
//
//   bf16_to_f32: out[i] = float(x[i])          (exact: bits << 16)
//   f32_to_bf16: out[i] = bf16_rn(x[i])        (round to nearest even, NaN stays NaN)
//
// Shapes: x, out [n] (any n >= 1, n < 2^31).
// Launch: 1-D grid-stride loop, block CAST_THREADS (256), grid min(ceil(ceil(n/8)/256),
// 8192) (metrale/ops/cast.py::_grid). Vector path: when both pointers are 16-byte aligned
// each thread moves 8 elements per step with 128-bit accesses (BF16 side 16 B, FP32 side
// 2 x 16 B); the last n % 8 elements are done one by one. Misaligned pointers take the
// scalar path for the whole buffer (the loop is common.cuh's grid_stride_x8). Memory-bound:
// 6 bytes per element.
#include "common.cuh"

#define CAST_THREADS 256

extern "C" __global__ void __launch_bounds__(CAST_THREADS)
bf16_to_f32(float *out, const bf16 *x, int n) {
    const bf16x8 *xv = reinterpret_cast<const bf16x8 *>(x);
    float4 *ov = reinterpret_cast<float4 *>(out);
    grid_stride_x8(
        n, aligned16(out) && aligned16(x),
        [&](long long i) {
            float f[8];
            unpack8(xv[i], f);
            ov[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
            ov[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
        },
        [&](long long i) { out[i] = bf2f(x[i]); });
}

extern "C" __global__ void __launch_bounds__(CAST_THREADS)
f32_to_bf16(bf16 *out, const float *x, int n) {
    const float4 *xv = reinterpret_cast<const float4 *>(x);
    bf16x8 *ov = reinterpret_cast<bf16x8 *>(out);
    grid_stride_x8(
        n, aligned16(out) && aligned16(x),
        [&](long long i) {
            const float4 a = xv[2 * i], b = xv[2 * i + 1];
            const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            ov[i] = pack8(f);
        },
        [&](long long i) { out[i] = f2bf(x[i]); });
}
