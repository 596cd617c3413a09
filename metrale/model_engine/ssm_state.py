"""`ModelSsmState`: the original engine's recurrent-state methods
(`crates/model-engine/src/traits/model/ssm_state.rs`, `model/trait_impl/verify_a_ssm.rs`,
`impl_ssm_state.rs`) over the state pool (kv/state_pool.py, model_engine/state_arena.py).

A model without recurrent layers (`self._states` None) answers as the original's defaults:
no SSM layers, nothing to checkpoint or roll back. A hybrid model keeps, per sequence, one
live slot (`seq.ssm_slot`) and, model-wide, the states inside the last verify of one
sequence (`_ssm_verify`: the verify slots j = 0..rows-1 hold the state after j of its rows;
the original's `h_state_checkpoint` is j = 0, its `h_state_intermediates[n - 1]` is j = n):

  checkpoint_ssm_states(seq)        live -> verify slot 0 (a decode_verify also saves it)
  rollback_ssm_states(seq, n)       the state after n rows of the last verify (n = 0: the
                                    checkpoint); every check first, then the copies, so a
                                    refused rollback leaves the live state as it was
  commit_accepted_prefix(seq, n, k) n == k: nothing (the verify's final state is live);
                                    0 < n < k: rollback_ssm_states(seq, n); else refused
  save/restore_decode_ssm_snapshot  live <-> the sequence's decode-rollback ring slot (after
                                    a restore, `rollback` to the snapshot's position keeps
                                    the restored state)
  decode_marconi_checkpoint(seq)    at a checkpoint boundary, the live state is kept as the
                                    prefix state of the tokens so far (prefix reuse)

Differences from the original, stated in the README's method table: the intermediates of
one verify are kept for the last verified sequence only (a sequence's own later pass, or
another sequence's checkpoint / verify, retires them, and a rollback then raises instead of
copying stale states); the ring and prefix slots are sized by load options; errors raise
`InvalidArgument` / `Unsupported` where the original returns `Err`.
"""
from __future__ import annotations

from typing import NamedTuple

from ..errors import InvalidArgument, Unsupported
from ..kv.prefix import prefix_keys
from .args import int_arg


class VerifyStates(NamedTuple):
    """The states the pool holds for the last verify (or checkpoint) of one sequence."""
    seq_id: int
    start: int      # seq_len before the verify's first row (or at the checkpoint)
    rows: int       # rows of the verify (0: a checkpoint alone)
    kept: int       # verify slots 0..kept-1 hold the state after that many rows


