"""StatePool bookkeeping: live slots, the full-pool error, verify/ring/prefix slot layout."""
import pytest

from metrale import CacheFull, InvalidArgument
from metrale.kv import StatePool


def test_alloc_hands_out_lowest_first_and_free_returns_it():
    pool = StatePool(3, 100)
    assert [pool.alloc() for _ in range(3)] == [0, 1, 2]
    pool.free(1)
    pool.free(0)
    assert pool.alloc() == 0 and pool.alloc() == 1 and pool.num_free() == 0


def test_full_pool_raises_cache_full_naming_the_pool_and_changes_nothing():
    pool = StatePool(2, 4096)
    a, b = pool.alloc(), pool.alloc()
    with pytest.raises(CacheFull, match="recurrent state pool exhausted: all 2 sequence "
                                        "slots.*max_sequences"):
        pool.alloc()
    assert pool.held(a) and pool.held(b) and pool.num_free() == 0
    pool.free(a)
    assert pool.alloc() == a


def test_free_of_a_slot_not_held_is_refused():
    pool = StatePool(2, 8)
    s = pool.alloc()
    pool.free(s)
    for bad in (s, 5, -1, "0"):
        with pytest.raises(InvalidArgument, match="not a held sequence slot"):
            pool.free(bad)
    assert pool.num_free() == 2


def test_slot_layout_is_disjoint_and_counts_every_region():
    pool = StatePool(3, 10, verify_slots=4, ring_depth=2, prefix_slots=5)
    live = [pool.alloc() for _ in range(3)]
    others = [pool.sink] + [pool.verify_slot(j) for j in range(4)] + \
        [pool.ring_slot(s, r) for s in live for r in range(2)]
    prefix = [pool.prefix_store(bytes([i]))[0] for i in range(5)]
    every = live + others + prefix
    assert len(set(every)) == len(every) == pool.total_slots == 3 + 1 + 4 + 6 + 5
    assert sorted(every) == list(range(pool.total_slots))
    assert pool.nbytes() == 10 * pool.total_slots


def test_verify_and_ring_slots_are_bounded():
    pool = StatePool(2, 8, verify_slots=2, ring_depth=1)
    s = pool.alloc()
    with pytest.raises(InvalidArgument, match="ssm_verify_states"):
        pool.verify_slot(2)
    with pytest.raises(InvalidArgument, match="decode_rollback_ring_slots"):
        pool.ring_slot(s, 1)
    with pytest.raises(InvalidArgument, match="not a held sequence slot"):
        pool.ring_slot(1, 0)   # slot 1 was never allocated


def test_prefix_states_are_kept_lru_and_reused_by_key():
    pool = StatePool(1, 8, prefix_slots=2)
    a, new_a = pool.prefix_store(b"a")
    b, new_b = pool.prefix_store(b"b")
    assert new_a and new_b and a != b
    assert pool.prefix_store(b"a") == (a, False)        # same key: same slot, not new
    assert pool.prefix_lookup(b"a") == a                  # "b" is now least recent
    c, new_c = pool.prefix_store(b"c")
    assert new_c and c == b and pool.prefix_lookup(b"b") is None
    assert pool.prefix_keys() == [b"a", b"c"] and pool.occupancy() == (2, 2)


def test_no_prefix_slots_is_a_clear_error():
    pool = StatePool(1, 8)
    with pytest.raises(CacheFull, match="ssm_prefix_states=0"):
        pool.prefix_store(b"k")
    assert pool.prefix_lookup(b"k") is None and pool.occupancy() == (0, 0)


@pytest.mark.parametrize("kw", [dict(seq_slots=0, slot_bytes=1), dict(seq_slots=1, slot_bytes=0),
                                dict(seq_slots=1, slot_bytes=1, verify_slots=-1),
                                dict(seq_slots=True, slot_bytes=1)])
def test_bad_sizes_are_refused(kw):
    with pytest.raises(InvalidArgument, match="StatePool"):
        StatePool(**kw)
