"""`DecoderVariant`: how a decoder family departs from the Llama block that every layer pass
runs by default (ModelMetadata.variant). Each field's default is Llama's, so a checkpoint of
the first families (llama, mistral, qwen2, qwen3 and the MoE ones) carries `DecoderVariant()`
and runs exactly as before; the families of issue 40 set what they change:

  norm_mode       every RMSNorm's weight step (ops.rmsnorm.WEIGHT_MODES): "llama"
                  bf16(bf16(x*inv)*w); "gemma" bf16(x*inv*(1 + w)) (Gemma 2/3, the q/k norms
                  too); "once" bf16(x*inv*w) (gpt-oss)
  sandwich_norms  Gemma's four norms a layer: the attention and MLP outputs are normalized
                  (post_attention_layernorm, post_feedforward_layernorm) before their
                  residual adds, and the MLP reads pre_feedforward_layernorm
  embed_scale     0, or the BF16 value the token embeddings are multiplied by (Gemma:
                  sqrt(hidden_size) cast to the weights' dtype, as HF's normalizer)
  attn_scale      0 (head_dim ** -0.5), or the attention's score scale (Gemma:
                  query_pre_attn_scalar ** -0.5)
  attn_softcap    0, or the cap of cap * tanh(score / cap) on the attention scores (Gemma 2)
  final_softcap   0, or the same cap on the logits (Gemma 2/3 final_logit_softcapping)
  local_rope      None, or (rope_theta, RopeScaling | None) of the sliding-window layers
                  (Gemma 3's rope_local_base_freq); full layers use the model's rope
  rotary_dim      0 (head_dim), or the rotated dims of a partial rotary embedding (Phi-3/4,
                  GLM-4.5)
  fused_projections  the checkpoint stores q|k|v as one `qkv_proj` and gate|up as one
                  `gate_up_proj` (Phi-3): the layout metrale fuses to anyway
  attention_sinks a learned sink logit per head (`self_attn.sinks`, gpt-oss)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderVariant:
    norm_mode: str = "llama"
    sandwich_norms: bool = False
    embed_scale: float = 0.0
    attn_scale: float = 0.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    local_rope: tuple[float, Any] | None = None
    rotary_dim: int = 0
    fused_projections: bool = False
    attention_sinks: bool = False

    def rope_of_layer(self, meta, window: int) -> tuple[float, Any]:
        """(rope_theta, scaling) of a layer with sliding window `window` (0: full)."""
        if window and self.local_rope is not None:
            return self.local_rope
        return meta.rope_theta, meta.rope_scaling
