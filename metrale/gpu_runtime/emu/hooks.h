// The instrumented build's entry points: g++ -fsanitize=thread calls __tsan_read<N>(addr)
// before every N-byte load and __tsan_write<N> before every store of the code it compiles
// (N = 1, 2, 4, 8, 16; _range for other sizes; _unaligned_ where the compiler itself knows
// the address may be unaligned). The build links no libtsan: these definitions are the
// runtime, and they feed check.h (alignment, races) and counters.h.
//
// With -fno-tree-sra (build.py) a 16-byte vector type (uint4, float4, bf16x8) stays one
// 16-byte access, as it is one ld/st.v4 on the GPU, instead of being split into fields.
// The runtime's own code is instrumented too (one translation unit); `busy` keeps the hooks
// from re-entering, and accesses outside shared memory and the launch's allocations (the
// fiber's stack, the emulator's state) are ignored.
#pragma once
#include "counters.h"

namespace emu {

inline bool hook_busy = false;

EMU_NOINST inline void report_misaligned(const Fiber *f, uintptr_t a, size_t n, bool write,
                                         long sidx, int range, unsigned int pc) {
    char where[128];
    if (sidx >= 0) shared_where(where, sizeof where, sidx);
    else std::snprintf(where, sizeof where, "byte %llu of the allocation at 0x%llx",
                       static_cast<unsigned long long>(a - chk.ranges[range].base),
                       chk.ranges[range].base);
    report("thread (%u,%u,%u): misaligned %zu-byte %s at @pc:0x%x: address 0x%llx (%s) is not "
           "a multiple of %zu (a misaligned-address fault on the GPU)", f->tid.x, f->tid.y,
           f->tid.z, n, write ? "store" : "load", pc, static_cast<unsigned long long>(a), where, n);
}

// An access of kernel code outside its own stack, while checks are on.
EMU_NOINST __attribute__((noinline)) inline void on_access_checked(
    Fiber *f, uintptr_t a, size_t n, bool write, const void *ret, bool may_check_alignment) {
    hook_busy = true;
    const long sidx = shared_index(a, n);
    int range = -1;
    if (sidx < 0 && (range = range_of(a, n)) < 0) {
        hook_busy = false;
        return;
    }
    const unsigned int pc = code_offset(ret);
    if ((chk.flags & CHECK_ALIGN) && may_check_alignment && n > 1 && (a & (n - 1))) {
        report_misaligned(f, a, n, write, sidx, range, pc);
        // never execute it: g++ may have emitted an aligned SSE move, which faults on x86
        hook_busy = false;
        yield(f, true);
        __builtin_trap();
    }
    if (chk.flags & CHECK_RACE) {
        if (sidx >= 0) race_shared(f->lin, sidx, n, write, pc);
        else race_global(f->lin, range, a, n, write, pc);
    }
    if (chk.flags & CHECK_COUNT) {
        if (sidx >= 0) {
            count_access(write ? SST : SLD, f, a, n, pc);
        } else {
            count_access(write ? GST : GLD, f, a, n, pc);
            mark_range(range, a, n, write);
        }
    }
    hook_busy = false;
}

// Every instrumented access: the common cases (no launch, checks off, the fiber's own
// stack) leave at once, without the frame the checks need.
EMU_NOINST __attribute__((always_inline)) inline void on_access(
    const void *p, size_t n, bool write, const void *ret, bool may_check_alignment) {
    Fiber *f = rt.cur;
    if (__builtin_expect(!f || !chk.flags || hook_busy, 0)) return;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (a - reinterpret_cast<uintptr_t>(f->stack) < f->stack_size) return;  // its own locals
    // threadIdx and friends read the runtime's state
    if (a - reinterpret_cast<uintptr_t>(&rt) < sizeof rt) return;
    if (a - reinterpret_cast<uintptr_t>(rt.fibers) < MAX_THREADS * sizeof(Fiber)) return;
    on_access_checked(f, a, n, write, ret, may_check_alignment);
}

}  // namespace emu

