// The grouped LoRA GEMMs: many adapters over one base model, each row of a batch with its
// own adapter (or none), applied after the base projection:
//
//   shrink   t[i, c]  = sum_k x[i, k] * A_s[c, k]                    (s = the row's slot)
//   expand   y[i, j]  = bf16( y[i, j] + sum_r u[i, p*rp + r] * B_s[j, r] )
//            u[i, q]  = (t_0[i, q] + t_1[i, q] + ...) * scale_s[p]       (p = the part of j)
//
// The expand's t may come in `splits` parts summed in order (t_s at t + s * t_split_stride):
// a tensor-parallel rank's row-parallel projection (o, down) shrinks its own slice of k, and
// the ranks' partial t, gathered, are added in rank order before the scale (splits = 1 on
// one device).
//
// y holds the base projection's BF16 output (gemm_tc / gemm_q, bias added); the expand adds
// the delta into it with one rounding. A group fuses up to three projections (q|k|v,
// gate|up): A_s is [c = parts * rp, k] (part p's A in rows p*rp .. p*rp + rp - 1), B_s is
// [n, rp] (output j of part p reads t columns p*rp ..), part p's outputs are
// [part_end[p-1], part_end[p]) with part_end = (part1, part2, n). Ranks below rp are zero
// rows of A and zero columns of B.
//
// Layouts: x bf16 [m, k]; t float32 [m, c]; y bf16 [m, n]; slot s of a pool at
// a_pool + s * a_slot_stride, b_pool + s * b_slot_stride (elements), scale_pool + s * parts
// (float32). tiles int32 [n_tiles][3] = (first row, rows, slot): rows consecutive rows that
// share a slot (at most ROWS); slot < 0 or >= n_slots: the tile does nothing (a row without
// an adapter, a padding row of a captured decode graph). Distinct tiles own distinct rows.
//
// ORDER (fixed; the numpy twin in metrale/ops/lora.py computes the same float32 operations in
// the same order, so on the emulator the two agree bit for bit): every product and every sum
// is one IEEE float32 rounding (__fmul_rn / __fadd_rn, never a fused multiply-add).
//   shrink  k is cut in 8-element chunks; chunk q belongs to lane q mod 128 of 128 lanes.
//           Lane l sums, from +0, its chunks in ascending order and each chunk's 8 products
//           in ascending k (chunks past k are zeros: +0 products). The 128 lane sums are
//           added by a halving tree: v[l] + v[l + 64], then + 32, 16, 8, 4, 2, 1.
//   expand  u = ((t_0 + t_1) + t_2 ...) * scale, then delta = +0, and + u[i, p*rp + r] *
//           B[j, r] for r = 0 .. rp-1;
//           y = bf16(float(y) + delta), round to nearest even.
// Neither depends on which tile, CTA or entry point computes an element, on the other rows
// of the tile, or on the batch: a row's bits are a function of its own x row, its slot's
// A, B and scale, and its base output. Decode (one row per tile) and prefill (up to eight
// rows of one sequence per tile) give the same bits, and a row without an adapter is never
// touched (the launcher gives it no tile; a padding tile exits at once).
//
// Entry points (block 128 threads):
//   lora_shrink_r{1,8}_{v8,v1}(t, x, a_pool, a_slot_stride, tiles, m, k, c, n_slots)
//       grid (n_tiles, ceil(c / 8)); CTA = one tile x 8 columns of t; accumulators
//       [ROWS][8] per thread, then the tree through 4 KiB (r1) / 32 KiB (r8) of shared
//       memory and warp shuffles.
//   lora_expand_r{1,8}_{v8,v1}(y, t, t_split_stride, splits, b_pool, b_slot_stride,
//                              scale_pool, tiles, m, n, rp, c, parts, part1, part2, n_slots)
//       grid (n_tiles, ceil(n / 128)); thread = one output column j of the tile's rows; u of
//       the tile in shared memory (c <= 768: at most 24 KiB).
// v8: 16-byte loads (k, rp, the slot strides multiples of 8; x, A, B 16-byte aligned); v1:
// 2-byte loads. Same bits.
#include "common.cuh"

#define LORA_LANES 128
#define LORA_COLS 8          // t columns per shrink CTA
#define LORA_MAX_C 768       // parts * rp: 3 * 256

__device__ __forceinline__ bool lora_tile(const int *tiles, int m, int n_slots, int &row0,
                                          int &rows, int &slot) {
    const int *e = tiles + 3 * blockIdx.x;
    row0 = e[0];
    rows = e[1];
    slot = e[2];
    if (slot < 0 || slot >= n_slots || row0 < 0 || rows < 1 || row0 >= m) return false;
    rows = min(rows, m - row0);
    return true;
}

// 8 BF16 at p (elements at index >= limit read as 0) into v
template <bool VEC>
__device__ __forceinline__ void lora_load8(const bf16 *p, int limit, float v[8]) {
    if (VEC && limit >= 8) {
        unpack8(*reinterpret_cast<const bf16x8 *>(p), v);
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = e < limit ? bf2f(p[e]) : 0.f;
    }
}

