// Warp operations and block barriers of the EmuBackend's execution model (fiber.h): how a
// lane's deposit at a warp intrinsic becomes every lane's result (the PTX lane rules), when a
// block barrier releases, and the diagnostics for what can never complete.
#pragma once
#include "check.h"
#include "fiber.h"

namespace emu {

// ------------------------------------------------------------------ warp operations
EMU_NOINST inline unsigned int lanes_in_warp(unsigned int warp) {
    const int left = rt.n_threads - static_cast<int>(warp) * 32;
    return left >= 32 ? 0xffffffffu : ((1u << left) - 1u);
}

// Source lane of a shuffle by the PTX rules for shfl.sync with c = ((32-width)<<8) | clamp.
EMU_NOINST inline unsigned int shfl_source(Op op, unsigned int lane, int b, int width) {
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

EMU_NOINST inline bool same_value(const Fiber &a, const Fiber &b) {
    const unsigned long long m = a.size >= 8 ? ~0ull : ((1ull << (8 * a.size)) - 1ull);
    return (a.val & m) == (b.val & m);
}

EMU_NOINST inline bool complete_tensor_op(Fiber *f, Fiber *w, unsigned int mask);  // tensor_core.h

// Called when fiber f arrived at a warp operation: complete it if every lane named is there.
EMU_NOINST inline void try_complete_warp(Fiber *f) {
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
    if (op == SYNCWARP) check_syncwarp(f->warp, mask);  // orders the lanes' memory accesses
    else if (chk.flags & CHECK_COUNT) count_event(EV_WARP_OP);
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

EMU_NOINST inline bool same_site(const site_t &a, const site_t &b) {
    return a.line() == b.line() && std::strcmp(a.file_name(), b.file_name()) == 0;
}

// Everything is blocked: release the block barrier or report why the block cannot go on.
EMU_NOINST inline void release_or_report() {
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
        check_barrier();  // a new epoch: every access before is ordered before every one after
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

}  // namespace emu
