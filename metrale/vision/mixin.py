"""`ModelVision`: the pointer-API capability of vision-language models (the original
engine's vision trait), mixed into a `TransformerModel` subclass (`LlavaModel`).

  encode_images(images, stream) -> DevicePtr
      Runs the vision tower + projector over preprocessed `[1, C, H, W]` float32 images
      and returns the features, `[n_images * num_image_features(), text_hidden]` BF16, in
      a device buffer the model owns (valid until the next `encode_images`).
  prefill_multimodal(tokens, image_features_ptr, seq, stream) -> DevicePtr
      `prefill`, with the embedding row of every position where
      `tokens == image_token_index()` replaced by the next feature row at
      `image_features_ptr` (image-token position k takes feature row k). Returns the last
      position's logits like `prefill`.
  prefill_chunk_multimodal(tokens, image_features_ptr, seq, chunk_start, chunk_len,
                           is_last_chunk, stream) -> DevicePtr
      The chunked form (image-token position k of the whole prompt takes row k).

Image spans: every maximal run of `image_token_index` in a prompt holds whole images, i.e.
its length is a multiple of `num_image_features()` (one image per run in LLaVA's prompt
format; back-to-back images make one longer run). Anything else raises InvalidArgument
before a launch. Positions fed from image features are recorded as -1 in `seq.tokens`, so
such a sequence is never offered to the prefix cache (equal image tokens do not mean equal
images); the text before the first image may still reuse cached blocks.

The host class provides `self._vision` (a `ClipVisionTower`) and the `TransformerModel`
internals the spliced prefill pass uses.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import NULL, DevicePtr
from ..model_engine.guard import exclusive
from ..model_engine.sequence import SequenceState


class ModelVision:
    # ------------------------------------------------------------------ facts
    def image_token_index(self) -> int:
        """The token id whose positions image features fill."""
        return self._vision.vision.image_token_index

    def num_image_features(self) -> int:
        """Prompt positions (feature rows) one image fills."""
        return self._vision.n_features

    def image_input_shape(self) -> tuple[int, int, int, int]:
        """The shape of one preprocessed image: `(1, channels, image_size, image_size)`."""
        return self._vision.pixel_shape

    def image_features_ptr(self) -> DevicePtr:
        """The model's feature buffer (what the last `encode_images` returned; NULL before)."""
        return self._features

    # ------------------------------------------------------------------ spans
    def image_spans(self, tokens, what: str = "image_spans") -> list[tuple[int, int]]:
        """`(start, length)` of every run of image tokens in `tokens`, each checked to hold
        whole images (length a multiple of `num_image_features()`)."""
        ids = np.asarray(tokens).reshape(-1)
        F, img = self.num_image_features(), self.image_token_index()
        mask = np.concatenate([[False], ids == img, [False]])
        edges = np.flatnonzero(mask[1:] != mask[:-1])
        spans = [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]
        for start, length in spans:
            if length % F:
                raise InvalidArgument(
                    f"{what}: the image-token span at position {start} holds {length} "
                    f"image tokens (id {img}); each image fills exactly {F} positions")
        return spans

    def count_images(self, tokens, what: str = "count_images") -> int:
        """Images a prompt's spans hold."""
        return sum(n for _, n in self.image_spans(tokens, what)) // self.num_image_features()

    # ------------------------------------------------------------------ encode
    @exclusive
    def encode_images(self, images: Sequence, stream: int) -> DevicePtr:
        """Features of `images` (each `[1, C, H, W]` float32), `[n * F, text_hidden]` BF16
        in the model's feature buffer; see the module docstring."""
        checked = self._check_images(images, "encode_images")
        if not checked:
            raise InvalidArgument("encode_images: no images given")
        return self._encode_checked(checked, stream)

    def _check_images(self, images, what: str) -> list[np.ndarray]:
        if images is None:
            return []
        if isinstance(images, np.ndarray) or hasattr(images, "__cuda_array_interface__"):
            raise InvalidArgument(f"{what}: images must be a list of [1, C, H, W] arrays "
                                  "(one per image-token span), not one array")
        try:
            items = list(images)
        except TypeError:
            raise InvalidArgument(f"{what}: images must be a list of arrays, got "
                                  f"{type(images).__name__}") from None
        return [self._vision.check_image(im, i) for i, im in enumerate(items)]

    def _encode_checked(self, checked: list[np.ndarray], stream: int) -> DevicePtr:
        rows = len(checked) * self.num_image_features()
        row_bytes = self._vision.vision.text_hidden_size * 2
        if rows > self._features_capacity:
            if self._features_capacity:
                self.backend.synchronize(stream)  # the old buffer may still be read
                self.backend.free(self._features)
                self._features, self._features_capacity = NULL, 0
            self._features = self.backend.alloc(rows * row_bytes)
            self._features_capacity = rows
        self._features_rows = rows
        self._vision.encode(checked, self._features, stream)
        return self._features

    # ------------------------------------------------------------------ prefill
    @exclusive
    def prefill_multimodal(self, tokens, image_features_ptr, seq: SequenceState,
                           stream: int) -> DevicePtr:
        """`prefill` with image-token rows taken from `image_features_ptr`."""
        tokens = self._check_tokens(tokens, "prefill_multimodal")
        self._check_seq(seq)
        if seq.seq_len != 0:
            raise InvalidArgument(f"prefill_multimodal: sequence {seq.seq_id} already holds "
                                  f"{seq.seq_len} tokens; use prefill_chunk_multimodal")
        img_pos = self._image_positions(tokens, image_features_ptr, "prefill_multimodal")
        self._check_capacity(seq, len(tokens))
        first = int(img_pos[0]) if len(img_pos) else len(tokens) - 1
        start = self.reuse_prefix(seq, tokens[:first + 1])
        return self._run_spliced(tokens, img_pos, image_features_ptr, seq, start,
                                 len(tokens), True, stream)

    @exclusive
    def prefill_chunk_multimodal(self, tokens, image_features_ptr, seq: SequenceState,
                                 chunk_start: int, chunk_len: int, is_last_chunk: bool,
                                 stream: int) -> DevicePtr:
        """`prefill_chunk` with image-token rows taken from `image_features_ptr` (position
        k-th image token of the whole prompt -> feature row k)."""
        what = "prefill_chunk_multimodal"
        tokens = self._check_tokens(tokens, what)
        self._check_seq(seq)
        if chunk_start != seq.seq_len:
            raise InvalidArgument(f"{what}: chunk_start {chunk_start} != seq_len {seq.seq_len} "
                                  f"of sequence {seq.seq_id}")
        if chunk_len < 1 or chunk_start + chunk_len > len(tokens):
            raise InvalidArgument(f"{what}: chunk [{chunk_start}, {chunk_start + chunk_len}) "
                                  f"is empty or beyond the {len(tokens)}-token prompt")
        if is_last_chunk and chunk_start + chunk_len != len(tokens):
            raise InvalidArgument(f"{what}: is_last_chunk but the chunk does not end the "
                                  f"prompt ({chunk_start + chunk_len} of {len(tokens)})")
        img_pos = self._image_positions(tokens, image_features_ptr, what)
        self._check_capacity(seq, chunk_len)
        out = self._run_spliced(tokens, img_pos, image_features_ptr, seq, chunk_start,
                                chunk_start + chunk_len, is_last_chunk, stream)
        return out if is_last_chunk else NULL

    def _image_positions(self, tokens: list[int], features_ptr, what: str) -> np.ndarray:
        """Positions of the image tokens (checked spans) and a check of the feature rows."""
        self.image_spans(tokens, what)
        pos = np.flatnonzero(np.asarray(tokens) == self.image_token_index())
        if len(pos) == 0:
            return pos
        if features_ptr is None or int(features_ptr) == 0:
            raise InvalidArgument(f"{what}: the prompt holds {len(pos) // self.num_image_features()}"
                                  " image span(s) but image_features_ptr is NULL (call "
                                  "encode_images first)")
        base, row = int(self._features), self._vision.vision.text_hidden_size * 2
        p = int(features_ptr)
        if base and base <= p < base + self._features_capacity * row:
            if (p - base) % row:
                raise InvalidArgument(f"{what}: image_features_ptr {DevicePtr(p)!r} is not at "
                                      "a feature-row boundary of the model's feature buffer")
            have = self._features_rows - (p - base) // row
            if len(pos) > have:
                raise InvalidArgument(
                    f"{what}: the prompt's image spans need {len(pos)} feature rows "
                    f"({len(pos) // self.num_image_features()} image(s)) but only {max(have, 0)}"
                    f" encoded rows start at {DevicePtr(p)!r} (the last encode_images made "
                    f"{self._features_rows // self.num_image_features()} image(s))")
        return pos

    def _run_spliced(self, tokens, img_pos, features_ptr, seq, start: int, end: int,
                     want_logits: bool, stream: int) -> DevicePtr:
        out = NULL
        while start < end:
            n = min(self._ws.max_tokens, end - start)
            out = self._prefill_pass_spliced(seq, tokens, start, n, img_pos, features_ptr,
                                             stream, want_logits and start + n == end)
            start += n
        return out

    def _prefill_pass_spliced(self, seq: SequenceState, tokens, start: int, n: int,
                              img_pos: np.ndarray, features_ptr, stream: int,
                              want_logits: bool) -> DevicePtr:
        """`_prefill_pass` over tokens[start:start+n] with the embedding rows of image
        positions overwritten by feature rows on the device before the decoder runs."""
        ws, b = self._ws, self.backend
        hid = self._meta.hidden_size
        chunk = tokens[start:start + n]

        def splice(stream):
            # image-token positions inside this chunk: k-th image token <- feature row k
            lo, hi = np.searchsorted(img_pos, [start, start + n])
            k = int(lo)
            while k < hi:
                j = k
                while j + 1 < hi and img_pos[j + 1] == img_pos[j] + 1:
                    j += 1
                b.copy_d2d_async(DevicePtr(features_ptr).offset(k * hid * 2),
                                 ws.residual.offset((int(img_pos[k]) - start) * hid * 2),
                                 (j - k + 1) * hid * 2, stream)
                k = j + 1
        img = self.image_token_index()
        return self._prefill_pass(seq, chunk, stream, want_logits, splice=splice,
                                  recorded=[-1 if t == img else int(t) for t in chunk])
