"""The decoder stack as a launch sequence over raw pointers (llama/mistral/qwen2/qwen3, and
the mixture-of-experts families, whose sparse layers run moe.moe_mlp for the MLP).

Pre-norm residual blocks with the residual add fused into RMSNorm:
    residual = embed(ids)
    per layer:  x = norm1(residual)                     (layer 0: no add)
                qkv = x @ Wqkv^T (+ bias); rope(q, k) (+ q/k norm) and k, v to the cache
                o = attention(q, cache; the layer's sliding window) @ Wo^T (+ bias)
                x = norm2(residual += o)
                h = act(x @ Wgate^T (+ b)) * (x @ Wup^T (+ b)) @ Wdown^T (+ b)
    out = final_norm(residual += h)
A decode step of at most 16 rows on a dense model (BF16 or quantized linears; no tensor
parallelism, no MoE, no o/gate_up/down bias) runs the same math in 7 launches a layer
instead of 10 (11 with a qkv bias): the norms move into the GEMMs that read them, the qkv
bias into the GEMM that produces qkv, and the residual adds into the GEMMs that feed them
(ops/gemm_fused.py), with the bits of the unfused sequence, so decode may fuse while verify
and prefill do not (`decode_fusable`).
The families of issue 40 change that block as `meta.variant` says (formats/decoder_variant.py):
Gemma's (1 + w) norms (every rmsnorm and the q/k norm in weight mode "gemma"), its four
norms a layer (the attention and MLP outputs normalized in place before their residual adds,
pre_feedforward_layernorm before the MLP), embeddings times a BF16 normalizer, the
attention's scale, soft-capped scores and logits, per-layer rope tables (Gemma 3's local
base on sliding layers), a partial rotary dimension (Phi-3/4, GLM-4.5), per-head sinks (gpt-oss).
Such models decode unfused when their norms are not Llama's.
Every linear layer (and the lm_head) is the batch-invariant tensor-core GEMM (ops.gemm_tc,
graph-capturable), for decode, verify and prefill alike: a row's bits never depend on how
many rows share the launch or which path runs it. `decode=True` uses split-K decode
attention, one query row per sequence row; `decode=False` the causal prefill attention
(tensor cores for the head dims attention_tc has).
On a tensor-parallel rank (`model._tp`, tp/runtime.py) the same sequence runs over the rank's
heads and intermediate slice (`model._layer_meta`); the embedding, o_proj, down_proj and the
lm_head end with the ranks' fixed-order combines instead.
"""
from __future__ import annotations

from ..formats.field_table import HF_ACTIVATIONS
from ..gpu_runtime.types import NULL, DevicePtr
from ..ops import activation, elementwise, gemm_fused, rmsnorm, rope
from .linear import Fp8Linear, Q4Linear, fused_operand, run_embedding, run_linear
from .moe import moe_mlp
from .deepseek import run_deepseek_decoder
from .paged_attention import paged_attention


