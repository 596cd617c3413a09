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
#include "common.cuh"

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
