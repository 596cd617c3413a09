"""The paged KV block pool: a free-block stack, reference counts, reservations, prefix cache.

Pure bookkeeping on the host; the blocks' bytes live in the model's KV buffers. Invariants
(tests/kv/test_block_pool.py): every block is either free (refcount 0, on the stack) or held
(refcount >= 1); `num_free() + held == num_total()`; an operation that cannot complete raises
`CacheFull` before changing anything.

The prefix cache is a forest: a cached block-aligned prefix's parent is the prefix one block
shorter. Eviction takes least-recently-used LEAVES first, as the original's prefix cache does
(`PrefixCache::evict`, used by `model/prefix_reclaim.rs`), so a chain is shortened from its
end and its head stays reusable; evicting a head first would orphan every longer prefix
below it (a lookup walks from the head), holding blocks that no prompt can reuse.

Sliding-window layers (DESIGN §6: their blocks are released by the block pool): a pool that
serves such layers trims a sequence's table with `trim_window`, releasing every block wholly
before the window of the sequence's next query; the table keeps its logical length with
`EVICTED` (-1) in the released entries, which no kernel reads (attention reads a window
layer's keys from the window start on).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

from ..errors import CacheFull, InvalidArgument

EVICTED = -1   # a block-table entry whose block a sliding window released


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens. The free stack hands out block 0 first."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise InvalidArgument(f"BlockPool needs num_blocks >= 1 and block_size >= 1, got "
                                  f"{num_blocks}, {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() -> lowest id first
        self._ref = [0] * self.num_blocks
        self._reserved = 0  # blocks promised to sequences but not yet taken from the stack
        # prefix cache: chain digest of a block-aligned prefix (kv/prefix.py) -> block id, in LRU order. The
        # cache holds one reference on each of its blocks.
        self._prefix: OrderedDict[bytes, int] = OrderedDict()
        self._prefix_of_block: dict[int, bytes] = {}
        self._parent: dict[bytes, bytes | None] = {}   # cached key -> its cached parent key
        self._children: dict[bytes, int] = {}          # cached key -> cached children

    # queries --------------------------------------------------------------------------
    def num_total(self) -> int:
        return self.num_blocks

    def num_free(self) -> int:
        """Blocks that a new allocation can take now (excludes reservations)."""
        return len(self._free) - self._reserved

    def num_cached(self) -> int:
        return len(self._prefix)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    # allocation -----------------------------------------------------------------------
    def allocate(self, n: int, reserved: int = 0) -> list[int]:
        """Take `n` blocks (refcount 1), first from the caller's reservation of `reserved`."""
        if n < 0:
            raise InvalidArgument(f"allocate: n must be >= 0, got {n}")
        from_reservation = min(n, reserved)
        fresh = n - from_reservation
        if fresh > self.num_free():
            evictable = self.num_evictable()
            if fresh > self.num_free() + evictable:
                raise CacheFull(f"KV cache exhausted: need {fresh} more block(s), "
                                f"{self.num_free()} free of {self.num_blocks} "
                                f"(block_size {self.block_size}, {evictable} evictable "
                                f"prefix-cache blocks)")
            self.reclaim(fresh - self.num_free())
        self._reserved -= from_reservation
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def reserve(self, n: int) -> None:
        """Promise `n` blocks to one caller; they leave `num_free()` until used or returned."""
        if n > self.num_free():
            evictable = self.num_evictable()
            if n > self.num_free() + evictable:
                raise CacheFull(f"KV cache exhausted: cannot reserve {n} block(s), "
                                f"{self.num_free()} free of {self.num_blocks}")
            self.reclaim(n - self.num_free())
        self._reserved += n

    def unreserve(self, n: int) -> None:
        if not 0 <= n <= self._reserved:
            raise InvalidArgument(f"unreserve({n}) with {self._reserved} reserved")
        self._reserved -= n

    def incref(self, blocks) -> None:
        for b in blocks:
            if self._ref[b] < 1:
                raise InvalidArgument(f"incref of free block {b}")
        for b in blocks:
            self._ref[b] += 1

    def release(self, blocks) -> None:
        """Drop one reference on each block; blocks reaching 0 go back on the free stack."""
        for b in blocks:
            if self._ref[b] < 1:
                raise InvalidArgument(f"release of free block {b}")
        # Released in reverse so that a table [a, b, c] freed whole comes back as a, b, c.
        for b in reversed(list(blocks)):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def trim_window(self, table: list[int], next_pos: int, window: int) -> int:
        """Release the blocks of `table` (a sequence's logical blocks) that hold only
        positions before the window of a query at `next_pos` (keys > next_pos - window);
        their entries become EVICTED. Returns how many were released."""
        first_needed = max(0, int(next_pos) - int(window) + 1) // self.block_size
        gone = [b for b in table[:first_needed] if b != EVICTED]
        if not gone:
            return 0
        self.release(gone)
        for i in range(first_needed):
            table[i] = EVICTED
        return len(gone)

    @staticmethod
    def held(table: list[int]) -> list[int]:
        """The blocks a table holds (its EVICTED entries left out)."""
        return [b for b in table if b != EVICTED]

    # prefix cache ---------------------------------------------------------------------
    def cache_prefix(self, key: bytes, block: int, parent: bytes | None = None) -> bool:
        """Register `block` as holding the prefix with chain hash `key` (cache takes a ref).
        `parent`: the key of the prefix one block shorter (None for a first block); it makes
        `key` a child that `reclaim` evicts before its parent."""
        if key in self._prefix:
            self._prefix.move_to_end(key)
            return False
        if block in self._prefix_of_block:
            return False
        self._ref[block] += 1
        self._prefix[key] = block
        self._prefix_of_block[block] = key
        parent = parent if parent in self._prefix else None
        self._parent[key] = parent
        self._children[key] = 0
        if parent is not None:
            self._children[parent] += 1
        return True

    def lookup_prefix(self, key: bytes) -> int | None:
        b = self._prefix.get(key)
        if b is not None:
            self._prefix.move_to_end(key)
        return b

    def peek_prefix(self, key: bytes) -> int | None:
        """The block cached under `key`, without touching the LRU order."""
        return self._prefix.get(key)

    def num_evictable(self) -> int:
        """Cached blocks that repeated leaf eviction can free: held only by the cache, with
        no descendant that a sequence holds."""
        blocked: set[bytes] = set()
        for key, b in self._prefix.items():
            if self._ref[b] > 1:
                k = key
                while k is not None and k not in blocked:
                    blocked.add(k)
                    k = self._parent[k]
        return len(self._prefix) - len(blocked)

    def reclaim(self, n: int) -> int:
        """Evict up to `n` prefix blocks no sequence holds, least recently used leaf first
        (a parent becomes a leaf once its last cached child is gone); returns the count."""
        rank = {key: i for i, key in enumerate(self._prefix)}   # LRU order, oldest first
        leaves = [(rank[k], k) for k, b in self._prefix.items()
                  if self._children[k] == 0 and self._ref[b] == 1]
        heapq.heapify(leaves)
        freed = 0
        while freed < n and leaves:
            _, key = heapq.heappop(leaves)
            b = self._prefix.pop(key)
            del self._prefix_of_block[b]
            del self._children[key]
            parent = self._parent.pop(key)
            self.release([b])
            freed += 1
            if parent is not None:
                self._children[parent] -= 1
                if self._children[parent] == 0 and self._ref[self._prefix[parent]] == 1:
                    heapq.heappush(leaves, (rank[parent], parent))
        return freed
