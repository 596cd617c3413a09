"""A mixture-of-experts block's weights on the device (formats/moe_config.py has the
checkpoint layout).

Per sparse layer: the router [E, hidden]; every expert's gate and up projections stacked
into one `[E, 2 * I, hidden]` tensor (expert e's rows: its gate rows, then its up rows,
the fused gate|up layout of the dense MLP, so one grouped GEMM and the dense act_mul serve
them); the down projections stacked `[E, hidden, I]`; qwen2_moe's shared expert fused the
same way plus its gate `[1, hidden]`. The grouped GEMM (ops/moe_gemm.py) reads expert e at
`gate_up + e * 2I * hidden` elements.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..gpu_runtime.types import NULL, DevicePtr


@dataclass
class MoeLayerWeights:
    router: DevicePtr            # [E, hidden] (HF `gate.weight`)
    gate_up: DevicePtr           # [E, 2 * I, hidden]
    down: DevicePtr              # [E, hidden, I]
    shared_gate_up: DevicePtr    # [2 * S, hidden] or NULL (qwen2_moe's shared expert)
    shared_down: DevicePtr       # [hidden, S] or NULL
    shared_gate: DevicePtr       # [1, hidden] or NULL (shared_expert_gate)


def upload_moe_layer(weights, up, meta, layer: int) -> MoeLayerWeights | None:
    """Upload layer `layer`'s MoE block through `up` (a WeightUploader) into buffers owned by
    `weights` (DecoderWeights: `_alloc` / `_own`); None when the layer is dense."""
    moe = meta.moe
    if moe is None or not moe.sparse_layers[layer]:
        return None
    h, i, E = meta.hidden_size, moe.expert_intermediate_size, moe.num_experts
    b = f"model.layers.{layer}.{moe.block}."
    gate, upn, down = moe.expert_proj
    gate_up = weights._alloc(E * 2 * i * h * 2)
    up.upload_into([f"{b}experts.{e}.{p}.weight" for e in range(E) for p in (gate, upn)],
                   gate_up)
    down_all = weights._alloc(E * h * i * 2)
    up.upload_into([f"{b}experts.{e}.{down}.weight" for e in range(E)], down_all)
    shared_gate_up = shared_down = shared_gate = NULL
    s = moe.shared_expert_intermediate_size
    if s:
        shared_gate_up = weights._alloc(2 * s * h * 2)
        up.upload_into([b + "shared_expert.gate_proj.weight", b + "shared_expert.up_proj.weight"],
                       shared_gate_up)
        shared_down = weights._own(up.upload(b + "shared_expert.down_proj.weight"))
        shared_gate = weights._own(up.upload(b + "shared_expert_gate.weight"))
    return MoeLayerWeights(router=weights._own(up.upload(b + "gate.weight")), gate_up=gate_up,
                           down=down_all, shared_gate_up=shared_gate_up,
                           shared_down=shared_down, shared_gate=shared_gate)
