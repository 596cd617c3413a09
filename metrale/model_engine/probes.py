"""The supertraits of the original engine's `Model` that this runtime's models have no
machinery for, with the original's defaults (`crates/model-engine/src/traits/model/
{draft,ssm_state,ep,device_feed,circuit}.rs`), so a scheduler ported from Rust can ask
and get the answer it expects: no draft proposer, no SSM state, a single rank, no device
token feed, the legacy forward. (LoRA adapters are real: adapters.py.)

A probe answers what the model has. An action the original's default refuses raises
`Unsupported`; an action whose default is a no-op stays one only where that is exactly
right for a model without the feature.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Sequence

from ..errors import Unsupported


class ModelDraft:
    """Draft proposers (MTP, DFlash, self-speculative): this model has none."""

    def has_proposer(self) -> bool:
        return False

    def has_self_speculative(self) -> bool:
        return False

    def mtp_slot_draft_capacity(self, slot_idx: int) -> int:
        """Most drafts a step may send: unbounded (no SSM verify pools)."""
        return sys.maxsize

    def dflash_gamma(self) -> int | None:
        return None

    def mtp_propose_batch_max(self) -> int:
        return 1

    def dflash_capture_band(self) -> int:
        return 0

    def generate_speculative(self, prompt_tokens, params, num_drafts: int):
        raise Unsupported("this model has no draft proposer; use "
                          "metrale.engine.speculative_generate with a draft model")

    def decode_draft(self, token: int, seq, stream: int):
        raise Unsupported("this model has no self-speculative draft decode")

    def run_mtp_propose(self, token: int, position: int, seq, stream: int) -> int | None:
        return None   # the original: None without a proposer

    def run_mtp_propose_batched(self, *args, **kwargs):
        return None   # the original: unsupported, the caller proposes per sequence

    def run_mtp_propose_multi(self, token, position, num_drafts, seq, stream,
                              grammar_bitmask=None) -> list[int]:
        raise Unsupported("run_mtp_propose_multi: this model has no draft proposer")

    def save_hidden_for_mtp(self, token_idx: int, stream: int) -> None:
        raise Unsupported("save_hidden_for_mtp: this model has no MTP head")

    def save_hidden_for_mtp_from_stash(self, idx: int, stream: int) -> None:
        raise Unsupported("save_hidden_for_mtp_from_stash: unsupported by this model")

    def stash_verify_hidden_rows(self, rows, stream: int) -> None:
        raise Unsupported("stash_verify_hidden_rows: unsupported by this model")

    def read_deferred_draft_token(self) -> int:
        return 0      # the original's default: no proposer left a draft on the device

    # drafter context bookkeeping: nothing to do without a drafter (the original's Ok(()))
    def stash_verify_catchup_rows(self, slot_rows) -> None:
        return None

    def run_mtp_catchup_batched(self, tokens, first_slot, first_pos, seqs) -> int:
        return 0

    def save_hidden_for_catchup(self, token_idx: int, pos: int) -> None:
        return None

    def save_dflash_hidden_for_propose(self, token_idx: int, stream: int) -> None:
        return None

    def dflash_accept_append(self, seq) -> None:
        return None

    def dflash_eagle_accept_append(self, seq) -> None:
        return None

    def dflash_eagle_kgamma_append(self, seq, num_accepted: int, base_pos: int) -> None:
        return None

    def dflash_serial_ctx_append(self, seq) -> None:
        return None

    def commit_ctx(self, seq, num_committed: int, base_pos: int, scratch_row: int) -> None:
        return None

    def trim_proposer_state(self, seq, num_accepted: int, stream: int) -> None:
        return None   # no proposer state to trim




class ModelEp:
    """The multi-rank (EP) protocol: this model runs on one rank."""

    def is_ep(self) -> bool:
        return False

    def ep_protocol_v2(self) -> bool:
        return False

    def ep_worker_step(self, slots) -> bool:
        return True

    def ep_broadcast_cmd(self, cmd: int) -> None:
        return None   # no worker ranks to tell

    def ep_broadcast_cmd_for_seq(self, seq_id: int, cmd: int) -> None:
        return None

    def ep_broadcast_tokens(self, tokens: Sequence[int]) -> list[int]:
        return []


class ModelDeviceFeed:
    """The asynchronous router's device token feed: not supported. The event and copy
    methods work (they are the backend's)."""

    def supports_device_token_feed(self) -> bool:
        return False

    def decode_batch_fed(self, sources, seqs, stream: int):
        raise Unsupported("decode_batch_fed: this model has no device token feed")

    def argmax_batch_to_feed(self, logits, masks, dst, event: int, stream: int) -> None:
        raise Unsupported("argmax_batch_to_feed: this model has no device token feed")

    def reserve_decode_block(self, seq) -> int:
        raise Unsupported("reserve_decode_block: this model has no device token feed "
                          "(reserve_blocks reserves blocks ahead)")

    def release_decode_blocks(self, seq, blocks: int) -> None:
        raise Unsupported("release_decode_blocks: this model has no device token feed")

    def fed_step_settled(self) -> None:
        return None

    def alloc_host_pinned(self, nbytes: int):
        raise Unsupported("alloc_host_pinned: this model has no device token feed")

    def free_host_pinned(self, ptr, nbytes: int) -> None:
        raise Unsupported("free_host_pinned: this model has no device token feed")

    def event_query(self, event: int) -> bool:
        return self.backend.event_query(event)

    def event_synchronize(self, event: int) -> None:
        self.backend.event_synchronize(event)

    def destroy_event(self, event: int) -> None:
        self.backend.destroy_event(event)

    def copy_d2h_async(self, src, dst, stream: int) -> None:
        """Additive (the original's default refuses): an async device-to-host copy on
        `stream`; `dst` must stay alive and unread until `stream` is synchronized."""
        self.backend.copy_d2h_async(src, dst, self._stream_of(stream))


@dataclass(frozen=True)
class ForwardDisclosure:
    """What a record states about the forward decode runs."""

    forward: str = "legacy"
    plan_digest: str | None = None
    launches_per_step: int | None = None


class ModelCircuit:
    """Forward selection: only the hand-written (legacy) forward exists here."""

    def set_forward(self, sel) -> None:
        if sel not in ("legacy", None):
            raise Unsupported("this model has no circuit executor; only the legacy forward")

    def forward_disclosure(self) -> ForwardDisclosure:
        return ForwardDisclosure()
