// The CUDA execution model on the CPU: one cooperative fiber per CUDA thread.
//
// A launch runs its blocks one after another (z, y, x order, x fastest). A block runs all its
// fibers to completion: a fiber runs until it reaches a __syncthreads (block barrier) or a
// warp intrinsic (warp barrier), or returns. The scheduler then
//   - completes a warp operation as soon as every lane named in its mask has arrived at one:
//     each lane deposited its value, the results follow the PTX lane rules (shfl incl. width,
//     ballot, match, reduce), and the lanes resume;
//   - releases a block barrier when every live thread waits at the same __syncthreads
//     (threads that returned count as arrived, as on sm_70+ hardware);
//   - reports, with file and line: a deadlock, threads waiting at different barriers, lanes
//     of one warp operation at different intrinsics or with different masks, a mask that
//     names an exited or missing lane, a shuffle reading a lane outside the mask.
// The order in which released fibers resume is forward, reverse or a seeded shuffle
// (METRALE_EMU_ORDER), so a race between threads of one barrier interval shows up as
// output that depends on the order.
//
// Context switch: a 16-instruction x86-64 register switch (callee-saved registers, MXCSR and
// the x87 control word); ucontext elsewhere. Fiber stacks are mmap'ed with a guard page and
// reused across launches. Under AddressSanitizer every switch is annotated.
// All state is one global `rt`; a mutex makes launches of one library exclusive.
#pragma once
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <pthread.h>
#include <signal.h>
#include <source_location>
#include <sys/mman.h>
#include <type_traits>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#endif

struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
        : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

