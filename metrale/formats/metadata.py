"""`ModelMetadata`: the facts metrale needs from a Hugging Face `config.json`.

Architectures: llama, mistral, qwen2, qwen3 and the mixture-of-experts qwen2_moe, qwen3_moe,
mixtral (decoder-only; moe_config.py), gemma2 and gemma3_text (gemma_config.py; a gemma3
checkpoint loads as its text model), the hybrid linear-attention decoders (qwen3_next,
qwen3_5_text, qwen3_5_moe_text and the qwen3_5 / qwen3_5_moe text models; hybrid_config.py),
deepseek_v2 / deepseek_v3 / glm4_moe_lite (latent attention; deepseek_config.py), glm4_moe
(GQA with DeepSeek's MoE block; glm4_config.py), whisper (encoder-decoder) and llava (a CLIP tower + projector in front of a dense
decoder-only text model). How a family's block departs from Llama's is
`ModelMetadata.variant` (decoder_variant.py). Rope settings come either from the
older `rope_scaling` + top-level `rope_theta` keys or from the newer `rope_parameters` key
(transformers >= 5), which holds `rope_theta` inside.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

from ..errors import FormatError, Unsupported
from . import decoder_fields as df
from . import gemma_config as gemma
from . import gpt_oss_config as oss
from . import phi3_config as phi3
from .config_fields import _Cfg, _pick, _token_ids
from .decoder_variant import DecoderVariant
from .deepseek_config import DEEPSEEK_ARCHS, MlaConfig, deepseek_fields, resolve_model_type
from .deepseek_config import DEFAULTS as DEEPSEEK_DEFAULTS
from .gemma4_config import GEMMA4_ARCHS
from .glm4_config import GLM4_ARCHS, glm4_fields
from .gemma4_config import refuse as refuse_gemma4
from .hybrid_config import HYBRID_ARCHS, WRAPPERS, HybridConfig, hybrid_fields
from .hybrid_quant import hybrid_quantization
from .moe_config import MOE_ARCHS, MoeConfig, moe_config, rope_theta
from .multimodal import VisionConfig, WhisperConfig, vision_config, whisper_config
from .quant.parse import parse_quantization
from .rope_config import RopeScaling, context_length, parse_rope

__all__ = ["ModelMetadata", "RopeScaling", "parse_rope", "ARCHITECTURES", "DECODER_ARCHS"]

DENSE_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# mixture-of-experts: moe_config.py; gemma: gemma_config.py ("gemma3": its text model);
# phi3: phi3_config.py; the hybrids: hybrid_config.py; deepseek (and glm4_moe_lite):
# deepseek_config.py; glm4_moe: glm4_config.py
DECODER_ARCHS = DENSE_ARCHS + MOE_ARCHS + gemma.GEMMA_ARCHS + ("gemma3", "phi3", "gpt_oss") \
    + DEEPSEEK_ARCHS + GLM4_ARCHS
ARCHITECTURES = DECODER_ARCHS + HYBRID_ARCHS + ("whisper", "llava")
_DTYPES = ("bfloat16", "float16", "float32")


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
    attention_bias: bool                  # biases on q/k/v
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None            # the configured window, None if no layer uses one
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str
    o_proj_bias: bool = False             # llama / qwen3 attention_bias
    mlp_bias: bool = False                # llama mlp_bias: gate/up/down biases
    hidden_act: str = "silu"              # HF name (field_table.HF_ACTIVATIONS)
    layer_windows: tuple[int, ...] = ()   # per layer: sliding window, 0 = full attention
    context_length: int = 0               # positions metrale runs (rope_config.context_length)
    text: "ModelMetadata | None" = None
    whisper: WhisperConfig | None = None  # multimodal.py
    vision: VisionConfig | None = None    # multimodal.py
    quantization: Any = None              # formats/quant/: the quantization_config (None: floats)
    moe: MoeConfig | None = None          # qwen2_moe / qwen3_moe / mixtral (moe_config.py)
    mla: MlaConfig | None = None          # deepseek_v2 / v3 / glm4_moe_lite latent attention
    variant: DecoderVariant = DecoderVariant()   # the block's departures from Llama's
    hybrid: HybridConfig | None = None    # linear-attention layers (hybrid_config.py)
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
        config = resolve_model_type(config)   # kimi_k2: deepseek_v3
        arch = config.get("model_type")
        if arch is None:
            raise FormatError(f"{source}: missing key 'model_type'")
        if arch in GEMMA4_ARCHS:   # named, with every piece metrale lacks (gemma4_config.py)
            refuse_gemma4(config, source)
        if arch not in ARCHITECTURES:
            raise Unsupported(f"{source}: model_type {arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
        if arch in ("whisper", "llava", "gemma3"):
            parse = {"whisper": _whisper, "llava": _llava, "gemma3": _gemma3}[arch]
            meta = parse(config, generation_config, source)
        elif arch in HYBRID_ARCHS:
            meta = _hybrid(config, generation_config, source, arch)
        elif arch in DEEPSEEK_ARCHS:
            # the HF class's token ids when neither file gives one
            ids = {k: v for k, v in DEEPSEEK_DEFAULTS[arch].items() if k.endswith("token_id")}
            meta = ModelMetadata(**deepseek_fields(config, source, arch),
                                 bos_token_id=_bos(config, generation_config, source, ids),
                                 eos_token_ids=_eos(config, generation_config, source, ids),
                                 dtype=_dtype(config, source))
        elif arch in GLM4_ARCHS:   # no default token ids
            meta = ModelMetadata(**glm4_fields(config, source, arch),
                                 bos_token_id=_bos(config, generation_config, source),
                                 eos_token_ids=_eos(config, generation_config, source),
                                 dtype=_dtype(config, source))
        else:
            meta = _decoder(config, generation_config, source, arch)
        return replace(meta, config=_frozen(config),
                       generation_config=None if generation_config is None
                       else _frozen(generation_config))


def _frozen(d: dict) -> Mapping:
    return MappingProxyType(copy.deepcopy(d))


def _decoder(config: dict, gen: dict | None, source: str, arch: str) -> ModelMetadata:
    """A decoder config (DECODER_ARCHS), field by field as field_table.py says."""
    c = _Cfg(config, source)
    if arch in gemma.GEMMA_ARCHS + ("phi3",):   # quant/'s layouts are the Llama block's
        df.refuse_quantized(config, source)
    mxfp4 = False
    if arch == "gpt_oss":   # BF16 experts, or MXFP4 ones (formats/quant/mxfp4.py)
        from .quant.mxfp4 import gpt_oss_mxfp4
        mxfp4 = gpt_oss_mxfp4(config, source)
        config = oss.rope_config(config)
    quantization = None if arch == "gpt_oss" else parse_quantization(config, source)
    hidden = df.size(c, arch, "hidden_size")
    heads = df.size(c, arch, "num_attention_heads")
    kv = df.kv_heads(c, arch, heads)
    head_dim = df.head_dim(c, arch, hidden, heads)
    if heads % kv:
        raise FormatError(f"{source}: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv}")
    layers = df.size(c, arch, "num_hidden_layers")
    max_pos = c.int("max_position_embeddings", df.MAX_POSITIONS_DEFAULT[arch])
    variant = DecoderVariant()
    if arch == "gemma3_text":   # full layers: the model's rope; sliding ones: the local one
        (theta, scaling), local = gemma.gemma3_rope(config, source, max_pos, head_dim)
    elif arch == "gpt_oss":
        theta, scaling = parse_rope(config, source, max_pos, head_dim)
        variant = oss.variant()
    elif arch == "phi3":        # longrope, a partial rotary dim, the fused projections
        theta, scaling, rot = phi3.phi3_rope(config, source, max_pos, head_dim, hidden, heads)
        variant = DecoderVariant(rotary_dim=rot if rot < head_dim else 0,
                                 fused_projections=True)
    else:
        theta, scaling = parse_rope(config, source, max_pos, head_dim)
        local = None
    if arch in gemma.GEMMA_ARCHS:
        variant = gemma.gemma_variant(c, arch, hidden, local)
    bias = df.biases(c, arch)
    sliding, windows = df.layer_windows(c, arch, layers)
    if arch in MOE_ARCHS:
        theta = rope_theta(config, arch, theta)
    return ModelMetadata(
        architecture=arch,
        vocab_size=df.size(c, arch, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=df.size(c, arch, "intermediate_size"),
        num_layers=layers,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=c.float("rms_norm_eps", phi3.RMS_NORM_EPS_DEFAULT if arch in (
            "phi3", "gpt_oss") else 1e-6, ge=0, f32=True),   # rsqrt(mean(x^2) + eps)
        attention_bias=bias.qkv, o_proj_bias=bias.o, mlp_bias=bias.mlp,
        hidden_act=df.activation(c, arch),
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
        tie_word_embeddings=c.bool("tie_word_embeddings", arch in gemma.GEMMA_ARCHS),
        sliding_window=sliding, layer_windows=windows,
        max_position_embeddings=max_pos,
        context_length=context_length(max_pos, scaling),
        bos_token_id=_bos(config, gen, source),
        eos_token_ids=_eos(config, gen, source),
        dtype=_dtype(config, source),
        quantization=quantization,
        moe=(moe_config(c, arch, layers, c.int("intermediate_size", required=True))
             if arch in MOE_ARCHS else oss.moe(c, layers, mxfp4) if arch == "gpt_oss"
             else None),
        variant=variant,
    )


def _hybrid(config: dict, gen: dict | None, source: str, arch: str) -> ModelMetadata:
    """A hybrid linear-attention decoder (hybrid_config.py); a wrapper's ids and dtype may
    come from its text_config, as llava's."""
    text = config.get("text_config") if arch in WRAPPERS else None
    text = text if isinstance(text, dict) else None
    if text is not None:
        df.refuse_quantized(text, f"{source} (text_config)")
    quantization = hybrid_quantization(config, source, arch)
    dtype_of = config if text is None or "torch_dtype" in config or "dtype" in config else text
    return ModelMetadata(**hybrid_fields(config, source, arch),
                         bos_token_id=_bos(config, gen, source, text),
                         eos_token_ids=_eos(config, gen, source, text),
                         dtype=_dtype(dtype_of, source), quantization=quantization)


