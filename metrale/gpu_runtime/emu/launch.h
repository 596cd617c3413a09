// One launch of the EmuBackend: the blocks one after another, each block's fibers to
// completion (fiber.h, sync.h), shared memory refilled per block, faults attributed to the
// kernel, block and thread that caused them.
#pragma once
#include <algorithm>
#include <vector>

#include "counters.h"
#include "sync.h"

namespace emu {

// ------------------------------------------------------------------ static shared memory
// Every __shared__ variable lives in the `emu_shared` section (see shim.h); the linker names
// its bounds (__start_emu_shared, declared in check.h). Refilled with 0xFF before each block,
// so unwritten reads are NaN.
EMU_NOINST inline void fill_static_shared() {
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

EMU_NOINST inline int run_block() {
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
            Fiber *f = rt.fibers + rt.queue[rt.q_head];
            rt.q_head = (rt.q_head + 1) % (MAX_THREADS + 1);
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

// The linear block ids a launch runs, in the order it runs them: all of them, or
// `sample` evenly spaced ones (the first and the last included), ascending, reversed or
// shuffled with `seed` (the blocks of a grid are unordered on the GPU).
inline std::vector<unsigned long long> block_sequence(unsigned long long n, unsigned int sample,
                                                      int order, unsigned long long seed) {
    std::vector<unsigned long long> ids;
    if (sample && sample < n) {
        ids.reserve(sample);
        for (unsigned int i = 0; i < sample; ++i)
            ids.push_back(sample == 1 ? 0 : i * (n - 1) / (sample - 1));
    } else {
        ids.resize(n);
        for (unsigned long long i = 0; i < n; ++i) ids[i] = i;
    }
    if (order == REVERSE) {
        std::reverse(ids.begin(), ids.end());
    } else if (order == SHUFFLE) {
        const unsigned long long saved = rt.rng;
        rt.rng = seed;
        for (size_t i = ids.size(); i > 1; --i)
            std::swap(ids[i - 1], ids[next_random() % i]);
        rt.rng = saved;
    }
    return ids;
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
    // The checks and counters exist in the instrumented build only (hooks.h).
    LaunchConfig c = *cfg;
#if defined(EMU_CHECK)
    if (!c.counters) c.checks &= ~CHECK_COUNT;
#else
    c.checks = 0;
#endif
    check_launch_begin(&c);
    if (c.checks & CHECK_COUNT) counters_launch_begin(&c);
#if !defined(EMU_ASAN)
    install_fault_handler();  // AddressSanitizer reports faults itself
#endif
    const unsigned long long gx = cfg->grid[0], gy = cfg->grid[1];
    if (!rc) {
        for (unsigned long long b : block_sequence(gx * gy * cfg->grid[2], cfg->sample_blocks,
                                                   cfg->block_order, cfg->block_seed)) {
            rt.bid = uint3{static_cast<unsigned int>(b % gx),
                           static_cast<unsigned int>((b / gx) % gy),
                           static_cast<unsigned int>(b / (gx * gy))};
            check_block_begin(static_cast<unsigned int>(b));
            std::memset(rt.dyn_smem, 0xFF, dyn);
            rc = run_block();
            check_block_end();
            if (c.checks & CHECK_COUNT) ++c.counters->blocks;
            if (rc) break;
        }
    }
#if !defined(EMU_ASAN)
    remove_fault_handler();
#endif
    if (c.checks & CHECK_COUNT) counters_launch_end();
    check_launch_end();
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
