"""A tensor-parallel rank's slice of a LoRA adapter: A sharded like its projection's input, B
like its output (the Megatron split of tp/shard.py):

  q|k|v, gate|up (column-parallel: the input whole, the output the rank's rows)
        A whole, B the rank's rows (its query heads, KV heads, intermediate slice)
  o, down (row-parallel: the input the rank's columns, the output whole after the combine)
        A the rank's columns, B whole
A row-parallel projection's x A^T on one rank is a partial sum over its columns; the ranks'
partials are gathered and added in rank order before the scale (lora_step.py, the expand's
`splits`), the delta added to the combined (whole) output once on every rank.
"""
from __future__ import annotations

import dataclasses

from ...formats.lora import LoraAdapter

ROW_PARALLEL = ("o", "down")


def shard_adapter(adapter: LoraAdapter, plan, head_dim: int) -> LoraAdapter:
    """`adapter`'s slice on rank `plan.rank` (tp/shard.py's ShardPlan)."""
    D = head_dim
    q = (plan.head_start * D, (plan.head_start + plan.num_heads) * D)
    kv = (plan.kv_head_start * D, (plan.kv_head_start + plan.num_kv_heads) * D)
    inter = (plan.inter_start, plan.inter_start + plan.intermediate)
    rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
            "mlp.gate_proj": inter, "mlp.up_proj": inter}
    cols = {"self_attn.o_proj": q, "mlp.down_proj": inter}
    out = []
    for m in adapter.modules:
        if m.kind in rows:
            a, b = rows[m.kind]
            out.append(dataclasses.replace(m, b=m.b[a:b].copy()))
        else:
            a, b = cols[m.kind]
            out.append(dataclasses.replace(m, a=m.a[:, a:b].copy()))
    return dataclasses.replace(adapter, modules=tuple(out))
