"""Whisper and LLaVA: the encoder-decoder and vision-language extras of config.json.

`ModelMetadata.from_config` (metadata.py) calls these parsers for the extras and keeps the
decoder fields of both (Whisper's decoder, LLaVA's text model) at the top level of
`ModelMetadata`, like any decoder-only model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from ..errors import FormatError, Unsupported
from .config_fields import (KERNEL_MAX_HEAD_DIM, _Cfg, _pick, _token_ids, one_token_id,
                            token_ids_below)


@dataclass(frozen=True)
class WhisperConfig:
    """Whisper-only fields (config.json, plus the special ids of generation_config.json)."""

    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    decoder_attention_heads: int
    decoder_ffn_dim: int
    num_mel_bins: int
    max_source_positions: int      # encoder positions; the encoder sees 2x as many mel frames
    max_target_positions: int
    decoder_start_token_id: int
    pad_token_id: int | None
    scale_embedding: bool
    activation_function: str
    layer_norm_eps: float = 1e-5   # nn.LayerNorm's default; Whisper configs do not store it
    no_timestamps_token_id: int | None = None
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    forced_decoder_ids: tuple[tuple[int, int | None], ...] = ()
    lang_to_id: Mapping[str, int] = field(default_factory=dict, compare=False, hash=False)
    task_to_id: Mapping[str, int] = field(default_factory=dict, compare=False, hash=False)
    is_multilingual: bool = False

    @property
    def num_mel_frames(self) -> int:
        """Mel frames the encoder takes (conv2 has stride 2)."""
        return 2 * self.max_source_positions


@dataclass(frozen=True)
class VisionConfig:
    """LLaVA: the CLIP vision tower, the projector and how image features are picked."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str                   # CLIP: "quick_gelu"
    image_token_index: int
    vision_feature_layer: int         # index into hidden_states (-2: the second-to-last)
    vision_feature_select_strategy: str  # "default" drops the CLS token, "full" keeps it
    projector_hidden_act: str
    projector_bias: bool
    text_hidden_size: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Image-token positions one image fills in the prompt."""
        return self.num_patches + (1 if self.vision_feature_select_strategy == "full" else 0)


def whisper_config(config: dict, gen: dict | None, source: str) -> WhisperConfig:
    """The Whisper-only fields of config.json (ids from generation_config.json first)."""
    c = _Cfg(config, source)
    g = gen or {}
    gsource = (source[:-len("config.json")] + "generation_config.json"
               if source.endswith("config.json") else f"{source} (generation_config.json)")

    def origin(key: str) -> str:   # the file a value was picked from (_pick: gen first)
        return gsource if g.get(key) is not None else source
    vocab = c.int("vocab_size", required=True)
    d = c.int("d_model", required=True)
    heads = c.int("decoder_attention_heads", required=True)
    for key, h in (("decoder_attention_heads", heads),
                   ("encoder_attention_heads", c.int("encoder_attention_heads", required=True))):
        if d % h:
            raise FormatError(f"{source}: d_model {d} is not a multiple of {key} {h}")
        _attention_head_dim(d // h, f"{source}: d_model {d} / {key} {h}")
    start = _pick("decoder_start_token_id", config, gen)
    if start is None:
        raise FormatError(f"{source}: missing key 'decoder_start_token_id'")

    def ids(key: str) -> tuple[int, ...]:
        return token_ids_below(_token_ids(_pick(key, config, gen), key, origin(key)), key,
                               origin(key), vocab)
    nots = g.get("no_timestamps_token_id")
    if nots is not None:
        nots = token_ids_below((one_token_id(nots, "no_timestamps_token_id", gsource),),
                               "no_timestamps_token_id", gsource, vocab)[0]
    return WhisperConfig(
        d_model=d, encoder_layers=c.int("encoder_layers", required=True),
        encoder_attention_heads=c.int("encoder_attention_heads", required=True),
        encoder_ffn_dim=c.int("encoder_ffn_dim", required=True),
        decoder_layers=c.int("decoder_layers", required=True),
        decoder_attention_heads=heads,
        decoder_ffn_dim=c.int("decoder_ffn_dim", required=True),
        num_mel_bins=c.int("num_mel_bins", required=True),
        max_source_positions=c.int("max_source_positions", required=True),
        max_target_positions=c.int("max_target_positions", required=True),
        decoder_start_token_id=token_ids_below(
            (one_token_id(start, "decoder_start_token_id", origin("decoder_start_token_id")),),
            "decoder_start_token_id", origin("decoder_start_token_id"), vocab)[0],
        pad_token_id=c.int("pad_token_id", positive=False),
        scale_embedding=c.bool("scale_embedding", False),
        activation_function=config.get("activation_function", "gelu"),
        no_timestamps_token_id=nots,
        suppress_tokens=ids("suppress_tokens"),
        begin_suppress_tokens=ids("begin_suppress_tokens"),
        forced_decoder_ids=_forced_ids(_pick("forced_decoder_ids", config, gen),
                                       origin("forced_decoder_ids"), vocab),
        lang_to_id=_id_map(g.get("lang_to_id"), "lang_to_id", gsource, vocab),
        task_to_id=_id_map(g.get("task_to_id"), "task_to_id", gsource, vocab),
        is_multilingual=bool(g.get("is_multilingual", False)),
    )


def _attention_head_dim(hd: int, what: str) -> None:
    """The attention kernels' head_dim: even and at most KERNEL_MAX_HEAD_DIM."""
    if hd % 2 or hd > KERNEL_MAX_HEAD_DIM:
        raise Unsupported(f"{what} gives head_dim {hd}: the attention kernels take an even "
                          f"head_dim of at most {KERNEL_MAX_HEAD_DIM}")


