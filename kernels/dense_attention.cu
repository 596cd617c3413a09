// Dense (non-paged) multi-head attention of one sequence: encoder self-attention, decoder
// cross-attention over precomputed K/V, and causal attention over a contiguous KV buffer.
//
//   q   [n_q] rows, row stride q_stride elements; head h at h*D (H query heads)
//   k,v [n_kv] rows, row stride kv_stride elements; kv head g at g*D (KV heads, H % KV == 0,
//       query head h uses kv head h / (H/KV))
//   out [n_q, H*D] bf16, contiguous
//   out[i, h] = softmax_j((q_i . k_j) * scale) v_j over keys j < n_kv, and with causal also
//   j <= q_offset + i (query row i sits at absolute position q_offset + i).
// Scores are in base 2: s = (q.k) * scale * log2(e), p = exp2(s - m), fp32 throughout; only
// the output is rounded (once) to bf16.
//
// Launch: grid (ceil(n_q/BQ), H), block 128 (4 warps, launch bounds 128x4), dynamic shared
// memory D*(4*BQ + 128) bytes. Entry points dense_attention_p{1,2,4}_v{8,2}: pN = pairs of
// dims per lane = ceil(D/64) (p1/p2: D <= 128, BQ = 32, 8 rows per warp; p4: D <= 256,
// BQ = 16, 4 rows per warp); v8 = 128-bit loads of q/k/v (D, q_stride, kv_stride multiples
// of 8, q/k/v 16-byte aligned), v2 = 32-bit loads otherwise.
// Flash-attention style, the tile code of attention_tile.cuh (shared with prefill_attention):
// per 32-key tile, K (stored transposed as bf16 pairs, XOR-swizzled) and V go to shared
// memory; lane j scores key j for all rows of its warp; online softmax per row with the
// running max/sum in registers; lane l accumulates output pairs l, l+32, ... The 128-bit
// (v8) loads of Q and K/V are this file's own; the 32-bit (v2) ones are the shared ones.
// Key tiles start at key 0 and are 32 wide whatever n_q is, so a row's result does not
// depend on n_q or on which CTA computes it (a decode step over a KV buffer equals the same
// row of a whole-prefix pass).
// Restrictions (checked by the launcher): D even, 2 <= D <= 256; H % KV == 0; n_q, n_kv >= 1;
// q_offset >= 0; strides even and >= the heads they hold; pointers 4-byte aligned.
#include "attention_tile.cuh"
#include "common.cuh"

