"""`ModelAdapters`: LoRA adapters over the slots of lora_pool.py, with the original engine's
methods and meanings (`crates/model-engine/src/traits/model/adapters.rs`, the slot pool of
`model-layers/src/lora/`):

  adapter_id_for(slot)       the prefix-cache id of a slot selector: >= 0 that slot, -1 the
                             active adapter; FNV-1a of the name (and the slot's generation
                             when not 0), never 0; 0 (the base model) for an empty slot, an
                             out-of-range one or no active adapter
  acquire_adapter_slot(slot) one more in-flight sequence on the resolved slot (-1: active),
                             stamped most recently used; returns the resolved slot, or -1
                             (nothing taken) when out of range or nothing is active
  release_adapter_slot(r)    undoes an acquire by the slot it returned; -1 is a no-op, the
                             count never goes below 0
  set_active_lora(name)      the resident adapter `name` becomes the one -1 selects
  swap_lora_from_disk(dir, name, slot)
                             the PEFT adapter at `dir` into `slot` in place (refused while
                             the slot has in-flight sequences); the slot's generation is bumped
  promote_lora_from_disk(dir, name) -> (slot, evicted name or None)
                             into a cache slot (not one loaded at start-up): the first empty
                             one, else the least recently used idle one, else AdapterPoolFull
                             (retry later); then active and most recently used
  promote_lora_from_peer     refused by name: no peer transport here
A sequence selects its adapter by `SequenceState.adapter_slot` (`alloc_sequence(adapter=
name | slot)`; -1 the active one) and is bound to it at its first forward pass
(lora_binding.py): prefixes are shared only within one adapter id.
Differences (additive, README's method table): no adapter is active until one is made
active (-1 then means the base model), and rotation needs no armed mode nor eager decode:
the decode graphs read the slots and the rows' slots from device memory, so a swap or a
rotation never recaptures them. `unload_lora`, `lora_slots`, `lora_slot_of` are additive.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import AdapterPoolFull, InvalidArgument, Unsupported
from ..formats.lora import LoraAdapter, read_adapter
from .guard import exclusive
from .lora_binding import BASE_ADAPTER_ID, AdapterBinding
from .lora_pool import LoraSlot


def adapter_id_hash(name: str, generation: int) -> int:
    """The cache id of adapter `name` at slot generation `generation`: 64-bit FNV-1a over the
    name's UTF-8 bytes, then over the generation's 8 little-endian bytes when it is not 0;
    never 0 (the base model's id)."""
    h = 0xcbf29ce484222325
    data = name.encode() + (int(generation).to_bytes(8, "little") if generation else b"")
    for byte in data:
        h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h or 1


@dataclass(frozen=True)
class LoraSlotInfo:
    """One slot as `lora_slots()` reports it."""

    slot: int
    name: str | None          # None: empty
    path: str | None
    rank: int
    modules: tuple[str, ...]
    generation: int
    in_flight: int
    pinned: bool
    active: bool
    nbytes: int               # device bytes the slot reserves


class ModelAdapters(AdapterBinding):
    """LoRA slots of a TransformerModel (`self._lora`: an AdapterPool, or None); the
    sequences' binding is lora_binding.py's."""

    _lora = None
    _active_lora: int | None = None

    # the original's methods ----------------------------------------------------------
    def adapter_id_for(self, slot: int) -> int:
        s = self._resolve(slot)
        if s < 0 or not self._lora.slots[s].name:
            return BASE_ADAPTER_ID
        return adapter_id_hash(self._lora.slots[s].name, self._lora.slots[s].generation)

    def acquire_adapter_slot(self, slot: int) -> int:
        s = self._resolve(slot)
        if s < 0:
            return -1
        st = self._lora.slots[s]
        st.refs += 1
        self._touch(s)
        return s

    def release_adapter_slot(self, resolved: int) -> None:
        if self._lora is None or not isinstance(resolved, int) or \
                not 0 <= resolved < self._lora.n_slots:
            return
        st = self._lora.slots[resolved]
        st.refs = max(0, st.refs - 1)

    @exclusive
    def set_active_lora(self, name) -> None:
        """Make the resident adapter `name` the one `adapter_slot == -1` selects (None: none,
        the base model; additive)."""
        self._pool_or_refuse("set_active_lora")
        if name is None:
            self._active_lora = None
            return
        self._active_lora = self._slot_named(name, "set_active_lora")

    @exclusive
    def swap_lora_from_disk(self, directory, name: str, slot: int) -> None:
        """Load the PEFT adapter at `directory` into `slot` under `name` (start-up and cache
        slots alike). Call it where no forward pass of this model is in flight (on a
        tensor-parallel model every rank calls it alike and loads its slice)."""
        self._load_slot(directory, name, slot, "swap_lora_from_disk")

    @exclusive
    def promote_lora_from_disk(self, adapter_dir, name: str):
        """Load the adapter into a cache slot and make it active; (slot, evicted name)."""
        pool = self._pool_or_refuse("promote_lora_from_disk")
        cache = [i for i, s in enumerate(pool.slots) if not s.pinned]
        empty = [i for i in cache if not pool.slots[i].name]
        idle = sorted((pool.slots[i].last_used, i) for i in cache if pool.slots[i].refs == 0)
        if empty:
            slot = empty[0]
        elif idle:
            slot = idle[0][1]
        else:
            raise AdapterPoolFull(f"promote_lora_from_disk: all {len(cache)} cache slot(s) "
                                  "have in-flight sequences; retry when one is released")
        evicted = pool.slots[slot].name or None
        self._load_slot(adapter_dir, name, slot, "promote_lora_from_disk")
        self._active_lora = slot
        self._touch(slot)
        return slot, evicted

    def promote_lora_from_peer(self, peer_addr: str, adapter_id: str, name: str, peft):
        """Refused by name: the original stages the adapter over RDMA from a peer server.
        Without a communicator there is no transport at all; a tensor-parallel rank's
        communicator joins only this model's own ranks, which load adapters from disk
        together (SPMD), so no peer holding a staged adapter is reachable either."""
        why = ("its tensor-parallel communicator joins only this model's ranks, which load "
               "adapters from disk together" if self._tp is not None else
               "it has no communicator")
        raise Unsupported(f"promote_lora_from_peer({peer_addr!r}, {adapter_id!r}): no peer "
                          f"can be reached ({why}); load it with promote_lora_from_disk or "
                          "swap_lora_from_disk")

    # additive ------------------------------------------------------------------------
    @exclusive
    def unload_lora(self, name: str) -> int:
        """Empty the slot holding `name` (refused while it has in-flight sequences); its
        rows compute the base model again. Returns the slot."""
        pool = self._pool_or_refuse("unload_lora")
        slot = self._slot_named(name, "unload_lora")
        self._check_idle(slot, "unload_lora")
        pool.write_slot(slot, None, self.default_stream())
        pool.slots[slot] = LoraSlot(generation=pool.slots[slot].generation,
                                    pinned=pool.slots[slot].pinned)
        if self._active_lora == slot:
            self._active_lora = None
        return slot

    def lora_slot_of(self, name: str) -> int | None:
        """The slot holding adapter `name`, or None."""
        if self._lora is None:
            return None
        for i, s in enumerate(self._lora.slots):
            if s.name and s.name == name:
                return i
        return None

    def lora_slots(self) -> list[LoraSlotInfo]:
        """Every slot: what it holds, its in-flight sequences and its bytes."""
        if self._lora is None:
            return []
        per = self._lora.slot_bytes()
        return [LoraSlotInfo(i, s.name or None, s.path or None, s.rank, s.kinds, s.generation,
                             s.refs, s.pinned, i == self._active_lora, per)
                for i, s in enumerate(self._lora.slots)]

    # internals -----------------------------------------------------------------------
    def _resolve(self, slot) -> int:
        """A selector as the original resolves it: >= 0 that slot if in range, < 0 the
        active one; -1 when there is none."""
        if self._lora is None or isinstance(slot, bool) or not isinstance(slot, int):
            return -1
        if slot < 0:
            return -1 if self._active_lora is None else self._active_lora
        return slot if slot < self._lora.n_slots else -1

    def _touch(self, slot: int) -> None:
        self._lora.tick += 1
        self._lora.slots[slot].last_used = self._lora.tick

    def _pool_or_refuse(self, what: str):
        if self._lora is None:
            raise Unsupported(f"{what}: this model has no LoRA slots (load it with "
                              "max_loras=N, max_lora_rank=R)")
        return self._lora

    def _resident(self) -> str:
        names = [s.name for s in self._lora.slots if s.name] if self._lora else []
        return f"resident: {', '.join(names)}" if names else "no adapter is resident"

    def _slot_named(self, name, what: str) -> int:
        self._pool_or_refuse(what)
        slot = self.lora_slot_of(name) if isinstance(name, str) else None
        if slot is None:
            raise InvalidArgument(f"{what}: adapter {name!r} is not resident "
                                  f"({self._resident()})")
        return slot

    def _check_idle(self, slot: int, what: str) -> None:
        refs = self._lora.slots[slot].refs
        if refs:
            raise InvalidArgument(f"{what}: slot {slot} has {refs} in-flight sequence(s); "
                                  "an adapter cannot be replaced under them")

    def _load_slot(self, directory, name, slot, what: str, startup: bool = False) -> None:
        """`directory`'s adapter into `slot` as `name`; a start-up load (the `loras` load
        option) pins the slot against promotion and keeps generation 0, as the original's
        start-up adapters."""
        pool = self._pool_or_refuse(what)
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{what}: name must be a non-empty string, got {name!r}")
        if isinstance(slot, bool) or not isinstance(slot, int) or \
                not 0 <= slot < pool.n_slots:
            raise InvalidArgument(f"{what}: slot {slot!r} is outside [0, max_loras="
                                  f"{pool.n_slots})")
        other = self.lora_slot_of(name)
        if other is not None and other != slot:
            raise InvalidArgument(f"{what}: adapter {name!r} is already resident in slot "
                                  f"{other}")
        self._check_idle(slot, what)
        adapter = directory if isinstance(directory, LoraAdapter) else \
            read_adapter(Path(directory), self._meta, max_rank=pool.max_rank)
        pool.write_slot(slot, adapter, self.default_stream())
        old = pool.slots[slot]
        pool.slots[slot] = LoraSlot(name=name, path=adapter.path, rank=adapter.max_rank,
                                    kinds=tuple(adapter.kinds()),
                                    generation=0 if startup else
                                    (old.generation + 1) & 0xFFFFFFFFFFFFFFFF,
                                    last_used=old.last_used, pinned=old.pinned or startup)
