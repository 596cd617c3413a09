// Force-included (-include shim.h) before every kernels/*.cu file in the EmuBackend build: it
// gives g++ what nvcc gives a kernel - the execution-space qualifiers, the built-in variables
// threadIdx/blockIdx/blockDim/gridDim, __shared__ memory, vector and BF16 types, intrinsics,
// barriers and warp intrinsics - on top of the fiber runtime (fiber.h).
//
// __CUDA_ARCH__ is not defined: inline PTX must sit in an `#ifdef __CUDA_ARCH__` branch with a
// plain C++ `#else` (metrale check-kernels enforces it). __shared__ variables are statics in
// the `emu_shared` section, refilled with 0xFF before each block; `extern __shared__ T x[]`
// (dynamic shared memory) is rewritten by the build into a pointer to the launch's buffer of
// exactly `shared_mem` bytes (metrale/gpu_runtime/emu/build.py).
#pragma once
#define METRALE_EMU 1
#define __CUDACC__ 1

#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __forceinline__ inline
#define __inline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static __attribute__((section("emu_shared")))

#include <utility>

#include "intrinsics.h"
#include "tensor_core.h"  // includes launch.h
#if defined(EMU_CHECK)
#include "hooks.h"        // the instrumented build's runtime (check.h, counters.h)
#endif

#define threadIdx (static_cast<const uint3 &>(::emu::rt.cur->tid))
#define blockIdx (static_cast<const uint3 &>(::emu::rt.bid))
#define blockDim (static_cast<const dim3 &>(::emu::rt.block_dim))
#define gridDim (static_cast<const dim3 &>(::emu::rt.grid_dim))
#define warpSize 32

namespace emu {
// Calls kernel `k` with its arguments unpacked from cuLaunchKernel-style `void **args`.
template <class... P, size_t... I>
inline void invoke_impl(void (*k)(P...), void **a, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<P> *>(a[I])...);
}
template <class... P> inline void invoke(void (*k)(P...), void **a) {
    invoke_impl(k, a, std::index_sequence_for<P...>{});
}

// One parameter's description for the launch check: "p<align>" pointer to a type of that
// alignment, "i4"/"u4"/"i8"/"u8"/"f4"/"f8" scalars, "x<size>" anything else; then ":" and
// the C type as the compiler spells it.
template <class T> inline const char *type_name() { return __PRETTY_FUNCTION__; }
template <class T> inline void describe(char *&out, char *end) {
    typedef std::remove_cv_t<T> U;
    int n;
    if constexpr (std::is_pointer_v<U>) {
        typedef std::remove_cv_t<std::remove_pointer_t<U>> E;
        size_t align = 1;
        if constexpr (!std::is_void_v<E>) align = alignof(E);
        n = std::snprintf(out, end - out, "p%zu", align);
    } else if constexpr (std::is_floating_point_v<U>) {
        n = std::snprintf(out, end - out, "f%zu", sizeof(U));
    } else if constexpr (std::is_integral_v<U>) {
        n = std::snprintf(out, end - out, "%c%zu", std::is_signed_v<U> ? 'i' : 'u', sizeof(U));
    } else {
        n = std::snprintf(out, end - out, "x%zu", sizeof(U));
    }
    out += n;
    const char *pretty = type_name<T>();
    const char *b = std::strstr(pretty, "T = ");
    b = b ? b + 4 : pretty;
    const char *e = std::strpbrk(b, ";]");
    n = std::snprintf(out, end - out, ":%.*s,", static_cast<int>(e ? e - b : std::strlen(b)), b);
    out += n;
}
template <class... P> inline const char *signature(void (*)(P...)) {
    static char buf[2048];
    char *out = buf, *end = buf + sizeof buf;
    buf[0] = 0;
    (describe<P>(out, end), ...);
    return buf;
}
}  // namespace emu
