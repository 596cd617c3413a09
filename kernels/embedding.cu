// Token embedding gather.
//
//   out[t, :] = table[ids[t], :]   if 0 <= ids[t] < vocab,   else 0 (zeros, nothing read)
//
// Shapes: table bf16 [vocab, hidden], ids int32 [n_tokens] (device), out bf16
// [n_tokens, hidden]. The model checks ids on the host before launch; the zero row is the
// kernel's defined, memory-safe answer to a bad id, not an error path.
// Launch: grid (n_tokens), block EMB_THREADS (128); the CTA of token t copies its row with
// 128-bit accesses (8 bf16) when hidden % 8 == 0 and table, out are 16-byte aligned, else
// element by element. Pure copy: memory-bound, 4 * hidden bytes per token.
//
// GGUF tables kept at their bytes (embedding_gguf_{type}, type the lower-case ggml name of
// ops/gguf_planes.PACKED: q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, q2_k, q3_k, q4_k, q5_k, q6_k,
// iq4_xs), rows dequantized on lookup:
//
//   out[t, :] = dequant_bf16(W)[ids[t], :]
//
// embedding_gguf_{type}(bf16 *out, const int *ids, const unsigned char *q,
//                       const unsigned char *qh, const unsigned char *meta, int n_tokens, int k)
// W [vocab, k] in the type's planes (q 16-byte aligned; qh, NULL for types without high
// bits, and meta at ops/gemm_gguf.plane_alignment), out bf16 [n_tokens, k], k % QK == 0.
// Every value is gguf_format.cuh's: the bits of ops/gguf_planes.dequant_bf16 (the load-time
// dequantizer's), the sign of zero included. ids are checked by the launcher (ops/
// embedding.py: 0 <= id < vocab; the kernel has no vocab to check against). Launch: grid
// (n_tokens), block EMB_THREADS (128), no dynamic shared memory; thread i dequantizes the
// 16-element runs i, i + 128, ... of the row (one sub-block's scales a run, the codes by one
// 32- to 128-bit __ldg) into two 16-byte stores (element stores when out is not 16-byte
// aligned). Memory-bound: a row's packed bytes in, 2 * k bytes out.
#include "common.cuh"
#include "gguf_format.cuh"

#define EMB_THREADS 128

extern "C" __global__ void __launch_bounds__(EMB_THREADS)
embedding(bf16 *out, const bf16 *table, const int *token_ids, int n_tokens, int hidden,
          int vocab) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int id = token_ids[t];
    const bool valid = id >= 0 && id < vocab;
    bf16 *o = out + (long long)t * hidden;
    const bf16 *src = table + (long long)(valid ? id : 0) * hidden;
    if ((hidden & 7) == 0 && aligned16(table) && aligned16(out)) {
        bf16x8 *ov = reinterpret_cast<bf16x8 *>(o);
        const uint4 *sv = reinterpret_cast<const uint4 *>(src);
        for (int c = threadIdx.x; c < (hidden >> 3); c += blockDim.x) {
            const uint4 v = valid ? __ldg(sv + c) : make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4 *>(ov + c) = v;
        }
    } else {
        const unsigned short *s16 = reinterpret_cast<const unsigned short *>(src);
        unsigned short *o16 = reinterpret_cast<unsigned short *>(o);
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) o16[c] = valid ? s16[c] : 0;
    }
}

template <int TYPE>
__device__ __forceinline__ void embedding_gguf(bf16 *out, const int *token_ids,
                                               const unsigned char *q, const unsigned char *qh,
                                               const unsigned char *meta, int n_tokens, int k) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const long long j = token_ids[t];   // 0 <= j < vocab: the launcher checks
    unsigned short *o = reinterpret_cast<unsigned short *>(out + (long long)t * k);
    const bool vec = aligned16(out);    // k % 32 == 0: every row start is aligned then
    for (int r = threadIdx.x; r < (k >> 4); r += blockDim.x) {
        uint4 v[2];
        gguf_row_run16<TYPE>(q, qh, meta, j, k, r, v[0], v[1]);
        if (vec) {
            reinterpret_cast<uint4 *>(o)[2 * r] = v[0];
            reinterpret_cast<uint4 *>(o)[2 * r + 1] = v[1];
        } else {
            const unsigned int w[8] = {v[0].x, v[0].y, v[0].z, v[0].w,
                                       v[1].x, v[1].y, v[1].z, v[1].w};
#pragma unroll
            for (int e = 0; e < 16; ++e)
                o[16 * r + e] = (unsigned short)(w[e >> 1] >> (16 * (e & 1)));
        }
    }
}

#define EMBEDDING_GGUF_ENTRY(NAME, TYPE)                                                      \
    extern "C" __global__ void __launch_bounds__(EMB_THREADS) embedding_gguf_##NAME(          \
        bf16 *out, const int *token_ids, const unsigned char *q, const unsigned char *qh,     \
        const unsigned char *meta, int n_tokens, int k) {                                     \
        embedding_gguf<TYPE>(out, token_ids, q, qh, meta, n_tokens, k);                        \
    }

EMBEDDING_GGUF_ENTRY(q4_0, GGML_Q4_0)
EMBEDDING_GGUF_ENTRY(q4_1, GGML_Q4_1)
EMBEDDING_GGUF_ENTRY(q5_0, GGML_Q5_0)
EMBEDDING_GGUF_ENTRY(q5_1, GGML_Q5_1)
EMBEDDING_GGUF_ENTRY(q8_0, GGML_Q8_0)
EMBEDDING_GGUF_ENTRY(iq4_nl, GGML_IQ4_NL)
EMBEDDING_GGUF_ENTRY(q2_k, GGML_Q2_K)
EMBEDDING_GGUF_ENTRY(q3_k, GGML_Q3_K)
EMBEDDING_GGUF_ENTRY(q4_k, GGML_Q4_K)
EMBEDDING_GGUF_ENTRY(q5_k, GGML_Q5_K)
EMBEDDING_GGUF_ENTRY(q6_k, GGML_Q6_K)
EMBEDDING_GGUF_ENTRY(iq4_xs, GGML_IQ4_XS)