def run_decoder(model, stream: int, n: int, *, decode: bool, n_seqs: int, max_q_len: int,
                out_ptr: DevicePtr, embeds_uploaded: bool = False, arena=None,
                lora=None) -> None:
    """Run all layers over `n` token rows whose metadata is already on the device.

    Final-norm hidden states `[n, hidden]` go to `out_ptr`. When `embeds_uploaded`, the
    input embeddings are already in `ws.residual` (multimodal / tensor API input). `arena`
    (k_cache(layer) / v_cache(layer)) is where K/V live: the model's pool by default, a
    dense `ContiguousArena` for the baseline cache. `lora` (lora_step.LoraStep): the rows'
    LoRA deltas, added to each fused projection's output after its bias (PEFT's order:
    base layer, then delta); with it a decode step runs unfused.
    """
    if model._meta.mla is not None:   # DeepSeek's latent attention (deepseek.py)
        return run_deepseek_decoder(model, stream, n, n_seqs=n_seqs, out_ptr=out_ptr,
                                    embeds_uploaded=embeds_uploaded, arena=arena, lora=lora)
    b, ws, m, W = model.backend, model._ws, model._layer_meta, model._weights
    tp = model._tp
    H, KV, D, hid = m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size
    inter, eps = m.intermediate_size, m.rms_norm_eps
    act = HF_ACTIVATIONS[m.hidden_act]
    var = m.variant
    mode = var.norm_mode            # every rmsnorm's weight step ("llama" unless a variant)
    rd = var.rotary_dim or D
    # the same kernel family for every row count (invariance): gemm_tc, or gemm_q for a
    # quantized linear (linear.py), which is gemm_tc on the dequantized weights
    linear = run_linear
    arena = ws if arena is None else arena

    fuse = decode and lora is None and decode_fusable(model, n)
    add_lora = (lambda *a: None) if lora is None else \
        (lambda layer, group, y, x: lora.apply(b, stream, layer, group, y, x, n))
    if not embeds_uploaded:
        if tp is None:   # a GGUF table kept packed is dequantized on lookup
            run_embedding(b, stream, ws.residual, W.embed_tokens, ws.token_ids,
                          ws.h_tokens[:n], n, hid, m.vocab_size)
        else:
            tp.embedding(stream, ws.residual, ws.token_ids, W.embed_tokens, n)
        if var.embed_scale:   # Gemma's normalizer (uploaded embeddings already carry it)
            elementwise.scale_inplace(b, stream, ws.residual, var.embed_scale, n * hid)
    for i, L in enumerate(W.layers):
        if fuse:   # ws.residual is the whole stream here: down_proj added into it
            gemm_fused.gemm_rmsnorm(b, stream, ws.qkv, ws.residual, fused_operand(L.qkv),
                                    L.input_layernorm, n, ws.qkv_dim, hid, eps,
                                    bias_ptr=L.qkv_bias)
        else:
            if i == 0:
                rmsnorm.rmsnorm(b, stream, ws.normed, ws.residual, L.input_layernorm, n, hid,
                                eps, weight_mode=mode)
            else:
                rmsnorm.rmsnorm(b, stream, ws.normed, ws.hidden, L.input_layernorm, n, hid,
                                eps, residual_ptr=ws.residual, weight_mode=mode)
            linear(b, stream, ws.qkv, ws.normed, L.qkv, n, ws.qkv_dim, hid)
            if not L.qkv_bias.is_null():
                elementwise.add_bias(b, stream, ws.qkv, L.qkv_bias, n, ws.qkv_dim)
            add_lora(i, "qkv", ws.qkv, ws.normed)
        kc, vc = arena.k_cache(i), arena.v_cache(i)
        window = m.layer_windows[i]   # 0: full attention (per-layer windows of qwen2/qwen3)
        # a sliding-window layer beside full ones: its group's own blocks (kv_groups.py)
        slots, tables = ((ws.window_slots, ws.window_tables) if model._layer_group[i]
                         else (ws.slot_mapping, ws.block_tables))
        # rope (+ q/k norm) and the k/v cache write in one launch; the layer's own table
        rope.rope_write_kv(b, stream, ws.qkv, ws.positions, model._layer_rope[i], kc, vc,
                           slots, n, H, KV, D, model._rope_rows, L.q_norm,
                           L.k_norm, eps, rotary_dim=rd, gemma_norm=mode == "gemma")
        paged_attention(model, stream, kc, vc, tables, n, decode, n_seqs, max_q_len, H, KV, D,
                        window, var.attn_softcap, L.sinks)
        if fuse:   # residual += o_proj(attn), then the MLP's norm inside gate_up, and
            # residual += down(act_mul(gate_up)): no rmsnorm or act_mul launch
            gemm_fused.gemm_residual(b, stream, ws.residual, ws.attn_out,
                                     fused_operand(L.o_proj), n, hid, H * D)
            gemm_fused.gemm_rmsnorm(b, stream, ws.gate_up, ws.residual, fused_operand(L.gate_up),
                                    L.post_attention_layernorm, n, 2 * inter, hid, eps)
            gemm_fused.gemm_actmul_residual(b, stream, ws.residual, ws.gate_up,
                                            fused_operand(L.down_proj), n, hid, inter, act)
            continue
        if tp is None:
            linear(b, stream, ws.hidden, ws.attn_out, L.o_proj, n, hid, H * D)
        else:
            tp.row_parallel(stream, ws.hidden, ws.attn_out, L.o_proj, n, hid, H * D)
        if not L.o_bias.is_null():
            elementwise.add_bias(b, stream, ws.hidden, L.o_bias, n, hid)
        add_lora(i, "o", ws.hidden, ws.attn_out)
        if var.sandwich_norms:   # Gemma: the branch normalized before the residual add
            rmsnorm.rmsnorm(b, stream, ws.hidden, ws.hidden, L.post_attention_layernorm, n,
                            hid, eps, weight_mode=mode)
        rmsnorm.rmsnorm(b, stream, ws.normed, ws.hidden, L.pre_mlp_norm, n, hid, eps,
                        residual_ptr=ws.residual, weight_mode=mode)
        if L.moe is not None:   # a mixture-of-experts block instead of the MLP (moe.py)
            moe_mlp(model, stream, n, L.moe)
            continue
        linear(b, stream, ws.gate_up, ws.normed, L.gate_up, n, 2 * inter, hid)
        if not L.gate_up_bias.is_null():
            elementwise.add_bias(b, stream, ws.gate_up, L.gate_up_bias, n, 2 * inter)
        add_lora(i, "gate_up", ws.gate_up, ws.normed)
        activation.act_mul(b, stream, ws.act, ws.gate_up, n, inter, act)
        if tp is None:
            linear(b, stream, ws.hidden, ws.act, L.down_proj, n, hid, inter)
        else:
            tp.row_parallel(stream, ws.hidden, ws.act, L.down_proj, n, hid, inter)
        if not L.down_bias.is_null():
            elementwise.add_bias(b, stream, ws.hidden, L.down_bias, n, hid)
        add_lora(i, "down", ws.hidden, ws.act)
        if var.sandwich_norms:
            rmsnorm.rmsnorm(b, stream, ws.hidden, ws.hidden, L.post_feedforward_layernorm, n,
                            hid, eps, weight_mode=mode)
    if fuse:
        rmsnorm.rmsnorm(b, stream, out_ptr, ws.residual, W.norm, n, hid, eps)
    else:
        rmsnorm.rmsnorm(b, stream, out_ptr, ws.hidden, W.norm, n, hid, eps,
                        residual_ptr=ws.residual, weight_mode=mode)


