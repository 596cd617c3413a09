// The EmuBackend's checks on every memory access of a kernel, in the instrumented build
// (build.py, flavour "check": g++ -fsanitize=thread instruments each load and store with a
// call into hooks.h, whose runtime is this file and counters.h, not libtsan):
//
//   CHECK_ALIGN  a 2/4/8/16-byte load or store whose address is not a multiple of its size
//                (on the GPU a misaligned access faults: "misaligned address"). x86 would run
//                it; the error names kernel, thread, file and line.
//   CHECK_RACE   a shared-memory race detector and a global-memory cross-block detector.
//                Shared memory: a shadow record per byte of the last writer and of up to two
//                readers since, each with the epoch and warp-sync sequence of its access. Two
//                accesses of one byte by different threads, at least one a write, race unless
//                something orders them:
//                  - a block barrier (__syncthreads and its _count/_and/_or forms) between
//                    them: every barrier release starts a new epoch;
//                  - for two lanes of one warp, a __syncwarp whose mask holds both, completed
//                    after the first access. On sm_70+ lanes of a warp are scheduled
//                    independently; PTX gives memory ordering to bar.warp.sync (__syncwarp)
//                    and not to shfl/vote/match/reduce.sync, which only wait for the lanes
//                    of their mask (compute-sanitizer racecheck agrees), so a shuffle between
//                    a shared store and another lane's load does not order them here;
//                  - cp.async: the copy is a write by the issuing thread that lands somewhere
//                    between the issue and the cp.async.wait_group that covers it, so it is
//                    recorded at both; a read of a destination byte before that wait (by any
//                    thread, the issuer included) is reported, and other threads need a
//                    barrier after the wait, as on the GPU;
//                  - atomics never race with atomics (they are not checked).
//                ldmatrix reads each 16-byte row as the lane that supplied its address.
//                Global memory: per byte of each writable allocation the block that last
//                wrote it and the block(s) that read it; a write and another access of the same
//                byte by two different blocks of one launch race (blocks are unordered).
//   CHECK_COUNT  hardware counters (counters.h).
//
// Diagnostics name code locations as "@pc:0x<offset>" (an offset into the library), which
// library.py turns into file:line (and the inline chain) with addr2line.
#pragma once
#include <dlfcn.h>

#include <vector>

#include "fiber.h"

// Bounds of the static shared memory (launch.h; every __shared__ variable is in this section).
extern "C" char __start_emu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_emu_shared[] __attribute__((weak, visibility("hidden")));


