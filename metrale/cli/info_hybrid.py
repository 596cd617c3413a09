"""`metrale info` for a hybrid linear-attention checkpoint: its recurrent layers, the state
each sequence holds and the state pool a load with default options allocates, and the
device memory estimate with them (KV cache of the full-attention layers only)."""
from __future__ import annotations

from dataclasses import replace


def hybrid_info(meta, context: int, batch: int) -> dict:
    """The recurrent part of `info` for a model loaded with max_batch=batch and the default
    pool options (max_sequences = ssm_prefix_states = batch, ssm_verify_states 8)."""
    from ..model_engine.hybrid_buffers import HybridBuffers
    from ..model_engine.state_arena import StateArena
    from ..model_engine.workspace import Workspace
    hy = meta.hybrid
    kv_meta = replace(meta, num_layers=len(hy.attention_layers))
    slots = batch + 1 + 8 + batch   # live, sink, verify, prefix
    state_el, conv_el = hy.state_shape()
    n_rec = len(hy.recurrent_layers)
    pool = StateArena.estimate_bytes(n_rec, state_el, conv_el, slots)
    rows = max(batch, 16)
    bs = 16
    ws = Workspace.estimate_bytes(kv_meta, max_tokens=2048, max_rows=rows,
                                  num_blocks=-(-context // bs) * batch, block_size=bs,
                                  max_blocks_per_seq=-(-context // bs), fp32_logits=False)
    return {
        "kind": "Mamba2" if hy.mamba is not None else "gated-DeltaNet",
        "recurrent_layers": n_rec, "attention_layers": len(hy.attention_layers),
        "state_bytes_per_sequence": StateArena.estimate_bytes(n_rec, state_el, conv_el, 1),
        "state_pool_slots": slots, "state_pool_bytes": pool,
        "kv_state_workspaces_bytes": ws + pool + HybridBuffers.estimate_bytes(
            meta, max(2048, rows)),
    }


def print_hybrid(info: dict, human_bytes) -> None:
    r = info["recurrent"]
    print(f"recurrent      {r['recurrent_layers']} {r['kind']} layers (state "
          f"{human_bytes(r['state_bytes_per_sequence'])} per sequence, FP32 + its BF16 conv "
          f"window), {r['attention_layers']} full-attention layers")
    print(f"state pool     {human_bytes(r['state_pool_bytes'])}: {r['state_pool_slots']} slots "
          f"(batch {info['batch']} live + the sink + 8 verify states + {info['batch']} prefix "
          "states; load options max_sequences, ssm_verify_states, ssm_prefix_states)")


def hybrid_math(meta) -> dict[str, str]:
    """The `math` fields of a hybrid (they replace the dense decoders' attention lines)."""
    hy, g, mb = meta.hybrid, meta.hybrid.gdn, meta.hybrid.mamba

    def layers(ix):
        return ", ".join(str(i) for i in ix)
    if mb is not None:
        mlp = [i for i, t in enumerate(hy.layer_types) if t == "mlp"]
        return {"rope": "none (no rotary embedding)",
                "attention": f"full attention, no rotary, on layers {layers(hy.attention_layers)}",
                "activation": f"relu2 MLP on layers {layers(mlp)}: down(relu(up(x))^2)",
                "qk_norm": "none", "norms": "RMSNorm rounding once: bf16(x * inv * w)",
                "mamba2": (f"on layers {layers(hy.recurrent_layers)}: {mb.num_heads} heads x "
                           f"{mb.head_dim}, d_state {mb.d_state}, {mb.n_groups} groups, conv "
                           f"{mb.conv_kernel}{' + bias' if mb.conv_bias else ''} + SiLU, chunk "
                           f"{mb.chunk_size}, dt limit ({mb.dt_min:g}, {mb.dt_max:g}) in "
                           "prefill, FP32 state, gated RMSNorm (silu(z) first) in "
                           f"{mb.n_groups} groups")}
    out = {"attention": (f"gated full attention on layers {layers(hy.attention_layers)} "
                         "(attn * sigmoid(gate), the gate from q_proj)"),
           "qk_norm": "RMSNorm (1 + w) on each q/k head",
           "rotary": f"the first {hy.rotary_dim} of {meta.head_dim} dims of each head",
           "norms": "zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w)"}
    if g is not None:
        out["linear attn"] = (f"gated DeltaNet on layers {layers(hy.recurrent_layers)}: "
                              f"{g.num_k_heads} key / {g.num_v_heads} value heads x "
                              f"{g.k_head_dim} / {g.v_head_dim}, conv {g.conv_kernel} + SiLU, "
                              "FP32 state, gated RMSNorm (norm, then silu(z))"
                              + ("; in_proj_qkvz / in_proj_ba regrouped at load"
                                 if g.fused_projections else ""))
    return out