namespace emu {

typedef std::source_location site_t;

enum State : unsigned char { READY, WAIT_BLOCK, WAIT_WARP, EXITED };
enum Op : unsigned char {
    // warp operations
    SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, BALLOT, ALL, ANY, MATCH_ANY, MATCH_ALL, SYNCWARP,
    REDUCE_ADD, REDUCE_MIN, REDUCE_MAX, REDUCE_UMIN, REDUCE_UMAX, REDUCE_AND, REDUCE_OR,
    REDUCE_XOR,
    // tensor-core collectives (tensor_core.h): operands and results through in/out pointers
    MMA_BF16, LDMATRIX,
    // block barriers
    SYNC, SYNC_COUNT, SYNC_AND, SYNC_OR,
};

inline const char *op_name(Op op) {
    static const char *names[] = {
        "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
        "__ballot_sync", "__all_sync", "__any_sync", "__match_any_sync", "__match_all_sync",
        "__syncwarp", "__reduce_add_sync", "__reduce_min_sync", "__reduce_max_sync",
        "__reduce_min_sync", "__reduce_max_sync", "__reduce_and_sync", "__reduce_or_sync",
        "__reduce_xor_sync", "mma.sync.m16n8k16.bf16", "ldmatrix", "__syncthreads",
        "__syncthreads_count", "__syncthreads_and",
        "__syncthreads_or"};
    return names[op];
}

struct Fiber {
    void *sp;                 // saved stack pointer (x86-64 switch)
    uint3 tid;
    unsigned int lin, lane, warp;
    State state;
    Op op;
    unsigned int mask;
    int width, param;
    unsigned int size;
    unsigned long long val, result;
    const void *in;           // tensor-core collectives: this lane's operands ...
    void *out;                // ... and where its results go (both on its own stack)
    site_t site;
    char *stack;              // usable stack (above the guard page)
    size_t stack_size;
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
#if defined(EMU_ASAN)
    void *fake_stack;
#endif
    // cp.async copies issued and not yet waited for (tensor_core.h)
    int n_async, async_groups;
    struct AsyncCopy { void *dst; const void *src; unsigned int bytes, src_bytes; int group; }
        async[128];
};

enum Order { FORWARD = 0, REVERSE = 1, SHUFFLE = 2 };

// What Python passes to a launch (metrale/gpu_runtime/emu/library.py mirrors it).
struct LaunchConfig {
    unsigned int grid[3];
    unsigned int block[3];
    unsigned long long shared_mem;
    int order;
    unsigned long long seed;
};

constexpr size_t STACK_BYTES = 64 * 1024;
constexpr int MAX_THREADS = 1024;

struct Runtime {
    Fiber *fibers = nullptr;  // MAX_THREADS, stacks allocated on first use
    int n_stacks = 0;
    int n_threads = 0;
    Fiber *cur = nullptr;
    void *sched_sp = nullptr;
#if !defined(__x86_64__)
    ucontext_t sched_uc;
#endif
#if defined(EMU_ASAN)
    void *sched_fake = nullptr;
    const void *sched_bottom = nullptr;
    size_t sched_size = 0;
#endif
    uint3 bid;
    dim3 grid_dim, block_dim;
    void (*body)(void **) = nullptr;
    void **args = nullptr;
    unsigned char *dyn_smem = nullptr;
    size_t dyn_bytes = 0;
    int order = FORWARD;
    unsigned long long rng = 0;
    int queue[MAX_THREADS + 1];
    int q_head = 0, q_tail = 0;
    bool failed = false;
    char err[1024];
    const char *kernel = "";
};

inline Runtime rt;
inline pthread_mutex_t launch_mutex = PTHREAD_MUTEX_INITIALIZER;

// ------------------------------------------------------------------ context switching
#if defined(__x86_64__)
extern "C" void emu_switch_ctx(void **save_sp, void *load_sp);
extern "C" void emu_fiber_trampoline();
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack,
// stores the stack pointer, loads the other one and restores the same set from it.
asm(R"(
    .text
    .p2align 4
    .hidden emu_switch_ctx
    .globl emu_switch_ctx
    .type emu_switch_ctx, @function
emu_switch_ctx:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_ctx, .-emu_switch_ctx
    .p2align 4
    .hidden emu_fiber_trampoline
    .globl emu_fiber_trampoline
    .type emu_fiber_trampoline, @function
emu_fiber_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size emu_fiber_trampoline, .-emu_fiber_trampoline
)");
#endif

[[noreturn]] inline void fiber_main(Fiber *f);
__attribute__((format(printf, 1, 2))) inline void report(const char *fmt, ...);

inline void fiber_main_uc(unsigned int hi, unsigned int lo) {
    fiber_main(reinterpret_cast<Fiber *>((static_cast<uintptr_t>(hi) << 32) | lo));
}

// Kernel code runs with the device's float environment: flush-to-zero and denormals-are-zero
// (CuPy always compiles with -ftz=true), round to nearest.
constexpr unsigned int KERNEL_MXCSR = 0x1F80u | 0x8000u | 0x0040u;

inline void prepare_fiber(Fiber *f) {
#if defined(EMU_ASAN)
    ASAN_UNPOISON_MEMORY_REGION(f->stack, f->stack_size);
    f->fake_stack = nullptr;
#endif
#if defined(__x86_64__)
    uint64_t *sp = reinterpret_cast<uint64_t *>(f->stack + f->stack_size - 64);
    unsigned short fpucw;
    asm volatile("fnstcw %0" : "=m"(fpucw));
    sp[0] = KERNEL_MXCSR | (static_cast<uint64_t>(fpucw) << 32);
    sp[1] = sp[2] = 0;                                             // r15, r14
    sp[3] = reinterpret_cast<uint64_t>(&fiber_main);               // r13
    sp[4] = reinterpret_cast<uint64_t>(f);                         // r12
    sp[5] = sp[6] = 0;                                             // rbx, rbp
    sp[7] = reinterpret_cast<uint64_t>(&emu_fiber_trampoline);     // return address
    f->sp = sp;
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack;
    f->uc.uc_stack.ss_size = f->stack_size;
    f->uc.uc_link = nullptr;
    const uintptr_t p = reinterpret_cast<uintptr_t>(f);
    makecontext(&f->uc, reinterpret_cast<void (*)()>(&fiber_main_uc), 2,
                static_cast<unsigned int>(p >> 32), static_cast<unsigned int>(p));
#endif
}

// scheduler -> fiber f; returns when f yields, exits or fails
inline void resume(Fiber *f) {
    rt.cur = f;
#if defined(EMU_ASAN)
    __sanitizer_start_switch_fiber(&rt.sched_fake, f->stack, f->stack_size);
#endif
#if defined(__x86_64__)
    emu_switch_ctx(&rt.sched_sp, f->sp);
#else
    swapcontext(&rt.sched_uc, &f->uc);
#endif
#if defined(EMU_ASAN)
    __sanitizer_finish_switch_fiber(rt.sched_fake, nullptr, nullptr);
#endif
    rt.cur = nullptr;
}

// fiber -> scheduler; `dying` fibers never resume
inline void yield(Fiber *f, bool dying = false) {
#if defined(EMU_ASAN)
    __sanitizer_start_switch_fiber(dying ? nullptr : &f->fake_stack, rt.sched_bottom,
                                   rt.sched_size);
#else
    (void)dying;
#endif
#if defined(__x86_64__)
    emu_switch_ctx(&f->sp, rt.sched_sp);
#else
    swapcontext(&f->uc, &rt.sched_uc);
#endif
#if defined(EMU_ASAN)
    __sanitizer_finish_switch_fiber(f->fake_stack, nullptr, nullptr);
#endif
}

[[noreturn]] inline void fiber_main(Fiber *f) {
#if defined(EMU_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &rt.sched_bottom, &rt.sched_size);
#endif
    rt.body(rt.args);
    if (f->n_async)
        report("thread (%u,%u,%u) exited with %d cp.async copies it never waited for",
               f->tid.x, f->tid.y, f->tid.z, f->n_async);
    f->state = EXITED;
    yield(f, true);
    __builtin_trap();  // an exited fiber is never resumed
}

// ------------------------------------------------------------------ diagnostics
inline const char *short_file(const char *path) {
    const char *s = std::strrchr(path, '/');
    return s ? s + 1 : path;
}

// Record the first error of the launch (printf-style); the launch stops at the next switch.
__attribute__((format(printf, 1, 2))) inline void report(const char *fmt, ...) {
    if (rt.failed) return;
    rt.failed = true;
    int n = std::snprintf(rt.err, sizeof rt.err, "%s block (%u,%u,%u): ", rt.kernel, rt.bid.x,
                          rt.bid.y, rt.bid.z);
    if (n < 0 || n >= static_cast<int>(sizeof rt.err)) n = 0;
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(rt.err + n, sizeof rt.err - n, fmt, ap);
    va_end(ap);
}

// A failure inside kernel code (e.g. __trap): report it and abandon this fiber.
[[noreturn]] inline void fail_here(const char *what, site_t site) {
    Fiber *f = rt.cur;
    report("thread (%u,%u,%u): %s at %s:%u", f->tid.x, f->tid.y, f->tid.z, what,
           short_file(site.file_name()), site.line());
    yield(f, true);
    __builtin_trap();
}

// ------------------------------------------------------------------ run queue and order
inline unsigned long long next_random() {  // splitmix64
    unsigned long long z = (rt.rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Append the fibers in `ids[0, n)` (ascending) to the run queue in the configured order.
inline void enqueue(int *ids, int n) {
    if (rt.order == REVERSE) {
        for (int i = 0, j = n - 1; i < j; ++i, --j) { int t = ids[i]; ids[i] = ids[j]; ids[j] = t; }
    } else if (rt.order == SHUFFLE) {
        for (int i = n - 1; i > 0; --i) {
            const int j = static_cast<int>(next_random() % static_cast<unsigned long long>(i + 1));
            int t = ids[i]; ids[i] = ids[j]; ids[j] = t;
        }
    }
    for (int i = 0; i < n; ++i) {
        rt.fibers[ids[i]].state = READY;
        rt.queue[rt.q_tail++ % (MAX_THREADS + 1)] = ids[i];
    }
}

// ------------------------------------------------------------------ warp operations
inline unsigned int lanes_in_warp(unsigned int warp) {
    const int left = rt.n_threads - static_cast<int>(warp) * 32;
    return left >= 32 ? 0xffffffffu : ((1u << left) - 1u);
}

// Source lane of a shuffle by the PTX rules for shfl.sync with c = ((32-width)<<8) | clamp.
inline unsigned int shfl_source(Op op, unsigned int lane, int b, int width) {
    const unsigned int seg = static_cast<unsigned int>(32 - width) & 31u;  // segment mask bits
    const unsigned int min_lane = lane & seg;
    const unsigned int clamp = (op == SHFL_UP) ? 0u : 31u;
    const unsigned int max_lane = min_lane | (clamp & ~seg);
    const unsigned int bb = static_cast<unsigned int>(b) & 31u;
    long j;
    bool ok;
    switch (op) {
    case SHFL_IDX: j = min_lane | (bb & ~seg); ok = j <= static_cast<long>(max_lane); break;
    case SHFL_UP: j = static_cast<long>(lane) - bb; ok = j >= static_cast<long>(max_lane); break;
    case SHFL_DOWN: j = static_cast<long>(lane) + bb; ok = j <= static_cast<long>(max_lane); break;
    default: j = lane ^ bb; ok = j <= static_cast<long>(max_lane); break;
    }
    return ok ? static_cast<unsigned int>(j) : lane;
}

inline bool same_value(const Fiber &a, const Fiber &b) {
    const unsigned long long m = a.size >= 8 ? ~0ull : ((1ull << (8 * a.size)) - 1ull);
    return (a.val & m) == (b.val & m);
}

inline bool complete_tensor_op(Fiber *f, Fiber *w, unsigned int mask);  // tensor_core.h

// Called when fiber f arrived at a warp operation: complete it if every lane named is there.
inline void try_complete_warp(Fiber *f) {
    const unsigned int mask = f->mask;
    Fiber *w = rt.fibers + f->warp * 32;
    if (!(mask & (1u << f->lane))) {
        report("thread (%u,%u,%u): %s at %s:%u with mask 0x%08x that does not include the "
               "calling lane %u", f->tid.x, f->tid.y, f->tid.z, op_name(f->op),
               short_file(f->site.file_name()), f->site.line(), mask, f->lane);
        return;
    }
    const unsigned int exist = lanes_in_warp(f->warp);
    if (mask & ~exist) {
        report("warp %u: %s at %s:%u names lanes 0x%08x that do not exist (block of %d threads)",
               f->warp, op_name(f->op), short_file(f->site.file_name()), f->site.line(),
               mask & ~exist, rt.n_threads);
        return;
    }
    for (unsigned int m = mask; m; m &= m - 1) {
        if (w[__builtin_ctz(m)].state != WAIT_WARP) return;  // not all there yet
    }
    for (unsigned int m = mask; m; m &= m - 1) {
        const Fiber &g = w[__builtin_ctz(m)];
        if (g.op != f->op || g.mask != f->mask || g.width != f->width || g.size != f->size) {
            report("warp %u: divergent warp intrinsics: lane %u at %s (%s:%u, mask 0x%08x), "
                   "lane %u at %s (%s:%u, mask 0x%08x)", f->warp, f->lane, op_name(f->op),
                   short_file(f->site.file_name()), f->site.line(), f->mask, g.lane,
                   op_name(g.op), short_file(g.site.file_name()), g.site.line(), g.mask);
            return;
        }
    }
    const Op op = f->op;
    if (op == MMA_BF16 || op == LDMATRIX) {
        if (complete_tensor_op(f, w, mask)) {
            int ids[32], n = 0;
            for (unsigned int m = mask; m; m &= m - 1) ids[n++] = static_cast<int>(w[__builtin_ctz(m)].lin);
            enqueue(ids, n);
        }
        return;
    }
    if (op <= SHFL_XOR && (f->width < 1 || f->width > 32 || (f->width & (f->width - 1)))) {
        report("warp %u: %s at %s:%u with width %d (must be a power of two in [1, 32])",
               f->warp, op_name(op), short_file(f->site.file_name()), f->site.line(), f->width);
        return;
    }
    unsigned long long agg = 0;
    unsigned int bits = 0;
    bool all = true, any = false, all_equal = true;
    if (op == REDUCE_MIN || op == REDUCE_UMIN || op == REDUCE_AND) agg = ~0ull;
    if (op == REDUCE_MAX) agg = 0x80000000ull;
    if (op == REDUCE_MIN) agg = 0x7fffffffull;
    for (unsigned int m = mask; m; m &= m - 1) {
        const Fiber &g = w[__builtin_ctz(m)];
        const unsigned int v32 = static_cast<unsigned int>(g.val);
        if (g.val) bits |= 1u << g.lane;
        all = all && g.val != 0;
        any = any || g.val != 0;
        all_equal = all_equal && same_value(g, *f);
        switch (op) {
        case REDUCE_ADD: agg = static_cast<unsigned int>(agg + v32); break;
        case REDUCE_MIN:
            if (static_cast<int>(v32) < static_cast<int>(agg)) agg = v32;
            break;
        case REDUCE_MAX:
            if (static_cast<int>(v32) > static_cast<int>(agg)) agg = v32;
            break;
        case REDUCE_UMIN: if (v32 < agg) agg = v32; break;
        case REDUCE_UMAX: if (v32 > agg) agg = v32; break;
        case REDUCE_AND: agg &= v32; break;
        case REDUCE_OR: agg |= v32; break;
        case REDUCE_XOR: agg ^= v32; break;
        default: break;
        }
    }
    int ids[32], n = 0;
    for (unsigned int m = mask; m; m &= m - 1) {
        Fiber &g = w[__builtin_ctz(m)];
        switch (op) {
        case SHFL_IDX: case SHFL_UP: case SHFL_DOWN: case SHFL_XOR: {
            const unsigned int src = shfl_source(op, g.lane, g.param, g.width);
            if (!(mask & (1u << src))) {
                report("warp %u: %s at %s:%u: lane %u reads lane %u, which is not in the mask "
                       "0x%08x (undefined on the GPU)", f->warp, op_name(op),
                       short_file(g.site.file_name()), g.site.line(), g.lane, src, mask);
                return;
            }
            g.result = w[src].val;
            break;
        }
        case BALLOT: g.result = bits; break;
        case ALL: g.result = all; break;
        case ANY: g.result = any; break;
        case MATCH_ANY: {
            unsigned int eq = 0;
            for (unsigned int k = mask; k; k &= k - 1)
                if (same_value(w[__builtin_ctz(k)], g)) eq |= 1u << __builtin_ctz(k);
            g.result = eq;
            break;
        }
        case MATCH_ALL: g.result = all_equal ? mask : 0u; break;
        case SYNCWARP: g.result = 0; break;
        default: g.result = agg; break;
        }
        ids[n++] = static_cast<int>(g.lin);
    }
    enqueue(ids, n);
}

// The value-carrying part of every warp intrinsic: deposit, wait, take the result.
template <class T>
inline T warp_op(Op op, unsigned int mask, T v, int param, int width, site_t site) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>,
                  "warp intrinsics move at most 8 bytes of trivially copyable data");
    Fiber *f = rt.cur;
    f->op = op;
    f->mask = mask;
    f->param = param;
    f->width = width;
    f->size = sizeof(T);
    f->val = 0;
    std::memcpy(&f->val, &v, sizeof(T));
    f->site = site;
    f->state = WAIT_WARP;
    yield(f);
    T r;
    std::memcpy(&r, &f->result, sizeof(T));
    return r;
}

// ------------------------------------------------------------------ block barriers
inline int block_barrier(Op op, int pred, site_t site) {
    Fiber *f = rt.cur;
    f->op = op;
    f->val = pred != 0;
    f->site = site;
    f->state = WAIT_BLOCK;
    yield(f);
    return static_cast<int>(f->result);
}

inline bool same_site(const site_t &a, const site_t &b) {
    return a.line() == b.line() && std::strcmp(a.file_name(), b.file_name()) == 0;
}

// Everything is blocked: release the block barrier or report why the block cannot go on.
inline void release_or_report() {
    const Fiber *first = nullptr;
    int live = 0, at_barrier = 0;
    for (int i = 0; i < rt.n_threads; ++i) {
        const Fiber &g = rt.fibers[i];
        if (g.state == EXITED) continue;
        ++live;
        if (g.state == WAIT_BLOCK) {
            ++at_barrier;
            if (!first) first = &g;
        }
    }
    if (live && at_barrier == live) {
        int count = 0;
        for (int i = 0; i < rt.n_threads; ++i) {
            const Fiber &g = rt.fibers[i];
            if (g.state != WAIT_BLOCK) continue;
            if (!same_site(g.site, first->site) || g.op != first->op) {
                report("threads wait at different barriers: thread %u at %s (%s:%u), thread %u "
                       "at %s (%s:%u)", first->lin, op_name(first->op),
                       short_file(first->site.file_name()), first->site.line(), g.lin,
                       op_name(g.op), short_file(g.site.file_name()), g.site.line());
                return;
            }
            count += g.val != 0;
        }
        int ids[MAX_THREADS], n = 0;
        for (int i = 0; i < rt.n_threads; ++i) {
            Fiber &g = rt.fibers[i];
            if (g.state != WAIT_BLOCK) continue;
            g.result = first->op == SYNC_COUNT ? count
                     : first->op == SYNC_AND   ? (count == at_barrier)
                     : first->op == SYNC_OR    ? (count > 0) : 0;
            ids[n++] = i;
        }
        enqueue(ids, n);
        return;
    }
    // a deadlock: name a warp operation that can never complete, or the mix of waits
    for (int i = 0; i < rt.n_threads; ++i) {
        const Fiber &g = rt.fibers[i];
        if (g.state != WAIT_WARP) continue;
        const Fiber *w = rt.fibers + g.warp * 32;
        for (unsigned int m = g.mask; m; m &= m - 1) {
            const Fiber &h = w[__builtin_ctz(m)];
            if (h.state == EXITED) {
                report("deadlock: thread %u waits at %s (%s:%u) with mask 0x%08x, which names "
                       "lane %u that has exited", g.lin, op_name(g.op),
                       short_file(g.site.file_name()), g.site.line(), g.mask, h.lane);
                return;
            }
            if (h.state == WAIT_BLOCK) {
                report("deadlock: thread %u waits at %s (%s:%u) for lane %u, which waits at %s "
                       "(%s:%u)", g.lin, op_name(g.op), short_file(g.site.file_name()),
                       g.site.line(), h.lane, op_name(h.op), short_file(h.site.file_name()),
                       h.site.line());
                return;
            }
        }
        report("deadlock: thread %u waits at %s (%s:%u) with mask 0x%08x", g.lin,
               op_name(g.op), short_file(g.site.file_name()), g.site.line(), g.mask);
        return;
    }
    report("deadlock: no thread can make progress");
}

// ------------------------------------------------------------------ static shared memory
// Every __shared__ variable lives in the `emu_shared` section (see shim.h); the linker names
// its bounds. Refilled with 0xFF before each block, so unwritten reads are NaN.
extern "C" char __start_emu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_emu_shared[] __attribute__((weak, visibility("hidden")));

inline void fill_static_shared() {
    if (__start_emu_shared && __stop_emu_shared > __start_emu_shared)
        std::memset(__start_emu_shared, 0xFF,
                    static_cast<size_t>(__stop_emu_shared - __start_emu_shared));
}

// ------------------------------------------------------------------ faults
// A fault inside kernel code (an out-of-bounds access, a fiber stack overflow) ends the
// process, as it ends the CUDA context on a GPU; first say which kernel, block and thread.
inline struct sigaction old_segv, old_bus;
inline stack_t old_altstack;
alignas(16) inline char alt_stack[64 * 1024];

inline void on_fault(int sig) {
    char msg[600];
    const Fiber *f = rt.cur;
    const int n = f ? std::snprintf(msg, sizeof msg, "metrale emu: signal %d in kernel %s "
                                    "block (%u,%u,%u) thread (%u,%u,%u)\n", sig, rt.kernel,
                                    rt.bid.x, rt.bid.y, rt.bid.z, f->tid.x, f->tid.y, f->tid.z)
                    : std::snprintf(msg, sizeof msg, "metrale emu: signal %d in kernel %s\n",
                                    sig, rt.kernel);
    if (n > 0) (void)!write(2, msg, static_cast<size_t>(n));
    // the faulting instruction runs again and reaches the previous handler
    sigaction(sig, sig == SIGSEGV ? &old_segv : &old_bus, nullptr);
}

inline void install_fault_handler() {
    stack_t ss{};
    ss.ss_sp = alt_stack;
    ss.ss_size = sizeof alt_stack;
    sigaltstack(&ss, &old_altstack);
    struct sigaction sa{};
    sa.sa_handler = on_fault;
    sa.sa_flags = SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv);
    sigaction(SIGBUS, &sa, &old_bus);
}

