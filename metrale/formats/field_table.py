"""The rule of the formats layer: every config field that Hugging Face's modeling code reads
for a supported architecture is HONOURED (implemented exactly), REFUSED (a value that would
change the math and that metrale does not implement raises `Unsupported` at load, naming the
file, the field and the value) or IRRELEVANT (HF reads it, but not for inference logits:
training, initialisation, generation defaults...). Never a silently different model.

The table was made by walking transformers 5.24's `modeling_*.py` / `configuration_*.py`
of llama, mistral, qwen2, qwen3, whisper, llava (+ clip's vision tower) and
`modeling_rope_utils.py` field by field. tests/formats/test_field_table.py parses every
fixture and preset with a config that records each key the parsers touch and fails when
one is not listed here. An HONOURED field may still refuse some values (e.g. an activation
the kernels lack); `why` says which.

Scopes: the seven decoder `model_type`s (the MoE ones: moe_config.py), "rope" (keys inside
`rope_parameters` / `rope_scaling`), "whisper", "llava", "clip_vision_model" (llava's
`vision_config`), "generation_config" (generation_config.json), "gguf" (GGUF metadata keys,
see GGUF) and "quantization_config.<method>" (quant/fields.py).
"""
from __future__ import annotations

from .field_status import HONOURED, IRRELEVANT, REFUSED, Field  # noqa: F401 (re-exported)
from .field_status import honoured as _h, irrelevant as _i, refused as _r
from .gemma_fields import GEMMA3, GEMMA_SCOPES, SIGLIP_VISION
from .hybrid_fields import HYBRID_SCOPES, VISION_SCOPES
from .moe_fields import MOE_SCOPES
from .gpt_oss_fields import GPT_OSS
from .deepseek_fields import DEEPSEEK_SCOPES
from .glm4_fields import GLM4_SCOPES
from .phi3_fields import PHI3
from .quant.fields import QUANT_SCOPES


# HF `hidden_act` / `activation_function` names -> the fused activation kernel's mode
# (ops/activation.py ACTIVATIONS). Names whose HF formula is the same function: swish is
# nn.SiLU, gelu_fast / gelu_new / gelu_pytorch_tanh are the tanh approximation.
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                  "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                  "relu": "relu", "quick_gelu": "quick_gelu"}

_TRAIN = "training only (dropout / layer drop / spec-augment), inactive at inference"
_INIT = "weight initialisation only; the checkpoint's weights are what is loaded"
_GEN = "generation default, not part of the forward pass"
_BOOK = "bookkeeping of transformers (serialisation, outputs, kernels), not the math"
_PAD = "padding_idx of the embedding: affects training gradients only"

# Every config (PreTrainedConfig and what from_pretrained reads).
_COMMON = {
    "model_type": _h("selects the architecture; others raise Unsupported"),
    "architectures": _i(_BOOK), "transformers_version": _i(_BOOK),
    "_name_or_path": _i(_BOOK), "output_attentions": _i(_BOOK),
    "output_hidden_states": _i(_BOOK), "return_dict": _i(_BOOK), "use_cache": _i(_BOOK),
    "is_encoder_decoder": _i(_BOOK), "chunk_size_feed_forward": _i(
        "feed-forward chunking in BERT-like models; these families never call it"),
    "id2label": _i("classification heads only"), "label2id": _i("classification heads only"),
    "problem_type": _i("classification heads only"),
    "attn_implementation": _i("eager / sdpa / flash give the same attention"),
    "initializer_range": _i(_INIT), "pad_token_id": _i(_PAD),
    "bos_token_id": _h("generation: the prompt's first token (generation_config.json wins)"),
    "eos_token_id": _h("generation: stop tokens (generation_config.json wins)"),
    "torch_dtype": _h("the stored dtype (used when `dtype` is absent); weights are converted "
                      "to BF16 on the device, shown by `metrale info`; bfloat16, float16, "
                      "float32 accepted, others refused"),
    "dtype": _h("as torch_dtype, and wins over it (HF PreTrainedConfig.__post_init__)"),
    "quantization_config": _r("quantized weights: refused whatever its value"),
    "tie_word_embeddings": _h("lm_head shares the input embedding"),
}

