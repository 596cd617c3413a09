// Mamba2's selective state space scan (SSD: Mamba2 layers of Nemotron-H, Granite-4.0-H): the
// chunked scan of a prefill over a ragged batch and the one-token state update of decode, FP32
// state per (sequence, head) in a slot pool.
//
// Per token t and head h (group gr = h / (n_heads / n_groups)), FP32:
//   dt = min(max(softplus(dt_raw + dt_bias[h]), dt_min), dt_max)   (softplus(x) = x if x > 20)
//   A = -exp(A_log[h]);  S[p][n] <- exp(dt A) S[p][n] + (dt B[gr][n]) x[h][p]
//   y[h][p] = bf16(sum_n S[p][n] C[gr][n] + D[h] x[h][p])
// The step evaluates exactly that (each product and the sum rounded on their own). Prefill,
// per chunk of chunk_size tokens on the grid of absolute positions (a chunk ends at the next
// multiple of chunk_size of start_pos + row), cum = inclusive cumsum of dt A (sequential),
// xt = dt x:
//   Y[l] = exp(cum_l) S C_l + sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) xt_s + D x_l
//   S   <- exp(cum_L-1) S + sum_s (exp(cum_L-1 - cum_s) xt_s) B_s^T
// (HF's mamba2_chunk_scan: segment sums, Y_diag + Y_off + D residual, chunk states). A prefill
// split at multiples of chunk_size runs the same chunks: same bits.
//
// Layouts (element strides, BF16 unless noted):
//   x       rows of x_stride, head h at x + t*x_stride + h*head_dim
//   B, C    rows of bc_stride, group gr at B + t*bc_stride + gr*d_state (C likewise)
//   dt_raw  rows of dt_stride, head h at column h;  A_log, dt_bias, D: FP32 [n_heads]
//   out     [n_tokens, n_heads, head_dim]
//   state   slot s at state_pool + s*slot_stride: FP32 [n_heads, head_dim, d_state]
//   slots, cu_seqlens [n_seqs + 1], start_pos: int32; start_pos == 0: fresh (zero state, not
//           read); the step always reads its slot. Distinct sequences, distinct slots.
// Restrictions: d_state in {32, 64, 128, 256} (one prefill entry point each); head_dim a
// multiple of BP = min(32, 4096 / d_state) (prefill) and of 4 (step); chunk_size in [1, 256];
// x_stride, bc_stride % 8 == 0; x/B/C/out/state_pool 16-byte aligned; slot_stride % 4 == 0.
//
// Prefill launch: grid (head_dim / BP, n_heads, n_seqs), block 128. A CTA owns the state
// columns p0..p0+BP of one (sequence, head), kept transposed in shared memory (sST[n][p]: the
// C.S products read a float4 of 4 p's per n, conflict-free), and walks the sequence's chunks.
// Within a chunk, 64-token output tiles l; for each, Y starts as exp(cum) C S, then for every
// 64-token source tile s <= l the CTA builds G = (C B^T) * decay (4 x 4 Gram tiles per thread
// from 128-bit rows, rows padded to 65 floats) and xt (FP32) in shared memory and accumulates
// G xt; the state update sums xt B over the chunk in registers (d_state / (128 / BP) columns
// of one row p per thread) and is written once the chunk's C.S reads are behind a barrier.
// Static shared memory: 16 KiB (state tile) + 16.25 KiB (G) + BP x 256 B (xt) + 2 KiB (dt,
// cum). The Gram products depend only on the group; each head and column block of a group
// recomputes them.
// Step launch: grid (n_heads, n_seqs), block 128, no shared memory: a state row p is spread
// over min(32, d_state / 4) lanes (float4 each, d_state / 128 float4 per lane above 128),
// read, updated and written once; y[p] is the lanes' xor-shuffle sum.
#include "recurrent_tiles.cuh"

#define M2_THREADS 128
#define M2_TILE 64
#define M2_MAX_CHUNK 256
#define M2_GS 65

