// The gated delta rule (gated DeltaNet: Qwen3-Next, Qwen3.5): chunked prefill over a ragged
// batch and the recurrent decode step, FP32 state per (sequence, value head) in a slot pool.
//
// Per token and value head h (key head kh = h / (n_v_heads / n_k_heads)), FP32:
//   g = -exp(A_log[h]) * softplus(a + dt_bias[h])  (softplus(x) = x for x > 20, else
//   log1p(exp(x))), beta = 1 / (1 + exp(-b)),
//   k^ = k * rsqrt(|k|^2 + 1e-6),  q^ = q * rsqrt(|q|^2 + 1e-6) / sqrt(d_k),
//   S <- exp(g) S;  u = beta (v - S^T k^);  S <- S + k^ u^T;  out = bf16(S^T q^).
// Decode evaluates it as: a = S^T k^, c = S^T q^ (old S, one pass), e = exp(g),
//   u = beta (v - e a), out = e c + u (k^ . q^), S <- e S + k^ u^T.
// Prefill, per chunk of L <= 64 tokens on the grid of absolute positions (a chunk ends at the
// next multiple of 64 of start_pos + row): gamma = inclusive cumsum of g (sequential),
//   A[i][j] = beta_i k^_i.k^_j exp(gamma_i - gamma_j)  (j < i)
//   X = (I + A)^-1 (beta (V - exp(gamma) K^ S))        (forward substitution)
//   O[t] = exp(gamma_t) q^_t S + sum_{s<=t} q^_t.k^_s exp(gamma_t - gamma_s) X[s]
//   S <- exp(gamma_L-1) S + sum_t exp(gamma_L-1 - gamma_t) k^_t X[t]^T
// (FLA's WY/UT form). A prefill split at multiples of 64 runs the same chunks: same bits.
//
// Layouts (element strides, BF16 unless noted):
//   q, k, v   rows of qkv_stride: q head kh at q + t*qkv_stride + kh*d_k, k likewise, value
//             head h at v + t*qkv_stride + h*d_v
//   a, b      rows of ab_stride, head h at column h;  A_log, dt_bias: FP32 [n_v_heads]
//   out       [n_tokens, n_v_heads, d_v]
//   state     slot s at state_pool + s*slot_stride: FP32 [n_v_heads, d_k, d_v]
//   slots, cu_seqlens [n_seqs + 1], start_pos: int32. start_pos == 0: fresh (zero state,
//             not read); decode always reads its slot. Distinct sequences, distinct slots.
// Restrictions: d_k % 16 == 0, d_k <= 128; d_v % 32 == 0; qkv_stride % 8 == 0, q/k/v/out and
// state_pool 16-byte aligned, slot_stride % 4 == 0.
//
// Launch (both): grid (d_v / 32, n_v_heads, n_seqs), block 128 (4 warps); a CTA owns 32 value
// columns of one (sequence, head): its state tile [d_k, 32] and no other block's bytes.
// Prefill: the tile lives in shared memory across the sequence's chunks; static shared memory
// 16 KiB (S tile) + 16.25 KiB (A, then Q^K^T; rows padded to 65 floats) + 10 KiB (X, rows
// padded to 40 floats: the substitution's column reads are conflict-free) + 1 KiB (per-token
// norms, gamma, beta).
// Gram tiles are 4 x 4 per thread from 128-bit q/k row loads (L1-resident: the chunk's rows
// are 2 x 16 KiB); the substitution runs per warp on 8 columns, 4 lanes per column, partial
// sums over j = lane/8 (mod 4) joined by shuffles, __syncwarp per row; each chunk costs five
// block barriers. The key-side work (A, Q^K^T) is recomputed by each of the d_v / 32 CTAs of
// a head.
// Decode: each thread holds d_k/16 rows x 4 columns of the tile (float4 loads and stores),
// the two column dots reduce by xor shuffles over the warp's row groups, then across the 4
// warps in warp order through shared memory; shared memory 1.6 KiB.
#include "recurrent_tiles.cuh"

