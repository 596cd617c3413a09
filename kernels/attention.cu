// Paged attention over the KV cache: ragged causal prefill and split-K decode.
//
// Common notation: H query heads, KV kv heads, G = H/KV (query head h uses kv head h/G),
// D head_dim, qkv [n_tokens, (H+2KV)*D] bf16 (q heads first; only q is read here),
// k_cache/v_cache [num_blocks, block_size, KV, D] bf16 (slot = block*block_size + offset),
// block_tables [n_seqs, max_blocks_per_seq] int32, kv_lens [n_seqs] int32 (cached tokens
// INCLUDING this step's). Scores use base 2: s = (q.k) * scale * log2(e), p = exp2(s - m),
// all in fp32; only the final output is rounded to bf16.
//
// ---- prefill_attention_p{1,2,4} ---------------------------------------------------------
//   Sequence s owns query rows qo_indptr[s] .. qo_indptr[s+1] (q_len rows); row i sits at
//   position pos_i = kv_len - q_len + i and attends to cached positions p with p <= pos_i
//   (and p > pos_i - sliding_window when sliding_window > 0).
//   out [n_tokens, H*D] bf16 = softmax(q K^T * scale) V per row and head.
//   Launch: grid (ceil(max_q_len/BQ), H, n_seqs), block 128 (4 warps, launch bounds 128x4:
//   <= 128 registers, 4 CTAs per SM), dynamic shared
//   memory D*(4*BQ + 128) bytes. Suffix pN = pairs of dims per lane = ceil(D/64):
//   p1/p2 (D <= 128): BQ = 32, 8 rows per warp; p4 (D <= 256): BQ = 16, 4 rows per warp.
//   Flash-attention style, the tile code of attention_tile.cuh (shared with dense_attention):
//   per 32-key tile, K (stored transposed as bf16 pairs, XOR-swizzled) and V go to shared
//   memory; lane j scores key j for all rows of its warp; online softmax per row; lane l
//   accumulates output pairs l, l+32, ... Key tiles are aligned to absolute positions, so a
//   row's result does not depend on how the query was chunked or batched.
//   An inconsistent sequence (q_len > max_q_len, q_len > kv_len, rows past n_tokens,
//   kv_len > max_blocks_per_seq*block_size) gets NaN rows where they are addressable.
//
// ---- decode_attention_v{8,2}_g{1,2,4,8} + decode_attention_combine ----------------------
//   One query per sequence (qkv row s) at position kv_len-1; out [n_seqs, H*D] bf16.
//   Split-K with a FIXED split length DECODE_SPLIT_TOKENS = 256 over absolute positions:
//   split i covers [i*256, (i+1)*256) clipped to the window, so the split count depends only
//   on the sequence's own kv_len (batch invariant) and the grid only on max_splits (graph
//   safe: every per-step value is read from device buffers).
//   Split kernel: grid (max_splits, KV*ceil(G/GT), n_seqs), block 128 (launch bounds
//   128x1: up to ~170 registers for GT=8 rather than spilling), dynamic shared
//   memory (GT*256 + 4*GT*(D + D/32))*4 bytes. One CTA = one split of one kv head for GT query heads
//   of its group (K/V rows loaded once, used by all GT heads); CTAs past the sequence's last
//   split (or before the window) exit. vN = bf16 per load: v8 = 128-bit loads (D % 8 == 0,
//   16-byte aligned pointers), v2 = 32-bit loads otherwise. Phase 1: L = lanes per key
//   (pow2 >= D/8 for v8, 32 for v2) compute q.k with a shuffle reduction, logits to shared
//   memory; phase 2: per-head max / exp2 / sum; phase 3: P.V, reduced over sub-warps by
//   shuffles and over warps in a fixed order. A sequence with a single active split writes
//   out = acc/l directly; otherwise it writes (m, l, acc) to the fp32 workspace:
//     ws_acc [n_seqs, H, max_splits, D], then ws_ml [n_seqs, H, max_splits, 2].
//   Combine kernel: grid (n_seqs, H), block 128: M = max m_i, w_i = exp2(m_i - M),
//   out = sum_i w_i acc_i / sum_i w_i l_i over active splits in increasing order.
//   kv_len <= 0 gives a zero row (padding rows of a captured batch); kv_len beyond
//   max_blocks_per_seq*block_size or max_splits*256 gives a NaN row.
//
// ---- options (every entry point; off at softcap = 0, sinks = NULL) ----------------------
//   softcap > 0 (Gemma 2's attn_logit_softcapping): each score becomes
//     cap * tanh((q.k) * scale / cap) before the softmax (base 2: times log2 e); prefill
//     through attention_tile.cuh's att_logit2, decode by pre-scaling q by scale / cap and
//     taking cap * log2(e) * tanh of each dot product.
//   sinks [H] fp32 (gpt-oss's learned attention sinks): head h's softmax denominator gains
//     exp(sinks[h]) (the sink is a logit whose value row is zero): with M = max(m, s2),
//     s2 = sinks[h] * log2 e, out = acc 2^(m-M) / (l 2^(m-M) + 2^(s2-M)); decode adds it
//     where the output is written (the split kernel for one split, else the combine, after
//     the splits' M and sum: L = sum_i 2^(m_i-M) l_i + 2^(s2-M)).
//
// Restrictions (checked by the launchers): D even, 2 <= D <= 256; H % KV == 0; pointers to
// bf16 data 4-byte aligned.
#include "attention_tile.cuh"
#include "common.cuh"

