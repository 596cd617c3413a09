"""`LanguageModelSource`: a llava checkpoint seen as its decoder-only text model.

LLaVA stores the text model under `language_model.` (`language_model.model.*`,
`language_model.lm_head.weight`; `DirectorySource` maps newer layouts onto these). This
thin `ModelSource` presents exactly those tensors under the plain decoder names (`model.*`,
`lm_head.weight`) and the text model's metadata, so `TransformerModel` loads the language
model unchanged.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import FormatError

PREFIX = "language_model."


class LanguageModelSource:
    """The text model of a llava `ModelSource` (tensors renamed, metadata = `meta.text`)."""

    def __init__(self, inner) -> None:
        meta = inner.metadata()
        if meta.text is None:
            raise FormatError(f"{inner.description}: not a vision-language checkpoint "
                              "(no text_config)")
        self.inner = inner
        self.description = inner.description
        if hasattr(inner, "weights_description"):
            self.weights_description = inner.weights_description
        cfg = inner.config()
        text_cfg = {"model_type": "llama", **(cfg.get("text_config") or {})}
        # bos/eos of the whole checkpoint (generation_config wins) on the text metadata
        self._meta = replace(meta.text, bos_token_id=meta.bos_token_id,
                             eos_token_ids=meta.eos_token_ids, config=text_cfg,
                             generation_config=meta.generation_config)
        self._config = text_cfg

    def config(self) -> dict:
        return dict(self._config)

    def generation_config(self) -> dict | None:
        return self.inner.generation_config()

    def metadata(self):
        return self._meta

    def tensor_names(self) -> list[str]:
        return [n[len(PREFIX):] for n in self.inner.tensor_names() if n.startswith(PREFIX)]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.inner.tensor_shape(PREFIX + name)

    def tensor_dtype(self, name: str) -> str:
        return self.inner.tensor_dtype(PREFIX + name)

    def tensor_file(self, name: str) -> str:
        f = getattr(self.inner, "tensor_file", None)
        return f(PREFIX + name) if callable(f) else self.description

    def read_bf16(self, name: str) -> np.ndarray:
        return self.inner.read_bf16(PREFIX + name)

    def tokenizer_path(self) -> Path | None:
        return self.inner.tokenizer_path()
