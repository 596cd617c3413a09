"""DeepSeek's multi-head latent attention as a layer pass (formats/deepseek_config.py has the
math), and its device buffers. For the `n` token rows of a step:

    q   = x @ Wq^T | rmsnorm(x @ Wqa^T; q_a_layernorm) @ Wqb^T    gemm_tc (+ rmsnorm)  [n, H, nope+rope]
    c   = rmsnorm(x @ Wc^T; kv_a_layernorm), kr = x @ Wkr^T      gemm_tc, rmsnorm     [n, R], [n, rope]
          (Wc / Wkr: the kv_lora_rank and the qk_rope_head_dim rows of kv_a_proj_with_mqa)
    rope(q tails, kr); the cache row [c | kr] at the token's slot   mla_rope_cache
    qa  = [q_nope_h @ W_UK_h | q_rope_h]                           mla_absorb_q         [n, H, R+rope]
    lat = softmax(scale qa . rows) rows[:R] over the latent cache  attention_mla           [n, H, R]
    o   = lat_h @ W_UV_h^T                                         mla_expand_v         [n, H, v]
Decode, verify and prefill run the same absorbed attention (prefill's rows see their causal
prefix through qo_indptr), so a position's bits are the same whichever path computes it;
prefill never expands keys and values, the cache holds only the latent. Rows go through
the attention MLA_CHUNK_ROWS at a time (the split-K workspace's rows).
"""
from __future__ import annotations

from ..gpu_runtime.types import NULL
from ..ops import attention_mla, mla_project, rmsnorm
from .linear import run_linear

# Query rows per attention launch: the split-K workspace holds rows x H x splits x
# (kv_lora_rank + 2) floats (V3 at 163840 positions: 2.7 GB for 16 rows), so larger decode
# batches and prefill chunks run in launches of 16 rows (rows are independent: same bits)
MLA_CHUNK_ROWS = 16


class MlaBuffers:
    """The MLA pass's buffers for up to `tokens` rows (attention workspace: `rows` rows at a
    time over sequences of up to `max_len` positions), allocated through `alloc` (the
    workspace's, which frees them)."""

    def __init__(self, alloc, meta, tokens: int, rows: int, max_len: int) -> None:
        self.chunk_rows = rows
        self.max_splits = attention_mla.mla_max_splits(max_len)
        for name, nbytes in self.layout(meta, tokens, rows, max_len).items():
            setattr(self, name, alloc(nbytes) if nbytes else NULL)

    @staticmethod
    def layout(meta, T: int, rows: int, max_len: int) -> dict[str, int]:
        a, H = meta.mla, meta.num_heads
        R, dr = a.kv_lora_rank, a.qk_rope_head_dim
        splits = attention_mla.mla_max_splits(max_len)
        return {
            "q_a": T * a.q_lora_rank * 2, "q_a_normed": T * a.q_lora_rank * 2,
            "q": T * H * a.qk_head_dim * 2,
            "c_raw": T * R * 2, "c": T * R * 2, "kr": T * dr * 2,
            "qa": T * H * (R + dr) * 2, "lat": T * H * R * 2,
            "o": T * H * a.v_head_dim * 2,
            "attn_ws": attention_mla.mla_workspace_bytes(rows, H, R, splits),
        }

    @staticmethod
    def estimate_bytes(meta, T: int, rows: int, max_len: int) -> int:
        return sum(MlaBuffers.layout(meta, T, rows, max_len).values())


def mla_attention(model, stream: int, n: int, layer: int, L, n_seqs: int, cache=None) -> None:
    """ws.mla.o [n, H * v_head_dim] (bf16) = the latent attention of ws.normed [n, hidden]
    for layer `layer` (L: its MlaLayerWeights); the rows' latents go to the layer's cache
    at ws.slot_mapping first (`cache`: another latent cache of the pool's layout, the MTP
    layer's)."""
    b, ws, m = model.backend, model._ws, model._meta
    a, mb, H, hid, eps = m.mla, ws.mla, m.num_heads, m.hidden_size, m.rms_norm_eps
    R, dn, dr, dv = a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    if a.q_lora_rank:
        run_linear(b, stream, mb.q_a, ws.normed, L.q_a, n, a.q_lora_rank, hid)
        rmsnorm.rmsnorm(b, stream, mb.q_a_normed, mb.q_a, L.q_a_norm, n, a.q_lora_rank, eps)
        run_linear(b, stream, mb.q, mb.q_a_normed, L.q_b, n, H * a.qk_head_dim, a.q_lora_rank)
    else:
        run_linear(b, stream, mb.q, ws.normed, L.q_proj, n, H * a.qk_head_dim, hid)
    run_linear(b, stream, mb.c_raw, ws.normed, L.kv_a_c, n, R, hid)
    run_linear(b, stream, mb.kr, ws.normed, L.kv_a_kr, n, dr, hid)
    rmsnorm.rmsnorm(b, stream, mb.c, mb.c_raw, L.kv_a_norm, n, R, eps)
    cache = ws.k_cache(layer) if cache is None else cache
    mla_project.mla_rope_cache(b, stream, mb.q, mb.c, mb.kr, ws.positions,
                               model._layer_rope[layer], cache, ws.slot_mapping, n, H, dn, dr,
                               R, model._rope_rows, a.rope_pairs_adjacent)
    mla_project.mla_absorb_q(b, stream, mb.qa, mb.q, L.kv_b, n, H, dn, dr, dv, R)
    for r0 in range(0, n, mb.chunk_rows):
        rows = min(mb.chunk_rows, n - r0)
        attention_mla.attention_mla(b, stream, mb.lat.offset(r0 * H * R * 2),
                              mb.qa.offset(r0 * H * (R + dr) * 2), cache, ws.block_tables,
                              ws.kv_lens, rows, H, R, dr, model._block_size,
                              ws.max_blocks_per_seq, a.softmax_scale, mb.attn_ws,
                              mb.max_splits, qo_indptr_ptr=ws.qo_indptr, n_seqs=n_seqs,
                              row_base=r0)
    mla_project.mla_expand_v(b, stream, mb.o, mb.lat, L.kv_b, n, H, dn, dv, R)
