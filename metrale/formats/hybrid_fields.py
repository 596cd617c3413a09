"""Config fields of the hybrid linear-attention decoders (hybrid_config.py) in field_table.py's
three statuses. field_table.FIELD_TABLE lays each of these scopes over the decoder fields
every family shares (its `_DECODER`)."""
from __future__ import annotations

from .field_status import honoured as _h, irrelevant as _i, refused as _r

_NOT_READ = "not read by this family's HF modeling code"
_TRAIN = "training only"
_VISION = ("the vision tower is not loaded: metrale runs the text model of this checkpoint "
           "(its model.visual.* tensors are skipped by name) and refuses images")

_QWEN_HYBRID = {
    "layer_types": _h("'linear_attention' (gated DeltaNet) or 'full_attention' (gated "
                      "attention) per layer; other types and a wrong length refused"),
    "full_attention_interval": _h("without layer_types: every interval-th layer is full "
                                  "attention (default 4)"),
    "linear_conv_kernel_dim": _h("width of the causal conv over q|k|v (2..4; others refused: "
                                 "the conv kernels' limit)"),
    "linear_key_head_dim": _h("d_k of the gated delta rule (a multiple of 16 up to 128; others "
                              "refused: the kernels' limit)"),
    "linear_value_head_dim": _h("d_v of the gated delta rule and the gated norm's group (a "
                                "multiple of 32; others refused)"),
    "linear_num_key_heads": _h("key heads of the linear attention (q and k)"),
    "linear_num_value_heads": _h("value heads; a multiple of the key heads (each key head "
                                 "serves num_value_heads / num_key_heads of them)"),
    "head_dim": _h("head dim of the full-attention layers (default 256)"),
    "num_key_value_heads": _h("kv heads of the full-attention layers (defaults: qwen3_next "
                              "2, qwen3_5_text 4, qwen3_5_moe_text 2)"),
    "hidden_act": _h("the MLP activation AND the linear-attention conv's; silu / swish only "
                     "(the conv kernels compute SiLU), others refused"),
    "attention_bias": _r("true refused (the gated q_proj's bias would need its rows "
                         "regrouped; no released checkpoint has one); false honoured"),
    "partial_rotary_factor": _h("rotary on the first int(head_dim * factor) dims of each "
                                "head (default 0.25); the rest pass through"),
    "rms_norm_eps": _h("epsilon of every RMSNorm (zero-centred ones, q/k norms, the gated "
                       "norm)"),
    "max_position_embeddings": _h("the context limit (absent: 32768)"),
    "intermediate_size": _h("width of the dense MLP (qwen3_next: of the layers that are not "
                            "sparse)"),
    "mtp_num_hidden_layers": _i("the multi-token-prediction head (mtp.* tensors): a draft "
                                "proposer metrale does not run; transformers ignores its "
                                "tensors too"),
    "mtp_use_dedicated_embeddings": _i("the MTP head's embeddings (not run, as above)"),
    "attn_output_gate": _i(_NOT_READ + ": the output gate is always applied (the "
                           "released configs say true)"),
    "mamba_ssm_dtype": _i(_NOT_READ + " (the state is FP32 here)"),
    "use_sliding_window": _i(_NOT_READ), "sliding_window": _i(_NOT_READ),
    "max_window_layers": _i(_NOT_READ), "mlp_bias": _i(_NOT_READ),
    "output_router_logits": _i("returns router logits for the auxiliary loss, not the logits"),
    "router_aux_loss_coef": _i(_TRAIN + ": the load-balancing loss"),
    "quantization_config": _h("fine-grained fp8 as released (Qwen3-Next-*-FP8, "
                              "Qwen3.5-*-A*-FP8: block-scaled e4m3 linears and routed "
                              "experts; routers and shared-expert gates read BF16; fields in "
                              "scope quantization_config.fp8); other methods refused"),
}

