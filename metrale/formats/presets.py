"""Preset `config.json` dicts for random-weight `MemorySource`s.

`tiny` is for tests and the README demo (the CPU benchmark runs in seconds); the others are
the real shapes of public checkpoints, for benchmarks without downloading weights.
"""
from __future__ import annotations

import copy

_LLAMA_31_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16", "hidden_act": "silu",
}

# Llama-3.1-70B's shapes (the tensor-parallel benchmark: it needs 4 or 8 GPUs)
_LLAMA_31_70B = dict(_LLAMA_31_8B, hidden_size=8192, intermediate_size=28672,
                     num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)

_QWEN25_7B = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "sliding_window": 131072, "use_sliding_window": False,
    "max_window_layers": 28, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": [151645, 151643],
    "torch_dtype": "bfloat16", "hidden_act": "silu",
}

_QWEN25_05B = {  # Qwen2.5-0.5B-Instruct's config.json, every field
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

_QWEN3_8B = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False,
    "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": [151645, 151643],
    "torch_dtype": "bfloat16", "hidden_act": "silu",
}

_MISTRAL_7B = {  # Mistral-7B-Instruct-v0.3
    "model_type": "mistral", "architectures": ["MistralForCausalLM"],
    "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "hidden_act": "silu",
}

_QWEN3_30B_A3B = {  # Qwen3-30B-A3B: 128 experts, 8 active, ~3.3B active parameters
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "max_position_embeddings": 40960, "max_window_layers": 48,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "attention_bias": False, "sliding_window": None, "use_sliding_window": False,
    "tie_word_embeddings": False, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16", "hidden_act": "silu",
}

_MIXTRAL_8X7B = {  # Mixtral-8x7B-v0.1: 8 experts, 2 active
    "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
    "router_aux_loss_coef": 0.02, "output_router_logits": False,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16", "hidden_act": "silu",
}

_QWEN15_MOE_A27B = {  # Qwen1.5-MoE-A2.7B (model_type qwen2_moe): 60 experts, 4 active, shared
    "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
    "decoder_sparse_step": 1, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 16, "max_position_embeddings": 8192, "max_window_layers": 21,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768,
    "use_sliding_window": False, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}

_WHISPER_SMALL = {
    "model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"],
    "vocab_size": 51865, "d_model": 768, "num_mel_bins": 80,
    "encoder_layers": 12, "encoder_attention_heads": 12, "encoder_ffn_dim": 3072,
    "decoder_layers": 12, "decoder_attention_heads": 12, "decoder_ffn_dim": 3072,
    "max_source_positions": 1500, "max_target_positions": 448,
    "decoder_start_token_id": 50258, "bos_token_id": 50257, "eos_token_id": 50257,
    "pad_token_id": 50257, "scale_embedding": False, "activation_function": "gelu",
    "tie_word_embeddings": True, "torch_dtype": "float32",
}

_TINY = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 344,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "hidden_act": "silu",
}

# Quantized variants (issue 24) of a shape: the quantization_config a real release of that
# kind carries (random weights come from MemorySource.read_raw).
_FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
_GPTQ_4BIT = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
              "sym": True, "checkpoint_format": "gptq", "damp_percent": 0.01,
              "true_sequential": True, "static_groups": False}
_AWQ_4BIT = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
             "version": "gemm", "modules_to_not_convert": None}


def _quantized(base: dict, qconfig: dict) -> dict:
    return {**copy.deepcopy(base), "quantization_config": dict(qconfig)}


_TINY_MOE = {  # a small qwen3_moe for CPU benchmarks of the MoE path
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 344,
    "moe_intermediate_size": 96, "num_experts": 16, "num_experts_per_tok": 4,
    "norm_topk_prob": True, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "hidden_act": "silu",
}

# Qwen3.5-0.8B's text model: the text_config of its published config.json (a qwen3_5
# checkpoint: the vision tower and the MTP head are not part of the text model), with the
# text model's own model_type; 18 gated-DeltaNet and 6 gated-attention layers
_QWEN35_08B = {
    "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
    "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
    "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 256, "attention_bias": False, "attn_output_gate": True,
    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "full_attention_interval": 4, "max_position_embeddings": 262144,
    "tie_word_embeddings": True, "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False, "hidden_act": "silu",
    "layer_types": ["linear_attention"] * 3 + ["full_attention"]
    + ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    + ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    + ["full_attention"],
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                        "rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25},
    "eos_token_id": 248044, "torch_dtype": "bfloat16",
}

# The published config.json of one checkpoint per newer family (issues 40 and 42), the
# fields that change shapes or numerics as released (LongRoPE's factor lists excepted: see
# _PHI4_MINI)
_GEMMA3_1B = {  # google/gemma-3-1b-it (text only; 5 sliding layers : 1 global)
    "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
    "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "query_pre_attn_scalar": 256, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": None, "sliding_window": 512, "sliding_window_pattern": 6,
    "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "attention_bias": False, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106],
    "pad_token_id": 0, "torch_dtype": "bfloat16",
}