// Prefill and decode both launch the tile's 128 threads (4 warps).
#define ATT_THREADS ATT_TILE_THREADS
#define ATT_WARPS ATT_TILE_WARPS
#define DECODE_SPLIT_TOKENS 256
#define DECODE_UNROLL 4

// ======================================================================================
// prefill
// ======================================================================================
template <int MAXP>
__device__ __forceinline__ void prefill_impl(
    bf16 *__restrict__ out, const bf16 *__restrict__ qkv, const bf16 *__restrict__ k_cache,
    const bf16 *__restrict__ v_cache, const int *__restrict__ block_tables,
    const int *__restrict__ kv_lens, const int *__restrict__ qo_indptr, int n_seqs,
    int n_tokens, int max_q_len, int H, int KV, int D, int bs, int max_blocks, float scale,
    int window, float softcap, const float *__restrict__ sinks) {
    constexpr int RT = tile_rows<MAXP>();  // query rows per warp
    constexpr int BQ = RT * ATT_WARPS;
    extern __shared__ float smem[];
    const int DP = D >> 1;                  // bf16 pairs per row
    float *sQ = smem;                       // [BQ][D] fp32
    unsigned int *sK = reinterpret_cast<unsigned int *>(sQ + BQ * D);  // [DP][32] swizzled
    unsigned int *sV = sK + DP * 32;        // [32][DP]

    const int tile = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (s >= n_seqs) return;
    const int kvh = h / (H / KV);
    const int q_start = qo_indptr[s], q_end = qo_indptr[s + 1];
    const int q_len = q_end - q_start;
    const int kv_len = kv_lens[s];
    const int r0 = tile * BQ;
    const long long out_row = (long long)H * D;
    const bool ok = q_start >= 0 && q_len >= 0 && q_len <= max_q_len && q_end <= n_tokens &&
                    q_len <= kv_len && (long long)kv_len <= (long long)max_blocks * bs;
    if (!ok) {
        // NaN rows where addressable: a loud result for a caller bug.
        const int lim = min(max(q_len, 0), max_q_len);
        for (int i = tid; i < BQ * D; i += ATT_THREADS) {
            const int r = r0 + i / D, tok = q_start + r;
            if (r < lim && tok >= 0 && tok < n_tokens)
                out[tok * out_row + (long long)h * D + i % D] = f2bf(__int_as_float(0x7fc00000));
        }
        return;
    }
    if (r0 >= q_len) return;
    const int rows_here = min(BQ, q_len - r0);
    const int pos0 = kv_len - q_len + r0;
    const int kv_hi = pos0 + rows_here;  // keys [0, kv_hi) may be needed
    const int kv_lo = window > 0 ? max(0, pos0 - window + 1) : 0;
    const long long qkv_row = (long long)(H + 2 * KV) * D;
    const long long cache_row = (long long)KV * D;
    const float sl2 = scale * ATT_LOG2E;
    const float cap_in = softcap > 0.f ? scale / softcap : 0.f;
    const float cap_l2 = softcap > 0.f ? softcap * ATT_LOG2E : 0.f;
    const float sink2 = sinks != nullptr ? __ldg(sinks + h) * ATT_LOG2E : NEG_INF;

    // Q tile -> shared memory (fp32, unscaled); rows past q_len are zero.
    tile_load_q_pairs<BQ>(sQ, D, rows_here, [&](int r) {
        return reinterpret_cast<const unsigned int *>(
            qkv + (long long)(q_start + r0 + r) * qkv_row + (long long)h * D);
    });

    const int wr0 = warp * RT;
    int qpos[RT];
#pragma unroll
    for (int i = 0; i < RT; ++i)
        qpos[i] = (wr0 + i < rows_here) ? pos0 + wr0 + i : -1;  // -1: attends to nothing
    TileRows<RT, MAXP> rows;
    tile_rows_init(rows);
    const int *bt = block_tables + (long long)s * max_blocks;

    for (int kt = kv_lo & ~(ATT_TILE_KEYS - 1); kt < kv_hi; kt += ATT_TILE_KEYS) {
        __syncthreads();  // previous tile fully consumed (and sQ written, first time)
        tile_load_kv_pairs<MAXP>(
            sK, sV, k_cache, v_cache, kt, D, lane, warp,
            [&](int kp) { return kp >= kv_lo && kp < kv_hi; },  // never touch evicted blocks
            [&](int kp) {
                const int blk = __ldg(bt + kp / bs);
                return ((long long)blk * bs + kp % bs) * cache_row + (long long)kvh * D;
            });
        __syncthreads();
        tile_attend(
            rows, sQ, sK, sV, D, lane, wr0, kt, sl2,
            [&](int i, int kp) { return kp <= qpos[i] && (window <= 0 || kp > qpos[i] - window); },
            cap_in, cap_l2);
    }

    tile_store(
        rows, D, lane, wr0, rows_here,
        [&](int r) {
            return reinterpret_cast<unsigned int *>(
                out + (long long)(q_start + r0 + r) * out_row + (long long)h * D);
        },
        sink2);
}

