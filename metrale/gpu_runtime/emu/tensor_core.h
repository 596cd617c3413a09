// Tensor-core instructions for the EmuBackend, from the PTX ISA's fragment layouts:
//   mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32   (emu::mma_m16n8k16_bf16)
//   ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16 (emu::ldmatrix)
//   cp.async.{ca,cg}.shared.global + commit_group / wait_group (emu::cp_async*)
// Kernels reach them through kernels/mma.cuh, whose #else branches call these.
//
// mma (per warp, lane = 4 * group + tig): A 16x16 row-major in 4 .b32 registers per lane,
//   a[0] = A[group][2 tig, +1], a[1] = A[group + 8][2 tig, +1], a[2] = A[group][2 tig + 8, +1],
//   a[3] = A[group + 8][2 tig + 8, +1]; B 16x8 (K x N) in 2 registers, b[0] = B[2 tig, +1][group],
//   b[1] = B[2 tig + 8, +1][group]; C and D 16x8 FP32, c[0,1] = C[group][2 tig, +1],
//   c[2,3] = C[group + 8][2 tig, +1]. The first element of a pair is the register's low half.
//   Each D element is computed on its own: products of BF16 values are exact in FP32 and are
//   added to the accumulator in k order with FP32 rounding (the hardware's internal order is
//   not specified; kernel-vs-twin tests carry a tolerance for it). No element depends on any
//   other row or column, which is what makes tensor-core GEMMs batch-invariant.
// ldmatrix: lanes 8 i .. 8 i + 7 give the row addresses of matrix i (16-byte aligned, in
//   shared memory); lane l receives row l / 4, columns 2 (l % 4), +1 of each matrix (.trans:
//   column l / 4, rows 2 (l % 4), +1).
// cp.async: in FORWARD order the copy happens at the wait that covers its group, not before,
//   so a kernel that reads shared memory too early reads the 0xFF fill (NaN); in REVERSE
//   order it lands at once, so a refill racing another warp's reads (a missing barrier) is
//   seen; SHUFFLE draws per copy. A thread that exits with copies it never waited for is
//   reported. src_bytes < bytes zero-fills the rest (the zfill form).
#pragma once
#include <cstring>

#include "launch.h"

