"""The KV cache groups of a decoder (DESIGN §6: a sliding-window layer's blocks are released
by the block pool). Layers that attend to the whole context share the pool every sequence's
`block_table` draws from (`model._pool`); when a model also has sliding-window layers, those
get a pool of their own and a second table per sequence (`window_table`), trimmed after
every step to the window of the sequence's next query (BlockPool.trim_window): a long
sequence holds at most ceil(window / block_size) + 1 blocks of each such layer, and the
window pool is sized for the rows of a step, not for their whole contexts (`window_blocks`).
A model whose every layer slides has one group, its pool trimmed the same way.

Prefix caching stays exact: a group caches the blocks its tables still hold, and a prompt
reuses a cached prefix of n blocks only if every group can restore what the query at
position n * block_size needs: the whole chain for full layers, the blocks from that
query's window start on for windowed ones (a prefix whose windowed blocks were released is
reused only as far as it can be restored).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..kv.block_pool import EVICTED, BlockPool


@dataclass
class KvGroup:
    pool: BlockPool
    table: str          # the SequenceState attribute of this group's block table
    reserved: str       # ... of the blocks this group promised the sequence
    window: int         # 0: full attention; else the layers' window (their blocks trimmed)
    layers: tuple[int, ...]


def group_layers(meta) -> list[tuple[int, tuple[int, ...]]]:
    """[(window, layers)]: the primary group first (full layers, or every layer when all
    slide), then the sliding-window layers when the model has both kinds. Every family
    here has one window value (the largest is taken should layers differ)."""
    windows = meta.layer_windows or (0,) * meta.num_layers
    full = tuple(i for i, w in enumerate(windows) if not w)
    sliding = tuple(i for i, w in enumerate(windows) if w)
    if not sliding:
        return [(0, full)]
    w = max(windows)
    return [(w, sliding)] if not full else [(0, full), (w, sliding)]


def window_blocks(num_blocks: int, window: int, block_size: int, max_rows: int,
                  max_tokens: int) -> int:
    """Blocks of a window pool: `max_rows` sequences holding their window at rest
    (ceil(window / block_size) + 1 blocks, + 1 for a decode or verify step's new block)
    and one prefill pass's new tokens; never more than the primary pool's `num_blocks`
    (a sequence's window blocks never outnumber its other blocks)."""
    per_seq = -(-window // block_size) + 2
    return min(num_blocks, max_rows * per_seq + -(-max_tokens // block_size))


def first_needed(next_pos: int, window: int, block_size: int) -> int:
    """The first logical block the query at `next_pos` reads in a layer of `window`."""
    return 0 if not window else max(0, next_pos - window + 1) // block_size


def restorable_blocks(groups: list[KvGroup], keys: list[bytes], block_size: int) -> int:
    """How many leading blocks of a prompt (its prefix keys) every group can restore from
    its prefix cache (no LRU touch)."""
    n_max = len(keys)
    for g in groups:
        if not g.window:
            c = 0
            while c < n_max and g.pool.peek_prefix(keys[c]) is not None:
                c += 1
            n_max = c
    for n in range(n_max, 0, -1):
        if all(g.pool.peek_prefix(keys[i]) is not None
               for g in groups if g.window
               for i in range(first_needed(n * block_size, g.window, block_size), n)):
            return n
    return 0


def take_prefix(groups: list[KvGroup], seq, keys: list[bytes], n: int) -> None:
    """Give `seq` (empty) the cached blocks of its first `n` keys, in every group (the
    windowed ones from the window of position n * block_size on)."""
    bs = groups[0].pool.block_size
    for g in groups:
        first = first_needed(n * bs, g.window, bs)
        table = [EVICTED] * first + [g.pool.lookup_prefix(keys[i]) for i in range(first, n)]
        g.pool.incref(table[first:])
        setattr(seq, g.table, table)


def cache_tables(groups: list[KvGroup], seq, keys: list[bytes]) -> int:
    """Offer each group's held blocks of `seq` (full ones, keyed by `keys`) to its prefix
    cache; returns blocks newly cached in the primary group."""
    counts = []
    for g in groups:
        table = getattr(seq, g.table)
        counts.append(sum(g.pool.cache_prefix(k, b, keys[i - 1] if i else None)
                          for i, (k, b) in enumerate(zip(keys, table)) if b != EVICTED))
    return counts[0]


def trim(groups: list[KvGroup], seq, next_pos: int) -> None:
    """Release each windowed group's blocks that the query at `next_pos` no longer reads."""
    for g in groups:
        if g.window and seq.arena is None:
            g.pool.trim_window(getattr(seq, g.table), next_pos, g.window)


def held_from(groups: list[KvGroup], seq) -> int:
    """The lowest position a rollback may return to: where each windowed group's held
    blocks still cover the window of a query there (0 when nothing was released)."""
    bs = groups[0].pool.block_size
    low = 0
    for g in groups:
        table = getattr(seq, g.table)
        if g.window and seq.arena is None and EVICTED in table:
            first = max(i for i, b in enumerate(table) if b == EVICTED) + 1
            low = max(low, first * bs + g.window - 1)
    return low
