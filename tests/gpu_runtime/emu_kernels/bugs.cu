// Kernels with the bugs the EmuBackend must report or expose (tests/gpu_runtime/test_emu.py).
#include <cuda_bf16.h>

// threads of one block wait at two different __syncthreads
extern "C" __global__ void divergent_barrier(int *out) {
    if (threadIdx.x < 32) {
        __syncthreads();
        out[threadIdx.x] = 1;
    } else {
        __syncthreads();
        out[threadIdx.x] = 2;
    }
}

// lane 0 returns, the others shuffle with a mask that still names it
extern "C" __global__ void exited_lane(int *out) {
    if (threadIdx.x == 0) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

// lane 0 waits at the block barrier while the rest of its warp waits for it at a shuffle
extern "C" __global__ void warp_vs_block(int *out) {
    if (threadIdx.x == 0) {
        __syncthreads();
        return;
    }
    out[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
}

// lanes of one warp call different intrinsics with the same mask
extern "C" __global__ void divergent_warp(int *out) {
    const int t = threadIdx.x;
    out[t] = (t & 1) ? __shfl_xor_sync(0xffffffffu, t, 1) : (int)__ballot_sync(0xffffffffu, t);
}

// a shuffle reading a lane outside its mask
extern "C" __global__ void outside_mask(int *out) {
    const int t = threadIdx.x;
    if (t < 16) out[t] = __shfl_sync(0x0000ffffu, t, 20);
}

// a block sum that forgot the barrier between writing and reading shared memory: the
// result depends on the order in which the threads run
extern "C" __global__ void racy_sum(float *out, const float *x) {
    __shared__ float part[64];
    part[threadIdx.x] = x[threadIdx.x];
    float s = 0.f;
    if (threadIdx.x == 0)
        for (int i = 0; i < 64; ++i) s += part[i];
    __syncthreads();
    if (threadIdx.x == 0) out[0] = s;
}

// the same with the barrier: order-independent
extern "C" __global__ void correct_sum(float *out, const float *x) {
    __shared__ float part[64];
    part[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (int i = 0; i < 64; ++i) s += part[i];
        out[0] = s;
    }
}

// unwritten shared memory reads as 0xFF bytes (NaN), static and dynamic alike
extern "C" __global__ void unwritten_shared(unsigned int *out) {
    __shared__ unsigned int s_static[4];
    extern __shared__ unsigned int s_dynamic[];
    if (threadIdx.x == 0) {
        out[0] = s_static[1];
        out[1] = s_dynamic[0];
    }
}

// __trap() stops the launch with a diagnostic
extern "C" __global__ void traps(int *out) {
    if (threadIdx.x == 5) __trap();
    out[threadIdx.x] = 1;
}

// reads x[n] (one element past the end): AddressSanitizer must name this line
extern "C" __global__ void read_past_end(float *out, const float *x, int n) {
    if (threadIdx.x == 0) out[0] = x[n];
}

// reads dynamic shared memory one float past what the launch asked for
extern "C" __global__ void shared_past_end(float *out, int n) {
    extern __shared__ float s[];
    if (threadIdx.x == 0) {
        for (int i = 0; i < n; ++i) s[i] = 1.f;
        out[0] = s[n];
    }
}

// parameter types the launch check knows
extern "C" __global__ void typed(float *out, const __nv_bfloat16 *x, int a, unsigned int b,
                                 long long c, float d) {
    out[0] = (float)a + (float)b + (float)c + d + __bfloat162float(x[0]);
}
