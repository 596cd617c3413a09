"""`ModelVerify`: scoring a speculative draft in one pass, and rolling back rejected tokens
(`crates/model-engine/src/traits/model/verify.rs`; `rollback` is additive)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from ..errors import InvalidArgument, Unsupported
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

    # the original's fixed-width and batched forms, with its defaults -----------------------
    def decode_verify_graphed(self, tokens: Sequence[int], seq: SequenceState,
                              stream: int) -> list[int]:
        """K=2 verify (`[last, draft]`)."""
        return self._verify_k(tokens, seq, stream, 2, "decode_verify_graphed")

    def decode_verify_graphed_k3(self, tokens: Sequence[int], seq: SequenceState,
                                 stream: int) -> list[int]:
        return self._verify_k(tokens, seq, stream, 3, "decode_verify_graphed_k3")

    def decode_verify_graphed_k4(self, tokens: Sequence[int], seq: SequenceState,
                                 stream: int) -> list[int]:
        return self._verify_k(tokens, seq, stream, 4, "decode_verify_graphed_k4")

    def decode_verify_graphed_kgamma(self, tokens: Sequence[int], seq: SequenceState,
                                     stream: int) -> list[int]:
        """DFlash-width verify. Default: `decode_verify`."""
        return self.decode_verify(tokens, seq, stream)

    def decode_verify_dflash(self, tokens: Sequence[int], seq: SequenceState,
                             stream: int) -> list[int]:
        return self.decode_verify_graphed_kgamma(tokens, seq, stream)

    def decode_and_verify_fused(self, tokens: Sequence[int], seq: SequenceState,
                                stream: int) -> list[int]:
        return self.decode_verify_graphed_kgamma(tokens, seq, stream)

    def can_batch_verify(self, ks: Sequence[int]) -> bool:
        """Whether `decode_verify_batched` can run these widths. Default False."""
        return False

    def decode_verify_batched(self, tokens, ks, seqs, stream, opts=None) -> list[int]:
        raise Unsupported("decode_verify_batched: unsupported by this model")

    def gdn_fold_accepted(self, slots, accepted_rows, k_rows: int) -> bool:
        """Nothing folded (no GDN layers). Default False."""
        return False

    def _verify_k(self, tokens, seq, stream, k: int, what: str) -> list[int]:
        if len(tokens) != k:
            raise InvalidArgument(f"{what}: takes exactly {k} tokens, got {len(tokens)}")
        return self.decode_verify(tokens, seq, stream)
