"""The decoder stack of the hybrid linear-attention models as a launch sequence (the dense
decoders' is layers.py): pre-norm residual blocks whose RMSNorms are zero-centred and whose
token mixer is either a gated DeltaNet (linear_attn.py) or a gated full attention:

    residual = embed(ids)
    per layer:  x = norm1(residual)                       (layer 0: no add; w -> 1 + w)
                linear_attention: h = gated_deltanet(x)
                full_attention:   q|k|v = x @ Wqkv^T, g = x @ Wgate^T
                                  q, k = rmsnorm_heads(q, k) (1 + w); rope on the first
                                  rotary_dim dims (hybrid_weights.py); k, v to the cache
                                  o = attention(q, cache) * sigmoid(g); h = o @ Wo^T
                x = norm2(residual += h)
                h = act(x @ Wgate^T) * (x @ Wup^T) @ Wdown^T, or the MoE block (moe.py)
    out = final_norm(residual += h)
Every linear is the batch-invariant tensor-core GEMM (as layers.py), attention and the
recurrent kernels keep sequences apart: a row's bits never depend on the batch.
"""
from __future__ import annotations

from ..formats.field_table import HF_ACTIVATIONS
from ..ops import activation, gated_norm, rope
from .linear import run_embedding, run_linear
from .linear_attn import gdn_layer
from .moe import moe_mlp
from .paged_attention import paged_attention


def run_hybrid_decoder(model, stream: int, n: int, *, decode: bool, n_seqs: int,
                       max_q_len: int, out_ptr, embeds_uploaded: bool = False,
                       arena=None) -> None:
    """All layers over the `n` rows whose metadata (and recurrent step) is staged; the
    final-norm hidden states [n, hidden] go to `out_ptr` (layers.run_decoder's contract)."""
    b, ws, m, W = model.backend, model._ws, model._meta, model._weights
    hid, eps = m.hidden_size, m.rms_norm_eps
    if not embeds_uploaded:
        run_embedding(b, stream, ws.residual, W.embed_tokens, ws.token_ids, ws.h_tokens[:n],
                      n, hid, m.vocab_size)
    for i, L in enumerate(W.layers):
        if i == 0:
            gated_norm.rmsnorm_offset(b, stream, ws.normed, ws.residual, L.input_norm, n, hid,
                                      eps)
        else:
            gated_norm.rmsnorm_offset(b, stream, ws.normed, ws.hidden, L.input_norm, n, hid,
                                      eps, residual_ptr=ws.residual)
        if L.kind == "linear_attention":
            gdn_layer(model, stream, L, n)
        else:
            gated_attention(model, stream, L, n, decode, n_seqs, max_q_len)
        gated_norm.rmsnorm_offset(b, stream, ws.normed, ws.hidden, L.post_norm, n, hid, eps,
                                  residual_ptr=ws.residual)
        if L.moe is not None:
            moe_mlp(model, stream, n, L.moe)
            continue
        inter = m.intermediate_size
        run_linear(b, stream, ws.gate_up, ws.normed, L.gate_up, n, 2 * inter, hid)
        activation.act_mul(b, stream, ws.act, ws.gate_up, n, inter, HF_ACTIVATIONS[m.hidden_act])
        run_linear(b, stream, ws.hidden, ws.act, L.down_proj, n, hid, inter)
    gated_norm.rmsnorm_offset(b, stream, out_ptr, ws.hidden, W.norm, n, hid, eps,
                              residual_ptr=ws.residual)


def gated_attention(model, stream: int, L, n: int, decode: bool, n_seqs: int,
                    max_q_len: int) -> None:
    """ws.hidden[n, hidden] = the gated full attention of ws.normed (layer weights L)."""
    b, ws, hb, m = model.backend, model._ws, model._hb, model._meta
    H, KV, D, hid = m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size
    run_linear(b, stream, ws.qkv, ws.normed, L.qkv, n, ws.qkv_dim, hid)
    run_linear(b, stream, hb.gate, ws.normed, L.gate, n, H * D, hid)
    gated_norm.rmsnorm_offset_heads(b, stream, ws.qkv, L.q_norm, L.k_norm, n, H, KV, D,
                                    ws.qkv_dim, m.rms_norm_eps)
    kc, vc = ws.k_cache(L.kv_index), ws.v_cache(L.kv_index)
    rope.rope_write_kv(b, stream, ws.qkv, ws.positions, model._rope_table, kc, vc,
                       ws.slot_mapping, n, H, KV, D, model._max_positions)
    paged_attention(model, stream, kc, vc, ws.block_tables, n, decode, n_seqs, max_q_len, H,
                    KV, D)
    gated_norm.sigmoid_gate_mul(b, stream, ws.attn_out, hb.gate, n, H * D, H * D)
    run_linear(b, stream, ws.hidden, ws.attn_out, L.o_proj, n, hid, H * D)
