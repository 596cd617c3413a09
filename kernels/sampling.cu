// Token sampling, one CTA of 1024 threads per row (twin: metrale/ops/sampling.py).
//
//   out[r] = sample(logits[r, :], params[r], seeds[r], steps[r], penalty_ids[r, :count[r]])
//
// Entry point `sample_rows`; launch grid (n_rows), block (1024), no dynamic shared memory.
// Arguments: logits [n_rows, vocab] BF16 (logits_fp32 == 0) or FP32 (logits_fp32 != 0);
// out [n_rows] uint32; params [n_rows] SampleParams (layout below, 32 bytes per row);
// seeds, steps [n_rows] uint64; penalty_ids [n_rows, max_penalty_ids] int32 and
// penalty_counts [n_rows] int32 (both may be NULL when max_penalty_ids == 0);
// workspace [n_rows, vocab] float32 scratch (overwritten). vocab <= 2^19.
// Every per-row value is read from device memory, so the launch is CUDA-graph safe.
//
// Per row, with l the logits widened to FP32:
//  1. repetition penalty (penalty != 1): for each id in penalty_ids[r, :count] with
//     0 <= id < vocab, l[id] = l[id] > 0 ? l[id] / penalty : l[id] * penalty. The new value
//     is computed from the original logit, so a repeated id is penalised once.
//  2. temperature: !(T > 0) is greedy: out = the device argmax rule (DESIGN §2, as
//     kernels/argmax.cu) over the penalised logits. Otherwise x = l / T. NaN -> -inf.
//     A row whose max is -inf gives 0 (what the argmax rule gives).
//  3. top_k (0 < k < vocab): keep x >= the k-th largest x (ties with it are kept; HF rule).
//     Found with a 4-pass 8-bit radix select on order-preserving keys of x.
//  4. weights e = (x == xmax) ? 1 : exp_det(x - xmax) (0 below -80 and for removed tokens),
//     computed with a deterministic FP32 exp (explicit _rn ops, no FMA contraction) that the
//     twin reproduces bit for bit; integer masses q = trunc(e * 2^44) (uint64), so every
//     sum below is exact and order-independent. Tokens with e < 2^-44 have q == 0 and are
//     never drawn (their probability is below 6e-14 of the top token's).
//  5. top_p (< 1): with Z = sum q and F(t) = sum of q over tokens whose e bits >= t, keep
//     tokens with (e bits) >= lo, lo = max{t : !((double)F(t) < (double)Z * top_p)}, i.e.
//     a token is kept iff the mass strictly above it is < top_p (ties kept together, at
//     least the top token kept). Binary search on t with block-wide integer sums.
//  6. min_p (> 0): keep e >= min(min_p, 1) (probability relative to the top token).
//  7. draw: philox4x32-10(counter = (step lo, step hi, 0, 0), key = (seed lo, seed hi))
//     word 0 = r; target = floor(Zf * r / 2^32) with Zf the kept mass; out = the first
//     index i (in vocabulary order) whose inclusive prefix mass exceeds target.
// Since steps 4-7 are exact integer arithmetic on bit-identical FP32 inputs, the twin gives
// the same token (FTZ: subnormal logits are flushed on the device, not in the twin).
#include "common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define Q_SCALE 17592186044416.0f  // 2^44
#define EXP_FLOOR (-80.0f)

// Per-row parameters, 32 bytes (metrale.ops.sampling.PARAMS_DTYPE).
struct SampleParams {
    float temperature;         // offset 0: <= 0 (or NaN) means greedy
    float top_p;               // offset 4: >= 1 (or NaN) disables
    float min_p;               // offset 8: <= 0 (or NaN) disables, > 1 acts as 1
    float repetition_penalty;  // offset 12: == 1 disables
    int top_k;                 // offset 16: <= 0 or >= vocab disables
    int reserved[3];           // offset 20: zero
};

typedef unsigned long long u64;

// ---------------------------------------------------------------------------- helpers
__device__ __forceinline__ float sanitize(float x) {
    return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u ? NEG_INF : x;
}

