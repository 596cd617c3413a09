"""Rope settings of a decoder config.json, resolved the way transformers 5 does it
(`PreTrainedConfig.convert_rope_params_to_dict` / `standardize_rope_params` and the
`_compute_*_parameters` of `modeling_rope_utils`):

- the dict is `rope_scaling` when it is set (non-empty), else `rope_parameters`;
- its `rope_theta` wins over the top-level `rope_theta`, which defaults to 10000;
- `rope_type` wins over the older `type`; absent means "default";
- llama3 / yarn take `original_max_position_embeddings` from the top level of config.json
  when it is there, else from the dict, else `max_position_embeddings`;
- `partial_rotary_factor` (top level or in the dict) is ignored by the default rope of these
  families; a scaled rope whose rotary dimension it would shorten is refused.

Every number is checked here, at load, for the range its formula needs (a FormatError
naming the file, the field and the value; never a NaN table or a bare Python exception):
rope_theta finite > 0 (yarn also != 1: its correction range divides by ln(theta)); every
`factor` finite > 0 (the frequencies are divided by it); llama3 low/high_freq_factor finite
> 0 and different (the smoothing divides by their difference and the wavelengths by each);
yarn beta_fast / beta_slow finite > 0 (ln of them; 0 or null means HF's default 32 / 1),
attention_factor finite > 0, mscale / mscale_all_dim finite and a finite, positive ratio,
truncate a bool; partial_rotary_factor finite in (0, 1].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import FormatError, Unsupported
from .config_fields import _Cfg, number

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling; `rope_type` is "linear" | "dynamic" | "llama3" | "yarn" |
    "longrope" (Phi-3: phi3_config.py)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0          # llama3
    high_freq_factor: float = 4.0         # llama3
    original_max_position_embeddings: int | None = None   # llama3 / yarn; dynamic: max_pos
    beta_fast: float = 32.0               # yarn
    beta_slow: float = 1.0                # yarn
    attention_factor: float | None = None  # yarn mscale; None -> 0.1 * ln(factor) + 1 (HF)
    truncate: bool = True                 # yarn: floor/ceil the correction range (HF default)
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to the switch
    long_factor: tuple[float, ...] = ()   # longrope: ... from original_max_position_embeddings

    def yarn_attention_factor(self) -> float:
        """The yarn cos/sin multiplier HF uses (`attention_factor`, else 0.1 ln(f) + 1)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


def _number(v, what: str, source: str, **bounds) -> float:
    return number(v, what, source, **bounds)


def parse_rope(config: dict, source: str, max_pos: int,
               head_dim: int | None = None) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling or None for the default rope) of a decoder config dict."""
    legacy = config.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, dict):
        raise FormatError(f"{source}: rope_scaling must be an object or null, got {legacy!r}")
    params, key = (legacy, "rope_scaling") if legacy else \
        (config.get("rope_parameters"), "rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise FormatError(f"{source}: {key} must be an object or null, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise Unsupported(f"{source}: per-layer-type {key} are not supported")
    if "rope_theta" in params:
        theta = _number(params["rope_theta"], "rope_theta", f"{source} ({key})", gt=0)
    else:
        theta = _number(config.get("rope_theta", 10000.0), "rope_theta", source, gt=0)
    rtype = params.get("rope_type", params.get("type", "default"))
    prf = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if rtype == "default":
        return float(theta), None   # HF's default rope never reads partial_rotary_factor
    if rtype not in ROPE_TYPES:
        raise Unsupported(f"{source}: rope type {rtype!r} in {key} is not supported "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    if prf is not None:
        prf_v = _number(prf, "partial_rotary_factor", source, gt=0)
        if prf_v > 1:
            raise FormatError(f"{source}: partial_rotary_factor must be in (0, 1], got {prf!r}")
    if prf is not None and head_dim is not None and int(head_dim * prf_v) != head_dim:
        raise Unsupported(f"{source}: partial_rotary_factor={prf} with rope type {rtype!r} "
                          f"is not supported (it shortens the rotary dimension of head_dim "
                          f"{head_dim}; transformers cannot run it either)")
    c = _Cfg(params, f"{source} ({key})")
    if rtype == "linear":
        return float(theta), RopeScaling("linear", factor=c.float("factor", required=True,
                                                                  gt=0))
    if rtype == "dynamic":
        # transformers' threshold is max_position_embeddings (its dynamic rope ignores the
        # dict's original_max_position_embeddings); below it the rope is the default one.
        return float(theta), RopeScaling("dynamic",
                                         factor=c.float("factor", required=True, gt=0),
                                         original_max_position_embeddings=max_pos)
    orig = config["original_max_position_embeddings"] \
        if "original_max_position_embeddings" in config else \
        params.get("original_max_position_embeddings", max_pos)
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise FormatError(f"{source}: original_max_position_embeddings must be a positive "
                          f"integer, got {orig!r}")
    if rtype == "llama3":
        low = c.float("low_freq_factor", required=True, gt=0)
        high = c.float("high_freq_factor", required=True, gt=0)
        if low == high:
            raise FormatError(f"{c.source}: llama3 low_freq_factor and high_freq_factor are "
                              f"both {low!r}; the smoothing divides by their difference")
        return float(theta), RopeScaling(
            "llama3", factor=c.float("factor", required=True, gt=0),
            low_freq_factor=low, high_freq_factor=high,
            original_max_position_embeddings=orig)
    return float(theta), _yarn(params, c, theta, max_pos, orig)


def _yarn(params: dict, c: _Cfg, theta: float, max_pos: int, orig: int) -> RopeScaling:
    """The yarn scaling of a rope dict, every number in the range HF's formula needs."""
    if "factor" not in params:
        raise FormatError(f"{c.source}: missing key 'factor' (rope type 'yarn')")
    if theta == 1:
        raise FormatError(f"{c.source}: rope_theta 1 with rope type 'yarn': the correction "
                          "range divides by ln(rope_theta)")
    factor = max_pos / orig if params["factor"] is None else c.float("factor", gt=0)
    # HF: `beta_fast or 32`, `beta_slow or 1` (0 and null mean the default)
    beta_fast = c.float("beta_fast", gt=0) if params.get("beta_fast") else 32.0
    beta_slow = c.float("beta_slow", gt=0) if params.get("beta_slow") else 1.0
    att = c.float("attention_factor", gt=0, f32=True)
    mscale, mscale_all = c.float("mscale"), c.float("mscale_all_dim")
    if att is None and mscale and mscale_all:
        def ms(scale, m):  # HF's get_mscale (DeepSeek-style yarn configs)
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        num, den = ms(factor, mscale), ms(factor, mscale_all)
        if den == 0 or not math.isfinite(num / den) or num / den <= 0:
            raise FormatError(f"{c.source}: mscale={mscale!r} / mscale_all_dim="
                              f"{mscale_all!r} give the attention factor {num} / {den}, "
                              "not a finite number > 0")
        att = num / den
    # HF: `rope_parameters.get("truncate", True)`, then `if truncate:` (null: no truncation)
    truncate = False if "truncate" in params and params["truncate"] is None else \
        c.bool("truncate", True)
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=orig,
                       beta_fast=beta_fast, beta_slow=beta_slow, attention_factor=att,
                       truncate=truncate)