_DECODER = {
    **_COMMON,
    "vocab_size": _h("embedding and lm_head rows"),
    "hidden_size": _h("model width"),
    "intermediate_size": _h("MLP width"),
    "num_hidden_layers": _h("layer count"),
    "num_attention_heads": _h("query heads"),
    "num_key_value_heads": _h("kv heads; absent: llama = num_attention_heads, mistral 8, "
                              "qwen2/qwen3 32 (HF's class defaults); null: num_attention_heads"),
    "head_dim": _h("absent or null: hidden_size // num_attention_heads (qwen3: 128 when "
                   "absent, as HF; null refused, HF fails)"),
    "hidden_act": _h("MLP activation: silu, swish, gelu, gelu_new, gelu_pytorch_tanh, "
                     "gelu_fast, relu, quick_gelu; any other ACT2FN name refused"),
    "max_position_embeddings": _h("the context limit (absent: llama 2048, mistral 131072, "
                                  "qwen 32768); positions past it are refused, except that "
                                  "yarn raises it to factor * original_max_position_embeddings"),
    "rms_norm_eps": _h("RMSNorm epsilon (also the q/k norms of qwen3)"),
    "rope_parameters": _h("rope settings (scope 'rope'); nested per-layer-type ones refused"),
    "rope_scaling": _h("the older name; HF takes it over rope_parameters when it is set"),
    "rope_theta": _h("rope base when rope_parameters has none (default 10000)"),
    "partial_rotary_factor": _h("ignored by HF's default rope of these families (so here); "
                                "with a scaled rope a factor that shortens the rotary "
                                "dimension is refused (HF's rotation fails on it)"),
    "original_max_position_embeddings": _h("top level: overrides the rope dict's value for "
                                           "llama3 / yarn (HF standardize_rope_params)"),
    "attention_dropout": _i(_TRAIN),
    "pretraining_tp": _i("transformers 4 split matmuls that sum to the same product; unread "
                         "in 5"),
    "quantization_config": _h("quantized weights (formats/quant*.py): fp8, compressed-tensors "
                              "FP8, gptq and awq 4-bit, each field in the scopes "
                              "quantization_config.<method>; other methods refused"),
}

# Keys the HF class of each family does not read: listed as irrelevant so that a config
# carrying them (configs are often copied between families) is documented, not guessed.
_NOT_READ = "not read by this family's HF modeling code"

LLAMA = {
    **_DECODER,
    "attention_bias": _h("biases on q/k/v AND o_proj"),
    "mlp_bias": _h("biases on gate/up/down projections"),
    "sliding_window": _i(_NOT_READ + " (llama attends to the whole context)"),
    "use_sliding_window": _i(_NOT_READ), "max_window_layers": _i(_NOT_READ),
    "layer_types": _i(_NOT_READ),
}

MISTRAL = {
    **_DECODER,
    "sliding_window": _h("every layer attends to the last sliding_window positions "
                         "(absent: 4096 as HF's class default; null: full attention)"),
    "attention_bias": _i(_NOT_READ + ": mistral projections never have biases (bias "
                         "tensors in the checkpoint are then unused and refused)"),
    "mlp_bias": _i(_NOT_READ), "use_sliding_window": _i(_NOT_READ),
    "max_window_layers": _i(_NOT_READ),
    "layer_types": _i(_NOT_READ + " (HF warns and ignores it)"),
}

_QWEN = {
    **_DECODER,
    "use_sliding_window": _h("turns sliding_window on; off means full attention everywhere"),
    "sliding_window": _h("window of the layers typed 'sliding_attention' (absent: 4096)"),
    "max_window_layers": _h("without layer_types: layers i >= max_window_layers slide "
                            "(absent: 28)"),
    "layer_types": _h("'full_attention' | 'sliding_attention' per layer ('attention' is the "
                      "legacy name of full); wins over max_window_layers; other types and "
                      "a wrong length refused"),
}