#define PREFILL_ENTRY(NAME, MAXP)                                                           \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 4)                               \
    NAME(bf16 *out, const bf16 *qkv, const bf16 *k_cache, const bf16 *v_cache,              \
         const int *block_tables, const int *kv_lens, const int *qo_indptr, int n_seqs,     \
         int n_tokens, int max_q_len, int num_heads, int num_kv_heads, int head_dim,        \
         int block_size, int max_blocks_per_seq, float scale, int sliding_window,           \
         float softcap, const float *sinks) {                                               \
        prefill_impl<MAXP>(out, qkv, k_cache, v_cache, block_tables, kv_lens, qo_indptr,    \
                           n_seqs, n_tokens, max_q_len, num_heads, num_kv_heads, head_dim,  \
                           block_size, max_blocks_per_seq, scale, sliding_window, softcap,  \
                           sinks);                                                          \
    }

PREFILL_ENTRY(prefill_attention_p1, 1)
PREFILL_ENTRY(prefill_attention_p2, 2)
PREFILL_ENTRY(prefill_attention_p4, 4)

// ======================================================================================
// decode
// ======================================================================================
template <int VEC> struct RawVec;
template <> struct RawVec<8> { typedef uint4 T; };
template <> struct RawVec<2> { typedef unsigned int T; };

__device__ __forceinline__ void unpack_raw(const uint4 &r, float *o) {
    o[0] = bf_lo(r.x); o[1] = bf_hi(r.x); o[2] = bf_lo(r.y); o[3] = bf_hi(r.y);
    o[4] = bf_lo(r.z); o[5] = bf_hi(r.z); o[6] = bf_lo(r.w); o[7] = bf_hi(r.w);
}
__device__ __forceinline__ void unpack_raw(const unsigned int &r, float *o) {
    o[0] = bf_lo(r); o[1] = bf_hi(r);
}
__device__ __forceinline__ uint4 ld_raw(const uint4 *p) { return __ldg(p); }
__device__ __forceinline__ unsigned int ld_raw(const unsigned int *p) { return __ldg(p); }
__device__ __forceinline__ void zero_raw(uint4 &r) { r = make_uint4(0u, 0u, 0u, 0u); }
__device__ __forceinline__ void zero_raw(unsigned int &r) { r = 0u; }

// Per-sequence facts shared by the split and the combine kernels.
struct DecodeSeq {
    int kv_len, start, first, n_splits;
    bool valid;
};