template <int MAXP, int VEC>
__device__ __forceinline__ void dense_impl(bf16 *__restrict__ out, const bf16 *__restrict__ q,
                                           const bf16 *__restrict__ k,
                                           const bf16 *__restrict__ v, int n_q, int n_kv,
                                           int H, int KV, int D, int q_stride, int kv_stride,
                                           float scale, int causal, int q_offset) {
    constexpr int RT = tile_rows<MAXP>();  // query rows per warp
    constexpr int BQ = RT * ATT_TILE_WARPS;
    extern __shared__ __align__(16) float smem[];
    const int DP = D >> 1;                  // bf16 pairs per row
    float *sQ = smem;                       // [BQ][D] fp32
    unsigned int *sK = reinterpret_cast<unsigned int *>(sQ + BQ * D);  // [DP][32] swizzled
    unsigned int *sV = sK + DP * 32;        // [32][DP]

    const int h = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kvh = h / (H / KV);
    const int r0 = blockIdx.x * BQ;
    if (r0 >= n_q) return;
    const int rows_here = min(BQ, n_q - r0);
    // keys [0, kv_hi) are needed by some row of this tile
    const int kv_hi = causal ? min(n_kv, q_offset + r0 + rows_here) : n_kv;
    const float sl2 = scale * ATT_LOG2E;
    const long long qoff = (long long)h * D, kvoff = (long long)kvh * D;

    // Q tile -> shared memory (fp32, unscaled); rows past n_q are zero.
    if (VEC == 8) {
        const int C8 = D >> 3;
        for (int i = tid; i < BQ * C8; i += ATT_TILE_THREADS) {
            const int r = i / C8, c = i - r * C8;
            uint4 raw = make_uint4(0u, 0u, 0u, 0u);
            if (r < rows_here)
                raw = __ldg(reinterpret_cast<const uint4 *>(
                    q + (long long)(r0 + r) * q_stride + qoff + c * 8));
            float f[8];
            unpack8(*reinterpret_cast<const bf16x8 *>(&raw), f);
#pragma unroll
            for (int e = 0; e < 8; ++e) sQ[r * D + c * 8 + e] = f[e];
        }
    } else {
        tile_load_q_pairs<BQ>(sQ, D, rows_here, [&](int r) {
            return reinterpret_cast<const unsigned int *>(
                q + (long long)(r0 + r) * q_stride + qoff);
        });
    }

    const int wr0 = warp * RT;
    int lim[RT];  // keys [0, lim) visible to the row (0: a padding row)
#pragma unroll
    for (int i = 0; i < RT; ++i) {
        const int r = wr0 + i;
        lim[i] = r < rows_here ? (causal ? min(n_kv, q_offset + r0 + r + 1) : n_kv) : 0;
    }
    TileRows<RT, MAXP> rows;
    tile_rows_init(rows);

    for (int kt = 0; kt < kv_hi; kt += ATT_TILE_KEYS) {
        __syncthreads();  // previous tile consumed (and sQ written, the first time)
        if (VEC == 8) {
            const int C8 = D >> 3;
            for (int i = tid; i < ATT_TILE_KEYS * C8; i += ATT_TILE_THREADS) {
                const int j = i / C8, c = i - j * C8;
                const int kp = kt + j;
                uint4 kw = make_uint4(0u, 0u, 0u, 0u), vw = kw;
                if (kp < kv_hi) {
                    const long long base = (long long)kp * kv_stride + kvoff + c * 8;
                    kw = __ldg(reinterpret_cast<const uint4 *>(k + base));
                    vw = __ldg(reinterpret_cast<const uint4 *>(v + base));
                }
                const unsigned int kws[4] = {kw.x, kw.y, kw.z, kw.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) sK[tile_k_index(c * 4 + e, j)] = kws[e];
                *reinterpret_cast<uint4 *>(sV + j * DP + c * 4) = vw;
            }
        } else {
            tile_load_kv_pairs<MAXP>(
                sK, sV, k, v, kt, D, lane, warp, [&](int kp) { return kp < kv_hi; },
                [&](int kp) { return (long long)kp * kv_stride + kvoff; });
        }
        __syncthreads();
        tile_attend(rows, sQ, sK, sV, D, lane, wr0, kt, sl2,
                    [&](int i, int kp) { return kp < lim[i]; });
    }

    const long long out_row = (long long)H * D;
    tile_store(rows, D, lane, wr0, rows_here, [&](int r) {
        return reinterpret_cast<unsigned int *>(
            out + (long long)(r0 + r) * out_row + (long long)h * D);
    });
}

#define DENSE_ENTRY(NAME, MAXP, VEC)                                                        \
    extern "C" __global__ void __launch_bounds__(ATT_TILE_THREADS, 4)                         \
    NAME(bf16 *out, const bf16 *q, const bf16 *k, const bf16 *v, int n_q, int n_kv,          \
         int num_heads, int num_kv_heads, int head_dim, int q_stride, int kv_stride,         \
         float scale, int causal, int q_offset) {                                            \
        dense_impl<MAXP, VEC>(out, q, k, v, n_q, n_kv, num_heads, num_kv_heads, head_dim,    \
                              q_stride, kv_stride, scale, causal, q_offset);                 \
    }

DENSE_ENTRY(dense_attention_p1_v8, 1, 8)
DENSE_ENTRY(dense_attention_p2_v8, 2, 8)
DENSE_ENTRY(dense_attention_p4_v8, 4, 8)
DENSE_ENTRY(dense_attention_p1_v2, 1, 2)
DENSE_ENTRY(dense_attention_p2_v2, 2, 2)
DENSE_ENTRY(dense_attention_p4_v2, 4, 2)
