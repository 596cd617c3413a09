"""The mixture-of-experts MLP as one more layer pass (layers.run_decoder calls `moe_mlp` for
a sparse layer instead of the dense MLP), and its device buffers.

    logits = x @ router^T                       gemm_tc, float32 out   [n, E]
    ids, w = top-k softmax (renormalised)       moe_topk_softmax       [n, k]
    pairs grouped by expert                     moe_route              [n * k]
    gate_up[p] = x[p / k] @ Wgu[e_p]^T          moe_gemm, bf16         [n * k, 2I]
    act[p] = act(gate) * up                     act_mul                [n * k, I]
    y[p] = act[p] @ Wd[e_p]^T                   moe_gemm, float32      [n * k, hidden]
    (qwen2_moe) shared = mlp_S(x), g = x @ Wg^T gemm_tc + act_mul, float32 out
    out[t] = bf16(sum_s w[t,s] y[t*k+s] (+ sigmoid(g) shared))   moe_combine, slot order
gpt-oss (MoeConfig.oss): the router's bias joins its logits (moe_topk_softmax), the
experts' biases their products (moe_gemm), act_mul runs the clamped SwiGLU.
Numerics against HF (fp32 goldens): the router logits are kept in float32 (HF runs its
router Linear in the model dtype; in fp32 that is float32 too) and the softmax, top-k and
renormalisation are HF's float32 formulas (moe_router.cu); expert outputs stay float32
until the one BF16 rounding of the sum, as the dense MLP's act_mul rounds once.
BATCH INVARIANCE: every step keeps rows apart (gemm_tc and moe_gemm compute each element
from its own two rows in a fixed order; the router, act_mul and the combine are per row),
and the routing only decides which CTA computes a row. So a token's bits do not depend on
the batch, on which tokens chose the same experts, or on the tile picked for the launch:
decode_batch rows equal solo decode, verify rows equal decode steps, chunked prefill
equals whole prefill. Nothing is read back to the host: graph capture works unchanged.
"""
from __future__ import annotations

from ..formats.field_table import HF_ACTIVATIONS
from ..gpu_runtime.types import NULL
from ..ops import activation, deepseek_router, gemm_tc, moe_combine, moe_gemm, moe_router
from .linear import run_linear
from .moe_mxfp4 import Mxfp4Experts
from .moe_quant import QuantExperts


def mlp_width(meta) -> int:
    """Columns per token row the MLP scratch (Workspace.gate_up / .act) must hold: the dense
    MLP's intermediate_size where a layer has one, top_k expert rows of
    expert_intermediate_size, and the shared expert's width (they run one after another)."""
    moe = meta.moe
    if moe is None:
        return meta.intermediate_size
    dense = meta.intermediate_size if not all(moe.sparse_layers) else 0
    routed = moe.top_k * moe.expert_intermediate_size if any(moe.sparse_layers) else 0
    return max(dense, routed, moe.shared_expert_intermediate_size, 1)


class MoeBuffers:
    """The MoE pass's buffers for up to `rows` tokens, allocated through `alloc` (the
    workspace's, which frees them)."""

    def __init__(self, alloc, meta, rows: int) -> None:
        for name, nbytes in self.layout(meta, rows).items():
            setattr(self, name, alloc(nbytes) if nbytes else NULL)

    @staticmethod
    def layout(meta, rows: int) -> dict[str, int]:
        moe, T, h = meta.moe, rows, meta.hidden_size
        E, k = moe.num_experts, moe.top_k
        shared = bool(moe.shared_expert_intermediate_size)
        return {
            "router_logits": T * E * 4,        # float32 [T, E]
            "topk_ids": T * k * 4,             # int32 [T, k]
            "topk_weights": T * k * 4,         # float32 [T, k]
            "sorted_pairs": T * k * 4,         # int32 [T * k]
            "expert_offsets": (E + 1) * 4,     # int32 [E + 1]
            "tile_offsets": (E + 1) * 4,       # int32 [E + 1]
            "expert_out": T * k * h * 4,       # float32 [T * k, hidden]
            "shared_out": T * h * 4 if shared else 0,    # float32 [T, hidden]
            "shared_gate": T * 4 if shared else 0,       # float32 [T] gate logits
        }

    @staticmethod
    def estimate_bytes(meta, rows: int) -> int:
        if meta.moe is None or not any(meta.moe.sparse_layers):
            return 0
        return sum(MoeBuffers.layout(meta, rows).values())


