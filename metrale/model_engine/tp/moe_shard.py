"""A tensor-parallel rank's slice of a mixture-of-experts block (qwen2_moe, qwen3_moe,
mixtral; BF16 weights).

Two ways to split the experts over N ranks (the rank's `ShardPlan` says which):
  tensor parallel  (default) every expert's intermediate dimension I: rank r holds rows
                   [r * I/N, (r+1) * I/N) of every expert's gate and up projections (column
                   parallel) and those columns of its down projection (row parallel);
                   qwen2_moe's shared expert the same way over its own width S. Every rank
                   routes every token (the router and the shared expert's gate are whole on
                   each rank) and runs the grouped GEMMs over its slices; the combine kernel
                   writes the rank's FP32 partial of the block's output,
                       p_r[t] = sum_s w[t, s] * y_r[t, s]  +  sigmoid(g[t]) * shared_r[t]
                   (moe_combine_f32, slot order), and the ranks' partials are summed in rank
                   order and rounded once to BF16 by the dense layers' reduction
                   (runtime.py: `reduce`): one collective a layer, the bytes of a dense
                   down_proj's, batch-invariant.
  expert parallel  (`expert_parallel=True`, tp/expert_parallel.py) whole experts, rank r
                   holding experts [r * E // N, (r+1) * E // N); the shared expert whole.
Whole on every rank: the router, the shared expert's gate, the norms. Attention is split as
for a dense model (shard.py).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...errors import Unsupported
from ...gpu_runtime.types import NULL, DevicePtr
from ..moe_weights import MoeLayerWeights


def plan_experts(meta, rank: int, n: int, expert_parallel: bool, where: str) -> dict:
    """The ShardPlan fields of the rank's expert slice (empty for a dense model);
    Unsupported naming the field that cannot be split."""
    moe = meta.moe
    if moe is None:
        if expert_parallel:
            raise Unsupported(f"{where}: expert_parallel=True needs a mixture-of-experts "
                              "checkpoint (num_experts / num_local_experts in config.json)")
        return {}
    if moe.oss is not None:
        raise Unsupported(f"{where}: tensor_parallel_size={n}: gpt-oss experts run on one "
                          "device")
    E, inter = moe.num_experts, moe.expert_intermediate_size
    S = moe.shared_expert_intermediate_size
    if expert_parallel:
        if E < n:
            raise Unsupported(f"{where}: expert_parallel over tensor_parallel_size={n} ranks "
                              f"needs at least one expert a rank; num_experts={E}")
        start, end = rank * E // n, (rank + 1) * E // n
        return dict(expert_parallel=True, expert_start=start, local_experts=end - start,
                    expert_intermediate=inter, expert_inter_start=0,
                    shared_intermediate=S, shared_start=0)
    for field, value in (("moe_intermediate_size", inter),
                         ("shared_expert_intermediate_size", S)):
        if value % n:
            raise Unsupported(f"{where}: tensor_parallel_size={n} does not divide "
                              f"{field}={value} (an expert's intermediate dimension; "
                              "expert_parallel=True splits whole experts instead)")
    i = inter // n
    return dict(expert_parallel=False, expert_start=0, local_experts=E,
                expert_intermediate=i, expert_inter_start=rank * i,
                shared_intermediate=S // n, shared_start=rank * (S // n))


def rank_meta(meta, plan):
    """`meta` whose MoE block has the rank's expert and shared-expert intermediate widths
    (what the MoE pass and its buffers are sized by)."""
    if meta.moe is None:
        return meta
    return replace(meta, moe=replace(meta.moe, expert_intermediate_size=plan.expert_intermediate,
                                     shared_expert_intermediate_size=plan.shared_intermediate))


def moe_layer_bytes(meta, plan) -> int:
    """BF16 bytes of one sparse layer's MoE block on this rank."""
    moe, hid = meta.moe, meta.hidden_size
    total = moe.num_experts * hid                                   # router
    total += plan.local_experts * 3 * plan.expert_intermediate * hid
    if moe.shared_expert_intermediate_size:                         # shared expert, its gate
        total += 3 * plan.shared_intermediate * hid + hid
    return 2 * total


def upload_moe_shard(weights, meta, plan, layer: int) -> MoeLayerWeights | None:
    """Layer `layer`'s MoE block on this rank through `weights` (ShardedDecoderWeights: its
    `_read`, `_whole`, `_alloc` and uploader); None when the layer is dense. One expert's
    slices are in host memory at a time."""
    moe = meta.moe
    if moe is None or not moe.sparse_layers[layer]:
        return None
    b = f"model.layers.{layer}.{moe.block}."
    gate, upn, down = moe.expert_proj
    hid, i, i0 = meta.hidden_size, plan.expert_intermediate, plan.expert_inter_start
    experts = range(plan.expert_start, plan.expert_start + plan.local_experts)
    gate_up = weights._alloc(len(experts) * 2 * i * hid * 2)
    down_all = weights._alloc(len(experts) * hid * i * 2)
    for j, e in enumerate(experts):
        x = f"{b}experts.{e}."
        gu = np.concatenate([weights._read(x + gate + ".weight")[i0:i0 + i],
                             weights._read(x + upn + ".weight")[i0:i0 + i]])
        weights._up.upload_array(gu, DevicePtr(gate_up).offset(j * gu.nbytes))
        d = np.ascontiguousarray(weights._read(x + down + ".weight")[:, i0:i0 + i])
        weights._up.upload_array(d, DevicePtr(down_all).offset(j * d.nbytes))
    shared_gate_up = shared_down = shared_gate = NULL
    if moe.shared_expert_intermediate_size:
        s = (plan.shared_start, plan.shared_start + plan.shared_intermediate)
        shared_gate_up = weights._rows([(b + "shared_expert.gate_proj.weight", s),
                                        (b + "shared_expert.up_proj.weight", s)])
        shared_down = weights._columns(b + "shared_expert.down_proj.weight", s)
        shared_gate = weights._whole(b + "shared_expert_gate.weight")
    return MoeLayerWeights(router=weights._whole(b + "gate.weight"), gate_up=gate_up,
                           down=down_all, shared_gate_up=shared_gate_up,
                           shared_down=shared_down, shared_gate=shared_gate)
