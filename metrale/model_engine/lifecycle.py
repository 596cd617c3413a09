"""`ModelLifecycle`: the cache mixin — sequences, their blocks, the prefix cache
(`crates/model-engine/src/traits/model/lifecycle.rs`; `reserve_blocks` is additive).

The model provides `self._kv_groups` (kv_groups.py: the primary group's pool is
`self._pool`, whose counts the public methods report; a model with sliding-window and full
layers has a second, trimmed one) and `self._copy_kv_block(src, dst, stream, group)` (device
copy of one block in the group's layers, for copy-on-write). Every method that can fail
checks first and raises before changing anything: a `CacheFull` leaves every sequence and
the pools exactly as they were. Its message contains "KV cache exhausted", the text the
original's schedulers match to preempt.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple, Sequence

from ..errors import CacheFull, InvalidArgument, Unsupported
from ..kv.block_pool import EVICTED
from ..kv.prefix import prefix_keys
from .args import int_arg
from .kv_groups import cache_tables, held_from, restorable_blocks, take_prefix
from .sequence import SequenceState


class PrefixReclaim(NamedTuple):
    """What `reclaim_prefix_blocks_for` left: the free blocks wanted and the count reached."""

    target: int
    free: int


class ModelLifecycle:
    # public API (names of the original's cache mixin) ---------------------------------------
    def alloc_sequence(self) -> SequenceState:
        """A new, empty sequence (holds no blocks until tokens are written)."""
        return SequenceState(owner=id(self))

    def alloc_sequence_for(self, budget_tokens: int) -> SequenceState:
        """`alloc_sequence` for a request that can reach at most `budget_tokens` tokens. As
        in the original, the budget sizes per-sequence state only (this model has none that
        scales with it): no KV blocks are reserved — `reserve_blocks` does that."""
        int_arg("alloc_sequence_for", "budget_tokens", budget_tokens, 0)
        return self.alloc_sequence()

    def reserve_blocks(self, seq: SequenceState, n_tokens: int) -> int:
        """Promise `seq` the KV blocks for `n_tokens` more tokens, so writing them cannot
        raise CacheFull. Idempotent: a reservation that already covers them is kept. Raises
        CacheFull (nothing changed) when the pool cannot promise them. Returns the blocks
        newly reserved. Additive: the original has no such method."""
        self._check_seq(seq)
        n_tokens = int_arg("reserve_blocks", "n_tokens", n_tokens, 0)
        if seq.arena is not None:
            return 0   # a dense cache owns all its blocks already
        mores = []
        for g in self._kv_groups:
            (_, _, _, total), = self._growth_plan([(seq, n_tokens)], g)
            more = max(0, total - getattr(seq, g.reserved))
            free = g.pool.num_free()
            if more > free and more > free + g.pool.num_evictable():
                raise CacheFull(f"KV cache exhausted: reserving {more} block(s) for sequence "
                                f"{seq.seq_id} with {g.pool.num_free()} free of "
                                f"{g.pool.num_total()}{_which(g)} (block_size "
                                f"{g.pool.block_size})")
            mores.append(more)
        for g, more in zip(self._kv_groups, mores):
            g.pool.reserve(more)
            setattr(seq, g.reserved, getattr(seq, g.reserved) + more)
        return mores[0]

    def poll_innerq(self) -> None:
        """The original's per-prefill-step calibration poll. Nothing to poll: this model has
        no InnerQ calibration."""
        return None

    def reclaim_prefix_blocks_for(self, prompt: Sequence[int], adapter_slot: int,
                                  blocks_needed: int) -> PrefixReclaim:
        """Evict prefix-cache blocks until `blocks_needed` are free or nothing more is
        evictable (the original's default: no credit for the prompt's own cached prefix)."""
        free = self.num_free_blocks()
        while free < blocks_needed and self.reclaim_prefix_blocks(blocks_needed - free) > 0:
            free = self.num_free_blocks()
        return PrefixReclaim(int(blocks_needed), free)

    def high_speed_swap_dims(self):
        """Dimensions for the original's high-speed swap: None (not supported)."""
        return None

    def save_sequence_state(self, seq: SequenceState, writer) -> None:
        raise Unsupported("swap not supported by this model")

    def restore_sequence_state(self, seq: SequenceState, num_blocks: int, reader) -> None:
        raise Unsupported("swap not supported by this model")

    def compact_sequence(self, seq: SequenceState, new_slot: int) -> None:
        raise Unsupported("compact_sequence: this model has no SSM pool slots to move")

    def detach_slot_for_reuse(self, seq: SequenceState) -> None:
        """Give up the sequence's SSM pool slot: there is none, so nothing to give up."""
        return None

    def bind_gpu_to_thread(self) -> None:
        """Make the model's device current on the calling thread (CUDA); a no-op on the
        host, which has no per-thread device."""
        bind = getattr(self.backend, "bind_to_thread", None)
        if bind is not None:
            bind()

    def free_sequence(self, seq: SequenceState) -> None:
        """Return the sequence's blocks and reservation to the pool. Idempotent."""
        self._check_seq(seq, allow_freed=True)
        if seq.freed:
            return
        for g in self._kv_groups:
            if seq.arena is None:
                g.pool.release(g.pool.held(getattr(seq, g.table)))
            g.pool.unreserve(getattr(seq, g.reserved))
            setattr(seq, g.table, [])
            setattr(seq, g.reserved, 0)
        seq.tokens, seq.seq_len = [], 0
        seq.freed, seq.rope_long = True, False

    def cache_sequence(self, seq: SequenceState) -> int:
        """Offer the sequence's full blocks to the prefix cache: a later prompt starting with
        the same block-aligned tokens reuses them. Returns blocks newly cached."""
        self._check_seq(seq)
        if seq.arena is not None or any(t < 0 for t in seq.tokens):
            return 0  # dense caches and embedding-fed sequences have no token prefix to share
        keys = prefix_keys(seq.tokens, self._pool.block_size,
                           salt=self._seq_prefix_salt(seq))
        return cache_tables(self._kv_groups, seq, keys)

    def num_free_blocks(self) -> int:
        return self._pool.num_free()

    def num_total_blocks(self) -> int:
        return self._pool.num_total()

    def reclaim_prefix_blocks(self, n: int) -> int:
        """Evict up to `n` prefix-cache blocks that no sequence holds; returns how many."""
        return self._pool.reclaim(int(n))

    def fork_sequence(self, seq: SequenceState) -> SequenceState:
        """A new sequence sharing `seq`'s blocks (copy-on-write of the partial last block at
        the first write)."""
        self._check_seq(seq)
        if seq.arena is not None:
            raise InvalidArgument("fork_sequence: a contiguous-cache sequence cannot share blocks")
        for g in self._kv_groups:
            g.pool.incref(g.pool.held(getattr(seq, g.table)))
        return SequenceState(tokens=list(seq.tokens), block_table=list(seq.block_table),
                             window_table=list(seq.window_table), seq_len=seq.seq_len,
                             owner=id(self), rope_long=seq.rope_long)

    # internals used by the forward paths ----------------------------------------------------
    def _check_seq(self, seq, allow_freed: bool = False) -> None:
        if not isinstance(seq, SequenceState):
            raise InvalidArgument(f"expected a SequenceState, got {type(seq).__name__}")
        if seq.owner != id(self):
            raise InvalidArgument(f"sequence {seq.seq_id} was allocated by another model")
        if seq.freed and not allow_freed:
            raise InvalidArgument(f"sequence {seq.seq_id} was freed")

    def reuse_prefix(self, seq: SequenceState, tokens: Sequence[int]) -> int:
        """For an empty sequence, take cached blocks covering the longest block-aligned
        prefix of `tokens`, leaving at least one token to compute. Returns tokens reused
        (the sequence's new `seq_len`); `prefill` does this itself, chunked schedulers call
        it before their first `prefill_chunk`."""
        self._check_seq(seq)
        if seq.seq_len == 0:   # the prompt decides how a LongRoPE sequence rotates
            seq.rope_long = self._long_prompt(tokens)
        if seq.arena is not None or seq.seq_len != 0 or self._pool.num_cached() == 0:
            return 0
        bs = self._pool.block_size
        keys = prefix_keys(tokens, bs, (len(tokens) - 1) // bs, self._seq_prefix_salt(seq))
        n = restorable_blocks(self._kv_groups, keys, bs)
        if n:
            take_prefix(self._kv_groups, seq, keys, n)
            seq.seq_len = n * bs
            seq.tokens = list(tokens[: seq.seq_len])
        return seq.seq_len

    def _prefix_namespace(self, seq: SequenceState) -> int:
        """The adapter id `seq`'s K/V is computed under: 0, the base model's (adapters.py
        gives a LoRA sequence its adapter's id)."""
        return 0

    def _growth_plan(self, items: Sequence[tuple[SequenceState, int]], g) -> list[tuple]:
        """`(seq, need, cow, total)` for each pool-backed `(seq, n_new)` in group `g`: new
        blocks for `n_new` more tokens, whether the partial last block is shared
        (copy-on-write). A windowed group's blocks are released after each pass (at most
        `max_tokens` tokens), so it needs at most one pass's new blocks at once."""
        bs = g.pool.block_size
        plans = []
        for seq, n_new in items:
            if seq.arena is not None:
                continue  # a dense cache owns all its blocks already
            table = getattr(seq, g.table)
            have = len(table)
            need = max(0, -(-(seq.seq_len + n_new) // bs) - have)
            last = table[seq.seq_len // bs] if have > seq.seq_len // bs else EVICTED
            cow = (seq.seq_len % bs != 0 and have > 0 and last != EVICTED
                   and g.pool.refcount(last) > 1)
            if g.window:   # trimmed after every pass: one pass's new blocks at a time
                need = min(need, -(-min(n_new, self._ws.max_tokens) // bs) + 1)
            plans.append((seq, need, cow, need + int(cow)))
        return plans

    def _check_room(self, items: Sequence[tuple[SequenceState, int]]) -> list[list]:
        """Each group's growth plan of `items`, or CacheFull if a pool cannot hold it."""
        out = []
        for g in self._kv_groups:
            plans = self._growth_plan(items, g)
            fresh = sum(max(0, total - getattr(seq, g.reserved))
                        for seq, _, _, total in plans)
            free = g.pool.num_free()
            if fresh > free and fresh > free + g.pool.num_evictable():
                raise CacheFull(f"KV cache exhausted: this step needs {fresh} new block(s), "
                                f"{g.pool.num_free()} free of {g.pool.num_total()}{_which(g)} "
                                f"(block_size {g.pool.block_size})")
            out.append(plans)
        return out

    def _reserve_for_writes(self, items: Sequence[tuple[SequenceState, int]], stream: int) -> None:
        """Give each `(seq, n_new)` the blocks for `n_new` more tokens, all or nothing.

        Copy-on-write: a shared block that the write will touch is replaced by a private
        copy first. Raises CacheFull before changing anything if the pool is short.
        """
        bs = self._pool.block_size
        for gi, (g, plans) in enumerate(zip(self._kv_groups, self._check_room(items))):
            for seq, need, cow, total in plans:
                if total == 0:
                    continue
                used = min(total, getattr(seq, g.reserved))
                new = g.pool.allocate(total, reserved=used)
                setattr(seq, g.reserved, getattr(seq, g.reserved) - used)
                table = getattr(seq, g.table)
                if cow:
                    idx = seq.seq_len // bs
                    old, copy = table[idx], new.pop()
                    self._copy_kv_block(old, copy, stream, gi)
                    g.pool.release([old])
                    table[idx] = copy
                table.extend(new)

    @contextmanager
    def _growth_guard(self, seqs: Sequence[SequenceState]):
        """Undo a pass's block growth if it raises (an interrupt, a kernel error): each
        sequence goes back to exactly ceil(seq_len / block_size) blocks and its
        reservation, so the pool's accounting stays exact and the sequence usable."""
        saved = [(s, [getattr(s, g.reserved) for g in self._kv_groups]) for s in seqs]
        try:
            yield
        except BaseException:
            for seq, reserved in saved:
                if seq.arena is not None or seq.freed:
                    continue
                keep = -(-seq.seq_len // self._pool.block_size)
                for g, r in zip(self._kv_groups, reserved):
                    table = getattr(seq, g.table)
                    g.pool.release(g.pool.held(table[keep:]))
                    del table[keep:]
                    if r > getattr(seq, g.reserved):
                        g.pool.reserve(r - getattr(seq, g.reserved))
                        setattr(seq, g.reserved, r)
            raise

    def _long_prompt(self, tokens) -> bool:
        """Whether a sequence with this prompt rotates every position with LongRoPE's long
        factors: its prompt is longer than original_max_position_embeddings (as one
        transformers generate call decides; formats/phi3_config.py)."""
        rs = self._meta.rope_scaling
        return rs is not None and rs.rope_type == "longrope" and \
            len(tokens) > rs.original_max_position_embeddings

    @staticmethod
    def _prefix_salt(rope_long: bool, adapter_id: int = 0) -> bytes:
        """The prefix-cache key chain's start: K/V that differ for the same tokens cache apart
        (a LoRA adapter's id, adapters.py; long-rope sequences); b"" for the base model."""
        return (int(adapter_id).to_bytes(8, "little") if adapter_id else b"") + \
            (b"longrope" if rope_long else b"")

    def _seq_prefix_salt(self, seq: SequenceState) -> bytes:
        return self._prefix_salt(seq.rope_long, self._prefix_namespace(seq))

    def _truncate(self, seq: SequenceState, new_len: int) -> None:
        """Drop cached positions >= new_len and the blocks no longer needed."""
        if not 0 <= new_len <= seq.seq_len:
            raise InvalidArgument(f"rollback to {new_len} tokens: sequence {seq.seq_id} has "
                                  f"{seq.seq_len}")
        low = held_from(self._kv_groups, seq)
        if 0 < new_len < low:
            raise InvalidArgument(f"rollback to {new_len} tokens: sequence {seq.seq_id}'s "
                                  "sliding-window layers released the blocks a query at "
                                  f"{new_len} reads (kept from position {low} on)")
        if seq.arena is None:
            keep = -(-new_len // self._pool.block_size)
            for g in self._kv_groups:
                table = getattr(seq, g.table)
                g.pool.release(g.pool.held(table[keep:]))
                del table[keep:]
        del seq.tokens[new_len:]
        seq.seq_len = new_len
        if new_len == 0:
            seq.rope_long = False


def _which(g) -> str:
    """Names the sliding-window layers' pool (a windowed group beside a full one)."""
    return " in the sliding-window layers' pool" if g.table == "window_table" else ""