def moe_mlp(model, stream: int, n: int, W) -> None:
    """ws.hidden[n, hidden] (bf16) = the MoE block of ws.normed[n, hidden]; W: the layer's
    MoeLayerWeights. Uses ws.gate_up / ws.act as scratch (sized by mlp_width)."""
    if model._tp is not None and model._tp.ep is not None:   # expert parallelism
        model._tp.ep.moe_mlp(model, stream, n, W)
        return
    b, ws, m = model.backend, model._ws, model._layer_meta   # a rank: its expert slices
    moe, mb = m.moe, ws.moe
    E, k, hid, inter = moe.num_experts, moe.top_k, m.hidden_size, moe.expert_intermediate_size
    act = HF_ACTIVATIONS[m.hidden_act]
    gemm_tc.gemm_tc(b, stream, mb.router_logits, ws.normed, W.router, n, E, hid, out_fp32=True)
    if moe.deepseek is None:
        moe_router.moe_topk_softmax(b, stream, mb.topk_ids, mb.topk_weights, mb.router_logits,
                                    n, E, k, moe.norm_topk_prob, bias_ptr=W.router_bias)
    else:   # DeepSeek's group-limited choice (ops/deepseek_router.py)
        r = moe.deepseek
        deepseek_router.moe_topk_grouped(
            b, stream, mb.topk_ids, mb.topk_weights, mb.router_logits, n, E, k, r.n_group,
            r.topk_group, int(r.scoring == "sigmoid"), moe.norm_topk_prob,
            r.routed_scaling_factor, bias_ptr=W.correction_bias)
    shared = gate = NULL
    s = moe.shared_expert_intermediate_size
    if s:   # qwen2_moe: the shared expert first (its scratch is free again afterwards)
        run_linear(b, stream, ws.gate_up, ws.normed, W.shared_gate_up, n, 2 * s, hid)
        activation.act_mul(b, stream, ws.act, ws.gate_up, n, s, act)
        run_linear(b, stream, mb.shared_out, ws.act, W.shared_down, n, hid, s,
                   out_fp32=True)
        shared = mb.shared_out
        if not W.shared_gate.is_null():
            gemm_tc.gemm_tc(b, stream, mb.shared_gate, ws.normed, W.shared_gate, n, 1, hid,
                            out_fp32=True)
            gate = mb.shared_gate
    pairs = n * k
    tile = moe_gemm.pick_tile(pairs, E)
    moe_router.moe_route(b, stream, mb.sorted_pairs, mb.expert_offsets, mb.tile_offsets,
                         mb.topk_ids, pairs, E, tile.bm)
    lists = (mb.sorted_pairs, mb.expert_offsets, mb.tile_offsets)
    run_experts(b, stream, ws.gate_up, ws.normed, W.gate_up, lists, pairs, E, 2 * inter, hid, k,
             False, tile.name, W.gate_up_bias)
    if moe.oss is None:
        activation.act_mul(b, stream, ws.act, ws.gate_up, pairs, inter, act)
    else:
        activation.act_mul(b, stream, ws.act, ws.gate_up, pairs, inter, "swiglu_clamp",
                           moe.oss.swiglu_alpha, moe.oss.swiglu_limit)
    run_experts(b, stream, mb.expert_out, ws.act, W.down, lists, pairs, E, hid, inter, 1, True,
             tile.name, W.down_bias)
    if model._tp is None:
        moe_combine.moe_combine(b, stream, ws.hidden, mb.expert_out, mb.topk_weights, n, hid,
                                k, shared, gate)
    else:   # a rank's slice of every expert: its FP32 combine, summed over the ranks
        model._tp.sum_partials(stream, ws.hidden, n, lambda part: moe_combine.moe_combine(
            b, stream, part, mb.expert_out, mb.topk_weights, n, hid, k, shared, gate,
            out_fp32=True))


def run_experts(b, stream, y, x, w, lists, pairs, E, n, k, row_div, out_fp32, tile, bias):
    """The grouped GEMM of an expert operand: BF16 (a DevicePtr), MXFP4 (gpt-oss) or
    quantized (QuantExperts: FP8, GPTQ, AWQ; no expert biases)."""
    if isinstance(w, QuantExperts):
        w.run(b, stream, y, x, lists, pairs, E, row_div, out_fp32, tile)
    elif isinstance(w, Mxfp4Experts):
        moe_gemm.moe_gemm_mxfp4(b, stream, y, x, w.blocks, w.scales, *lists, pairs, E, n, k,
                                row_div, out_fp32, tile, bias_ptr=bias)
    else:
        moe_gemm.moe_gemm(b, stream, y, x, w, *lists, pairs, E, n, k, row_div, out_fp32, tile,
                          bias_ptr=bias)