# microsoft/Phi-4-mini-instruct: fused qkv / gate_up, partial rotary 0.75, LongRoPE. The
# release's 48 short/long factors are not reproduced here: both lists are 1.0 (the shapes
# and the work per token do not depend on them)
_PHI4_MINI = {
    "model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
    "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
    "partial_rotary_factor": 0.75, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                     "long_factor": [1.0] * 48},
    "sliding_window": 262144, "attention_bias": False, "tie_word_embeddings": True,
    "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999,
    "torch_dtype": "bfloat16", "hidden_act": "silu",
}

_GPT_OSS_20B = {  # openai/gpt-oss-20b: 32 experts, 4 active; sliding (128) / full layers
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
    "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "sliding_window": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                     "truncate": False},
    "attention_bias": True, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "eos_token_id": 200002, "pad_token_id": 199999, "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}

_DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite: MLA without q_lora, 64 experts, 6 active
    "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "topk_method": "greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096},
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 100000,
    "eos_token_id": 100001, "torch_dtype": "bfloat16", "hidden_act": "silu",
}

PRESETS: dict[str, dict] = {
    "tiny": _TINY,
    "llama-3.1-8b": _LLAMA_31_8B,
    "llama-3.1-70b": _LLAMA_31_70B,
    "qwen2.5-0.5b": _QWEN25_05B,
    "qwen2.5-0.5b-fp8": _quantized(_QWEN25_05B, _FP8_BLOCK),
    "qwen2.5-0.5b-gptq": _quantized(_QWEN25_05B, _GPTQ_4BIT),
    "qwen2.5-0.5b-awq": _quantized(_QWEN25_05B, _AWQ_4BIT),
    "llama-3.1-8b-fp8": _quantized(_LLAMA_31_8B, _FP8_BLOCK),
    "llama-3.1-8b-gptq": _quantized(_LLAMA_31_8B, _GPTQ_4BIT),
    "qwen2.5-7b": _QWEN25_7B,
    "qwen3-8b": _QWEN3_8B,
    "mistral-7b": _MISTRAL_7B,
    "tiny-moe": _TINY_MOE,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "mixtral-8x7b": _MIXTRAL_8X7B,
    "qwen1.5-moe-a2.7b": _QWEN15_MOE_A27B,
    "whisper-small": _WHISPER_SMALL,
    "qwen3.5-0.8b": _QWEN35_08B,
    "gemma-3-1b": _GEMMA3_1B,
    "phi-4-mini": _PHI4_MINI,
    "gpt-oss-20b": _GPT_OSS_20B,
    "deepseek-v2-lite": _DEEPSEEK_V2_LITE,
}

# generation_config.json of the presets that need one (Whisper's special ids).
_LANGS = ["en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl"]
PRESET_GENERATION: dict[str, dict] = {
    "whisper-small": {
        "decoder_start_token_id": 50258, "bos_token_id": 50257, "eos_token_id": 50257,
        "pad_token_id": 50257, "no_timestamps_token_id": 50363, "is_multilingual": True,
        "lang_to_id": {f"<|{c}|>": 50259 + i for i, c in enumerate(_LANGS)},
        "task_to_id": {"translate": 50358, "transcribe": 50359},
        "forced_decoder_ids": [[1, None], [2, 50359]],
        "begin_suppress_tokens": [220, 50257],
        "suppress_tokens": [1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61,
                            62, 63, 90, 91, 92, 93, 359, 503, 522, 542, 873, 893, 902, 918,
                            922, 931, 1350, 1853, 1982, 2460, 2627, 3246, 3253, 3268, 3536,
                            3846, 3961, 4183, 4667, 6585, 6647, 7273, 9061, 9383, 10428,
                            10929, 11938, 12033, 12331, 12562, 13793, 14157, 14635, 15265,
                            15618, 16553, 16604, 18362, 18956, 20075, 21675, 22520, 26130,
                            26161, 26435, 28279, 29464, 31650, 32302, 32470, 36865, 42863,
                            47425, 49870, 50254, 50258, 50358, 50359, 50360, 50361, 50362],
        "max_length": 448,
    },
}


def preset_config(name: str) -> tuple[dict, dict | None]:
    """(config.json dict, generation_config dict or None) of a preset; copies."""
    from ..errors import InvalidArgument
    if name not in PRESETS:
        raise InvalidArgument(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    gen = PRESET_GENERATION.get(name)
    return copy.deepcopy(PRESETS[name]), copy.deepcopy(gen) if gen is not None else None