class ModelSsmState:
    # probes -------------------------------------------------------------------------------
    def has_ssm_layers(self) -> bool:
        return getattr(self, "_states", None) is not None

    def decode_rollback_unsupported(self) -> bool:
        """True when a decode rollback cannot rewind the recurrent state: a hybrid model
        loaded without the decode-rollback ring (load option decode_rollback_ring_slots)."""
        return self.has_ssm_layers() and self._states.ring_depth == 0

    def decode_rollback_ring_slots(self) -> int:
        return self._states.ring_depth if self.has_ssm_layers() else 0

    def state_bytes_per_sequence(self) -> int:
        """Device bytes of one sequence's recurrent state (0 without recurrent layers).
        Additive."""
        return self._arena.slot_bytes if self.has_ssm_layers() else 0

    def state_pool_bytes(self) -> int:
        """Device bytes of the whole state pool: live, sink, verify, ring and prefix slots
        (0 without recurrent layers). Additive."""
        return self._arena.nbytes if self.has_ssm_layers() else 0

    def ssm_snapshot_occupancy(self) -> tuple[int, int] | None:
        """(prefix states held, prefix slots), or None without a prefix-state pool."""
        if not self.has_ssm_layers() or self._states.prefix_slots == 0:
            return None
        return self._states.occupancy()

    # verify checkpoint and rollback ---------------------------------------------------------
    def checkpoint_ssm_states(self, seq) -> None:
        if not self.has_ssm_layers():
            return None
        self._check_seq(seq)
        with self._guard:
            slot = self._states.verify_slot(0)
            self._arena.copy_slot(seq.ssm_slot, slot, self.default_stream())
            self._ssm_verify = VerifyStates(seq.seq_id, seq.seq_len, 0, 1)

    def rollback_ssm_states(self, seq, num_accepted: int) -> None:
        """The live state := the state after `num_accepted` rows of the last verify of `seq`
        (0: its checkpoint). The KV length is the caller's (`rollback`, or a Rust-style
        scheduler's own seq_len), as in the original."""
        if not self.has_ssm_layers():
            return None
        what = "rollback_ssm_states"
        self._check_seq(seq)
        n = int_arg(what, "num_accepted", num_accepted, 0)
        with self._guard:
            src = self._verify_source(seq, n, what)   # every check before any copy
            if src is not None:
                self._arena.copy_slot(src, seq.ssm_slot, self.default_stream())

    def start_checkpoint_async(self, seq) -> None:
        self.checkpoint_ssm_states(seq)

    def start_rollback_and_checkpoint_async(self, seq, num_accepted: int) -> None:
        self.rollback_ssm_states(seq, num_accepted)
        self.checkpoint_ssm_states(seq)

    def sync_secondary(self) -> None:
        return None   # every copy runs on the default stream, in order

    def commit_accepted_prefix(self, seq, num_accepted: int, k: int) -> None:
        if not self.has_ssm_layers():
            return None
        what = "commit_accepted_prefix"
        n, k = int_arg(what, "num_accepted", num_accepted, 0), int_arg(what, "k", k, 1)
        if n > k or n == 0:
            raise InvalidArgument(f"{what}: num_accepted={n} with k={k}: a commit keeps 1..k "
                                  "verify rows (more than k is an off-by-one; 0 is a "
                                  "rollback_ssm_states(seq, 0))")
        if n < k:
            self.rollback_ssm_states(seq, n)

    # the decode-rollback ring ---------------------------------------------------------------
    def save_decode_ssm_snapshot(self, seq, ring_slot: int) -> None:
        self._ring_copy(seq, ring_slot, "save_decode_ssm_snapshot", save=True)

    def restore_decode_ssm_snapshot(self, seq, ring_slot: int) -> None:
        self._ring_copy(seq, ring_slot, "restore_decode_ssm_snapshot", save=False)

    def _ring_copy(self, seq, ring_slot, what: str, save: bool) -> None:
        if not self.has_ssm_layers():
            return None   # the original's default: Ok(()), nothing to snapshot
        self._check_seq(seq)
        if self._states.ring_depth == 0:
            raise Unsupported(f"{what}: no decode-rollback ring (load option "
                              "decode_rollback_ring_slots=0)")
        r = int_arg(what, "ring_slot", ring_slot, 0, self._states.ring_depth - 1)
        with self._guard:
            ring = self._states.ring_slot(seq.ssm_slot, r)
            src, dst = (seq.ssm_slot, ring) if save else (ring, seq.ssm_slot)
            self._arena.copy_slot(src, dst, self.default_stream())
            if save:   # the position the snapshot belongs to (a later rollback's target)
                self._ring_pos[ring] = (seq.seq_id, seq.seq_len)
                return
            self._retire_verify(seq)
            owner, pos = self._ring_pos.get(ring, (None, None))
            # the live state is now the one at `pos`: `rollback` to it keeps it as it is
            self._ssm_live_at = (seq.seq_id, pos) if owner == seq.seq_id else None

    # prefix states (Marconi-style checkpoints) ----------------------------------------------
    def decode_marconi_checkpoint(self, seq) -> None:
        """At a checkpoint boundary (seq_len a multiple of `ssm_checkpoint_interval()`), keep
        the live state as the prefix state of the tokens so far and offer their blocks to the
        prefix cache; elsewhere nothing (the original's default is a no-op too)."""
        if not self.has_ssm_layers():
            return None
        self._check_seq(seq)
        n = seq.seq_len
        if n == 0 or n % self.ssm_checkpoint_interval() or seq.arena is not None or \
                self._states.prefix_slots == 0 or any(t < 0 for t in seq.tokens):
            return None
        with self._guard:
            self._keep_prefix_state(seq, seq.tokens[:n], self.default_stream())
        self.cache_sequence(seq)

    def ssm_checkpoint_interval(self) -> int:
        """Positions at which prefix states are kept: multiples of the KV block size and of
        the recurrent kernels' chunk (a prefill resumed there runs the chunks a fresh one
        runs, so a reused prefix gives the fresh prefill's bits); 0 without recurrent
        layers. Additive."""
        return self._checkpoint_interval if self.has_ssm_layers() else 0

    def _keep_prefix_state(self, seq, tokens, stream: int) -> None:
        """The live state of `seq` (after exactly `tokens`) into the prefix-state slots."""
        key = prefix_keys(tokens, self._block_size)[-1]
        slot, new = self._states.prefix_store(key)
        if new:
            self._arena.copy_slot(seq.ssm_slot, slot, stream)

    def _prefix_state_for(self, tokens, matched_blocks: int) -> tuple[int, int] | None:
        """(positions, slot) of the longest kept prefix state within the first
        `matched_blocks` blocks of `tokens`, or None."""
        bs, step = self._block_size, self._checkpoint_interval
        keys = prefix_keys(tokens, bs, matched_blocks)
        for p in range(matched_blocks * bs // step * step, 0, -step):
            slot = self._states.prefix_lookup(keys[p // bs - 1])
            if slot is not None:
                return p, slot
        return None

    # the verify record --------------------------------------------------------------------
    def _verify_source(self, seq, n: int, what: str) -> int | None:
        """The slot to restore `n` rows of the last verify of `seq` from (None: the live
        state is it), or InvalidArgument naming why there is none."""
        rec = self._ssm_verify
        if rec is None or rec.seq_id != seq.seq_id:
            who = "no verify or checkpoint" if rec is None else \
                f"the last one was of sequence {rec.seq_id}"
            raise InvalidArgument(f"{what}: sequence {seq.seq_id} has no verify states to "
                                  f"restore ({who}; one sequence's states are kept at a time "
                                  "and a later pass of it retires them). No copy was made")
        if rec.rows and n == rec.rows:
            return None   # every row accepted: the verify's final state is the live one
        if n >= rec.kept or n > rec.rows > 0:
            had = f"a verify of {rec.rows} rows" if rec.rows else "a checkpoint"
            raise InvalidArgument(f"{what}: cannot restore the state after {n} rows: sequence "
                                  f"{seq.seq_id}'s last was {had} keeping the states after "
                                  f"0..{rec.kept - 1} rows (load option ssm_verify_states). "
                                  "No copy was made")
        return self._states.verify_slot(n)

    def _retire_verify(self, seq, checkpoint_too: bool = True) -> None:
        """Forget the verify states of `seq` (its live state moved on); a checkpoint alone
        is kept unless `checkpoint_too` (it is the state at a point the caller chose)."""
        rec = self._ssm_verify
        if rec is not None and rec.seq_id == seq.seq_id and (checkpoint_too or rec.rows):
            self._ssm_verify = None
