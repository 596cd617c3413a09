// BF16 <-> float32 for HostBackend's twins, one pass each (numpy needs about seven for
// the rounding), built into the same library as gemm_f32.cpp by metrale/gpu_runtime/native.py.
//
// Formula (metrale/ops/bf16.py, the device's cvt.rn.bf16.f32):
//   bf16_to_f32: f32 bits = bf16 bits << 16 (exact).
//   f32_to_bf16: u = f32 bits; NaN (|u| > 0x7F800000) -> 0x7FFF; else
//                (u + 0x7FFF + ((u >> 16) & 1)) >> 16   (round to nearest, ties to even).
// Both are exact integer maps, so these give numpy's bits by construction (tests compare
// them anyway). Restrictions: contiguous arrays, n >= 0, out must not overlap the input.
#include <cstdint>

extern "C" {

__attribute__((visibility("default"))) void md_f32_to_bf16(const uint32_t *x, uint16_t *y,
                                                           int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = x[i];
        const uint16_t r = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        y[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FFF) : r;
    }
}

__attribute__((visibility("default"))) void md_bf16_to_f32(const uint16_t *x, uint32_t *y,
                                                           int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = uint32_t(x[i]) << 16;
}

}  // extern "C"
