"""`TransformerModel`'s own `ModelDraft` methods, with the meaning of the original's
`impl ModelDraft for TransformerModel` (`model/trait_impl/impl_draft.rs` and the
`*_dispatch` helpers of `trait_impl/speculative.rs`, `impl_b1_decode.rs`) for a model
loaded without a draft proposer (no MTP head, no self-speculative layers):

- `save_hidden_for_mtp(token_idx)` copies row `token_idx` of the last forward pass's
  pre-final-norm hidden state (the residual stream, BF16 `[hidden]`) into the model's MTP
  input row and remembers the index. The original does it whether or not a proposer is
  loaded, and its verify steps call it on both the accept and the reject branch.
- `run_mtp_propose_multi(...)` returns `[]`: no proposer, no drafts (the original's
  `run_mtp_propose_inner` returns an empty Vec when `self.proposer` is None).
- `decode_draft(token, seq)` is a decode step that skips the linear-attention (SSM) layers;
  every layer here is attention, so it is `decode`: the token is appended, `seq_len`
  advances by one and the logits are at `decode_logits_ptr()`.
"""
from __future__ import annotations

from ..gpu_runtime.types import DevicePtr
from .args import int_arg
from .guard import exclusive
from .sequence import SequenceState


class TransformerDraft:
    _last_mtp_hidden_idx: int | None = None

    @exclusive
    def save_hidden_for_mtp(self, token_idx: int, stream: int) -> None:
        """Copy hidden row `token_idx` (before the final norm, BF16 `[hidden]`) of the last
        forward pass into the MTP input row (`mtp_hidden_ptr()`). Runs on the default
        stream, as the original, after it has waited for `stream`."""
        ws = self._ws
        idx = int_arg("save_hidden_for_mtp", "token_idx", token_idx, 0, ws.max_tokens - 1)
        stream = self._default_after(stream)
        row = self._meta.hidden_size * 2
        self.backend.copy_d2d_async(ws.residual.offset(idx * row), ws.mtp_hidden, row, stream)
        self._last_mtp_hidden_idx = idx

    def mtp_hidden_ptr(self) -> DevicePtr:
        """The MTP input row `save_hidden_for_mtp` writes (BF16 `[hidden]`). Additive: the
        original keeps it private (`mtp_hidden_save`)."""
        return self._ws.mtp_hidden

    def last_mtp_hidden_idx(self) -> int | None:
        """The `token_idx` of the last `save_hidden_for_mtp` (None before the first).
        Additive: the original's `last_mtp_hidden_idx` field."""
        return self._last_mtp_hidden_idx

    def run_mtp_propose_multi(self, token: int, position: int, num_drafts: int,
                              seq: SequenceState, stream: int,
                              grammar_bitmask=None) -> list[int]:
        """Up to `num_drafts` draft tokens from the MTP proposer: `[]`, there is none."""
        int_arg("run_mtp_propose_multi", "num_drafts", num_drafts, 0)
        self._stream_of(stream)
        return []

    def decode_draft(self, token: int, seq: SequenceState, stream: int) -> DevicePtr:
        """The self-speculative draft step: `decode` without the linear-attention layers,
        of which this model has none, so exactly `decode(token, seq, stream)`."""
        return self.decode(token, seq, stream)
