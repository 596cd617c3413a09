// Depthwise causal 1-D convolution with a per-sequence state: the short convolution of the
// hybrid linear-attention layers (Qwen3-Next / Qwen3.5 gated DeltaNet over the q|k|v
// channels, Mamba2 over x|B|C), optional bias, optional SiLU.
//
// Per channel c of a sequence whose inputs so far are ... x[-2], x[-1] (held in its state)
// followed by this call's rows x[0 .. len):
//   acc      = sum_{j=0}^{W-1} w[c, j] * x[t - (W-1) + j, c]     (FP32, j ascending, each
//              product and each sum rounded: __fmul_rn / __fadd_rn, no FMA)
//   acc      = acc + bias[c]                                       (when bias != NULL)
//   out[t,c] = bf16(silu ? acc / (1 + expf(-acc)) : acc)
// x rows at negative positions come from the state, or are zero when start_pos[i] == 0 (a
// fresh sequence: the state slot is not read). The state written back holds the last W-1
// inputs of (old state ++ rows), so a prefill split anywhere continues exactly.
//
// Layouts (element strides, BF16 unless noted):
//   x    [n_tokens, x_stride]    channels [0, channels) of each row; the rows of sequence i
//                                are cu_seqlens[i] .. cu_seqlens[i+1] (prefill) or row i
//                                (update: one token per sequence)
//   out  [n_tokens, out_stride]  same channels; must not overlap x
//   w    [channels, W]           HF's depthwise Conv1d weight [channels, 1, W] squeezed
//   bias [channels] or NULL
//   state_pool  slot s at state_pool + s * slot_stride: [W-1, channels], time-major, BF16
//               (row W-2 is the newest input). BF16 because the state is a copy of BF16
//               inputs: lossless, half the bytes of FP32, and time-major rows give the
//               128-bit channel vectors that the activation rows use.
//   slots, cu_seqlens [n_seqs + 1], start_pos [n_seqs]: int32, device memory.
// W (width) in [2, 4]. Distinct sequences must name distinct slots.
//
// Launch (prefill): grid (ceil(channels / (VEC * 128)), n_seqs, n_tiles <= 65535), block 128.
// Thread = VEC adjacent channels of one sequence; block z handles the 64-token tiles z,
// z + n_tiles, ... of its sequence, each tile as a sliding window over its rows (the W-1
// inputs before a tile re-read from x or the state), so any n_tiles is correct and a larger
// one only adds parallelism. Only block z == 0 reads and writes the state (the same thread
// reads a state vector before it writes it): no block touches another's state bytes.
// Launch (update): grid (ceil(channels / (VEC * 128)), n_seqs), block 128.
// VEC = 8 (128-bit loads and stores) when channels, x_stride, out_stride and slot_stride are
// multiples of 8 and every pointer is 16-byte aligned (the _v8 entry points); VEC = 1
// otherwise (_v1). Both give the same bits. No shared memory.
#include "common.cuh"

#define CC_THREADS 128
#define CC_TILE 64

template <int VEC>
__device__ __forceinline__ void load_vec(const bf16 *p, float out[VEC]) {
    if (VEC == 8) {
        unpack8(*reinterpret_cast<const bf16x8 *>(p), out);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) out[e] = bf2f(p[e]);
    }
}

template <int VEC>
__device__ __forceinline__ void store_vec(bf16 *p, const float in[VEC]) {
    if (VEC == 8) {
        *reinterpret_cast<bf16x8 *>(p) = pack8(in);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) p[e] = f2bf(in[e]);
    }
}

// Raw BF16 copy (the state keeps the input bits).
template <int VEC>
__device__ __forceinline__ void copy_vec(bf16 *dst, const bf16 *src) {
    if (VEC == 8) {
        *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) dst[e] = src[e];
    }
}

// The weights of VEC channels, tap-major in registers: wt[j][e] = w[c0 + e, j].
template <int W, int VEC>
__device__ __forceinline__ void load_weights(const bf16 *w, int c0, float wt[W][VEC]) {
    const bf16 *p = w + (long long)c0 * W;
    if (VEC == 8) {
        // 8 channels x W taps = W 16-byte vectors, contiguous (c0 % 8 == 0)
        float f[8 * W];
#pragma unroll
        for (int q = 0; q < W; ++q) unpack8(reinterpret_cast<const bf16x8 *>(p)[q], f + 8 * q);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
#pragma unroll
            for (int j = 0; j < W; ++j) wt[j][e] = f[e * W + j];
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
#pragma unroll
            for (int j = 0; j < W; ++j) wt[j][e] = bf2f(p[e * W + j]);
    }
}

