"""The reference scheduler: continuous batching with chunked prefill, preemption and prefix
reuse produces, for every request, exactly what running that request alone produces."""
import numpy as np
import pytest

from metrale import CacheFull, InvalidArgument
from metrale.engine import Scheduler, generate
from tests.model.common import load


def random_requests(rng, n, vocab=256, shared_prefix=None, max_new=12):
    reqs = []
    for _ in range(n):
        plen = int(rng.integers(1, 40))
        prompt = rng.integers(4, vocab, plen).tolist()
        if shared_prefix is not None and rng.random() < 0.3:
            prompt = shared_prefix + prompt
        reqs.append((prompt, int(rng.integers(1, max_new))))
    return reqs


def solo(model, prompt, n):
    return generate(model, prompt, n, stop_token_ids=[3]).tokens


def test_batch_of_16_mixed_requests_equals_solo_runs():
    m = load("qwen2", kv_blocks=256, block_size=4, max_batch=16)
    rng = np.random.default_rng(1)
    reqs = random_requests(rng, 16)
    sched = Scheduler(m, chunk_tokens=24)
    ids = [sched.add_request(p, n, stop_token_ids=[3]) for p, n in reqs]
    done = sched.run()
    for rid, (p, n) in zip(ids, reqs):
        assert done[rid].output == solo(m, p, n), f"request {rid}"
    assert m.num_free_blocks() + 0 <= m.num_total_blocks()
    m.reclaim_prefix_blocks(m.num_total_blocks())
    assert m.num_free_blocks() == m.num_total_blocks()


def test_200_requests_through_a_small_pool_with_preemption_and_prefix_reuse():
    m = load("llama_gqa", kv_blocks=24, block_size=4, max_batch=12)
    rng = np.random.default_rng(2)
    shared = rng.integers(4, 256, 12).tolist()
    reqs = random_requests(rng, 200, shared_prefix=shared, max_new=30)
    sched = Scheduler(m, chunk_tokens=32)
    ids = []
    for i, (p, n) in enumerate(reqs):   # requests keep arriving while others run
        ids.append(sched.add_request(p, n, stop_token_ids=[3]))
        if i % 5 == 4:
            sched.step()
    done = sched.run()
    assert len(done) == 200 and all(done[r].finish_reason in ("stop", "length") for r in ids)
    assert sched.preemptions > 0, "the pool was meant to be too small for everything at once"
    for rid, (p, n) in zip(ids, reqs):
        assert done[rid].output == solo(m, p, n), f"request {rid} (preempted " \
                                                  f"{done[rid].preemptions}x)"
    m.reclaim_prefix_blocks(m.num_total_blocks())
    assert m.num_free_blocks() == m.num_total_blocks()


def test_cancel_frees_blocks_and_others_continue():
    m = load("mistral", kv_blocks=64, block_size=4)
    sched = Scheduler(m, chunk_tokens=8)
    a = sched.add_request(list(range(4, 30)), 20, stop_token_ids=[])
    b = sched.add_request(list(range(40, 50)), 5, stop_token_ids=[])
    sched.step()
    sched.step()
    assert sched.cancel(a) and not sched.cancel(a)
    done = sched.run()
    assert done[a].finish_reason == "cancelled"
    assert done[b].output == generate(m, list(range(40, 50)), 5, stop_token_ids=[]).tokens
    m.reclaim_prefix_blocks(m.num_total_blocks())
    assert m.num_free_blocks() == m.num_total_blocks()


def test_requests_that_can_never_fit_are_refused():
    m = load("mistral", kv_blocks=4, block_size=4)
    sched = Scheduler(m)
    # a prompt that alone exceeds the 16-token pool; one that fills it exactly is admitted
    # and stops at the limit (tests/engine/test_context_limit.py)
    with pytest.raises(InvalidArgument, match="prompt of 17 tokens"):
        sched.add_request(list(range(4, 21)), 8)
    with pytest.raises(InvalidArgument):
        sched.add_request([], 8)
