"""The host-side cos/sin table of the rotary kernels (kernels/rope.cu, ops/rope.py).

Table: float32 [max_positions, R] (R = the rotary dimension: head_dim, or fewer with a partial
rotary embedding); row p holds cos(p * inv_freq[j]) * attention_factor in columns [0, R/2)
and sin(p * inv_freq[j]) * attention_factor in [R/2, R), computed in float64 and cast once.
inv_freq follows Hugging Face transformers' `modeling_rope_utils` (default, linear, llama3,
yarn; dynamic below its limit, where it is the default; longrope, see `rope_table`).
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument


# --------------------------------------------------------------------------------------
def _get(obj, name, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        v = obj.get(name, default)
    else:
        v = getattr(obj, name, default)
    return default if v is None else v


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling,
                  max_positions: int | None = None) -> tuple[np.ndarray, float]:
    """`(inv_freq float64 [head_dim//2], attention_factor)` per HF modeling_rope_utils."""
    if head_dim < 2 or head_dim % 2:
        raise InvalidArgument(f"rope: head_dim must be even and >= 2, got {head_dim}")
    if not rope_theta > 0:
        raise InvalidArgument(f"rope: rope_theta must be > 0, got {rope_theta}")
    dim = int(head_dim)
    base = float(rope_theta)
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    pos_freqs = base ** exponents
    inv_freq = 1.0 / pos_freqs
    rope_type = _get(rope_scaling, "rope_type", None) or _get(rope_scaling, "type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "dynamic":
        # HF's dynamic NTK rope rescales only once a call reaches a position past
        # original_max_position_embeddings (= max_position_embeddings); below that it is the
        # default rope, and a table reaching past it is refused (HF's rescaling there
        # depends on how the tokens were chunked and batched).
        limit = _get(rope_scaling, "original_max_position_embeddings", None)
        if limit is None or (max_positions is not None and max_positions > int(limit)):
            raise InvalidArgument(f"rope: dynamic rope covers positions below "
                                  f"max_position_embeddings={limit}, not {max_positions}")
        return inv_freq, 1.0
    if rope_type == "linear":
        factor = float(_get(rope_scaling, "factor", 1.0))
        if not factor > 0:
            raise InvalidArgument(f"rope_scaling.factor must be > 0, got {factor}")
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        factor = float(_get(rope_scaling, "factor"))
        low = float(_get(rope_scaling, "low_freq_factor"))
        high = float(_get(rope_scaling, "high_freq_factor"))
        old_ctx = float(_get(rope_scaling, "original_max_position_embeddings"))
        if high == low:
            raise InvalidArgument("rope_scaling: llama3 needs high_freq_factor != low_freq_factor")
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2.0 * math.pi / inv_freq
        # long wavelengths (low frequencies) are divided by factor, short ones kept,
        # the band in between interpolated smoothly
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        orig = _get(rope_scaling, "original_max_position_embeddings", None) or max_positions
        if orig is None:
            raise InvalidArgument("rope_scaling: yarn needs original_max_position_embeddings")
        orig = float(orig)
        factor = _get(rope_scaling, "factor", None)
        if factor is None:
            if max_positions is None:
                raise InvalidArgument("rope_scaling: yarn needs factor")
            factor = max_positions / orig
        factor = float(factor)
        attention_factor = _get(rope_scaling, "attention_factor", None)
        mscale = _get(rope_scaling, "mscale", None)
        mscale_all_dim = _get(rope_scaling, "mscale_all_dim", None)

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)
        beta_fast = float(_get(rope_scaling, "beta_fast", None) or 32)
        beta_slow = float(_get(rope_scaling, "beta_slow", None) or 1)
        truncate = bool(_get(rope_scaling, "truncate", True))

        def correction_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
        extrap = 1.0 - ramp  # 1 where the original frequency is kept
        inv_interp = 1.0 / (factor * pos_freqs)
        return inv_interp * (1.0 - extrap) + inv_freq * extrap, float(attention_factor)
    if rope_type == "longrope":
        raise InvalidArgument("rope: longrope has two sets of frequencies; use "
                              "longrope_inv_freq / rope_table")
    raise InvalidArgument(f"rope_scaling.rope_type {rope_type!r} is not supported "
                          "(default, linear, dynamic, llama3, yarn, longrope)")


def longrope_inv_freq(dim: int, rope_theta: float, scaling) -> tuple[np.ndarray, np.ndarray]:
    """LongRoPE's (short, long) inv_freq float64 [dim // 2]: 1 / (factor_j * theta^(2j/dim))
    (HF `_compute_longrope_parameters`)."""
    base = float(rope_theta) ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    out = []
    for name in ("short_factor", "long_factor"):
        f = np.asarray(_get(scaling, name), np.float64)
        if f.shape != base.shape or not np.all(f > 0):
            raise InvalidArgument(f"rope: longrope {name} must hold {dim // 2} numbers > 0")
        out.append(1.0 / (f * base))
    return out[0], out[1]


def _cos_sin(positions: np.ndarray, inv_freq: np.ndarray, attn: float) -> np.ndarray:
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(ang) * attn, np.sin(ang) * attn], axis=1).astype(np.float32)


def rope_table(head_dim: int, max_positions: int, rope_theta: float,
               rope_scaling) -> np.ndarray:
    """Host-side float32 table [max_positions, head_dim]: cos in [:, :D/2], sin in [:, D/2:],
    both multiplied by the scaling type's attention factor (yarn, longrope), computed in
    float64. `head_dim` is the rotary dimension (fewer than the head's for a partial
    rotary embedding).

    LongRoPE (formats/phi3_config.py has the rule): [2 * max_positions, head_dim]; row p < P
    holds position p with the short factors below original_max_position_embeddings and the
    long ones from it on; row P + p holds position p with the long factors (a sequence whose
    prompt was longer than original_max_position_embeddings reads rows P + p)."""
    if max_positions < 1:
        raise InvalidArgument(f"rope: max_positions must be >= 1, got {max_positions}")
    if (_get(rope_scaling, "rope_type", None) or _get(rope_scaling, "type", "")) == "longrope":
        if head_dim < 2 or head_dim % 2 or not rope_theta > 0:
            raise InvalidArgument(f"rope: head_dim {head_dim} / rope_theta {rope_theta}")
        short, long = longrope_inv_freq(int(head_dim), rope_theta, rope_scaling)
        attn = float(_get(rope_scaling, "attention_factor", 1.0))
        orig = int(_get(rope_scaling, "original_max_position_embeddings"))
        pos = np.arange(max_positions)
        switched = np.where((pos >= orig)[:, None], _cos_sin(pos, long, attn),
                            _cos_sin(pos, short, attn))
        return np.concatenate([switched, _cos_sin(pos, long, attn)], axis=0)
    inv_freq, attn = rope_inv_freq(head_dim, rope_theta, rope_scaling, max_positions)
    return _cos_sin(np.arange(max_positions), inv_freq, attn)