template <int N>
__device__ __forceinline__ void prefill_impl(bf16 *__restrict__ out, const bf16 *__restrict__ x,
                                             int x_stride, const bf16 *__restrict__ Bm,
                                             const bf16 *__restrict__ Cm, int bc_stride,
                                             const bf16 *__restrict__ dt_raw, int dt_stride,
                                             const float *A_log, const float *dt_bias,
                                             const float *Dp, float dt_min, float dt_max,
                                             float *state_pool, long long slot_stride,
                                             const int *slots, const int *cu_seqlens,
                                             const int *start_pos, int n_heads, int n_groups,
                                             int head_dim, int chunk) {
    constexpr int BP = (4096 / N) < 32 ? 4096 / N : 32;   // state columns p per CTA
    constexpr int PQ = BP / 4;                             // float4 column quads
    constexpr int TG = M2_THREADS / PQ;                    // token groups of an output tile
    constexpr int TPT = M2_TILE / TG;                      // tokens per thread
    constexpr int TPP = M2_THREADS / BP;                   // threads per state row (update)
    constexpr int NPT = N / TPP;                           // state columns n per thread
    __shared__ __align__(16) float sST[N][BP];
    __shared__ __align__(16) float sG[M2_TILE][M2_GS];
    __shared__ __align__(16) float sXt[M2_TILE][BP];
    __shared__ float s_dt[M2_MAX_CHUNK], s_cum[M2_MAX_CHUNK];

    const int tid = threadIdx.x, pq = tid % PQ, tg = tid / PQ;
    const int p0 = blockIdx.x * BP, h = blockIdx.y, seq = blockIdx.z;
    const int gr = h / (n_heads / n_groups);
    const int row0 = cu_seqlens[seq];
    const int len = cu_seqlens[seq + 1] - row0;
    if (len <= 0) return;                                  // CTA-uniform: state unchanged
    const int pos0 = start_pos[seq];
    float *st = state_pool + (long long)slots[seq] * slot_stride +
                ((long long)h * head_dim + p0) * N;
    for (int idx = tid; idx < BP * (N / 4); idx += M2_THREADS) {
        const int p = idx / (N / 4), n4 = (idx % (N / 4)) * 4;
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
        if (pos0 != 0) s = *reinterpret_cast<const float4 *>(st + (long long)p * N + n4);
        sST[n4][p] = s.x;
        sST[n4 + 1][p] = s.y;
        sST[n4 + 2][p] = s.z;
        sST[n4 + 3][p] = s.w;
    }
    const float A = -expf(A_log[h]), dtb = dt_bias[h], Dh = Dp[h];
    const long long xs = x_stride, bcs = bc_stride;
    const int hp = h * head_dim + p0;

    for (int c0 = 0; c0 < len;) {
        const int L = min(len - c0, chunk - (pos0 + c0) % chunk);
        const long long rb = row0 + c0;
        const bf16 *xc = x + rb * xs + hp;
        const bf16 *Bc = Bm + rb * bcs + (long long)gr * N;
        const bf16 *Cc = Cm + rb * bcs + (long long)gr * N;

        // 1. dt per token, then cum = cumsum(dt A)
        for (int t = tid; t < L; t += M2_THREADS) {
            const float v = softplus_f(bf2f(dt_raw[(rb + t) * dt_stride + h]) + dtb);
            s_dt[t] = fminf(fmaxf(v, dt_min), dt_max);
        }
        __syncthreads();
        if (tid == 0) {
            float acc = 0.f;
            for (int t = 0; t < L; ++t) {
                acc = __fadd_rn(acc, __fmul_rn(s_dt[t], A));
                s_cum[t] = acc;
            }
        }
        __syncthreads();

        // 2. output tiles
        for (int l0 = 0; l0 < L; l0 += M2_TILE) {
            const int nl = min(M2_TILE, L - l0);
            float acc[TPT][4];
#pragma unroll
            for (int m = 0; m < TPT; ++m)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[m][c] = 0.f;
            for (int n = 0; n < N; n += 8) {          // exp(cum) C S, from the chunk's state
                float f[TPT][8];
#pragma unroll
                for (int m = 0; m < TPT; ++m) {
                    const int t = tg + TG * m;
                    if (t < nl) {
                        unpack8(*reinterpret_cast<const bf16x8 *>(Cc + (l0 + t) * bcs + n), f[m]);
                    } else {
#pragma unroll
                        for (int e = 0; e < 8; ++e) f[m][e] = 0.f;
                    }
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const float4 s = *reinterpret_cast<const float4 *>(&sST[n + e][4 * pq]);
#pragma unroll
                    for (int m = 0; m < TPT; ++m) {
                        acc[m][0] = fmaf(f[m][e], s.x, acc[m][0]);
                        acc[m][1] = fmaf(f[m][e], s.y, acc[m][1]);
                        acc[m][2] = fmaf(f[m][e], s.z, acc[m][2]);
                        acc[m][3] = fmaf(f[m][e], s.w, acc[m][3]);
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < TPT; ++m) {
                const int t = tg + TG * m;
                const float e = t < nl ? expf(s_cum[l0 + t]) : 0.f;
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[m][c] *= e;
            }
            for (int s0 = 0; s0 <= l0; s0 += M2_TILE) {
                const int ns = min(M2_TILE, L - s0);
                const bool diag = s0 == l0;
                __syncthreads();                       // the previous tile's G, xt reads done
                for (int tile = tid; tile < 256; tile += M2_THREADS) {
                    const int bi = tile >> 4, bj = tile & 15;
                    if (4 * bi >= nl || 4 * bj >= ns || (diag && bj > bi)) continue;
                    float g[4][4];
                    gram4x4(Cc + l0 * bcs, nl, Bc + s0 * bcs, ns, bcs, 4 * bi, 4 * bj, N, g);
#pragma unroll
                    for (int ii = 0; ii < 4; ++ii)
#pragma unroll
                        for (int jj = 0; jj < 4; ++jj) {
                            const int i = 4 * bi + ii, j = 4 * bj + jj;
                            if (i < nl && j < ns && (!diag || j <= i))
                                sG[i][j] = g[ii][jj] * expf(s_cum[l0 + i] - s_cum[s0 + j]);
                        }
                }
                for (int idx = tid; idx < M2_TILE * (BP / 8); idx += M2_THREADS) {
                    const int s = idx / (BP / 8), v8 = (idx % (BP / 8)) * 8;
                    if (s >= ns) continue;
                    float f[8];
                    unpack8(*reinterpret_cast<const bf16x8 *>(xc + (s0 + s) * xs + v8), f);
                    const float d = s_dt[s0 + s];
#pragma unroll
                    for (int e = 0; e < 8; ++e) sXt[s][v8 + e] = f[e] * d;
                }
                __syncthreads();
#pragma unroll
                for (int m = 0; m < TPT; ++m) {
                    const int t = tg + TG * m;
                    if (t >= nl) continue;
                    const int s_end = diag ? t + 1 : ns;
                    for (int s = 0; s < s_end; ++s) {
                        const float g = sG[t][s];
                        const float4 xv = *reinterpret_cast<const float4 *>(&sXt[s][4 * pq]);
                        acc[m][0] = fmaf(g, xv.x, acc[m][0]);
                        acc[m][1] = fmaf(g, xv.y, acc[m][1]);
                        acc[m][2] = fmaf(g, xv.z, acc[m][2]);
                        acc[m][3] = fmaf(g, xv.w, acc[m][3]);
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < TPT; ++m) {
                const int t = tg + TG * m;
                if (t >= nl) continue;
                float xv[4], y[4];
                load4_bf16(xc + (l0 + t) * xs + 4 * pq, xv);
#pragma unroll
                for (int c = 0; c < 4; ++c) y[c] = fmaf(Dh, xv[c], acc[m][c]);
                store4_bf16(out + ((rb + l0 + t) * n_heads) * head_dim + hp + 4 * pq, y);
            }
        }

        // 3. S <- exp(cum_L-1) S + sum_s (exp(cum_L-1 - cum_s) dt_s x_s[p]) B_s
        {
            const int p = tid / TPP, n0 = (tid % TPP) * NPT;
            const float gl = s_cum[L - 1];
            float ns_acc[NPT];
#pragma unroll
            for (int e = 0; e < NPT; ++e) ns_acc[e] = 0.f;
            for (int s = 0; s < L; ++s) {
                const float w = expf(gl - s_cum[s]) * s_dt[s] * bf2f(xc[s * xs + p]);
#pragma unroll
                for (int e = 0; e < NPT; e += 8) {
                    float f[8];
                    unpack8(*reinterpret_cast<const bf16x8 *>(Bc + s * bcs + n0 + e), f);
#pragma unroll
                    for (int k = 0; k < 8; ++k) ns_acc[e + k] = fmaf(w, f[k], ns_acc[e + k]);
                }
            }
            // every C.S read of sST is behind the barriers of step 2
            const float decay = expf(gl);
#pragma unroll
            for (int e = 0; e < NPT; ++e) sST[n0 + e][p] = fmaf(decay, sST[n0 + e][p], ns_acc[e]);
            __syncthreads();   // the tile, dt and cum are final before the next chunk
        }
        c0 += L;
    }

    for (int idx = tid; idx < BP * (N / 4); idx += M2_THREADS) {
        const int p = idx / (N / 4), n4 = (idx % (N / 4)) * 4;
        *reinterpret_cast<float4 *>(st + (long long)p * N + n4) =
            make_float4(sST[n4][p], sST[n4 + 1][p], sST[n4 + 2][p], sST[n4 + 3][p]);
    }
}

// (min 2 CTAs per SM, what the shared memory allows anyway: without the hint ptxas held the
// prefill to 128 registers on sm_90 and spilled; with it ~180, no spills)
#define M2_PREFILL(N)                                                                        \
    extern "C" __global__ void __launch_bounds__(M2_THREADS, 2)                              \
    mamba2_prefill_n##N(bf16 *out, const bf16 *x, int x_stride, const bf16 *Bm,              \
                        const bf16 *Cm, int bc_stride, const bf16 *dt_raw, int dt_stride,    \
                        const float *A_log, const float *dt_bias, const float *Dp,           \
                        float dt_min, float dt_max, float *state_pool, long long slot_stride,\
                        const int *slots, const int *cu_seqlens, const int *start_pos,       \
                        int n_heads, int n_groups, int head_dim, int chunk) {                \
        prefill_impl<N>(out, x, x_stride, Bm, Cm, bc_stride, dt_raw, dt_stride, A_log,       \
                        dt_bias, Dp, dt_min, dt_max, state_pool, slot_stride, slots,         \
                        cu_seqlens, start_pos, n_heads, n_groups, head_dim, chunk);          \
    }

M2_PREFILL(32)
M2_PREFILL(64)
M2_PREFILL(128)
M2_PREFILL(256)

extern "C" __global__ void __launch_bounds__(M2_THREADS)
mamba2_step(bf16 *out, const bf16 *x, int x_stride, const bf16 *Bm, const bf16 *Cm,
            int bc_stride, const bf16 *dt_raw, int dt_stride, const float *A_log,
            const float *dt_bias, const float *Dp, float dt_min, float dt_max,
            float *state_pool, long long slot_stride, const int *slots, int n_heads,
            int n_groups, int head_dim, int d_state) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.x, seq = blockIdx.y;
    const int gr = h / (n_heads / n_groups);
    const int N = d_state;
    const int lpr = min(32, N / 4);            // lanes per state row (a power of two)
    const int f4 = (N / 4) / lpr;              // float4 per lane: 1, or 2 for d_state 256
    const int rpw = 32 / lpr;                  // rows per warp
    const int lr = lane % lpr, rw = lane / lpr;
    const float dt = fminf(fmaxf(softplus_f(bf2f(dt_raw[(long long)seq * dt_stride + h]) +
                                            dt_bias[h]), dt_min), dt_max);
    const float dA = expf(dt * -expf(A_log[h]));
    const float Dh = Dp[h];
    const bf16 *brow = Bm + (long long)seq * bc_stride + (long long)gr * N;
    const bf16 *crow = Cm + (long long)seq * bc_stride + (long long)gr * N;
    float db[2][4], cc[2][4];
#pragma unroll
    for (int f = 0; f < 2; ++f) {
        if (f >= f4) break;
        const int n4 = (lr + f * lpr) * 4;
        load4_bf16(brow + n4, db[f]);
        load4_bf16(crow + n4, cc[f]);
#pragma unroll
        for (int c = 0; c < 4; ++c) db[f][c] = __fmul_rn(dt, db[f][c]);
    }
    const bf16 *xr = x + (long long)seq * x_stride + (long long)h * head_dim;
    float *st = state_pool + (long long)slots[seq] * slot_stride + (long long)h * head_dim * N;
    bf16 *yr = out + ((long long)seq * n_heads + h) * head_dim;
    for (int p0 = 0; p0 < head_dim; p0 += 4 * rpw) {   // warp-uniform trip count
        const int p = p0 + warp * rpw + rw;
        const bool live = p < head_dim;
        const float xp = live ? bf2f(xr[p]) : 0.f;
        float part = 0.f;
#pragma unroll
        for (int f = 0; f < 2; ++f) {
            if (!live || f >= f4) break;
            float4 *sp = reinterpret_cast<float4 *>(st + (long long)p * N + (lr + f * lpr) * 4);
            const float4 s = *sp;
            const float ns[4] = {__fadd_rn(__fmul_rn(s.x, dA), __fmul_rn(xp, db[f][0])),
                                 __fadd_rn(__fmul_rn(s.y, dA), __fmul_rn(xp, db[f][1])),
                                 __fadd_rn(__fmul_rn(s.z, dA), __fmul_rn(xp, db[f][2])),
                                 __fadd_rn(__fmul_rn(s.w, dA), __fmul_rn(xp, db[f][3]))};
            *sp = make_float4(ns[0], ns[1], ns[2], ns[3]);
#pragma unroll
            for (int c = 0; c < 4; ++c) part = fmaf(ns[c], cc[f][c], part);
        }
        for (int o = lpr >> 1; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
        if (live && lr == 0) yr[p] = f2bf(fmaf(Dh, xp, part));
    }
}
