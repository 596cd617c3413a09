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

Mixture of experts (qwen2_moe, qwen3_moe, mixtral): the router whole on every rank, every
expert's intermediate rows split like the dense MLP's ([r * I/N, (r+1) * I/N) of gate/up
rows and down columns; the shared expert's likewise): a rank runs every expert on its
slice, and its combine's FP32 partial is summed over the ranks like down_proj's. With
expert_parallel=True a rank holds a range of whole experts instead
(tp/expert_parallel.py), the router and the shared expert whole.

Refused, by name: N that does not divide num_attention_heads, intermediate_size,
moe_intermediate_size, shared_expert_intermediate_size (tensor-parallel experts) or
hidden_size, or that neither divides nor is divided by num_key_value_heads; more ranks than
experts, or a dense checkpoint, under expert_parallel=True; N above 64.
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
    expert_intermediate: int = 0   # MoE: each expert's rows [expert_start, + this)
    expert_start: int = 0
    shared_intermediate: int = 0   # qwen2_moe's shared expert: [shared_start, + this)
    shared_start: int = 0
    # the experts held: [first_expert, + local_experts) (all of them unless expert parallel,
    # where each is whole: expert_intermediate is the whole width)
    first_expert: int = 0
    local_experts: int = 0
    expert_parallel: bool = False

    def layer_metadata(self, meta):
        """`meta` with this rank's head and intermediate counts: what its layer passes,
        workspace and KV pool are sized by (vocab_size stays whole: logits rows are)."""
        moe = meta.moe
        if moe is not None:   # every expert (and the shared one) split like the dense MLP
            moe = replace(moe, expert_intermediate_size=self.expert_intermediate,
                          shared_expert_intermediate_size=self.shared_intermediate)
        return replace(meta, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       intermediate_size=self.intermediate, moe=moe)


def plan_shards(meta, rank: int, size: int, where: str,
                expert_parallel: bool = False) -> ShardPlan:
    """Rank `rank`'s ShardPlan of `size` ranks (expert_parallel: whole experts partitioned
    over the ranks); Unsupported naming the field that cannot be split."""
    H, KV, inter, hid, V = (meta.num_heads, meta.num_kv_heads, meta.intermediate_size,
                            meta.hidden_size, meta.vocab_size)
    N = int(size)
    if not 1 <= N <= MAX_RANKS:
        raise Unsupported(f"{where}: tensor_parallel_size={N} is outside [1, {MAX_RANKS}]")

    def refuse(field: str, value: int, why: str) -> None:
        raise Unsupported(f"{where}: tensor_parallel_size={N} {why} {field}={value}")
    if H % N:
        refuse("num_attention_heads", H, "does not divide")
    if inter % N:
        refuse("intermediate_size", inter, "does not divide")
    if hid % N:
        refuse("hidden_size", hid, "does not divide")
    if KV % N == 0:
        kv, kv_start, replicated = KV // N, rank * (KV // N), False
    elif N % KV == 0:
        kv, kv_start, replicated = 1, rank * KV // N, True
    else:
        refuse("num_key_value_heads", KV, "neither divides nor is a multiple of")
    moe = getattr(meta, "moe", None)
    ei = si = 0
    experts = {}
    if moe is None and expert_parallel:
        raise Unsupported(f"{where}: expert_parallel=True needs a mixture-of-experts "
                          "checkpoint (num_experts / num_local_experts in config.json)")
    if moe is not None:
        ei, si, E = (moe.expert_intermediate_size, moe.shared_expert_intermediate_size,
                     moe.num_experts)
        experts = dict(first_expert=0, local_experts=E)
        if expert_parallel:   # whole experts [r * E // N, (r+1) * E // N); a divisor of 1
            if E < N:
                raise Unsupported(f"{where}: expert_parallel over tensor_parallel_size={N} "
                                  f"ranks needs at least one expert a rank; num_experts={E}")
            a, z = rank * E // N, (rank + 1) * E // N
            experts = dict(first_expert=a, local_experts=z - a, expert_parallel=True)
        elif ei % N:
            refuse("moe_intermediate_size", ei, "does not divide")
        elif si % N:
            refuse("shared_expert_intermediate_size", si, "does not divide")
    d = 1 if expert_parallel else N   # the experts' intermediate split
    h = H // N
    i = inter // N
    vs = -(-V // N)
    v0 = rank * vs
    return ShardPlan(rank=rank, size=N, num_heads=h, head_start=rank * h, num_kv_heads=kv,
                     kv_head_start=kv_start, kv_replicated=replicated, intermediate=i,
                     inter_start=rank * i, vocab_shard=vs, vocab_start=v0,
                     vocab_rows=max(0, min(vs, V - v0)), expert_intermediate=ei // d,
                     expert_start=rank * (ei // N) if d > 1 else 0,
                     shared_intermediate=si // d,
                     shared_start=rank * (si // N) if d > 1 else 0, **experts)


def rank_weight_bytes(meta, plan: ShardPlan, tied: bool) -> int:
    """BF16 bytes of one rank's weights (for the memory plan and the 1/N check)."""
    D, hid = meta.head_dim, meta.hidden_size
    per_layer = hid * (plan.num_heads + 2 * plan.num_kv_heads) * D      # q, k, v
    per_layer += hid * plan.num_heads * D                               # o_proj
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
    moe = getattr(meta, "moe", None)
    for L in range(meta.num_layers):   # gate, up, down; a MoE block's router, experts and
        if moe is None or not moe.sparse_layers[L]:   # shared expert (+ its gate)
            total += 3 * hid * plan.intermediate
            continue
        total += moe.num_experts * hid + plan.local_experts * 3 * hid * plan.expert_intermediate
        if moe.shared_expert_intermediate_size:
            total += 3 * hid * plan.shared_intermediate + hid
    total += plan.vocab_shard * hid * (1 if tied else 2)                # embedding (+ head)
    return 2 * total
