// Device argmax, the original engine's rule bit for bit (DESIGN §2).
//
//   out[r] = argmax_i logits[r, i]
//
// Shapes: logits [n_rows, vocab] (BF16 or FP32, rows contiguous), out [n_rows] uint32.
// Launch: grid (n_rows), block (1024), no dynamic shared memory. Exactly 1024 threads:
// the tie rule depends on it.
// Rule: thread t scans i = t, t+1024, ... keeping the FIRST strictly greater value,
// starting from (-1e30, index 0); then a halving tree (512, 256, ..., 1) in which slot t
// takes slot t+s only when strictly greater. A tie therefore goes to the candidate in the
// lower slot at each step, not to the lowest index. NaN never wins (comparisons with NaN
// are false); a row with no value > -1e30 gives 0.
// The masked host-greedy pick (argmax_bf16_batch_masked, 256 threads per row) is a second,
// different rule, and count_nonfinite_* (the engine's NaN/Inf check of logits rows) a third
// scan: see their own headers further down.
#include "common.cuh"

#define ARGMAX_THREADS 1024

template <typename T>
__device__ __forceinline__ float load_logit(const T *p, long long i);
template <>
__device__ __forceinline__ float load_logit<bf16>(const bf16 *p, long long i) { return bf2f(p[i]); }
template <>
__device__ __forceinline__ float load_logit<float>(const float *p, long long i) { return p[i]; }

