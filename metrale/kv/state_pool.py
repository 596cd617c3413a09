"""The recurrent-state pool of hybrid models (gated DeltaNet, Mamba2): fixed-size slots, one
per live sequence, beside the paged KV block pool.

A slot holds one sequence's whole recurrent state: for every linear-attention / Mamba layer
its FP32 state and its BF16 conv window (the bytes live in the model's device arena,
model_engine/state_arena.py; this module is bookkeeping on the host, like BlockPool). Slot
indices, in the order the arena lays them out:

    [0, seq_slots)              live slots: `alloc` hands one to each sequence, `free` takes
                                it back (lowest index first)
    sink                        written by the padding rows of a graphed decode, never read
    verify slots (verify_slots) the states inside the last verify: slot j holds the state
                                after j of its rows (ModelSsmState's intermediates)
    ring slots                  decode-rollback snapshots, `ring_depth` per live slot
    prefix slots                states at block boundaries kept for prefix reuse, keyed by
                                the prefix's chain digest (kv/prefix.py), evicted least
                                recently used first (nothing holds them: a reuse copies one)

Every operation that cannot complete raises before changing anything; a full pool raises
`CacheFull` naming the pool and the load option that sizes it, never overwrites a slot.
"""
from __future__ import annotations

from collections import OrderedDict

from ..errors import CacheFull, InvalidArgument


class StatePool:
    """`seq_slots` live slots of `slot_bytes` device bytes each, plus the sink, the verify,
    ring and prefix slots (module docstring)."""

    def __init__(self, seq_slots: int, slot_bytes: int, *, verify_slots: int = 0,
                 ring_depth: int = 0, prefix_slots: int = 0) -> None:
        for name, v, lo in (("seq_slots", seq_slots, 1), ("slot_bytes", slot_bytes, 1),
                            ("verify_slots", verify_slots, 0), ("ring_depth", ring_depth, 0),
                            ("prefix_slots", prefix_slots, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidArgument(f"StatePool: {name} must be an int >= {lo}, got {v!r}")
        self.seq_slots, self.slot_bytes = seq_slots, slot_bytes
        self.verify_slots, self.ring_depth = verify_slots, ring_depth
        self.prefix_slots = prefix_slots
        self.sink = seq_slots
        self._verify0 = seq_slots + 1
        self._ring0 = self._verify0 + verify_slots
        self._prefix0 = self._ring0 + seq_slots * ring_depth
        self.total_slots = self._prefix0 + prefix_slots
        self._free = list(range(seq_slots - 1, -1, -1))   # pop() -> lowest slot first
        self._held = [False] * seq_slots
        self._prefix: OrderedDict[bytes, int] = OrderedDict()   # key -> slot, LRU first
        self._prefix_free = list(range(self.total_slots - 1, self._prefix0 - 1, -1))

    # live slots ---------------------------------------------------------------------------
    def alloc(self) -> int:
        """A free live slot (CacheFull when every one is held)."""
        if not self._free:
            raise CacheFull(f"recurrent state pool exhausted: all {self.seq_slots} sequence "
                            f"slots are held ({self.slot_bytes} bytes each; load option "
                            "max_sequences sizes the pool); free a sequence first")
        slot = self._free.pop()
        self._held[slot] = True
        return slot

    def free(self, slot: int) -> None:
        """Return a live slot; InvalidArgument (nothing changed) for one not held."""
        if not (isinstance(slot, int) and 0 <= slot < self.seq_slots and self._held[slot]):
            raise InvalidArgument(f"StatePool.free: slot {slot!r} is not a held sequence slot")
        self._held[slot] = False
        self._free.append(slot)
        self._free.sort(reverse=True)   # lowest first again, whatever the order of frees

    def num_free(self) -> int:
        return len(self._free)

    def held(self, slot: int) -> bool:
        return 0 <= slot < self.seq_slots and self._held[slot]

    # verify and ring slots --------------------------------------------------------------
    def verify_slot(self, j: int) -> int:
        """The slot holding the state after `j` rows of the last verify, j < verify_slots."""
        if not 0 <= j < self.verify_slots:
            raise InvalidArgument(f"StatePool: verify state {j} outside the pool's "
                                  f"{self.verify_slots} (load option ssm_verify_states)")
        return self._verify0 + j

    def ring_slot(self, seq_slot: int, ring_slot: int) -> int:
        """Snapshot `ring_slot` of live slot `seq_slot` (decode-rollback ring)."""
        if not self.held(seq_slot):
            raise InvalidArgument(f"StatePool: slot {seq_slot} is not a held sequence slot")
        if not 0 <= ring_slot < self.ring_depth:
            raise InvalidArgument(f"ring_slot {ring_slot} outside [0, {self.ring_depth}) "
                                  "(decode_rollback_ring_slots(); load option "
                                  "decode_rollback_ring_slots)")
        return self._ring0 + seq_slot * self.ring_depth + ring_slot

    # prefix states ------------------------------------------------------------------------
    def prefix_lookup(self, key: bytes) -> int | None:
        """The slot holding the state after the prefix `key`, or None (marks it used)."""
        slot = self._prefix.get(key)
        if slot is not None:
            self._prefix.move_to_end(key)
        return slot

    def prefix_store(self, key: bytes) -> tuple[int, bool]:
        """(slot, new): the slot to hold the state after prefix `key`; a key already held
        keeps its slot (new False: its state is the same); else a free prefix slot or the
        least recently used one's. CacheFull when the pool has no prefix slots."""
        if key in self._prefix:
            self._prefix.move_to_end(key)
            return self._prefix[key], False
        if not self.prefix_slots:
            raise CacheFull("recurrent state pool has no prefix slots (load option "
                            "ssm_prefix_states=0): prefix states cannot be kept")
        if self._prefix_free:
            slot = self._prefix_free.pop()
        else:
            _, slot = self._prefix.popitem(last=False)
        self._prefix[key] = slot
        return slot, True

    def prefix_keys(self) -> list[bytes]:
        """The keys held, least recently used first."""
        return list(self._prefix)

    def occupancy(self) -> tuple[int, int]:
        """(prefix states held, prefix slots)."""
        return len(self._prefix), self.prefix_slots

    def nbytes(self) -> int:
        """Device bytes of every slot of the pool."""
        return self.total_slots * self.slot_bytes
