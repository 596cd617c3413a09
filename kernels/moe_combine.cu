// The weighted sum of a token's k expert outputs (and qwen2_moe's gated shared expert), in
// a fixed order: the token's top-k slot order, never the order in which experts or CTAs ran.
//
//   acc = 0; for s = 0 .. k-1:  acc = acc + w[t, s] * y[t * k + s, c]
//   with a shared expert:       g = shared_gate ? 1 / (1 + expf(-shared_gate[t])) : 1
//                               acc = acc + g * shared[t, c]
//   out[t, c] = bf16(acc)                  (moe_combine)
//   out[t, c] = acc                        (moe_combine_f32: a tensor-parallel rank's
//                                           partial, summed over the ranks before the one
//                                           BF16 rounding; model_engine/tp/moe_shard.py)
// Each * and + is one float32 rounding (__fmul_rn / __fadd_rn: never contracted into an
// FMA, so the twin's float32 numpy arithmetic is the same formula).
// Shapes: expert_out float32 [n_tokens * top_k, hidden] (row t * k + s: slot s of token t,
// written there by moe_gemm_fp32_*), topk_weights float32 [n_tokens, top_k], shared float32
// [n_tokens, hidden] or NULL, shared_gate float32 [n_tokens] (the gate logit x @
// shared_expert_gate^T) or NULL, out bf16 (moe_combine) or float32 (moe_combine_f32)
// [n_tokens, hidden].
// Launch: grid (n_tokens), block MOE_COMBINE_THREADS (256) striding over the row (common.cuh
// row_stride_x8): 8 columns per step as two 128-bit float4 loads per input row and one
// 128-bit store when hidden % 8 == 0 and every pointer is 16-byte aligned, else one column
// per step (same arithmetic). A token's row reads only its own k + 1 rows: its bits never
// depend on the other tokens of the launch. Restrictions: 1 <= top_k, n_tokens, hidden.
#include "common.cuh"

#define MOE_COMBINE_THREADS 256

// One token's row: acc in the order above, handed to store8(c8, acc[8]) / store1(c, acc).
template <typename Store8, typename Store1>
__device__ __forceinline__ void combine_row(const float *y, const float *wt, const float *sh,
                                            float g, int hidden, int top_k, bool vec,
                                            Store8 store8, Store1 store1) {
    row_stride_x8(
        hidden, vec,
        [&](int c8) {
            float acc[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[q] = 0.f;
            for (int s = 0; s < top_k; ++s) {
                const float ws = wt[s];
                const float4 *yv = reinterpret_cast<const float4 *>(y + (long long)s * hidden);
                const float4 a = yv[2 * c8], b = yv[2 * c8 + 1];
                const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(ws, v[q]));
            }
            if (sh) {
                const float4 *sv = reinterpret_cast<const float4 *>(sh);
                const float4 a = sv[2 * c8], b = sv[2 * c8 + 1];
                const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(g, v[q]));
            }
            store8(c8, acc);
        },
        [&](int c) {
            float acc = 0.f;
            for (int s = 0; s < top_k; ++s)
                acc = __fadd_rn(acc, __fmul_rn(wt[s], y[(long long)s * hidden + c]));
            if (sh) acc = __fadd_rn(acc, __fmul_rn(g, sh[c]));
            store1(c, acc);
        });
}

extern "C" __global__ void __launch_bounds__(MOE_COMBINE_THREADS)
moe_combine(bf16 *out, const float *expert_out, const float *topk_weights,
            const float *shared, const float *shared_gate, int n_tokens, int hidden,
            int top_k) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const float *y = expert_out + (long long)t * top_k * hidden;
    const float *sh = shared ? shared + (long long)t * hidden : nullptr;
    const float g = shared_gate ? 1.f / (1.f + expf(-shared_gate[t])) : 1.f;
    bf16 *o = out + (long long)t * hidden;
    const bool vec = (hidden & 7) == 0 && aligned16(expert_out) && aligned16(o) &&
                     (!sh || aligned16(sh));
    combine_row(
        y, topk_weights + (long long)t * top_k, sh, g, hidden, top_k, vec,
        [&](int c8, const float *acc) { reinterpret_cast<bf16x8 *>(o)[c8] = pack8(acc); },
        [&](int c, float acc) { o[c] = f2bf(acc); });
}

extern "C" __global__ void __launch_bounds__(MOE_COMBINE_THREADS)
moe_combine_f32(float *out, const float *expert_out, const float *topk_weights,
                const float *shared, const float *shared_gate, int n_tokens, int hidden,
                int top_k) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const float *y = expert_out + (long long)t * top_k * hidden;
    const float *sh = shared ? shared + (long long)t * hidden : nullptr;
    const float g = shared_gate ? 1.f / (1.f + expf(-shared_gate[t])) : 1.f;
    float *o = out + (long long)t * hidden;
    const bool vec = (hidden & 7) == 0 && aligned16(expert_out) && aligned16(o) &&
                     (!sh || aligned16(sh));
    combine_row(
        y, topk_weights + (long long)t * top_k, sh, g, hidden, top_k, vec,
        [&](int c8, const float *acc) {
            float4 *o4 = reinterpret_cast<float4 *>(o);
            o4[2 * c8] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            o4[2 * c8 + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        },
        [&](int c, float acc) { o[c] = acc; });
}
