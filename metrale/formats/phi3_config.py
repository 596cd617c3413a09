"""Phi-3 / 3.5 / 4 decoders (`phi3`), as transformers 5.25's configuration_phi3.py and
modeling_phi3.py resolve config.json (phi3_fields.py lists every field). Against Llama:

  - the checkpoint stores q|k|v as one `self_attn.qkv_proj` and gate|up as one
    `mlp.gate_up_proj`, in the order metrale fuses them anyway (loaded as they are);
  - `partial_rotary_factor` (top level, or in the rope dict) rotates only the first
    int(head_dim * factor) dims of each head, with the rope's frequencies computed over that
    dimension, for the default rope too (Phi-4-mini: 0.75);
  - LongRoPE (`rope_scaling` / `rope_parameters` of type "longrope", or the older names "su"
    and "yarn", which Phi3Config maps to it): inv_freq = 1 / (factor_j * theta^(2j/R)) with
    `short_factor` or `long_factor`, cos and sin times the attention factor (`attention_
    factor`, else sqrt(1 + ln(f) / ln(original_max_position_embeddings)) with f = `factor`,
    else max_position_embeddings / original_max_position_embeddings; 1 when f <= 1);
  - `sliding_window` (default none) on every layer;
  - defaults: rms_norm_eps 1e-5, max_position_embeddings 4096, num_key_value_heads =
    num_attention_heads, original_max_position_embeddings 4096, untied embeddings.

The LongRoPE switch. transformers picks the factors per forward call: long when the call's
largest position + 1 exceeds original_max_position_embeddings (`longrope_frequency_update`),
short otherwise, and keys already in its cache keep the rotation they were written with. In
one `generate` call (the prompt in one call, then one position a call) that is: a prompt
longer than original_max_position_embeddings rotates every position with the long factors;
a shorter one rotates with the short factors, and the decode steps from position
original_max_position_embeddings on switch to the long ones (the cached keys below stay
short). metrale does exactly that per sequence, whatever the chunking: a sequence whose
prompt (the tokens of its first prefill; a decode-only sequence has none) is longer than
original_max_position_embeddings rotates every position with the long factors; any other
sequence rotates position p with the short factors below original_max_position_embeddings
and the long ones from it on (ops/rope_table.py lays both rules out as one table). The
prefix cache keeps the two kinds of sequence apart (their keys differ).
"""
from __future__ import annotations

import math

from ..errors import FormatError, Unsupported
from .config_fields import _Cfg, number
from .rope_config import RopeScaling

DEFAULT_THETA = 10000.0
ORIGINAL_MAX_POSITIONS_DEFAULT = 4096
RMS_NORM_EPS_DEFAULT = 1e-5


def phi3_rope(config: dict, source: str, max_pos: int, head_dim: int, hidden: int,
              heads: int) -> tuple[float, RopeScaling | None, int]:
    """(rope_theta, scaling or None, rotary dim) as Phi3Config.convert_rope_params_to_dict
    and the Phi3 rotary embedding read them."""
    legacy = config.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, dict):
        raise FormatError(f"{source}: rope_scaling must be an object or null, got {legacy!r}")
    params, key = (legacy, "rope_scaling") if legacy else \
        (config.get("rope_parameters"), "rope_parameters")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise FormatError(f"{source}: {key} must be an object or null, got {params!r}")
    where = f"{source} ({key})"
    c = _Cfg(params, where)
    theta = number(params["rope_theta"] if "rope_theta" in params else
                   config.get("rope_theta", DEFAULT_THETA), "rope_theta", source, gt=0)
    prf = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    prf = number(prf, "partial_rotary_factor", source, gt=0)
    if prf > 1:
        raise FormatError(f"{source}: partial_rotary_factor must be in (0, 1], got {prf!r}")
    rot = int(head_dim * prf)
    if rot < 2 or rot % 2:
        raise Unsupported(f"{source}: partial_rotary_factor={prf} gives a rotary dimension "
                          f"of {rot} (head_dim {head_dim}); the rope kernels rotate an even "
                          "number >= 2 of dims")
    rtype = params.get("rope_type", params.get("type", "default"))
    rtype = "longrope" if rtype in ("su", "yarn") else rtype   # Phi3Config's old names
    if rtype == "default":
        return float(theta), None, rot
    if rtype != "longrope":
        raise Unsupported(f"{source}: rope type {rtype!r} in {key} is not supported for phi3 "
                          "(transformers' Phi3Config takes default and longrope only)")
    orig = config["original_max_position_embeddings"] if \
        "original_max_position_embeddings" in config else params.get(
            "original_max_position_embeddings", ORIGINAL_MAX_POSITIONS_DEFAULT)
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise FormatError(f"{source}: original_max_position_embeddings must be a positive "
                          f"integer, got {orig!r}")
    # Phi3Config.validate_rope counts the factors against hidden // heads (not head_dim)
    want = int(hidden // heads * prf) // 2
    factors = []
    for name in ("short_factor", "long_factor"):
        v = params.get(name)
        if not isinstance(v, list) or len(v) != want:
            raise FormatError(f"{where}: {name} must list {want} numbers (rotary dimension "
                              f"/ 2), got {v!r}")
        factors.append(tuple(number(x, f"{name}[{i}]", where, gt=0) for i, x in enumerate(v)))
    if want != rot // 2:
        raise Unsupported(f"{where}: {want} factors for a rotary dimension of {rot} "
                          f"(head_dim {head_dim} != hidden_size / num_attention_heads)")
    factor = c.float("factor", gt=0)
    if factor is None:
        factor = max_pos / orig
    att = c.float("attention_factor", gt=0, f32=True)
    if att is None:
        if factor > 1 and orig == 1:
            raise FormatError(f"{where}: original_max_position_embeddings 1 with factor "
                              f"{factor}: the attention factor divides by ln(1)")
        att = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return float(theta), RopeScaling("longrope", factor=factor,
                                     original_max_position_embeddings=orig,
                                     attention_factor=att, short_factor=factors[0],
                                     long_factor=factors[1]), rot


def layer_windows(c: _Cfg, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """`sliding_window` on every layer (absent or null: none)."""
    w = None if c.d.get("sliding_window") is None else c.int("sliding_window")
    return w, (w or 0,) * n_layers
