"""What `metrale info` shows about a checkpoint's math: every field that changes what the
model computes (formats/field_table.py), as metrale will run it."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace


def _runs(windows) -> str:
    """(0, 0, 5, 5) -> "full on layers 0-1, window 5 on layers 2-3"."""
    parts, start = [], 0
    for i in range(1, len(windows) + 1):
        if i == len(windows) or windows[i] != windows[start]:
            layers = f"layer {start}" if i - start == 1 else f"layers {start}-{i - 1}"
            w = windows[start]
            parts.append(f"{'full attention' if not w else f'window {w}'} on {layers}")
            start = i
    return ", ".join(parts)


def rope_text(meta) -> str:
    if meta.architecture == "whisper":
        return "none (learned / sinusoidal positions)"
    rs, theta = meta.rope_scaling, f"theta {meta.rope_theta:g}"
    if rs is None:
        return f"default, {theta}"
    if rs.rope_type == "linear":
        return f"linear, factor {rs.factor:g}, {theta}"
    if rs.rope_type == "dynamic":
        return (f"dynamic NTK, factor {rs.factor:g}, {theta}: the default rope below "
                f"max_position_embeddings {rs.original_max_position_embeddings:,} (positions "
                "past it are refused)")
    if rs.rope_type == "longrope":
        orig = rs.original_max_position_embeddings
        return (f"longrope, short factors below position {orig:,} and long ones from it on "
                f"(every position long for a prompt longer than {orig:,}, as one transformers "
                f"generate call), attention factor {rs.attention_factor:.4f}, {theta}")
    if rs.rope_type == "llama3":
        return (f"llama3, factor {rs.factor:g}, low/high freq factor {rs.low_freq_factor:g}/"
                f"{rs.high_freq_factor:g}, original context "
                f"{rs.original_max_position_embeddings:,}, {theta}")
    return (f"yarn, factor {rs.factor:g}, original context "
            f"{rs.original_max_position_embeddings:,}, beta fast/slow {rs.beta_fast:g}/"
            f"{rs.beta_slow:g}, attention factor {rs.yarn_attention_factor():.4f}"
            f"{'' if rs.truncate else ', untruncated'}, {theta}")


def variant_fields(meta) -> dict[str, str]:
    """How the block departs from Llama's (formats/decoder_variant.py), field by field."""
    var, out = meta.variant, {}
    if var.norm_mode == "gemma":
        out["norms"] = ("RMSNorm weights applied as (1 + w), one BF16 rounding"
                        + (", four per layer: the attention and MLP outputs are normalized "
                           "before their residual adds" if var.sandwich_norms else ""))
    elif var.norm_mode == "once":
        out["norms"] = "RMSNorm as bf16(x * rsqrt(mean(x^2) + eps) * w), one rounding"
    if var.embed_scale:
        out["embed_scale"] = (f"x {var.embed_scale:g} (sqrt(hidden_size) = "
                              f"{meta.hidden_size ** 0.5:.4f} cast to BF16, as HF does)")
    if var.attn_scale or var.attn_softcap:
        scale = var.attn_scale or meta.head_dim ** -0.5
        out["scores"] = f"q.k x {scale:.6g}" + (
            f" (query_pre_attn_scalar {round(scale ** -2, 4):g})" if var.attn_scale else "") + (
            f", soft-capped: {var.attn_softcap:g} * tanh(s / {var.attn_softcap:g})"
            if var.attn_softcap else "")
    if var.final_softcap:
        out["logit_cap"] = f"{var.final_softcap:g} * tanh(logits / {var.final_softcap:g})"
    if var.rotary_dim:
        out["rotary_dims"] = (f"the first {var.rotary_dim} of each head's {meta.head_dim} "
                              "(partial_rotary_factor)")
    if var.fused_projections:
        out["projections"] = "qkv_proj and gate_up_proj stored fused (loaded as they are)"
    if var.local_rope is not None:
        theta, rs = var.local_rope
        local = replace(meta, rope_theta=theta, rope_scaling=rs)
        out["local_rope"] = f"sliding layers: {rope_text(local)}"
    return out


