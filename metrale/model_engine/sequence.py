"""`SequenceState`: one sequence's tokens and its blocks in the paged KV pool."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

_ids = itertools.count(1)


@dataclass
class SequenceState:
    """tokens: every token whose K/V is in the cache, in order (len == seq_len);
    block_table: physical block ids in logical order (exactly ceil(seq_len / block_size));
    seq_len: tokens cached. `reserved_blocks` were promised by `alloc_sequence_for` and not
    yet used. A sequence belongs to the model that allocated it (`owner`). A sequence with an
    `arena` keeps its K/V in that dense buffer (identity block table) instead of the pool.
    `adapter_slot`, `acquired_adapter_slot`, `adapter_id`: its LoRA adapter (adapters.py).
    `window_table` / `window_reserved`: the same for the sliding-window layers of a model that
    has both kinds (kv_groups.py), EVICTED (-1) where the window released a block."""

    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    seq_len: int = 0
    reserved_blocks: int = 0
    window_table: list[int] = field(default_factory=list)
    window_reserved: int = 0
    seq_id: int = field(default_factory=lambda: next(_ids))
    owner: int = 0
    freed: bool = False
    # a ContiguousArena for the dense baseline cache; None for pool-backed sequences
    arena: object | None = None
    # LoRA (model_engine/adapters.py), the original's fields: the adapter slot this
    # sequence selects (-1: the active adapter) and the slot it holds a reference on (-1:
    # none), released by free_sequence; and the adapter id its K/V is computed under (None
    # until its first forward pass binds it; 0: the base model)
    adapter_slot: int = -1
    acquired_adapter_slot: int = -1
    adapter_id: int | None = None
    # LongRoPE: every position rotates with the long factors (its prompt was longer than
    # original_max_position_embeddings; formats/phi3_config.py)
    rope_long: bool = False
    # a hybrid model's recurrent-state slot (kv/state_pool.py); -1: none
    ssm_slot: int = -1
    # the draft proposer's state for this sequence (the original's field; mtp.MtpState)
    proposer_state: object | None = None
