"""Vision-language models: image preprocessing, the CLIP tower, LLaVA.

  preprocess_image(uint8 [H, W, 3], config) -> float32 [1, 3, H', W']
  load_image(path) -> uint8 [H, W, 3]               (Pillow: the optional extra `vision`)
  LlavaModel         — pointer API (`TransformerModel` + `ModelVision`); `metrale.load`
  LlavaGenerativeModel — tensor contract with `embed_multimodal`
"""
from .preprocess import (CLIP_MEAN, CLIP_STD, ImageProcessorConfig, center_crop, load_image,
                         preprocess_image, resize)

__all__ = ["preprocess_image", "load_image", "ImageProcessorConfig", "CLIP_MEAN", "CLIP_STD",
           "resize", "center_crop", "LlavaModel", "LlavaGenerativeModel", "ModelVision",
           "ClipVisionTower"]


def __getattr__(name):
    # The model classes pull in the whole engine; import them on first use.
    if name == "LlavaModel":
        from .llava import LlavaModel
        return LlavaModel
    if name == "LlavaGenerativeModel":
        from .generative import LlavaGenerativeModel
        return LlavaGenerativeModel
    if name == "ModelVision":
        from .mixin import ModelVision
        return ModelVision
    if name == "ClipVisionTower":
        from .clip import ClipVisionTower
        return ClipVisionTower
    raise AttributeError(f"module 'metrale.vision' has no attribute {name!r}")
