"""Config fields of gpt-oss (`gpt_oss`; gpt_oss_config.py) in field_table.py's three
statuses, laid over the decoder fields every family shares."""
from __future__ import annotations

from .field_status import honoured as _h, irrelevant as _i

_NOT_READ = "not read by this family's HF modeling code"

GPT_OSS = {
    "vocab_size": _h("embedding and lm_head rows (absent: 201088)"),
    "hidden_size": _h("model width (absent: 2880)"),
    "intermediate_size": _h("width of each expert (absent: 2880); every MLP is the MoE block"),
    "num_hidden_layers": _h("layer count (absent: 36)"),
    "num_attention_heads": _h("query heads (absent: 64)"),
    "num_key_value_heads": _h("kv heads (absent: 8; null: num_attention_heads)"),
    "head_dim": _h("absent: 64; null: hidden_size // num_attention_heads"),
    "max_position_embeddings": _h("the context limit (absent: 131072)"),
    "rms_norm_eps": _h("RMSNorm epsilon (absent: 1e-5); the weight applies as "
                       "bf16(x * inv * w), one rounding (GptOssRMSNorm)"),
    "attention_bias": _h("biases on q/k/v AND o_proj (absent: true)"),
    "sliding_window": _h("window of the 'sliding_attention' layers (absent: 128)"),
    "layer_types": _h("'full_attention' | 'sliding_attention' per layer (absent: every other "
                      "layer slides, from layer 0); other types refused"),
    "num_local_experts": _h("experts (absent: 128); alias num_experts, differing values "
                            "refused"),
    "num_experts": _h("alias of num_local_experts (HF attribute_map)"),
    "num_experts_per_tok": _h("top-k experts per token (absent: 4)"),
    "swiglu_alpha": _h("the clamped SwiGLU's sigmoid gain (absent: 1.702)"),
    "swiglu_limit": _h("the clamp of the gate (above) and up branch (both sides) (absent: 7)"),
    "rope_theta": _h("rope base when the rope dict has none (absent: 150000)"),
    "rope_scaling": _h("the rope (scope 'rope'); absent with rope_parameters: HF's default "
                       "yarn (factor 32 over 4096 positions, untruncated)"),
    "rope_parameters": _h("as rope_scaling (transformers 5)"),
    "quantization_config": _h("mxfp4 experts as released (scope quantization_config.mxfp4); "
                              "other methods refused"),
    "hidden_act": _i(_NOT_READ + ": the experts run their clamped SwiGLU"),
    "router_aux_loss_coef": _i("training only: the load-balancing loss"),
    "output_router_logits": _i("returns router logits for the auxiliary loss, not the logits"),
    "experts_per_token": _i(_NOT_READ + " (the released config's copy of "
                            "num_experts_per_tok)"),
    "initial_context_length": _i(_NOT_READ + " (the released config's note of the rope's "
                                 "original context)"),
    "mlp_bias": _i(_NOT_READ), "use_sliding_window": _i(_NOT_READ),
    "max_window_layers": _i(_NOT_READ),
}
