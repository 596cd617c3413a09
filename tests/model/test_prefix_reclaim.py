"""`reclaim_prefix_blocks_for` (issue 29 §1): the port of the original's
`TransformerModel` override (model/prefix_reclaim.rs, `reclaim_for_prompt`) and its tests
(prefix_reclaim_tests.rs) on metrale's block pool, then the measured case on a model:
making room to resume a sequence whose history is cached must not evict that history."""
import numpy as np

from metrale.gpu_runtime import HostBackend
from metrale.kv.block_pool import BlockPool
from metrale.kv.prefix import prefix_keys
from metrale.model_engine import ModelLifecycle
from metrale.model_engine.lifecycle import PrefixReclaim
from metrale.model_engine.prefix_reclaim import reclaim_for_prompt, reused_prefix_blocks
from tests.model.common import golden, load

BS = 16


def cache_finished(pool, tokens):
    """A finished sequence over `tokens`, as cache_sequence then free_sequence leave it:
    the cache holds the only reference on each of its blocks."""
    blocks = pool.allocate(len(tokens) // BS)
    keys = prefix_keys(tokens, BS)
    for i, (k, b) in enumerate(zip(keys, blocks)):
        pool.cache_prefix(k, b, keys[i - 1] if i else None)
    pool.release(blocks)
    return blocks


def test_warm_admission_keeps_the_prefix_it_reuses():
    pool = BlockPool(10, BS)
    cold = list(range(1000, 1096))
    cached = cache_finished(pool, cold)
    assert pool.num_free() == 4
    warm = cold + list(range(5000, 5004))
    got = reclaim_for_prompt(pool, warm, len(warm) // BS + 1)
    assert got == PrefixReclaim(1, 4), "only the unmatched tail is reserved, nothing evicted"
    assert all(pool.refcount(b) == 1 for b in cached), "the cache keeps its reference"
    assert reused_prefix_blocks(pool, warm) == cached


def test_tail_that_cannot_fit_evicts_others_but_never_the_reused_prefix():
    pool = BlockPool(10, BS)
    reused = list(range(1000, 1096))
    other = list(range(7000, 7016))
    kept = cache_finished(pool, reused)
    cache_finished(pool, other)
    assert pool.num_free() == 3
    warm = reused + list(range(5000, 5080))
    got = reclaim_for_prompt(pool, warm, len(warm) // BS + 1)
    assert got == PrefixReclaim(6, 4)
    assert pool.peek_prefix(prefix_keys(other, BS)[0]) is None, "the unrelated entry is evicted"
    assert reused_prefix_blocks(pool, warm) == kept, "the reused prefix is kept"
    assert pool.reclaim(6) == 6, "the pin is released after the reclaim"


def test_a_prompt_that_reuses_nothing_reserves_the_whole_count():
    pool = BlockPool(10, BS)
    cache_finished(pool, list(range(1000, 1096)))
    assert reclaim_for_prompt(pool, [], 7) == PrefixReclaim(7, 7)


def test_resuming_a_sequence_whose_history_is_cached_reuses_it():
    """The measured case: a sequence's history (20 tokens, one full block cached) waits
    while another sequence holds the rest of a 4-block pool. Making room for its 2 blocks
    used to evict its own cached block (0 tokens reused); the pinned prefix leaves the
    one free block as the target and 16 tokens are reused, as in Rust."""
    ids = golden("llama_gqa")["input_ids"][0].tolist()
    history, other = (ids * 2)[:20], (ids * 2)[20:50]
    want = load("llama_gqa", HostBackend(), kv_blocks=64, block_size=BS)
    V = want.vocab_size()

    def fresh():
        m = load("llama_gqa", HostBackend(), kv_blocks=4, block_size=BS)
        a = m.alloc_sequence()
        m.prefill(history, a, 0)
        m.cache_sequence(a)
        m.free_sequence(a)
        b = m.alloc_sequence()
        m.prefill(other, b, 0)                    # holds 2 blocks: 1 left free
        assert m.num_free_blocks() == 1
        return m

    m = fresh()
    assert m.reclaim_prefix_blocks_for(history, 0, 2) == PrefixReclaim(1, 1)
    seq = m.alloc_sequence()
    assert m.reuse_prefix(seq, history) == 16
    got = np.empty(V, np.uint16)
    m.copy_logits_to_host(m.prefill_chunk(history, seq, 0, 20, True, 0), got)
    ref = np.empty(V, np.uint16)
    want.copy_logits_to_host(want.prefill(history, want.alloc_sequence(), 0), ref)
    assert np.array_equal(got, ref)
    # the trait default (no credit for the prompt's own prefix) evicts it: what metrale did
    m = fresh()
    assert ModelLifecycle.reclaim_prefix_blocks_for(m, history, 0, 2) == PrefixReclaim(2, 2)
    assert m.reuse_prefix(m.alloc_sequence(), history) == 0


def test_eviction_shortens_a_cached_history_from_its_end():
    """reclaim_prefix_blocks takes least-recently-used leaves, as the original's prefix cache
    does: after one block of a 3-block cached history is evicted, a prompt repeating that
    history still reuses its first two blocks (evicting the head first, as metrale did,
    orphaned the whole chain: 0 tokens reused and two blocks held for nothing)."""
    ids = golden("llama_gqa")["input_ids"][0].tolist()
    history = (ids * 8)[:50]                                  # 3 full blocks + 2 tokens
    m = load("llama_gqa", HostBackend(), kv_blocks=8, block_size=BS)
    a = m.alloc_sequence()
    m.prefill(history, a, 0)                                   # caches the 3 full blocks
    m.free_sequence(a)
    assert m.num_free_blocks() == 8 - 3
    assert m.reclaim_prefix_blocks(1) == 1 and m.num_free_blocks() == 8 - 2
    assert m.reuse_prefix(m.alloc_sequence(), history) == 2 * BS
