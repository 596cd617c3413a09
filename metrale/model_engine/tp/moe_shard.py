"""A tensor-parallel rank's slice of a mixture-of-experts block (qwen2_moe, qwen3_moe,
mixtral; BF16 weights), and the fixed-order combine of the ranks' expert outputs.

Two ways to split the experts over N ranks (the rank's `ShardPlan` says which):
  tensor parallel  (default) every expert's intermediate dimension I: rank r holds rows
                   [r * I/N, (r+1) * I/N) of every expert's gate and up projections (column
                   parallel) and those columns of its down projection (row parallel). Every
                   rank routes every token (the router is whole on each rank) and runs the
                   grouped GEMMs over its slice; a token's expert outputs are then partial
                   sums over the ranks, combined below.
  expert parallel  (`expert_parallel=True`, tp/expert_parallel.py) whole experts, rank r
                   holding experts [r * E // N, (r+1) * E // N).
Whole on every rank (replicated): the router, qwen2_moe's shared expert and its sigmoid gate
(a few percent of a layer's expert bytes; each rank computes the shared term of every
token in float32), the norms. Attention is split as for a dense model (shard.py).

The tensor-parallel combine keeps every partial in float32 until one BF16 rounding:
each rank all-gathers the other ranks' partial expert outputs y^r[t, s] ([n * k, hidden]
float32), lays them out as k * N slots per token in (slot, rank) order (tp_concat_shards)
and runs the single-device combine kernel over them with each slot weight repeated N times:
    out[t] = bf16( sum over s, then r, of w[t, s] * y^r[t, s]  +  sigmoid(g[t]) * shared[t] )
in that fixed order, on every rank alike: a token's bits do not depend on its batch, and
every rank ends with the whole [n, hidden] rows, as after a dense layer's reduction. Cost:
each rank receives (N - 1) * k * 4 bytes per element of hidden per token, k times a dense
layer's gather (benchmarks/results/tp_allreduce_model.md has the model).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...errors import Unsupported
from ...gpu_runtime.types import NULL, DevicePtr
from ...ops import moe_combine as moe_combine_op
from ...ops import tensor_parallel
from ..moe_weights import MoeLayerWeights

# Largest gathered expert partials (N * tokens * k * hidden * 4 bytes) one combine launch
# covers: larger batches are combined in token chunks (memory bound, not bits: every token
# is combined alone).
MOE_GATHER_MAX_BYTES = 64 << 20


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
    if expert_parallel:
        if E < n:
            raise Unsupported(f"{where}: expert_parallel over tensor_parallel_size={n} ranks "
                              f"needs at least one expert a rank; num_experts={E}")
        start, end = rank * E // n, (rank + 1) * E // n
        return dict(expert_parallel=True, expert_start=start, local_experts=end - start,
                    expert_intermediate=inter, expert_inter_start=0)
    if inter % n:
        raise Unsupported(f"{where}: tensor_parallel_size={n} does not divide "
                          f"moe_intermediate_size={inter} (the experts' intermediate "
                          "dimension; expert_parallel=True splits whole experts instead)")
    i = inter // n
    return dict(expert_parallel=False, expert_start=0, local_experts=E,
                expert_intermediate=i, expert_inter_start=rank * i)


def rank_meta(meta, plan):
    """`meta` whose MoE block has the rank's expert intermediate width (what the MoE pass
    and its buffers are sized by)."""
    if meta.moe is None:
        return meta
    return replace(meta, moe=replace(meta.moe,
                                     expert_intermediate_size=plan.expert_intermediate))


def moe_layer_bytes(meta, plan) -> int:
    """BF16 bytes of one sparse layer's MoE block on this rank."""
    moe, hid = meta.moe, meta.hidden_size
    s = moe.shared_expert_intermediate_size
    total = moe.num_experts * hid                                   # router
    total += plan.local_experts * 3 * plan.expert_intermediate * hid
    if s:
        total += 3 * s * hid + hid                                  # shared expert, its gate
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
        s = (0, moe.shared_expert_intermediate_size)
        shared_gate_up = weights._rows([(b + "shared_expert.gate_proj.weight", s),
                                        (b + "shared_expert.up_proj.weight", s)])
        shared_down = weights._whole(b + "shared_expert.down_proj.weight")
        shared_gate = weights._whole(b + "shared_expert_gate.weight")
    return MoeLayerWeights(router=weights._whole(b + "gate.weight"), gate_up=gate_up,
                           down=down_all, shared_gate_up=shared_gate_up,
                           shared_down=shared_down, shared_gate=shared_gate)