template <typename T>
__device__ __forceinline__ void argmax_row(const T *row, int vocab, unsigned int *out) {
    __shared__ float s_val[ARGMAX_THREADS];
    __shared__ unsigned int s_idx[ARGMAX_THREADS];
    const int t = threadIdx.x;
    float best = -1e30f;
    unsigned int best_i = 0;
    for (int i = t; i < vocab; i += ARGMAX_THREADS) {
        float v = load_logit<T>(row, i);
        if (v > best) { best = v; best_i = (unsigned int)i; }
    }
    s_val[t] = best;
    s_idx[t] = best_i;
    __syncthreads();
    for (int s = ARGMAX_THREADS / 2; s > 0; s >>= 1) {
        if (t < s && s_val[t + s] > s_val[t]) {
            s_val[t] = s_val[t + s];
            s_idx[t] = s_idx[t + s];
        }
        __syncthreads();
    }
    if (t == 0) *out = s_idx[0];
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_bf16(const bf16 *logits, unsigned int *out, int vocab) {
    argmax_row<bf16>(logits, vocab, out);
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_bf16_batch(const bf16 *logits, unsigned int *out, int n_rows, int vocab) {
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    argmax_row<bf16>(logits + (long long)r * vocab, vocab, out + r);
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_fp32(const float *logits, unsigned int *out, int n_rows, int vocab) {
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    argmax_row<float>(logits + (long long)r * vocab, vocab, out + r);
}

// ---------------------------------------------------------------------------------------
// argmax_bf16_batch_masked: the host greedy pick with per-row suppressed ids (the original
// engine's masked greedy of 2026-10-07, `argmax_bf16_batch_masked_host`).
//
//   valid(r) = { i < vocab : i is none of masks[r, 0..7] }
//   out[r]   = the i in valid(r) with the largest logits[r, i]; among equal values the
//              HIGHEST index (+0 and -0 are equal)
//   out[r]   = 0xFFFFFFFF when some valid value is not finite (NaN or +-inf) or valid(r)
//              is empty: the caller then runs its host path unchanged.
//
// Shapes: logits [n_rows, row_stride] BF16 (the first `vocab` of each row are read),
// masks [n_rows, MASK_IDS] uint32 (0xFFFFFFFF = no id; ids >= vocab never match),
// out [n_rows] uint32.
// Launch: grid (n_rows), block (MASKED_THREADS), no dynamic shared memory.
// The pick is a maximum under a total order on (value, index), so the answer does not
// depend on the thread count or the reduction order.
#define MASKED_THREADS 256
#define MASK_IDS 8
#define NO_ID 0xFFFFFFFFu

struct MaskedBest {
    float v;
    unsigned int i;    // NO_ID: nothing valid seen yet
    unsigned int bad;  // 1: a valid value was not finite
};

__device__ __forceinline__ MaskedBest masked_pick(MaskedBest a, MaskedBest b) {
    MaskedBest r = a;
    if (b.i != NO_ID && (a.i == NO_ID || b.v > a.v || (b.v == a.v && b.i > a.i))) {
        r.v = b.v;
        r.i = b.i;
    }
    r.bad = a.bad | b.bad;
    return r;
}

extern "C" __global__ void __launch_bounds__(MASKED_THREADS)
argmax_bf16_batch_masked(const bf16 *logits, const unsigned int *masks, unsigned int *out,
                         int n_rows, int vocab, int row_stride) {
    __shared__ MaskedBest s_warp[MASKED_THREADS / 32];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const int t = threadIdx.x;
    const bf16 *row = logits + (long long)r * row_stride;
    unsigned int m[MASK_IDS];
#pragma unroll
    for (int j = 0; j < MASK_IDS; ++j) m[j] = masks[(long long)r * MASK_IDS + j];

    MaskedBest best = {NEG_INF, NO_ID, 0u};
    for (int i = t; i < vocab; i += MASKED_THREADS) {
        bool masked = false;
#pragma unroll
        for (int j = 0; j < MASK_IDS; ++j) masked |= (m[j] == (unsigned int)i);
        if (masked) continue;
        const float v = bf2f(row[i]);
        if (!isfinite(v)) {
            best.bad = 1u;
            continue;
        }
        const MaskedBest c = {v, (unsigned int)i, 0u};
        best = masked_pick(best, c);
    }
    // warp, then block: any order gives the same pick (see the header)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        MaskedBest other;
        other.v = __shfl_down_sync(0xffffffffu, best.v, o);
        other.i = __shfl_down_sync(0xffffffffu, best.i, o);
        other.bad = __shfl_down_sync(0xffffffffu, best.bad, o);
        best = masked_pick(best, other);
    }
    if ((t & 31) == 0) s_warp[t >> 5] = best;
    __syncthreads();
    if (t == 0) {
        MaskedBest acc = s_warp[0];
        for (int w = 1; w < MASKED_THREADS / 32; ++w) acc = masked_pick(acc, s_warp[w]);
        out[r] = (acc.bad || acc.i == NO_ID) ? NO_ID : acc.i;
    }
}

// ---------------------------------------------------------------------------------------
// count_nonfinite_bf16 / count_nonfinite_fp32: how many values of each logits row are NaN
// or +-inf. The engine's check that a forward pass gave usable logits before it picks a
// token from them (not in the original engine, whose argmax quietly gives 0 for a NaN row).
//
//   out[r] = #{ i < vocab : logits[r, i] is NaN or +-inf }      (exact integer count)
//
// Shapes: logits [n_rows, vocab] (BF16 or FP32, rows contiguous), out [n_rows] uint32.
// Launch: grid (n_rows), block (NONFINITE_THREADS = 256), no dynamic shared memory.
// A thread counts the values it visits: 8 BF16 / 4 FP32 per 128-bit load when vocab is a
// multiple of 8 / 4 and the row is 16-byte aligned, one per load otherwise; a warp-shuffle
// sum per warp, then the 8 warp totals through shared memory. The test is on the exponent
// bits (all ones means NaN or inf), an integer compare that fast math cannot fold away.
#define NONFINITE_THREADS 256

// Non-finite values among the elements of one 32-bit word (2 BF16 or 1 FP32).
template <typename E>
__device__ __forceinline__ unsigned int nonfinite_word(unsigned int w);
template <>
__device__ __forceinline__ unsigned int nonfinite_word<unsigned short>(unsigned int w) {
    return ((w & 0x7f80u) == 0x7f80u) + (((w >> 16) & 0x7f80u) == 0x7f80u);
}
template <>
__device__ __forceinline__ unsigned int nonfinite_word<unsigned int>(unsigned int w) {
    return (w & 0x7f800000u) == 0x7f800000u;
}

// Row r's count into out[r]; E is the element's bits (unsigned short: BF16, unsigned int:
// FP32). `s_warp_count`: NONFINITE_THREADS / 32 words of shared memory (the kernel's).
template <typename E>
__device__ __forceinline__ void count_nonfinite_rows(const E *logits, unsigned int *out,
                                                     int n_rows, int vocab,
                                                     unsigned int *s_warp_count) {
    constexpr int PER_VEC = 16 / sizeof(E);
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const E *row = logits + (long long)r * vocab;
    unsigned int count = 0;
    if (vocab % PER_VEC == 0 && aligned16(row)) {
        const uint4 *v = reinterpret_cast<const uint4 *>(row);
        for (int c = threadIdx.x; c < vocab / PER_VEC; c += NONFINITE_THREADS) {
            const uint4 w = __ldg(v + c);
            count += nonfinite_word<E>(w.x) + nonfinite_word<E>(w.y) + nonfinite_word<E>(w.z) +
                     nonfinite_word<E>(w.w);
        }
    } else {
        // one element widened to a word (a BF16's high half is 0: finite, not counted)
        for (int i = threadIdx.x; i < vocab; i += NONFINITE_THREADS)
            count += nonfinite_word<E>((unsigned int)row[i]);
    }
    // warp-shuffle sum, then the warp totals through shared memory; thread 0 writes
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) count += __shfl_xor_sync(0xffffffffu, count, o);
    if (lane == 0) s_warp_count[warp] = count;
    __syncthreads();
    count = lane < NONFINITE_THREADS / 32 ? s_warp_count[lane] : 0u;
    if (warp == 0) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) count += __shfl_xor_sync(0xffffffffu, count, o);
        if (lane == 0) out[r] = count;
    }
}

extern "C" __global__ void __launch_bounds__(NONFINITE_THREADS)
count_nonfinite_bf16(const bf16 *logits, unsigned int *out, int n_rows, int vocab) {
    __shared__ unsigned int s_count_bf16[NONFINITE_THREADS / 32];
    count_nonfinite_rows<unsigned short>(reinterpret_cast<const unsigned short *>(logits), out,
                                         n_rows, vocab, s_count_bf16);
}

extern "C" __global__ void __launch_bounds__(NONFINITE_THREADS)
count_nonfinite_fp32(const float *logits, unsigned int *out, int n_rows, int vocab) {
    __shared__ unsigned int s_count_fp32[NONFINITE_THREADS / 32];
    count_nonfinite_rows<unsigned int>(reinterpret_cast<const unsigned int *>(logits), out,
                                       n_rows, vocab, s_count_fp32);
}
