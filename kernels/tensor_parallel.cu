// Tensor-parallel combines: the device side of a rank's reductions and gathers.
//
//   tp_sum_partials:    out[i] = bf16(((p[0][i] + p[1][i]) + p[2][i]) + ... + p[R-1][i])
//       partials float32 [n_ranks, count] (rank-major, as an all-gather or all-to-all leaves
//       them), out bf16 [count]. The sum runs in rank order 0, 1, ..., R-1 for every element,
//       whatever count, row or launch: the fixed order that makes a tensor-parallel layer's
//       output independent of the batch (NCCL's ring / tree all-reduce orders by message
//       size and ring position). FP32 adds with the device's flush-to-zero, one RNE rounding.
//   tp_concat_shards:   out[r, k * shard_bytes + b] = shards[k, r, b]    for b < row bytes left
//       shards [n_ranks, n_rows, shard_bytes] (an all-gather of each rank's [n_rows, shard]
//       slice), out [n_rows, row_bytes] with row_bytes <= n_ranks * shard_bytes: the last
//       shard's padding (vocabulary padded to n_ranks * shard) is dropped. Element-type
//       agnostic (BF16 or FP32 logits rows); a pure copy.
//   tp_embedding_shard: out[t, :] = float(table[ids[t] - vocab_start, :])  if the id is in
//       [vocab_start, vocab_start + shard_rows), else 0.0f
//       table bf16 [shard_rows, hidden] (this rank's vocabulary slice), ids int32 [n_tokens],
//       out float32 [n_tokens, hidden]: exactly one rank writes each row's values, so the
//       rank-order sum of the ranks' outputs (tp_sum_partials) is the embedding row exactly.
//
// Launch:
//   tp_sum_partials:    1-D grid-stride, block TP_THREADS (256), grid min(ceil(count/4/256),
//       8192); float4 loads and 8-byte bf16x4 stores when count % 4 == 0 and partials,
//       out are 16- / 8-byte aligned, else one element per access.
//   tp_concat_shards:   grid (n_rows, n_ranks), block TP_THREADS; CTA (r, k) copies one
//       shard row with 16-byte accesses when both ends are 16-byte aligned and the span is a
//       multiple of 16 bytes, else byte by byte.
//   tp_embedding_shard: grid (n_tokens), block TP_THREADS, one row per CTA.
// Restrictions: count, n_rows, n_ranks, hidden, shard_rows in [1, 2^31); row_bytes and
// shard_bytes in [1, 2^31); n_ranks <= TP_MAX_RANKS (64). Memory-bound: tp_sum_partials
// reads 4 * n_ranks and writes 2 bytes per element.
#include "common.cuh"

#define TP_THREADS 256
#define TP_MAX_RANKS 64

struct __align__(8) bf16x4 { __nv_bfloat162 h[2]; };

extern "C" __global__ void __launch_bounds__(TP_THREADS)
tp_sum_partials(bf16 *out, const float *partials, int count, int n_ranks) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if ((count & 3) == 0 && aligned16(partials) &&
        (reinterpret_cast<unsigned long long>(out) & 7ull) == 0) {
        const long long n4 = count >> 2;
        const float4 *p4 = reinterpret_cast<const float4 *>(partials);
        bf16x4 *o4 = reinterpret_cast<bf16x4 *>(out);
        for (long long i = tid; i < n4; i += stride) {
            float4 s = __ldg(p4 + i);
            for (int r = 1; r < n_ranks; ++r) {
                const float4 v = __ldg(p4 + (long long)r * n4 + i);
                s.x += v.x;
                s.y += v.y;
                s.z += v.z;
                s.w += v.w;
            }
            bf16x4 o;
            o.h[0] = __floats2bfloat162_rn(s.x, s.y);
            o.h[1] = __floats2bfloat162_rn(s.z, s.w);
            o4[i] = o;
        }
        done = n4 << 2;
    }
    for (long long i = done + tid; i < count; i += stride) {
        float s = partials[i];
        for (int r = 1; r < n_ranks; ++r) s += partials[(long long)r * count + i];
        out[i] = f2bf(s);
    }
}

extern "C" __global__ void __launch_bounds__(TP_THREADS)
tp_concat_shards(unsigned char *out, const unsigned char *shards, int n_rows, int row_bytes,
                 int shard_bytes, int n_ranks) {
    const int r = blockIdx.x, k = blockIdx.y;
    if (r >= n_rows || k >= n_ranks) return;
    const long long first = (long long)k * shard_bytes;
    if (first >= row_bytes) return;  // a shard entirely in the padding
    const int span = (int)min((long long)shard_bytes, row_bytes - first);
    const unsigned char *src = shards + ((long long)k * n_rows + r) * shard_bytes;
    unsigned char *dst = out + (long long)r * row_bytes + first;
    if ((span & 15) == 0 && aligned16(src) && aligned16(dst)) {
        const uint4 *s = reinterpret_cast<const uint4 *>(src);
        uint4 *d = reinterpret_cast<uint4 *>(dst);
        for (int c = threadIdx.x; c < (span >> 4); c += blockDim.x) d[c] = __ldg(s + c);
    } else {
        for (int c = threadIdx.x; c < span; c += blockDim.x) dst[c] = src[c];
    }
}

extern "C" __global__ void __launch_bounds__(TP_THREADS)
tp_embedding_shard(float *out, const bf16 *table, const int *token_ids, int n_tokens,
                   int hidden, int vocab_start, int shard_rows) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const long long local = (long long)token_ids[t] - vocab_start;
    const bool mine = local >= 0 && local < shard_rows;
    float *o = out + (long long)t * hidden;
    const unsigned short *src =
        reinterpret_cast<const unsigned short *>(table) + (mine ? local : 0) * hidden;
    // the widening is exact (bits << 16), never a float operation, so nothing is flushed
    for (int c = threadIdx.x; c < hidden; c += blockDim.x)
        o[c] = mine ? __uint_as_float((unsigned int)src[c] << 16) : 0.0f;
}
