"""The tensors a checkpoint must hold (HF key names and shapes), derived from its metadata.

Names follow the Hugging Face checkpoints on the Hub. LLaVA uses the llava-hf layout
(`language_model.model.*`, `language_model.lm_head.weight`, `vision_tower.vision_model.*`,
`multi_modal_projector.*`); `DirectorySource` maps the newer transformers layouts onto it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .gpt_oss_config import oss_layer_tensors
from .hybrid_layout import hybrid_tensors
from .deepseek_config import deepseek_layer_tensors
from .deepseek_moe_config import deepseek_moe_tensors
from .moe_config import moe_layer_tensors

if TYPE_CHECKING:
    from .metadata import ModelMetadata


def decoder_tensors(m: "ModelMetadata", prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Decoder tensors (DECODER_ARCHS) -> shape ([out, in] for linear weights)."""
    h, hd, i = m.hidden_size, m.head_dim, m.intermediate_size
    q, kv = m.num_heads * hd, m.num_kv_heads * hd
    var = m.variant
    t: dict[str, tuple[int, ...]] = {f"{prefix}model.embed_tokens.weight": (m.vocab_size, h)}
    for n in range(m.num_layers):
        p = f"{prefix}model.layers.{n}."
        t[p + "input_layernorm.weight"] = (h,)
        if m.mla is not None:   # DeepSeek's latent attention (deepseek_config.py)
            t.update(deepseek_layer_tensors(m, p))
        elif var.fused_projections:   # Phi-3: q|k|v and gate|up stored fused
            t[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        else:
            t[p + "self_attn.q_proj.weight"] = (q, h)
            t[p + "self_attn.k_proj.weight"] = (kv, h)
            t[p + "self_attn.v_proj.weight"] = (kv, h)
        if m.mla is None:
            t[p + "self_attn.o_proj.weight"] = (h, q)
        if var.attention_sinks:
            t[p + "self_attn.sinks"] = (m.num_heads,)
        if m.attention_bias:
            t[p + "self_attn.q_proj.bias"] = (q,)
            t[p + "self_attn.k_proj.bias"] = (kv,)
            t[p + "self_attn.v_proj.bias"] = (kv,)
        if m.o_proj_bias:
            t[p + "self_attn.o_proj.bias"] = (h,)
        if m.qk_norm:
            t[p + "self_attn.q_norm.weight"] = (hd,)
            t[p + "self_attn.k_norm.weight"] = (hd,)
        t[p + "post_attention_layernorm.weight"] = (h,)
        if var.sandwich_norms:   # Gemma: the MLP's own pre- and post-norm
            t[p + "pre_feedforward_layernorm.weight"] = (h,)
            t[p + "post_feedforward_layernorm.weight"] = (h,)
        if m.moe is not None and m.moe.sparse_layers[n]:   # a MoE block instead of the MLP
            t.update(oss_layer_tensors(m, p) if m.moe.oss is not None else  # gpt-oss
                     deepseek_moe_tensors(m, p) if m.moe.deepseek is not None else
                     moe_layer_tensors(m, p))
            continue
        if var.fused_projections:
            t[p + "mlp.gate_up_proj.weight"] = (2 * i, h)
        else:
            t[p + "mlp.gate_proj.weight"] = (i, h)
            t[p + "mlp.up_proj.weight"] = (i, h)
        t[p + "mlp.down_proj.weight"] = (h, i)
        if m.mlp_bias:
            t[p + "mlp.gate_proj.bias"] = (i,)
            t[p + "mlp.up_proj.bias"] = (i,)
            t[p + "mlp.down_proj.bias"] = (h,)
    t[f"{prefix}model.norm.weight"] = (h,)
    if not m.tie_word_embeddings:
        t[f"{prefix}lm_head.weight"] = (m.vocab_size, h)
    return t


def _attn(t: dict, p: str, d_q: int, d_kv: int, d: int) -> None:
    # Whisper and CLIP: q/v/out biased; Whisper's k_proj has no bias, CLIP's has one.
    for proj, dim in (("q_proj", d_q), ("k_proj", d_kv), ("v_proj", d_kv)):
        t[f"{p}{proj}.weight"] = (dim, d)
    t[f"{p}out_proj.weight"] = (d, d_q)
    t[f"{p}q_proj.bias"] = (d_q,)
    t[f"{p}v_proj.bias"] = (d_kv,)
    t[f"{p}out_proj.bias"] = (d,)


def _ln(t: dict, name: str, d: int) -> None:
    t[name + ".weight"] = (d,)
    t[name + ".bias"] = (d,)


def whisper_tensors(m: "ModelMetadata") -> dict[str, tuple[int, ...]]:
    """WhisperForConditionalGeneration tensors; `proj_out` is tied to the decoder embedding."""
    w = m.whisper
    d = w.d_model
    t: dict[str, tuple[int, ...]] = {
        "model.encoder.conv1.weight": (d, w.num_mel_bins, 3), "model.encoder.conv1.bias": (d,),
        "model.encoder.conv2.weight": (d, d, 3), "model.encoder.conv2.bias": (d,),
        "model.encoder.embed_positions.weight": (w.max_source_positions, d),
    }
    for n in range(w.encoder_layers):
        p = f"model.encoder.layers.{n}."
        _attn(t, p + "self_attn.", d, d, d)
        _ln(t, p + "self_attn_layer_norm", d)
        t[p + "fc1.weight"], t[p + "fc1.bias"] = (w.encoder_ffn_dim, d), (w.encoder_ffn_dim,)
        t[p + "fc2.weight"], t[p + "fc2.bias"] = (d, w.encoder_ffn_dim), (d,)
        _ln(t, p + "final_layer_norm", d)
    _ln(t, "model.encoder.layer_norm", d)
    t["model.decoder.embed_tokens.weight"] = (m.vocab_size, d)
    t["model.decoder.embed_positions.weight"] = (w.max_target_positions, d)
    for n in range(w.decoder_layers):
        p = f"model.decoder.layers.{n}."
        _attn(t, p + "self_attn.", d, d, d)
        _ln(t, p + "self_attn_layer_norm", d)
        _attn(t, p + "encoder_attn.", d, d, d)
        _ln(t, p + "encoder_attn_layer_norm", d)
        t[p + "fc1.weight"], t[p + "fc1.bias"] = (w.decoder_ffn_dim, d), (w.decoder_ffn_dim,)
        t[p + "fc2.weight"], t[p + "fc2.bias"] = (d, w.decoder_ffn_dim), (d,)
        _ln(t, p + "final_layer_norm", d)
    _ln(t, "model.decoder.layer_norm", d)
    if not m.tie_word_embeddings:
        t["proj_out.weight"] = (m.vocab_size, d)
    return t


def llava_tensors(m: "ModelMetadata") -> dict[str, tuple[int, ...]]:
    """LLaVA tensors in the llava-hf layout (CLIP tower + 2-layer projector + text model)."""
    v = m.vision
    d = v.hidden_size
    p = "vision_tower.vision_model."
    t: dict[str, tuple[int, ...]] = {
        p + "embeddings.class_embedding": (d,),
        p + "embeddings.patch_embedding.weight": (d, v.num_channels, v.patch_size, v.patch_size),
        p + "embeddings.position_embedding.weight": (v.num_patches + 1, d),
    }
    _ln(t, p + "pre_layrnorm", d)  # sic: HF's CLIP spells it "pre_layrnorm"
    for n in range(v.num_layers):
        q = f"{p}encoder.layers.{n}."
        _attn(t, q + "self_attn.", d, d, d)
        t[q + "self_attn.k_proj.bias"] = (d,)
        _ln(t, q + "layer_norm1", d)
        t[q + "mlp.fc1.weight"], t[q + "mlp.fc1.bias"] = (v.intermediate_size, d), \
            (v.intermediate_size,)
        t[q + "mlp.fc2.weight"], t[q + "mlp.fc2.bias"] = (d, v.intermediate_size), (d,)
        _ln(t, q + "layer_norm2", d)
    _ln(t, p + "post_layernorm", d)
    th = v.text_hidden_size
    t["multi_modal_projector.linear_1.weight"] = (th, d)
    t["multi_modal_projector.linear_2.weight"] = (th, th)
    if v.projector_bias:
        t["multi_modal_projector.linear_1.bias"] = (th,)
        t["multi_modal_projector.linear_2.bias"] = (th,)
    t.update(decoder_tensors(m.text, prefix="language_model."))
    return t


def head_name(meta: "ModelMetadata") -> str:
    """The output projection's tensor name (tied to the input embedding or not)."""
    if meta.architecture == "whisper":
        return "proj_out.weight"
    return "language_model.lm_head.weight" if meta.architecture == "llava" else "lm_head.weight"


def expected_tensors(meta: "ModelMetadata",
                     names=None) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold: HF key name -> shape. Tied: no head, unless
    `names` (the checkpoint's tensor names) holds one: transformers 5 then keeps the stored
    head (`tie_weights` does not tie a head that differs from the embedding), so it is used
    too."""
    if meta.architecture == "whisper":
        t = whisper_tensors(meta)
    elif meta.architecture == "llava":
        t = llava_tensors(meta)
    elif getattr(meta, "hybrid", None) is not None:
        t = hybrid_tensors(meta)
    else:
        t = decoder_tensors(meta)
    head = head_name(meta)
    if meta.tie_word_embeddings and names is not None and head in set(names):
        t[head] = (meta.vocab_size, meta.hidden_size)
    return t


def num_parameters(meta: "ModelMetadata") -> int:
    """Parameters in the checkpoint (tied embeddings counted once)."""
    return sum(math.prod(s) for s in expected_tensors(meta).values())
