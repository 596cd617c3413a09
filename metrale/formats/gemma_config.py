"""Gemma 2 and Gemma 3 decoders (`gemma2`, `gemma3_text`; a `gemma3` checkpoint's text model),
as transformers 5.25's configuration_gemma{2,3}.py and modeling_gemma{2,3}.py resolve
config.json (gemma_fields.py lists every field). What they change against the Llama block
(decoder_variant.py):

  - RMSNorm weights stored centred on 0 and applied as bf16(x * inv * (1 + w)), one rounding
    (every norm, Gemma 3's q/k norms too);
  - four norms a layer: residual += post_attention_layernorm(attention(input_layernorm(x)));
    residual += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(residual)));
  - embeddings times the normalizer sqrt(hidden_size), a float32 buffer that HF casts to the
    weights' dtype before multiplying: BF16 (sqrt(640) = 25.298... -> 25.25);
  - scores scaled by query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5);
  - Gemma 2: attention scores soft-capped (attn_logit_softcapping, default 50) and the
    logits too (final_logit_softcapping, default 30); Gemma 3: the logits when configured
    (default none). Gemma3Attention never passes attn_logit_softcapping to its attention,
    so a value there changes nothing (as here); Gemma3ForConditionalGeneration (a `gemma3`
    checkpoint) never applies final_logit_softcapping either;
  - a sliding window on the layers `layer_types` names "sliding_attention"; without it
    Gemma 2 alternates (layer i slides iff (i + 1) % 2) and Gemma 3 slides every layer but
    each `sliding_window_pattern`-th (default 6);
  - Gemma 3's sliding layers rotate with a default rope of base `rope_local_base_freq`
    (10000), its full layers with `rope_theta` (1e6) and `rope_scaling` (transformers 4.x
    keys), or the per-layer-type `rope_parameters` {"full_attention": {...},
    "sliding_attention": {...}} of transformers 5;
  - the MLP's activation is `hidden_activation` (gelu_pytorch_tanh); `hidden_act` is not
    read.
Class defaults fill absent keys (a `gemma3` checkpoint's text_config holds only the values
that differ from them). Refused: use_bidirectional_attention (an encoder, not causal).
"""
from __future__ import annotations

import numpy as np

from ..errors import FormatError, Unsupported
from ..ops.bf16 import bf16_to_f32, f32_to_bf16
from .config_fields import _Cfg
from .decoder_variant import DecoderVariant
from .rope_config import parse_rope

GEMMA_ARCHS = ("gemma2", "gemma3_text")
# HF class defaults of keys a config.json may leave out (Gemma2Config / Gemma3TextConfig)
CLASS_DEFAULTS = {
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, max_position_embeddings=8192),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=256, max_position_embeddings=131072),
}
WINDOW_DEFAULT = 4096
SLIDING_PATTERN_DEFAULT = 6           # Gemma 3: every sixth layer is full
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0   # Gemma3TextConfig.default_theta


def _null(c: _Cfg, key: str) -> bool:
    return key in c.d and c.d[key] is None


def _optional_positive(c: _Cfg, key: str, default):
    """A float > 0, null meaning none (not the class default, as `c.float` would read it)."""
    return None if _null(c, key) else c.float(key, default, gt=0, f32=True)


def embed_scale(hidden: int) -> float:
    """sqrt(hidden_size) as HF multiplies by it: a float32 tensor cast to BF16."""
    s = np.array([hidden ** 0.5], np.float32)
    return float(bf16_to_f32(f32_to_bf16(s))[0])


