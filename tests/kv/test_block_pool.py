"""BlockPool bookkeeping: stack order, refcounts, reservations, prefix cache, CacheFull."""
import pytest

from metrale import CacheFull, InvalidArgument
from metrale.kv import BlockPool, CacheConfig, prefix_keys


def held(pool):
    return sum(1 for b in range(pool.num_total()) if pool.refcount(b) > 0)


def test_stack_hands_out_block_zero_first_and_returns_in_order():
    pool = BlockPool(8, 16)
    assert pool.allocate(3) == [0, 1, 2]
    pool.release([0, 1, 2])
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free() == 5 and held(pool) == 3


def test_cache_full_changes_nothing():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    with pytest.raises(CacheFull, match="1 free of 4"):
        pool.allocate(2)
    assert pool.num_free() == 1 and [pool.refcount(b) for b in a] == [1, 1, 1]


def test_refcounts_and_double_release():
    pool = BlockPool(4, 16)
    a = pool.allocate(2)
    pool.incref(a)
    pool.release(a)
    assert pool.num_free() == 2
    pool.release(a)
    assert pool.num_free() == 4
    with pytest.raises(InvalidArgument):
        pool.release(a)
    with pytest.raises(InvalidArgument):
        pool.incref([3])


def test_reservations():
    pool = BlockPool(6, 4)
    pool.reserve(4)
    assert pool.num_free() == 2
    with pytest.raises(CacheFull):
        pool.allocate(3)
    got = pool.allocate(3, reserved=3)   # taken from the reservation
    assert len(got) == 3 and pool.num_free() == 2
    pool.unreserve(1)
    assert pool.num_free() == 3


def test_prefix_cache_and_reclaim():
    pool = BlockPool(4, 2)
    toks = [5, 6, 7, 8, 9]
    keys = prefix_keys(toks, 2)
    assert len(keys) == 2
    blocks = pool.allocate(3)
    assert pool.cache_prefix(keys[0], blocks[0]) and pool.cache_prefix(keys[1], blocks[1], keys[0])
    assert not pool.cache_prefix(keys[0], blocks[0])
    pool.release(blocks)  # the sequence ends; the cache still holds two blocks
    assert pool.num_free() == 2 and pool.num_cached() == 2 and pool.num_evictable() == 2
    assert pool.lookup_prefix(keys[0]) == blocks[0] and pool.lookup_prefix(keys[1]) == blocks[1]
    # an allocation larger than the free stack evicts: the leaf goes first, although the
    # lookup walk (head then leaf) left the head the least recently used
    got = pool.allocate(3)
    assert len(got) == 3 and pool.num_cached() == 1
    assert pool.lookup_prefix(keys[0]) == blocks[0] and pool.peek_prefix(keys[1]) is None
    pool.release(got)
    assert pool.reclaim(5) == 1 and pool.num_free() == 4


def cache_chain(pool, tokens):
    """Blocks for `tokens` cached as a chain (each prefix the child of the one before), then
    released: the cache holds the only reference, as after cache_sequence + free_sequence."""
    keys = prefix_keys(tokens, pool.block_size)
    blocks = pool.allocate(len(keys))
    for i, (k, b) in enumerate(zip(keys, blocks)):
        pool.cache_prefix(k, b, keys[i - 1] if i else None)
    pool.release(blocks)
    return keys, blocks


def test_reclaim_takes_least_recently_used_leaves_first():
    """The original's order (PrefixCache::evict): chains shrink from their ends, by leaf age."""
    pool = BlockPool(8, 2)
    a_keys, a_blocks = cache_chain(pool, [1, 2, 3, 4, 5, 6])      # a0 <- a1 <- a2
    b_keys, b_blocks = cache_chain(pool, [7, 8])                  # b0, more recent than a
    for k in a_keys:                                              # a reused: a2 newest
        pool.lookup_prefix(k)
    pool.lookup_prefix(b_keys[0])                                 # b0 newest of all
    # leaves by age: a2 (older) then b0; a2 goes, then a1 (a leaf now, older than b0)
    assert pool.reclaim(2) == 2
    assert [pool.peek_prefix(k) for k in a_keys] == [a_blocks[0], None, None]
    assert pool.peek_prefix(b_keys[0]) == b_blocks[0]
    assert pool.reclaim(1) == 1 and pool.peek_prefix(a_keys[0]) is None   # a0 older than b0
    assert pool.num_cached() == 1 and pool.num_free() == 7


def test_a_held_descendant_keeps_its_cached_ancestors():
    """A cached head whose cached child a sequence holds cannot be evicted (only leaves
    go), so it is not counted evictable: allocate raises CacheFull instead of popping an
    empty free stack."""
    pool = BlockPool(3, 2)
    keys = prefix_keys([1, 2, 3, 4], 2)
    head = pool.allocate(1)                  # another sequence's block for the first prefix
    pool.cache_prefix(keys[0], head[0])
    pool.release(head)
    mine = pool.allocate(2)                  # a sequence that computed the same prefix itself
    assert not pool.cache_prefix(keys[0], mine[0])
    assert pool.cache_prefix(keys[1], mine[1], keys[0])
    assert pool.num_free() == 0 and pool.num_evictable() == 0
    with pytest.raises(CacheFull):
        pool.allocate(1)
    assert pool.num_cached() == 2
    pool.release(mine)                       # the child is now the cache's alone
    assert pool.num_evictable() == 2 and pool.num_free() == 1
    assert pool.allocate(3) and pool.num_cached() == 0


def test_prefix_keys_chain_the_whole_prefix():
    a = prefix_keys([1, 2, 3, 4], 2)
    b = prefix_keys([9, 9, 3, 4], 2)
    assert a[0] != b[0] and a[1] != b[1]          # same last block, different prefix
    assert prefix_keys([1, 2, 3], 2) == a[:1]     # only full blocks


@pytest.mark.parametrize("kw", [dict(kind="dense"), dict(max_seq_len=0), dict(block_size=3),
                                dict(block_size=True), dict(max_seq_len="8")])
def test_cache_config_rejects(kw):
    with pytest.raises(InvalidArgument):
        CacheConfig(**kw)
