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
    `arena` keeps its K/V in that dense buffer (identity block table) instead of the pool."""

    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    seq_len: int = 0
    reserved_blocks: int = 0
    seq_id: int = field(default_factory=lambda: next(_ids))
    owner: int = 0
    freed: bool = False
    # a ContiguousArena for the dense baseline cache; None for pool-backed sequences
    arena: object | None = None
    # a hybrid model's recurrent-state slot (kv/state_pool.py); -1: none
    ssm_slot: int = -1