def layer_windows(c: _Cfg, arch: str, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, per-layer window: 0 = full) as Gemma2Config / Gemma3TextConfig
    resolve `layer_types` (or their default patterns) and `sliding_window`."""
    if c.d.get("use_bidirectional_attention") is not None and \
            c.bool("use_bidirectional_attention", False):
        raise Unsupported(f"{c.source}: use_bidirectional_attention=true is not supported "
                          "(bidirectional attention: an encoder, not a causal decoder)")
    types = c.d.get("layer_types")
    if types is None:
        if arch == "gemma2":
            sliding = [bool((i + 1) % 2) for i in range(n_layers)]
        else:
            pattern = c.int("sliding_window_pattern", SLIDING_PATTERN_DEFAULT)
            sliding = [bool((i + 1) % pattern) for i in range(n_layers)]
    else:
        if not isinstance(types, list) or len(types) != n_layers:
            raise FormatError(f"{c.source}: layer_types must list one type per layer "
                              f"({n_layers}), got {types!r}")
        bad = [t for t in types if not isinstance(t, str) or t not in _LAYER_TYPES]
        if bad:
            raise Unsupported(f"{c.source}: layer_types value {bad[0]!r} is not supported "
                              f"(supported: {', '.join(_LAYER_TYPES)})")
        sliding = [_LAYER_TYPES[t] for t in types]
    w = None if _null(c, "sliding_window") else c.int("sliding_window", WINDOW_DEFAULT)
    if any(sliding) and w is None:
        raise Unsupported(f"{c.source}: sliding_window is null but layers are "
                          "'sliding_attention' (transformers fails on this config)")
    windows = tuple(w if s else 0 for s in sliding)
    return (w if any(windows) else None), windows


def gemma3_rope(config: dict, source: str, max_pos: int, head_dim: int):
    """((theta, scaling) of the full layers, (theta, scaling) of the sliding layers), as
    Gemma3TextConfig.convert_rope_params_to_dict builds them."""
    rp = config.get("rope_parameters")
    legacy = config.get("rope_scaling")
    if rp is None:
        rp = {}
    if not isinstance(rp, dict) or any(k not in _LAYER_TYPES for k in rp) or \
            any(v is not None and not isinstance(v, dict) for v in rp.values()):
        raise Unsupported(f"{source}: rope_parameters {rp!r} is not supported for gemma3: "
                          "transformers reads only per-layer-type dicts "
                          "{'full_attention': {...}, 'sliding_attention': {...}}")
    if legacy is not None and not isinstance(legacy, dict):
        raise FormatError(f"{source}: rope_scaling must be an object or null, got {legacy!r}")
    full = dict(rp.get("full_attention") or {"rope_type": "default"})
    if legacy:
        if rp and rp.get("full_attention") is None:
            raise FormatError(f"{source}: rope_scaling with a rope_parameters that has no "
                              "'full_attention' (transformers fails on this config)")
        full.update(legacy)
    full.setdefault("rope_theta", config.get("rope_theta", _GLOBAL_THETA))
    local = dict(rp.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", config.get("rope_local_base_freq", _LOCAL_THETA))
    parsed = []
    for name, d in (("full_attention", full), ("sliding_attention", local)):
        parsed.append(parse_rope({"rope_parameters": d}, f"{source} (rope {name})", max_pos,
                                 head_dim))
    return parsed[0], parsed[1]


def gemma_variant(c: _Cfg, arch: str, hidden: int, local_rope) -> DecoderVariant:
    """The Gemma block of `arch` (decoder_variant.py)."""
    qpas = c.float("query_pre_attn_scalar", 256.0, gt=0)
    attn_cap = _optional_positive(c, "attn_logit_softcapping", 50.0) if arch == "gemma2" \
        else None   # Gemma3Attention never applies it
    final_cap = _optional_positive(c, "final_logit_softcapping",
                                   30.0 if arch == "gemma2" else None)
    return DecoderVariant(norm_mode="gemma", sandwich_norms=True,
                          embed_scale=embed_scale(hidden), attn_scale=qpas ** -0.5,
                          attn_softcap=attn_cap or 0.0, final_softcap=final_cap or 0.0,
                          local_rope=local_rope)


def text_config(config: dict, source: str) -> dict:
    """A `gemma3` checkpoint's text_config (absent or null: every class default)."""
    text = config.get("text_config")
    if text is None:
        text = {}
    if not isinstance(text, dict):
        raise FormatError(f"{source}: text_config must be an object, got {text!r}")
    arch = text.get("model_type", "gemma3_text")
    if arch != "gemma3_text":
        raise Unsupported(f"{source}: gemma3 text model {arch!r} is not supported "
                          "(supported: gemma3_text)")
    return text
