"""`TransformerModel`'s own `ModelDraft` methods, with the meaning of the original's
`impl ModelDraft for TransformerModel` (`model/trait_impl/impl_draft.rs` and the
`*_dispatch` helpers of `trait_impl/speculative.rs`, `impl_b1_decode.rs`). A DeepSeek-V3
model loaded with its MTP module has a proposer (mtp_proposer.py: `save_hidden_for_mtp`
also keeps the rows before `token_idx`, `run_mtp_propose_multi` drafts,
`trim_proposer_state` drops the pairs a rollback removed); without one (no MTP head, no
self-speculative layers):

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

from ..errors import Unsupported
from ..gpu_runtime.types import DevicePtr
from .args import int_arg
from .guard import exclusive
from .sequence import SequenceState


class TransformerDraft:
    _last_mtp_hidden_idx: int | None = None
    _mtp = None   # mtp_proposer.MtpProposer of a model loaded with its MTP module

    def has_proposer(self) -> bool:
        """Whether the model drafts for itself (the original: an MTP proposer loaded)."""
        return self._mtp is not None

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
        if self._mtp is not None:
            self._mtp.save(self, idx, stream)
        self._last_mtp_hidden_idx = idx

    def mtp_hidden_ptr(self) -> DevicePtr:
        """The MTP input row `save_hidden_for_mtp` writes (BF16 `[hidden]`). Additive: the
        original keeps it private (`mtp_hidden_save`)."""
        return self._ws.mtp_hidden

    def last_mtp_hidden_idx(self) -> int | None:
        """The `token_idx` of the last `save_hidden_for_mtp` (None before the first).
        Additive: the original's `last_mtp_hidden_idx` field."""
        return self._last_mtp_hidden_idx

    @exclusive
    def run_mtp_propose_multi(self, token: int, position: int, num_drafts: int,
                              seq: SequenceState, stream: int,
                              grammar_bitmask=None) -> list[int]:
        """Up to `num_drafts` draft tokens from the MTP proposer (`[]` without one): `token`
        is the sequence's token at `position` (== seq.seq_len, not yet in its cache), the
        saved hidden rows (`save_hidden_for_mtp`) end at position - 1. Fewer drafts near
        the context limit (MAX_VERIFY_ROWS - 1 at most); `[]` when the saved rows cannot give
        the MTP the pairs it has not seen. `num_drafts` 0: the pairs are fed and nothing is
        drafted (a prompt prefilled in chunks: after each chunk's save, with the next chunk's
        first token). `grammar_bitmask`: refused when given (the drafts are unconstrained
        argmax ids)."""
        what = "run_mtp_propose_multi"
        nd = int_arg(what, "num_drafts", num_drafts, 0)
        s = self._stream_of(stream)
        if self._mtp is None:
            return []
        if grammar_bitmask is not None:
            raise Unsupported(f"{what}: grammar_bitmask (constrained drafts) is not supported")
        self._check_seq(seq)
        int_arg(what, "position", position, seq.seq_len, seq.seq_len)
        int_arg(what, "token", token, 0, self._meta.vocab_size - 1)
        return self._mtp.propose(self, int(token), int(position), nd, seq,
                                 self._default_after(s))

    def run_mtp_propose(self, token: int, position: int, seq: SequenceState,
                        stream: int) -> int | None:
        """One draft (`run_mtp_propose_multi` with 1), None without a proposer."""
        drafts = self.run_mtp_propose_multi(token, position, 1, seq, stream)
        return drafts[0] if drafts else None

    @exclusive
    def trim_proposer_state(self, seq: SequenceState, num_accepted: int, stream: int) -> None:
        """After a verify and the rollback of its rejected rows: the MTP's pairs past the
        sequence are dropped (nothing to trim without a proposer)."""
        int_arg("trim_proposer_state", "num_accepted", num_accepted, 0)
        self._stream_of(stream)
        if self._mtp is not None:
            self._check_seq(seq)
            self._mtp.trim(seq)

    def generate_speculative(self, prompt_tokens, params, num_drafts: int):
        """The original's model-level loop lives in the engine here (a model cannot reach
        the sampler): Unsupported, naming the call that runs it."""
        if self._mtp is None:
            raise Unsupported("this model has no draft proposer; use "
                              "metrale.engine.speculative_generate with a draft model")
        raise Unsupported("generate_speculative: use metrale.engine.speculative_generate("
                          "model, None, prompt, max_new_tokens, k=num_drafts), which drafts "
                          "with this model's MTP module")

    def max_prefill_tokens(self) -> int:
        """The most tokens one prefill pass runs (the load option): the rows one
        `save_hidden_for_mtp` can keep. Additive."""
        return self._ws.max_tokens

    def mtp_logits_ptr(self) -> DevicePtr:
        """The MTP's logits rows of the last propose, one per draft ([n, vocab], the
        model's logits dtype). Additive."""
        if self._mtp is None:
            raise Unsupported("mtp_logits_ptr: this model has no MTP module")
        return self._mtp.buffers.logits

    def decode_draft(self, token: int, seq: SequenceState, stream: int) -> DevicePtr:
        """The self-speculative draft step: `decode` without the linear-attention layers,
        of which this model has none, so exactly `decode(token, seq, stream)`."""
        return self.decode(token, seq, stream)
