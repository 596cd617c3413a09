// DeepSeek's group-limited top-k routing (ops/deepseek_router.py has the formula).
//
//   mode 1 (V3): s = 1 / (1 + expf(-l)); c = s + bias; group score = the largest c of the
//                group + the second largest; renormalize: w /= (sum w + 1e-20)
//   mode 0 (V2): s = expf(l - max) / sum (the sum over experts in index order); c = s;
//                group score = the largest c of the group; unchosen groups' experts count 0
//   the topk_group best groups; the top_k best experts of c inside them; w = s of the
//   chosen (rank order) * routed_scaling_factor.
// Ranking (groups and experts): larger first, equal values by the lower index, NaN as -inf.
// Every * / + is one float32 rounding (__fmul_rn, __fadd_rn, __fdiv_rn), so the twin's
// float32 numpy arithmetic is the same formula; expf may differ from numpy's by an ulp.
// Shapes: logits float32 [n_tokens, E]; bias float32 [E] or NULL; topk_ids int32 [n, k];
// topk_weights float32 [n, k].
// Launch: grid ceil(n / 4), block 128: one warp per token. The token's s and c live in
// shared memory (4 x 2 x 512 floats); the softmax sum runs on lane 0 in index order, lane
// g (< n_group <= 32) scores group g, and each of the topk_group + top_k picks is a warp
// argmax (lane-strided scan, then a butterfly keeping the larger value, the lower index).
// Limits (checked by the launcher): E <= 512, n_group <= 32, E % n_group == 0, top_k <= 32.
#include "common.cuh"

#define DS_ROUTER_THREADS 128
#define DS_MAX_EXPERTS 512

__device__ __forceinline__ float ds_key(float v) { return isnan(v) ? NEG_INF : v; }

// (value, index) of the better of two candidates: larger key, then lower index
__device__ __forceinline__ void ds_best(float &v, int &i, float v2, int i2) {
    const float a = ds_key(v), b = ds_key(v2);
    if (b > a || (b == a && i2 < i)) {
        v = v2;
        i = i2;
    }
}

__device__ __forceinline__ void ds_warp_best(float &v, int &i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        ds_best(v, i, v2, i2);
    }
}

extern "C" __global__ void __launch_bounds__(DS_ROUTER_THREADS)
moe_topk_grouped(int *topk_ids, float *topk_weights, const float *logits, const float *bias,
                 int n_tokens, int E, int top_k, int n_group, int topk_group, int mode,
                 int renormalize, float scale) {
    __shared__ float s_all[DS_ROUTER_THREADS / 32][DS_MAX_EXPERTS];
    __shared__ float c_all[DS_ROUTER_THREADS / 32][DS_MAX_EXPERTS];
    __shared__ float g_all[DS_ROUTER_THREADS / 32][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = blockIdx.x * (DS_ROUTER_THREADS / 32) + warp;
    if (t >= n_tokens) return;   // a whole warp leaves together
    const float *l = logits + (long long)t * E;
    float *s = s_all[warp], *c = c_all[warp], *gs = g_all[warp];
    if (mode == 1) {
        for (int e = lane; e < E; e += 32) {
            s[e] = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-l[e])));
            c[e] = bias ? __fadd_rn(s[e], bias[e]) : s[e];
        }
    } else {
        float m = NEG_INF;
        for (int e = lane; e < E; e += 32) m = fmaxf(m, l[e]);
        m = warp_max(m);
        for (int e = lane; e < E; e += 32) s[e] = expf(__fsub_rn(l[e], m));
        __syncwarp();
        float total = 0.f;
        if (lane == 0)
            for (int e = 0; e < E; ++e) total = __fadd_rn(total, s[e]);
        total = __shfl_sync(0xffffffffu, total, 0);
        __syncwarp();   // lane 0's reads of s before the other lanes overwrite it
        for (int e = lane; e < E; e += 32) {
            s[e] = __fdiv_rn(s[e], total);
            c[e] = s[e];
        }
    }
    __syncwarp();
    const int G = E / n_group;
    if (lane < n_group) {
        float b1 = NEG_INF, b2 = NEG_INF;   // the group's best, then the best of the rest
        int i1 = 0x7fffffff, i2 = 0x7fffffff;
        for (int e = lane * G; e < (lane + 1) * G; ++e) ds_best(b1, i1, c[e], e);
        for (int e = lane * G; e < (lane + 1) * G; ++e)
            if (e != i1) ds_best(b2, i2, c[e], e);
        gs[lane] = mode == 1 ? __fadd_rn(b1, b2) : b1;
    }
    __syncwarp();
    unsigned int allowed = 0;          // bit g: group g chosen (n_group <= 32)
    for (int j = 0; j < topk_group; ++j) {
        float v = NEG_INF;
        int i = 0x7fffffff;
        if (lane < n_group && !(allowed >> lane & 1u)) {
            v = gs[lane];
            i = lane;
        }
        ds_warp_best(v, i);
        allowed |= 1u << i;
    }
    const float masked = mode == 1 ? NEG_INF : 0.f;
    float w_mine = 0.f;
    int id_mine = 0;
    unsigned int taken[DS_MAX_EXPERTS / 32 / 32 + 1] = {0};   // bit per expert of this lane
    for (int j = 0; j < top_k; ++j) {
        float v = NEG_INF;
        int i = 0x7fffffff;
        for (int e = lane, q = 0; e < E; e += 32, ++q) {
            if (taken[q >> 5] >> (q & 31) & 1u) continue;
            ds_best(v, i, (allowed >> (e / G) & 1u) ? c[e] : masked, e);
        }
        ds_warp_best(v, i);
        if ((i & 31) == lane) {
            const int q = i >> 5;
            taken[q >> 5] |= 1u << (q & 31);
        }
        if (lane == j) {
            id_mine = i;
            w_mine = s[i];
        }
    }
    float total = 0.f;
    if (renormalize) {
        for (int j = 0; j < top_k; ++j)
            total = __fadd_rn(total, __shfl_sync(0xffffffffu, w_mine, j));
    }
    if (lane < top_k) {
        float w = renormalize ? __fdiv_rn(w_mine, __fadd_rn(total, 1e-20f)) : w_mine;
        topk_ids[(long long)t * top_k + lane] = id_mine;
        topk_weights[(long long)t * top_k + lane] = __fmul_rn(w, scale);
    }
}