__device__ __forceinline__ DecodeSeq decode_seq(int kv_len, int bs, int max_blocks,
                                                int max_splits, int window) {
    DecodeSeq d;
    d.kv_len = kv_len;
    d.valid = kv_len <= 0 || ((long long)kv_len <= (long long)max_blocks * bs &&
                              (long long)kv_len <= (long long)max_splits * DECODE_SPLIT_TOKENS);
    d.start = (window > 0 && kv_len > window) ? kv_len - window : 0;
    d.first = d.start / DECODE_SPLIT_TOKENS;
    d.n_splits = kv_len > 0 ? (kv_len + DECODE_SPLIT_TOKENS - 1) / DECODE_SPLIT_TOKENS : 0;
    return d;
}

template <int VEC, int MAXC, int GT>
__device__ __forceinline__ void decode_split_impl(
    bf16 *__restrict__ out, float *__restrict__ ws, const bf16 *__restrict__ qkv,
    const bf16 *__restrict__ k_cache, const bf16 *__restrict__ v_cache,
    const int *__restrict__ block_tables, const int *__restrict__ kv_lens, int n_seqs, int H,
    int KV, int D, int bs, int max_blocks, int max_splits, float scale, int window,
    float softcap, const float *__restrict__ sinks) {
    typedef typename RawVec<VEC>::T raw_t;
    constexpr int S = DECODE_SPLIT_TOKENS;
    constexpr int CV = MAXC * VEC;  // values per lane per head
    extern __shared__ float smem[];  // [GT][S] logits/probabilities, then [WARPS][GT][DP]
    __shared__ int s_blk[S + 1];
    __shared__ float s_m[GT], s_l[GT];
    float *s_logit = smem;
    float *s_red = smem + GT * S;
    // s_red rows hold element d at d + d / 32 (DP = D + D / 32 floats): the lanes that store
    // VEC consecutive values each would otherwise meet in the same banks, 32 / VEC lanes
    // apart (a 4-way conflict for VEC = 8, found by the EmuBackend's counters).
    const int DP = D + (D >> 5);

    const int split = blockIdx.x, s = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (s >= n_seqs) return;
    const int G = H / KV;
    const int n_hg = (G + GT - 1) / GT;
    const int kvh = blockIdx.y / n_hg, g0 = (blockIdx.y % n_hg) * GT;
    const int ng = min(GT, G - g0);
    const int h0 = kvh * G + g0;
    bf16 *orow = out + (long long)s * H * D + (long long)h0 * D;

    const DecodeSeq q = decode_seq(kv_lens[s], bs, max_blocks, max_splits, window);
    if (q.kv_len <= 0 || !q.valid) {
        if (split == 0) {
            const bf16 v = f2bf(q.kv_len <= 0 ? 0.f : __int_as_float(0x7fc00000));
            for (int i = tid; i < ng * D; i += ATT_THREADS) orow[i] = v;
        }
        return;
    }
    if (split < q.first || split >= q.n_splits) return;
    const int t0 = max(split * S, q.start), t1 = min(split * S + S, q.kv_len);
    const int n = t1 - t0;  // >= 1
    const int b0 = t0 / bs, nb = (t1 - 1) / bs - b0 + 1;
    const int *bt = block_tables + (long long)s * max_blocks + b0;
    for (int i = tid; i < nb; i += ATT_THREADS) s_blk[i] = __ldg(bt + i);

    const int C = D / VEC;  // chunks of VEC values per row
    int L = 32;             // lanes per key (power of two)
    if (VEC == 8) { L = 1; while (L < C && L < 32) L <<= 1; }
    const int TPW = 32 / L, NSUB = ATT_WARPS * TPW;
    const int sub = lane / L, sl = lane % L;
    const long long cache_row = (long long)KV * D;
    const long long kv_off = (long long)kvh * D;

    // this lane's slices of the GT query vectors, pre-scaled by scale*log2(e) (soft-capped:
    // by scale/cap, the dot product then going through cap*log2(e)*tanh)
    const float sl2 = softcap > 0.f ? scale / softcap : scale * ATT_LOG2E;
    const float cap_l2 = softcap > 0.f ? softcap * ATT_LOG2E : 0.f;
    const bf16 *qrow = qkv + (long long)s * (H + 2 * KV) * D + (long long)h0 * D;
    float qv[GT][CV];
#pragma unroll
    for (int g = 0; g < GT; ++g) {
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            const int ch = sl + c * L;
            raw_t r;
            zero_raw(r);
            if (g < ng && ch < C)
                r = ld_raw(reinterpret_cast<const raw_t *>(qrow + g * D + ch * VEC));
            unpack_raw(r, &qv[g][c * VEC]);
#pragma unroll
            for (int i = 0; i < VEC; ++i) qv[g][c * VEC + i] *= sl2;
        }
    }
    __syncthreads();  // s_blk

    // Rows of `cache` (K or V) for the keys wb + sub + u*NSUB (u < DECODE_UNROLL): this
    // lane's chunks sl + c*L of each, zeros past the split's n keys or the row's C chunks.
    auto load_rows = [&](raw_t (&r)[DECODE_UNROLL][MAXC], const bf16 *cache, int wb) {
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            const int tt = wb + sub + u * NSUB;
            const int t = t0 + tt;
            const bf16 *row = cache;
            if (tt < n)
                row = cache + ((long long)s_blk[t / bs - b0] * bs + t % bs) * cache_row + kv_off;
#pragma unroll
            for (int c = 0; c < MAXC; ++c) {
                const int ch = sl + c * L;
                zero_raw(r[u][c]);
                if (tt < n && ch < C)
                    r[u][c] = ld_raw(reinterpret_cast<const raw_t *>(row + ch * VEC));
            }
        }
    };

    // ---- phase 1: logits ------------------------------------------------------------
    for (int wb = warp * TPW; wb < n; wb += NSUB * DECODE_UNROLL) {
        raw_t kr[DECODE_UNROLL][MAXC];
        load_rows(kr, k_cache, wb);
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            float kf[CV];
#pragma unroll
            for (int c = 0; c < MAXC; ++c) unpack_raw(kr[u][c], &kf[c * VEC]);
            const int tt = wb + sub + u * NSUB;
#pragma unroll
            for (int g = 0; g < GT; ++g) {
                float a = 0.f;
#pragma unroll
                for (int i = 0; i < CV; ++i) a = fmaf(qv[g][i], kf[i], a);
                for (int o = L >> 1; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
                if (cap_l2 > 0.f) a = cap_l2 * tanhf(a);
                if (sl == 0 && tt < n && g < ng) s_logit[g * S + tt] = a;
            }
        }
    }
    __syncthreads();

    // ---- phase 2: softmax statistics per head -------------------------------------------
    for (int g = warp; g < ng; g += ATT_WARPS) {
        float mx = NEG_INF;
        for (int i = lane; i < n; i += 32) mx = fmaxf(mx, s_logit[g * S + i]);
        mx = warp_max(mx);
        float sum = 0.f;
        for (int i = lane; i < n; i += 32) {
            const float p = exp2f(s_logit[g * S + i] - mx);
            s_logit[g * S + i] = p;
            sum += p;
        }
        sum = warp_sum(sum);
        if (lane == 0) { s_m[g] = mx; s_l[g] = sum; }
    }
    __syncthreads();

    // ---- phase 3: P.V -----------------------------------------------------------------
    float acc[GT][CV];
