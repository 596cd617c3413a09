"""`ModelForward`: running tokens through the model. Required methods plus the defaults of
the original engine, which build the batched and mixed forms from the required ones.

Logits pointers returned here point into the model's device logits buffers: `decode_batch`
leaves `[n, vocab]` rows at `logits_buffer_ptr()`; the batched prefill forms put item i's
last-position row at row `row_base + i` of the same buffer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple, Sequence

from ..gpu_runtime.types import NULL, DevicePtr
from .sequence import SequenceState


class PrefillChunk(NamedTuple):
    """One sequence's prefill chunk: `tokens` is its whole prompt; the chunk is
    `tokens[chunk_start : chunk_start + chunk_len]`, and `chunk_start` must equal
    `seq.seq_len`."""

    tokens: Sequence[int]
    seq: SequenceState
    chunk_start: int
    chunk_len: int
    is_last_chunk: bool


class ModelForward(ABC):
    @abstractmethod
    def prefill(self, tokens: Sequence[int], seq: SequenceState, stream: int) -> DevicePtr:
        """Run the whole prompt; returns the last position's logits row."""

    @abstractmethod
    def prefill_chunk(self, tokens: Sequence[int], seq: SequenceState, chunk_start: int,
                      chunk_len: int, is_last_chunk: bool, stream: int) -> DevicePtr:
        """Run `tokens[chunk_start : chunk_start + chunk_len]` against the cached prefix.
        Returns the last position's logits when `is_last_chunk`, else NULL."""

    @abstractmethod
    def decode(self, token: int, seq: SequenceState, stream: int) -> DevicePtr:
        """One new token at the end of `seq`; returns its logits row."""

    @abstractmethod
    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState],
                     stream: int) -> DevicePtr:
        """One new token for each sequence (each at its own length); returns `[n, vocab]`
        rows at `logits_buffer_ptr()`, row i for `seqs[i]`."""

    @abstractmethod
    def kv_block_size(self) -> int:
        """Tokens per KV block."""

    # defaults, built from the methods above -----------------------------------------------
    def prefill_batch_chunk(self, chunks: Sequence[PrefillChunk], stream: int) -> list[DevicePtr]:
        """Several sequences' prefill chunks; item i's logits (last chunks only) at row i of
        the logits buffer, NULL for the others."""
        return self.prefill_batch_chunk_rows(chunks, stream, 0)

    def prefill_batch_chunk_rows(self, chunks: Sequence[PrefillChunk], stream: int,
                                 row_base: int) -> list[DevicePtr]:
        """As `prefill_batch_chunk`, placing item i's logits at row `row_base + i`."""
        out: list[DevicePtr] = []
        for i, c in enumerate(chunks):
            p = self.prefill_chunk(c.tokens, c.seq, c.chunk_start, c.chunk_len,
                                   c.is_last_chunk, stream)
            if p.is_null():
                out.append(NULL)
                continue
            row_bytes = self.vocab_size() * (4 if self.logits_ptr_is_fp32(p) else 2)
            dst = self.logits_buffer_ptr().offset((row_base + i) * row_bytes)
            if int(dst) != int(p):
                self.backend.copy_d2d_async(p, dst, row_bytes, stream)
            out.append(dst)
        return out

    def mixed_forward(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                      chunk: PrefillChunk | None, stream: int) -> tuple[DevicePtr, DevicePtr]:
        """Decode rows for `decode_seqs` (rows 0..n-1) and one prefill chunk (row n).
        Returns `(decode_rows_ptr or NULL, prefill_row_ptr or NULL)`."""
        rows, chunk_ptrs = self.mixed_forward_batch(decode_tokens, decode_seqs,
                                                    [chunk] if chunk else [], stream)
        return rows, (chunk_ptrs[0] if chunk_ptrs else NULL)

    def mixed_forward_batch(self, decode_tokens: Sequence[int],
                            decode_seqs: Sequence[SequenceState],
                            chunks: Sequence[PrefillChunk],
                            stream: int) -> tuple[DevicePtr, list[DevicePtr]]:
        """Decode rows 0..n-1 for `decode_seqs`, then the prefill chunks' logits at rows
        n, n+1, ... Returns `(decode_rows_ptr or NULL, [chunk row ptr or NULL, ...])`."""
        rows = NULL
        if decode_seqs:
            rows = self.decode_batch(decode_tokens, decode_seqs, stream)
        ptrs = self.prefill_batch_chunk_rows(chunks, stream, len(decode_seqs)) if chunks else []
        return rows, ptrs
