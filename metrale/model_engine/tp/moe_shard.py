"""A tensor-parallel rank's mixture-of-experts block (shard.py has the split): the router
whole, every expert's gate and up rows [s, s + I/N) fused as [gate | up] and its down
columns [s, s + I/N), stacked in moe_weights.py's layout; qwen2_moe's shared expert split
the same way, its one-row gate whole. A rank then runs the routing of every token (the
router is whole, so every rank routes alike) and every expert on its slice; moe.py sums
the ranks' FP32 partial combines in rank order (the runtime's reduce), as down_proj's.
Quantized experts are cut packed (quant_shard.py: gate/up rows, down columns) into
moe_quant.py's layout; a block the config quantizes in part goes up BF16, dequantized.
Expert parallel (plan.expert_parallel): the same uploads over the rank's range of whole
experts [first_expert, + local_experts) (a whole width: nothing is cut, quantized experts
stay packed as released), the shared expert whole (tp/expert_parallel.py runs them)."""
from __future__ import annotations

import numpy as np

from ...formats.quant.fp8 import concat_fp8
from ...formats.quant.int4 import HostQ4, concat_q4
from ...formats.quant.layout import dequant_bits, linear_shapes
from ...gpu_runtime.types import NULL
from ..moe_quant import tables_everywhere, upload_fp8_experts, upload_q4_experts
from ..moe_weights import MoeLayerWeights
from . import quant_shard


def upload_moe_shard(w, meta, plan, layer: int) -> MoeLayerWeights | None:
    """Layer `layer`'s MoE block for rank `plan.rank`, uploaded through `w`
    (ShardedDecoderWeights: _read, _upload); None for a dense layer."""
    moe = meta.moe
    if moe is None or not moe.sparse_layers[layer]:
        return None
    b = f"model.layers.{layer}.{moe.block}."
    a, z = plan.expert_start, plan.expert_start + plan.expert_intermediate
    experts = range(plan.first_expert, plan.first_expert + plan.local_experts)
    quant = _quantized_experts(w, meta, b, (a, z), experts)   # None: BF16 (or in part)
    gate_up, down_all = (quant if quant is not None
                         else _bf16_experts(w, meta, b, (a, z), experts))
    shared_gate_up = shared_down = shared_gate = NULL
    if moe.shared_expert_intermediate_size:
        sa, sz = plan.shared_start, plan.shared_start + plan.shared_intermediate
        s = b + "shared_expert."
        shared_gate_up = w._linear_rows([(s + "gate_proj", (sa, sz)), (s + "up_proj", (sa, sz))])
        shared_down = w._linear_columns(s + "down_proj", (sa, sz))
        shared_gate = w._whole(b + "shared_expert_gate.weight")
    return MoeLayerWeights(router=w._whole(b + "gate.weight"), gate_up=gate_up,
                           down=down_all, shared_gate_up=shared_gate_up,
                           shared_down=shared_down, shared_gate=shared_gate)


def _bf16_experts(w, meta, b: str, span, experts):
    """gate_up [E', 2 I/N, h] and down [E', h, I/N] (E' the rank's `experts`) as BF16, each expert linear read as BF16
    or, where the config quantizes it, dequantized (ops.gemm_q's formula) then sliced."""
    moe, (a, z) = meta.moe, span
    gate, up, down = moe.expert_proj
    qc = meta.quantization

    def bits(m):
        if qc is None or not qc.converts(m):
            return w._read(m + ".weight")
        n, k = linear_shapes(meta, w._source.tensor_names())[m]
        return dequant_bits(qc.read(w._source, m, n, k))
    gu = np.stack([np.concatenate([bits(f"{b}experts.{e}.{gate}")[a:z],
                                   bits(f"{b}experts.{e}.{up}")[a:z]])
                   for e in experts])
    dn = np.stack([np.ascontiguousarray(bits(f"{b}experts.{e}.{down}")[:, a:z])
                   for e in experts])
    return w._upload(gu), w._upload(dn)


def _quantized_experts(w, meta, b: str, span, experts):
    """(gate_up, down) QuantExperts of the rank's slices when the config quantizes every
    expert linear of the block (quant_shard.py cuts each), else None."""
    qc, moe, (a, z) = meta.quantization, meta.moe, span
    if qc is None:
        return None
    gate, up, down = moe.expert_proj
    mods = [[f"{b}experts.{e}.{p}" for p in (gate, up, down)] for e in experts]
    every = [f"{b}experts.{e}.{p}" for p in (gate, up, down) for e in range(moe.num_experts)]
    if not all(qc.converts(m) for m in every):   # (the same choice on every rank)
        return None
    shapes = linear_shapes(meta, w._source.tensor_names())

    def host(m):
        return qc.read(w._source, m, *shapes[m])
    hosts = [[quant_shard.rows(host(g), a, z), quant_shard.rows(host(u), a, z),
              quant_shard.columns(host(d), a, z)] for g, u, d in mods]
    h, i = meta.hidden_size, z - a
    if isinstance(hosts[0][0], HostQ4):
        tables_everywhere(hosts)
        gu = upload_q4_experts(w, w._up, [concat_q4([r[0], r[1]]) for r in hosts], 2 * i, h)
        dn = upload_q4_experts(w, w._up, [r[2] for r in hosts], h, i)
    else:
        gu = upload_fp8_experts(w, w._up, [concat_fp8([r[0], r[1]]) for r in hosts], 2 * i, h)
        dn = upload_fp8_experts(w, w._up, [r[2] for r in hosts], h, i)
    w.held += gu.nbytes + dn.nbytes
    return gu, dn
