// Hardware counters from the instrumented build (CHECK_COUNT, see check.h): what a warp's
// memory instructions would ask of the memory system of an sm_80/sm_90 GPU.
//
// A warp-level request is the accesses of one warp's lanes at the same program point: the
// n-th execution of an instruction (pc) by each lane, n counted per lane since the last
// block barrier (where every thread is at the same point). That is how the lanes of a
// converged warp execute it together; lanes that diverged form partial requests.
//   global (an allocation a pointer argument points into): a request's 32-byte sectors, its
//     unique bytes and the fewest sectors those could take, ceil(unique / 32) (sector
//     efficiency = that / sectors: 100% for coalesced and for broadcast requests); per
//     allocation the unique bytes and sectors touched by the whole launch (bitmaps per 64
//     KiB page);
//   shared: 32 banks of 4 bytes. A request is served in phases (accesses of <= 4 bytes: the
//     whole warp; 8 bytes: half-warps; 16 bytes: quarter-warps); a phase takes as many
//     wavefronts as the most distinct 4-byte words any one bank holds (the same word is a
//     broadcast). Bank conflicts = wavefronts - ideal, ideal = what the phase's unique bytes
//     need at 128 bytes per wavefront. ldmatrix: one phase per 8x8 matrix (8 rows of 16 B).
//   cp.async: a global load request (its source) and a shared store request (destination);
//   mma.sync, ldmatrix, block barriers, __syncwarp, other warp collectives, atomics: counts.
#pragma once
#include <algorithm>
#include <unordered_map>

#include "check.h"
#include "sync.h"

