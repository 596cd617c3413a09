"""Config fields of the Phi-3 decoders (`phi3`: Phi-3, 3.5, 4; phi3_config.py) in
field_table.py's three statuses, laid over the decoder fields every family shares."""
from __future__ import annotations

from .field_status import honoured as _h, irrelevant as _i, refused as _r

_NOT_READ = "not read by this family's HF modeling code"
_TRAIN = "training only (dropout), inactive at inference"

PHI3 = {
    "num_key_value_heads": _h("kv heads; absent or null: num_attention_heads (HF's default)"),
    "head_dim": _h("absent: hidden_size // num_attention_heads; null refused (HF fails)"),
    "max_position_embeddings": _h("the context limit (absent: 4096)"),
    "original_max_position_embeddings": _h("LongRoPE: where the long factors start and the "
                                           "attention factor's base (absent: 4096; wins "
                                           "over the rope dict's value, as HF)"),
    "rms_norm_eps": _h("RMSNorm epsilon (absent: 1e-5)"),
    "partial_rotary_factor": _h("rotate the first int(head_dim * factor) dims of each head "
                                "(default rope and longrope alike; an odd or zero count "
                                "refused)"),
    "rope_scaling": _h("longrope (or its older names su / yarn): short_factor, long_factor, "
                       "factor, attention_factor; other types refused, as Phi3Config does"),
    "rope_parameters": _h("as rope_scaling (transformers 5)"),
    "rope_theta": _h("rope base when the rope dict has none (default 10000)"),
    "sliding_window": _h("every layer attends to the last sliding_window positions "
                         "(absent or null: full attention)"),
    "resid_pdrop": _i(_TRAIN), "embd_pdrop": _i(_TRAIN),
    "attention_bias": _i(_NOT_READ + ": Phi-3's projections have no biases"),
    "mlp_bias": _i(_NOT_READ), "use_sliding_window": _i(_NOT_READ),
    "max_window_layers": _i(_NOT_READ), "layer_types": _i(_NOT_READ),
    "quantization_config": _r("quantized Phi-3 checkpoints (fused qkv_proj / gate_up_proj): "
                              "refused whatever its value"),
}
