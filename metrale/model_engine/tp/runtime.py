"""How a tensor-parallel rank's layer passes end: the fixed-order reductions and gathers.

Every rank holds the whole residual stream ([n, hidden], BF16) and a slice of every weight
(tp/shard.py). Three places talk to the other ranks:
  embedding     each rank writes the rows of the ids in its vocabulary slice (FP32, zeros
                elsewhere); `reduce` adds them: exactly one rank holds each row, so the sum is
                the embedding row, bit for bit.
  o_proj, down  the rank's slice of the contraction, out in FP32 (`gemm_tc(out_fp32=True)`,
                no BF16 rounding of a partial sum); `reduce` adds the ranks' partials and
                rounds once to BF16; the layer's bias is added after it, once. A MoE
                block's output likewise: its combine writes the rank's FP32 partial
                (`sum_partials`; tp/moe_shard.py), or, expert parallel, the block talks to
                the other ranks itself (tp/expert_parallel.py).
  lm_head       each rank's vocabulary slice of the logits rows; an all-gather and
                `tp_concat_shards` put whole rows in the logits arena on every rank, so
                argmax, copy_logits_to_host and every sampler read them unchanged.

`reduce` (count elements of [N, count] FP32 partials -> count BF16) sums in rank order
0, 1, ..., N-1 for every element (kernels/tensor_parallel.cu): a sequence's rows get the same
bits alone or in any batch, and run to run. Two schedules, chosen by size for speed only
(the adds are the same, so are the bits):
  gather     all_gather the partials, every rank sums all of them. One collective; each
             rank receives (N-1) * 4 * count bytes. For decode-sized messages (latency-bound).
  exchange   all_to_all: rank k receives everyone's k-th 1/N of the partials, sums it in rank
             order, and an all_gather of the BF16 sums gives every rank the whole. Each rank
             receives (N-1)/N * 6 * count bytes: 1.5x a BF16 ring all-reduce's 4 * (N-1)/N.
NCCL's own all-reduce is not used: its ring and tree orders depend on message size, so a
row's bits would depend on the batch it is in.
"""
from __future__ import annotations

import numpy as np

from ...gpu_runtime.owned import OwnedBuffers
from ...gpu_runtime.types import DevicePtr
from ...ops import tensor_parallel
from ..linear import run_linear
from .expert_parallel import ExpertParallel
from .shard import ShardPlan

# Largest gathered partials (N * count * 4 bytes) the `gather` schedule is used for; above
# it `exchange`. Speed only: the results are the same bits. From the paper model
# (benchmarks/results/tp_allreduce_model.md): on NVLink (~370 GB/s effective) the gather's
# extra bytes cost less than exchange's second collective (~10 us) up to ~20 rows of a
# 8192-wide layer at TP=8 (5 MiB) and ~60 rows at TP=4 (8 MiB).
GATHER_MAX_BYTES = 4 << 20


