"""Images in `generate`: the prefill of a LLaVA prompt fills its image-token spans from the
images' features (`encode_images` + `prefill_multimodal`, metrale.vision.mixin)."""
from __future__ import annotations

from typing import Callable

from ..errors import InvalidArgument, Unsupported


def image_prefill(m, prompt: list[int], images) -> Callable:
    """The prefill `generate` runs on pointer-API model `m`: `m.prefill` when `images` is
    None or empty, else `(tokens, seq, stream) -> logits ptr` through `prefill_multimodal`.

    images: one preprocessed `[1, 3, H, W]` float32 array per image-token span of `prompt`
    (`metrale.vision.preprocess_image`), in prompt order; checked here, before anything is
    launched: a model without a vision tower (Unsupported), a count that differs from the
    prompt's spans, shapes or dtypes (InvalidArgument).
    """
    if images is None or (isinstance(images, (list, tuple)) and not images):
        return m.prefill
    if not hasattr(m, "prefill_multimodal"):
        raise Unsupported(f"generate: images were given but the model "
                          f"({m.metadata().architecture}) has no vision tower")
    images = list(images)
    checked = m._check_images(images, "generate: images")
    spans = m.count_images(prompt, "generate: prompt")
    if spans != len(checked):
        F = m.num_image_features()
        raise InvalidArgument(
            f"generate: the prompt holds {spans} image span(s) but {len(checked)} image(s) "
            f"were given; each image fills a span of {F} tokens of id "
            f"{m.image_token_index()} in the prompt")

    def prefill(tokens, seq, stream):
        return m.prefill_multimodal(tokens, m.encode_images(images, stream), seq, stream)
    return prefill
