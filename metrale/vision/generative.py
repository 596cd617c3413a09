"""`LlavaGenerativeModel`: the tensor contract over a `LlavaModel`.

Everything of `DecoderGenerativeModel` (prefill, decode, prefill_all_logits, ... on given
embeddings), plus `embed_multimodal(tokens, images)`: token embeddings with every
image-token span filled by the vision tower's features of the matching image.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InvalidArgument, Unsupported
from ..formats import open_source
from ..generative.decoder import DecoderGenerativeModel
from ..gpu_runtime import backend_for
from ..gpu_runtime.arrays import to_backend, to_numpy
from ..ops.bf16 import bf16_to_f32
from .llava import LlavaModel


class LlavaGenerativeModel(DecoderGenerativeModel):
    def __init__(self, model) -> None:
        if not isinstance(model, LlavaModel):
            raise Unsupported(f"LlavaGenerativeModel needs a LlavaModel, got "
                              f"{type(model).__name__}")
        super().__init__(model)

    @classmethod
    def load(cls, source, device="auto", **options) -> "LlavaGenerativeModel":
        """A llava checkpoint as a `LlavaModel` behind the contract; `options` are
        `LlavaModel`'s."""
        return cls(LlavaModel(backend_for(device), open_source(source), **options))

    def image_processor_config(self):
        """What `metrale.vision.preprocess_image(image, model)` uses."""
        return self.model.image_processor_config()

    def num_image_features(self) -> int:
        return self.model.num_image_features()

    def image_token_index(self) -> int:
        return self.model.image_token_index()

    def embed_multimodal(self, tokens, images: Sequence = ()):
        """`[1, s]` int tokens with `image_token_index` once per image feature, and one
        preprocessed `[1, 3, H, W]` float32 image per image-token span, in order ->
        `[1, s, hidden]` float32 embeddings (feature rows in the spans)."""
        m = self.model
        what = "embed_multimodal"
        ids = np.asarray(to_numpy(tokens))
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise InvalidArgument(f"{what}: tokens must be a [batch, seq] integer array, got "
                                  f"{ids.dtype} {ids.shape}")
        checked = m._check_images(images, what)
        n_spans = [m.count_images(row, what) for row in ids]
        if not checked and not any(n_spans):
            return self.embed(tokens)
        if ids.shape[0] != 1:
            raise InvalidArgument(f"{what}: tokens with images must be [1, seq], got batch "
                                  f"{ids.shape[0]}")
        if n_spans[0] != len(checked):
            F = m.num_image_features()
            raise InvalidArgument(
                f"{what}: the tokens hold {n_spans[0]} image span(s) ({n_spans[0] * F} tokens "
                f"of id {m.image_token_index()}, {F} per image) but {len(checked)} image(s) "
                "were given")
        m._check_tokens(ids[0], what)
        rows = self._embedding_rows(ids[0].astype(np.int64))
        hid = self.metadata().hidden_size
        feats = np.empty((len(checked) * m.num_image_features(), hid), np.uint16)
        with m._guard:
            stream = m.default_stream()
            ptr = m._encode_checked(checked, stream)
            m.backend.synchronize(stream)
            m.backend.copy_d2h(ptr, feats)
        rows[ids[0] == m.image_token_index()] = feats
        return to_backend(self.backend, bf16_to_f32(rows)[None])
