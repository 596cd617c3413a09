"""Config fields of DeepSeek-V2 / V3 (`deepseek_v2`, `deepseek_v3`; deepseek_config.py) in
field_table.py's three statuses, laid over the decoder fields every family shares."""
from __future__ import annotations

from .field_status import honoured as _h, irrelevant as _i, refused as _r

_NOT_READ = "not read by this family's HF modeling code"
_TRAIN = "training only (auxiliary balance losses), inactive at inference"

_SHARED = {
    "vocab_size": _h("embedding and lm_head rows"),
    "hidden_size": _h("model width"),
    "intermediate_size": _h("width of the dense MLP of the first first_k_dense_replace layers"),
    "num_hidden_layers": _h("layer count"),
    "num_attention_heads": _h("query heads; every head has its own key and value expanded "
                              "from the latent"),
    "num_key_value_heads": _i("every head's key and value are expanded from the one latent "
                              "by kv_b_proj; transformers' attention (sdpa, its default) runs "
                              "the same whatever this says (saved configs carry the class "
                              "default 128 beside 4 heads)"),
    "qk_head_dim": _i("derived: qk_nope_head_dim + qk_rope_head_dim (the HF config's "
                      "__post_init__ overwrites it)"),
    "head_dim": _i("overwritten by qk_rope_head_dim in the HF config's __post_init__"),
    "max_position_embeddings": _h("the context limit (yarn raises it to factor * "
                                  "original_max_position_embeddings)"),
    "rms_norm_eps": _h("every RMSNorm's epsilon (also q_a_layernorm and kv_a_layernorm)"),
    "hidden_act": _h("activation of the dense, shared and routed MLPs (ACT2FN names of "
                     "field_table.HF_ACTIVATIONS)"),
    "attention_bias": _r("true (biases on q_a / kv_a / o projections) refused; false "
                         "accepted"),
    "mlp_bias": _i(_NOT_READ),
    "kv_lora_rank": _h("width of the latent the KV cache keeps (with qk_rope_head_dim)"),
    "q_lora_rank": _h("width of the query's low-rank bottleneck; null: q_proj straight "
                      "from the hidden state (V2-Lite)"),
    "qk_nope_head_dim": _h("per-head query/key dims without rope (W_UK rows per head)"),
    "qk_rope_head_dim": _h("per-head roped dims (one roped key shared by every head); also "
                           "the rope's dimension"),
    "v_head_dim": _h("per-head value dims (W_UV rows per head)"),
    "n_routed_experts": _h("routed experts"),
    "n_shared_experts": _h("shared experts, fused as one MLP of moe_intermediate_size * "
                           "n_shared_experts"),
    "moe_intermediate_size": _h("width of each routed expert"),
    "num_experts_per_tok": _h("experts chosen per token"),
    "first_k_dense_replace": _h("layers i < first_k_dense_replace run the dense MLP"),
    "routed_scaling_factor": _h("the routed experts' weights are multiplied by it"),
    "n_group": _h("expert groups of the group-limited choice"),
    "topk_group": _h("groups a token may choose experts from"),
    "moe_layer_freq": _r("1 accepted (what transformers runs); other values refused: "
                         "DeepSeek's own code would skip MoE layers, transformers does not"),
    "rope_theta": _h("rope base when the rope dict has none (default 10000)"),
    "rope_scaling": _h("the rope (scope 'rope'; yarn's mscale_all_dim also scales the "
                       "attention scores, HF yarn_apply_mscale)"),
    "rope_parameters": _h("as rope_scaling (transformers 5)"),
    "partial_rotary_factor": _r("1 or absent accepted; other values refused"),
    "quantization_config": _h("fine-grained fp8 (DeepSeek-V3's released form; its fields: "
                              "scope quantization_config.fp8); other methods refused"),
    "output_router_logits": _i("returns router logits for the auxiliary loss, not the logits"),
    "aux_loss_alpha": _i(_TRAIN), "seq_aux": _i(_TRAIN),
    "ep_size": _i("expert-parallel degree of DeepSeek's own training/serving code, not the "
                  "math"),
    "auto_map": _i("remote-code class names; transformers' own classes are the definition"),
    "use_sliding_window": _i(_NOT_READ), "sliding_window": _i(_NOT_READ),
    "max_window_layers": _i(_NOT_READ), "layer_types": _i(_NOT_READ),
}

DEEPSEEK_V3 = {
    **_SHARED,
    "num_local_experts": _h("alias of n_routed_experts (HF attribute_map); differing values "
                            "refused"),
    "norm_topk_prob": _h("the chosen sigmoid scores divided by their sum + 1e-20 (default "
                         "true)"),
    "rope_interleave": _h("rope pairs: adjacent dims (true, the default) or the two halves"),
    "topk_method": _r("noaux_tc (what transformers runs) accepted; other values refused"),
    "scoring_func": _r("sigmoid (what transformers runs) accepted; other values refused"),
    "num_nextn_predict_layers": _i("the MTP module's depth: transformers builds no MTP "
                                   "layer and the logits do not depend on it; the first MTP "
                                   "layer (model.layers.{num_hidden_layers}.*) loads as the "
                                   "draft proposer when present (load option mtp, "
                                   "model_engine/mtp.py), deeper ones are held, not loaded"),
    "num_mtp_layers": _i("alias of num_nextn_predict_layers (HF attribute_map)"),
}

DEEPSEEK_V2 = {
    **_SHARED,
    "num_experts": _h("alias of n_routed_experts (HF attribute_map); differing values "
                      "refused"),
    "topk_method": _h("greedy (top-k of the softmax) or group_limited_greedy (n_group / "
                      "topk_group by each group's best score); others refused"),
    "norm_topk_prob": _r("false accepted; true refused: transformers' V2 router never "
                         "renormalises, DeepSeek's own code would"),
    "scoring_func": _r("softmax (what transformers runs) accepted; other values refused"),
    "rope_interleave": _i(_NOT_READ + " (V2 always rotates adjacent pairs)"),
    "num_nextn_predict_layers": _i(_NOT_READ),
}

DEEPSEEK_SCOPES = {"deepseek_v3": DEEPSEEK_V3, "deepseek_v2": DEEPSEEK_V2}