def partial_rope(c: _Cfg, max_pos: int, head_dim: int,
                 default_factor: float) -> tuple[float, RopeScaling | None, int]:
    """(theta, scaling, rotary_dim) of a partial rotary embedding: it turns the first
    rotary_dim = int(head_dim * partial_rotary_factor) dims of each head (NeoX halves within
    them), with the frequencies of a head of rotary_dim, for every rope type (HF computes
    them with dim = head_dim * partial_rotary_factor). The factor is the rope dict's (as
    `parse_rope` picks the dict), else the top level's, else `default_factor` (the family's
    class default: Qwen3.5 0.25, GLM-4.5 0.5); null refused."""
    params = c.d.get("rope_scaling") or c.d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise FormatError(f"{c.source}: rope_parameters must be an object, got {params!r}")
    where = params if "partial_rotary_factor" in params else c.d
    prf = where.get("partial_rotary_factor", default_factor)
    if prf is None:
        raise FormatError(f"{c.source}: partial_rotary_factor is null")
    prf = _number(prf, "partial_rotary_factor", c.source, gt=0)
    if prf > 1:
        raise FormatError(f"{c.source}: partial_rotary_factor must be in (0, 1], got {prf}")
    rotary = int(head_dim * prf)
    if rotary < 2 or rotary % 2:
        raise Unsupported(f"{c.source}: partial_rotary_factor {prf} gives {rotary} rotary "
                          f"dims of head_dim {head_dim}; an even count >= 2 is needed")
    stripped = {k: v for k, v in c.d.items() if k != "partial_rotary_factor"}
    for key in ("rope_parameters", "rope_scaling"):   # Qwen3.5's mrope keys: text only
        if isinstance(stripped.get(key), dict):
            stripped[key] = {k: v for k, v in stripped[key].items()
                             if k not in ("partial_rotary_factor", "mrope_section",
                                          "mrope_interleaved")}
    theta, scaling = parse_rope(stripped, c.source, max_pos, rotary)
    return theta, scaling, rotary


def context_length(max_pos: int, scaling: RopeScaling | None) -> int:
    """The positions metrale runs: max_position_embeddings, raised to factor *
    original_max_position_embeddings for yarn (a static rope defined at every position).
    Dynamic NTK is refused past max_position_embeddings: there transformers rescales the
    frequencies per call, by the longest position it has seen, so the same tokens get a
    different rotation depending on how they were chunked, batched or preceded."""
    if scaling is not None and scaling.rope_type == "yarn":
        return max(max_pos, int(scaling.factor * scaling.original_max_position_embeddings))
    return max_pos
