"""`ModelMetadata`: the facts metrale needs from a Hugging Face `config.json`.

Architectures: llama, mistral, qwen2, qwen3 (decoder-only), whisper (encoder-decoder) and
llava (a CLIP tower + projector in front of a decoder-only text model). Rope settings come
either from the older `rope_scaling` + top-level `rope_theta` keys or from the newer
`rope_parameters` key (transformers >= 5), which holds `rope_theta` inside.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

from ..errors import FormatError, Unsupported
from .config_fields import _Cfg, _pick, _token_ids
from .multimodal import VisionConfig, WhisperConfig, vision_config, whisper_config

DECODER_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = DECODER_ARCHS + ("whisper", "llava")
_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling; `rope_type` is "default" | "linear" | "llama3" | "yarn"."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0          # llama3
    high_freq_factor: float = 4.0         # llama3
    original_max_position_embeddings: int | None = None   # llama3 / yarn
    beta_fast: float = 32.0               # yarn
    beta_slow: float = 1.0                # yarn
    attention_factor: float | None = None  # yarn mscale; None -> 0.1 * ln(factor) + 1 (HF)
    truncate: bool = True                 # yarn: floor/ceil the correction range (HF default)

    def yarn_attention_factor(self) -> float:
        """The yarn cos/sin multiplier HF uses (`attention_factor`, else 0.1 ln(f) + 1)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclass(frozen=True)