#pragma unroll
    for (int g = 0; g < GT; ++g)
#pragma unroll
        for (int i = 0; i < CV; ++i) acc[g][i] = 0.f;
    for (int wb = warp * TPW; wb < n; wb += NSUB * DECODE_UNROLL) {
        raw_t vr[DECODE_UNROLL][MAXC];
        load_rows(vr, v_cache, wb);
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            const int tt = wb + sub + u * NSUB;
            if (tt < n) {
                float vf[CV];
#pragma unroll
                for (int c = 0; c < MAXC; ++c) unpack_raw(vr[u][c], &vf[c * VEC]);
#pragma unroll
                for (int g = 0; g < GT; ++g) {
                    const float p = g < ng ? s_logit[g * S + tt] : 0.f;
#pragma unroll
                    for (int i = 0; i < CV; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
                }
            }
        }
    }
    // reduce over the sub-warps (lanes with equal sl), then over warps in a fixed order
    for (int o = L; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < GT; ++g)
#pragma unroll
            for (int i = 0; i < CV; ++i) acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], o);
    }
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < GT; ++g) {
#pragma unroll
            for (int c = 0; c < MAXC; ++c) {
                const int ch = sl + c * L;
                if (g < ng && ch < C) {
#pragma unroll
                    for (int i = 0; i < VEC; ++i)
                        s_red[(warp * GT + g) * DP + (ch * VEC + i) + ((ch * VEC + i) >> 5)] =
                            acc[g][c * VEC + i];
                }
            }
        }
    }
    __syncthreads();
    const bool direct = q.n_splits - q.first == 1;
    const long long ws_base = ((long long)s * H + h0) * max_splits + split;  // head h0
    float *ws_ml = ws + (long long)n_seqs * H * max_splits * D;
    for (int i = tid; i < ng * D; i += ATT_THREADS) {
        const int g = i / D, d = i - g * D;
        const int dp = d + (d >> 5);
        float a = s_red[g * DP + dp];
#pragma unroll
        for (int w = 1; w < ATT_WARPS; ++w) a += s_red[(w * GT + g) * DP + dp];
        if (direct && sinks != nullptr) {
            const float s2 = __ldg(sinks + h0 + g) * ATT_LOG2E;
            const float M = fmaxf(s_m[g], s2), e = exp2f(s_m[g] - M);
            orow[i] = f2bf(a * e / (s_l[g] * e + exp2f(s2 - M)));
        } else if (direct) {
            orow[i] = f2bf(a / s_l[g]);
        } else {
            const long long e = ws_base + (long long)g * max_splits;
            ws[e * D + d] = a;
            if (d == 0) { ws_ml[2 * e] = s_m[g]; ws_ml[2 * e + 1] = s_l[g]; }
        }
    }
}

