"""gpt-oss (`gpt_oss`), as transformers 5.25's configuration_gpt_oss.py and
modeling_gpt_oss.py resolve config.json (gpt_oss_fields.py lists every field). Against the
Llama block:

  - attention: biases on q/k/v and o (`attention_bias`, default true); a learned sink per
    head (`self_attn.sinks`: a logit in the softmax's denominator only, an option of every
    attention kernel); windows on the layers `layer_types` names "sliding_attention" (absent:
    every other layer from layer 0, HF's default), `sliding_window` (default 128) wide;
  - RMSNorm bf16(x * rsqrt(mean(x^2) + eps) * w), one rounding (the rmsnorm kernel's
    weight mode "once");
  - every MLP is a mixture of experts: router logits x @ W^T + b, the top `num_experts_per_tok`
    of them, a softmax over those (in exact arithmetic the renormalised softmax over all
    experts, which is what the router kernel computes); each expert runs
    gate_up = x @ W_gu + b_gu (gate = columns 0::2, up = 1::2), the clamped SwiGLU
    (up' + 1) * gate' * sigmoid(alpha * gate') with gate' = min(gate, limit), up' =
    clamp(up, -limit, limit) (`swiglu_alpha` 1.702, `swiglu_limit` 7), then
    @ W_down + b_down; the weighted sum over the chosen experts;
  - rope: `rope_scaling` / `rope_parameters` (absent: HF's default yarn, factor 32 over
    4096 positions, beta 32 / 1, untruncated), base `rope_theta` (absent: 150000);
  - defaults: head_dim 64, num_key_value_heads 8 (null: num_attention_heads),
    rms_norm_eps 1e-5, max_position_embeddings 131072, untied embeddings.
Expert weights: BF16 tensors as transformers saves them (`mlp.experts.gate_up_proj`
[E, hidden, 2I], `_bias` [E, 2I], `down_proj` [E, I, hidden], `_bias` [E, hidden];
`mlp.router.weight` [E, hidden], `.bias` [E]); the MXFP4 form (`quantization_config.
quant_method: mxfp4`, formats/quant/mxfp4.py) keeps `*_blocks` / `*_scales` instead.
"""
from __future__ import annotations

from ..errors import FormatError, Unsupported
from .config_fields import _Cfg
from .decoder_variant import DecoderVariant
from .moe_config import MAX_EXPERTS, MAX_TOP_K, MoeConfig, OssExperts

DEFAULTS = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                num_hidden_layers=36, num_attention_heads=64, head_dim=64,
                max_position_embeddings=131072, num_key_value_heads=8)
DEFAULT_THETA = 150000.0
WINDOW_DEFAULT = 128
RMS_NORM_EPS_DEFAULT = 1e-5
# HF's rope when config.json gives none (GptOssConfig.__post_init__)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


def rope_config(config: dict) -> dict:
    """config.json as the rope parser must read it: HF's default yarn dict when neither rope
    key is set, the base 150000 when no rope_theta is given anywhere."""
    cfg = dict(config)
    if not cfg.get("rope_scaling") and cfg.get("rope_parameters") is None:
        cfg["rope_parameters"] = dict(DEFAULT_ROPE)
    rp = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and not (isinstance(rp, dict) and "rope_theta" in rp):
        cfg["rope_theta"] = DEFAULT_THETA
    return cfg


def layer_windows(c: _Cfg, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """`layer_types` (absent: sliding iff (i + 1) % 2) with `sliding_window`."""
    types = c.d.get("layer_types")
    if types is None:
        sliding = [bool((i + 1) % 2) for i in range(n_layers)]
    else:
        if not isinstance(types, list) or len(types) != n_layers:
            raise FormatError(f"{c.source}: layer_types must list one type per layer "
                              f"({n_layers}), got {types!r}")
        bad = [t for t in types if not isinstance(t, str) or t not in _LAYER_TYPES]
        if bad:
            raise Unsupported(f"{c.source}: layer_types value {bad[0]!r} is not supported "
                              f"(supported: {', '.join(_LAYER_TYPES)})")
        sliding = [_LAYER_TYPES[t] for t in types]
    w = None if "sliding_window" in c.d and c.d["sliding_window"] is None else \
        c.int("sliding_window", WINDOW_DEFAULT)
    if any(sliding) and w is None:
        raise Unsupported(f"{c.source}: sliding_window is null but layers are "
                          "'sliding_attention' (transformers fails on this config)")
    windows = tuple(w if s else 0 for s in sliding)
    return (w if any(windows) else None), windows


def moe(c: _Cfg, n_layers: int, mxfp4: bool) -> MoeConfig:
    """The expert block of every layer."""
    vals = {k: c.int(k) for k in ("num_local_experts", "num_experts") if c.d.get(k) is not None}
    if len(set(vals.values())) > 1:
        raise FormatError(f"{c.source}: num_local_experts and num_experts disagree: {vals} "
                          "(the same field in gpt_oss)")
    E = next(iter(vals.values())) if vals else 128
    k = c.int("num_experts_per_tok", 4)
    if k > E:
        raise FormatError(f"{c.source}: num_experts_per_tok={k} exceeds the expert count {E}")
    if E > MAX_EXPERTS or k > MAX_TOP_K:
        raise Unsupported(f"{c.source}: num_local_experts={E} / num_experts_per_tok={k}: the "
                          f"MoE kernels support at most {MAX_EXPERTS} experts and top-"
                          f"{MAX_TOP_K}")
    alpha = c.float("swiglu_alpha", 1.702, f32=True)
    limit = c.float("swiglu_limit", 7.0, gt=0, f32=True)
    inter = c.int("intermediate_size", DEFAULTS["intermediate_size"])
    # the router's softmax over the top-k logits = the renormalised softmax over all
    return MoeConfig(E, k, True, inter, 0, (True,) * n_layers, "mlp",
                     ("gate_up_proj", "gate_up_proj", "down_proj"),
                     oss=OssExperts(alpha, limit, mxfp4))


def variant() -> DecoderVariant:
    return DecoderVariant(norm_mode="once", attention_sinks=True)


def oss_layer_tensors(m, p: str) -> dict[str, tuple[int, ...]]:
    """gpt-oss's MoE block tensors of one layer (prefix `p` = "model.layers.{i}.")."""
    E, h, i = m.moe.num_experts, m.hidden_size, m.moe.expert_intermediate_size
    b = p + "mlp."
    t = {b + "router.weight": (E, h), b + "router.bias": (E,),
         b + "experts.gate_up_proj_bias": (E, 2 * i), b + "experts.down_proj_bias": (E, h)}
    if m.moe.oss.mxfp4:   # rows are output features, 32 values (16 bytes) a block
        t[b + "experts.gate_up_proj_blocks"] = (E, 2 * i, h // 32, 16)
        t[b + "experts.gate_up_proj_scales"] = (E, 2 * i, h // 32)
        t[b + "experts.down_proj_blocks"] = (E, h, i // 32, 16)
        t[b + "experts.down_proj_scales"] = (E, h, i // 32)
    else:
        t[b + "experts.gate_up_proj"] = (E, h, 2 * i)
        t[b + "experts.down_proj"] = (E, i, h)
    return t
