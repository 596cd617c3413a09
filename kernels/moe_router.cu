// Mixture-of-experts routing: each token's top-k experts and weights, then per-expert row
// lists for the grouped GEMM (kernels/moe_gemm.cu).
//
// moe_topk_softmax (HF's *TopKRouter after the logits GEMM, in float32):
//   m = max_e l[t, e] (NaN ignored), x_e = expf(l[t, e] - m), s = sum_e x_e, p_e = x_e / s
//   slots 0..k-1: the k experts ranked first by the router logit l (descending; equal logits:
//   the lower expert index first; NaN above every number, as torch.topk puts it), i.e. by p
//   (exp is monotone) with ties of p broken by l, then by index (see below)
//   w_s = p_{e_s}; with `renormalize`: w_s = w_s / (((w_0 + w_1) + w_2) + ... + w_{k-1})
// With `bias` (bf16 [num_experts], gpt-oss's router bias; NULL: none) every l[t, e] above is
// the float32 logit plus the bias, one float32 add, before anything else.
// Shapes: logits float32 [n_tokens, num_experts]; topk_ids int32 [n_tokens, top_k] (slot
// order = rank order), topk_weights float32 [n_tokens, top_k].
// Launch: block MOE_ROUTER_THREADS (128: 4 warps), one warp per token, grid
// ceil(n_tokens / 4). Lane l holds experts l, l + 32, ... (at most MOE_MAX_PER_LANE = 16 per
// lane: num_experts <= 512); s is each lane's sequential sum of its experts in index order,
// then the xor butterfly 16, 8, 4, 2, 1 (common.cuh warp_sum). Restrictions: 1 <= top_k <=
// min(num_experts, 32). A row depends on its own logits only (batch invariance).
// Ties: torch.topk on the CPU (TopKImpl.h) compares values only and sorts with
// std::partial_sort / std::nth_element, which are unstable: which of two equal
// probabilities it picks depends on every other value of the row, so no rule of (value,
// index) reproduces it. The rule here is a strict total order, so it is deterministic and
// the same for every batch. Ranking by the logit instead of p selects the same experts as
// ranking by p except where two different logits round to the same float32 probability,
// where it picks the larger logit (HF's pick there is the unstable one). On a GPU,
// torch.topk (aten/src/ATen/native/cuda/TensorTopK.cu gatherTopK) takes every value above
// the k-th, then fills the remaining places with the values equal to it in index order:
// the lower expert index first, this rule, so HF on CUDA picks the same experts.
//
// moe_route (one CTA): the token-expert pairs p = t * top_k + s grouped by expert:
//   expert_offsets[e] = #pairs with expert < e (expert_offsets[E] = n_pairs),
//   sorted_pairs[expert_offsets[e] + r] = the r-th pair, in increasing p, routed to e,
//   tile_offsets[e] = sum_{e' < e} ceil(count_e' / block_m) (the grouped GEMM's row tiles).
// Deterministic: positions are ranks (counts), never an order of atomics. Launch: grid 1,
// block MOE_ROUTE_THREADS (512: 16 warps); warp w owns the pairs [w * seg, (w + 1) * seg),
// seg = ceil(n_pairs / 16), counts them per expert (__match_any_sync), the block scans the
// counts, and each warp places its pairs at its base + rank. Shared memory: 16 x 512 ints.
// Restrictions: 1 <= num_experts <= 512; every id in [0, num_experts) (ids from
// moe_topk_softmax are; others are skipped and leave expert_offsets[E] < n_pairs).
#include "common.cuh"

#define MOE_ROUTER_THREADS 128
#define MOE_MAX_EXPERTS 512
#define MOE_MAX_PER_LANE (MOE_MAX_EXPERTS / 32)
#define MOE_ROUTE_THREADS 512
#define MOE_ROUTE_WARPS (MOE_ROUTE_THREADS / 32)

// (a, ia) ranks before (b, ib): NaN first, then the larger value, then the lower index.
__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) {
    const bool na = a != a, nb = b != b;
    if (na != nb) return na;
    if (!na && a != b) return a > b;
    return ia < ib;
}

