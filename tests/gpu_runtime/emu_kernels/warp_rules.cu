// Test kernels for the EmuBackend's warp intrinsics (tests/gpu_runtime/test_emu.py): each
// thread of a block writes what one intrinsic returned to out[threadIdx.x].
//   shuffle: op 0 idx, 1 up, 2 down, 3 xor; value = 1000 * threadIdx.x + 7.
//   votes:   pred[t] per thread -> out[4 t .. 4 t + 3] = ballot, any, all, match_any(pred).
//   reduce:  out[t] = __reduce_add_sync, then min and max (3 entries per thread) of vals.
//   count:   out[t] = __syncthreads_count(pred), __syncthreads_and, __syncthreads_or.
#include <cuda_bf16.h>

extern "C" __global__ void shuffle(int *out, int op, int param, int width) {
    const int t = threadIdx.x;
    const int v = 1000 * t + 7;
    int r;
    if (op == 0) r = __shfl_sync(0xffffffffu, v, param, width);
    else if (op == 1) r = __shfl_up_sync(0xffffffffu, v, (unsigned)param, width);
    else if (op == 2) r = __shfl_down_sync(0xffffffffu, v, (unsigned)param, width);
    else r = __shfl_xor_sync(0xffffffffu, v, param, width);
    out[t] = r;
}

extern "C" __global__ void votes(unsigned int *out, const int *pred) {
    const int t = threadIdx.x;
    const int p = pred[t];
    out[4 * t] = __ballot_sync(0xffffffffu, p);
    out[4 * t + 1] = (unsigned)__any_sync(0xffffffffu, p);
    out[4 * t + 2] = (unsigned)__all_sync(0xffffffffu, p);
    out[4 * t + 3] = __match_any_sync(0xffffffffu, p);
}

extern "C" __global__ void reduce(int *out, const int *vals) {
    const int t = threadIdx.x;
    out[3 * t] = __reduce_add_sync(0xffffffffu, vals[t]);
    out[3 * t + 1] = __reduce_min_sync(0xffffffffu, vals[t]);
    out[3 * t + 2] = __reduce_max_sync(0xffffffffu, vals[t]);
}

extern "C" __global__ void count(int *out, const int *pred) {
    const int t = threadIdx.x;
    out[3 * t] = __syncthreads_count(pred[t]);
    out[3 * t + 1] = __syncthreads_and(pred[t]);
    out[3 * t + 2] = __syncthreads_or(pred[t]);
}

// Half-warp shuffles with their own masks: lanes 0-15 and 16-31 exchange independently.
extern "C" __global__ void half_masks(int *out) {
    const int t = threadIdx.x & 31;
    const unsigned int m = t < 16 ? 0x0000ffffu : 0xffff0000u;
    out[threadIdx.x] = __shfl_xor_sync(m, (int)threadIdx.x, 1);
}
