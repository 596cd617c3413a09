"""gpt-oss's MXFP4 experts on the device, kept at their bytes (formats/quant/mxfp4.py has the
checkpoint layout, ops/mxfp4.py the values): blocks uint8 [E, n, k / 2] and scales uint8
[E, n, k / 32] per projection, the gate|up rows reordered from the checkpoint's interleaving
(gate = rows 0::2, up = 1::2) to gate rows then up rows, as the BF16 experts
(moe_weights.py). ops.moe_gemm.moe_gemm_mxfp4 dequantizes them inside its tiles."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..gpu_runtime.types import DevicePtr


@dataclass
class Mxfp4Experts:
    """One projection of every expert: W [E, n, k] as MXFP4 on the device."""
    blocks: DevicePtr     # uint8 [E, n, k / 2]
    scales: DevicePtr     # uint8 [E, n, k / 32]
    n: int
    k: int


def upload_mxfp4_experts(weights, up, meta, b: str) -> tuple[Mxfp4Experts, Mxfp4Experts]:
    """(gate_up, down) of the layer whose MoE block is at prefix `b` ("model.layers.{i}.mlp.")."""
    src = up.source
    h, i = meta.hidden_size, meta.moe.expert_intermediate_size
    out = []
    for proj, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
        blocks = np.asarray(src.read_raw(f"{b}experts.{proj}_blocks"))   # [E, n, k/32, 16]
        scales = np.asarray(src.read_raw(f"{b}experts.{proj}_scales"))   # [E, n, k/32]
        if proj == "gate_up_proj":   # [gate rows | up rows]
            order = np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])
            blocks, scales = blocks[:, order], scales[:, order]
        E = blocks.shape[0]
        out.append(Mxfp4Experts(
            weights._own(up.upload_bytes(np.ascontiguousarray(blocks).reshape(E, n, k // 2))),
            weights._own(up.upload_bytes(np.ascontiguousarray(scales))), n, k))
    return out[0], out[1]
