// Paged KV cache write: copy each token's k and v heads from the fused projection buffer
// into its cache slot.
//
//   slot = slot_mapping[t];  if slot < 0: skip (padding token)
//   k_cache[slot, :] = qkv[t, H*D     : (H+KV)*D]
//   v_cache[slot, :] = qkv[t, (H+KV)*D : (H+2KV)*D]
//
// Shapes: qkv [n_tokens, (H + 2*KV) * D] bf16; slot_mapping [n_tokens] int32;
//         k_cache, v_cache [num_blocks, block_size, KV, D] bf16, i.e. rows [num_slots, KV*D]
//         with slot = block_id * block_size + offset.
// Launch: grid (n_tokens), block 128. 128-bit copies when D % 8 == 0 and every pointer is
//         16-byte aligned, else 16-bit copies.
// Restrictions: D even, 2 <= D <= 256; slots are not bounds-checked here (the block pool
//         hands them out; the numpy twin checks them against the allocation).
#include "common.cuh"

#define WRITE_KV_THREADS 128

extern "C" __global__ void __launch_bounds__(WRITE_KV_THREADS)
write_kv(const bf16 *qkv, bf16 *k_cache, bf16 *v_cache, const int *slot_mapping,
         int n_tokens, int num_heads, int num_kv_heads, int head_dim) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int row = num_kv_heads * head_dim;
    const bf16 *src_k = qkv + (long long)t * (num_heads + 2 * num_kv_heads) * head_dim
                            + (long long)num_heads * head_dim;
    const bf16 *src_v = src_k + row;
    bf16 *dst_k = k_cache + (long long)slot * row;
    bf16 *dst_v = v_cache + (long long)slot * row;
    const bool vec = (head_dim % 8 == 0) &&
        ((((unsigned long long)qkv | (unsigned long long)k_cache |
           (unsigned long long)v_cache) & 15ull) == 0);
    if (vec) {
        const int n8 = row >> 3;
        const bf16x8 *sk = reinterpret_cast<const bf16x8 *>(src_k);
        const bf16x8 *sv = reinterpret_cast<const bf16x8 *>(src_v);
        bf16x8 *dk = reinterpret_cast<bf16x8 *>(dst_k);
        bf16x8 *dv = reinterpret_cast<bf16x8 *>(dst_v);
        for (int i = threadIdx.x; i < n8; i += WRITE_KV_THREADS) {
            const bf16x8 a = sk[i], b = sv[i];
            dk[i] = a;
            dv[i] = b;
        }
    } else {
        for (int i = threadIdx.x; i < row; i += WRITE_KV_THREADS) {
            const bf16 a = src_k[i], b = src_v[i];
            dst_k[i] = a;
            dst_v[i] = b;
        }
    }
}
