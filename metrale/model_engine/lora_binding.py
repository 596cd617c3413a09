"""How a sequence gets its LoRA adapter (the binding half of adapters.py's `ModelAdapters`):
`alloc_sequence(adapter=...)` records the selector (`SequenceState.adapter_slot`: a slot, or
-1 for the active adapter); the first forward pass or prefix lookup binds it, acquiring the
resolved slot unless the caller already did (`acquired_adapter_slot`, the original's
scheduler convention) and fixing the adapter id its K/V is computed under (`adapter_id`);
`free_sequence` releases the slot, `fork_sequence` takes one more reference. A pass asks for
its rows' slots (`_lora_row_slots`) and the tiles of its LoRA launches (`_lora_step`).
Every check is made for all of a pass's sequences before any of them is bound.
"""
from __future__ import annotations

from ..errors import InvalidArgument
from .lora_step import LoraStep
from .sequence import SequenceState

BASE_ADAPTER_ID = 0


class AdapterBinding:
    """Overrides of the cache mixin's sequence calls; see the module docstring."""

    def _adapter_selector(self, adapter) -> int:
        """alloc_sequence's `adapter`: None (-1, the active adapter), a resident name or a
        filled slot index."""
        if adapter is None:
            return -1
        if isinstance(adapter, str):
            return self._slot_named(adapter, "alloc_sequence")
        if isinstance(adapter, bool) or not isinstance(adapter, int):
            raise InvalidArgument(f"alloc_sequence: adapter must be a name, a slot or None, "
                                  f"got {adapter!r}")
        pool = self._pool_or_refuse("alloc_sequence(adapter=...)")
        if not 0 <= adapter < pool.n_slots or not pool.slots[adapter].name:
            raise InvalidArgument(f"alloc_sequence: adapter slot {adapter} holds no adapter "
                                  f"({self._resident()})")
        return adapter

    def _bind_adapters(self, seqs) -> list[int]:
        """Each sequence's slot for a pass (-1: none), binding unbound ones; checked for all
        before any is bound."""
        todo = []
        for seq in seqs:
            if seq.adapter_id is not None:
                continue
            s = seq.acquired_adapter_slot if seq.acquired_adapter_slot >= 0 else \
                self._resolve(seq.adapter_slot)
            if s >= 0 and not self._lora.slots[s].name:
                raise InvalidArgument(f"sequence {seq.seq_id}: adapter slot {s} holds no "
                                      f"adapter ({self._resident()})")
            if seq.adapter_slot >= 0 and s < 0:
                raise InvalidArgument(f"sequence {seq.seq_id}: adapter slot "
                                      f"{seq.adapter_slot} does not exist")
            todo.append((seq, s))
        for seq, s in todo:
            if s >= 0 and seq.acquired_adapter_slot < 0:
                seq.acquired_adapter_slot = self.acquire_adapter_slot(s)
            seq.adapter_id = self.adapter_id_for(s) if s >= 0 else BASE_ADAPTER_ID
        return [seq.acquired_adapter_slot if seq.adapter_id else -1 for seq in seqs]

    def _prefix_namespace(self, seq: SequenceState) -> int:
        if self._lora is None:
            return BASE_ADAPTER_ID
        self._bind_adapters([seq])
        return seq.adapter_id

    def _unbind_adapter(self, seq: SequenceState) -> None:
        self.release_adapter_slot(seq.acquired_adapter_slot)
        seq.acquired_adapter_slot = -1
        seq.adapter_id = None

    # the cache mixin's calls, with the adapter binding ---------------------------------
    def alloc_sequence(self, adapter=None) -> SequenceState:
        """A new, empty sequence; `adapter` (additive): the LoRA adapter it runs, a resident
        name or a filled slot index (None: the active adapter, else the base model)."""
        slot = self._adapter_selector(adapter)
        seq = super().alloc_sequence()
        seq.adapter_slot = slot
        return seq

    def alloc_sequence_for(self, budget_tokens: int, adapter=None) -> SequenceState:
        slot = self._adapter_selector(adapter)
        seq = super().alloc_sequence_for(budget_tokens)
        seq.adapter_slot = slot
        return seq

    def free_sequence(self, seq: SequenceState) -> None:
        """Also releases the adapter slot the sequence holds (once)."""
        self._check_seq(seq, allow_freed=True)
        was_freed = seq.freed
        super().free_sequence(seq)
        if not was_freed:
            self._unbind_adapter(seq)

    def fork_sequence(self, seq: SequenceState) -> SequenceState:
        """The fork runs the same adapter (a reference of its own on the slot)."""
        child = super().fork_sequence(seq)
        child.adapter_slot, child.adapter_id = seq.adapter_slot, seq.adapter_id
        if seq.acquired_adapter_slot >= 0:
            child.acquired_adapter_slot = self.acquire_adapter_slot(seq.acquired_adapter_slot)
        return child

    # the forward passes' calls --------------------------------------------------------
    def _lora_row_slots(self, seqs, counts) -> list[int] | None:
        """The slot of every row of a pass (`counts[i]` rows of `seqs[i]`), binding the
        sequences first; None without LoRA slots."""
        if self._lora is None:
            return None
        slots = self._bind_adapters(seqs)
        return [s for s, c in zip(slots, counts) for _ in range(c)]

    def _lora_step(self, row_slots, stream: int, decode: bool, graph_rows=None):
        """The pass's LoraStep (tiles uploaded on `stream`), or None: no row adapted."""
        if row_slots is None:
            return None
        return LoraStep.plan(self._lora, row_slots, stream, graph_rows, decode, self._tp)
