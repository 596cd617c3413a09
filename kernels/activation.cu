// Activations, FP32 math, one RNE rounding to BF16 per stored element.
//
//   act_mul:  out[r, c] = bf16( act(g) * u ),  g = gate_up[r, c], u = gate_up[r, I + c],
//             gate_up [n_rows, 2*I] (the fused gate_up projection: gate columns first, then
//             up), out [n_rows, I]. act by `act` (the ACT_* codes below, ops/activation.py):
//             0 silu g / (1 + exp(-g)); 1 gelu (erf) 0.5 g (1 + erf(g/sqrt2));
//             2 gelu tanh 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))); 3 relu (g < 0 ? 0 : g);
//             4 quick_gelu g * sigmoid(1.702 g); 5 swiglu_clamp (gpt-oss's experts, with
//             alpha and limit): g' = min(g, limit), u' = clamp(u, -limit, limit),
//             out = bf16((u' + 1) * (g' * sigmoid(alpha * g'))), sigmoid = 1 / (1 + exp(-x)).
//             An unknown code gives NaN rows. alpha and limit are read by code 5 only.
//   gelu:     out[i] = bf16( gelu(x[i]) ),  x, out [n]; mode 0 "none": 0.5 x (1 + erf(x/sqrt2)),
//             1 "tanh": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
//             2 "quick": x * sigmoid(1.702 x)  (CLIP's quick_gelu).
//
// Rounding choice: HF computes act(gate) in BF16 and then multiplies (two roundings);
// like vLLM/TensorRT-LLM we round once (the brief's contract); the difference is <= 1 ulp.
//
// act_mul launch: grid (n_rows, col_blocks), block ACT_THREADS (256); the col_blocks blocks
//   of a row stride over it together (chunk / element c = blockIdx.y * 256 + threadIdx.x,
//   step col_blocks * 256), col_blocks = min(ceil(ceil(I / 8) / 256), 65535): a decode row
//   of I = 14336 is 7 blocks, not one block on one SM (the EmuBackend's counters found a
//   batch-1 row drawing one SM's share of the bandwidth). Vector path (8 bf16 per 128-bit
//   access) when I % 8 == 0 and both pointers are 16-byte aligned, else one element per
//   access. Any I >= 1.
// gelu launch: 1-D grid-stride (common.cuh's grid_stride_x8), block 256, grid
//   min(ceil(ceil(n/8)/256), 8192); vector path when both pointers are 16-byte aligned, the
//   last n % 8 elements one by one. in-place (out == x) is allowed.
// Fast-math: expf/tanhf use the approximate hardware paths (--use_fast_math); the error is
// far below one BF16 ulp. erff is precise.
#include "activation.cuh"

#define ACT_THREADS 256

extern "C" __global__ void __launch_bounds__(ACT_THREADS)
act_mul(bf16 *out, const bf16 *gate_up, int n_rows, int intermediate, int act, float alpha,
        float limit) {
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const bf16 *g = gate_up + (long long)r * 2 * intermediate;
    const bf16 *u = g + intermediate;
    bf16 *o = out + (long long)r * intermediate;
    const bf16x8 *gv = reinterpret_cast<const bf16x8 *>(g);
    const bf16x8 *uv = reinterpret_cast<const bf16x8 *>(u);
    bf16x8 *ov = reinterpret_cast<bf16x8 *>(o);
    const int first = blockIdx.y * ACT_THREADS + threadIdx.x, step = gridDim.y * ACT_THREADS;
    if (act == ACT_SWIGLU_CLAMP) {   // the up branch enters the formula: its own path
        for (int c = first; c < intermediate; c += step) {
            const float gc = fminf(bf2f(g[c]), limit);
            const float uc = fminf(fmaxf(bf2f(u[c]), -limit), limit);
            o[c] = f2bf((uc + 1.0f) * (gc / (1.0f + expf(-alpha * gc))));
        }
        return;
    }
    if ((intermediate & 7) == 0 && aligned16(g) && aligned16(o)) {
        for (int c = first; c < (intermediate >> 3); c += step)
            ov[c] = map8(gv[c], uv[c], [&](float g, float u) { return gated_act_f(g, act) * u; });
    } else {
        for (int c = first; c < intermediate; c += step)
            o[c] = f2bf(gated_act_f(bf2f(g[c]), act) * bf2f(u[c]));
    }
}

extern "C" __global__ void __launch_bounds__(ACT_THREADS)
gelu(bf16 *out, const bf16 *x, int n, int mode) {
    const bf16x8 *xv = reinterpret_cast<const bf16x8 *>(x);
    bf16x8 *ov = reinterpret_cast<bf16x8 *>(out);
    grid_stride_x8(
        n, aligned16(out) && aligned16(x),
        [&](long long i) { ov[i] = map8(xv[i], [&](float a) { return gelu_f(a, mode); }); },
        [&](long long i) { out[i] = f2bf(gelu_f(bf2f(x[i]), mode)); });
}