QWEN2 = {
    **_QWEN,
    "attention_bias": _i(_NOT_READ + ": qwen2 always has q/k/v biases and no o_proj bias"),
    "mlp_bias": _i(_NOT_READ),
}

QWEN3 = {
    **_QWEN,
    "attention_bias": _h("biases on q/k/v AND o_proj"),
    "mlp_bias": _i(_NOT_READ),
}

ROPE = {
    "rope_type": _h("default, linear, dynamic, llama3, yarn; longrope for phi3 "
                    "(phi3_config.py); proportional and others refused"),
    "short_factor": _h("phi3 longrope: the divisors of each frequency up to the switch"),
    "long_factor": _h("phi3 longrope: the divisors from original_max_position_embeddings "
                      "on (or everywhere for a prompt longer than it)"),
    "type": _h("older name of rope_type (rope_type wins)"),
    "rope_theta": _h("rope base; wins over the top-level rope_theta"),
    "factor": _h("linear / dynamic / llama3 / yarn scale (yarn: null means "
                 "max_position_embeddings / original_max_position_embeddings)"),
    "low_freq_factor": _h("llama3"), "high_freq_factor": _h("llama3"),
    "original_max_position_embeddings": _h("llama3 / yarn (absent: max_position_embeddings); "
                                           "dynamic ignores it, as HF does"),
    "beta_fast": _h("yarn (null or 0: 32)"), "beta_slow": _h("yarn (null or 0: 1)"),
    "attention_factor": _h("yarn cos/sin scale"), "mscale": _h("yarn attention factor"),
    "mscale_all_dim": _h("yarn attention factor"), "truncate": _h("yarn correction range"),
    "partial_rotary_factor": _h("as the top-level key"),
    "full_attention": _h("gemma3: the full layers' rope dict (per-layer-type parameters)"),
    "sliding_attention": _h("gemma3: the sliding layers' rope dict (per-layer-type "
                            "parameters)"),
    # qwen3_5's multimodal rope: text positions are equal on its three axes, where the
    # sections' frequencies are the plain rope's (hybrid_config.py)
    "mrope_section": _h("qwen3_5: text-only positions make the multimodal rope the plain one"),
    "mrope_interleaved": _h("qwen3_5: as mrope_section"),
}

WHISPER = {
    **_COMMON,
    "vocab_size": _h("decoder embedding rows"), "d_model": _h("model width"),
    "encoder_layers": _h("encoder depth"), "decoder_layers": _h("decoder depth"),
    "encoder_attention_heads": _h("encoder heads"),
    "decoder_attention_heads": _h("decoder heads"),
    "encoder_ffn_dim": _h("encoder MLP width"), "decoder_ffn_dim": _h("decoder MLP width"),
    "num_mel_bins": _h("conv1 input channels"),
    "max_source_positions": _h("encoder positions (2x mel frames)"),
    "max_target_positions": _h("decoder positions: the decoder's context limit"),
    "scale_embedding": _i("transformers' WhisperEncoder/WhisperDecoder set embed_scale = "
                          "sqrt(d_model) from it but never multiply by it, so it changes "
                          "nothing (as here)"),
    "activation_function": _h("gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, quick_gelu; "
                              "others refused"),
    "decoder_start_token_id": _h("the decoder prompt's first token"),
    "suppress_tokens": _h(_GEN + "; used by metrale.engine.transcribe"),
    "begin_suppress_tokens": _h(_GEN + "; used by metrale.engine.transcribe"),
    "forced_decoder_ids": _h(_GEN + "; used by metrale.engine.transcribe"),
    "dropout": _i(_TRAIN), "attention_dropout": _i(_TRAIN), "activation_dropout": _i(_TRAIN),
    "encoder_layerdrop": _i(_TRAIN), "decoder_layerdrop": _i(_TRAIN),
    "apply_spec_augment": _i(_TRAIN), "mask_time_prob": _i(_TRAIN),
    "mask_time_length": _i(_TRAIN), "mask_time_min_masks": _i(_TRAIN),
    "mask_feature_prob": _i(_TRAIN), "mask_feature_length": _i(_TRAIN),
    "mask_feature_min_masks": _i(_TRAIN), "init_std": _i(_INIT),
    "use_weighted_layer_sum": _i("audio classification head only"),
    "classifier_proj_size": _i("audio classification head only"),
    "median_filter_width": _i("word-timestamp alignment, not the logits"),
    "max_length": _i(_GEN), "num_hidden_layers": _i("alias of encoder_layers"),
}

