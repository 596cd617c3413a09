"""`TransformerModel.reclaim_prefix_blocks_for`: make room for a prompt's prefill without
evicting the cached prefix that prefill is about to reuse.

Port of the original's override (`model/prefix_reclaim.rs`, `reclaim_for_prompt`):
`blocks_needed` counts the whole prompt (the caller's headroom included); the blocks of the
prompt's cached prefix that the prefill's lookup reuses are subtracted from it, and that
prefix is pinned (an extra reference on each block, so `reclaim` cannot take it) while
least-recently-used cache entries are evicted until the rest is free or nothing more is
evictable. The pin is dropped before returning; the prefill's lookup takes its own
references. An empty prompt reuses nothing, so the whole count is the target.

The reused prefix is the one `reuse_prefix` / `prefill` take: the longest block-aligned
cached prefix that leaves at least one prompt token to compute.
"""
from __future__ import annotations

from typing import Sequence

from ..kv.prefix import prefix_keys
from .args import int_arg, list_arg
from .lifecycle import PrefixReclaim


def reused_prefix_blocks(pool, prompt: Sequence[int], salt: bytes = b"") -> list[int]:
    """The cached blocks a prefill of `prompt` would reuse, in order (no LRU touch); `salt`:
    the model's key chain start for this prompt (lifecycle._prefix_salt: its adapter, its
    rope)."""
    if not prompt or pool.num_cached() == 0:
        return []
    bs = pool.block_size
    blocks = []
    for key in prefix_keys(prompt, bs, (len(prompt) - 1) // bs, salt):
        b = pool.peek_prefix(key)
        if b is None:
            break
        blocks.append(b)
    return blocks


def reclaim_for_prompt(pool, prompt: Sequence[int], blocks_needed: int,
                       salt: bytes = b"") -> PrefixReclaim:
    """Evict LRU prefix-cache blocks until `pool` has the free blocks a prefill of `prompt`
    allocates (`blocks_needed` less the reused prefix), never the reused prefix itself."""
    pinned = reused_prefix_blocks(pool, prompt, salt)
    target = max(0, blocks_needed - len(pinned))
    pool.incref(pinned)            # the pin: refcount 2 is not evictable
    try:
        while pool.num_free() < target:
            if pool.reclaim(target - pool.num_free()) == 0:
                break
    finally:
        pool.release(pinned)       # back to the cache's own reference
    return PrefixReclaim(target, pool.num_free())


class PrefixReclaimFor:
    def reclaim_prefix_blocks_for(self, prompt: Sequence[int], adapter_slot: int,
                                  blocks_needed: int) -> PrefixReclaim:
        """Reclaim prefix-cache blocks until `num_free_blocks()` covers what a prefill of
        `prompt` allocates: `blocks_needed` (the caller's count for the whole prompt) less
        the cached prefix that prefill reuses, which is kept. Returns
        `PrefixReclaim(target, free)`; `free < target` means nothing more was evictable.
        `adapter_slot` selects the prefix-cache namespace, `adapter_id_for(adapter_slot)`
        (0, the base model's, without LoRA slots)."""
        what = "reclaim_prefix_blocks_for"
        prompt = list_arg(what, prompt)
        if prompt:
            prompt = self._check_tokens(prompt, what)
        int_arg(what, "adapter_slot", adapter_slot)
        needed = int_arg(what, "blocks_needed", blocks_needed, 0)
        with self._guard:
            return reclaim_for_prompt(self._pool, prompt, needed,
                                      self._prefix_salt(self._long_prompt(prompt),
                                                        self.adapter_id_for(adapter_slot)))