#define DECODE_ENTRY(NAME, VEC, MAXC, GT)                                                   \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1)                             \
    NAME(bf16 *out, float *workspace, const bf16 *qkv, const bf16 *k_cache,                 \
         const bf16 *v_cache, const int *block_tables, const int *kv_lens, int n_seqs,      \
         int num_heads, int num_kv_heads, int head_dim, int block_size,                     \
         int max_blocks_per_seq, int max_splits, float scale, int sliding_window,           \
         float softcap, const float *sinks) {                                               \
        decode_split_impl<VEC, MAXC, GT>(out, workspace, qkv, k_cache, v_cache,             \
                                         block_tables, kv_lens, n_seqs, num_heads,          \
                                         num_kv_heads, head_dim, block_size,                \
                                         max_blocks_per_seq, max_splits, scale,             \
                                         sliding_window, softcap, sinks);                   \
    }

DECODE_ENTRY(decode_attention_v8_g1, 8, 1, 1)
DECODE_ENTRY(decode_attention_v8_g2, 8, 1, 2)
DECODE_ENTRY(decode_attention_v8_g4, 8, 1, 4)
DECODE_ENTRY(decode_attention_v8_g8, 8, 1, 8)
DECODE_ENTRY(decode_attention_v2_g1, 2, 4, 1)
DECODE_ENTRY(decode_attention_v2_g2, 2, 4, 2)
DECODE_ENTRY(decode_attention_v2_g4, 2, 4, 4)
DECODE_ENTRY(decode_attention_v2_g8, 2, 4, 8)

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
decode_attention_combine(bf16 *out, const float *workspace, const int *kv_lens, int n_seqs,
                         int num_heads, int head_dim, int block_size, int max_blocks_per_seq,
                         int max_splits, int sliding_window, const float *sinks) {
    const int s = blockIdx.x, h = blockIdx.y;
    if (s >= n_seqs || h >= num_heads) return;
    const DecodeSeq q = decode_seq(kv_lens[s], block_size, max_blocks_per_seq, max_splits,
                                   sliding_window);
    if (q.kv_len <= 0 || !q.valid || q.n_splits - q.first <= 1) return;  // split kernel wrote
    const int D = head_dim;
    const long long base = ((long long)s * num_heads + h) * max_splits;
    const float *ml = workspace + (long long)n_seqs * num_heads * max_splits * D;
    float M = NEG_INF;
    for (int i = q.first; i < q.n_splits; ++i) M = fmaxf(M, ml[2 * (base + i)]);
    const float s2 = sinks != nullptr ? __ldg(sinks + h) * ATT_LOG2E : NEG_INF;
    M = fmaxf(M, s2);
    float Lsum = 0.f;
    for (int i = q.first; i < q.n_splits; ++i)
        Lsum += exp2f(ml[2 * (base + i)] - M) * ml[2 * (base + i) + 1];
    if (sinks != nullptr) Lsum += exp2f(s2 - M);
    const float inv = 1.f / Lsum;
    bf16 *o = out + (long long)s * num_heads * D + (long long)h * D;
    for (int d = threadIdx.x; d < D; d += ATT_THREADS) {
        float a = 0.f;
        for (int i = q.first; i < q.n_splits; ++i)
            a += exp2f(ml[2 * (base + i)] - M) * workspace[(base + i) * D + d];
        o[d] = f2bf(a * inv);
    }
}
