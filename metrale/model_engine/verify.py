"""`ModelVerify`: scoring a speculative draft in one pass, and rolling back rejected tokens."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from .sequence import SequenceState


class ModelVerify(ABC):
    @abstractmethod
    def decode_verify(self, tokens: Sequence[int], seq: SequenceState, stream: int) -> list[int]:
        """`[last_token, draft0, ..., draft_{k-1}]` in: appends all k+1 tokens to `seq` and
        returns the device-argmax id after each position (k+1 ids). All k+1 logits rows are
        left at `logits_buffer_ptr()`. The caller rolls back what it rejects."""

    def rollback(self, seq: SequenceState, n_tokens: int) -> None:
        """Drop the last `n_tokens` positions of `seq` (their blocks go back to the pool)."""
        from .args import int_arg
        self._check_seq(seq)
        n = int_arg("rollback", "n_tokens", n_tokens, 0, seq.seq_len)
        self._truncate(seq, seq.seq_len - n)
