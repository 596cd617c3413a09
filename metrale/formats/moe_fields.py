"""Config fields of the mixture-of-experts decoders (qwen2_moe, qwen3_moe, mixtral;
moe_config.py) in field_table.py's three statuses: the fields with their own defaults or
meaning in these families, and the sparse block's. field_table.FIELD_TABLE lays each
family's table over the decoder fields every family shares (its `_DECODER`)."""
from __future__ import annotations

from .field_status import honoured as _h, irrelevant as _i

_NOT_READ = "not read by this family's HF modeling code"
_TRAIN = "training only"

_MOE = {
    "num_experts_per_tok": _h("top-k experts per token; more than the expert count refused "
                              "(and more than 32, the router kernel's limit)"),
    "output_router_logits": _i("returns router logits for the auxiliary loss, not the logits"),
    "router_aux_loss_coef": _i(_TRAIN + ": the load-balancing loss"),
    "mlp_bias": _i(_NOT_READ),
    "head_dim": _h("absent: hidden_size // num_attention_heads; null refused (HF fails)"),
    "quantization_config": _h("FP8 (fine-grained, compressed-tensors), GPTQ and AWQ "
                              "experts as the dense families read them (formats/quant/); "
                              "routers stay BF16"),
}
_QWEN_MOE = {
    **_MOE,
    "moe_intermediate_size": _h("width of one routed expert"),
    "intermediate_size": _h("width of the dense MLP of the layers that are not sparse"),
    "norm_topk_prob": _h("renormalise the top-k routing weights to sum 1 (default false)"),
    "decoder_sparse_step": _h("layer i is sparse iff (i + 1) % step == 0 and i is not in "
                              "mlp_only_layers (default 1; < 1 refused)"),
    "mlp_only_layers": _h("layers with the dense MLP; an index outside the layers refused"),
    "max_position_embeddings": _h("the context limit (absent: 32768)"),
}

QWEN3_MOE = {
    **_QWEN_MOE,
    "num_experts": _h("routed experts (absent: 128; 0: every layer dense); alias of "
                      "num_local_experts, differing values refused"),
    "num_local_experts": _h("alias of num_experts (HF attribute_map)"),
    "num_key_value_heads": _h("kv heads; absent: 4 (HF's class default); null refused"),
    "attention_bias": _h("biases on q/k/v AND o_proj"),
    "use_sliding_window": _h("turns sliding_window on, for every layer"),
    "sliding_window": _h("the window of every layer when use_sliding_window (absent: 4096)"),
    "max_window_layers": _i(_NOT_READ + " (qwen3_moe slides every layer or none)"),
    "layer_types": _i(_NOT_READ), "qkv_bias": _i(_NOT_READ),
    "shared_expert_intermediate_size": _i(_NOT_READ + ": qwen3_moe has no shared expert"),
}

QWEN2_MOE = {
    **_QWEN_MOE,
    "num_experts": _h("routed experts (absent: 60; 0: every layer dense)"),
    "num_local_experts": _i(_NOT_READ + " (qwen2_moe reads num_experts only)"),
    "shared_expert_intermediate_size": _h("width of the shared expert, added to every "
                                          "token's output times sigmoid(x @ "
                                          "shared_expert_gate^T) (absent: 5632)"),
    "num_key_value_heads": _h("kv heads; absent: 16 (HF's class default); null refused"),
    "qkv_bias": _h("biases on q/k/v (default true); o_proj never has one"),
    "attention_bias": _i(_NOT_READ + ": qwen2_moe reads qkv_bias"),
    "use_sliding_window": _h("turns sliding_window on; off means full attention everywhere"),
    "sliding_window": _h("window of the layers typed 'sliding_attention' (absent: 4096)"),
    "max_window_layers": _h("without layer_types: the even layers i < max_window_layers "
                            "slide, as HF's default layer_types (absent: 28)"),
    "layer_types": _h("'full_attention' | 'sliding_attention' per layer; other types, a "
                      "wrong length and sliding layers without a window refused"),
}

MIXTRAL = {
    **_MOE,
    "num_local_experts": _h("routed experts (absent: 8); alias of num_experts, differing "
                            "values refused"),
    "num_experts": _h("alias of num_local_experts (HF attribute_map)"),
    "intermediate_size": _h("width of each expert (mixtral has no dense MLP)"),
    "num_key_value_heads": _h("kv heads; absent: 8 (HF's class default); null refused"),
    "head_dim": _h("absent or null: hidden_size // num_attention_heads"),
    "max_position_embeddings": _h("the context limit (absent: 131072)"),
    "rope_theta": _h("rope base when rope_parameters has none (absent: 1e6, mixtral's "
                     "default_theta)"),
    "sliding_window": _h("every layer attends to the last sliding_window positions (absent "
                         "or null: full attention)"),
    "router_jitter_noise": _i(_TRAIN + ": multiplicative noise on the router "
                              "input"),
    "norm_topk_prob": _i(_NOT_READ + ": mixtral always renormalises the top-k weights"),
    "decoder_sparse_step": _i(_NOT_READ + ": every mixtral layer is sparse"),
    "mlp_only_layers": _i(_NOT_READ), "moe_intermediate_size": _i(_NOT_READ),
    "shared_expert_intermediate_size": _i(_NOT_READ), "attention_bias": _i(_NOT_READ),
    "qkv_bias": _i(_NOT_READ), "use_sliding_window": _i(_NOT_READ),
    "max_window_layers": _i(_NOT_READ), "layer_types": _i(_NOT_READ),
}

MOE_SCOPES = {"qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}