#define GDR_THREADS 128
#define GDR_CHUNK 64
#define GDR_BV 32
#define GDR_MAX_DK 128
#define GDR_XS 40   // row stride of the X tile (floats)
#define GDR_AS 65   // row stride of the A tile: step 5 reads four rows per column at once

// acc[m][c] = sum_d rows[tg + 16m][d] * sS[d][4cq + c] for the four tokens tg + 16m < L.
__device__ __forceinline__ void rows_times_state(const bf16 *rows, long long stride, int tg,
                                                 int cq, int L, int d_k,
                                                 const float (*sS)[GDR_BV], float acc[4][4]) {
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] = 0.f;
    for (int d = 0; d < d_k; d += 8) {
        float f[4][8];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int t = tg + 16 * m;
            if (t < L) unpack8(*reinterpret_cast<const bf16x8 *>(rows + t * stride + d), f[m]);
            else
#pragma unroll
                for (int e = 0; e < 8; ++e) f[m][e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float4 s = *reinterpret_cast<const float4 *>(&sS[d + e][4 * cq]);
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                acc[m][0] = fmaf(f[m][e], s.x, acc[m][0]);
                acc[m][1] = fmaf(f[m][e], s.y, acc[m][1]);
                acc[m][2] = fmaf(f[m][e], s.z, acc[m][2]);
                acc[m][3] = fmaf(f[m][e], s.w, acc[m][3]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(GDR_THREADS)
gdr_prefill(bf16 *out, const bf16 *q, const bf16 *k, const bf16 *v, int qkv_stride,
            const bf16 *a, const bf16 *b, int ab_stride, const float *A_log,
            const float *dt_bias, float *state_pool, long long slot_stride, const int *slots,
            const int *cu_seqlens, const int *start_pos, int n_k_heads, int n_v_heads, int d_k,
            int d_v) {
    __shared__ __align__(16) float sS[GDR_MAX_DK][GDR_BV];
    __shared__ __align__(16) float sA[GDR_CHUNK][GDR_AS];
    __shared__ __align__(16) float sX[GDR_CHUNK][GDR_XS];
    __shared__ float s_rk[GDR_CHUNK], s_rq[GDR_CHUNK], s_gam[GDR_CHUNK], s_beta[GDR_CHUNK];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int cq = tid & 7, tg = tid >> 3;           // column quad, token / row group
    const int j0 = blockIdx.x * GDR_BV, h = blockIdx.y, seq = blockIdx.z;
    const int kh = h / (n_v_heads / n_k_heads);
    const int row0 = cu_seqlens[seq];
    const int len = cu_seqlens[seq + 1] - row0;
    if (len <= 0) return;                             // CTA-uniform: the state is unchanged
    const int p0 = start_pos[seq];
    const long long stride = qkv_stride;
    float *st = state_pool + (long long)slots[seq] * slot_stride + (long long)h * d_k * d_v + j0;

    for (int idx = tid; idx < d_k * 8; idx += GDR_THREADS) {
        const int i = idx >> 3, c4 = (idx & 7) * 4;
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
        if (p0 != 0) s = *reinterpret_cast<const float4 *>(st + (long long)i * d_v + c4);
        *reinterpret_cast<float4 *>(&sS[i][c4]) = s;
    }
    const float neg_a = -expf(A_log[h]);
    const float dtb = dt_bias[h];
    const float inv_sqrt_dk = 1.0f / sqrtf((float)d_k);

    for (int c0 = 0; c0 < len;) {
        const int L = min(len - c0, GDR_CHUNK - (p0 + c0) % GDR_CHUNK);
        const long long r0 = (long long)(row0 + c0) * stride;
        const bf16 *qc = q + r0 + (long long)kh * d_k;
        const bf16 *kc = k + r0 + (long long)kh * d_k;
        const bf16 *vc = v + r0 + (long long)h * d_v + j0;

        // 1. per token: norms and gates (threads 0..63), then gamma = cumsum g
        if (tid < GDR_CHUNK) {
            float rk = 0.f, rq = 0.f, gg = 0.f, bb = 0.f;
            if (tid < L) {
                float sk = 0.f, sq = 0.f;
                for (int d = 0; d < d_k; d += 8) {
                    float fk[8], fq[8];
                    unpack8(*reinterpret_cast<const bf16x8 *>(kc + tid * stride + d), fk);
                    unpack8(*reinterpret_cast<const bf16x8 *>(qc + tid * stride + d), fq);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        sk = fmaf(fk[e], fk[e], sk);
                        sq = fmaf(fq[e], fq[e], sq);
                    }
                }
                rk = rsqrtf(sk + 1e-6f);
                rq = rsqrtf(sq + 1e-6f) * inv_sqrt_dk;
                const long long ra = (long long)(row0 + c0 + tid) * ab_stride + h;
                gg = neg_a * softplus_f(bf2f(a[ra]) + dtb);
                bb = 1.f / (1.f + expf(-bf2f(b[ra])));
            }
            s_rk[tid] = rk;
            s_rq[tid] = rq;
            s_gam[tid] = gg;
            s_beta[tid] = bb;
        }
        __syncthreads();
        if (tid == 0) {
            float acc = 0.f;
            for (int t = 0; t < L; ++t) {
                acc += s_gam[t];
                s_gam[t] = acc;
            }
        }
        __syncthreads();

        // 2. A (strictly lower) and X = beta (V - exp(gamma) K^ S)
        for (int tile = tid; tile < 256; tile += GDR_THREADS) {
            const int bi = tile >> 4, bj = tile & 15;
            if (bj > bi || 4 * bi >= L) continue;
            float acc[4][4];
            gram4x4(kc, L, kc, L, stride, 4 * bi, 4 * bj, d_k, acc);
#pragma unroll
            for (int ii = 0; ii < 4; ++ii)
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const int i = 4 * bi + ii, j = 4 * bj + jj;
                    if (j < i && i < L)
                        sA[i][j] = s_beta[i] * s_rk[i] * s_rk[j] * acc[ii][jj] *
                                   expf(s_gam[i] - s_gam[j]);
                }
        }
        {
            float acc[4][4];
            rows_times_state(kc, stride, tg, cq, L, d_k, sS, acc);
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const int t = tg + 16 * m;
                if (t >= L) continue;
                float vv[4];
                load4_bf16(vc + t * stride + 4 * cq, vv);
                const float w = expf(s_gam[t]) * s_rk[t];
                float x[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) x[c] = s_beta[t] * (vv[c] - w * acc[m][c]);
                *reinterpret_cast<float4 *>(&sX[t][4 * cq]) = make_float4(x[0], x[1], x[2], x[3]);
            }
        }
        __syncthreads();

        // 3. X <- (I + A)^-1 X: warp w solves columns 8w..8w+7
        {
            const int col = 8 * warp + (lane & 7), part = lane >> 3;
            for (int i = 1; i < L; ++i) {
                float s = 0.f;
                for (int j = part; j < i; j += 4) s = fmaf(sA[i][j], sX[j][col], s);
                s += __shfl_xor_sync(0xffffffffu, s, 8);
                s += __shfl_xor_sync(0xffffffffu, s, 16);
                if (part == 0) sX[i][col] -= s;
                __syncwarp();
            }
        }
        __syncthreads();

        // 4. sA <- Q^ K^T * D (lower, diagonal included)
        for (int tile = tid; tile < 256; tile += GDR_THREADS) {
            const int bi = tile >> 4, bj = tile & 15;
            if (bj > bi || 4 * bi >= L) continue;
            float acc[4][4];
            gram4x4(qc, L, kc, L, stride, 4 * bi, 4 * bj, d_k, acc);
#pragma unroll
            for (int ii = 0; ii < 4; ++ii)
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const int i = 4 * bi + ii, j = 4 * bj + jj;
                    if (j <= i && i < L)
                        sA[i][j] = s_rq[i] * s_rk[j] * acc[ii][jj] * expf(s_gam[i] - s_gam[j]);
                }
        }
        __syncthreads();

        // 5. O = exp(gamma) Q^ S + (Q^K^T * D) X, stored as BF16
        {
            float acc[4][4];
            rows_times_state(qc, stride, tg, cq, L, d_k, sS, acc);
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const int t = tg + 16 * m;
                if (t >= L) continue;
                const float w = expf(s_gam[t]) * s_rq[t];
                float o[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) o[c] = w * acc[m][c];
                for (int s = 0; s <= t; ++s) {
                    const float as = sA[t][s];
                    const float4 x = *reinterpret_cast<const float4 *>(&sX[s][4 * cq]);
                    o[0] = fmaf(as, x.x, o[0]);
                    o[1] = fmaf(as, x.y, o[1]);
                    o[2] = fmaf(as, x.z, o[2]);
                    o[3] = fmaf(as, x.w, o[3]);
                }
                store4_bf16(out + ((long long)(row0 + c0 + t) * n_v_heads + h) * d_v + j0 + 4 * cq,
                            o);
            }
        }

        // 6. S <- exp(gamma_L-1) S + sum_t (exp(gamma_L-1 - gamma_t) k^_t) X[t]^T
        {
            const int i0 = 8 * tg;     // rows i0..i0+7 of this thread (i0 < d_k)
            float ns[8][4];
#pragma unroll
            for (int e = 0; e < 8; ++e)
#pragma unroll
                for (int c = 0; c < 4; ++c) ns[e][c] = 0.f;
            const float gl = s_gam[L - 1];
            if (i0 < d_k) {
                for (int t = 0; t < L; ++t) {
                    float f[8];
                    unpack8(*reinterpret_cast<const bf16x8 *>(kc + t * stride + i0), f);
                    const float w = s_rk[t] * expf(gl - s_gam[t]);
                    const float4 x = *reinterpret_cast<const float4 *>(&sX[t][4 * cq]);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const float kw = f[e] * w;
                        ns[e][0] = fmaf(kw, x.x, ns[e][0]);
                        ns[e][1] = fmaf(kw, x.y, ns[e][1]);
                        ns[e][2] = fmaf(kw, x.z, ns[e][2]);
                        ns[e][3] = fmaf(kw, x.w, ns[e][3]);
                    }
                }
            }
            __syncthreads();   // step 5's reads of sS are done
            if (i0 < d_k) {
                const float decay = expf(gl);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    float4 *p = reinterpret_cast<float4 *>(&sS[i0 + e][4 * cq]);
                    const float4 s = *p;
                    *p = make_float4(fmaf(decay, s.x, ns[e][0]), fmaf(decay, s.y, ns[e][1]),
                                     fmaf(decay, s.z, ns[e][2]), fmaf(decay, s.w, ns[e][3]));
                }
            }
            __syncthreads();   // the tile is whole before the next chunk (or the store) reads it
        }
        c0 += L;
    }

    for (int idx = tid; idx < d_k * 8; idx += GDR_THREADS) {
        const int i = idx >> 3, c4 = (idx & 7) * 4;
        *reinterpret_cast<float4 *>(st + (long long)i * d_v + c4) =
            *reinterpret_cast<const float4 *>(&sS[i][c4]);
    }
}