// One output vector from the W-1 previous inputs `win` and the current one `cur`.
template <int W, int VEC>
__device__ __forceinline__ void conv_point(const float wt[W][VEC], const float win[W - 1][VEC],
                                           const float cur[VEC], const float bias_v[VEC],
                                           bool has_bias, int silu, float out[VEC]) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
        float acc = __fmul_rn(wt[0][e], win[0][e]);
#pragma unroll
        for (int j = 1; j < W - 1; ++j) acc = __fadd_rn(acc, __fmul_rn(wt[j][e], win[j][e]));
        acc = __fadd_rn(acc, __fmul_rn(wt[W - 1][e], cur[e]));
        if (has_bias) acc = __fadd_rn(acc, bias_v[e]);
        out[e] = silu ? acc / (1.0f + expf(-acc)) : acc;
    }
}

template <int W, int VEC>
__device__ __forceinline__ void prefill_impl(bf16 *__restrict__ out, int out_stride,
                                             const bf16 *__restrict__ x, int x_stride,
                                             const bf16 *__restrict__ w,
                                             const bf16 *__restrict__ bias, bf16 *state_pool,
                                             long long slot_stride, const int *slots,
                                             const int *cu_seqlens, const int *start_pos,
                                             int channels, int silu) {
    const int c0 = (blockIdx.x * CC_THREADS + threadIdx.x) * VEC;
    if (c0 >= channels) return;   // no barriers in this kernel
    const int seq = blockIdx.y;
    const int row0 = cu_seqlens[seq];
    const int len = cu_seqlens[seq + 1] - row0;
    if (len <= 0) return;          // nothing to do; the state is unchanged
    const bool fresh = start_pos[seq] == 0;
    bf16 *st = state_pool + (long long)slots[seq] * slot_stride + c0;

    float wt[W][VEC], bias_v[VEC];
    load_weights<W, VEC>(w, c0, wt);
    const bool has_bias = bias != nullptr;
#pragma unroll
    for (int e = 0; e < VEC; ++e) bias_v[e] = has_bias ? bf2f(bias[c0 + e]) : 0.f;

    for (int t0 = blockIdx.z * CC_TILE; t0 < len; t0 += gridDim.z * CC_TILE) {
        float win[W - 1][VEC];
#pragma unroll
        for (int j = 0; j < W - 1; ++j) {
            const int pos = t0 - (W - 1) + j;    // position relative to this call's row 0
            if (pos >= 0) {
                load_vec<VEC>(x + (long long)(row0 + pos) * x_stride + c0, win[j]);
            } else if (fresh) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) win[j][e] = 0.f;
            } else {
                load_vec<VEC>(st + (long long)(W - 1 + pos) * channels, win[j]);
            }
        }
        const int t1 = min(len, t0 + CC_TILE);
        for (int t = t0; t < t1; ++t) {
            float cur[VEC], y[VEC];
            load_vec<VEC>(x + (long long)(row0 + t) * x_stride + c0, cur);
            conv_point<W, VEC>(wt, win, cur, bias_v, has_bias, silu, y);
            store_vec<VEC>(out + (long long)(row0 + t) * out_stride + c0, y);
#pragma unroll
            for (int j = 0; j < W - 2; ++j)
#pragma unroll
                for (int e = 0; e < VEC; ++e) win[j][e] = win[j + 1][e];
#pragma unroll
            for (int e = 0; e < VEC; ++e) win[W - 2][e] = cur[e];
        }
    }

    if (blockIdx.z != 0) return;
    // The new state: inputs at positions len-(W-1) .. len-1 of (old state ++ rows). Rows of
    // the old state that stay (a call shorter than W-1) move up; the loop runs upwards, so
    // each read of an old row (index j + len > j) happens before that row is overwritten,
    // and every access is this thread's own VEC channels.
