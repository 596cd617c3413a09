"""Config fields of the GLM-4.5 families in field_table.py's three statuses, laid over the
decoder fields every family shares: `glm4_moe` (GLM-4.5 / 4.5-Air / 4.6; glm4_config.py)
and `glm4_moe_lite` (GLM-4.7-Flash: DeepSeek-V3's table under GLM's names and defaults;
deepseek_config.py)."""
from __future__ import annotations

from .deepseek_fields import DEEPSEEK_V3
from .field_status import honoured as _h, irrelevant as _i, refused as _r

_NOT_READ = "not read by this family's HF modeling code"
_MTP = ("the MTP module's depth: transformers builds no MTP layer into the model and the "
        "logits do not depend on it; its layers (model.layers.{num_hidden_layers}.. ) are "
        "held, never loaded")
_V3_ONLY = "not read by transformers' {}; its value there (noaux_tc router) accepted, others " \
    "refused: the code such a config was written for would route otherwise"

_MOE = {
    "n_routed_experts": _h("routed experts"),
    "num_local_experts": _h("alias of n_routed_experts (HF attribute_map); differing values "
                            "refused"),
    "n_shared_experts": _h("shared experts, fused as one MLP of moe_intermediate_size * "
                           "n_shared_experts (0: none)"),
    "moe_intermediate_size": _h("width of each routed expert"),
    "num_experts_per_tok": _h("experts chosen per token"),
    "routed_scaling_factor": _h("the routed experts' weights are multiplied by it"),
    "n_group": _h("expert groups of the group-limited choice (scored by their top two)"),
    "topk_group": _h("groups a token may choose experts from"),
    "norm_topk_prob": _h("the chosen sigmoid scores divided by their sum + 1e-20 (default "
                         "true)"),
    "output_router_logits": _i("returns router logits for the auxiliary loss, not the logits"),
    "num_nextn_predict_layers": _i(_MTP),
}

GLM4_MOE = {
    **_MOE,
    "num_mtp_layers": _i("alias of num_nextn_predict_layers (HF attribute_map); " + _MTP),
    "intermediate_size": _h("width of the dense MLP of the first first_k_dense_replace "
                            "layers"),
    "first_k_dense_replace": _h("layers i < first_k_dense_replace run the dense MLP "
                                "(default 1)"),
    "num_key_value_heads": _h("kv heads (absent: 8; null refused, HF's strict config "
                              "rejects it)"),
    "head_dim": _h("absent: hidden_size // num_attention_heads, floored as HF does; null "
                   "refused (HF fails)"),
    "max_position_embeddings": _h("the context limit (absent: 131072; yarn raises it)"),
    "rms_norm_eps": _h("every RMSNorm's epsilon, the q/k norms' too (absent: 1e-5)"),
    "attention_bias": _h("biases on q/k/v (never on o_proj)"),
    "use_qk_norm": _h("a per-head RMSNorm on q and k before the rope (default false)"),
    "partial_rotary_factor": _h("the rope turns the first int(head_dim * factor) dims of "
                                "each head, NeoX halves within them (absent: 0.5, "
                                "Glm4MoeConfig's default; the rope dict's wins; null, an "
                                "odd or zero count refused)"),
    "mlp_bias": _i(_NOT_READ),
    "sliding_window": _i(_NOT_READ), "use_sliding_window": _i(_NOT_READ),
    "max_window_layers": _i(_NOT_READ), "layer_types": _i(_NOT_READ),
    "topk_method": _r(_V3_ONLY.format("glm4_moe")),
    "scoring_func": _r("not read by transformers' glm4_moe; sigmoid accepted, others "
                       "refused"),
    "moe_layer_freq": _r("not read by transformers' glm4_moe (a MoE block on every layer "
                         "from first_k_dense_replace on); 1 accepted, others refused"),
    "quantization_config": _r("quantized glm4_moe checkpoints: refused whatever its value"),
}

GLM4_MOE_LITE = {
    **DEEPSEEK_V3,
    **_MOE,
    "num_mtp_layers": _i(_NOT_READ + "; read as num_nextn_predict_layers' alias for the MTP "
                         "layers it leaves unread"),
    "head_dim": _h("alias of qk_rope_head_dim (HF attribute_map; it wins); a different "
                   "qk_rope_head_dim beside it refused"),
    "mlp_layer_types": _h("'dense' | 'sparse' per layer: which layers run the MoE block "
                          "(absent: layer 0 dense, the rest sparse); other values or a wrong "
                          "length refused"),
    "first_k_dense_replace": _r("not read by transformers' glm4_moe_lite (mlp_layer_types "
                                "decides): a value that agrees with mlp_layer_types "
                                "accepted, one that disagrees refused"),
    "rms_norm_eps": _h("every RMSNorm's epsilon (absent: 1e-5; also q_a_layernorm and "
                       "kv_a_layernorm)"),
    "topk_method": _r(_V3_ONLY.format("glm4_moe_lite")),
    "scoring_func": _r("not read by transformers' glm4_moe_lite; sigmoid accepted, others "
                       "refused"),
    "moe_layer_freq": _r("not read by transformers' glm4_moe_lite; 1 accepted, others "
                         "refused"),
    "quantization_config": _r("quantized glm4_moe_lite checkpoints: refused whatever its "
                              "value"),
}

GLM4_SCOPES = {"glm4_moe": GLM4_MOE, "glm4_moe_lite": GLM4_MOE_LITE}