def experts_text(meta) -> str:
    """The mixture-of-experts block as metrale computes it."""
    moe = meta.moe
    sparse = [i for i, s in enumerate(moe.sparse_layers) if s]
    dense = [i for i, s in enumerate(moe.sparse_layers) if not s]
    r = moe.deepseek   # DeepSeek's router (deepseek_moe_config.py), else the softmax one
    text = (f"{moe.num_experts} experts of width {moe.expert_intermediate_size}, top-"
            f"{moe.top_k} of a float32 {'softmax' if r is None else r.scoring}"
            + ("" if r is None else
               (" + e_score_correction_bias (choice only)" if r.correction_bias else "")
               + (f" in the best {r.topk_group} of {r.n_group} expert groups"
                  if r.n_group > 1 else ""))
            + f"{', renormalised' if moe.norm_topk_prob else ''}"
            + ("" if r is None or r.routed_scaling_factor == 1 else
               f", times {r.routed_scaling_factor:g}"))
    if moe.shared_expert_intermediate_size:
        text += (f", plus a shared expert of width {moe.shared_expert_intermediate_size} "
                 + ("times sigmoid(shared_expert_gate)" if r is None else "(ungated)"))
    if moe.oss is not None:   # gpt-oss
        o = moe.oss
        text += (f" (a softmax over the top-{moe.top_k} biased router logits, the same "
                 f"weights), expert biases, clamped SwiGLU alpha {o.swiglu_alpha:g} limit "
                 f"{o.swiglu_limit:g}" + ("; MXFP4 experts kept at their bytes (4.25 bits a "
                                         "weight, 0.27x of BF16), dequantized in the "
                                         "grouped GEMM's tiles" if o.mxfp4 else ""))
    text += f"; sparse on {len(sparse)} of {len(moe.sparse_layers)} layers"
    if dense:
        text += f" (dense MLP {meta.intermediate_size} on layers {dense})"
    return text


def biases_text(meta) -> str:
    if meta.architecture == "whisper":
        return "q/v/out projections, MLP, layer norms (Whisper)"
    parts = [p for p, on in (("q/k/v", meta.attention_bias), ("o_proj", meta.o_proj_bias),
                             ("gate/up/down", meta.mlp_bias)) if on]
    return ", ".join(parts) if parts else "none"


def stored_dtypes(source) -> dict[str, int]:
    """Stored dtype (BF16, F32, a GGUF's Q4_K...) -> how many tensors have it."""
    return dict(sorted(Counter(source.tensor_dtype(n) for n in source.tensor_names()).items()))


def dtype_text(meta, source) -> str:
    stored = stored_dtypes(source)
    kinds = ", ".join(f"{n} {dt}" for dt, n in stored.items())
    if getattr(meta, "quantization", None) is not None:
        return (f"{meta.dtype} in config.json; tensors: {kinds}; the quantized linears stay "
                "packed on the device (quantization), the rest bfloat16")
    lossy = sorted(dt for dt in stored if dt not in ("BF16", "U8"))
    how = "exact" if not lossy else (f"{'/'.join(lossy)} rounded to nearest even BF16")
    if "U8" in stored:   # gpt-oss's MXFP4 experts
        how += "; U8: MXFP4 expert blocks and scales, kept packed"
    if hasattr(source, "stored_types"):   # a GGUF file: no config.json
        return f"GGUF {source.stored_types()}; {gguf_held_text(meta, source)}"
    return f"{meta.dtype} in config.json; tensors: {kinds} -> bfloat16 on the device ({how})"