def _whisper(config: dict, gen: dict | None, source: str) -> ModelMetadata:
    """ModelMetadata of a Whisper config; decoder fields at the top, the rest in .whisper."""
    df.refuse_quantized(config, source)
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
        layer_windows=(0,) * w.decoder_layers, context_length=w.max_target_positions,
        hidden_act=w.activation_function, bos_token_id=_bos(config, gen, source), eos_token_ids=_eos(config, gen, source),
        dtype=_dtype(config, source), whisper=w)


def _llava(config: dict, gen: dict | None, source: str) -> ModelMetadata:
    """ModelMetadata of a LLaVA config: the text model's fields, plus .text and .vision."""
    text_cfg, vis_cfg = config.get("text_config"), config.get("vision_config")
    if not isinstance(text_cfg, dict) or not isinstance(vis_cfg, dict):
        raise FormatError(f"{source}: llava needs text_config and vision_config objects")
    df.refuse_quantized(config, source)
    text_arch = text_cfg.get("model_type", "llama")   # HF's default text model
    if text_arch not in DENSE_ARCHS:
        raise Unsupported(f"{source}: llava text model {text_arch!r} is not "
                          f"supported (supported: {', '.join(DENSE_ARCHS)})")
    text = _decoder(text_cfg, None, f"{source} (text_config)", text_arch)
    # LlavaConfig: the head is tied when either the top level or the text model says so
    if _Cfg(config, source).bool("tie_word_embeddings", False):
        text = replace(text, tie_word_embeddings=True)
    vision = vision_config(config, source, text.hidden_size, text.vocab_size)
    return replace(text, architecture="llava",
                   bos_token_id=_bos(config, gen, source, text_cfg),
                   eos_token_ids=_eos(config, gen, source, text_cfg),
                   dtype=_dtype(config, source) if ("torch_dtype" in config or "dtype" in config)
                   else text.dtype,
                   text=text, vision=vision)