// Order-preserving key of a (non-NaN) float; -0 and +0 share a key.
__device__ __forceinline__ unsigned int order_key(float x) {
    unsigned int u = __float_as_uint(x);
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// exp(d) for d <= 0 with only correctly rounded FP32 ops (never contracted into FMA), so
// numpy reproduces it bit for bit. 0 for d < -80 (also -inf); about 1 ulp accurate.
__device__ __forceinline__ float exp_det(float d) {
    if (!(d >= EXP_FLOOR)) return 0.f;
    const float n = rintf(__fmul_rn(d, 1.44269502f));
    float r = __fsub_rn(d, __fmul_rn(n, 0.693359375f));
    r = __fsub_rn(r, __fmul_rn(n, -2.12194440e-4f));
    float p = 1.98412698e-4f;                      // 1/7!
    p = __fadd_rn(__fmul_rn(p, r), 1.38888889e-3f);  // 1/6!
    p = __fadd_rn(__fmul_rn(p, r), 8.33333333e-3f);  // 1/5!
    p = __fadd_rn(__fmul_rn(p, r), 4.16666667e-2f);  // 1/4!
    p = __fadd_rn(__fmul_rn(p, r), 1.66666667e-1f);  // 1/3!
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    return __fmul_rn(p, __int_as_float(((int)n + 127) << 23));
}

__device__ __forceinline__ u64 mass_of(float e) {
    return __float2ull_rz(__fmul_rn(e, Q_SCALE));
}

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ u64 block_sum_u64(u64 v, u64 *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_u64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < SAMPLE_WARPS ? scratch[lane] : 0ull;
    return warp_sum_u64(v);
}

// Philox4x32-10 (Random123), first output word.
__device__ __forceinline__ unsigned int philox_word0(u64 seed, u64 step) {
    unsigned int c0 = (unsigned int)step, c1 = (unsigned int)(step >> 32), c2 = 0u, c3 = 0u;
    unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

__device__ __forceinline__ float load_logit(const void *row, int fp32, int i) {
    return fp32 ? ((const float *)row)[i] : bf2f(((const bf16 *)row)[i]);
}

// The argmax rule of kernels/argmax.cu over ws[0, vocab).
__device__ unsigned int argmax_rule_ws(const float *ws, int vocab, float *s_val,
                                       unsigned int *s_idx) {
    const int t = threadIdx.x;
    float best = -1e30f;
    unsigned int best_i = 0;
    for (int i = t; i < vocab; i += SAMPLE_THREADS) {
        const float v = ws[i];
        if (v > best) { best = v; best_i = (unsigned int)i; }
    }
    __syncthreads();
    s_val[t] = best;
    s_idx[t] = best_i;
    __syncthreads();
    for (int s = SAMPLE_THREADS / 2; s > 0; s >>= 1) {
        if (t < s && s_val[t + s] > s_val[t]) {
            s_val[t] = s_val[t + s];
            s_idx[t] = s_idx[t + s];
        }
        __syncthreads();
    }
    return s_idx[0];
}

// The key of the k-th largest x in ws (radix select, 8 bits per pass, MSB first).
__device__ unsigned int kth_largest_key(const float *ws, int vocab, int k, unsigned int *hist,
                                        unsigned int *s_bcast) {
    const int t = threadIdx.x, lane = t & 31;
    unsigned int prefix = 0u, mask = 0u, remaining = (unsigned int)k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        __syncthreads();
        if (t < 256) hist[t] = 0u;
        __syncthreads();
        for (int base = 0; base < vocab; base += SAMPLE_THREADS) {
            const int i = base + t;
            unsigned int digit = 256u;
            if (i < vocab) {
                const unsigned int key = order_key(ws[i]);
                if ((key & mask) == prefix) digit = (key >> shift) & 255u;
            }
            // warp-aggregated increment: one atomic per distinct digit in the warp
            const unsigned int peers = __match_any_sync(0xffffffffu, digit);
            if (digit < 256u && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
        }
        __syncthreads();
        if (t < 32) {
            // lane L holds bins 255-8L ... 248-8L (descending)
            unsigned int s = 0u;
#pragma unroll
            for (int j = 0; j < 8; ++j) s += hist[255 - 8 * lane - j];
            unsigned int incl = s;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned int v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            const unsigned int excl = incl - s;
            if (excl < remaining && incl >= remaining) {
                unsigned int above = excl;
                int j = 0;
                while (j < 7 && above + hist[255 - 8 * lane - j] < remaining) {
                    above += hist[255 - 8 * lane - j];
                    ++j;
                }
                s_bcast[0] = (unsigned int)(255 - 8 * lane - j);
                s_bcast[1] = remaining - above;
            }
        }
        __syncthreads();
        prefix |= s_bcast[0] << shift;
        mask |= 255u << shift;
        remaining = s_bcast[1];
    }
    return prefix;
}

// ---------------------------------------------------------------------------- kernel
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1)
sample_rows(const void *logits, int logits_fp32, unsigned int *out, int n_rows, int vocab,
            const SampleParams *params, const u64 *seeds, const u64 *steps,
            const int *penalty_ids, const int *penalty_counts, int max_penalty_ids,
            float *workspace) {
    __shared__ float s_val[SAMPLE_THREADS];
    __shared__ unsigned int s_idx[SAMPLE_THREADS];
    __shared__ u64 s_u64[SAMPLE_WARPS];
    __shared__ float s_f[32];
    __shared__ unsigned int s_bcast[2];

    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int fp32 = logits_fp32 != 0;
    const void *row = fp32 ? (const void *)((const float *)logits + (long long)r * vocab)
                           : (const void *)((const bf16 *)logits + (long long)r * vocab);
    float *ws = workspace + (long long)r * vocab;
    const SampleParams p = params[r];
    const float temp = p.temperature;
    const bool greedy = !(temp > 0.f);

    // 1-2: x = penalised logits (/ T unless greedy) into the workspace
    for (int i = t; i < vocab; i += SAMPLE_THREADS) {
        const float l = load_logit(row, fp32, i);
        ws[i] = sanitize(greedy ? l : __fdiv_rn(l, temp));
    }
    const float pen = p.repetition_penalty;
    if (max_penalty_ids > 0 && pen != 1.f) {
        const int cnt = min(penalty_counts[r], max_penalty_ids);
        __syncthreads();
        const int *ids = penalty_ids + (long long)r * max_penalty_ids;
        for (int j = t; j < cnt; j += SAMPLE_THREADS) {
            const int id = ids[j];
            if (id < 0 || id >= vocab) continue;
            const float l = load_logit(row, fp32, id);
            const float lp = l > 0.f ? __fdiv_rn(l, pen) : __fmul_rn(l, pen);
            ws[id] = sanitize(greedy ? lp : __fdiv_rn(lp, temp));  // same value if repeated
        }
    }
    __syncthreads();
    if (greedy) {
        const unsigned int idx = argmax_rule_ws(ws, vocab, s_val, s_idx);
        if (t == 0) out[r] = idx;
        return;
    }
    float m = NEG_INF;
    for (int i = t; i < vocab; i += SAMPLE_THREADS) m = fmaxf(m, ws[i]);
    const float xmax = block_max(m, s_f);
    if (xmax == NEG_INF) {
        if (t == 0) out[r] = 0u;
        return;
    }

    // 3: top_k threshold key
    const int k = p.top_k;
    unsigned int kkey = 0u;
    if (k > 0 && k < vocab) kkey = kth_largest_key(ws, vocab, k, s_idx, s_bcast);
    __syncthreads();

    // 4: weights in place; Z = total mass
    u64 z = 0ull;
    for (int i = t; i < vocab; i += SAMPLE_THREADS) {
        const float x = ws[i];
        float e = 0.f;
        if (order_key(x) >= kkey) e = (x == xmax) ? 1.f : exp_det(__fsub_rn(x, xmax));
        ws[i] = e;
        z += mass_of(e);
    }
    z = block_sum_u64(z, s_u64);

    // 5: top_p threshold on the bits of e
    unsigned int pkey = 0u;
    const float top_p = p.top_p;
    if (top_p < 1.f) {
        const double limit = __dmul_rn(__ull2double_rn(z), (double)top_p);
        unsigned int lo = 0u, hi = 0x3F800001u;
        while (hi - lo > 1u) {
            const unsigned int mid = lo + ((hi - lo) >> 1);
            u64 f = 0ull;
            for (int i = t; i < vocab; i += SAMPLE_THREADS) {
                const float e = ws[i];
                if (__float_as_uint(e) >= mid) f += mass_of(e);
            }
            f = block_sum_u64(f, s_u64);
            if (__ull2double_rn(f) < limit) hi = mid; else lo = mid;
        }
        pkey = lo;
    }

    // 6: min_p
    const float min_p = p.min_p;
    const float mp = min_p > 0.f ? fminf(min_p, 1.f) : 0.f;

    // 7: draw. Warp w owns the contiguous segment [w * seg, (w + 1) * seg).
    const int seg = ((vocab + SAMPLE_WARPS - 1) / SAMPLE_WARPS + 31) & ~31;
    const int beg = warp * seg, end = min(vocab, beg + seg);
    u64 wsum = 0ull;
    for (int i = beg + lane; i < end; i += 32) {
        const float e = ws[i];
        if (__float_as_uint(e) >= pkey && e >= mp) wsum += mass_of(e);
    }
    wsum = warp_sum_u64(wsum);
    __syncthreads();
    if (lane == 0) s_u64[warp] = wsum;
    __syncthreads();
    u64 before = 0ull, zf = 0ull;
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        const u64 v = s_u64[w];
        if (w < warp) before += v;
        zf += v;
    }
    const unsigned int rnd = philox_word0(seeds[r], steps[r]);
    const u64 target = __umul64hi(zf, (u64)rnd << 32);  // floor(zf * rnd / 2^32) < zf
    if (before <= target && target < before + wsum) {
        u64 acc = before;
        for (int base = beg; base < end; base += 32) {
            const int i = base + lane;
            u64 v = 0ull;
            if (i < end) {
                const float e = ws[i];
                if (__float_as_uint(e) >= pkey && e >= mp) v = mass_of(e);
            }
            u64 incl = v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u64 u = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += u;
            }
            const unsigned int hit = __ballot_sync(0xffffffffu, acc + incl > target);
            if (hit) {
                if (lane == __ffs(hit) - 1) out[r] = (unsigned int)i;
                break;
            }
            acc += __shfl_sync(0xffffffffu, incl, 31);
        }
    }
}