#pragma unroll
    for (int j = 0; j < W - 1; ++j) {
        const int pos = len - (W - 1) + j;
        bf16 *dst = st + (long long)j * channels;
        if (pos >= 0) {
            copy_vec<VEC>(dst, x + (long long)(row0 + pos) * x_stride + c0);
        } else if (fresh) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) dst[e] = f2bf(0.f);
        } else {
            copy_vec<VEC>(dst, st + (long long)(W - 1 + pos) * channels);
        }
    }
}

template <int W, int VEC>
__device__ __forceinline__ void update_impl(bf16 *__restrict__ out, int out_stride,
                                            const bf16 *__restrict__ x, int x_stride,
                                            const bf16 *__restrict__ w,
                                            const bf16 *__restrict__ bias, bf16 *state_pool,
                                            long long slot_stride, const int *slots,
                                            int channels, int silu) {
    const int c0 = (blockIdx.x * CC_THREADS + threadIdx.x) * VEC;
    if (c0 >= channels) return;
    const int seq = blockIdx.y;
    bf16 *st = state_pool + (long long)slots[seq] * slot_stride + c0;
    float wt[W][VEC], bias_v[VEC], win[W - 1][VEC], cur[VEC], y[VEC];
    load_weights<W, VEC>(w, c0, wt);
    const bool has_bias = bias != nullptr;
#pragma unroll
    for (int e = 0; e < VEC; ++e) bias_v[e] = has_bias ? bf2f(bias[c0 + e]) : 0.f;
#pragma unroll
    for (int j = 0; j < W - 1; ++j) load_vec<VEC>(st + (long long)j * channels, win[j]);
    const bf16 *xr = x + (long long)seq * x_stride + c0;
    load_vec<VEC>(xr, cur);
    conv_point<W, VEC>(wt, win, cur, bias_v, has_bias, silu, y);
    store_vec<VEC>(out + (long long)seq * out_stride + c0, y);
    // shift: row j <- row j + 1 (read before written, this thread's channels), newest = x
#pragma unroll
    for (int j = 0; j < W - 2; ++j)
        copy_vec<VEC>(st + (long long)j * channels, st + (long long)(j + 1) * channels);
    copy_vec<VEC>(st + (long long)(W - 2) * channels, xr);
}

#define CC_DISPATCH(FN, VEC, ...)                         \
    switch (width) {                                      \
    case 2: FN<2, VEC>(__VA_ARGS__); break;               \
    case 3: FN<3, VEC>(__VA_ARGS__); break;               \
    default: FN<4, VEC>(__VA_ARGS__); break;              \
    }

// (min 4 CTAs per SM: without that hint ptxas spilled 8 bytes in the scalar prefill on sm_80)
#define CC_PREFILL(NAME, VEC)                                                               \
    extern "C" __global__ void __launch_bounds__(CC_THREADS, 4)                             \
    NAME(bf16 *out, int out_stride, const bf16 *x, int x_stride, const bf16 *w,             \
         const bf16 *bias, bf16 *state_pool, long long slot_stride, const int *slots,       \
         const int *cu_seqlens, const int *start_pos, int channels, int width, int silu) {  \
        CC_DISPATCH(prefill_impl, VEC, out, out_stride, x, x_stride, w, bias, state_pool,   \
                    slot_stride, slots, cu_seqlens, start_pos, channels, silu)              \
    }

#define CC_UPDATE(NAME, VEC)                                                                \
    extern "C" __global__ void __launch_bounds__(CC_THREADS)                                \
    NAME(bf16 *out, int out_stride, const bf16 *x, int x_stride, const bf16 *w,             \
         const bf16 *bias, bf16 *state_pool, long long slot_stride, const int *slots,       \
         int channels, int width, int silu) {                                               \
        CC_DISPATCH(update_impl, VEC, out, out_stride, x, x_stride, w, bias, state_pool,    \
                    slot_stride, slots, channels, silu)                                     \
    }

CC_PREFILL(causal_conv1d_prefill_v8, 8)
CC_PREFILL(causal_conv1d_prefill_v1, 1)
CC_UPDATE(causal_conv1d_update_v8, 8)
CC_UPDATE(causal_conv1d_update_v1, 1)
