// Kernels with the bugs the EmuBackend's checks must report (tests/gpu_runtime/
// test_emu_checks.py), each next to a correct twin the checks must pass, and kernels whose
// hardware counters are known in closed form.
#include "mma.cuh"

// ---- shared-memory races ----------------------------------------------------------------
// Warp-synchronous exchange through shared memory: lane l writes s[l], reads s[l ^ 1].
// mode 0: nothing between (a race), 1: a __shfl_sync between (still a race: shuffles give
// no memory ordering), 2: __syncwarp() between (correct), 3: __syncthreads() (correct).
extern "C" __global__ void warp_exchange(int *out, int mode) {
    __shared__ int s[64];
    const int t = threadIdx.x;
    s[t] = 10 * t;
    int dummy = t;
    if (mode == 1) dummy = __shfl_xor_sync(0xffffffffu, dummy, 1);
    if (mode == 2) __syncwarp();
    if (mode == 3) __syncthreads();
    out[t] = s[t ^ 1] + (dummy - dummy);
}

// Two lanes of a warp write the same word (write after write) unless `distinct`.
extern "C" __global__ void same_word(int *out, int distinct) {
    __shared__ int s[32];
    s[distinct ? threadIdx.x : 0] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x];
}

// A refill of a buffer the other warp may still read (write after read) unless `barrier`.
extern "C" __global__ void refill_without_barrier(float *out, const float *x, int barrier) {
    __shared__ float s[64];
    const int t = threadIdx.x;
    s[t] = x[t];
    __syncthreads();
    float v = s[63 - t];
    if (barrier) __syncthreads();
    s[t] = x[64 + t];
    __syncthreads();
    out[t] = v + s[63 - t];
}

// cp.async: a thread reads what another thread's copy brought in. mode 0: after the
// issuer's wait but with no barrier (a race), 1: after wait + barrier (correct), 2: the
// issuer reads its own destination before waiting.
extern "C" __global__ void cp_async_visibility(float *out, const float *x, int mode) {
    __shared__ __align__(16) float s[128];
    const int t = threadIdx.x;
    cp_async_16(&s[4 * t], x + 4 * t, 16);
    cp_async_commit();
    if (mode == 2) out[t] = s[4 * t];
    cp_async_wait<0>();
    if (mode == 1) __syncthreads();
    out[t] = s[4 * ((t + 1) % 32)];
}

// Shared-memory atomics from every thread: never a race.
extern "C" __global__ void shared_histogram(int *out, const int *x) {
    __shared__ int hist[8];
    if (threadIdx.x < 8) hist[threadIdx.x] = 0;
    __syncthreads();
    atomicAdd(&hist[x[threadIdx.x] & 7], 1);
    __syncthreads();
    if (threadIdx.x < 8) out[threadIdx.x] = hist[threadIdx.x];
}

// ---- global memory across blocks ----------------------------------------------------------
// mode 0: every block writes out[i] for its own i (correct); 1: every block also writes
// out[0] (write after write); 2: block b reads out[b - 1], which block b - 1 writes (read
// after write, or write after read: the result depends on the block order).
extern "C" __global__ void blocks_overlap(int *out, int mode) {
    const int b = blockIdx.x;
    if (threadIdx.x != 0) return;
    if (mode == 2) {
        out[b] = (b ? out[b - 1] : 0) + 1;
        return;
    }
    out[b] = b;
    if (mode == 1) out[0] = b;
}

// ---- alignment -----------------------------------------------------------------------------
// 16-byte loads of x + offset elements (bf16): misaligned unless offset % 8 == 0; 8-byte
// stores to out + out_offset floats: misaligned unless out_offset is even.
extern "C" __global__ void vector_access(float *out, const bf16 *x, int offset, int out_offset) {
    const uint4 v = *reinterpret_cast<const uint4 *>(x + offset + 8 * threadIdx.x);
    *reinterpret_cast<float2 *>(out + out_offset + 2 * threadIdx.x) =
        make_float2(bf_lo(v.x), bf_hi(v.w));
}

// A 16-byte shared-memory load at a 4-byte offset.
extern "C" __global__ void misaligned_shared(float *out, int offset) {
    __shared__ __align__(16) float s[64];
    s[threadIdx.x] = 1.f;
    __syncthreads();
    const float4 v = *reinterpret_cast<const float4 *>(s + offset);
    out[threadIdx.x] = v.x + v.w;
}

// ---- launch bounds and guard bytes -------------------------------------------------------
extern "C" __global__ void __launch_bounds__(64) bounded(int *out) { out[threadIdx.x] = 1; }

// Writes out[n] (one element past the end) when `past` (a stray write into the padding).
extern "C" __global__ void write_past(float *out, int n, int past) {
    if (threadIdx.x < n) out[threadIdx.x] = 1.f;
    if (past && threadIdx.x == 0) out[n + past - 1] = 2.f;
}

// ---- counters ----------------------------------------------------------------------------
// Each thread loads one float at x[stride * t] and stores it to y[t]. stride 1: 4 sectors
// per warp request (128 B); stride 8: 32 sectors (each lane in its own sector).
extern "C" __global__ void strided_copy(float *y, const float *x, int stride) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    y[t] = x[(long long)stride * t];
}

// Every lane reads the same float: one sector per request, as efficient as it gets.
extern "C" __global__ void broadcast_load(float *y, const float *x) {
    y[blockIdx.x * blockDim.x + threadIdx.x] = x[blockIdx.x];
}

// 16-byte loads and stores: 16 sectors per warp request, 100% efficient.
extern "C" __global__ void vector_copy(uint4 *y, const uint4 *x) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    y[t] = x[t];
}

// One warp; lane l reads s[stride * l] (4 bytes): a stride of 32 words puts every lane in
// bank 0 (32-way conflict: 32 wavefronts), stride 1 none, stride 2 a 2-way conflict.
extern "C" __global__ void bank_stride(float *out, int stride) {
    __shared__ float s[32 * 33];
    for (int i = threadIdx.x; i < 32 * 33; i += 32) s[i] = (float)i;
    __syncthreads();
    out[threadIdx.x] = s[stride * threadIdx.x];
}

// ldmatrix.x4 from rows of 64 bytes: matrix i is chunk i of rows 0-7. Unswizzled, the four
// even rows share banks, as do the four odd ones (4 wavefronts per matrix instead of 1);
// `swizzle` stores chunk c of row r at chunk c ^ ((r / 2) % 4), spreading them over 32 banks.
extern "C" __global__ void ldmatrix_banks(unsigned int *out, int swizzle) {
    __shared__ __align__(16) unsigned short s[32][32];
    const int lane = threadIdx.x;
    for (int i = lane; i < 32 * 32; i += 32) (&s[0][0])[i] = (unsigned short)i;
    __syncthreads();
    const int row = lane % 8, chunk = lane / 8;
    const int c = swizzle ? (chunk ^ ((row >> 1) & 3)) : chunk;
    unsigned int r[4];
    ldmatrix_x4(r, &s[row][8 * c]);
    out[lane] = r[0] ^ r[1] ^ r[2] ^ r[3];
}

// Counts: `iters` mma.sync per warp, `iters` __syncthreads, one __syncwarp per warp.
extern "C" __global__ void mma_loop(float *out, int iters) {
    unsigned int a[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u};
    unsigned int b[2] = {0x3f803f80u, 0x3f803f80u};
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < iters; ++i) {
        mma_bf16_16816(acc, a, b, acc);
        __syncthreads();
    }
    __syncwarp();
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc[0];
}