extern "C" __global__ void __launch_bounds__(MOE_ROUTER_THREADS)
moe_topk_softmax(int *topk_ids, float *topk_weights, const float *logits, int n_tokens,
                 int num_experts, int top_k, int renormalize, const bf16 *bias) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (MOE_ROUTER_THREADS / 32) + (threadIdx.x >> 5);
    if (t >= n_tokens) return;  // warp-uniform
    const float *row = logits + (long long)t * num_experts;
    float l[MOE_MAX_PER_LANE], x[MOE_MAX_PER_LANE];
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < MOE_MAX_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        l[j] = e < num_experts ? row[e] : 0.f;
        if (bias != nullptr && e < num_experts) l[j] += bf2f(bias[e]);
        if (e < num_experts) m = fmaxf(m, l[j]);
    }
    m = warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < MOE_MAX_PER_LANE; ++j) {
        x[j] = 0.f;
        if (lane + 32 * j < num_experts) {
            x[j] = expf(l[j] - m);
            s += x[j];
        }
    }
    s = warp_sum(s);

    unsigned int taken = 0;  // bit j: expert lane + 32 j already chosen
    int my_id = 0;           // lane s < top_k keeps slot s
    float my_w = 0.f;
    for (int slot = 0; slot < top_k; ++slot) {
        float bv = 0.f;
        int bi = 0x7fffffff;  // no candidate: ranks after every real one
#pragma unroll
        for (int j = 0; j < MOE_MAX_PER_LANE; ++j) {
            const int e = lane + 32 * j;
            if (e < num_experts && !(taken >> j & 1u) &&
                (bi == 0x7fffffff || ranks_before(l[j], e, bv, bi))) {
                bv = l[j];
                bi = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi != 0x7fffffff && (bi == 0x7fffffff || ranks_before(ov, oi, bv, bi))) {
                bv = ov;
                bi = oi;
            }
        }
        // the owner lane marks it and hands out its probability
        float p = 0.f;
#pragma unroll
        for (int j = 0; j < MOE_MAX_PER_LANE; ++j)
            if (lane + 32 * j == bi) {
                taken |= 1u << j;
                p = x[j] / s;
            }
        p = __shfl_sync(0xffffffffu, p, bi & 31);
        if (lane == slot) {
            my_id = bi;
            my_w = p;
        }
    }
    if (renormalize) {
        float sum = 0.f;
        for (int slot = 0; slot < top_k; ++slot) sum += __shfl_sync(0xffffffffu, my_w, slot);
        my_w = my_w / sum;
    }
    if (lane < top_k) {
        topk_ids[(long long)t * top_k + lane] = my_id;
        topk_weights[(long long)t * top_k + lane] = my_w;
    }
}

// Inclusive scan of v over the block (MOE_ROUTE_THREADS threads); `scratch` holds one int
// per warp. Every thread gets its inclusive prefix; `total` the block's sum.
__device__ __forceinline__ int block_scan_incl(int v, int *scratch, int &total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    int before = 0;
    total = 0;
    for (int w = 0; w < MOE_ROUTE_WARPS; ++w) {
        if (w < warp) before += scratch[w];
        total += scratch[w];
    }
    return v + before;
}

extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS)
moe_route(int *sorted_pairs, int *expert_offsets, int *tile_offsets, const int *topk_ids,
          int n_pairs, int num_experts, int block_m) {
    __shared__ int hist[MOE_ROUTE_WARPS][MOE_MAX_EXPERTS];  // then: each warp's base per expert
    __shared__ int scratch[MOE_ROUTE_WARPS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int seg = (n_pairs + MOE_ROUTE_WARPS - 1) / MOE_ROUTE_WARPS;
    const int lo = warp * seg, hi = min(n_pairs, lo + seg);
    const unsigned int below = (1u << lane) - 1u;
    for (int e = lane; e < num_experts; e += 32) hist[warp][e] = 0;
    __syncwarp();
    // 1. each warp counts its pairs per expert (only it writes its row)
    for (int base = lo; base < hi; base += 32) {
        const int p = base + lane;
        int e = p < hi ? topk_ids[p] : -1;
        if (e >= num_experts) e = -1;
        const unsigned int peers = __match_any_sync(0xffffffffu, e);
        if (e >= 0 && (peers & below) == 0) hist[warp][e] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    // 2. per expert: count, the exclusive scans of rows and of row tiles, each warp's base
    const int e = tid;  // MOE_ROUTE_THREADS == MOE_MAX_EXPERTS
    int count = 0;
    if (e < num_experts)
        for (int w = 0; w < MOE_ROUTE_WARPS; ++w) count += hist[w][e];
    const int tiles = (count + block_m - 1) / block_m;
    int rows_total, tiles_total;
    const int rows_incl = block_scan_incl(count, scratch, rows_total);
    const int tiles_incl = block_scan_incl(tiles, scratch, tiles_total);
    if (e < num_experts) {
        expert_offsets[e] = rows_incl - count;
        tile_offsets[e] = tiles_incl - tiles;
        int run = rows_incl - count;
        for (int w = 0; w < MOE_ROUTE_WARPS; ++w) {
            const int c = hist[w][e];
            hist[w][e] = run;
            run += c;
        }
    }
    if (tid == 0) {
        expert_offsets[num_experts] = rows_total;
        tile_offsets[num_experts] = tiles_total;
    }
    __syncthreads();
    // 3. each warp places its pairs, in order, at its base + rank among equal experts
    for (int base = lo; base < hi; base += 32) {
        const int p = base + lane;
        int ex = p < hi ? topk_ids[p] : -1;
        if (ex >= num_experts) ex = -1;
        const unsigned int peers = __match_any_sync(0xffffffffu, ex);
        if (ex >= 0) sorted_pairs[hist[warp][ex] + __popc(peers & below)] = p;
        __syncwarp();
        if (ex >= 0 && (peers & below) == 0) hist[warp][ex] += __popc(peers);
        __syncwarp();
    }
}
