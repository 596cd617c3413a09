// The activations of the gated MLP (act codes of ops/activation.py), shared by act_mul
// (kernels/activation.cu) and the decode GEMM that applies act(gate) * up to its X tiles
// (kernels/gemm_tc.cu, gemm_tc_bf16_16x16_actmul_res): one definition, so both give the
// same bits. FP32 math; expf/tanhf take the fast-math hardware paths, erff is precise.
#pragma once
#include "common.cuh"

#define ACT_SILU 0
#define ACT_GELU 1
#define ACT_GELU_TANH 2
#define ACT_RELU 3
#define ACT_QUICK_GELU 4
#define ACT_SWIGLU_CLAMP 5   // act_mul only (activation.cu): gpt-oss's clamped SwiGLU

__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }

__device__ __forceinline__ float gelu_f(float x, int mode) {
    if (mode == 0) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    if (mode == 1) {
        const float inner = 0.79788456080286536f * (x + 0.044715f * x * x * x);
        return 0.5f * x * (1.0f + tanhf(inner));
    }
    return x / (1.0f + expf(-1.702f * x));
}

// act(g) of a gated MLP; the branch is uniform across the grid (one `act` per launch).
__device__ __forceinline__ float gated_act_f(float g, int act) {
    switch (act) {
    case ACT_SILU: return silu_f(g);
    case ACT_GELU: return gelu_f(g, 0);
    case ACT_GELU_TANH: return gelu_f(g, 1);
    case ACT_RELU: return g < 0.0f ? 0.0f : g;  // NaN stays NaN, as torch.relu
    case ACT_QUICK_GELU: return gelu_f(g, 2);
    default: return __int_as_float(0x7fc00000);
    }
}