def gguf_held_text(meta, source) -> str:
    """How `metrale.load` holds a GGUF's tensors by default: block types at their stored
    bytes (model_engine/gguf_weights.py), the rest bfloat16."""
    from ..model_engine.gguf_weights import held_types
    held = held_types(meta, source)
    packed = sorted({t for t in held.values() if t != "BF16"})
    n_packed = sum(t != "BF16" for t in held.values())
    floats = sorted({source.tensor_dtype(n) for n, t in held.items() if t == "BF16"
                     and source.packed_type(n) is None} - {"BF16"})
    parts = []
    if packed:
        parts.append(f"{n_packed} tensors ({'/'.join(packed)}) kept at their stored bytes on "
                     "the device, dequantized inside the GEMMs and the embedding lookup "
                     "(ggml's float32 values rounded to nearest even bfloat16)")
    deq = [n for n, t in held.items() if t == "BF16" and source.packed_type(n) is not None]
    if deq:
        parts.append(f"{len(deq)} block-type tensors dequantized to bfloat16 at load (in a "
                     f"fused group with a float part, e.g. {deq[0]})")
    parts.append(("the rest bfloat16" if packed or deq else "every tensor bfloat16")
                 + (f" ({'/'.join(floats)} rounded to nearest even)" if floats else ""))
    return "; ".join(parts)


def math_fields(meta, source, head_stored: bool) -> dict[str, str]:
    """Field -> how metrale computes it, in the order `metrale info` prints them."""
    out = {"rope": rope_text(meta)}
    if meta.architecture != "whisper":
        out["attention"] = _runs(meta.layer_windows or (0,) * meta.num_layers)
        out["activation"] = (f"{meta.hidden_act} (gated MLP: act(gate) * up)" if meta.moe is None
                             or meta.moe.oss is None else "the experts' clamped SwiGLU "
                             "(clamp(up) + 1) * gate' * sigmoid(alpha * gate'), gate' = "
                             "min(gate, limit)")
        out["qk_norm"] = ("none" if not meta.qk_norm else "RMSNorm on each q/k head "
                          + ("(gemma: 1 + w)" if meta.variant.norm_mode == "gemma"
                             else "(qwen3, glm4_moe)"))
        out.update(variant_fields(meta))
    else:
        w = meta.whisper
        out["attention"] = (f"full; encoder {w.max_source_positions} positions "
                            f"({w.num_mel_frames} mel frames), decoder "
                            f"{w.max_target_positions}")
        out["activation"] = (f"{w.activation_function} (MLP); embedding scale none "
                             "(transformers never applies scale_embedding)")
    if getattr(meta, "hybrid", None) is not None:   # linear-attention layers
        from .info_hybrid import hybrid_math
        out.update(hybrid_math(meta))
    if meta.moe is not None:
        out["experts"] = experts_text(meta)
    out["biases"] = biases_text(meta)
    out["embeddings"] = ("lm_head separate (untied)" if not meta.tie_word_embeddings else
                         "tied, but the checkpoint stores its own head, which is used (as "
                         "transformers 5 does)" if head_stored else "tied: lm_head = input "
                         "embedding")
    if meta.vision is not None:
        v = meta.vision
        out["vision"] = (f"CLIP {v.num_layers} layers x {v.hidden_size}, {v.hidden_act}, "
                         f"features from hidden_states[{v.vision_feature_layer}] "
                         f"({v.vision_feature_select_strategy}), projector "
                         f"{v.projector_hidden_act}{' with' if v.projector_bias else ' no'} "
                         f"biases, {v.num_image_tokens} tokens per image")
    if getattr(meta, "quantization", None) is not None:
        out["quantization"] = quantization_text(meta)
    out["dtype"] = dtype_text(meta, source)
    return out


def quantization_text(meta) -> str:
    """The quantized format and which linears it covers (formats/quant*.py)."""
    from ..formats.quant.layout import linear_shapes
    q = meta.quantization
    mods = linear_shapes(meta)
    kept = sorted({m.split(".")[-1] for m in mods if not q.converts(m)})
    return (f"{q.describe()}; dequantized to BF16 inside the GEMM tiles"
            + (f"; left BF16: {', '.join(kept)}" if kept else ""))
