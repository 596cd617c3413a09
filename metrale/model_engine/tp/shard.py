"""Which slice of every weight a tensor-parallel rank holds (Megatron-style), decided and
checked before anything is uploaded or any rank talks to another.

For N ranks, rank r holds:
  query heads     [r * H/N, (r+1) * H/N)                      (q_proj rows, o_proj columns)
  KV heads        N divides KV: [r * KV/N, (r+1) * KV/N)       (k/v_proj rows; its KV pool
                  KV divides N: the one head r * KV // N, the   holds only these heads)
                  same on N/KV ranks (replicated, as vLLM does: the query heads of a rank
                  always share one KV head then)
  intermediate    [r * I/N, (r+1) * I/N)                       (gate/up rows, down columns)
  vocabulary      [r * Vs, (r+1) * Vs), Vs = ceil(V / N)       (embedding and lm_head rows;
                  the last rank's slice is padded with zero rows up to Vs)
Norm weights, o_proj / down_proj biases and everything else are whole on every rank; the
column-split biases (q/k/v, gate/up) are sliced like their weights. o_proj and down_proj
outputs are partial sums that the ranks add in rank order (tp/runtime.py); their biases
are added once, after that sum.

A mixture-of-experts layer holds its experts' slices instead of the MLP (tp/moe_shard.py:
a 1/N slice of every expert and of the shared expert, or with expert_parallel a range of
whole experts).

Refused, by name: N that does not divide num_attention_heads, intermediate_size (when a
layer is dense), hidden_size, moe_intermediate_size or shared_expert_intermediate_size
(tensor parallel experts), or that neither divides nor is divided by num_key_value_heads;
more ranks than experts (expert parallel); N above 64.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...errors import Unsupported
from ...ops.tensor_parallel import MAX_RANKS


@dataclass(frozen=True)
class ShardPlan:
    """One rank's slices; see the module docstring."""

    rank: int
    size: int
    num_heads: int          # query heads on this rank
    head_start: int
    num_kv_heads: int       # KV heads on this rank
    kv_head_start: int
    kv_replicated: bool     # N > num_key_value_heads: heads copied over N/KV ranks
    intermediate: int
    inter_start: int
    vocab_shard: int        # rows of this rank's embedding / lm_head slice (padded)
    vocab_start: int
    vocab_rows: int         # of them, real vocabulary rows (the rest are zero padding)
    # a mixture of experts (tp/moe_shard.py): each expert's intermediate rows held (tensor
    # parallel: a 1/N slice of every expert) and the experts held (expert parallel: a
    # range of whole experts)
    expert_intermediate: int = 0
    expert_inter_start: int = 0
    expert_start: int = 0
    local_experts: int = 0
    expert_parallel: bool = False
    shared_intermediate: int = 0    # qwen2_moe's shared expert: its width on this rank
    shared_start: int = 0

    def layer_metadata(self, meta):
        """`meta` with this rank's head and intermediate counts: what its layer passes,
        workspace and KV pool are sized by (vocab_size stays whole: logits rows are)."""
        from .moe_shard import rank_meta
        return rank_meta(replace(meta, num_heads=self.num_heads,
                                 num_kv_heads=self.num_kv_heads,
                                 intermediate_size=self.intermediate), self)


def plan_shards(meta, rank: int, size: int, where: str,
                expert_parallel: bool = False) -> ShardPlan:
    """Rank `rank`'s ShardPlan of `size` ranks (a mixture of experts: its experts split as
    tp/moe_shard.py says); Unsupported naming the field that cannot be split."""
    from .moe_shard import plan_experts
    H, KV, inter, hid, V = (meta.num_heads, meta.num_kv_heads, meta.intermediate_size,
                            meta.hidden_size, meta.vocab_size)
    N = int(size)
    if not 1 <= N <= MAX_RANKS:
        raise Unsupported(f"{where}: tensor_parallel_size={N} is outside [1, {MAX_RANKS}]")

    def refuse(field: str, value: int, why: str) -> None:
        raise Unsupported(f"{where}: tensor_parallel_size={N} {why} {field}={value}")
    if H % N:
        refuse("num_attention_heads", H, "does not divide")
    dense = meta.moe is None or not all(meta.moe.sparse_layers)
    if inter % N and dense:   # (an all-sparse model has no dense MLP to split)
        refuse("intermediate_size", inter, "does not divide")
    if hid % N:
        refuse("hidden_size", hid, "does not divide")
    if KV % N == 0:
        kv, kv_start, replicated = KV // N, rank * (KV // N), False
    elif N % KV == 0:
        kv, kv_start, replicated = 1, rank * KV // N, True
    else:
        refuse("num_key_value_heads", KV, "neither divides nor is a multiple of")
    h = H // N
    i = inter // N if dense else 0
    experts = plan_experts(meta, rank, N, expert_parallel, where)
    vs = -(-V // N)
    v0 = rank * vs
    return ShardPlan(rank=rank, size=N, num_heads=h, head_start=rank * h, num_kv_heads=kv,
                     kv_head_start=kv_start, kv_replicated=replicated, intermediate=i,
                     inter_start=rank * i, vocab_shard=vs, vocab_start=v0,
                     vocab_rows=max(0, min(vs, V - v0)), **experts)


def rank_weight_bytes(meta, plan: ShardPlan, tied: bool) -> int:
    """BF16 bytes of one rank's weights (for the memory plan and the 1/N check)."""
    D, hid = meta.head_dim, meta.hidden_size
    per_layer = hid * (plan.num_heads + 2 * plan.num_kv_heads) * D      # q, k, v
    per_layer += hid * plan.num_heads * D                               # o_proj
    per_layer += 3 * hid * plan.intermediate                            # gate, up, down
    per_layer += 2 * hid                                                # the two norms
    if meta.attention_bias:
        per_layer += (plan.num_heads + 2 * plan.num_kv_heads) * D
    if meta.o_proj_bias:
        per_layer += hid
    if meta.qk_norm:
        per_layer += 2 * D
    if meta.mlp_bias:
        per_layer += 2 * plan.intermediate + hid
    total = meta.num_layers * per_layer + hid                           # + final norm
    if meta.moe is not None:   # a sparse layer holds its MoE block instead of the MLP
        from .moe_shard import moe_layer_bytes
        sparse = sum(meta.moe.sparse_layers)
        total += sparse * (moe_layer_bytes(meta, plan) // 2 - 3 * hid * plan.intermediate)
    total += plan.vocab_shard * hid * (1 if tied else 2)                # embedding (+ head)
    return 2 * total