LLAVA = {
    **_COMMON,
    "text_config": _h("the decoder (scope: its model_type, llama when absent)"),
    "vision_config": _h("the vision tower (scope clip_vision_model)"),
    "image_token_index": _h("the image placeholder id"),
    "image_token_id": _h("alias of image_token_index"),
    "projector_hidden_act": _h("gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, quick_gelu"),
    "multimodal_projector_bias": _h("projector biases"),
    "vision_feature_layer": _h("one int; a list of layers refused"),
    "vision_feature_select_strategy": _h("'default' drops CLS, 'full' keeps it"),
    "image_seq_length": _i("processor: prompt expansion, not the model"),
}

CLIP_VISION = {
    "model_type": _h("clip_vision_model; other towers refused"),
    "hidden_size": _h("tower width"), "intermediate_size": _h("tower MLP width"),
    "num_hidden_layers": _h("tower depth"), "num_attention_heads": _h("tower heads"),
    "num_channels": _h("image channels"), "image_size": _h("square input size"),
    "patch_size": _h("patch size"), "layer_norm_eps": _h("LayerNorm epsilon"),
    "hidden_act": _h("gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, quick_gelu"),
    "projection_dim": _i("CLIPVisionModelWithProjection only; llava takes hidden states"),
    "attention_dropout": _i(_TRAIN), "initializer_range": _i(_INIT),
    "initializer_factor": _i(_INIT),
}

GENERATION_CONFIG = {
    "bos_token_id": _h("wins over config.json"), "eos_token_id": _h("wins over config.json"),
    "decoder_start_token_id": _h("whisper"), "no_timestamps_token_id": _h("whisper"),
    "lang_to_id": _h("whisper language tokens"), "task_to_id": _h("whisper task tokens"),
    "is_multilingual": _h("whisper"), "suppress_tokens": _h("whisper"),
    "begin_suppress_tokens": _h("whisper"), "forced_decoder_ids": _h("whisper"),
}

# GGUF metadata keys (formats/gguf/config.py), `{arch}` standing for general.architecture
# (llama, qwen2, qwen3) and a trailing `*` for every key under that prefix. A key of a
# GGUF file that is not listed here is refused by name. HONOURED entries that accept only
# a neutral value say which; any other value is refused.
_DESCRIBES = "describes the file (provenance, naming, licence), not the model's math"
_LLAMACPP_GEN = "llama.cpp's recommended sampling; not part of the forward pass (HF's GGUF " \
                "loader ignores it too)"
