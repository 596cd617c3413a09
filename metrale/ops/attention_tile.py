"""Numpy twins of the flash-attention tiles: kernels/attention_tile.cuh (CUDA cores, shared
by prefill_attention and dense_attention) and the tensor-core tile of kernels/attention_tc.cu.

The CUDA-core tile walks 32-key tiles with an online softmax (running max m, sum l, rescaled
acc) in FP32 throughout; the closed form it computes per query row is

    p = exp2(s - max(s)),   out = (p @ V) / sum(p)                       (`attend_base2`)

over base-2 scores s = (q . k) * scale * log2(e), masked keys -inf. Both of its twins call
`attend_base2` with their own scores, so a change to this math lands once.

The tensor-core tile rounds P to BF16 before the P.V mma, against the running max of the key
tile it is in, so its closed form keeps the tiles (`attend_base2_bf16p`).

Options (attention_common.py): soft-capped scores are `softcap_base2` of the raw ones; a
learned sink (base-2 logit s2 per row) joins the denominator only:
    M = max(max(s), s2),  out = (exp2(s - M) @ V) / (sum exp2(s - M) + exp2(s2 - M)).

`gather_paged`: the paged K or V rows of one sequence that those twins attend over.
"""
from __future__ import annotations

import numpy as np

from ..errors import KernelError
from .attention_common import LOG2E
from .bf16 import bf16_to_f32, round_bf16


def softcap_base2(raw: np.ndarray, scale: float, softcap: float) -> np.ndarray:
    """Base-2 logits of raw scores q.k (float64): raw * scale * log2(e), or soft-capped
    softcap * log2(e) * tanh(raw * scale / softcap) when softcap > 0 (the kernels' float32
    factors, the tanh in float64)."""
    if softcap > 0:
        cap_in = float(np.float32(scale) / np.float32(softcap))
        return float(np.float32(softcap) * LOG2E) * np.tanh(raw * cap_in)
    return raw * float(np.float32(scale) * LOG2E)


def attend_base2(scores: np.ndarray, values: np.ndarray,
                 sink2: np.ndarray | None = None) -> np.ndarray:
    """Softmax-weighted values over the last axis of base-2 `scores`.

    scores [..., T] (masked keys -inf, at least one finite per row), values [..., T, D]
    -> [..., D] in the inputs' dtype (the prefill twin passes float64, the dense twin
    float32; the sum of p is taken in that dtype too). sink2 [..., 1]: each row's sink
    logit (base 2), in the denominator only.
    """
    m = scores.max(axis=-1, keepdims=True)
    if sink2 is not None:
        m = np.maximum(m, sink2)
    p = np.exp2(scores - m)
    den = p.sum(axis=-1, keepdims=True, dtype=p.dtype)
    if sink2 is not None:
        den = den + np.exp2(sink2 - m)
    return np.matmul(p, values) / den


def attend_base2_bf16p(scores: np.ndarray, values: np.ndarray, key_pos: np.ndarray,
                       tile: int, sink2: np.ndarray | None = None) -> np.ndarray:
    """What the tensor-core tile computes: the online softmax over key tiles of `tile`
    consecutive absolute positions (tile t = positions [t*tile, (t+1)*tile)), P rounded to
    BF16 against the running max when its tile is processed.

    scores [..., T] base-2 (masked keys -inf; taken as float32 like the kernel's S),
    values [..., T, D] float64, key_pos [T] consecutive increasing positions -> [..., D]
    float64. Per row, with M_t the running max through tile t (-inf -> 0):
        w_p = bf16(exp2(s_p - M_t(p))) * 2^(M_t(p) - M_last),  out = sum w v / sum w
    (the kernel's l sums the same rounded p, rescaled tile by tile). A row with no visible
    key gives 0, as the kernel. sink2 [..., 1]: each row's sink logit (base 2), added to the
    denominator against M = max(M_last, sink2) as the kernel does.
    """
    s = np.array(scores, dtype=np.float32)          # a copy of our own: modified in place
    first = int(key_pos[0]) // tile
    n_tiles = int(key_pos[-1]) // tile - first + 1
    front = int(key_pos[0]) - first * tile
    lead, T = s.shape[:-1], s.shape[-1]
    if front == 0 and T == n_tiles * tile:
        s_tiles = s.reshape(*lead, n_tiles, tile)
    else:   # keys padded to whole tiles with -inf (weight 0)
        s_tiles = np.full((*lead, n_tiles * tile), -np.inf, np.float32)
        s_tiles[..., front:front + T] = s
        s_tiles = s_tiles.reshape(*lead, n_tiles, tile)           # [..., n_tiles, tile]
    running = np.maximum.accumulate(s_tiles.max(axis=-1), axis=-1)  # [..., n_tiles]
    ref = np.where(running == -np.inf, np.float32(0), running)     # the kernel's mu
    s_tiles -= ref[..., None]
    np.exp2(s_tiles, out=s_tiles)
    p = round_bf16(s_tiles)                                         # pads and masked: 0
    scale = np.exp2(ref.astype(np.float64) - ref[..., -1:])        # per tile
    w = (p * scale[..., None]).reshape(*lead, n_tiles * tile)[..., front:front + T]  # [..., T]
    total = w.sum(axis=-1, keepdims=True)
    out = np.matmul(w, values)
    if sink2 is not None:   # against M = max(M_last, s2); rows that saw no key stay 0
        last = running[..., -1:].astype(np.float64)
        big = np.maximum(last, sink2)
        a = np.where(last == -np.inf, 0.0, np.exp2(last - big))
        den = total * a + np.exp2(sink2 - big)
        return out * (a / den)
    out /= np.where(total > 0, total, 1.0)
    return out


def gather_paged(ctx, cache_ptr, table, lo, hi, block_size, num_kv_heads, head_dim, what):
    """float32 [hi - lo, KV, D] of cached positions [lo, hi) through the block table."""
    blk_elems = block_size * num_kv_heads * head_dim
    b0, b1 = lo // block_size, (hi - 1) // block_size
    blocks = np.asarray(table[b0:b1 + 1], np.int64)
    if blocks.min() < 0:
        b = b0 + int(np.argmax(blocks < 0))
        raise KernelError(f"{what}: block table entry {b} is {int(table[b])} (< 0) "
                          "inside the sequence")
    # one bounds-checked read of the blocks [0, max + 1), then the table's blocks from it
    top = int(blocks.max()) + 1
    cache = ctx.read(cache_ptr, top * blk_elems, np.uint16).reshape(top, -1)
    flat = cache[blocks].reshape(-1, num_kv_heads, head_dim)
    off = lo - b0 * block_size
    return bf16_to_f32(flat[off:off + (hi - lo)])
