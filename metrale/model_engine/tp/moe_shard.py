"""A tensor-parallel rank's mixture-of-experts block (shard.py has the split): the router
whole, every expert's gate and up rows [s, s + I/N) fused as [gate | up] and its down
columns [s, s + I/N), stacked in moe_weights.py's layout; qwen2_moe's shared expert split
the same way, its one-row gate whole. A rank then runs the routing of every token (the
router is whole, so every rank routes alike) and every expert on its slice; moe.py sums
the ranks' FP32 partial combines in rank order (the runtime's reduce), as down_proj's."""
from __future__ import annotations

import numpy as np

from ...gpu_runtime.types import NULL
from ..moe_weights import MoeLayerWeights


def upload_moe_shard(w, meta, plan, layer: int) -> MoeLayerWeights | None:
    """Layer `layer`'s MoE block for rank `plan.rank`, uploaded through `w`
    (ShardedDecoderWeights: _read, _upload); None for a dense layer."""
    moe = meta.moe
    if moe is None or not moe.sparse_layers[layer]:
        return None
    b = f"model.layers.{layer}.{moe.block}."
    gate, up, down = moe.expert_proj
    a, z = plan.expert_start, plan.expert_start + plan.expert_intermediate
    gu = np.stack([np.concatenate([w._read(f"{b}experts.{e}.{gate}.weight")[a:z],
                                   w._read(f"{b}experts.{e}.{up}.weight")[a:z]])
                   for e in range(moe.num_experts)])
    dn = np.stack([np.ascontiguousarray(w._read(f"{b}experts.{e}.{down}.weight")[:, a:z])
                   for e in range(moe.num_experts)])
    shared_gate_up = shared_down = shared_gate = NULL
    if moe.shared_expert_intermediate_size:
        sa, sz = plan.shared_start, plan.shared_start + plan.shared_intermediate
        s = b + "shared_expert."
        shared_gate_up = w._upload(np.concatenate([w._read(s + "gate_proj.weight")[sa:sz],
                                                   w._read(s + "up_proj.weight")[sa:sz]]))
        shared_down = w._upload(np.ascontiguousarray(w._read(s + "down_proj.weight")[:, sa:sz]))
        shared_gate = w._whole(b + "shared_expert_gate.weight")
    return MoeLayerWeights(router=w._whole(b + "gate.weight"), gate_up=w._upload(gu),
                           down=w._upload(dn), shared_gate_up=shared_gate_up,
                           shared_down=shared_down, shared_gate=shared_gate)
