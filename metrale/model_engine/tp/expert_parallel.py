"""Expert parallelism (`metrale.load(..., tensor_parallel_size=N, expert_parallel=True)`):
whole experts partitioned over the ranks, tokens dispatched to the ranks that hold their
experts and the expert outputs combined back, with all-to-all(v) over the rank's
communicator (MPI_Alltoallv on the host backends, grouped ncclSend/ncclRecv on CUDA).

Attention, the embedding and the lm_head stay split as for tensor parallelism (shard.py):
every rank holds the whole residual stream. Rank r holds experts [r * E // N, (r+1) * E // N)
(shard.plan_shards), the router and qwen2_moe's shared expert whole. A MoE layer of n
tokens on rank q:
  1. route      the router on all n rows (replicated: every rank knows every token's
                experts, so every rank computes every all-to-all's counts; nothing else is
                exchanged). The routing is read back to the host here, once per MoE layer:
                an expert-parallel model decodes without graphs.
  2. home       token t's home rank is t // c, c = ceil(n / N): it dispatches the token and
                combines it. Its pairs (t, s) go in (t, s) order.
  3. dispatch   all_to_all_v of the BF16 rows: rank q receives the pairs of its experts
                from every rank in rank order, which is global (t, s) order.
  4. experts    the single-device grouped GEMMs over the received rows (moe_gemm with one
                row a pair), gate_up, act_mul, down in float32.
  5. return     all_to_all_v of the float32 expert outputs back to the home ranks; each home
                rank puts them in slot order (a row gather) and runs the single-device
                combine kernel on its tokens (+ the shared expert, computed on its tokens).
  6. gather     an all_gather of the home ranks' BF16 rows: the whole [n, hidden] output on
                every rank, token t at row t.
DETERMINISM: a pair's expert output is the grouped GEMM's row for that pair (rows are
independent of which other rows share the launch), and the combine adds a token's slots in
slot order on its home rank: the MoE block's output is the single-device block's, bit for
bit, whatever the batch, the home split or the number of ranks.
QUANTIZED experts (FP8, GPTQ, AWQ) are whole on their rank, packed as released
(moe_shard.py), and run through moe.py's grouped GEMM choice (moe_gemm_q): the same rows.
"""
from __future__ import annotations

import numpy as np

from ...formats.field_table import HF_ACTIVATIONS
from ...gpu_runtime.types import NULL, DevicePtr
from ...ops import activation, embedding, gemm_tc, moe_combine, moe_gemm, moe_router
from ..linear import run_linear
from ..moe import run_experts