namespace emu {

enum CheckFlags : unsigned int { CHECK_ALIGN = 1u, CHECK_RACE = 2u, CHECK_COUNT = 4u };

// One allocation a launch's pointer arguments point into (library.py mirrors it).
struct Range {
    unsigned long long base, size;
    unsigned int writable, pad;
};

struct SharedShadow {   // per byte of shared memory
    unsigned int w_ep, r_ep;          // epoch of the last write / of the readers
    unsigned int w_seq, r_seq[2];     // warp-sync sequence at the access
    unsigned int w_pc, r_pc[2];       // code offsets
    unsigned short w_tid, r_tid[2];   // linear thread ids
    unsigned char n_readers, pending; // pending: a cp.async write that has not landed
};

struct GlobalShadow {   // per byte of a writable allocation, within one launch
    unsigned int w_blk, r_blk, r_blk2;  // linear block id + 1 (0: none); r_blk2: a second
    unsigned int w_pc, r_pc;            // reading block
    unsigned short w_tid, r_tid;
};

struct Check {
    unsigned int flags = 0;
    const Range *ranges = nullptr;
    int n_ranges = 0;
    uintptr_t lib_base = 0;
    // races
    unsigned int epoch = 0;           // +1 at every block start and barrier release
    unsigned int sync_seq = 0;        // +1 at every __syncwarp completion
    unsigned int pair_sync[MAX_THREADS / 32][32][32];  // last __syncwarp holding lanes i, j
    SharedShadow *smem = nullptr;        // shadow of shared memory
    size_t smem_cap = 0;
    size_t static_bytes = 0;
    size_t n_pending = 0;             // shadow bytes with pending set
    std::vector<GlobalShadow *> gmem; // per range (writable ones), calloc'ed per launch
    unsigned int block_lin = 0;
};
inline Check chk;

EMU_NOINST inline unsigned int code_offset(const void *pc) {
    return static_cast<unsigned int>(reinterpret_cast<uintptr_t>(pc) - chk.lib_base);
}

EMU_NOINST inline void thread_xyz(unsigned int lin, unsigned int &x, unsigned int &y, unsigned int &z) {
    x = lin % rt.block_dim.x;
    y = (lin / rt.block_dim.x) % rt.block_dim.y;
    z = lin / (rt.block_dim.x * rt.block_dim.y);
}

// Index of [p, p + n) in the shadow of shared memory (static section, then dynamic), or -1.
EMU_NOINST inline long shared_index(uintptr_t a, size_t n) {
    const uintptr_t s0 = reinterpret_cast<uintptr_t>(__start_emu_shared);
    const uintptr_t s1 = reinterpret_cast<uintptr_t>(__stop_emu_shared);
    if (s0 && a >= s0 && a + n <= s1) return static_cast<long>(a - s0);
    const uintptr_t d = reinterpret_cast<uintptr_t>(rt.dyn_smem);
    if (d && a >= d && a + n <= d + rt.dyn_bytes)
        return static_cast<long>(chk.static_bytes + (a - d));
    return -1;
}

// The range holding [a, a + n), or -1 (ranges are sorted by base).
EMU_NOINST inline int range_of(uintptr_t a, size_t n) {
    int lo = 0, hi = chk.n_ranges - 1;
    while (lo <= hi) {
        const int mid = (lo + hi) >> 1;
        const Range &r = chk.ranges[mid];
        if (a < r.base) hi = mid - 1;
        else if (a >= r.base + r.size) lo = mid + 1;
        else return a + n <= r.base + r.size ? mid : -1;
    }
    return -1;
}

EMU_NOINST inline void shared_where(char *buf, size_t len, long idx) {
    if (static_cast<size_t>(idx) < chk.static_bytes)  // @sym: library.py names the variable
        std::snprintf(buf, len, "static shared memory @sym:0x%x",
                      code_offset(__start_emu_shared + idx));
    else
        std::snprintf(buf, len, "dynamic shared memory + %ld",
                      idx - static_cast<long>(chk.static_bytes));
}

// ------------------------------------------------------------------ launch and sync points
inline void check_launch_begin(const LaunchConfig *cfg) {
    chk.flags = cfg->checks;
    chk.ranges = cfg->ranges;
    chk.n_ranges = cfg->ranges ? cfg->n_ranges : 0;
    if (!chk.lib_base) {
        Dl_info info;
        if (dladdr(reinterpret_cast<const void *>(&check_launch_begin), &info))
            chk.lib_base = reinterpret_cast<uintptr_t>(info.dli_fbase);
    }
    chk.static_bytes = __start_emu_shared && __stop_emu_shared > __start_emu_shared
                       ? static_cast<size_t>(__stop_emu_shared - __start_emu_shared) : 0;
    if (chk.flags & CHECK_RACE) {
        const size_t n = chk.static_bytes + static_cast<size_t>(cfg->shared_mem);
        if (chk.smem_cap < n) {
            std::free(chk.smem);
            chk.smem = static_cast<SharedShadow *>(std::calloc(n, sizeof(SharedShadow)));
            chk.smem_cap = chk.smem ? n : 0;
        }
        chk.gmem.assign(static_cast<size_t>(chk.n_ranges), nullptr);
        for (int i = 0; i < chk.n_ranges; ++i)
            if (chk.ranges[i].writable)
                chk.gmem[i] = static_cast<GlobalShadow *>(
                    std::calloc(chk.ranges[i].size, sizeof(GlobalShadow)));
    }
}

inline void check_launch_end() {
    for (GlobalShadow *g : chk.gmem) std::free(g);
    chk.gmem.clear();
    chk.flags = 0;
    chk.ranges = nullptr;
    chk.n_ranges = 0;
}

// counters.h
enum Event { EV_MMA, EV_SYNCWARP, EV_WARP_OP, EV_ATOMIC };
inline void count_event(Event e);
inline void counters_block_boundary();
inline void counters_barrier();

inline void check_block_begin(unsigned int block_lin) {
    chk.block_lin = block_lin;
    ++chk.epoch;
    if (chk.n_pending) {  // copies an abandoned launch never waited for
        for (size_t i = 0; i < chk.smem_cap; ++i) chk.smem[i].pending = 0;
        chk.n_pending = 0;
    }
}

inline void check_block_end() {
    if (chk.flags & CHECK_COUNT) counters_block_boundary();
}

inline void check_barrier() {
    ++chk.epoch;
    if (chk.flags & CHECK_COUNT) counters_barrier();
}

EMU_NOINST inline void check_syncwarp(unsigned int warp, unsigned int mask) {
    if (chk.flags & CHECK_COUNT) count_event(EV_SYNCWARP);
    if (!(chk.flags & CHECK_RACE)) return;
    const unsigned int s = ++chk.sync_seq;
    for (unsigned int a = mask; a; a &= a - 1)
        for (unsigned int b = mask; b; b &= b - 1)
            chk.pair_sync[warp][__builtin_ctz(a)][__builtin_ctz(b)] = s;
}

// ------------------------------------------------------------------ shared-memory races
// Whether an access by thread `a` (at warp-sync sequence `seq`) happens before the current
// access by thread `t`, given both are in the current epoch.
EMU_NOINST inline bool ordered(unsigned int a, unsigned int seq, unsigned int t) {
    if (a == t) return true;
    if ((a >> 5) != (t >> 5)) return false;
    return chk.pair_sync[t >> 5][a & 31u][t & 31u] > seq;
}

EMU_NOINST inline void report_race(const char *what, long idx, unsigned int t, unsigned int t_pc,
                        bool t_write, unsigned int o, unsigned int o_pc, bool o_write) {
    unsigned int tx, ty, tz, ox, oy, oz;
    thread_xyz(t, tx, ty, tz);
    thread_xyz(o, ox, oy, oz);
    char where[96];
    shared_where(where, sizeof where, idx);
    report("shared-memory race (%s) on %s: thread (%u,%u,%u) %s it at @pc:0x%x and thread "
           "(%u,%u,%u) %s it at @pc:0x%x with no __syncthreads or __syncwarp ordering them",
           what, where, ox, oy, oz, o_write ? "wrote" : "read", o_pc, tx, ty, tz,
           t_write ? "writes" : "reads", t_pc);
}

// An access of n bytes of shared memory at shadow index idx by thread t (linear id).
EMU_NOINST inline void race_shared(unsigned int t, long idx, size_t n, bool write, unsigned int pc) {
    const unsigned int seq = chk.sync_seq, ep = chk.epoch;
    for (size_t i = 0; i < n; ++i) {
        SharedShadow &s = chk.smem[static_cast<size_t>(idx) + i];
        if (s.pending) {
            unsigned int ix, iy, iz, tx, ty, tz;
            thread_xyz(s.w_tid, ix, iy, iz);
            thread_xyz(t, tx, ty, tz);
            report("shared memory used before its cp.async landed: thread (%u,%u,%u) issued "
                   "cp.async at @pc:0x%x, thread (%u,%u,%u) %s a byte of its destination at "
                   "@pc:0x%x before the cp.async.wait_group (and, for other threads, the "
                   "barrier) that completes it", ix, iy, iz, s.w_pc, tx, ty, tz,
                   write ? "writes" : "reads", pc);
            return;
        }
        if (s.w_ep == ep && !ordered(s.w_tid, s.w_seq, t)) {
            report_race(write ? "write after write" : "read after write",
                        idx + static_cast<long>(i), t, pc, write, s.w_tid, s.w_pc, true);
            return;
        }
        if (write) {
            if (s.r_ep == ep)
                for (int r = 0; r < s.n_readers; ++r)
                    if (!ordered(s.r_tid[r], s.r_seq[r], t)) {
                        report_race("write after read", idx + static_cast<long>(i), t, pc,
                                    true, s.r_tid[r], s.r_pc[r], false);
                        return;
                    }
            s.w_ep = ep;
            s.w_tid = static_cast<unsigned short>(t);
            s.w_seq = seq;
            s.w_pc = pc;
            s.r_ep = 0;
            s.n_readers = 0;
        } else {
            if (s.r_ep != ep) { s.r_ep = ep; s.n_readers = 0; }
            int r = 0;
            while (r < s.n_readers && s.r_tid[r] != t) ++r;
            if (r == 2) r = 1;  // a third reader: keep the first and the latest
            s.r_tid[r] = static_cast<unsigned short>(t);
            s.r_seq[r] = seq;
            s.r_pc[r] = pc;
            if (r == s.n_readers) ++s.n_readers;
        }
    }
}

// cp.async: the destination is written by the issuing thread at some moment up to the wait.
EMU_NOINST inline void race_async_issue(unsigned int t, const void *dst, unsigned int bytes,
                             unsigned int pc) {
    const long idx = shared_index(reinterpret_cast<uintptr_t>(dst), bytes);
    if (idx < 0) return;
    race_shared(t, idx, bytes, true, pc);
    for (unsigned int i = 0; i < bytes; ++i) chk.smem[static_cast<size_t>(idx) + i].pending = 1;
    chk.n_pending += bytes;
}

EMU_NOINST inline void race_async_land(const void *dst, unsigned int bytes) {
    const long idx = shared_index(reinterpret_cast<uintptr_t>(dst), bytes);
    if (idx < 0) return;
    for (unsigned int i = 0; i < bytes; ++i) {
        SharedShadow &s = chk.smem[static_cast<size_t>(idx) + i];
        if (s.pending) --chk.n_pending;
        s.pending = 0;
        s.w_ep = chk.epoch;  // lands now, as a write of the issuing thread
        s.w_seq = chk.sync_seq;
        s.r_ep = 0;
        s.n_readers = 0;
    }
}

// ------------------------------------------------------------------ global memory, cross-block
EMU_NOINST inline void race_global(unsigned int t, int range, uintptr_t a, size_t n, bool write,
                        unsigned int pc) {
    GlobalShadow *g = chk.gmem[static_cast<size_t>(range)];
    if (!g) return;  // read-only allocation: no block writes it
    const unsigned int b = chk.block_lin + 1;
    const Range &r = chk.ranges[range];
    for (size_t i = 0; i < n; ++i) {
        GlobalShadow &s = g[a + i - r.base];
        const char *what = nullptr;
        unsigned int other = 0, other_pc = 0, other_tid = 0;
        bool other_wrote = false;
        if (s.w_blk && s.w_blk != b) {
            what = write ? "write after write" : "read after write";
            other = s.w_blk; other_pc = s.w_pc; other_tid = s.w_tid;
            other_wrote = true;
        } else if (write && ((s.r_blk && s.r_blk != b) || s.r_blk2)) {
            what = "write after read";  // (of two reading blocks, one is not this one)
            other = s.r_blk != b ? s.r_blk : s.r_blk2;
            other_pc = s.r_pc; other_tid = s.r_tid;
        }
        if (what) {
            const unsigned int gx = rt.grid_dim.x, gy = rt.grid_dim.y;
            // (the code location and thread of a read are those of the latest reader)
            const unsigned int ob = other - 1;
            report("global-memory race (%s) between blocks: byte %zu of the allocation at "
                   "0x%llx: block (%u,%u,%u) thread %u %s it at @pc:0x%x, thread %u of this "
                   "block %s it at @pc:0x%x (the blocks of a launch are unordered)", what,
                   static_cast<size_t>(a + i - r.base), r.base, ob % gx, (ob / gx) % gy,
                   ob / (gx * gy), other_tid, other_wrote ? "wrote" : "read", other_pc, t,
                   write ? "writes" : "reads", pc);
            return;
        }
        if (write) {
            s.w_blk = b; s.w_pc = pc; s.w_tid = static_cast<unsigned short>(t);
        } else {
            if (!s.r_blk) s.r_blk = b;
            else if (s.r_blk != b && !s.r_blk2) s.r_blk2 = b;
            s.r_pc = pc; s.r_tid = static_cast<unsigned short>(t);
        }
    }
}

}  // namespace emu