class MoeCombine:
    """The tensor-parallel combine of the module docstring and its buffers."""

    def __init__(self, tp, meta, max_tokens: int) -> None:
        self.tp = tp
        moe = meta.moe
        self.k, self.hidden = moe.top_k, meta.hidden_size
        self.chunk = self.chunk_tokens(tp.size, meta, max_tokens)
        sizes = self.layout(tp.size, meta, max_tokens)
        self.gathered = tp._alloc(sizes["gathered"])    # [N, c * k, hidden] f32
        self.slots = tp._alloc(sizes["slots"])          # [c, k, N, hidden] f32
        self.weights_n = tp._alloc(sizes["weights_n"])  # [N, c * k] f32
        self.weights = tp._alloc(sizes["weights"])      # [c, k, N] f32

    @staticmethod
    def chunk_tokens(n_ranks: int, meta, max_tokens: int) -> int:
        per_token = n_ranks * meta.moe.top_k * meta.hidden_size * 4
        return max(1, min(max_tokens, MOE_GATHER_MAX_BYTES // per_token))

    @staticmethod
    def layout(n_ranks: int, meta, max_tokens: int) -> dict[str, int]:
        c = MoeCombine.chunk_tokens(n_ranks, meta, max_tokens)
        pairs = c * meta.moe.top_k
        return {"gathered": n_ranks * pairs * meta.hidden_size * 4,
                "slots": n_ranks * pairs * meta.hidden_size * 4,
                "weights_n": n_ranks * pairs * 4, "weights": n_ranks * pairs * 4}

    def combine(self, stream: int, out_ptr, expert_out, topk_weights, n: int, shared,
                gate) -> None:
        """out[n, hidden] bf16 = the fixed-order combine of every rank's expert_out [n * k,
        hidden] f32 partials with topk_weights [n, k] f32 (and the whole shared expert
        output shared [n, hidden] f32 under its gate logits gate [n] f32, or NULL)."""
        tp, b, k, hid, N = self.tp, self.tp.backend, self.k, self.hidden, self.tp.size
        tp.before_collective()
        for t0 in range(0, n, self.chunk):
            c = min(self.chunk, n - t0)
            pairs = c * k
            tp.comm.all_gather(DevicePtr(expert_out).offset(t0 * k * hid * 4), self.gathered,
                               pairs * hid, np.float32, stream)
            tensor_parallel.tp_concat_shards(b, stream, self.slots, self.gathered, pairs,
                                             N * hid * 4, hid * 4, N)
            w = DevicePtr(topk_weights).offset(t0 * k * 4)
            for r in range(N):   # each slot weight once per rank, (slot, rank) order
                b.copy_d2d_async(w, DevicePtr(self.weights_n).offset(r * pairs * 4),
                                 pairs * 4, stream)
            tensor_parallel.tp_concat_shards(b, stream, self.weights, self.weights_n, pairs,
                                             N * 4, 4, N)
            moe_combine_op.moe_combine(
                b, stream, DevicePtr(out_ptr).offset(t0 * hid * 2), self.slots, self.weights,
                c, hid, k * N, _rows(shared, t0, hid * 4), _rows(gate, t0, 4))
            tp.reductions += 1
            tp.bytes_received += (N - 1) * pairs * hid * 4


def _rows(ptr, t0: int, row_bytes: int):
    p = DevicePtr(ptr)
    return p if p.is_null() else p.offset(t0 * row_bytes)
