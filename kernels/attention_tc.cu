// Tensor-core causal prefill attention over the paged KV cache (FlashAttention-2 style):
// the tensor-core sibling of prefill_attention_p{1,2,4} in attention.cu, with the same
// arguments and contract. BF16 mma.sync m16n8k16 with FP32 accumulation (kernels/mma.cuh).
//
// Notation as attention.cu: H query heads, KV kv heads, G = H/KV (query head h uses kv head
// h/G), D head_dim; qkv [n_tokens, (H+2KV)*D] bf16 (only q read); k_cache/v_cache
// [num_blocks, block_size, KV, D] bf16 (slot = block*block_size + offset); block_tables
// [n_seqs, max_blocks_per_seq] int32; kv_lens [n_seqs] int32 (INCLUDING this step's tokens);
// qo_indptr [n_seqs+1] int32. Row i of sequence s sits at pos_i = kv_len - q_len + i and
// sees key p when p <= pos_i (and p > pos_i - sliding_window when sliding_window > 0).
// out [n_tokens, H*D] bf16.
//
// ---- formula (per query row and head) ----------------------------------------------------
//   s_p = fp32(q . k_p) * scale * log2(e)   (masked keys: -inf)
//   keys are walked in tiles of BN at ABSOLUTE positions [t*BN, (t+1)*BN); after tile t the
//   running max is M_t = max(M_{t-1}, max of the tile's s) (M = -inf: use 0 as reference),
//     p_p   = bf16(exp2(s_p - M_t))                     (P is rounded to BF16 for the MMA)
//     l     = l * exp2(M_{t-1} - M_t) + sum_p p_p       (sum of the rounded p, fp32)
//     acc   = acc * exp2(M_{t-1} - M_t) + P V           (mma, FP32 accumulate)
//     (alpha = exp2(M_{t-1} - M_t) is exactly 1 when the max did not move)
//   out = bf16(acc * (1/l)); a row without a visible key would give 0 (never NaN).
//   Closed form (the twin, metrale/ops/attention_tile.py `attend_base2_bf16p`):
//   out = sum_p w_p v_p / sum_p w_p with w_p = bf16(exp2(s_p - M_{t(p)})) * 2^(M_{t(p)} - M_last).
//
//   Options (as attention.cu): softcap > 0 replaces s_p by cap * log2(e) * tanh(q.k * scale /
//   cap) (Gemma 2); sinks [H] fp32 add head h's 2^(s2 - M) to the final denominator,
//   s2 = sinks[h] * log2 e, M = max(M_last, s2): out = acc 2^(M_last-M) / (l 2^(M_last-M) +
//   2^(s2-M)) (gpt-oss). Off at softcap = 0 and sinks = NULL.
//
// ---- launch geometry ---------------------------------------------------------------------
//   Entry prefill_attention_tc_d{D} per supported head dim with its key tile BN:
//   D = 16, 32, 64, 80, 96, 128 -> BN = 64; D = 256 -> BN = 16 (other D: attention.cu).
//   grid (ceil(max_q_len*G / 64), KV, n_seqs), block 128 (4 warps), launch bounds 128x2.
//   One CTA = 64 query rows of one (sequence, kv head): flattened row f = token*G + g (the G
//   heads of the group are adjacent rows), so one K/V tile in shared memory serves every head
//   of the GQA/MQA group, and short chunks (decode-like q_len) fill the tile with heads
//   instead of padding. Warp w owns rows 16w .. 16w+15. blockIdx.x runs the tiles from the
//   last (longest key range) to the first.
//   Dynamic shared memory (BM + 2*BN) * RS * 16 bytes, <= 48 KiB for every instance:
//     sQ [64][D], sK [BN][D], sV [BN][D] bf16; a row is CH = D/8 chunks of 16 bytes.
//     CH % 8 == 0 (D = 64, 128, 256): row stride CH chunks, chunk c of row r stored at
//       c ^ (r & 7) (XOR swizzle); otherwise (D = 16, 32, 80, 96) row stride CH+1 chunks
//       (odd: padding). Either way the 8 rows an ldmatrix phase reads hit 8 distinct
//       16-byte bank groups.
//   Pipeline (cp.async, zero-fill for keys outside [kv_lo, kv_hi) and rows past q_len):
//     Q and K_0 in flight; per tile t: issue V_t | wait K_t; S = Q K_t^T | issue K_{t+1};
//     softmax in registers | wait V_t; acc += P V_t. K loads overlap softmax + P V, V loads
//     overlap Q K^T (two commit groups in flight).
//   Fragments (mma.cuh): Q A-fragments by ldmatrix.x4 (held in registers for D <= 128,
//   reloaded per tile for D = 256); K B-fragments by ldmatrix.x4 of two n8 key tiles;
//   S = Q K^T accumulates over D in 16-wide steps in increasing order; the online softmax
//   runs on the accumulator layout (a lane holds rows group and group+8, columns 2tig,
//   2tig+1 of each n8 tile; row max over the quad by xor-shuffles 1, 2); P's accumulators
//   repack in registers into A-fragments of P V; V B-fragments by ldmatrix.x4.trans.
//
// ---- invariance --------------------------------------------------------------------------
//   A row's bits depend only on its own q, its visible keys and D: key tiles sit at absolute
//   positions (multiples of BN), each S element accumulates its own products over D in a
//   fixed order, max/sum per row use the same shuffle pattern for every row, and each acc
//   element accumulates tile after tile, 16 keys per mma in increasing order. Tiles a row
//   does not see (before its window, after its position) leave its state bit-identical:
//   its max does not move (alpha = 1 exactly), its p are 0 and 0 * v adds +0 (finite
//   K/V: keys outside [kv_lo, kv_hi) are zero-filled, never read). So a row's
//   result is the same however the query is chunked or batched and whichever CTA or row
//   slot (token, head) holds it: chunked prefill == whole prefill, bit for bit.
//
// ---- restrictions (the launcher checks them) ---------------------------------------------
//   D in {16, 32, 64, 80, 96, 128, 256}; H % KV == 0; max_q_len * G < 2^31; qkv, k_cache,
//   v_cache 16-byte aligned (cp.async), out 4-byte aligned. An inconsistent sequence
//   (q_len > max_q_len, q_len > kv_len, rows past n_tokens, kv_len > max_blocks_per_seq *
//   block_size) gets NaN rows where they are addressable, as attention.cu.
#include "common.cuh"
#include "mma.cuh"

