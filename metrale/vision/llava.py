"""`LlavaModel`: a LLaVA checkpoint on the pointer API — the text model as a
`TransformerModel` (loaded through `LanguageModelSource`, so the `language_model.` keys and
`text_config` look like a plain decoder), plus `ModelVision` (the CLIP tower + projector
and prefill variants that splice image features into the image-token rows).

`metrale.load(llava_dir)` returns this; `metrale.vision.LlavaGenerativeModel(model)` (what
`metrale.load_generative` returns) gives the tensor contract, whose `embed_multimodal` runs
the same tower.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import Unsupported
from ..formats import check_tensors, expected_tensors
from ..gpu_runtime.types import NULL
from ..model_engine.transformer import TransformerModel
from .clip import ClipVisionTower
from .mixin import ModelVision
from .preprocess import ImageProcessorConfig
from .text_source import LanguageModelSource


class LlavaModel(ModelVision, TransformerModel):
    """LLaVA (CLIP vision tower + 2-layer projector + llama/mistral/qwen text model)."""

    def __init__(self, backend, source, *, kv_blocks: int | None = None, block_size: int = 16,
                 max_batch: int = 64, fp32_logits: bool = False, progress: bool = True,
                 **options) -> None:
        meta = source.metadata()
        if meta.architecture != "llava" or meta.vision is None or meta.text is None:
            raise Unsupported(f"{source.description}: model_type {meta.architecture!r} is not "
                              "llava")
        if options.get("max_loras") or options.get("loras"):
            raise Unsupported(f"{source.description}: LoRA adapter slots (max_loras, loras) "
                              "are served on decoder checkpoints, not llava")
        # every tensor, under its checkpoint name, before the first byte is uploaded
        check_tensors(source, expected_tensors(meta, source.tensor_names()))
        self._llava_meta = meta
        self._source = source
        self._features, self._features_capacity, self._features_rows = NULL, 0, 0
        # The tower goes first, so the KV pool (sized from free memory on a GPU) sees it.
        self._vision = ClipVisionTower(backend, source, meta, progress=progress)
        try:
            super().__init__(backend, LanguageModelSource(source), kv_blocks=kv_blocks,
                             block_size=block_size, max_batch=max_batch,
                             fp32_logits=fp32_logits, progress=progress, **options)
        except BaseException:
            self._vision.free()
            raise

    def metadata(self):
        """The llava metadata: the text model's fields at the top, `.vision`, `.text`."""
        return self._llava_meta

    def image_processor_config(self) -> ImageProcessorConfig:
        """The checkpoint's preprocessor_config.json, else CLIP defaults at the tower's
        image size."""
        path = getattr(self._source, "path", None)
        if isinstance(path, Path):
            return ImageProcessorConfig.from_pretrained(path, self._llava_meta.vision.image_size)
        return ImageProcessorConfig.clip_defaults(self._llava_meta.vision.image_size)

    def _release_device(self) -> None:
        super()._release_device()
        vision = getattr(self, "_vision", None)
        if vision is not None:
            vision.free()
        if not self._features.is_null():
            self.backend.free(self._features)
            self._features, self._features_capacity, self._features_rows = NULL, 0, 0