extern "C" __global__ void __launch_bounds__(GDR_THREADS)
gdr_decode(bf16 *out, const bf16 *q, const bf16 *k, const bf16 *v, int qkv_stride,
           const bf16 *a, const bf16 *b, int ab_stride, const float *A_log,
           const float *dt_bias, float *state_pool, long long slot_stride, const int *slots,
           int n_k_heads, int n_v_heads, int d_k, int d_v) {
    __shared__ __align__(16) float s_k[GDR_MAX_DK], s_q[GDR_MAX_DK];
    __shared__ float s_red[4][2][GDR_BV];
    __shared__ float s_par[4];     // rk, rq, g, beta

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int cq = tid & 7, rg = tid >> 3;
    const int j0 = blockIdx.x * GDR_BV, h = blockIdx.y, seq = blockIdx.z;
    const int kh = h / (n_v_heads / n_k_heads);
    const long long row = (long long)seq * qkv_stride;
    const bf16 *qr = q + row + (long long)kh * d_k;
    const bf16 *kr = k + row + (long long)kh * d_k;

    if (warp < 2) {
        const bf16 *x = warp == 0 ? kr : qr;
        float s = 0.f;
        for (int d = lane; d < d_k; d += 32) {
            const float f = bf2f(x[d]);
            s = fmaf(f, f, s);
        }
        s = warp_sum(s);
        if (lane == 0) s_par[warp] = rsqrtf(s + 1e-6f) * (warp == 0 ? 1.f : 1.0f / sqrtf((float)d_k));
    } else if (tid == 64) {
        const long long ra = (long long)seq * ab_stride + h;
        s_par[2] = -expf(A_log[h]) * softplus_f(bf2f(a[ra]) + dt_bias[h]);
        s_par[3] = 1.f / (1.f + expf(-bf2f(b[ra])));
    }
    __syncthreads();
    for (int d = tid; d < d_k; d += GDR_THREADS) {
        s_k[d] = bf2f(kr[d]) * s_par[0];
        s_q[d] = bf2f(qr[d]) * s_par[1];
    }
    __syncthreads();

    float *st = state_pool + (long long)slots[seq] * slot_stride + (long long)h * d_k * d_v + j0 +
                4 * cq;
    const int n_rows = d_k >> 4;   // rows rg + 16 r of this thread
    float s[8][4], pa[4] = {0.f, 0.f, 0.f, 0.f}, pc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        if (r >= n_rows) break;
        const int i = rg + 16 * r;
        const float4 x = *reinterpret_cast<const float4 *>(st + (long long)i * d_v);
        s[r][0] = x.x; s[r][1] = x.y; s[r][2] = x.z; s[r][3] = x.w;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            pa[c] = fmaf(s[r][c], s_k[i], pa[c]);
            pc[c] = fmaf(s[r][c], s_q[i], pc[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        pa[c] += __shfl_xor_sync(0xffffffffu, pa[c], 8);
        pa[c] += __shfl_xor_sync(0xffffffffu, pa[c], 16);
        pc[c] += __shfl_xor_sync(0xffffffffu, pc[c], 8);
        pc[c] += __shfl_xor_sync(0xffffffffu, pc[c], 16);
    }
    if (lane < 8) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            s_red[warp][0][4 * cq + c] = pa[c];
            s_red[warp][1][4 * cq + c] = pc[c];
        }
    }
    float kq = 0.f;
    for (int d = 0; d < d_k; ++d) kq = fmaf(s_k[d], s_q[d], kq);
    __syncthreads();

    const float e = expf(s_par[2]), beta = s_par[3];
    float vv[4], u[4], o[4];
    load4_bf16(v + row + (long long)h * d_v + j0 + 4 * cq, vv);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int col = 4 * cq + c;
        const float av = ((s_red[0][0][col] + s_red[1][0][col]) + s_red[2][0][col]) + s_red[3][0][col];
        const float cv = ((s_red[0][1][col] + s_red[1][1][col]) + s_red[2][1][col]) + s_red[3][1][col];
        u[c] = beta * (vv[c] - e * av);
        o[c] = fmaf(u[c], kq, e * cv);
    }
    if (rg == 0) store4_bf16(out + ((long long)seq * n_v_heads + h) * d_v + j0 + 4 * cq, o);
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        if (r >= n_rows) break;
        const int i = rg + 16 * r;
        const float ki = s_k[i];
        *reinterpret_cast<float4 *>(st + (long long)i * d_v) =
            make_float4(fmaf(e, s[r][0], ki * u[0]), fmaf(e, s[r][1], ki * u[1]),
                        fmaf(e, s[r][2], ki * u[2]), fmaf(e, s[r][3], ki * u[3]));
    }
}