_MOE = {
    "num_experts_per_tok": _h("top-k experts per token (more than the experts, or than 32, "
                              "refused)"),
    "moe_intermediate_size": _h("width of one routed expert (default 512)"),
    "shared_expert_intermediate_size": _h("width of the shared expert (default 512), added "
                                          "with its sigmoid gate (shared_expert_gate)"),
}

QWEN3_NEXT = {
    **_QWEN_HYBRID, **_MOE,
    "num_experts": _h("routed experts (default 512; 0: every layer dense)"),
    "norm_topk_prob": _h("renormalise the top-k routing weights (default true)"),
    "decoder_sparse_step": _h("layer i is sparse iff (i + 1) % step == 0 and i is not in "
                              "mlp_only_layers (default 1)"),
    "mlp_only_layers": _h("layers with the dense MLP; an index outside the layers refused"),
}

_FP8 = _h("fine-grained fp8 as released (Qwen3.5-*-FP8: block-scaled e4m3 linears, "
          "FP32 / BF16 / FP16 weight_scale_inv, modules_to_not_convert kept BF16; fields in "
          "scope quantization_config.fp8); other methods refused")

QWEN3_5_TEXT = {
    **_QWEN_HYBRID,
    "quantization_config": _FP8,
    **{k: _i(_NOT_READ + " (qwen3_5_text is dense)") for k in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
        "mlp_only_layers")},
}

QWEN3_5_MOE_TEXT = {
    **_QWEN_HYBRID, **_MOE,
    "num_experts": _h("routed experts of every layer (default 256; < 1 refused)"),
    "norm_topk_prob": _i(_NOT_READ + ": the top-k weights are always renormalised"),
    "decoder_sparse_step": _i(_NOT_READ + ": every layer is sparse"),
    "mlp_only_layers": _i(_NOT_READ + ": every layer is sparse"),
    "intermediate_size": _i(_NOT_READ + ": every layer is sparse"),
}

