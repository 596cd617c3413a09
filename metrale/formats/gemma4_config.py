"""Gemma 4 (`gemma4_text`, and a `gemma4` checkpoint's text model), as transformers 5.25's
configuration_gemma4.py / modeling_gemma4.py define it, against what metrale runs. It shares
Gemma 3's skeleton (four norms a layer, embeddings times a BF16 normalizer, q/k norms,
per-layer windows with a local and a global rope, GeGLU, a final logit cap), which the
Gemma code path (gemma_config.py) implements; but every Gemma 4 decoder layer also has
pieces that no metrale kernel or layer pass computes yet, so a Gemma 4 checkpoint is refused
as a whole, naming each such piece it holds:

  always (architecture, not a field): `v_norm`, an RMSNorm without weight on every value
    head, and `layer_scalar`, a stored per-layer factor multiplying the layer's output;
  `hidden_size_per_layer_input` != 0 (default 256): per-layer input embeddings (PLE): a
    second embedding table sliced per layer, gated and projected into every layer;
  `global_head_dim` != head_dim (default 512) / `num_global_key_value_heads`: full layers
    with other head shapes than sliding ones (and 512 > the attention kernels' 256);
  the full layers' rope `proportional` (default, partial_rotary_factor 0.25 of a head that
    keeps its size);
  `num_kv_shared_layers` > 0: the last layers reuse earlier layers' K/V;
  `attention_k_eq_v`: full layers whose values are their keys;
  `use_double_wide_mlp`: a double-width MLP on the KV-shared layers;
  `enable_moe_block` (`num_experts`, `top_k_experts`, `moe_intermediate_size`): a mixture of
    experts beside the dense MLP, with three more norms;
  `use_bidirectional_attention` "all" / "vision": not causal.
"""
from __future__ import annotations

from ..errors import FormatError, Unsupported

GEMMA4_ARCHS = ("gemma4_text", "gemma4")


def refuse(config: dict, source: str) -> None:
    """Unsupported naming every piece of this Gemma 4 config that metrale does not run."""
    arch = config.get("model_type")
    text = config
    if arch == "gemma4":
        text = config.get("text_config") or {}
        if not isinstance(text, dict):
            raise FormatError(f"{source}: text_config must be an object, got {text!r}")
    pieces = ["v_norm (an unscaled RMSNorm on every value head)",
              "layer_scalar (a per-layer factor on each layer's output)"]
    ple = text.get("hidden_size_per_layer_input", 256)
    if ple:
        pieces.append(f"hidden_size_per_layer_input={ple} (per-layer input embeddings)")
    head_dim = text.get("head_dim", 256)
    global_dim = text.get("global_head_dim", 512)
    if global_dim != head_dim or text.get("num_global_key_value_heads") is not None:
        pieces.append(f"global_head_dim={global_dim} (full layers of another head shape than "
                      f"head_dim={head_dim})")
    full_rope = ((text.get("rope_parameters") or {}).get("full_attention") or
                 {"rope_type": "proportional"})
    if isinstance(full_rope, dict) and full_rope.get("rope_type") == "proportional":
        pieces.append("the full layers' rope_type 'proportional'")
    for key, neutral, what in (
            ("num_kv_shared_layers", 0, "layers reusing earlier layers' K/V"),
            ("attention_k_eq_v", False, "values that are the keys"),
            ("use_double_wide_mlp", False, "a double-width MLP"),
            ("enable_moe_block", False, "a mixture-of-experts block beside the MLP"),
            ("use_bidirectional_attention", None, "non-causal attention")):
        v = text.get(key, neutral)
        if v != neutral and not (neutral is False and v is None):
            pieces.append(f"{key}={v!r} ({what})")
    raise Unsupported(f"{source}: model_type {arch!r} (Gemma 4) is not supported: metrale "
                      "runs Gemma 3's block, and this checkpoint also has "
                      + "; ".join(pieces))