namespace emu {

struct Counters {  // per launch, summed over the blocks run (library.py mirrors it)
    unsigned long long blocks;
    unsigned long long gld_requests, gld_sectors, gld_bytes, gld_unique;
    unsigned long long gst_requests, gst_sectors, gst_bytes, gst_unique;
    unsigned long long sld_requests, sld_wavefronts, sld_ideal;
    unsigned long long sst_requests, sst_wavefronts, sst_ideal;
    unsigned long long ldsm_requests, ldsm_wavefronts, ldsm_ideal;
    unsigned long long cp_async, mma, barriers, syncwarps, warp_ops, atomics;
    unsigned long long gld_ideal, gst_ideal;  // fewest sectors the requests' bytes need
};

enum ReqKind : unsigned int { GLD = 0, GST = 1, SLD = 2, SST = 3, LDSM = 4 };

struct PcStat {  // per instruction: requests, sectors (global) or wavefronts (shared), and
    unsigned int pc, kind;  // the fewest sectors / wavefronts the same bytes need
    unsigned long long requests, units, ideal, bytes;
};

struct RangeStat { unsigned long long ld_bytes, st_bytes, ld_sectors, st_sectors; };

struct Group {
    unsigned int kind, n, lanes;  // lanes: the lanes that took part
    unsigned long long addr[32];
    unsigned int size[32];
    unsigned char lane[32];
};

struct GroupKey {
    unsigned int pc, warp, inst, kind;
    bool operator==(const GroupKey &o) const {
        return pc == o.pc && warp == o.warp && inst == o.inst && kind == o.kind;
    }
};
struct GroupKeyHash {
    size_t operator()(const GroupKey &k) const {
        unsigned long long h = (static_cast<unsigned long long>(k.pc) << 32) ^ k.inst;
        h ^= (static_cast<unsigned long long>(k.warp) << 20) ^ (static_cast<unsigned long long>(k.kind) << 60);
        h *= 0x9E3779B97F4A7C15ull;
        return static_cast<size_t>(h ^ (h >> 29));
    }
};

struct PageBits { unsigned int ld[2048], st[2048]; };  // 64 KiB of bytes, 1 bit each

struct Count {
    Counters *out = nullptr;
    PcStat *pcs = nullptr;
    int pc_cap = 0, *n_pc = nullptr;
    RangeStat *ranges = nullptr;
    std::unordered_map<GroupKey, Group, GroupKeyHash> groups;
    std::unordered_map<unsigned long long, unsigned int> inst;  // (lin, pc) -> executions
    std::unordered_map<unsigned long long, int> pc_index;       // (kind, pc) -> pcs[i]
    std::vector<std::unordered_map<unsigned long long, PageBits *>> pages;  // per range
};
inline Count cnt;

EMU_NOINST inline PcStat *pc_stat(unsigned int kind, unsigned int pc) {
    const unsigned long long key = (static_cast<unsigned long long>(kind) << 32) | pc;
    auto it = cnt.pc_index.find(key);
    if (it != cnt.pc_index.end()) return it->second >= 0 ? cnt.pcs + it->second : nullptr;
    int i = -1;
    if (cnt.pcs && *cnt.n_pc < cnt.pc_cap) {
        i = (*cnt.n_pc)++;
        cnt.pcs[i] = PcStat{pc, kind, 0, 0, 0, 0};
    }
    cnt.pc_index.emplace(key, i);
    return i >= 0 ? cnt.pcs + i : nullptr;
}

// ------------------------------------------------------------------ one request, finished
EMU_NOINST inline void finish_global(const Group &g, unsigned int pc) {
    std::pair<unsigned long long, unsigned long long> iv[32];
    unsigned long long bytes = 0;
    for (unsigned int i = 0; i < g.n; ++i) {
        iv[i] = {g.addr[i], g.addr[i] + g.size[i]};
        bytes += g.size[i];
    }
    std::sort(iv, iv + g.n);
    unsigned long long unique = 0, sectors = 0, last_sector = ~0ull, hi = 0;
    for (unsigned int i = 0; i < g.n; ++i) {
        unsigned long long lo = std::max(iv[i].first, hi);
        if (lo >= iv[i].second) continue;
        unique += iv[i].second - lo;
        const unsigned long long s0 = lo >> 5, s1 = (iv[i].second - 1) >> 5;
        sectors += s1 - s0 + 1 - (s0 == last_sector ? 1 : 0);
        last_sector = s1;
        hi = iv[i].second;
    }
    const unsigned long long ideal = (unique + 31) / 32;
    Counters &c = *cnt.out;
    if (g.kind == GLD) {
        ++c.gld_requests; c.gld_sectors += sectors; c.gld_bytes += bytes; c.gld_unique += unique;
        c.gld_ideal += ideal;
    } else {
        ++c.gst_requests; c.gst_sectors += sectors; c.gst_bytes += bytes; c.gst_unique += unique;
        c.gst_ideal += ideal;
    }
    if (PcStat *p = pc_stat(g.kind, pc)) {
        ++p->requests; p->units += sectors; p->ideal += ideal; p->bytes += bytes;
    }
}

// Wavefronts of one phase of a shared request: lanes [l0, l1) of the group's entries.
EMU_NOINST inline void shared_phase(const Group &g, unsigned int l0, unsigned int l1,
                         unsigned long long &wavefronts, unsigned long long &ideal) {
    unsigned long long words[128];
    int n = 0;
    for (unsigned int i = 0; i < g.n; ++i) {
        if (g.lane[i] < l0 || g.lane[i] >= l1) continue;
        for (unsigned long long w = g.addr[i] >> 2; w <= (g.addr[i] + g.size[i] - 1) >> 2 && n < 128; ++w)
            words[n++] = w;
    }
    if (!n) return;
    std::sort(words, words + n);
    n = static_cast<int>(std::unique(words, words + n) - words);
    int per_bank[32] = {0};
    int worst = 0;
    for (int i = 0; i < n; ++i) worst = std::max(worst, ++per_bank[words[i] & 31u]);
    wavefronts += static_cast<unsigned long long>(worst);
    ideal += static_cast<unsigned long long>((n + 31) / 32);
}

EMU_NOINST inline void finish_shared(const Group &g, unsigned int pc) {
    unsigned int size = 0;
    for (unsigned int i = 0; i < g.n; ++i) size = std::max(size, g.size[i]);
    const unsigned int lanes_per_phase = size <= 4 ? 32 : size == 8 ? 16 : 8;
    unsigned long long wf = 0, ideal = 0, bytes = 0;
    for (unsigned int l0 = 0; l0 < 32; l0 += lanes_per_phase) shared_phase(g, l0, l0 + lanes_per_phase, wf, ideal);
    for (unsigned int i = 0; i < g.n; ++i) bytes += g.size[i];
    Counters &c = *cnt.out;
    if (g.kind == SLD) { ++c.sld_requests; c.sld_wavefronts += wf; c.sld_ideal += ideal; }
    else { ++c.sst_requests; c.sst_wavefronts += wf; c.sst_ideal += ideal; }
    if (PcStat *p = pc_stat(g.kind, pc)) {
        ++p->requests; p->units += wf; p->ideal += ideal; p->bytes += bytes;
    }
}

EMU_NOINST inline void finish(const GroupKey &k, const Group &g) {
    if (g.kind == GLD || g.kind == GST) finish_global(g, k.pc);
    else finish_shared(g, k.pc);
}

inline void flush_groups() {
    for (auto &kv : cnt.groups) finish(kv.first, kv.second);
    cnt.groups.clear();
    cnt.inst.clear();
}

inline void counters_barrier() {
    ++cnt.out->barriers;
    flush_groups();
}

inline void counters_block_boundary() { flush_groups(); }

inline void count_event(Event e) {
    Counters &c = *cnt.out;
    switch (e) {
    case EV_MMA: ++c.mma; break;
    case EV_SYNCWARP: ++c.syncwarps; break;
    case EV_WARP_OP: ++c.warp_ops; break;
    case EV_ATOMIC: ++c.atomics; break;
    }
}

// ------------------------------------------------------------------ recording accesses
EMU_NOINST inline void mark_range(int range, uintptr_t a, size_t n, bool write) {
    const Range &r = chk.ranges[range];
    auto &pages = cnt.pages[static_cast<size_t>(range)];
    for (unsigned long long off = a - r.base, end = off + n; off < end;) {
        PageBits *&p = pages[off >> 16];
        if (!p) p = static_cast<PageBits *>(std::calloc(1, sizeof(PageBits)));
        unsigned int *bits = write ? p->st : p->ld;
        const unsigned long long stop = std::min(end, ((off >> 16) + 1) << 16);
        for (; off < stop; ++off) bits[(off & 0xffffu) >> 5] |= 1u << (off & 31u);
    }
}

// One lane's access (kind GLD/GST/SLD/SST) at pc; joins its warp's request.
EMU_NOINST inline void count_access(unsigned int kind, const Fiber *f, uintptr_t a, size_t n,
                         unsigned int pc) {
    const unsigned long long ik = (static_cast<unsigned long long>(f->lin) << 32) | pc;
    const unsigned int inst = cnt.inst[ik]++;
    const GroupKey key{pc, f->warp, inst, kind};
    Group &g = cnt.groups[key];
    if (g.n == 0) g.kind = kind;
    if (g.n < 32) {
        g.addr[g.n] = a;
        g.size[g.n] = static_cast<unsigned int>(n);
        g.lane[g.n] = static_cast<unsigned char>(f->lane);
        ++g.n;
    }
    g.lanes |= 1u << f->lane;
    // every lane of the warp has done it or has exited: the request is complete
    const Fiber *w = rt.fibers + f->warp * 32;
    unsigned int done = g.lanes;
    for (unsigned int m = lanes_in_warp(f->warp) & ~done; m; m &= m - 1)
        if (w[__builtin_ctz(m)].state == EXITED) done |= 1u << __builtin_ctz(m);
    if (done == lanes_in_warp(f->warp)) {
        finish(key, g);
        cnt.groups.erase(key);
    }
}

// ldmatrix .x<count>: rows[l] (lane l < 8 count) is row l % 8 of matrix l / 8 (16 bytes).
EMU_NOINST inline void count_ldmatrix(const void *const *rows, int count, unsigned int pc) {
    Counters &c = *cnt.out;
    unsigned long long wf = 0, ideal = 0;
    for (int i = 0; i < count; ++i) {
        Group g{};
        g.kind = LDSM;
        for (int r = 0; r < 8; ++r) {
            g.addr[g.n] = reinterpret_cast<uintptr_t>(rows[8 * i + r]);
            g.size[g.n] = 16;
            g.lane[g.n] = 0;
            ++g.n;
        }
        shared_phase(g, 0, 32, wf, ideal);
    }
    ++c.ldsm_requests; c.ldsm_wavefronts += wf; c.ldsm_ideal += ideal;
    if (PcStat *p = pc_stat(LDSM, pc)) {
        ++p->requests; p->units += wf; p->ideal += ideal; p->bytes += 128ull * count;
    }
}

// cp.async of one lane: its source read (a global load) and destination write (a shared
// store), each joining the warp's request for this instruction.
EMU_NOINST inline void count_cp_async(const Fiber *f, const void *dst, const void *src,
                           unsigned int bytes, unsigned int src_bytes, unsigned int pc) {
    ++cnt.out->cp_async;
    const uintptr_t s = reinterpret_cast<uintptr_t>(src);
    int range;
    if (src_bytes && (range = range_of(s, src_bytes)) >= 0) {
        count_access(GLD, f, s, src_bytes, pc);
        mark_range(range, s, src_bytes, false);
    }
    count_access(SST, f, reinterpret_cast<uintptr_t>(dst), bytes, pc);
}

inline void counters_launch_begin(const LaunchConfig *cfg) {
    cnt.out = cfg->counters;
    cnt.pcs = cfg->pc_stats;
    cnt.pc_cap = cfg->pc_cap;
    cnt.n_pc = cfg->n_pc;
    cnt.ranges = cfg->range_stats;
    cnt.groups.clear();
    cnt.inst.clear();
    cnt.pc_index.clear();
    cnt.pages.assign(static_cast<size_t>(chk.n_ranges), {});
}

inline void counters_launch_end() {
    flush_groups();
    for (size_t r = 0; r < cnt.pages.size(); ++r) {
        RangeStat s{0, 0, 0, 0};
        for (auto &kv : cnt.pages[r]) {
            for (int i = 0; i < 2048; ++i) {
                s.ld_bytes += static_cast<unsigned long long>(__builtin_popcount(kv.second->ld[i]));
                s.st_bytes += static_cast<unsigned long long>(__builtin_popcount(kv.second->st[i]));
                s.ld_sectors += kv.second->ld[i] != 0;
                s.st_sectors += kv.second->st[i] != 0;
            }
            std::free(kv.second);
        }
        if (cnt.ranges) cnt.ranges[r] = s;
    }
    cnt.pages.clear();
    cnt.out = nullptr;
}

}  // namespace emu