class ModelMetadata:
    """Architecture facts of one checkpoint; build with `ModelMetadata.from_config`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str
    text: "ModelMetadata | None" = None
    whisper: WhisperConfig | None = None  # multimodal.py
    vision: VisionConfig | None = None    # multimodal.py
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False,
                                      repr=False)
    generation_config: Mapping[str, Any] | None = field(default=None, compare=False,
                                                        hash=False, repr=False)

    # The tensor layout is derived from this (layout.py: expected_tensors, num_parameters).

    @staticmethod
    def from_config(config: dict, generation_config: dict | None = None, *,
                    source: str = "config.json") -> "ModelMetadata":
        """Parse a config.json dict; `generation_config` ids (bos/eos) win over config's."""
        if not isinstance(config, dict):
            raise FormatError(f"{source}: must hold a JSON object")
        if generation_config is not None and not isinstance(generation_config, dict):
            raise FormatError(f"{source}: generation_config.json must hold a JSON object")
        arch = config.get("model_type")
        if arch is None:
            raise FormatError(f"{source}: missing key 'model_type'")
        if arch not in ARCHITECTURES:
            raise Unsupported(f"{source}: model_type {arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
        if arch in ("whisper", "llava"):
            parse = _whisper if arch == "whisper" else _llava
            meta = parse(config, generation_config, source)
        else:
            meta = _decoder(config, generation_config, source, arch)
        return replace(meta, config=_frozen(config),
                       generation_config=None if generation_config is None
                       else _frozen(generation_config))


def _frozen(d: dict) -> Mapping:
    return MappingProxyType(copy.deepcopy(d))


def _decoder(config: dict, gen: dict | None, source: str, arch: str) -> ModelMetadata:
    c = _Cfg(config, source)
    hidden = c.int("hidden_size", required=True)
    heads = c.int("num_attention_heads", required=True)
    kv = c.int("num_key_value_heads", heads)
    head_dim = c.int("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise FormatError(f"{source}: hidden_size {hidden} is not a multiple of "
                              f"num_attention_heads {heads} and no head_dim is given")
        head_dim = hidden // heads
    if heads % kv:
        raise FormatError(f"{source}: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv}")
    if c.bool("mlp_bias", False):
        raise Unsupported(f"{source}: mlp_bias=true is not supported")
    max_pos = c.int("max_position_embeddings", 2048)
    theta, scaling = parse_rope(config, source, max_pos)
    sliding = c.int("sliding_window")
    if arch == "qwen2" or arch == "qwen3":
        # Qwen configs carry a sliding_window value even when it is off.
        if not c.bool("use_sliding_window", False):
            sliding = None
    elif arch == "llama":
        sliding = None
    return ModelMetadata(
        architecture=arch,
        vocab_size=c.int("vocab_size", required=True),
        hidden_size=hidden,
        intermediate_size=c.int("intermediate_size", required=True),
        num_layers=c.int("num_hidden_layers", required=True),
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=c.float("rms_norm_eps", 1e-6),
        attention_bias=True if arch == "qwen2" else c.bool("attention_bias", False),
        qk_norm=arch == "qwen3",
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        sliding_window=sliding,
        max_position_embeddings=max_pos,
        bos_token_id=_bos(config, gen, source),
        eos_token_ids=_eos(config, gen, source),
        dtype=_dtype(config, source),
    )


def _whisper(config: dict, gen: dict | None, source: str) -> ModelMetadata:
    """ModelMetadata of a Whisper config; decoder fields at the top, the rest in .whisper."""
    w = whisper_config(config, gen, source)
    c = _Cfg(config, source)
    heads = w.decoder_attention_heads
    return ModelMetadata(
        architecture="whisper", vocab_size=c.int("vocab_size", required=True),
        hidden_size=w.d_model, intermediate_size=w.decoder_ffn_dim,
        num_layers=w.decoder_layers, num_heads=heads, num_kv_heads=heads,
        head_dim=w.d_model // heads,
        rope_theta=0.0, rope_scaling=None,  # learned/sinusoidal positions, no rope
        rms_norm_eps=w.layer_norm_eps, attention_bias=True, qk_norm=False,
        tie_word_embeddings=c.bool("tie_word_embeddings", True),
        sliding_window=None, max_position_embeddings=w.max_target_positions,
        bos_token_id=_bos(config, gen, source), eos_token_ids=_eos(config, gen, source),
        dtype=_dtype(config, source), whisper=w)


def _llava(config: dict, gen: dict | None, source: str) -> ModelMetadata:
    """ModelMetadata of a LLaVA config: the text model's fields, plus .text and .vision."""
    text_cfg, vis_cfg = config.get("text_config"), config.get("vision_config")
    if not isinstance(text_cfg, dict) or not isinstance(vis_cfg, dict):
        raise FormatError(f"{source}: llava needs text_config and vision_config objects")
    text_cfg = {"model_type": "llama", **text_cfg}
    if text_cfg["model_type"] not in DECODER_ARCHS:
        raise Unsupported(f"{source}: llava text model {text_cfg['model_type']!r} is not "
                          f"supported (supported: {', '.join(DECODER_ARCHS)})")
    text = _decoder(text_cfg, None, f"{source} (text_config)", text_cfg["model_type"])
    vision = vision_config(config, source, text.hidden_size, text.vocab_size)
    return replace(text, architecture="llava",
                   bos_token_id=_bos(config, gen, source, text_cfg),
                   eos_token_ids=_eos(config, gen, source, text_cfg),
                   dtype=_dtype(config, source) if ("torch_dtype" in config or "dtype" in config)
                   else text.dtype,
                   text=text, vision=vision)


def parse_rope(config: dict, source: str, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_parameters`, else `rope_scaling` + `rope_theta`."""
    params = config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise FormatError(f"{source}: rope_parameters must be an object, got {params!r}")
        if params and all(isinstance(v, dict) for v in params.values()):
            raise Unsupported(f"{source}: per-layer-type rope_parameters are not supported")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = params
        key = "rope_parameters"
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = config.get("rope_scaling")
        key = "rope_scaling"
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise FormatError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise FormatError(f"{source}: {key} must be an object or null, got {scaling!r}")
    # "rope_type" is the current name; "type" the older one (both may be present).
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    if rtype == "default":
        return float(theta), None
    c = _Cfg(scaling, f"{source} ({key})")
    if rtype == "linear":
        rs = RopeScaling("linear", factor=c.float("factor", required=True))
    elif rtype == "llama3":
        rs = RopeScaling("llama3", factor=c.float("factor", required=True),
                         low_freq_factor=c.float("low_freq_factor", required=True),
                         high_freq_factor=c.float("high_freq_factor", required=True),
                         original_max_position_embeddings=c.int(
                             "original_max_position_embeddings", required=True))
    elif rtype == "yarn":
        factor = c.float("factor", required=True)
        att = scaling.get("attention_factor")
        if att is None and scaling.get("mscale") and scaling.get("mscale_all_dim"):
            def ms(scale, m):  # HF's get_mscale (DeepSeek-style yarn configs)
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
            att = ms(factor, scaling["mscale"]) / ms(factor, scaling["mscale_all_dim"])
        rs = RopeScaling("yarn", factor=factor,
                         original_max_position_embeddings=c.int(
                             "original_max_position_embeddings", max_pos),
                         beta_fast=c.float("beta_fast", 32.0),
                         beta_slow=c.float("beta_slow", 1.0),
                         attention_factor=None if att is None else float(att),
                         truncate=bool(scaling.get("truncate", True)))
    else:
        raise Unsupported(f"{source}: rope type {rtype!r} in {key} is not supported "
                          "(supported: default, linear, llama3, yarn)")
    return float(theta), rs


def _bos(config: dict, gen: dict | None, source: str, fallback: dict | None = None):
    ids = _token_ids(_pick("bos_token_id", config, gen, fallback), "bos_token_id", source)
    if len(ids) > 1:
        raise FormatError(f"{source}: bos_token_id must be one id, got {list(ids)}")
    return ids[0] if ids else None


def _eos(config: dict, gen: dict | None, source: str, fallback: dict | None = None):
    return _token_ids(_pick("eos_token_id", config, gen, fallback), "eos_token_id", source)


def _dtype(config: dict, source: str) -> str:
    v = config.get("torch_dtype", config.get("dtype")) or "float32"  # HF's default
    if v not in _DTYPES:
        raise Unsupported(f"{source}: dtype {v!r} is not supported (supported: "
                          f"{', '.join(_DTYPES)})")
    return v
