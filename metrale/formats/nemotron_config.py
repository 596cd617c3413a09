"""Nemotron-H (`nemotron_h`): Mamba2 layers interleaved with attention and MLP layers, as
transformers 5.25's configuration_nemotron_h.py / modeling_nemotron_h.py resolve config.json
(hybrid_fields.py lists every field).

Each layer is one pre-norm block `residual += mixer(rmsnorm(residual))`, the RMSNorm rounding
once (`bf16(x * rsqrt(mean(x^2) + eps) * w)`), the mixer by `layers_block_type` (or the
older `hybrid_override_pattern`: M, *, -, E):
  "linear_attention"  Mamba2: in_proj -> z | x B C | dt; conv1d (+ bias) + SiLU over x|B|C
                      with its state; the SSD scan (A = -exp(A_log), dt = softplus(dt +
                      dt_bias) clamped to time_step_limit in a prefill, as HF's chunked scan,
                      unclamped in a decode step, as HF's state update; D skip; groups);
                      the gated RMSNorm silu(z) first, per group of heads * head_dim /
                      n_groups; out_proj
  "full_attention"    q/k/v/o without biases, rotary embeddings or q/k norms
  "mlp"               down(relu(up(x))^2)
  "moe"               refused (its DeepSeek-style grouped sigmoid router is not implemented)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import FormatError, Unsupported
from .config_fields import KERNEL_MAX_HEAD_DIM, _Cfg

D_STATES = (32, 64, 128, 256)     # ops/mamba2_ssd.py's kernels
MAX_CHUNK, MAX_CONV_KERNEL = 256, 4
_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
_KINDS = {"linear_attention": "mamba", "full_attention": "full_attention", "mlp": "mlp",
          "moe": "moe"}
# the older key names transformers still reads (NemotronHConfig.__post_init__)
_ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv",
            "time_step_limit": "mamba_dt_limit", "use_conv_bias": "mamba_conv_bias",
            "chunk_size": "mamba_chunk_size"}


@dataclass(frozen=True)
class Mamba2Config:
    """The Mamba2 layers' shapes (ModelMetadata.hybrid.mamba)."""

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    dt_min: float       # time_step_limit, applied in a prefill's chunked scan
    dt_max: float

    @property
    def inner(self) -> int:
        """heads * head_dim: the width of x, z and the scan's output."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x | B | C."""
        return self.inner + 2 * self.n_groups * self.d_state

    @property
    def proj_dim(self) -> int:
        """Columns of in_proj: z | x B C | dt."""
        return self.inner + self.conv_dim + self.num_heads


def _get(c: _Cfg, key: str, default):
    """A key or its older alias (the alias wins, as in HF's __post_init__)."""
    alias = _ALIASES.get(key)
    if alias is not None and alias in c.d:
        return c.d[alias], alias
    return c.d.get(key, default), key


def _number(v, key: str, source: str) -> float:
    if isinstance(v, dict) and set(v) == {"__float__"}:   # HF's JSON for inf / nan
        v = {"Infinity": math.inf, "-Infinity": -math.inf}.get(v["__float__"], math.nan)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        raise FormatError(f"{source}: {key} must hold numbers, got {v!r}")
    return float(v)


def layer_kinds(c: _Cfg) -> tuple[str, ...]:
    types = c.d.get("layers_block_type")
    if types is None and c.d.get("hybrid_override_pattern") is not None:
        pattern = c.d["hybrid_override_pattern"]
        if not isinstance(pattern, str) or any(ch not in _PATTERN for ch in pattern):
            raise FormatError(f"{c.source}: hybrid_override_pattern must be a string of "
                              f"{''.join(_PATTERN)}, got {pattern!r}")
        types = [_PATTERN[ch] for ch in pattern]
    if types is None:
        types = ["linear_attention", "moe", "full_attention", "mlp"]   # HF's default
    if not isinstance(types, list) or not types or any(t not in _KINDS for t in types):
        raise FormatError(f"{c.source}: layers_block_type must list "
                          f"{', '.join(_KINDS)} per layer, got {types!r}")
    if "moe" in types:
        raise Unsupported(f"{c.source}: layers_block_type has 'moe' layers: Nemotron-H's "
                          "mixture of experts (a grouped sigmoid router with a score "
                          "correction bias) is not supported")
    return tuple(_KINDS[t] for t in types)


