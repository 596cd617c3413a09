"""`ModelForward`: running tokens through the model. Required methods plus the defaults of
the original engine (`crates/model-engine/src/traits/model/forward.rs`), which build the
batched and mixed forms from the required ones.

Logits pointers returned here point into the model's device logits arena and stay valid
until the next forward pass on that model: `decode_batch` leaves `[n, vocab]` rows at
`logits_buffer_ptr()`; prefill writes row 0 (`decode_logits_ptr()`); the batched prefill
forms put slice i's last-position row at row `row_base + i`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ..errors import Unsupported
from ..gpu_runtime.types import NULL, DevicePtr
from .sequence import SequenceState


class PrefillSlice(NamedTuple):
    """One sequence's prefill chunk (the original's `PrefillSlice`): `prompt_tokens` is the
    whole prompt; the chunk is `prompt_tokens[chunk_start : chunk_start + chunk_len]` in
    prompt positions (positions already in the cache are skipped)."""

    prompt_tokens: Sequence[int]
    seq: SequenceState
    chunk_start: int
    chunk_len: int
    is_last_chunk: bool


class MixedForwardResult(NamedTuple):
    """`decode_logits`: `[n_decode, vocab]` rows or NULL; `prefill_logits`: the chunk's
    last-position row, NULL unless it was the last chunk."""

    decode_logits: DevicePtr
    prefill_logits: DevicePtr


class MixedBatchResult(NamedTuple):
    """`decode_logits`: `[n_decode, vocab]` rows or NULL; `prefill_logits`: one pointer per
    slice, NULL for a slice that was not its prompt's last chunk."""

    decode_logits: DevicePtr
    prefill_logits: list


@dataclass
class BeamReq:
    """One beam-search request (the original's `BeamReq`, for translation models)."""

    prompt_tokens: Sequence[int]
    src_lang_id: int = 0
    tgt_lang_id: int = 0
    adapter_slot: int = -1
    num_beams: int = 1
    max_new: int = 0
    length_penalty: float = 1.0
    early_stopping: bool = False


class ModelForward(ABC):
    @abstractmethod
    def prefill(self, tokens: Sequence[int], seq: SequenceState, stream: int) -> DevicePtr:
        """Run the whole prompt; returns the last position's logits row."""

    @abstractmethod
    def prefill_chunk(self, tokens: Sequence[int], seq: SequenceState, chunk_start: int,
                      chunk_len: int, is_last_chunk: bool, stream: int) -> DevicePtr:
        """Run `tokens[chunk_start : chunk_start + chunk_len]`. Returns the last prompt
        position's logits when `is_last_chunk`, else NULL."""

    @abstractmethod
    def decode(self, token: int, seq: SequenceState, stream: int) -> DevicePtr:
        """One new token at the end of `seq`; returns its logits row. An empty sequence
        takes it at position 0, as the original's decode (the same logits as a one-token
        prefill, without the prefix-cache lookup)."""

    @abstractmethod
    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState],
                     stream: int) -> DevicePtr:
        """One new token for each sequence; returns `[n, vocab]` rows, row i for `seqs[i]`."""

    # defaults of the original engine ------------------------------------------------------
    def supports_beam(self) -> bool:
        """Whether `generate_beam_batch` is implemented. Default False."""
        return False

    def generate_beam_batch(self, reqs: Sequence[BeamReq]) -> list[list[int]]:
        """Beam search to completion per request. Default: this model has none."""
        raise Unsupported("this model does not support beam search")

    def mixed_forward(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                      prefill_tokens: Sequence[int], prefill_seq: SequenceState,
                      prefill_chunk_start: int, prefill_chunk_len: int, prefill_is_last: bool,
                      stream: int) -> MixedForwardResult:
        """Decode rows for `decode_seqs` plus one prefill chunk. Default: `decode_batch`
        (skipped without decode tokens), then `prefill_chunk`."""
        rows = self.decode_batch(decode_tokens, decode_seqs, stream) if decode_tokens else NULL
        p = self.prefill_chunk(prefill_tokens, prefill_seq, prefill_chunk_start,
                               prefill_chunk_len, prefill_is_last, stream)
        return MixedForwardResult(rows, p)

    def prefill_batch_chunk(self, slices: Sequence[PrefillSlice], stream: int) -> list[DevicePtr]:
        """One chunk per slice; per slice its last-position logits or NULL. Default:
        `prefill_chunk` per slice."""
        return [self.prefill_chunk(s.prompt_tokens, s.seq, s.chunk_start, s.chunk_len,
                                   s.is_last_chunk, stream) for s in slices]

    def prefill_batch_chunk_rows(self, slices: Sequence[PrefillSlice], stream: int,
                                 row_base: int) -> list[DevicePtr]:
        """`prefill_batch_chunk` with slice i's logits at row `row_base + i`, clear of the
        decode rows of a mixed step. Default: ignore `row_base`."""
        return self.prefill_batch_chunk(slices, stream)

    def mixed_forward_batch(self, decode_tokens: Sequence[int],
                            decode_seqs: Sequence[SequenceState],
                            prefill_slices: Sequence[PrefillSlice],
                            stream: int) -> MixedBatchResult:
        """Decode rows for `decode_seqs` plus one chunk per slice. Default (the original's
        order): `decode_batch`, synchronize the default stream, then
        `prefill_batch_chunk_rows` with `row_base` = the number of decode rows."""
        rows = NULL
        if decode_tokens:
            rows = self.decode_batch(decode_tokens, decode_seqs, stream)
            # the batched prefill reuses the decode pass's buffers on `stream`
            self.synchronize(self.default_stream())
        ptrs = self.prefill_batch_chunk_rows(prefill_slices, stream, len(decode_tokens))
        return MixedBatchResult(rows, list(ptrs))

    def normalize_ssm_states(self, seq: SequenceState, stream: int) -> None:
        """Per-chunk pass over a sequence's SSM state. Default: nothing (no SSM state)."""
        return None

    def prefill_twophase(self, tokens: Sequence[int], seq: SequenceState, chunk_size: int,
                         stream: int) -> DevicePtr:
        """The whole prompt in one call. Default: one `prefill_chunk` over all of it."""
        return self.prefill_chunk(tokens, seq, 0, len(tokens), True, stream)

    def is_mla(self) -> bool:
        """Whether chunked prefill must run as one chunk (MLA). Default False."""
        return False

    def hc_mult(self) -> int:
        """Hyper-connection stream count; 0 means none. Default 0."""
        return 0

    def kv_block_size(self) -> int | None:
        """Tokens per paged-KV block, or None without a paged cache. Default None."""
        return None

    def prefill_tail_split(self, tokens: Sequence[int]) -> int | None:
        """Where a prefill of `tokens` must end a non-last chunk (an SSM snapshot point), or
        None when this model does not split. Default None."""
        return None

    def prefill_grid(self, tokens: Sequence[int]) -> int | None:
        """The grid non-last prefill chunks must end on, or None. Default None."""
        return None