def _forced_ids(v, source: str, vocab: int) -> tuple[tuple[int, int | None], ...]:
    """forced_decoder_ids: [[position, token id or null], ...]."""
    if v is None:
        return ()
    ok = isinstance(v, list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], int)
        and not isinstance(p[0], bool) and p[0] >= 0
        and (p[1] is None or (isinstance(p[1], int) and not isinstance(p[1], bool)
                              and 0 <= p[1] < vocab)) for p in v)
    if not ok:
        raise FormatError(f"{source}: forced_decoder_ids must be [position, token id < "
                          f"vocab_size {vocab} or null] pairs, got {v!r}")
    return tuple((p[0], p[1]) for p in v)


def _id_map(v, what: str, source: str, vocab: int) -> Mapping[str, int]:
    """lang_to_id / task_to_id: {token text: id < vocab}."""
    if v is None:
        return MappingProxyType({})
    if not isinstance(v, dict) or not all(
            isinstance(k, str) and isinstance(i, int) and not isinstance(i, bool)
            and 0 <= i < vocab for k, i in v.items()):
        raise FormatError(f"{source}: {what} must map token texts to ids below vocab_size "
                          f"{vocab}, got {v!r}"[:300])
    return MappingProxyType(dict(v))


def vision_config(config: dict, source: str, text_hidden_size: int,
                  text_vocab_size: int) -> VisionConfig:
    """The LLaVA vision tower, projector and feature selection of config.json, for a text
    model of `text_hidden_size` / `text_vocab_size` (parsed first)."""
    vis_cfg = config["vision_config"]
    v = _Cfg(vis_cfg, f"{source} (vision_config)")
    if vis_cfg.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise Unsupported(f"{source}: vision tower {vis_cfg.get('model_type')!r} is not "
                          "supported (supported: clip_vision_model)")
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise FormatError(f"{source}: vision_feature_select_strategy {strategy!r} must be "
                          "'default' or 'full'")
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise Unsupported(f"{source}: vision_feature_layer must be one int, got {layer!r}")
    image_token = config.get("image_token_index", config.get("image_token_id"))
    hidden, heads = v.int("hidden_size", 768), v.int("num_attention_heads", 12)
    if hidden % heads:   # CLIPAttention raises on this too
        raise FormatError(f"{v.source}: hidden_size {hidden} is not a multiple of "
                          f"num_attention_heads {heads}")
    _attention_head_dim(hidden // heads, f"{v.source}: hidden_size {hidden} / "
                                         f"num_attention_heads {heads}")
    num_layers = v.int("num_hidden_layers", 12)
    # hidden_states holds the embeddings and every layer's output: num_layers + 1 entries
    if not -(num_layers + 1) <= layer <= num_layers:
        raise FormatError(f"{source}: vision_feature_layer {layer} is outside the "
                          f"{num_layers + 1} hidden states of a {num_layers}-layer tower "
                          f"[{-(num_layers + 1)}, {num_layers}]")
    image_size, patch = v.int("image_size", 224), v.int("patch_size", 32)
    if patch > image_size:
        raise FormatError(f"{v.source}: patch_size {patch} is larger than image_size "
                          f"{image_size} (no patch fits)")
    bias = config.get("multimodal_projector_bias", True)
    if not isinstance(bias, bool):
        raise FormatError(f"{source}: multimodal_projector_bias must be true or false, got "
                          f"{bias!r}")
    vision = VisionConfig(
        hidden_size=hidden, intermediate_size=v.int("intermediate_size", 3072),
        num_layers=num_layers, num_heads=heads,
        image_size=image_size, patch_size=patch,
        num_channels=v.int("num_channels", 3),
        layer_norm_eps=v.float("layer_norm_eps", 1e-5, ge=0, f32=True),  # (x - mu) * rsqrt(var + eps)
        hidden_act=vis_cfg.get("hidden_act", "quick_gelu"),
        image_token_index=one_token_id(image_token, "image_token_index", source)
        if image_token is not None else 32000,
        vision_feature_layer=layer, vision_feature_select_strategy=strategy,
        projector_hidden_act=config.get("projector_hidden_act", "gelu"),
        projector_bias=bias, text_hidden_size=text_hidden_size)
    if vision.image_token_index >= text_vocab_size:
        raise FormatError(f"{source}: image_token_index {vision.image_token_index} is not "
                          f"below the text vocab_size {text_vocab_size}")
    return vision