inline void remove_fault_handler() {
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    sigaltstack(&old_altstack, nullptr);
}

// ------------------------------------------------------------------ launch
inline bool ensure_stacks(int n) {
    if (!rt.fibers) {
        rt.fibers = static_cast<Fiber *>(std::calloc(MAX_THREADS, sizeof(Fiber)));
        if (!rt.fibers) return false;
    }
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (; rt.n_stacks < n; ++rt.n_stacks) {
        void *m = mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return false;
        mprotect(m, page, PROT_NONE);  // guard page: a stack overflow faults
        Fiber &f = rt.fibers[rt.n_stacks];
        f.stack = static_cast<char *>(m) + page;
        f.stack_size = STACK_BYTES;
    }
    return true;
}

inline int run_block() {
    for (int i = 0; i < rt.n_threads; ++i) {
        Fiber &f = rt.fibers[i];
        f.lin = static_cast<unsigned int>(i);
        f.tid.x = static_cast<unsigned int>(i) % rt.block_dim.x;
        f.tid.y = (static_cast<unsigned int>(i) / rt.block_dim.x) % rt.block_dim.y;
        f.tid.z = static_cast<unsigned int>(i) / (rt.block_dim.x * rt.block_dim.y);
        f.lane = static_cast<unsigned int>(i) & 31u;
        f.warp = static_cast<unsigned int>(i) >> 5;
        f.n_async = f.async_groups = 0;
        prepare_fiber(&f);
    }
    fill_static_shared();
    rt.q_head = rt.q_tail = 0;
    {
        static int ids[MAX_THREADS];
        for (int i = 0; i < rt.n_threads; ++i) ids[i] = i;
        enqueue(ids, rt.n_threads);
    }
    int exited = 0;
    for (;;) {
        while (rt.q_head != rt.q_tail) {
            Fiber *f = rt.fibers + rt.queue[rt.q_head++ % (MAX_THREADS + 1)];
            resume(f);
            if (rt.failed) return 1;
            if (f->state == EXITED) ++exited;
            else if (f->state == WAIT_WARP) try_complete_warp(f);
            if (rt.failed) return 1;
        }
        if (exited == rt.n_threads) return 0;
        release_or_report();
        if (rt.failed) return 1;
    }
}