GGUF = {
    "general.architecture": _h("llama, qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3 "
                               "(gguf/archs.py: their HF model_type); others refused"),
    "general.alignment": _h("alignment of the tensor data (default 32)"),
    "general.type": _h("'model' only; adapters (LoRA) and projectors refused"),
    "general.quantization_version": _h("2 only (every GGUF block layout read here)"),
    "general.file_type": _i("a label of the dominant tensor type; each tensor's own type "
                            "is what is read: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                            "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS (gguf/quants.py "
                            "SUPPORTED; any other type refused by name)"),
    **{f"general.{k}": _i(_DESCRIBES) for k in (
        "name", "basename", "finetune", "size_label", "license", "license.name",
        "license.link", "organization", "author", "version", "description", "url", "doi",
        "uuid", "repo_url", "tags", "languages", "quantized_by", "source.*",
        "base_model.*", "dataset.*")},
    "general.sampling.*": _i(_LLAMACPP_GEN),
    "{arch}.vocab_size": _h("embedding / lm_head rows (absent: the token count)"),
    "{arch}.context_length": _h("max_position_embeddings"),
    "{arch}.embedding_length": _h("hidden_size"),
    "{arch}.block_count": _h("num_hidden_layers"),
    "{arch}.feed_forward_length": _h("intermediate_size (per-layer lists refused)"),
    "{arch}.attention.head_count": _h("num_attention_heads (per-layer lists refused)"),
    "{arch}.attention.head_count_kv": _h("num_key_value_heads (absent: head_count; "
                                         "per-layer lists refused)"),
    "{arch}.attention.key_length": _h("head_dim (absent: embedding_length / head_count)"),
    "{arch}.attention.value_length": _h("must equal key_length"),
    "{arch}.attention.layer_norm_rms_epsilon": _h(
        "rms_norm_eps; stored as float32, read back as the shortest decimal that rounds to "
        "it (1e-05, not 9.9999997e-06): the same float32 that HF's float32 RMSNorm and "
        "metrale's kernels add"),
    "{arch}.attention.causal": _h("true only"),
    "{arch}.attention.max_alibi_bias": _h("0 only (ALiBi refused)"),
    "{arch}.attention.clamp_kqv": _h("0 only (clamped q/k/v refused)"),
    "{arch}.attention.sliding_window": _h("phi3, gemma2, gemma3: sliding_window; 0 only "
                                          "elsewhere (llama.cpp attends to the whole "
                                          "context there)"),
    "{arch}.attention.layer_norm_epsilon": _r("LayerNorm: not an RMSNorm model"),
    "{arch}.rope.dimension_count": _h("must equal head_dim; phi3: the rotated dims "
                                      "(partial_rotary_factor)"),
    "{arch}.rope.freq_base": _h("rope_theta (absent: 10000); float32, read back as its "
                                "shortest decimal"),
    "{arch}.rope.scaling.type": _h("none or linear; yarn for qwen2 / qwen3 / qwen3moe "
                                   "(their converter writes it); longrope and others "
                                   "refused"),
    "{arch}.rope.scaling.factor": _h("linear factor"),
    "{arch}.rope.scale_linear": _h("the older key of the linear factor"),
    "{arch}.rope.scaling.original_context_length": _h(
        "yarn's original_max_position_embeddings; phi3: original_max_position_embeddings "
        "(read by LongRoPE only, refused)"),
    "{arch}.rope.scaling.finetuned": _i("records whether the model was tuned for the "
                                        "scaled context; not the math"),
    "{arch}.expert_count": _h("qwen3moe: num_experts; 0 only elsewhere"),
    "{arch}.expert_used_count": _h("qwen3moe: num_experts_per_tok; 0 only elsewhere"),
    "{arch}.expert_feed_forward_length": _h("qwen3moe: moe_intermediate_size"),
    "{arch}.expert_weights_norm": _h("qwen3moe: true only (norm_topk_prob; llama.cpp's "
                                     "qwen3moe renormalises whatever it says)"),
    "{arch}.attn_logit_softcapping": _h("gemma2: attn_logit_softcapping"),
    "{arch}.final_logit_softcapping": _h("gemma2, gemma3: final_logit_softcapping"),
    "{arch}.use_parallel_residual": _h("false only"),
    "{arch}.tensor_data_layout": _h("'Meta AI original pth' and the default store the "
                                    "same interleaved rotary rows, undone the same way"),
    "tokenizer.ggml.model": _h("gpt2 (byte-level BPE) or llama (SentencePiece BPE); "
                               "others refused"),
    "tokenizer.ggml.pre": _h("gpt2: the pre-tokenizer split (gguf/tokenizer.py: PRE_SPLITS); "
                             "unknown names refused; llama: unused"),
    "tokenizer.ggml.tokens": _h("the vocabulary"),
    "tokenizer.ggml.token_type": _h("control tokens become special tokens, user-defined "
                                    "ones added tokens"),
    "tokenizer.ggml.merges": _h("BPE merges (llama: absent means derived from scores)"),
    "tokenizer.ggml.scores": _h("llama: merge order when the file has no merges"),
    "tokenizer.ggml.bos_token_id": _h("bos_token_id"),
    "tokenizer.ggml.eos_token_id": _h("eos_token_id, a stop token"),
    "tokenizer.ggml.eot_token_id": _h("a stop token too (llama.cpp's end-of-turn)"),
    "tokenizer.ggml.eom_token_id": _h("a stop token too (llama.cpp's end-of-message)"),
    "tokenizer.ggml.unknown_token_id": _h("llama: the BPE unk token"),
    "tokenizer.ggml.padding_token_id": _i(_PAD),
    "tokenizer.ggml.add_bos_token": _h("a BOS before plain prompts (llama absent: true)"),
    "tokenizer.ggml.add_eos_token": _h("an EOS after plain prompts"),
    "tokenizer.ggml.add_space_prefix": _h("llama: a '▁' before the text (absent: true); "
                                          "gpt2: unused, as in llama.cpp and HF"),
    "tokenizer.ggml.remove_extra_whitespaces": _h("false only"),
    "tokenizer.ggml.add_sep_token": _h("false only"),
    "tokenizer.ggml.precompiled_charsmap": _r("a SentencePiece normalizer (T5-style)"),
    **{f"tokenizer.ggml.{k}_token_id": _i("fill-in-the-middle / encoder ids; used only "
                                          "when a caller builds such prompts")
       for k in ("seperator", "mask", "prefix", "suffix", "middle", "fim_pre", "fim_suf",
                 "fim_mid", "fim_pad", "fim_rep", "fim_sep")},
    "tokenizer.ggml.token_type_count": _i("BERT segment types; decoders have one"),
    "tokenizer.chat_template": _h("the chat template (--chat)"),
    "tokenizer.chat_template.*": _i("named templates (tool use, RAG); the default one is "
                                    "rendered, as HF does without chat_template=NAME"),
    "tokenizer.chat_templates": _i("the names of the named templates"),
    "tokenizer.huggingface.json": _i("an embedded tokenizer.json; the tokenizer is built "
                                     "from tokenizer.ggml.*, as llama.cpp builds it"),
    "quantize.imatrix.*": _i("how the quantization was calibrated; the stored values are "
                             "what is read"),
    "split.count": _h("1 only (split GGUF files refused)"),
    "split.no": _i("0 in an unsplit file"),
    "split.tensors.count": _i("the tensor count of an unsplit file"),
}

FIELD_TABLE: dict[str, dict[str, Field]] = {
    "llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3, "rope": ROPE,
    # mixture-of-experts families: the decoder fields, then their own (moe_fields.py)
    **{arch: {**_DECODER, **fields} for arch, fields in MOE_SCOPES.items()},
    # Gemma 2 / 3 (gemma_fields.py); a gemma3 checkpoint's top level, then its text model
    **{arch: {**_DECODER, **fields} for arch, fields in GEMMA_SCOPES.items()},
    "gemma3": {**_COMMON, **GEMMA3}, "siglip_vision_model": SIGLIP_VISION,
    "phi3": {**_DECODER, **PHI3},   # phi3_fields.py
    "gpt_oss": {**_DECODER, **GPT_OSS},   # gpt_oss_fields.py
    # hybrid linear-attention families (hybrid_fields.py): the text models over the decoder
    # fields, the multimodal wrappers over the common ones
    **{arch: {**(_COMMON if "text_config" in fields else _DECODER), **fields}
       for arch, fields in HYBRID_SCOPES.items()},
    **VISION_SCOPES,
    **{arch: {**_DECODER, **fields} for arch, fields in DEEPSEEK_SCOPES.items()},
    **{arch: {**_DECODER, **fields} for arch, fields in GLM4_SCOPES.items()},
    "whisper": WHISPER, "llava": LLAVA, "clip_vision_model": CLIP_VISION,
    "generation_config": GENERATION_CONFIG, "gguf": GGUF,
    **QUANT_SCOPES,   # quantization_config.<method> (quant/fields.py)
}


def field_counts() -> dict[str, dict[str, int]]:
    """{scope: {status: count}} (the README's and the report's summary)."""
    out = {}
    for scope, table in FIELD_TABLE.items():
        counts = {HONOURED: 0, REFUSED: 0, IRRELEVANT: 0}
        for f in table.values():
            counts[f.status] += 1
        out[scope] = counts
    return out
