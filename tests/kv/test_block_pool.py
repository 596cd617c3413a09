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
    assert pool.cache_prefix(keys[0], blocks[0]) and pool.cache_prefix(keys[1], blocks[1])
    assert not pool.cache_prefix(keys[0], blocks[0])
    pool.release(blocks)  # the sequence ends; the cache still holds two blocks
    assert pool.num_free() == 2 and pool.num_cached() == 2
    assert pool.lookup_prefix(keys[1]) == blocks[1]
    # an allocation larger than the free stack evicts least recently used cached blocks
    got = pool.allocate(3)
    assert len(got) == 3 and pool.num_cached() == 1
    assert pool.lookup_prefix(keys[1]) == blocks[1]   # the recently used one survived
    pool.release(got)
    assert pool.reclaim(5) == 1 and pool.num_free() == 4


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