// Runs `body(args)` as every thread of every block. Returns 0, or 1 with `err` filled.
inline int launch(const char *kernel, const LaunchConfig *cfg, void (*body)(void **),
                  void **args, char *err, int errlen) {
    pthread_mutex_lock(&launch_mutex);
    rt.kernel = kernel;
    rt.failed = false;
    rt.err[0] = 0;
    rt.bid = uint3{0, 0, 0};
    rt.grid_dim = dim3(cfg->grid[0], cfg->grid[1], cfg->grid[2]);
    rt.block_dim = dim3(cfg->block[0], cfg->block[1], cfg->block[2]);
    rt.n_threads = static_cast<int>(cfg->block[0] * cfg->block[1] * cfg->block[2]);
    rt.body = body;
    rt.args = args;
    rt.order = cfg->order;
    rt.rng = cfg->seed;
    int rc = 0;
    if (rt.n_threads < 1 || rt.n_threads > MAX_THREADS) {
        report("block of %d threads (1 to %d)", rt.n_threads, MAX_THREADS);
        rc = 1;
    } else if (!ensure_stacks(rt.n_threads)) {
        report("out of memory for %d fiber stacks", rt.n_threads);
        rc = 1;
    }
    // Exactly the requested dynamic shared memory: AddressSanitizer reports a read past it.
    const size_t dyn = static_cast<size_t>(cfg->shared_mem);
    if (!rc) {
        rt.dyn_smem = static_cast<unsigned char *>(std::malloc(dyn ? dyn : 1));
        rt.dyn_bytes = dyn;
        if (!rt.dyn_smem) { report("out of memory for shared memory"); rc = 1; }
    }
#if !defined(EMU_ASAN)
    install_fault_handler();  // AddressSanitizer reports faults itself
#endif
    for (unsigned int z = 0; !rc && z < cfg->grid[2]; ++z)
        for (unsigned int y = 0; !rc && y < cfg->grid[1]; ++y)
            for (unsigned int x = 0; !rc && x < cfg->grid[0]; ++x) {
                rt.bid = uint3{x, y, z};
                std::memset(rt.dyn_smem, 0xFF, dyn);
                rc = run_block();
            }
#if !defined(EMU_ASAN)
    remove_fault_handler();
#endif
    std::free(rt.dyn_smem);
    rt.dyn_smem = nullptr;
    if (rc) std::snprintf(err, static_cast<size_t>(errlen), "%s", rt.err);
    pthread_mutex_unlock(&launch_mutex);
    return rc;
}

inline void *dynamic_smem() { return rt.dyn_smem; }

// Whether [p, p + n) lies in this block's shared memory (static or dynamic).
inline bool is_shared(const void *p, size_t n) {
    const char *c = static_cast<const char *>(p);
    if (__start_emu_shared && c >= __start_emu_shared && c + n <= __stop_emu_shared) return true;
    const char *d = reinterpret_cast<const char *>(rt.dyn_smem);
    return d && c >= d && c + n <= d + rt.dyn_bytes;
}

}  // namespace emu
