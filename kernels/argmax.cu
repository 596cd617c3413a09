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