#define EMU_HOOK(N)                                                                          \
    extern "C" EMU_NOINST void __tsan_read##N(void *p) {                                     \
        ::emu::on_access(p, N, false, __builtin_return_address(0), true);                    \
    }                                                                                        \
    extern "C" EMU_NOINST void __tsan_write##N(void *p) {                                    \
        ::emu::on_access(p, N, true, __builtin_return_address(0), true);                     \
    }                                                                                        \
    extern "C" EMU_NOINST void __tsan_unaligned_read##N(void *p) {                           \
        ::emu::on_access(p, N, false, __builtin_return_address(0), false);                   \
    }                                                                                        \
    extern "C" EMU_NOINST void __tsan_unaligned_write##N(void *p) {                          \
        ::emu::on_access(p, N, true, __builtin_return_address(0), false);                    \
    }
EMU_HOOK(1)
EMU_HOOK(2)
EMU_HOOK(4)
EMU_HOOK(8)
EMU_HOOK(16)
#undef EMU_HOOK

extern "C" EMU_NOINST void __tsan_read_range(void *p, unsigned long n) {
    ::emu::on_access(p, n, false, __builtin_return_address(0), false);
}
extern "C" EMU_NOINST void __tsan_write_range(void *p, unsigned long n) {
    ::emu::on_access(p, n, true, __builtin_return_address(0), false);
}
extern "C" EMU_NOINST void __tsan_init() {}
extern "C" EMU_NOINST void __tsan_func_entry(void *) {}
extern "C" EMU_NOINST void __tsan_func_exit() {}
extern "C" EMU_NOINST void __tsan_vptr_update(void **, void *) {}
extern "C" EMU_NOINST void __tsan_vptr_read(void **) {}

// Atomic builtins the C++ library may use (function-local static guards): plain operations,
// fibers never run concurrently.
#define EMU_TSAN_ATOMIC(N, T)                                                                \
    extern "C" EMU_NOINST T __tsan_atomic##N##_load(const volatile T *a, int) { return *a; } \
    extern "C" EMU_NOINST void __tsan_atomic##N##_store(volatile T *a, T v, int) { *a = v; } \
    extern "C" EMU_NOINST T __tsan_atomic##N##_exchange(volatile T *a, T v, int) {           \
        T o = *a; *a = v; return o;                                                          \
    }                                                                                        \
    extern "C" EMU_NOINST T __tsan_atomic##N##_fetch_add(volatile T *a, T v, int) {          \
        T o = *a; *a = static_cast<T>(o + v); return o;                                      \
    }                                                                                        \
    extern "C" EMU_NOINST T __tsan_atomic##N##_fetch_sub(volatile T *a, T v, int) {          \
        T o = *a; *a = static_cast<T>(o - v); return o;                                      \
    }                                                                                        \
    extern "C" EMU_NOINST T __tsan_atomic##N##_fetch_or(volatile T *a, T v, int) {           \
        T o = *a; *a = static_cast<T>(o | v); return o;                                      \
    }                                                                                        \
    extern "C" EMU_NOINST T __tsan_atomic##N##_fetch_and(volatile T *a, T v, int) {          \
        T o = *a; *a = static_cast<T>(o & v); return o;                                      \
    }                                                                                        \
    extern "C" EMU_NOINST int __tsan_atomic##N##_compare_exchange_strong(                    \
        volatile T *a, T *c, T v, int, int) {                                                \
        if (*a == *c) { *a = v; return 1; }                                                  \
        *c = *a; return 0;                                                                   \
    }                                                                                        \
    extern "C" EMU_NOINST int __tsan_atomic##N##_compare_exchange_weak(                      \
        volatile T *a, T *c, T v, int s, int f) {                                            \
        return __tsan_atomic##N##_compare_exchange_strong(a, c, v, s, f);                    \
    }
EMU_TSAN_ATOMIC(8, unsigned char)
EMU_TSAN_ATOMIC(16, unsigned short)
EMU_TSAN_ATOMIC(32, unsigned int)
EMU_TSAN_ATOMIC(64, unsigned long long)
#undef EMU_TSAN_ATOMIC
extern "C" EMU_NOINST void __tsan_atomic_thread_fence(int) {}
extern "C" EMU_NOINST void __tsan_atomic_signal_fence(int) {}