#define TC_THREADS 128
#define TC_BM 64  // query rows (token, head) per CTA: 16 per warp
#define TC_LOG2E 1.4426950408889634f

// Element offset of 16-byte chunk c of row r in a [rows][D] bf16 tile (see the header).
template <int D>
__device__ __forceinline__ int tc_off(int r, int c) {
    constexpr int CH = D / 8;
    if constexpr (CH % 8 == 0) return (r * CH + (c ^ (r & 7))) * 8;
    else return (r * (CH + 1) + c) * 8;
}

template <int D>
__host__ __device__ constexpr int tc_row_chunks() { return (D / 8) % 8 == 0 ? D / 8 : D / 8 + 1; }

template <int D, int BN>
__device__ __forceinline__ void prefill_tc_impl(
    bf16 *__restrict__ out, const bf16 *__restrict__ qkv, const bf16 *__restrict__ k_cache,
    const bf16 *__restrict__ v_cache, const int *__restrict__ block_tables,
    const int *__restrict__ kv_lens, const int *__restrict__ qo_indptr, int n_seqs,
    int n_tokens, int max_q_len, int H, int KV, int head_dim, int bs, int max_blocks,
    float scale, int window, float softcap, const float *__restrict__ sinks) {
    constexpr int CH = D / 8;        // 16-byte chunks per row
    constexpr int KC = D / 16;       // k steps of Q K^T
    constexpr int NT = BN / 8;       // n8 key tiles of S
    constexpr int DT = D / 8;        // n8 column tiles of the output
    constexpr bool Q_IN_REGS = D <= 128;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    bf16 *sQ = reinterpret_cast<bf16 *>(tc_smem);
    bf16 *sK = sQ + TC_BM * tc_row_chunks<D>() * 8;
    bf16 *sV = sK + BN * tc_row_chunks<D>() * 8;

    const int tile = gridDim.x - 1 - blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int grp = lane >> 2, tig = lane & 3;
    if (s >= n_seqs) return;
    const int G = H / KV;
    const int q_start = qo_indptr[s], q_end = qo_indptr[s + 1];
    const int q_len = q_end - q_start;
    const int kv_len = kv_lens[s];
    const int f0 = tile * TC_BM;  // first flattened row (token * G + g) of this CTA
    const long long out_row = (long long)H * D;
    const bool ok = head_dim == D && q_start >= 0 && q_len >= 0 && q_len <= max_q_len &&
                    q_end <= n_tokens && q_len <= kv_len &&
                    (long long)kv_len <= (long long)max_blocks * bs;
    if (!ok) {
        // NaN rows where addressable: a loud result for a caller bug.
        const int lim = min(max(q_len, 0), max_q_len);
        for (int i = tid; i < TC_BM * D; i += TC_THREADS) {
            const int f = f0 + i / D, t = f / G;
            const long long tok = (long long)q_start + t;
            if (t < lim && tok >= 0 && tok < n_tokens)
                out[tok * out_row + (long long)(kvh * G + f - t * G) * D + i % D] =
                    f2bf(__int_as_float(0x7fc00000));
        }
        return;
    }
    const int t_first = f0 / G;
    if (t_first >= q_len) return;
    const int t_last = min(q_len - 1, (f0 + TC_BM - 1) / G);
    const int pos_base = kv_len - q_len;
    const int kv_hi = pos_base + t_last + 1;  // keys [kv_lo, kv_hi) may be needed
    const int kv_lo = window > 0 ? max(0, pos_base + t_first - window + 1) : 0;
    const long long qkv_row = (long long)(H + 2 * KV) * D;
    const long long cache_row = (long long)KV * D;
    const int *bt = block_tables + (long long)s * max_blocks;

    // Q tile -> sQ (rows past q_len zero-filled).
    for (int i = tid; i < TC_BM * CH; i += TC_THREADS) {
        const int r = i / CH, c = i - r * CH;
        const int f = f0 + r, t = f / G;
        const bool v = t < q_len;
        const bf16 *src = qkv;
        if (v)
            src = qkv + (long long)(q_start + t) * qkv_row + (long long)(kvh * G + f - t * G) * D +
                  c * 8;
        cp_async_16(sQ + tc_off<D>(r, c), src, v ? 16 : 0);
    }
    cp_async_commit();
    // Keys kt .. kt+BN-1 of `cache` -> dst; keys outside [kv_lo, kv_hi) are zeros and their
    // block table entries are never read (blocks before a window may be evicted).
    auto load_keys = [&](bf16 *dst, const bf16 *cache, int kt) {
        for (int i = tid; i < BN * CH; i += TC_THREADS) {
            const int j = i / CH, c = i - j * CH;
            const int kp = kt + j;
            const bool v = kp >= kv_lo && kp < kv_hi;
            const bf16 *src = cache;
            if (v)
                src = cache + ((long long)__ldg(bt + kp / bs) * bs + kp % bs) * cache_row +
                      (long long)kvh * D + c * 8;
            cp_async_16(dst + tc_off<D>(j, c), src, v ? 16 : 0);
        }
    };
    const int kt0 = (kv_lo / BN) * BN;
    load_keys(sK, k_cache, kt0);
    cp_async_commit();

    // This lane's two rows (accumulator rows grp and grp+8 of the warp's 16).
    int qpos[2], qtok[2], qhead[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int f = f0 + warp * 16 + grp + 8 * r, t = f / G;
        qtok[r] = t;
        qhead[r] = kvh * G + f - t * G;
        qpos[r] = t < q_len ? pos_base + t : -1;  // -1: sees nothing
    }
    const int pos_lo = pos_base + t_first, pos_hi = pos_base + t_last;
    const float sl2 = scale * TC_LOG2E;
    const float cap_in = softcap > 0.f ? scale / softcap : 0.f;
    const float cap_l2 = softcap > 0.f ? softcap * TC_LOG2E : 0.f;

    unsigned int qf[Q_IN_REGS ? KC : 1][4];
    const int q_row = warp * 16 + (lane & 15), q_chunk = lane >> 4;
    if constexpr (Q_IN_REGS) {
        cp_async_wait<1>();  // Q arrived (K_0 may still be in flight)
        __syncthreads();
#pragma unroll
        for (int kc = 0; kc < KC; ++kc)
            ldmatrix_x4(qf[kc], sQ + tc_off<D>(q_row, 2 * kc + q_chunk));
    }

    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float o[DT][4];
#pragma unroll
    for (int jd = 0; jd < DT; ++jd) o[jd][0] = o[jd][1] = o[jd][2] = o[jd][3] = 0.f;
    // ldmatrix row/chunk of this lane: K (two n8 key tiles x two k halves), V (.trans).
    const int k_row = (lane & 7) + 8 * (lane >> 4), k_half = (lane >> 3) & 1;
    const int v_row = (lane & 7) + 8 * ((lane >> 3) & 1), v_half = lane >> 4;

    for (int kt = kt0; kt < kv_hi; kt += BN) {
        load_keys(sV, v_cache, kt);
        cp_async_commit();
        cp_async_wait<1>();  // K_t (and Q) arrived; V_t may be in flight
        __syncthreads();

        // ---- S = Q K^T (16 rows x BN keys per warp) ----------------------------------
        float sc[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            unsigned int qa[4];
            if constexpr (Q_IN_REGS) {
#pragma unroll
                for (int e = 0; e < 4; ++e) qa[e] = qf[kc][e];
            } else {
                ldmatrix_x4(qa, sQ + tc_off<D>(q_row, 2 * kc + q_chunk));
            }
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                unsigned int kb[4];
                ldmatrix_x4(kb, sK + tc_off<D>(8 * j + k_row, 2 * kc + k_half));
                const unsigned int b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
                mma_bf16_16816(sc[j], qa, b0, sc[j]);
                mma_bf16_16816(sc[j + 1], qa, b1, sc[j + 1]);
            }
        }
        __syncthreads();  // every warp is done with sK
        if (kt + BN < kv_hi) load_keys(sK, k_cache, kt + BN);
        cp_async_commit();  // (possibly empty: keeps the group count uniform)

        // ---- online softmax on the accumulator layout; P -> bf16 A-fragments ----------
        const bool full = kt + BN - 1 <= pos_lo && (window <= 0 || kt > pos_hi - window);
        unsigned int pf[BN / 16][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int kp = kt + 8 * j + 2 * tig + e;
                    float v = cap_l2 > 0.f ? cap_l2 * tanhf(sc[j][2 * r + e] * cap_in)
                                           : sc[j][2 * r + e] * sl2;
                    if (!full && !(kp <= qpos[r] && (window <= 0 || kp > qpos[r] - window)))
                        v = NEG_INF;
                    sc[j][2 * r + e] = v;
                    mx = fmaxf(mx, v);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[r], mx);
            const float mu = mn == NEG_INF ? 0.f : mn;
            const float alpha = mn == m[r] ? 1.f : exp2f(m[r] - mu);
            m[r] = mn;
            float ls = 0.f;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const unsigned int pw =
                    pack_bf2(exp2f(sc[j][2 * r] - mu), exp2f(sc[j][2 * r + 1] - mu));
                ls += bf_lo(pw);
                ls += bf_hi(pw);
                pf[j >> 1][(j & 1) * 2 + r] = pw;  // a[0..3] = (A, B) rows x (lo, hi) keys
            }
            l[r] = l[r] * alpha + ls;