def mamba_config(c: _Cfg) -> Mamba2Config:
    act = c.d.get("mamba_hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise Unsupported(f"{c.source}: mamba_hidden_act={act!r} is not supported (the conv "
                          "kernels compute SiLU)")
    groups, gkey = _get(c, "n_groups", 8)
    conv, ckey = _get(c, "conv_kernel", 4)
    chunk, chkey = _get(c, "chunk_size", 128)
    bias, bkey = _get(c, "use_conv_bias", True)
    limit, lkey = _get(c, "time_step_limit", [0.0, math.inf])
    for key, v in ((gkey, groups), (ckey, conv), (chkey, chunk)):
        _Cfg({key: v}, c.source).int(key)
    _Cfg({bkey: bias}, c.source).bool(bkey, True)
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise FormatError(f"{c.source}: {lkey} must be [min, max], got {limit!r}")
    lo, hi = (_number(v, lkey, c.source) for v in limit)
    if not 0 <= lo <= hi:
        raise FormatError(f"{c.source}: {lkey} must satisfy 0 <= min <= max, got {limit!r}")
    m = Mamba2Config(c.int("mamba_num_heads", 128), c.int("mamba_head_dim", 64), groups,
                     c.int("ssm_state_size", 128), conv, chunk, bias, lo, hi)
    if m.num_heads % m.n_groups:
        raise FormatError(f"{c.source}: mamba_num_heads {m.num_heads} is not a multiple of "
                          f"n_groups {m.n_groups}")
    if m.d_state not in D_STATES:
        raise Unsupported(f"{c.source}: ssm_state_size {m.d_state} is not supported (the "
                          f"Mamba2 kernels take {D_STATES})")
    bp = min(32, 4096 // m.d_state)
    if m.head_dim % bp:
        raise Unsupported(f"{c.source}: mamba_head_dim {m.head_dim} is not supported with "
                          f"ssm_state_size {m.d_state} (a multiple of {bp})")
    if not 2 <= m.conv_kernel <= MAX_CONV_KERNEL or m.chunk_size > MAX_CHUNK:
        raise Unsupported(f"{c.source}: conv_kernel {m.conv_kernel} / chunk_size "
                          f"{m.chunk_size} not supported (2..{MAX_CONV_KERNEL}, <= {MAX_CHUNK})")
    return m


def nemotron_fields(config: dict, source: str) -> tuple[dict, tuple[str, ...], Mamba2Config]:
    """(ModelMetadata keyword arguments of a nemotron_h config but its hybrid config, the
    layer kinds, the Mamba2 shapes): hybrid_config.hybrid_fields assembles them."""
    c = _Cfg(config, source)
    for key in ("use_bias", "mlp_bias"):
        if c.bool(key, False):
            raise Unsupported(f"{source}: {key}=true is not supported for nemotron_h (no "
                              "released checkpoint has these biases)")
    act = c.d.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise Unsupported(f"{source}: mlp_hidden_act={act!r} is not supported for "
                          "nemotron_h (relu2 only)")
    kinds = layer_kinds(c)
    hidden, heads = c.int("hidden_size", 4096), c.int("num_attention_heads", 32)
    kv = heads if c.d.get("num_key_value_heads", 8) is None else \
        c.int("num_key_value_heads", 8)
    head_dim = c.int("head_dim", 128)
    if heads % kv or head_dim % 2 or head_dim > KERNEL_MAX_HEAD_DIM:
        raise Unsupported(f"{source}: {heads} heads / {kv} kv heads x head_dim {head_dim} "
                          f"not supported (kv heads dividing the heads, an even head_dim "
                          f"<= {KERNEL_MAX_HEAD_DIM})")
    max_pos = c.int("max_position_embeddings", 4096)
    return dict(
        architecture="nemotron_h", vocab_size=c.int("vocab_size", 131072), hidden_size=hidden,
        intermediate_size=c.int("intermediate_size", 21504), num_layers=len(kinds),
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rope_theta=0.0,
        rope_scaling=None, rms_norm_eps=c.float("layer_norm_epsilon", 1e-5, ge=0, f32=True),
        attention_bias=False, qk_norm=False,
        tie_word_embeddings=c.bool("tie_word_embeddings", False), sliding_window=None,
        max_position_embeddings=max_pos, hidden_act="relu2",
        layer_windows=(0,) * len(kinds), context_length=max_pos), kinds, mamba_config(c)
