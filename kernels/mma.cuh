// Tensor-core building blocks for sm_80+ kernels: the BF16 m16n8k16 MMA with FP32
// accumulation, ldmatrix (8x8 b16 tiles from shared memory into MMA fragments) and cp.async
// (global -> shared copies that bypass registers, in commit groups).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16; lane = 4 * group + tig):
//   A 16x16 row-major: a[0] = A[group][2tig,2tig+1], a[1] = A[group+8][2tig..], a[2] =
//     A[group][2tig+8..], a[3] = A[group+8][2tig+8..] (low half = first element);
//   B 16x8 (k x n): b[0] = B[2tig,2tig+1][group], b[1] = B[2tig+8, 2tig+9][group];
//   C/D 16x8 FP32: c[0], c[1] = C[group][2tig, 2tig+1]; c[2], c[3] = C[group+8][...].
//   ldmatrix_x4 of the 16x16 A tile whose row r starts at `row(r)` (lanes 0-15 pass rows
//   0-15 at column 0, lanes 16-31 rows 0-15 at column 8) yields exactly a[0..3]; for B stored
//   n-major (W[n][k], the nn.Linear layout) the non-transposed ldmatrix yields b[] directly.
// Every device-only instruction sits in an #ifdef __CUDA_ARCH__ branch; the #else branch is
// the EmuBackend's implementation of the same instruction (metrale/gpu_runtime/emu/
// tensor_core.h), so kernels using these run on the CPU emulator unchanged.
#pragma once
#include "common.cuh"

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned int (&a)[4],
                                               const unsigned int (&b)[2], const float (&c)[4]) {
#ifdef __CUDA_ARCH__
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    emu::mma_m16n8k16_bf16(d, a, b, c);
#endif
}

// Four 8x8 b16 matrices; this lane passes the address of one row (lane / 8 = which matrix).
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], const void *smem_row) {
#ifdef __CUDA_ARCH__
    const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem_row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
#else
    emu::ldmatrix(r, smem_row, 4, false);
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], const void *smem_row) {
#ifdef __CUDA_ARCH__
    const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem_row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
#else
    emu::ldmatrix(r, smem_row, 4, true);
#endif
}

__device__ __forceinline__ void ldmatrix_x2(unsigned int (&r)[2], const void *smem_row) {
#ifdef __CUDA_ARCH__
    const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem_row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(s));
#else
    emu::ldmatrix(r, smem_row, 2, false);
#endif
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned int (&r)[2], const void *smem_row) {
#ifdef __CUDA_ARCH__
    const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem_row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(s));
#else
    emu::ldmatrix(r, smem_row, 2, true);
#endif
}

// 16 bytes global -> shared, bypassing L1 (.cg); only the first src_bytes (0..16) are read,
// the rest of the 16 is zero-filled (so out-of-range rows become zeros without a branch).
__device__ __forceinline__ void cp_async_16(void *smem, const void *gmem, int src_bytes) {
#ifdef __CUDA_ARCH__
    const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
                 "r"(src_bytes));
#else
    emu::cp_async(smem, gmem, 16u, static_cast<unsigned int>(src_bytes));
#endif
}

// N (4, 8 or 16) bytes global -> shared: 16 as cp_async_16 (.cg), 4 and 8 through L1
// (.ca: .cg takes 16 bytes only); src_bytes (0..N) as above. Both addresses N-byte aligned.
template <int N>
__device__ __forceinline__ void cp_async_n(void *smem, const void *gmem, int src_bytes) {
    static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
    if constexpr (N == 16) {
        cp_async_16(smem, gmem, src_bytes);
    } else {
#ifdef __CUDA_ARCH__
        const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(gmem),
                     "n"(N), "r"(src_bytes));
#else
        emu::cp_async(smem, gmem, static_cast<unsigned int>(N),
                      static_cast<unsigned int>(src_bytes));
#endif
    }
}

// A hint: bring the L1 line holding `gmem` in now (a later __ldg of it then hits L1). No
// effect on any value; a no-op on the EmuBackend.
__device__ __forceinline__ void prefetch_l1(const void *gmem) {
#ifdef __CUDA_ARCH__
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(gmem));
#else
    (void)gmem;
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.commit_group;\n" ::);
#else
    emu::cp_async_commit();
#endif
}

// Wait until at most `N` of this thread's most recent committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
    emu::cp_async_wait(N);
#endif
}