def decode_fusable(model, n: int) -> bool:
    """Whether a decode step of `n` rows may run the fused GEMMs (ops/gemm_fused.py): at
    most 16 rows (their tile), every layer a dense MLP with BF16 or quantized (Q4 / FP8)
    linears and no o_proj / gate_up / down_proj bias, on one device. The bits are the
    unfused ones either way. GGUF linears (GgufLinear) are not among the fused GEMMs'
    operands: a model holding one runs unfused."""
    var = model._meta.variant
    if n > 16 or model._tp is not None or var.norm_mode != "llama" or var.sandwich_norms:
        return False   # the fused GEMMs' norm prologue is Llama's
    return all(L.moe is None and L.o_bias.is_null() and L.gate_up_bias.is_null() and
               L.down_bias.is_null() and
               all(isinstance(w, (DevicePtr, Q4Linear, Fp8Linear))
                   for w in (L.qkv, L.o_proj, L.gate_up, L.down_proj))
               for L in model._weights.layers)


def lm_head(model, stream: int, x_ptr: DevicePtr, n_rows: int, out_ptr: DevicePtr) -> None:
    """logits[n_rows, vocab] = x[n_rows, hidden] @ lm_head^T, BF16 or FP32 per the model.

    The batch-invariant tensor-core GEMM, as every linear layer: a row's logits never depend
    on its neighbours, and FP32 output is its accumulator unrounded.
    """
    m = model._meta
    if model._tp is not None:   # each rank's vocabulary slice, gathered into whole rows
        model._tp.lm_head(stream, x_ptr, n_rows, out_ptr, model._weights.lm_head,
                          model.use_fp32_logits)
        return
    run_linear(model.backend, stream, out_ptr, x_ptr, model._weights.lm_head, n_rows,
               m.vocab_size, m.hidden_size, out_fp32=model.use_fp32_logits)
    if m.variant.final_softcap:   # Gemma: cap * tanh(logits / cap), on what was stored
        elementwise.softcap_inplace(model.backend, stream, out_ptr, m.variant.final_softcap,
                                    n_rows * m.vocab_size, model.use_fp32_logits)


__all__ = ["run_decoder", "decode_fusable", "lm_head", "NULL"]

