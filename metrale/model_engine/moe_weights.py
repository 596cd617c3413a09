"""A mixture-of-experts block's weights on the device (formats/moe_config.py has the
checkpoint layout).

Per sparse layer: the router [E, hidden]; every expert's gate and up projections stacked
into one `[E, 2 * I, hidden]` tensor (expert e's rows: its gate rows, then its up rows,
the fused gate|up layout of the dense MLP, so one grouped GEMM and the dense act_mul serve
them); the down projections stacked `[E, hidden, I]`; qwen2_moe's shared expert fused the
same way plus its gate `[1, hidden]`. The grouped GEMM (ops/moe_gemm.py) reads expert e at
`gate_up + e * 2I * hidden` elements.

DeepSeek's block (formats/deepseek_moe_config.py): the same expert layout, its shared experts
as one ungated MLP and the router's correction bias (`upload_deepseek_moe`).

gpt-oss (formats/gpt_oss_config.py) stores each layer's experts stacked and transposed,
`gate_up_proj` [E, hidden, 2I] with the gate and up columns interleaved (0::2, 1::2) and
`down_proj` [E, I, hidden], plus biases: uploaded in the layout above (gate rows, then up
rows; their biases likewise) with the router's bias beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..gpu_runtime.types import NULL, DevicePtr
from .linear import upload_linear
from .moe_quant import upload_quant_experts


@dataclass
class MoeLayerWeights:
    router: DevicePtr            # [E, hidden] (HF `gate.weight`)
    gate_up: object              # [E, 2 * I, hidden]: BF16 DevicePtr, Mxfp4Experts or
    down: object                 # [E, hidden, I]       QuantExperts (moe_quant.py)
    shared_gate_up: object       # [2 * S, hidden] or NULL (qwen2_moe's shared expert; a
    shared_down: object          # [hidden, S] or NULL   linear.py linear, BF16 or quantized)
    shared_gate: DevicePtr       # [1, hidden] or NULL (shared_expert_gate)
    router_bias: DevicePtr = NULL    # [E] (gpt-oss)
    gate_up_bias: DevicePtr = NULL   # [E, 2 * I], gate then up (gpt-oss)
    down_bias: DevicePtr = NULL      # [E, hidden] (gpt-oss)
    correction_bias: DevicePtr = NULL  # float32 [E] (DeepSeek-V3 e_score_correction_bias)


def upload_moe_layer(weights, up, meta, layer: int) -> MoeLayerWeights | None:
    """Upload layer `layer`'s MoE block through `up` (a WeightUploader) into buffers owned by
    `weights` (DecoderWeights: `_alloc` / `_own`); None when the layer is dense."""
    moe = meta.moe
    if moe is None or not moe.sparse_layers[layer]:
        return None
    h, i, E = meta.hidden_size, moe.expert_intermediate_size, moe.num_experts
    if moe.oss is not None:
        return _upload_oss_layer(weights, up, meta, f"model.layers.{layer}.mlp.", E)
    if moe.deepseek is not None:   # glm4_moe: DeepSeek's block under a GQA attention
        return upload_deepseek_moe(weights, up, meta, f"model.layers.{layer}.mlp.")
    b = f"model.layers.{layer}.{moe.block}."
    gate, upn, down = moe.expert_proj
    quant = (upload_quant_experts(weights, up, meta, b) if meta.quantization is not None
             else None)   # quantized experts (moe_quant.py), or None: BF16 in the checkpoint
    if quant is not None:
        gate_up, down_all = quant
    else:
        gate_up = weights._alloc(E * 2 * i * h * 2)
        up.upload_into([f"{b}experts.{e}.{p}.weight" for e in range(E) for p in (gate, upn)],
                       gate_up)
        down_all = weights._alloc(E * h * i * 2)
        up.upload_into([f"{b}experts.{e}.{down}.weight" for e in range(E)], down_all)
    shared_gate_up = shared_down = shared_gate = NULL
    s = moe.shared_expert_intermediate_size
    if s:   # BF16 or quantized linears (linear.py), as the dense MLP's
        src = up.source
        shared_gate_up = upload_linear(weights, up, src, meta, [b + "shared_expert.gate_proj",
                                                               b + "shared_expert.up_proj"])
        shared_down = upload_linear(weights, up, src, meta, [b + "shared_expert.down_proj"])
        shared_gate = weights._own(up.upload(b + "shared_expert_gate.weight"))
    return MoeLayerWeights(router=weights._own(up.upload(b + "gate.weight")), gate_up=gate_up,
                           down=down_all, shared_gate_up=shared_gate_up,
                           shared_down=shared_down, shared_gate=shared_gate)


def upload_deepseek_moe(weights, up, meta, b: str) -> MoeLayerWeights:
    """DeepSeek's MoE block under prefix `b` ("model.layers.{i}.mlp."; deepseek_v2 / v3,
    glm4_moe, glm4_moe_lite and DeepSeek-V3's MTP layer): the routed experts as above (BF16,
    or FP8 kept packed: moe_quant.py), the shared experts fused as one ungated MLP (BF16 or
    FP8 linears), the router's e_score_correction_bias as float32 whatever its stored dtype,
    as the router reads it."""
    moe = meta.moe
    E, h, i = moe.num_experts, meta.hidden_size, moe.expert_intermediate_size
    src = up.source
    quant = (upload_quant_experts(weights, up, meta, b) if meta.quantization is not None
             else None)
    if quant is not None:
        gate_up, down = quant
    else:
        gate_up = weights._alloc(E * 2 * i * h * 2)
        up.upload_into([f"{b}experts.{e}.{x}_proj.weight" for e in range(E)
                        for x in ("gate", "up")], gate_up)
        down = weights._alloc(E * h * i * 2)
        up.upload_into([f"{b}experts.{e}.down_proj.weight" for e in range(E)], down)
    shared_gate_up = shared_down = bias = NULL
    if moe.shared_expert_intermediate_size:
        shared_gate_up = upload_linear(weights, up, src, meta, [b + "shared_experts.gate_proj",
                                                                b + "shared_experts.up_proj"])
        shared_down = upload_linear(weights, up, src, meta, [b + "shared_experts.down_proj"])
    if moe.deepseek.correction_bias:
        name = b + "gate.e_score_correction_bias"
        f32 = (np.asarray(src.read_raw(name), np.float32)
               if src.tensor_dtype(name) == "F32" else
               (np.asarray(src.read_bf16(name)).astype(np.uint32) << 16).view(np.float32))
        bias = weights._alloc(E * 4)
        weights.backend.copy_h2d(np.ascontiguousarray(f32, np.float32), bias)
    return MoeLayerWeights(router=weights._own(up.upload(b + "gate.weight")),
                           gate_up=gate_up, down=down, shared_gate_up=shared_gate_up,
                           shared_down=shared_down, shared_gate=NULL, correction_bias=bias)


def _gate_then_up(a: np.ndarray, axis: int) -> np.ndarray:
    """gpt-oss's interleaved gate/up halves (0::2, 1::2 along `axis`) as [gate | up]."""
    ev = np.take(a, np.arange(0, a.shape[axis], 2), axis=axis)
    od = np.take(a, np.arange(1, a.shape[axis], 2), axis=axis)
    return np.concatenate([ev, od], axis=axis)


