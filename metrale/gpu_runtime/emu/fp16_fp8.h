// FP16 and FP8 for the EmuBackend: what kernels use from <cuda_fp16.h> and <cuda_fp8.h>
// (included through the stub headers of include/), with CUDA's semantics.
//
// FP16: the storage types (__half_raw, __half2_raw, __half, __half2), bit casts and the
// exact widening to FP32 (__half2float, __half22float2).
// FP8: the storage types, __nv_fp8_interpretation_t, the exact widening of one or two codes
// to FP16 (__nv_cvt_fp8_to_halfraw, __nv_cvt_fp8x2_to_halfraw2; on sm_89+ the device runs
// cvt.rn.f16x2.e4m3x2 / .e5m2x2) and __nv_fp8_e4m3 / __nv_fp8_e5m2 read as float or half.
// Every FP8 value is an FP16 value, so widening is exact: e4m3fn has no infinities, its
// codes 0x7F / 0xFF are NaN (widened to the canonical FP16 NaN 0x7FFF, sign dropped, as
// cuda_fp8.hpp does), exponent 0 holds the subnormals m * 2^-9 and the two zeros; e5m2 is
// the upper byte of an FP16 (NaNs canonical 0x7FFF). The FP32 -> FP8 direction (rounding,
// saturation) is not emulated: no kernel converts to FP8.
#pragma once
#include <cstdint>
#include <cstring>

// ------------------------------------------------------------------ FP16
struct __half_raw { unsigned short x; };
struct __half2_raw { unsigned short x, y; };
struct __half {
    unsigned short __x;
    __half() = default;
    __half(__half_raw r) : __x(r.x) {}
    operator __half_raw() const { return {__x}; }
};
struct __attribute__((aligned(4))) __half2 {
    __half x, y;
    __half2() = default;
    __half2(__half a, __half b) : x(a), y(b) {}
    __half2(__half2_raw r) : x(__half_raw{r.x}), y(__half_raw{r.y}) {}
    operator __half2_raw() const { return {x.__x, y.__x}; }
};
typedef __half half;
typedef __half2 half2;

namespace emu {
// FP16 bits -> FP32, exactly (subnormals normalised, infinities kept, NaN stays NaN with its
// payload shifted into place, as cvt.f32.f16 does).
inline float half_bits_to_f32(unsigned short h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal: mant * 2^-24, normalised
        int e = 113;
        while ((mant & 0x400u) == 0) {
            mant <<= 1;
            --e;
        }
        bits = sign | (uint32_t(e) << 23) | ((mant & 0x3FFu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
}  // namespace emu

inline float __half2float(__half h) { return emu::half_bits_to_f32(h.__x); }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline __half __ushort_as_half(unsigned short u) { return __half_raw{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }

// ------------------------------------------------------------------ FP8
typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
typedef unsigned int __nv_fp8x4_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };

inline __half_raw __nv_cvt_fp8_to_halfraw(const __nv_fp8_storage_t x,
                                          const __nv_fp8_interpretation_t interp) {
    const unsigned short sign = (unsigned short)((x & 0x80u) << 8);
    if (interp == __NV_E5M2) {
        const unsigned short h = (unsigned short)(x << 8);
        return {(h & 0x7FFFu) > 0x7C00u ? (unsigned short)0x7FFFu : h};
    }
    const unsigned e = (x >> 3) & 0xFu, m = x & 7u;
    if ((x & 0x7Fu) == 0x7Fu) return {0x7FFFu};                      // NaN
    if (e != 0) return {(unsigned short)(sign | ((e + 8u) << 10) | (m << 7))};  // 2^(e-7)
    if (m == 0) return {sign};                                         // +-0
    // subnormal m * 2^-9 = 2^(p - 9) (1 + rest), p the top set bit of m: FP16 normal
    const unsigned p = m >= 4 ? 2u : m >= 2 ? 1u : 0u;
    const unsigned rest = (m << (3 - p)) & 7u;   // the bits below the top one, as 3 bits
    return {(unsigned short)(sign | ((p - 9u + 15u) << 10) | (rest << 7))};
}

inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(const __nv_fp8x2_storage_t x,
                                              const __nv_fp8_interpretation_t interp) {
    return {__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(x & 0xFFu), interp).x,
            __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(x >> 8), interp).x};
}

template <__nv_fp8_interpretation_t I>
struct __emu_fp8 {
    __nv_fp8_storage_t __x;
    explicit operator __half() const { return __nv_cvt_fp8_to_halfraw(__x, I); }
    explicit operator float() const { return __half2float(__nv_cvt_fp8_to_halfraw(__x, I)); }
};
typedef __emu_fp8<__NV_E4M3> __nv_fp8_e4m3;
typedef __emu_fp8<__NV_E5M2> __nv_fp8_e5m2;
