// CUDA device intrinsics for the EmuBackend: vector types, BF16, bit tricks, rounding-mode
// arithmetic, math, atomics, warp intrinsics and barriers, with the device's semantics.
//
// Numerics: the build uses -ffp-contract=off, so a*b+c is never fused unless the kernel says
// fmaf (a real fused multiply-add, -mfma). The explicitly rounded `_rn` operations are IEEE
// operations whose result is pinned in a register (an empty asm), so the compiler cannot
// combine them with neighbours even if contraction were on. Float-to-integer conversions
// saturate and send NaN to 0, as PTX cvt does. FP32 -> BF16 rounds to nearest even and gives
// the canonical NaN 0x7FFF for every NaN, as cvt.rn.bf16.f32 does (twin: metrale/ops/bf16.py).
// Not reproduced: --use_fast_math's approximate expf/exp2f/rsqrtf/division (libm's correctly
// rounded or near-correct results are used) and nvcc's own FMA contraction.
#pragma once
#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <time.h>

#include "sync.h"

#define EMU_VEC2(T, N, A) struct __attribute__((aligned(A))) N { T x, y; };
#define EMU_VEC3(T, N) struct N { T x, y, z; };
#define EMU_VEC4(T, N, A) struct __attribute__((aligned(A))) N { T x, y, z, w; };
EMU_VEC2(int, int2, 8)
EMU_VEC3(int, int3)
EMU_VEC4(int, int4, 16)
EMU_VEC2(unsigned int, uint2, 8)
EMU_VEC4(unsigned int, uint4, 16)
EMU_VEC2(float, float2, 8)
EMU_VEC3(float, float3)
EMU_VEC4(float, float4, 16)
EMU_VEC2(double, double2, 16)
EMU_VEC2(long long, longlong2, 16)
EMU_VEC2(unsigned long long, ulonglong2, 16)
EMU_VEC2(unsigned short, ushort2, 4)
EMU_VEC4(unsigned short, ushort4, 8)
EMU_VEC2(short, short2, 4)
EMU_VEC4(unsigned char, uchar4, 4)
EMU_VEC4(signed char, char4, 4)
#undef EMU_VEC2
#undef EMU_VEC3
#undef EMU_VEC4

inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }
inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return {x, y, z}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
    return {x, y, z, w};
}
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float3 make_float3(float x, float y, float z) { return {x, y, z}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline double2 make_double2(double x, double y) { return {x, y}; }

// ------------------------------------------------------------------ reinterpretation
inline unsigned int __float_as_uint(float x) { unsigned int u; std::memcpy(&u, &x, 4); return u; }
inline int __float_as_int(float x) { int u; std::memcpy(&u, &x, 4); return u; }
inline float __uint_as_float(unsigned int u) { float x; std::memcpy(&x, &u, 4); return x; }
inline float __int_as_float(int u) { float x; std::memcpy(&x, &u, 4); return x; }
inline long long __double_as_longlong(double x) { long long u; std::memcpy(&u, &x, 8); return u; }
inline double __longlong_as_double(long long u) { double x; std::memcpy(&x, &u, 8); return x; }
inline int __double2hiint(double x) { return static_cast<int>(__double_as_longlong(x) >> 32); }
inline int __double2loint(double x) { return static_cast<int>(__double_as_longlong(x)); }

// ------------------------------------------------------------------ BF16
struct __nv_bfloat16_raw { unsigned short x; };

namespace emu {
inline unsigned short f32_to_bf16_bits(float f) {
    const unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // canonical NaN
    return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline unsigned short f32_to_bf16_bits_rz(float f) {
    const unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    return static_cast<unsigned short>(u >> 16);
}
}  // namespace emu

struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(__nv_bfloat16_raw r) : __x(r.x) {}
    __nv_bfloat16(float f) : __x(emu::f32_to_bf16_bits(f)) {}
    operator float() const { return __uint_as_float(static_cast<unsigned int>(__x) << 16); }
    operator __nv_bfloat16_raw() const { return {__x}; }
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

inline float __bfloat162float(__nv_bfloat16 b) {
    return __uint_as_float(static_cast<unsigned int>(b.__x) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    __nv_bfloat16 b;
    b.__x = emu::f32_to_bf16_bits(f);
    return b;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
    __nv_bfloat16 b;
    b.__x = emu::f32_to_bf16_bits_rz(f);
    return b;
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
    __nv_bfloat16 b;
    b.__x = u;
    return b;
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
    return {__bfloat162float(v.x), __bfloat162float(v.y)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline __nv_bfloat162 __float2bfloat162_rn(float a) { return __floats2bfloat162_rn(a, a); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return {a, b}; }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return {a, a}; }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 v) { return v.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 v) { return v.y; }
inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }

// ------------------------------------------------------------------ integer intrinsics
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz(static_cast<unsigned int>(x)) : 32; }
inline int __clzll(long long x) {
    return x ? __builtin_clzll(static_cast<unsigned long long>(x)) : 64;
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline int __mulhi(int a, int b) {
    return static_cast<int>((static_cast<long long>(a) * b) >> 32);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline long long __mul64hi(long long a, long long b) {
    return static_cast<long long>((static_cast<__int128>(a) * b) >> 64);
}
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const unsigned long long v = (static_cast<unsigned long long>(y) << 32) | x;
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) r |= ((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}

// min/max as CUDA overloads them (integer, mixed signedness as unsigned, float, double).
template <class A, class B>
inline auto min(A a, B b) -> std::enable_if_t<std::is_integral_v<A> && std::is_integral_v<B>,
                                               std::common_type_t<A, B>> {
    typedef std::common_type_t<A, B> C;
    return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
}
template <class A, class B>
inline auto max(A a, B b) -> std::enable_if_t<std::is_integral_v<A> && std::is_integral_v<B>,
                                               std::common_type_t<A, B>> {
    typedef std::common_type_t<A, B> C;
    return static_cast<C>(a) > static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
}
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }

// ------------------------------------------------------------------ rounding-mode arithmetic
#define EMU_PIN(v) asm("" : "+x"(v))
inline float __fadd_rn(float a, float b) { float r = a + b; EMU_PIN(r); return r; }
inline float __fsub_rn(float a, float b) { float r = a - b; EMU_PIN(r); return r; }
inline float __fmul_rn(float a, float b) { float r = a * b; EMU_PIN(r); return r; }
inline float __fdiv_rn(float a, float b) { float r = a / b; EMU_PIN(r); return r; }
inline float __frcp_rn(float a) { float r = 1.0f / a; EMU_PIN(r); return r; }
inline float __fsqrt_rn(float a) { float r = std::sqrt(a); EMU_PIN(r); return r; }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { double r = a + b; EMU_PIN(r); return r; }
inline double __dsub_rn(double a, double b) { double r = a - b; EMU_PIN(r); return r; }
inline double __dmul_rn(double a, double b) { double r = a * b; EMU_PIN(r); return r; }
inline double __ddiv_rn(double a, double b) { double r = a / b; EMU_PIN(r); return r; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
#undef EMU_PIN

// ------------------------------------------------------------------ conversions (saturating)
namespace emu {
template <class I, class F>
inline I sat_cvt(F r) {  // r already rounded to an integral value
    if (r != r) return 0;
    if (r <= static_cast<F>(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
    if (r >= static_cast<F>(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
    return static_cast<I>(r);
}
}  // namespace emu
inline int __float2int_rn(float x) { return emu::sat_cvt<int>(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return emu::sat_cvt<int>(std::trunc(x)); }
inline int __float2int_rd(float x) { return emu::sat_cvt<int>(std::floor(x)); }
inline int __float2int_ru(float x) { return emu::sat_cvt<int>(std::ceil(x)); }
inline unsigned int __float2uint_rn(float x) {
    return emu::sat_cvt<unsigned int>(std::nearbyint(x));
}
inline unsigned int __float2uint_rz(float x) { return emu::sat_cvt<unsigned int>(std::trunc(x)); }
inline long long __float2ll_rz(float x) { return emu::sat_cvt<long long>(std::trunc(x)); }
inline long long __float2ll_rn(float x) { return emu::sat_cvt<long long>(std::nearbyint(x)); }
inline unsigned long long __float2ull_rz(float x) {
    return emu::sat_cvt<unsigned long long>(std::trunc(x));
}
inline unsigned long long __float2ull_rn(float x) {
    return emu::sat_cvt<unsigned long long>(std::nearbyint(x));
}
inline int __double2int_rn(double x) { return emu::sat_cvt<int>(std::nearbyint(x)); }
inline int __double2int_rz(double x) { return emu::sat_cvt<int>(std::trunc(x)); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned int x) { return static_cast<float>(x); }
inline float __ll2float_rn(long long x) { return static_cast<float>(x); }
inline float __ull2float_rn(unsigned long long x) { return static_cast<float>(x); }
inline double __int2double_rn(int x) { return static_cast<double>(x); }
inline double __uint2double_rn(unsigned int x) { return static_cast<double>(x); }
inline double __ll2double_rn(long long x) { return static_cast<double>(x); }
inline double __ull2double_rn(unsigned long long x) { return static_cast<double>(x); }
inline float __double2float_rn(double x) { return static_cast<float>(x); }

// ------------------------------------------------------------------ math
// expf, exp2f, tanhf, erff, fmaf, ... are libm's (<math.h>), as CUDA spells them; see the
// header comment for what that does not reproduce.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float exp10f(float x) { return std::pow(10.0f, x); }
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __log10f(float x) { return std::log10(x); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x != x ? 0.0f : std::fmin(std::fmax(x, 0.0f), 1.0f); }
inline void sincosf(float x, float *s, float *c) { *s = std::sin(x); *c = std::cos(x); }
inline void __sincosf(float x, float *s, float *c) { sincosf(x, s, c); }

// ------------------------------------------------------------------ memory access hints
template <class T> inline T __ldg(const T *p) { return *p; }
template <class T> inline T __ldcg(const T *p) { return *p; }
template <class T> inline T __ldca(const T *p) { return *p; }
template <class T> inline T __ldcs(const T *p) { return *p; }
template <class T> inline T __ldlu(const T *p) { return *p; }
template <class T> inline T __ldcv(const T *p) { return *p; }
template <class T> inline void __stcg(T *p, T v) { *p = v; }
template <class T> inline void __stcs(T *p, T v) { *p = v; }
template <class T> inline void __stwb(T *p, T v) { *p = v; }
template <class T> inline void __stwt(T *p, T v) { *p = v; }

// ------------------------------------------------------------------ atomics
// Fibers never preempt each other, so a plain read-modify-write is atomic. Atomics are not
// instrumented (the race detector must not see them as plain accesses) and are counted.
namespace emu {
inline void note_atomic() {
    if (chk.flags & CHECK_COUNT) count_event(EV_ATOMIC);
}
}  // namespace emu
#define EMU_ATOMIC_FN template <class T, class U> __attribute__((no_sanitize_thread)) inline T
#define EMU_ATOMIC(NAME, EXPR)                                                              \
    EMU_ATOMIC_FN NAME(T *p, U v) { ::emu::note_atomic(); T old = *p; *p = EXPR; return old; }
EMU_ATOMIC(atomicAdd, static_cast<T>(old + static_cast<T>(v)))
EMU_ATOMIC(atomicSub, static_cast<T>(old - static_cast<T>(v)))
EMU_ATOMIC(atomicExch, static_cast<T>(v))
EMU_ATOMIC(atomicMin, (static_cast<T>(v) < old ? static_cast<T>(v) : old))
EMU_ATOMIC(atomicMax, (static_cast<T>(v) > old ? static_cast<T>(v) : old))
EMU_ATOMIC(atomicAnd, static_cast<T>(old & static_cast<T>(v)))
EMU_ATOMIC(atomicOr, static_cast<T>(old | static_cast<T>(v)))
EMU_ATOMIC(atomicXor, static_cast<T>(old ^ static_cast<T>(v)))
EMU_ATOMIC(atomicAdd_block, static_cast<T>(old + static_cast<T>(v)))
EMU_ATOMIC(atomicAdd_system, static_cast<T>(old + static_cast<T>(v)))
#undef EMU_ATOMIC
#undef EMU_ATOMIC_FN
__attribute__((no_sanitize_thread)) inline unsigned int atomicInc(unsigned int *p, unsigned int v) {
    emu::note_atomic();
    const unsigned int old = *p;
    *p = old >= v ? 0u : old + 1u;
    return old;
}
__attribute__((no_sanitize_thread)) inline unsigned int atomicDec(unsigned int *p, unsigned int v) {
    emu::note_atomic();
    const unsigned int old = *p;
    *p = (old == 0u || old > v) ? v : old - 1u;
    return old;
}
template <class T> __attribute__((no_sanitize_thread)) inline T atomicCAS(T *p, T compare, T v) {
    emu::note_atomic();
    const T old = *p;
    if (old == compare) *p = v;
    return old;
}
inline void __threadfence() { asm volatile("" ::: "memory"); }
inline void __threadfence_block() { asm volatile("" ::: "memory"); }
inline void __threadfence_system() { asm volatile("" ::: "memory"); }
inline void __nanosleep(unsigned int) {}
inline long long clock64() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return static_cast<long long>(t.tv_sec) * 1000000000LL + t.tv_nsec;
}
[[noreturn]] inline void __trap(emu::site_t site = emu::site_t::current()) {
    emu::fail_here("__trap()", site);
}

// ------------------------------------------------------------------ barriers and warps
namespace emu {
template <class T> inline unsigned long long widen(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "match takes <= 8 bytes");
    unsigned long long u = 0;
    std::memcpy(&u, &v, sizeof(T));
    return u;
}
}  // namespace emu
inline void __syncthreads(emu::site_t site = emu::site_t::current()) {
    emu::block_barrier(emu::SYNC, 0, site);
}
inline int __syncthreads_count(int p, emu::site_t site = emu::site_t::current()) {
    return emu::block_barrier(emu::SYNC_COUNT, p, site);
}
inline int __syncthreads_and(int p, emu::site_t site = emu::site_t::current()) {
    return emu::block_barrier(emu::SYNC_AND, p, site);
}
inline int __syncthreads_or(int p, emu::site_t site = emu::site_t::current()) {
    return emu::block_barrier(emu::SYNC_OR, p, site);
}
inline void __syncwarp(unsigned int mask = 0xffffffffu,
                       emu::site_t site = emu::site_t::current()) {
    emu::warp_op<int>(emu::SYNCWARP, mask, 0, 0, 32, site);
}
template <class T>
inline T __shfl_sync(unsigned int mask, T v, int src_lane, int width = 32,
                     emu::site_t site = emu::site_t::current()) {
    return emu::warp_op<T>(emu::SHFL_IDX, mask, v, src_lane, width, site);
}
template <class T>
inline T __shfl_up_sync(unsigned int mask, T v, unsigned int delta, int width = 32,
                        emu::site_t site = emu::site_t::current()) {
    return emu::warp_op<T>(emu::SHFL_UP, mask, v, static_cast<int>(delta), width, site);
}
template <class T>
inline T __shfl_down_sync(unsigned int mask, T v, unsigned int delta, int width = 32,
                          emu::site_t site = emu::site_t::current()) {
    return emu::warp_op<T>(emu::SHFL_DOWN, mask, v, static_cast<int>(delta), width, site);
}
template <class T>
inline T __shfl_xor_sync(unsigned int mask, T v, int lane_mask, int width = 32,
                         emu::site_t site = emu::site_t::current()) {
    return emu::warp_op<T>(emu::SHFL_XOR, mask, v, lane_mask, width, site);
}
inline unsigned int __ballot_sync(unsigned int mask, int pred,
                                  emu::site_t site = emu::site_t::current()) {
    return emu::warp_op<unsigned int>(emu::BALLOT, mask, pred != 0, 0, 32, site);
}
inline int __all_sync(unsigned int mask, int pred, emu::site_t site = emu::site_t::current()) {
    return static_cast<int>(emu::warp_op<unsigned int>(emu::ALL, mask, pred != 0, 0, 32, site));
}
inline int __any_sync(unsigned int mask, int pred, emu::site_t site = emu::site_t::current()) {
    return static_cast<int>(emu::warp_op<unsigned int>(emu::ANY, mask, pred != 0, 0, 32, site));
}
template <class T>
inline unsigned int __match_any_sync(unsigned int mask, T v,
                                     emu::site_t site = emu::site_t::current()) {
    return static_cast<unsigned int>(
        emu::warp_op<unsigned long long>(emu::MATCH_ANY, mask, emu::widen(v), 0, 32, site));
}
template <class T>
inline unsigned int __match_all_sync(unsigned int mask, T v, int *pred,
                                     emu::site_t site = emu::site_t::current()) {
    const unsigned int r = static_cast<unsigned int>(
        emu::warp_op<unsigned long long>(emu::MATCH_ALL, mask, emu::widen(v), 0, 32, site));
    *pred = r != 0;
    return r;
}
#define EMU_REDUCE(NAME, T, OP)                                                             \
    inline T NAME(unsigned int mask, T v, emu::site_t site = emu::site_t::current()) {       \
        return emu::warp_op<T>(emu::OP, mask, v, 0, 32, site);                              \
    }
EMU_REDUCE(__reduce_add_sync, unsigned int, REDUCE_ADD)
EMU_REDUCE(__reduce_add_sync, int, REDUCE_ADD)
EMU_REDUCE(__reduce_min_sync, unsigned int, REDUCE_UMIN)
EMU_REDUCE(__reduce_min_sync, int, REDUCE_MIN)
EMU_REDUCE(__reduce_max_sync, unsigned int, REDUCE_UMAX)
EMU_REDUCE(__reduce_max_sync, int, REDUCE_MAX)
EMU_REDUCE(__reduce_and_sync, unsigned int, REDUCE_AND)
EMU_REDUCE(__reduce_or_sync, unsigned int, REDUCE_OR)
EMU_REDUCE(__reduce_xor_sync, unsigned int, REDUCE_XOR)
#undef EMU_REDUCE
// The lanes of this warp that have not exited (the emulator keeps no notion of divergence).
inline unsigned int __activemask() {
    const emu::Fiber *w = emu::rt.fibers + emu::rt.cur->warp * 32;
    unsigned int m = 0;
    for (unsigned int l = 0; l < 32; ++l)
        if ((emu::lanes_in_warp(emu::rt.cur->warp) >> l & 1u) && w[l].state != emu::EXITED)
            m |= 1u << l;
    return m;
}