def _upload_oss_layer(weights, up, meta, b: str, E: int) -> MoeLayerWeights:
    """gpt-oss's stacked BF16 experts (or MXFP4 ones: moe_mxfp4.py) in the layout of this
    module's docstring."""
    src = up.source
    if meta.moe.oss.mxfp4:
        from .moe_mxfp4 import upload_mxfp4_experts
        gate_up, down = upload_mxfp4_experts(weights, up, meta, b)
    else:
        gu = np.asarray(src.read_bf16(b + "experts.gate_up_proj"))        # [E, h, 2I]
        gate_up = weights._own(up.upload_array(_gate_then_up(gu.transpose(0, 2, 1), 1)))
        dn = np.asarray(src.read_bf16(b + "experts.down_proj"))            # [E, I, h]
        down = weights._own(up.upload_array(dn.transpose(0, 2, 1)))
    gu_bias = np.asarray(src.read_bf16(b + "experts.gate_up_proj_bias"))   # [E, 2I]
    return MoeLayerWeights(
        router=weights._own(up.upload(b + "router.weight")), gate_up=gate_up, down=down,
        shared_gate_up=NULL, shared_down=NULL, shared_gate=NULL,
        router_bias=weights._own(up.upload(b + "router.bias")),
        gate_up_bias=weights._own(up.upload_array(_gate_then_up(gu_bias, 1))),
        down_bias=weights._own(up.upload(b + "experts.down_proj_bias")))
