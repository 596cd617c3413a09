// The CUDA execution model on the CPU: one cooperative fiber per CUDA thread. This file has
// the fibers, their context switch, the run queue and the diagnostics; sync.h the warp
// operations and block barriers; launch.h the launch loop.
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

// The runtime's own code is not instrumented in the instrumented build (check.h): it would
// only call the hooks for memory that is not the kernel's; what it calls that is (the C++
// library) is kept out by hooks.h's `busy`.
#define EMU_NOINST __attribute__((no_sanitize_thread))

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
    unsigned int pc;          // ... and the code offset of the call (check.h)
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
    struct AsyncCopy {
        void *dst; const void *src; unsigned int bytes, src_bytes; int group, landed;
    } async[128];
};

enum Order { FORWARD = 0, REVERSE = 1, SHUFFLE = 2 };

struct Range;      // check.h: the memory and counters of the instrumented build
struct Counters;
struct PcStat;
struct RangeStat;

// What Python passes to a launch (metrale/gpu_runtime/emu/library.py mirrors it).
struct LaunchConfig {
    unsigned int grid[3];
    unsigned int block[3];
    unsigned long long shared_mem;
    int order;                    // thread order within a block (Order)
    unsigned long long seed;
    int block_order;              // order of the blocks of the grid (Order)
    unsigned long long block_seed;
    unsigned int checks;          // CHECK_* of check.h (the instrumented build only)
    unsigned int sample_blocks;   // run only this many blocks, evenly spaced (0: all)
    const Range *ranges;          // the allocations the launch's pointers point into
    int n_ranges;
    Counters *counters;           // CHECK_COUNT: totals of the launch
    PcStat *pc_stats;             // CHECK_COUNT: per memory instruction (pc)
    int pc_cap;
    int *n_pc;
    RangeStat *range_stats;       // CHECK_COUNT: bytes touched per range
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

EMU_NOINST inline void prepare_fiber(Fiber *f) {
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
EMU_NOINST inline void resume(Fiber *f) {
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
EMU_NOINST inline unsigned long long next_random() {  // splitmix64
    unsigned long long z = (rt.rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Put the fibers in `ids[0, n)` (ascending) on the run queue in the configured order.
// FORWARD appends them (breadth first: the warps of a block advance roughly in step).
// REVERSE puts them first (depth first: the warp that just synchronised runs on until it
// blocks at a barrier, far ahead of the others), so a missing barrier between one warp's
// reads and another's writes of shared memory shows up; SHUFFLE picks either at random.
EMU_NOINST inline void enqueue(int *ids, int n) {
    if (rt.order == REVERSE) {
        for (int i = 0, j = n - 1; i < j; ++i, --j) { int t = ids[i]; ids[i] = ids[j]; ids[j] = t; }
    } else if (rt.order == SHUFFLE) {
        for (int i = n - 1; i > 0; --i) {
            const int j = static_cast<int>(next_random() % static_cast<unsigned long long>(i + 1));
            int t = ids[i]; ids[i] = ids[j]; ids[j] = t;
        }
    }
    constexpr int Q = MAX_THREADS + 1;
    const bool front = rt.order == REVERSE || (rt.order == SHUFFLE && (next_random() & 1));
    for (int i = 0; i < n; ++i) rt.fibers[ids[i]].state = READY;
    if (front) {
        for (int i = n - 1; i >= 0; --i) {
            rt.q_head = (rt.q_head + Q - 1) % Q;
            rt.queue[rt.q_head] = ids[i];
        }
    } else {
        for (int i = 0; i < n; ++i) {
            rt.queue[rt.q_tail] = ids[i];
            rt.q_tail = (rt.q_tail + 1) % Q;
        }
    }
}

}  // namespace emu