class ExpertParallel:
    """A rank's expert-parallel MoE pass and its buffers (see the module docstring)."""

    def __init__(self, tp, meta, plan, max_tokens: int) -> None:
        self.tp, self.plan = tp, plan
        moe, N = meta.moe, plan.size
        self.E, self.k, self.hidden = moe.num_experts, moe.top_k, meta.hidden_size
        self.owner = np.zeros(self.E, np.int32)   # expert -> the rank that holds it
        for r in range(N):
            self.owner[r * self.E // N:(r + 1) * self.E // N] = r
        # what each step moved, for the benchmark report and the tests
        self.dispatched_rows = 0
        for name, nbytes in self.layout(meta, plan, max_tokens).items():
            setattr(self, name, tp._alloc(nbytes))
        self._host_ids = np.zeros(max_tokens * self.k, np.int32)
        # host index arrays of the last layer's uploads, kept until the stream passed them
        # (the next layer's routing readback synchronizes it)
        self._uploads: list[np.ndarray] = []

    @staticmethod
    def layout(meta, plan, max_tokens: int) -> dict[str, int]:
        """Device bytes of the pass's buffers for up to max_tokens tokens."""
        T, k, h, N = max_tokens, meta.moe.top_k, meta.hidden_size, plan.size
        P = T * k                                 # pairs a rank may send or receive
        c = -(-T // N)                            # home tokens a rank combines at most
        return {"send_rows": P * 4,               # int32: token of each dispatched pair
                "send_x": P * h * 2,              # bf16 rows dispatched
                "recv_x": P * h * 2,              # bf16 rows received
                "recv_ids": P * 4,                # int32: local expert of each row
                "sorted_pairs": P * 4,
                "expert_offsets": (plan.local_experts + 1) * 4,
                "tile_offsets": (plan.local_experts + 1) * 4,
                "recv_y": P * h * 4,              # f32 expert outputs computed here
                "back_y": P * h * 4,              # f32 outputs of this rank's home pairs
                "slot_rows": P * 4,               # int32: back_y row of each home slot
                "home_y": P * h * 4,              # f32 [c * k, hidden] in slot order
                "home_out": c * h * 2,            # bf16 [c, hidden]
                "all_out": N * c * h * 2}         # bf16 [N * c, hidden]

    def moe_mlp(self, model, stream: int, n: int, W) -> None:
        """ws.hidden[n, hidden] bf16 = the MoE block of ws.normed[n, hidden] (W: the
        layer's MoeLayerWeights with this rank's experts)."""
        tp, b, ws, m = self.tp, model.backend, model._ws, model._meta
        mb, moe, plan = ws.moe, m.moe, self.plan
        E, k, hid, inter = self.E, self.k, self.hidden, moe.expert_intermediate_size
        N, q = plan.size, plan.rank
        tp.before_collective()
        # 1. route every token (the same on every rank) and read the experts back
        gemm_tc.gemm_tc(b, stream, mb.router_logits, ws.normed, W.router, n, E, hid,
                        out_fp32=True)
        moe_router.moe_topk_softmax(b, stream, mb.topk_ids, mb.topk_weights,
                                    mb.router_logits, n, E, k, moe.norm_topk_prob,
                                    bias_ptr=W.router_bias)
        ids = self._host_ids[:n * k]
        b.copy_d2h_async(mb.topk_ids, ids, stream)
        tp.comm.wait(stream)
        b.synchronize(stream)
        self._uploads = []
        dest = self.owner[ids]                            # [n * k] rank of each pair
        c = -(-n // N)
        home = np.arange(n * k) // k // c                 # [n * k] home rank of each pair
        t0, t1 = min(q * c, n), min((q + 1) * c, n)
        mine = home == q
        # 2./3. dispatch: my home pairs to their experts' ranks, in (t, s) order per rank
        order = np.argsort(dest[mine], kind="stable")     # grouped by rank, (t, s) kept
        send_pairs = np.flatnonzero(mine)[order]
        send_counts = np.bincount(dest[mine], minlength=N)
        recv_pairs = np.flatnonzero(dest == q)            # (p, t, s) == (t, s) order
        recv_counts = np.bincount(home[recv_pairs], minlength=N)
        S, R = len(send_pairs), len(recv_pairs)
        if S:
            self._upload(b, stream, (send_pairs // k).astype(np.int32), self.send_rows)
            embedding.embedding(b, stream, self.send_x, ws.normed, self.send_rows, S, hid, n)
        tp.comm.all_to_all_v(self.send_x, send_counts * hid, self.recv_x, recv_counts * hid,
                             np.uint16, stream)
        # 4. this rank's experts over the rows it received
        if R:
            local = (ids[recv_pairs] - plan.first_expert).astype(np.int32)
            self._upload(b, stream, local, self.recv_ids)
            El = plan.local_experts
            tile = moe_gemm.pick_tile(R, El)
            moe_router.moe_route(b, stream, self.sorted_pairs, self.expert_offsets,
                                 self.tile_offsets, self.recv_ids, R, El, tile.bm)
            lists = (self.sorted_pairs, self.expert_offsets, self.tile_offsets)
            run_experts(b, stream, ws.gate_up, self.recv_x, W.gate_up, lists, R, El,
                        2 * inter, hid, 1, False, tile.name, W.gate_up_bias)
            activation.act_mul(b, stream, ws.act, ws.gate_up, R, inter,
                               HF_ACTIVATIONS[m.hidden_act])
            run_experts(b, stream, self.recv_y, ws.act, W.down, lists, R, El, hid, inter, 1,
                        True, tile.name, W.down_bias)
        # 5. the outputs back to their home ranks, in slot order, and the combine there
        tp.comm.all_to_all_v(self.recv_y, recv_counts * hid, self.back_y, send_counts * hid,
                             np.float32, stream)
        self.dispatched_rows += S
        tp.bytes_received += R * hid * 2 + S * hid * 4
        if t1 > t0:
            slot_of = np.empty(S, np.int32)
            slot_of[send_pairs - t0 * k] = np.arange(S, dtype=np.int32)
            self._upload(b, stream, slot_of, self.slot_rows)
            # f32 rows moved as pairs of BF16 words: the gather copies bits
            embedding.embedding(b, stream, self.home_y, self.back_y, self.slot_rows, S,
                                2 * hid, S)
            shared, gate = self._shared(model, stream, W, t0, t1 - t0)
            moe_combine.moe_combine(b, stream, self.home_out, self.home_y,
                                    DevicePtr(mb.topk_weights).offset(t0 * k * 4), t1 - t0,
                                    hid, k, shared, gate)
        # 6. every home rank's rows to every rank
        tp.comm.all_gather(self.home_out, self.all_out, c * hid, np.uint16, stream)
        b.copy_d2d_async(self.all_out, ws.hidden, n * hid * 2, stream)
        tp.bytes_received += (N - 1) * c * hid * 2
        tp.reductions += 1

    def _shared(self, model, stream: int, W, t0: int, rows: int):
        """qwen2_moe's shared expert on the home tokens [t0, t0 + rows): (its float32 output,
        its gate logits), or (NULL, NULL)."""
        s = model._meta.moe.shared_expert_intermediate_size
        if not s:
            return NULL, NULL
        b, ws, hid = model.backend, model._ws, self.hidden
        mb = ws.moe
        x = DevicePtr(ws.normed).offset(t0 * hid * 2)
        run_linear(b, stream, ws.gate_up, x, W.shared_gate_up, rows, 2 * s, hid)
        activation.act_mul(b, stream, ws.act, ws.gate_up, rows, s,
                           HF_ACTIVATIONS[model._meta.hidden_act])
        run_linear(b, stream, mb.shared_out, ws.act, W.shared_down, rows, hid, s,
                   out_fp32=True)
        if W.shared_gate.is_null():
            return mb.shared_out, NULL
        gemm_tc.gemm_tc(b, stream, mb.shared_gate, x, W.shared_gate, rows, 1, hid,
                        out_fp32=True)
        return mb.shared_out, mb.shared_gate

    def _upload(self, b, stream: int, arr: np.ndarray, ptr) -> None:
        arr = np.ascontiguousarray(arr)
        self._uploads.append(arr)
        b.copy_h2d_async(arr, ptr, stream)