class TensorParallel(OwnedBuffers):
    """A rank's communicator, slices and combine buffers; see the module docstring."""

    def __init__(self, backend, comm, plan: ShardPlan, meta, *, max_tokens: int,
                 logits_rows: int, fp32_logits: bool, before_collective=lambda: None) -> None:
        self.backend, self.comm, self.plan = backend, comm, plan
        self.size = plan.size
        self.hidden = meta.hidden_size
        self.vocab = meta.vocab_size
        self.logit_bytes = 4 if fp32_logits else 2
        self.gather_max_bytes = GATHER_MAX_BYTES
        # the agreement step of the call (agreement.py) runs before its first collective
        self.before_collective = before_collective
        self.logits_rows = logits_rows
        # what each step moved, for the benchmark report
        self.reductions = 0
        self.bytes_received = 0
        self._owned: list[DevicePtr] = []
        sizes = self.buffer_bytes(plan, meta, max_tokens=max_tokens, logits_rows=logits_rows,
                                  fp32_logits=fp32_logits, parts=True)
        self._gathered_bytes = sizes["gathered"]
        try:
            self.partial = self._alloc(sizes["partial"])            # [T, hidden] f32
            self.gathered = self._alloc(sizes["gathered"])          # [N, T*hidden/N] f32
            self.summed = self._alloc(sizes["summed"])              # [T*hidden/N] bf16
            self.logits_shard = self._alloc(sizes["logits_shard"])  # [rows, Vs]
            self.logits_all = self._alloc(sizes["logits_all"])      # [N, rows, Vs]
            # expert parallelism: the dispatch / combine pass (expert_parallel.py)
            self.ep = (ExpertParallel(self, meta, plan, max(max_tokens, logits_rows))
                       if plan.expert_parallel else None)
        except BaseException:
            self.free()
            raise

    @staticmethod
    def buffer_bytes(plan: ShardPlan, meta, *, max_tokens: int, logits_rows: int,
                     fp32_logits: bool, parts: bool = False):
        """Device bytes of the combine buffers (the memory plan counts them)."""
        hid, N = meta.hidden_size, plan.size
        count = max(max_tokens, logits_rows) * hid   # a prefill chunk or a decode batch
        lb = 4 if fp32_logits else 2
        sizes = {"partial": count * 4,
                 "gathered": max(count * 4, GATHER_MAX_BYTES + N * hid * 4),
                 "summed": -(-count // N) * 2,
                 "logits_shard": logits_rows * plan.vocab_shard * lb,
                 "logits_all": N * logits_rows * plan.vocab_shard * lb}
        if plan.expert_parallel:
            sizes["ep"] = sum(ExpertParallel.layout(meta, plan, max(max_tokens,
                                                                    logits_rows)).values())
        return sizes if parts else sum(sizes.values())

    # the three combines ----------------------------------------------------------------
    def embedding(self, stream: int, out_ptr, token_ids_ptr, table_ptr, n: int) -> None:
        """out[n, hidden] bf16 = the embedding rows of the n ids at token_ids_ptr."""
        p = self.plan
        self.before_collective()
        tensor_parallel.tp_embedding_shard(self.backend, stream, self.partial, table_ptr,
                                           token_ids_ptr, n, self.hidden, p.vocab_start,
                                           p.vocab_shard)
        self.reduce(stream, self.partial, out_ptr, n * self.hidden)

    def row_parallel(self, stream: int, out_ptr, x_ptr, w_ptr, n: int, out_dim: int,
                     in_dim: int) -> None:
        """out[n, out_dim] bf16 = x[n, in_dim] @ w[out_dim, in_dim]^T summed over the
        ranks' slices of the contraction (o_proj, down_proj), one rounding."""
        self.before_collective()
        run_linear(self.backend, stream, self.partial, x_ptr, w_ptr, n, out_dim, in_dim,
                   out_fp32=True)   # BF16 or quantized (the rank's slice of k)
        self.reduce(stream, self.partial, out_ptr, n * out_dim)

    def sum_partials(self, stream: int, out_ptr, n: int, fill) -> None:
        """out[n, hidden] bf16 = the rank-order sum of every rank's partial [n, hidden] f32,
        which `fill(partial_ptr)` writes (a MoE block's combine: moe.py)."""
        self.before_collective()
        fill(self.partial)
        self.reduce(stream, self.partial, out_ptr, n * self.hidden)

    def lm_head(self, stream: int, x_ptr, n_rows: int, out_ptr, w_ptr, fp32: bool) -> None:
        """Whole logits rows out[n_rows, vocab] (BF16, or FP32 when `fp32`) on every rank,
        from each rank's vocabulary slice of x[n_rows, hidden] @ lm_head^T."""
        p, b = self.plan, self.backend
        self.before_collective()
        lb = 4 if fp32 else 2
        for r0 in range(0, n_rows, self.logits_rows):
            k = min(self.logits_rows, n_rows - r0)
            run_linear(b, stream, self.logits_shard, DevicePtr(x_ptr).offset(
                r0 * self.hidden * 2), w_ptr, k, p.vocab_shard, self.hidden, out_fp32=fp32)
            self.comm.all_gather(self.logits_shard, self.logits_all, k * p.vocab_shard,
                                 np.float32 if fp32 else np.uint16, stream)
            tensor_parallel.tp_concat_shards(b, stream, DevicePtr(out_ptr).offset(
                r0 * self.vocab * lb), self.logits_all, k, self.vocab * lb,
                p.vocab_shard * lb, self.size)
            self.bytes_received += (self.size - 1) * k * p.vocab_shard * lb

    # the fixed-order reduction ---------------------------------------------------------
    def reduce(self, stream: int, partial_ptr, out_ptr, count: int) -> None:
        """out[count] bf16 = the rank-order sum of every rank's partial[count] f32."""
        N, b = self.size, self.backend
        self.reductions += 1
        if self._gathers(count):
            self.comm.all_gather(partial_ptr, self.gathered, count, np.float32, stream)
            tensor_parallel.tp_sum_partials(b, stream, out_ptr, self.gathered, count, N)
            self.bytes_received += (N - 1) * count * 4
            return
        seg = count // N     # hidden_size % N == 0 (tp/shard.py), so N * seg == count
        self.comm.all_to_all(partial_ptr, self.gathered, seg, np.float32, stream)
        tensor_parallel.tp_sum_partials(b, stream, self.summed, self.gathered, seg, N)
        self.comm.all_gather(self.summed, out_ptr, seg, np.uint16, stream)
        self.bytes_received += (N - 1) * seg * 6

    def _gathers(self, count: int) -> bool:
        """Whether `reduce` of `count` elements takes the `gather` schedule (`gathers` with
        this rank's limit, which tests may lower)."""
        n = self.size * count * 4
        return n <= self.gather_max_bytes and n <= self._gathered_bytes

    # the benchmark's measure -------------------------------------------------------------
    def time_step_collectives(self, stream: int, n_rows: int, num_layers: int,
                              repeats: int = 5) -> float:
        """Milliseconds of one decode step's combines at `n_rows` rows, alone (every rank
        must call it together): the embedding reduce, 2 * num_layers reductions and the
        logits gather, with their kernels, on scratch data. Median of `repeats`."""
        b = self.backend
        count = n_rows * self.hidden
        b.memset_async(self.partial, 0, count * 4, stream)
        b.memset_async(self.logits_shard, 0, n_rows * self.plan.vocab_shard * self.logit_bytes,
                       stream)
        scratch = b.alloc(count * 2)
        scratch_logits = b.alloc(n_rows * self.vocab * self.logit_bytes)
        start, end = b.create_event(), b.create_event()
        saved = (self.reductions, self.bytes_received)
        times = []
        try:
            for _ in range(repeats + 1):          # the first is a warm-up
                self.comm.barrier(stream)
                b.record_event(start, stream)
                for _ in range(2 * num_layers + 1):
                    self.reduce(stream, self.partial, scratch, count)
                self.comm.all_gather(self.logits_shard, self.logits_all,
                                     n_rows * self.plan.vocab_shard,
                                     np.float32 if self.logit_bytes == 4 else np.uint16, stream)
                tensor_parallel.tp_concat_shards(b, stream, scratch_logits, self.logits_all,
                                                 n_rows, self.vocab * self.logit_bytes,
                                                 self.plan.vocab_shard * self.logit_bytes,
                                                 self.size)
                b.record_event(end, stream)
                self.comm.wait(stream)
                b.event_synchronize(end)
                times.append(b.event_elapsed_ms(start, end))
        finally:
            self.reductions, self.bytes_received = saved
            b.synchronize(stream)
            b.free(scratch)
            b.free(scratch_logits)
            for e in (start, end):
                getattr(b, "destroy_event", lambda _e: None)(e)
        return float(np.median(times[1:]))

    def step_bytes(self, n_rows: int, num_layers: int) -> int:
        """Bytes each rank receives in one decode step of `n_rows` rows."""
        return step_comm_bytes(self.size, self.hidden, self.plan.vocab_shard, num_layers,
                               n_rows, self.logit_bytes, self._gathers(n_rows * self.hidden))



def step_comm_bytes(n_ranks: int, hidden: int, vocab_shard: int, num_layers: int, n_rows: int,
                    logit_bytes: int, gather: bool) -> int:
    """Bytes each rank receives in one decode step of `n_rows` rows: the embedding's and
    2 * num_layers reductions of n_rows * hidden elements (`gather`: the gather schedule,
    else exchange), and the other ranks' logits slices."""
    N, count = n_ranks, n_rows * hidden
    per = (N - 1) * count * 4 if gather else (N - 1) * (count // N) * 6
    return (2 * num_layers + 1) * per + (N - 1) * n_rows * vocab_shard * logit_bytes


def gathers(n_ranks: int, count: int) -> bool:
    """Whether a reduction of `count` elements takes the gather schedule (GATHER_MAX_BYTES)."""
    return n_ranks * count * 4 <= GATHER_MAX_BYTES
