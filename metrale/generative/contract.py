"""The model-agnostic tensor contract (`seeds/generative_model.rs`): `GenerativeModel` and
`SpeechToTextModel`. Names, defaults and docs follow the seed.

Arrays in and out are the backend's arrays (numpy on CPU, CuPy on CUDA): token ids int32,
embeddings, hidden states and logits float32 (BF16 values widen exactly).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from ..errors import Unsupported, UnsupportedMedia


class GenerativeModel(ABC):
    """Fixed contract every generative architecture implements — the analog of MLC's
    `embed / prefill / decode / create_kv_cache` function set."""

    @abstractmethod
    def metadata(self):
        """Metadata this model was built from."""

    @classmethod
    @abstractmethod
    def load(cls, source, device="auto", **options) -> "GenerativeModel":
        """Loads all weights from a `ModelSource` onto `device`."""

    @abstractmethod
    def create_kv_cache(self, config, batch: int = 1):
        """A fresh KV cache for a new generation session, sized and implemented according
        to `config` (paged arena vs contiguous baseline)."""

    @abstractmethod
    def embed(self, tokens):
        """Embeds token ids: `[batch, seq]` int32 -> `[batch, seq, hidden]` float32."""

    def embed_multimodal(self, tokens, images: Sequence):
        """Embeds token ids, splicing vision-tower features into the image-token spans.
        `images` are preprocessed pixel batches `[1, channels, H, W]`, one per image-token
        span, in order. Text-only models keep this default, which rejects non-empty media
        and otherwise defers to `embed`."""
        if len(images) > 0:
            raise UnsupportedMedia(f"{len(images)} image(s) passed to a text-only model")
        return self.embed(tokens)

    @abstractmethod
    def prefill(self, input, cache, pos: range):
        """Runs (a chunk of) the prompt through the model, filling the KV cache for
        positions `pos`. `pos.stop - pos.start` must equal the input sequence length, and
        `pos.start` must equal the cache's current length. Returns the logits of the last
        position, `[batch, vocab]`."""

    @abstractmethod
    def decode(self, input, cache):
        """One decode step (a single new position at the end of the cache); returns its
        logits, `[batch, vocab]`."""

    def decode_all_logits(self, input, cache):
        """Decodes `n` tokens at the cache tail and returns logits for every position
        (`[1, n, vocab]`) — the seam multi-token verification needs."""
        raise Unsupported("this model does not expose per-position decode logits")

    def supports_decode_all_logits(self) -> bool:
        return False

    def prefill_hidden(self, input, cache, pos: range):
        """Runs (a chunk of) the prompt and returns the final-norm hidden states,
        `[1, seq, hidden]` — the embeddings path. Same cache/position contract as
        `prefill`."""
        raise Unsupported("this model does not expose hidden states for embeddings")

    def supports_hidden_states(self) -> bool:
        return False

    def prefill_all_logits(self, input, cache, pos: range):
        """Runs (a chunk of) the prompt and returns logits for every position,
        `[1, seq, vocab]` — the perplexity / speculative path. Memory scales with
        `seq x vocab`, so callers chunk accordingly."""
        raise Unsupported("this model does not expose per-position logits")


class SpeechToTextModel(ABC):
    """Speech-to-text models (Whisper-style encoder-decoder): the encoder runs once per audio
    window, then the decoder is stepped over token prefixes against the fixed states."""

    @abstractmethod
    def metadata(self):
        """Architecture and hyperparameter metadata."""

    @abstractmethod
    def n_mels(self) -> int:
        """Mel bins the encoder expects (derived from its conv stem weights)."""

    @abstractmethod
    def encode_audio(self, mel):
        """Encodes one `[1, n_mels, frames]` log-mel window into `[1, frames/2, hidden]`."""

    @abstractmethod
    def decode_step(self, tokens: Sequence[int], encoded):
        """Runs the decoder over the whole token prefix; returns the final position's
        logits `[vocab]`."""