namespace emu {

struct MmaIn { unsigned int a[4], b[2]; float c[4]; };
struct LdmatrixIn { const void *row; int count; int trans; };

EMU_NOINST inline void bf16_pair(unsigned int r, float &lo, float &hi) {
    unsigned int l = r << 16, h = r & 0xffff0000u;
    std::memcpy(&lo, &l, 4);
    std::memcpy(&hi, &h, 4);
}

// The warp collective is complete (every lane of `mask` arrived at the same op): compute it.
EMU_NOINST inline bool complete_tensor_op(Fiber *f, Fiber *w, unsigned int mask) {
    if (mask != 0xffffffffu) {
        report("warp %u: %s at %s:%u with mask 0x%08x: the .aligned tensor-core instructions "
               "need all 32 lanes", f->warp, op_name(f->op), short_file(f->site.file_name()),
               f->site.line(), mask);
        return false;
    }
    if (f->op == MMA_BF16) {
        float A[16][16], B[16][8], C[16][8];
        for (int l = 0; l < 32; ++l) {
            const MmaIn &in = *static_cast<const MmaIn *>(w[l].in);
            const int g = l >> 2, t = l & 3;
            bf16_pair(in.a[0], A[g][2 * t], A[g][2 * t + 1]);
            bf16_pair(in.a[1], A[g + 8][2 * t], A[g + 8][2 * t + 1]);
            bf16_pair(in.a[2], A[g][2 * t + 8], A[g][2 * t + 9]);
            bf16_pair(in.a[3], A[g + 8][2 * t + 8], A[g + 8][2 * t + 9]);
            bf16_pair(in.b[0], B[2 * t][g], B[2 * t + 1][g]);
            bf16_pair(in.b[1], B[2 * t + 8][g], B[2 * t + 9][g]);
            C[g][2 * t] = in.c[0];
            C[g][2 * t + 1] = in.c[1];
            C[g + 8][2 * t] = in.c[2];
            C[g + 8][2 * t + 1] = in.c[3];
        }
        if (chk.flags & CHECK_COUNT) count_event(EV_MMA);
        for (int l = 0; l < 32; ++l) {
            float *d = static_cast<float *>(w[l].out);
            const int g = l >> 2, t = l & 3;
            const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
            for (int e = 0; e < 4; ++e) {
                float acc = C[rows[e]][cols[e]];
                for (int k = 0; k < 16; ++k) {
                    float p = A[rows[e]][k] * B[k][cols[e]];  // exact: 8-bit x 8-bit mantissas
                    asm("" : "+x"(p));
                    acc = acc + p;
                    asm("" : "+x"(acc));
                }
                d[e] = acc;
            }
        }
        return true;
    }
    // ldmatrix
    const LdmatrixIn &me = *static_cast<const LdmatrixIn *>(f->in);
    for (int l = 0; l < 32; ++l) {
        const LdmatrixIn &in = *static_cast<const LdmatrixIn *>(w[l].in);
        if (in.count != me.count || in.trans != me.trans) {
            report("warp %u: ldmatrix at %s:%u: lanes disagree on .x%d%s", f->warp,
                   short_file(f->site.file_name()), f->site.line(), me.count,
                   me.trans ? ".trans" : "");
            return false;
        }
        if (l < 8 * me.count) {
            if (reinterpret_cast<uintptr_t>(in.row) & 15u) {
                report("warp %u: ldmatrix at %s:%u: lane %d's row address %p is not 16-byte "
                       "aligned", f->warp, short_file(f->site.file_name()), f->site.line(), l,
                       in.row);
                return false;
            }
            if (!is_shared(in.row, 16)) {
                report("warp %u: ldmatrix at %s:%u: lane %d's row address %p is not in shared "
                       "memory", f->warp, short_file(f->site.file_name()), f->site.line(), l,
                       in.row);
                return false;
            }
        }
    }
    if (chk.flags & (CHECK_RACE | CHECK_COUNT)) {
        const void *rows[32];
        for (int l = 0; l < 8 * me.count; ++l) {
            rows[l] = static_cast<const LdmatrixIn *>(w[l].in)->row;
            // each row is read as the lane that supplied its address
            if (chk.flags & CHECK_RACE)
                race_shared(w[l].lin, shared_index(reinterpret_cast<uintptr_t>(rows[l]), 16),
                            16, false, w[l].pc);
        }
        if (chk.flags & CHECK_COUNT) count_ldmatrix(rows, me.count, f->pc);
        if (rt.failed) return false;
    }
    unsigned short M[4][8][8];
    for (int i = 0; i < me.count; ++i)
        for (int r = 0; r < 8; ++r)
            std::memcpy(M[i][r], static_cast<const LdmatrixIn *>(w[8 * i + r].in)->row, 16);
    for (int l = 0; l < 32; ++l) {
        unsigned int *out = static_cast<unsigned int *>(w[l].out);
        const int r = l >> 2, c = 2 * (l & 3);
        for (int i = 0; i < me.count; ++i) {
            const unsigned int lo = me.trans ? M[i][c][r] : M[i][r][c];
            const unsigned int hi = me.trans ? M[i][c + 1][r] : M[i][r][c + 1];
            out[i] = lo | (hi << 16);
        }
    }
    return true;
}

template <class In>
inline void collective(Op op, const In &in, void *out, site_t site, const void *ret) {
    Fiber *f = rt.cur;
    f->pc = code_offset(ret);
    f->op = op;
    f->mask = 0xffffffffu;
    f->width = 32;
    f->size = 0;
    f->in = &in;
    f->out = out;
    f->site = site;
    f->state = WAIT_WARP;
    yield(f);
}

// d = a * b + c for one 16x8x16 tile held by the warp (see the layouts above). These are
// not inlined, so that __builtin_return_address names the kernel's call (check.h).
__attribute__((noinline)) inline void mma_m16n8k16_bf16(float *d, const unsigned int *a,
                                                        const unsigned int *b, const float *c,
                                                        site_t site = site_t::current()) {
    MmaIn in;
    std::memcpy(in.a, a, sizeof in.a);
    std::memcpy(in.b, b, sizeof in.b);
    std::memcpy(in.c, c, sizeof in.c);
    float out[4];
    collective(MMA_BF16, in, out, site, __builtin_return_address(0));
    std::memcpy(d, out, sizeof out);
}

// count (1, 2 or 4) 8x8 b16 matrices; r[i] receives this lane's part of matrix i.
__attribute__((noinline)) inline void ldmatrix(unsigned int *r, const void *row, int count,
                                               bool trans, site_t site = site_t::current()) {
    const LdmatrixIn in{row, count, trans ? 1 : 0};
    unsigned int out[4];
    collective(LDMATRIX, in, out, site, __builtin_return_address(0));
    std::memcpy(r, out, sizeof(unsigned int) * static_cast<size_t>(count));
}

__attribute__((noinline)) inline void cp_async(void *dst, const void *src, unsigned int bytes,
                                               unsigned int src_bytes,
                                               site_t site = site_t::current()) {
    Fiber *f = rt.cur;
    if ((bytes != 4 && bytes != 8 && bytes != 16) || src_bytes > bytes) {
        fail_here("cp.async with a size other than 4, 8 or 16 bytes (or src-size > size)", site);
    }
    if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & (bytes - 1))
        fail_here("cp.async with an address not aligned to the copy size", site);
    if (!is_shared(dst, bytes)) fail_here("cp.async destination is not shared memory", site);
    if (src_bytes && is_shared(src, src_bytes))
        fail_here("cp.async source is shared memory (it must be global)", site);
    if (f->n_async == static_cast<int>(sizeof f->async / sizeof f->async[0]))
        fail_here("more than 128 cp.async copies in flight in one thread", site);
    f->async[f->n_async++] = {dst, src, bytes, src_bytes, f->async_groups, 0};
    if (chk.flags & (CHECK_RACE | CHECK_COUNT)) {
        const unsigned int pc = code_offset(__builtin_return_address(0));
        if (chk.flags & CHECK_RACE) {
            race_async_issue(f->lin, dst, bytes, pc);
            const int range = src_bytes ? range_of(reinterpret_cast<uintptr_t>(src), src_bytes) : -1;
            if (range >= 0)
                race_global(f->lin, range, reinterpret_cast<uintptr_t>(src), src_bytes, false, pc);
        }
        if (chk.flags & CHECK_COUNT) count_cp_async(f, dst, src, bytes, src_bytes, pc);
    }
    // Where the copy lands: at the covering wait (FORWARD: a read before the wait sees the
    // fill), or at once (REVERSE: a write into a buffer another warp still reads, with no
    // barrier between, is seen by that warp); SHUFFLE draws one per copy.
    if (rt.order == REVERSE || (rt.order == SHUFFLE && (next_random() & 1))) {
        Fiber::AsyncCopy &c = f->async[f->n_async - 1];
        if (c.src_bytes) std::memcpy(c.dst, c.src, c.src_bytes);
        std::memset(static_cast<char *>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
        c.landed = 1;  // the wait only retires it
    }
}

inline void cp_async_commit() { ++rt.cur->async_groups; }

// Complete every copy of the groups older than the newest `pending` committed ones.
inline void cp_async_wait(int pending) {
    Fiber *f = rt.cur;
    int kept = 0;
    for (int i = 0; i < f->n_async; ++i) {
        Fiber::AsyncCopy &c = f->async[i];
        if (c.group < f->async_groups - pending) {
            if (!c.landed) {
                if (c.src_bytes) std::memcpy(c.dst, c.src, c.src_bytes);
                std::memset(static_cast<char *>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
            }
            if (chk.flags & CHECK_RACE) race_async_land(c.dst, c.bytes);
        } else {
            f->async[kept++] = c;
        }
    }
    f->n_async = kept;
}

}  // namespace emu
