"""Checkpoint tensor names as the loaders read them: newer transformers layouts and wrapper
checkpoints mapped onto one name per tensor.

- llava: the newer `model.language_model.*` / `model.vision_tower.*` layout onto llava-hf's
  (`language_model.model.*`, `vision_tower.vision_model.*`; layout.py).
- gemma3: the text model of either layout onto the plain decoder's names; its vision tower
  and projector are held but never read (`GEMMA3_VISION`).
- qwen3_5 / qwen3_5_moe wrappers: the text model's names (hybrid_layout.py).
- deepseek_v3, glm4_moe, glm4_moe_lite: their MTP layers are not the main model's
  (deepseek_config.mtp_prefixes); DeepSeek-V3's first loads as the draft proposer
  (model_engine/mtp.py), GLM's stay unread.
"""
from __future__ import annotations

from .deepseek_config import mtp_prefixes
from .hybrid_layout import canonical_name

# a gemma3 checkpoint loads as its text model (images refused): these stay unread
GEMMA3_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.")

_LLAVA_PREFIXES = (("model.language_model.", "language_model.model."),
                   ("model.vision_tower.", "vision_tower."),
                   ("model.multi_modal_projector.", "multi_modal_projector."))


def unloaded_prefixes(config: dict) -> tuple[str, ...]:
    """Name prefixes a checkpoint with this config.json holds but no load reads."""
    return GEMMA3_VISION if config.get("model_type") == "gemma3" else mtp_prefixes(config)


def canonical_key(model_type, raw: str) -> str:
    """The name the loaders use for the checkpoint tensor `raw` of a `model_type` config."""
    if model_type == "gemma3":
        for old in ("model.language_model.", "language_model.model."):
            if raw.startswith(old):
                return "model." + raw[len(old):]
        return "lm_head.weight" if raw == "language_model.lm_head.weight" else raw
    if model_type != "llava":
        return canonical_name(model_type, raw)
    for old, new in _LLAVA_PREFIXES:
        if raw.startswith(old):
            raw = new + raw[len(old):]
    if raw == "lm_head.weight":
        raw = "language_model.lm_head.weight"
    if raw.startswith("vision_tower.") and not raw.startswith("vision_tower.vision_model."):
        raw = "vision_tower.vision_model." + raw[len("vision_tower."):]
    return raw
