// Test kernels for the EmuBackend's tensor-core instructions (tests/gpu_runtime/test_emu.py).
// Fragments are built here straight from the PTX ISA's tables, independently of the
// emulator, so a wrong index on either side shows up against numpy.
#include "mma.cuh"

// One warp: D[16x8] = A[16x16] @ B[16x8] + C, with B given as Bt [8][16] (n-major).
extern "C" __global__ void mma_direct(float *d, const bf16 *a, const bf16 *bt, const float *c) {
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    auto pair = [](const bf16 *p) {
        return (unsigned int)__bfloat16_as_ushort(p[0]) |
               ((unsigned int)__bfloat16_as_ushort(p[1]) << 16);
    };
    const unsigned int af[4] = {pair(a + g * 16 + 2 * t), pair(a + (g + 8) * 16 + 2 * t),
                                pair(a + g * 16 + 2 * t + 8), pair(a + (g + 8) * 16 + 2 * t + 8)};
    const unsigned int bf[2] = {pair(bt + g * 16 + 2 * t), pair(bt + g * 16 + 2 * t + 8)};
    const float cf[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                         c[(g + 8) * 8 + 2 * t + 1]};
    float df[4];
    mma_bf16_16816(df, af, bf, cf);
    d[g * 8 + 2 * t] = df[0];
    d[g * 8 + 2 * t + 1] = df[1];
    d[(g + 8) * 8 + 2 * t] = df[2];
    d[(g + 8) * 8 + 2 * t + 1] = df[3];
}

// Four 8x8 matrices m[4][8][8] (b16) through shared memory and ldmatrix_x4(_trans):
// out[lane][i] = the register lane receives for matrix i.
extern "C" __global__ void ldmatrix_check(unsigned int *out, const unsigned short *m, int trans) {
    __shared__ __align__(16) unsigned short s[4][8][8];
    const int lane = threadIdx.x;
    for (int i = lane; i < 256; i += 32) (&s[0][0][0])[i] = m[i];
    __syncthreads();
    unsigned int r[4];
    if (trans) ldmatrix_x4_trans(r, &s[lane / 8][lane % 8][0]);
    else ldmatrix_x4(r, &s[lane / 8][lane % 8][0]);
    for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// A small tensor-core GEMM in the nn.Linear layout, y[m, n] = x[m, k] @ w[n, k]^T (FP32 out):
// one warp per 16x8 tile, k in steps of 16 through cp.async -> shared -> ldmatrix -> mma,
// double-buffered. m % 16 == 0, n % 8 == 0, k % 16 == 0.
extern "C" __global__ void tc_gemm(float *y, const bf16 *x, const bf16 *w, int m, int n, int k) {
    __shared__ __align__(16) bf16 sa[2][16][16];
    __shared__ __align__(16) bf16 sb[2][8][16];
    const int lane = threadIdx.x, row0 = blockIdx.y * 16, col0 = blockIdx.x * 8;
    auto load = [&](int buf, int k0) {
        // A: 16 rows x 32 bytes = 32 chunks of 16 B, one per lane; B: 8 rows x 32 B = 16
        cp_async_16(&sa[buf][lane / 2][8 * (lane % 2)], x + (long long)(row0 + lane / 2) * k + k0 + 8 * (lane % 2), 16);
        if (lane < 16)
            cp_async_16(&sb[buf][lane / 2][8 * (lane % 2)], w + (long long)(col0 + lane / 2) * k + k0 + 8 * (lane % 2), 16);
        cp_async_commit();
    };
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    load(0, 0);
    for (int kt = 0; kt < k / 16; ++kt) {
        if (kt + 1 < k / 16) {
            load((kt + 1) & 1, (kt + 1) * 16);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int buf = kt & 1;
        unsigned int a[4], b[2];
        ldmatrix_x4(a, &sa[buf][lane % 16][8 * (lane / 16)]);
        ldmatrix_x2(b, &sb[buf][lane % 8][8 * ((lane / 8) % 2)]);
        mma_bf16_16816(acc, a, b, acc);
        __syncthreads();
    }
    const int g = lane >> 2, t = lane & 3;
    y[(long long)(row0 + g) * n + col0 + 2 * t] = acc[0];
    y[(long long)(row0 + g) * n + col0 + 2 * t + 1] = acc[1];
    y[(long long)(row0 + g + 8) * n + col0 + 2 * t] = acc[2];
    y[(long long)(row0 + g + 8) * n + col0 + 2 * t + 1] = acc[3];
}

// Reads shared memory filled by cp.async before and after waiting for it.
extern "C" __global__ void cp_async_early_read(float *out, const float *src) {
    __shared__ __align__(16) float s[4];
    cp_async_16(s, src, 16);
    cp_async_commit();
    out[0] = s[0];  // not yet arrived: the 0xFF fill
    cp_async_wait<0>();
    out[1] = s[0];
    cp_async_16(s, src, 8);  // zfill: 8 bytes copied, 8 zeroed
    cp_async_commit();
    cp_async_wait<0>();
    out[2] = s[1];
    out[3] = s[2];
}

// Bugs: a copy never waited for; ldmatrix from global memory; cp.async into global memory.
extern "C" __global__ void cp_async_never_waited(const float *src) {
    __shared__ __align__(16) float s[4];
    cp_async_16(s, src, 16);
    cp_async_commit();
}

extern "C" __global__ void ldmatrix_from_global(unsigned int *out, const unsigned short *m) {
    unsigned int r[4];
    ldmatrix_x4(r, m + 8 * threadIdx.x);
    out[threadIdx.x] = r[0];
}

extern "C" __global__ void cp_async_to_global(float *dst, const float *src) {
    cp_async_16(dst, src, 16);
    cp_async_commit();
    cp_async_wait<0>();
}

// Two warps refill a shared buffer with cp.async each iteration and read the other warp's
// part after a barrier. With `barrier` = 0 the barrier that keeps a refill from overwriting
// what the other warp has not read yet is missing: out[t] depends on the thread order.
extern "C" __global__ void refill(float *out, const float *src, int barrier) {
    __shared__ __align__(16) float buf[64 * 4];
    const int t = threadIdx.x;
    float acc = 0.f;
    for (int it = 0; it < 4; ++it) {
        if (barrier) __syncthreads();
        cp_async_16(&buf[4 * t], src + it * 256 + 4 * t, 16);
        cp_async_commit();
        acc = __shfl_xor_sync(0xffffffffu, acc, 0);  // warp-collective work in flight
        cp_async_wait<0>();
        __syncthreads();
        acc += buf[4 * ((t + 32) % 64)];
        acc = __shfl_xor_sync(0xffffffffu, acc, 0);
    }
    out[t] = acc;
}