def _gemma3(config: dict, gen: dict | None, source: str) -> ModelMetadata:
    """A `gemma3` checkpoint (Gemma3ForConditionalGeneration) as its text model: the vision
    tower and projector are not loaded (images are refused), and, as that class does, the
    logits are never soft-capped. The head is tied when the top level says so (default
    true) or the text model does."""
    text_cfg = gemma.text_config(config, source)
    df.refuse_quantized(config, source)
    text = _decoder(text_cfg, None, f"{source} (text_config)", "gemma3_text")
    if _Cfg(config, source).bool("tie_word_embeddings", True):
        text = replace(text, tie_word_embeddings=True)
    return replace(text, architecture="gemma3",
                   variant=replace(text.variant, final_softcap=0.0),
                   bos_token_id=_bos(config, gen, source, text_cfg),
                   eos_token_ids=_eos(config, gen, source, text_cfg),
                   dtype=_dtype(config, source) if ("torch_dtype" in config or "dtype" in config)
                   else text.dtype)


def _bos(config: dict, gen: dict | None, source: str, fallback: dict | None = None):
    ids = _token_ids(_pick("bos_token_id", config, gen, fallback), "bos_token_id", source)
    if len(ids) > 1:
        raise FormatError(f"{source}: bos_token_id must be one id, got {list(ids)}")
    return ids[0] if ids else None


def _eos(config: dict, gen: dict | None, source: str, fallback: dict | None = None):
    return _token_ids(_pick("eos_token_id", config, gen, fallback), "eos_token_id", source)


def _dtype(config: dict, source: str) -> str:
    # `dtype` wins over the older `torch_dtype` (PreTrainedConfig.__post_init__)
    v = config.get("dtype") or config.get("torch_dtype") or "float32"  # HF's default
    if v not in _DTYPES:
        raise Unsupported(f"{source}: dtype {v!r} is not supported (supported: "
                          f"{', '.join(_DTYPES)})")
    return v