#pragma unroll
            for (int jd = 0; jd < DT; ++jd) {
                o[jd][2 * r] *= alpha;
                o[jd][2 * r + 1] *= alpha;
            }
        }

        // ---- acc += P V ----------------------------------------------------------------
        cp_async_wait<1>();  // V_t arrived; K_{t+1} may be in flight
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int jd = 0; jd < DT; jd += 2) {
                unsigned int vb[4];
                ldmatrix_x4_trans(vb, sV + tc_off<D>(16 * kk + v_row, jd + v_half));
                const unsigned int b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
                mma_bf16_16816(o[jd], pf[kk], b0, o[jd]);
                mma_bf16_16816(o[jd + 1], pf[kk], b1, o[jd + 1]);
            }
        }
        __syncthreads();  // every warp is done with sV
    }
    cp_async_wait<0>();

    // ---- out = acc / l ---------------------------------------------------------------------
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float lt = l[r] + __shfl_xor_sync(0xffffffffu, l[r], 1);
        lt = lt + __shfl_xor_sync(0xffffffffu, lt, 2);
        if (qpos[r] >= 0) {
            float inv = lt > 0.f ? 1.f / lt : 0.f;
            if (sinks != nullptr) {   // m[r] is -inf only for a row that saw no key: 0
                const float s2 = __ldg(sinks + qhead[r]) * TC_LOG2E;
                const float M = fmaxf(m[r], s2), a = exp2f(m[r] - M);
                inv = m[r] == NEG_INF ? 0.f : a / (lt * a + exp2f(s2 - M));
            }
            bf16 *orow = out + (long long)(q_start + qtok[r]) * out_row + (long long)qhead[r] * D;
#pragma unroll
            for (int jd = 0; jd < DT; ++jd)
                *reinterpret_cast<unsigned int *>(orow + 8 * jd + 2 * tig) =
                    pack_bf2(o[jd][2 * r] * inv, o[jd][2 * r + 1] * inv);
        }
    }
}

#define PREFILL_TC_ENTRY(D, BN)                                                             \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, 2) prefill_attention_tc_d##D(  \
        bf16 *out, const bf16 *qkv, const bf16 *k_cache, const bf16 *v_cache,              \
        const int *block_tables, const int *kv_lens, const int *qo_indptr, int n_seqs,     \
        int n_tokens, int max_q_len, int num_heads, int num_kv_heads, int head_dim,        \
        int block_size, int max_blocks_per_seq, float scale, int sliding_window,           \
        float softcap, const float *sinks) {                                               \
        prefill_tc_impl<D, BN>(out, qkv, k_cache, v_cache, block_tables, kv_lens,          \
                               qo_indptr, n_seqs, n_tokens, max_q_len, num_heads,          \
                               num_kv_heads, head_dim, block_size, max_blocks_per_seq,     \
                               scale, sliding_window, softcap, sinks);                     \
    }

PREFILL_TC_ENTRY(16, 64)
PREFILL_TC_ENTRY(32, 64)
PREFILL_TC_ENTRY(64, 64)
PREFILL_TC_ENTRY(80, 64)
PREFILL_TC_ENTRY(96, 64)
PREFILL_TC_ENTRY(128, 64)
PREFILL_TC_ENTRY(256, 16)
