// FP8 and FP16 widening as kernels see it (cuda_fp8.h / cuda_fp16.h), for the emulator's
// tests (tests/gpu_runtime/test_emu_fp8.py): one thread per code.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

// out [256] each: e4m3 -> half bits (one code, and as the low / high byte of a pair), e5m2
// -> half bits, e4m3 -> float through __nv_fp8_e4m3.
extern "C" __global__ void fp8_codes(unsigned short *e4m3, unsigned short *pair_lo,
                                     unsigned short *pair_hi, unsigned short *e5m2,
                                     float *e4m3_f32) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= 256) return;
    e4m3[c] = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3).x;
    // the pair (c, 255 - c): low byte first
    const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)(c | ((255 - c) << 8));
    const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    pair_lo[c] = h2.x;
    pair_hi[c] = h2.y;
    e5m2[c] = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E5M2).x;
    __nv_fp8_e4m3 v;
    v.__x = (__nv_fp8_storage_t)c;
    e4m3_f32[c] = static_cast<float>(v);
}

// out [65536]: every FP16 code widened to FP32 (__half2float), and pairs via __half22float2.
extern "C" __global__ void half_codes(float *out, float2 *pairs) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= 65536) return;
    out[c] = __half2float(__ushort_as_half((unsigned short)c));
    __half2_raw r;
    r.x = (unsigned short)c;
    r.y = (unsigned short)(65535 - c);
    pairs[c] = __half22float2(__half2(r));
}
