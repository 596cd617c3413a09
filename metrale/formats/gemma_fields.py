"""Config fields of the Gemma decoders (gemma2, gemma3_text, and a gemma3 checkpoint's top
level; gemma_config.py) in field_table.py's three statuses: the fields with their own
defaults or meaning in these families. field_table.FIELD_TABLE lays each table over the
decoder fields every family shares (its `_DECODER`)."""
from __future__ import annotations

from .field_status import honoured as _h, irrelevant as _i, refused as _r

_NOT_READ = "not read by this family's HF modeling code"
_BOOK = "bookkeeping of transformers (serialisation, outputs, kernels), not the math"

_GEMMA = {
    "vocab_size": _h("embedding and lm_head rows (absent: HF's class default)"),
    "hidden_size": _h("model width; the embeddings are scaled by sqrt(hidden_size) cast to "
                      "BF16 as HF casts its normalizer (absent: class default)"),
    "intermediate_size": _h("MLP width (absent: class default)"),
    "num_hidden_layers": _h("layer count (absent: class default 26)"),
    "num_attention_heads": _h("query heads (absent: class default 8)"),
    "num_key_value_heads": _h("kv heads (absent: 4, HF's class default; null refused)"),
    "head_dim": _h("absent: 256 (HF's class default); null refused (HF fails)"),
    "hidden_activation": _h("the MLP's activation (GeGLU with gelu_pytorch_tanh by "
                            "default); the hidden_act names metrale supports, others refused"),
    "hidden_act": _i(_NOT_READ + " (Gemma reads hidden_activation)"),
    "rms_norm_eps": _h("every RMSNorm's epsilon (the q/k norms' too); the weights apply as "
                       "(1 + w), one BF16 rounding, as Gemma's RMSNorm"),
    "attention_bias": _h("biases on q/k/v AND o_proj"),
    "query_pre_attn_scalar": _h("scores are scaled by query_pre_attn_scalar ** -0.5 "
                                "(absent: 256)"),
    "sliding_window": _h("window of the 'sliding_attention' layers (absent: 4096; null "
                         "with sliding layers refused)"),
    "layer_types": _h("'full_attention' | 'sliding_attention' per layer; other types and a "
                      "wrong length refused"),
    "final_logit_softcapping": _h("logits = cap * tanh(logits / cap) (null: none)"),
    "use_bidirectional_attention": _h("false or null only; true (an encoder's attention) "
                                      "refused"),
    "cache_implementation": _i(_BOOK + " (HF's hybrid cache; the paged cache here keeps "
                               "every layer's window)"),
    "use_sliding_window": _i(_NOT_READ), "max_window_layers": _i(_NOT_READ),
    "mlp_bias": _i(_NOT_READ),
    "quantization_config": _r("quantized Gemma checkpoints: refused whatever its value"),
    "tie_word_embeddings": _h("lm_head shares the input embedding (absent: true)"),
    "max_position_embeddings": _h("the context limit (absent: gemma2 8192, gemma3_text "
                                  "131072)"),
}

GEMMA2 = {
    **_GEMMA,
    "attn_logit_softcapping": _h("attention scores = cap * tanh(scores / cap) before the "
                                 "softmax, in every attention kernel (absent: 50; null: none)"),
    "final_logit_softcapping": _h("logits = cap * tanh(logits / cap) (absent: 30; null: "
                                  "none)"),
    "layer_types": _h("'full_attention' | 'sliding_attention' per layer (absent: layer i "
                      "slides iff (i + 1) % 2, HF's default); other types refused"),
}

GEMMA3_TEXT = {
    **_GEMMA,
    "attn_logit_softcapping": _i("stored by Gemma3Attention but never passed to its "
                                 "attention function: no effect in HF, none here"),
    "layer_types": _h("'full_attention' | 'sliding_attention' per layer (absent: every "
                      "sliding_window_pattern-th layer full, the others sliding)"),
    "sliding_window_pattern": _h("without layer_types: layer i slides iff (i + 1) % pattern "
                                 "(absent: 6)"),
    "_sliding_window_pattern": _i("transformers 5 saves its private copy of "
                                  "sliding_window_pattern; never read back"),
    "rope_theta": _h("the full layers' rope base when rope_parameters has none (absent: "
                     "1e6)"),
    "rope_local_base_freq": _h("the sliding layers' rope base when rope_parameters has none "
                               "(absent: 10000); a default rope"),
    "rope_scaling": _h("transformers 4.x: the full layers' scaling (the sliding layers keep "
                       "the default rope)"),
    "rope_parameters": _h("per layer type: {'full_attention': {...}, 'sliding_attention': "
                          "{...}} (scope 'rope'); a flat dict refused (HF mixes it up)"),
}

GEMMA3 = {   # Gemma3ForConditionalGeneration: loaded as its text model
    "text_config": _h("the decoder (scope gemma3_text; absent keys: its class defaults)"),
    "vision_config": _i("the SigLIP tower: not loaded (metrale runs the text model; images "
                        "are refused)"),
    "mm_tokens_per_image": _i("image prompts only (images refused)"),
    "boi_token_index": _i("image prompts only (images refused)"),
    "eoi_token_index": _i("image prompts only (images refused)"),
    "image_token_index": _i("image prompts only (images refused)"),
    "image_token_id": _i("alias of image_token_index"),
    "boi_token_id": _i("alias of boi_token_index"),
    "eoi_token_id": _i("alias of eoi_token_index"),
    "tie_word_embeddings": _h("the head is tied when this (absent: true) or the text model "
                              "says so"),
    "quantization_config": _r("quantized Gemma checkpoints: refused whatever its value"),
}

# a gemma3 checkpoint's vision tower: not loaded (its text model runs, images are refused)
_TOWER = "the SigLIP vision tower is not loaded (metrale runs gemma3's text model)"
SIGLIP_VISION = {k: _i(_TOWER) for k in (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_channels", "image_size", "patch_size", "hidden_act",
    "layer_norm_eps", "attention_dropout", "vision_use_head")}

GEMMA_SCOPES = {"gemma2": GEMMA2, "gemma3_text": GEMMA3_TEXT}