NEMOTRON_H = {
    "layers_block_type": _h("'linear_attention' (Mamba2), 'full_attention', 'mlp' per layer "
                            "(the list's length is the layer count); 'moe' refused (the "
                            "grouped sigmoid router is not implemented)"),
    "hybrid_override_pattern": _h("the older pattern string (M, *, -, E) when "
                                  "layers_block_type is absent"),
    "num_hidden_layers": _i("deprecated in transformers 5: the layer list's length wins"),
    "num_key_value_heads": _h("kv heads (default 8; null: num_attention_heads)"),
    "head_dim": _h("attention head dim (default 128)"),
    "max_position_embeddings": _h("the context limit (default 4096; no rotary embedding)"),
    "intermediate_size": _h("width of the MLP layers"),
    "mlp_hidden_act": _h("relu2 only (down(relu(up(x))^2)); others refused"),
    "mlp_bias": _r("true refused; false honoured"), "use_bias": _r("true refused (in_proj / "
                                                                    "out_proj biases)"),
    "attention_bias": _i(_NOT_READ + ": the attention projections never have biases"),
    "layer_norm_epsilon": _h("epsilon of every RMSNorm (and the gated one)"),
    "rms_norm_eps": _i(_NOT_READ + " (layer_norm_epsilon is)"),
    "ssm_state_size": _h("d_state of the SSD scan (32, 64, 128 or 256; others refused)"),
    "mamba_num_heads": _h("SSD heads"), "mamba_head_dim": _h("SSD head dim (a multiple of "
                                                             "32, 16 with d_state 256)"),
    "mamba_hidden_act": _h("the conv activation: silu only"),
    "n_groups": _h("B / C groups (heads per group share them); the gated norm's groups"),
    "mamba_n_groups": _h("older name of n_groups (wins, as in HF)"),
    "conv_kernel": _h("conv width (2..4)"), "mamba_d_conv": _h("older name of conv_kernel"),
    "use_conv_bias": _h("the conv's bias"), "mamba_conv_bias": _h("older name of use_conv_bias"),
    "chunk_size": _h("the SSD scan's chunk (<= 256); prefix states are kept at its multiples"),
    "mamba_chunk_size": _h("older name of chunk_size"),
    "time_step_limit": _h("dt clamp of a prefill's chunked scan; a decode step does not clamp "
                          "(as HF's state update)"),
    "mamba_dt_limit": _h("older name of time_step_limit"),
    "expand": _i(_NOT_READ + " (the inner width is mamba_num_heads * mamba_head_dim)"),
    "mamba_expand": _i(_NOT_READ),
    **{k: _i("initialisation of dt_bias only") for k in (
        "time_step_min", "time_step_max", "time_step_floor", "mamba_dt_min", "mamba_dt_max",
        "mamba_dt_init_floor")},
    "mamba_proj_bias": _i(_NOT_READ), "mamba_ssm_cache_dtype": _i(_NOT_READ),
    "use_mamba_kernels": _i("deprecated; the kernel choice does not change the math"),
    "residual_in_fp32": _i(_NOT_READ + " (the residual stays in the model dtype)"),
    "rescale_prenorm_residual": _i("initialisation only"),
    "hidden_dropout": _i(_TRAIN), "num_logits_to_keep": _i("generation: logits kept"),
    "sliding_window": _i(_NOT_READ),
    **{k: _i("the MoE layers' (refused where layers_block_type has 'moe')") for k in (
        "n_routed_experts", "num_local_experts", "n_shared_experts", "moe_intermediate_size",
        "moe_shared_expert_intermediate_size", "moe_latent_size",
        "moe_shared_expert_overlap", "num_experts_per_tok", "routed_scaling_factor", "n_group",
        "topk_group", "norm_topk_prob", "output_router_logits", "router_aux_loss_coef")},
    "num_nextn_predict_layers": _i("the MTP layers (mtp.* tensors, skipped as HF does)"),
    "mtp_layers_block_type": _i("the MTP layers' types (not run)"),
    "mtp_hybrid_override_pattern": _i("the MTP layers' types (not run)"),
    "partial_rotary_factor": _i(_NOT_READ + " (no rotary embedding)"),
    "rope_parameters": _i(_NOT_READ + " (no rotary embedding)"),
    "rope_scaling": _i(_NOT_READ), "rope_theta": _i(_NOT_READ),
    "hidden_act": _i(_NOT_READ + " (mlp_hidden_act and mamba_hidden_act are)"),
    "quantization_config": _r("quantized nemotron_h checkpoints: refused whatever its value"),
}

# the multimodal wrappers: their text_config is one of the scopes above
_WRAPPER = {
    "text_config": _h("the text model (scope: its model_type)"),
    "quantization_config": _h("qwen3_5: as qwen3_5_text's (a modules_to_not_convert name under "
                              "model.language_model. read as the text model's); qwen3_5_moe: "
                              "refused (quantized experts)"),
    "vision_config": _i(_VISION),
    "tie_word_embeddings": _h("the head shares the embedding when the top level or "
                              "text_config says so; the two disagreeing refused"),
    **{k: _i("a vision / video placeholder token: " + _VISION) for k in (
        "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")},
}

HYBRID_SCOPES = {
    "qwen3_next": QWEN3_NEXT, "qwen3_5_text": QWEN3_5_TEXT,
    "qwen3_5_moe_text": QWEN3_5_MOE_TEXT, "qwen3_5": _WRAPPER, "qwen3_5_moe": _WRAPPER,
    "nemotron_h": NEMOTRON_H,
}

# keys of the skipped vision towers' configs (scope: the vision config's model_type)
VISION_SCOPES = {s: {k: _i(_VISION) for k in (
    "model_type", "depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads",
    "in_channels", "patch_size", "spatial_merge_size", "temporal_patch_size",
    "out_hidden_size", "num_position_embeddings", "initializer_range", "deepstack_visual_indexes",
    "dtype", "torch_dtype", "rope_parameters")} for s in ("qwen3_5_vision", "qwen3_5_moe_vision")}