template <int ROWS, bool VEC>
__device__ __forceinline__ void lora_shrink_body(float *t, const bf16 *x, const bf16 *a_pool,
                                                 long long a_slot_stride, const int *tiles,
                                                 int m, int k, int c, int n_slots) {
    __shared__ float red[ROWS * LORA_COLS][LORA_LANES];
    int row0, rows, slot;
    if (!lora_tile(tiles, m, n_slots, row0, rows, slot)) return;
    const int lane = threadIdx.x, c0 = blockIdx.y * LORA_COLS;
    const bf16 *a = a_pool + slot * a_slot_stride;
    float acc[ROWS][LORA_COLS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int q = 0; q < LORA_COLS; ++q) acc[i][q] = 0.f;
    const int steps = (k + LORA_LANES * 8 - 1) / (LORA_LANES * 8);
    for (int s = 0; s < steps; ++s) {
        const int kk = s * LORA_LANES * 8 + lane * 8;
        const int lim = k - kk;          // <= 0: a chunk past k, all zeros
        float xv[ROWS][8];
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int r = row0 + min(i, rows - 1);   // rows past the tile: a copy, unused
            lora_load8<VEC>(x + (long long)r * k + kk, lim, xv[i]);
        }
#pragma unroll
        for (int q = 0; q < LORA_COLS; ++q) {
            float av[8];
            const int col = min(c0 + q, c - 1);      // columns past c: a copy, unused
            lora_load8<VEC>(a + (long long)col * k + kk, lim, av);
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    acc[i][q] = __fadd_rn(acc[i][q], __fmul_rn(xv[i][e], av[e]));
        }
    }
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int q = 0; q < LORA_COLS; ++q) red[i * LORA_COLS + q][lane] = acc[i][q];
    __syncthreads();
    const int warp = lane >> 5, l = lane & 31;
    for (int v = warp; v < ROWS * LORA_COLS; v += LORA_LANES / 32) {
        const int i = v / LORA_COLS, q = v % LORA_COLS;
        if (i >= rows || c0 + q >= c) continue;          // uniform across the warp
        const float *s = red[v];
        float val = __fadd_rn(__fadd_rn(s[l], s[l + 64]), __fadd_rn(s[l + 32], s[l + 96]));
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1)
            val = __fadd_rn(val, __shfl_xor_sync(0xffffffffu, val, o));
        if (l == 0) t[(long long)(row0 + i) * c + c0 + q] = val;
    }
}

template <int ROWS, bool VEC>
__device__ __forceinline__ void lora_expand_body(bf16 *y, const float *t,
                                                 long long t_split_stride, int splits,
                                                 const bf16 *b_pool, long long b_slot_stride,
                                                 const float *scale_pool, const int *tiles,
                                                 int m, int n, int rp, int c, int parts,
                                                 int part1, int part2, int n_slots) {
    __shared__ float u[ROWS * LORA_MAX_C];
    int row0, rows, slot;
    if (!lora_tile(tiles, m, n_slots, row0, rows, slot)) return;
    const float *scale = scale_pool + slot * parts;
    for (int idx = threadIdx.x; idx < rows * c; idx += blockDim.x) {
        const int i = idx / c, q = idx % c;
        const float *tq = t + (long long)(row0 + i) * c + q;
        float v = tq[0];
        for (int sp = 1; sp < splits; ++sp) v = __fadd_rn(v, tq[sp * t_split_stride]);
        u[i * c + q] = __fmul_rn(v, scale[q / rp]);
    }
    __syncthreads();
    const int j = blockIdx.y * LORA_LANES + threadIdx.x;
    if (j >= n) return;
    const int p = (j >= part1) + (j >= part2);
    const bf16 *b = b_pool + slot * b_slot_stride + (long long)j * rp;
    const float *uc = u + p * rp;   // rows past the tile read the last row's u: unused
    float delta[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) delta[i] = 0.f;
    for (int r0 = 0; r0 < rp; r0 += 8) {
        float bv[8];
        lora_load8<VEC>(b + r0, rp - r0, bv);
        const int lim = min(8, rp - r0);
        for (int e = 0; e < lim; ++e)
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
                delta[i] = __fadd_rn(delta[i],
                                     __fmul_rn(uc[min(i, rows - 1) * c + r0 + e], bv[e]));
    }
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        if (i >= rows) break;
        bf16 *yp = y + (long long)(row0 + i) * n + j;
        *yp = f2bf(__fadd_rn(bf2f(*yp), delta[i]));
    }
}

#define LORA_ENTRIES(R, V, VEC)                                                                \
    extern "C" __global__ void __launch_bounds__(LORA_LANES)                                   \
        lora_shrink_r##R##_##V(float *t, const bf16 *x, const bf16 *a_pool,                    \
                               long long a_slot_stride, const int *tiles, int m, int k, int c, \
                               int n_slots) {                                                  \
        lora_shrink_body<R, VEC>(t, x, a_pool, a_slot_stride, tiles, m, k, c, n_slots);        \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(LORA_LANES)                                   \
        lora_expand_r##R##_##V(bf16 *y, const float *t, long long t_split_stride, int splits,  \
                               const bf16 *b_pool, long long b_slot_stride,                    \
                               const float *scale_pool, const int *tiles, int m, int n,        \
                               int rp, int c, int parts, int part1, int part2, int n_slots) {  \
        lora_expand_body<R, VEC>(y, t, t_split_stride, splits, b_pool, b_slot_stride,          \
                                 scale_pool, tiles, m, n, rp, c, parts, part1, part2,          \
                                 n_slots);                                                     \
    }

LORA_ENTRIES(1, v8, true)
LORA_ENTRIES(1, v1, false)
LORA_ENTRIES(8, v8, true)
LORA_ENTRIES(8, v1, false)
