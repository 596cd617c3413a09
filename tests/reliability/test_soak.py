"""Soak (marked slow; CI runs it with the count below): the reference scheduler through
2,000 random requests with random cancellations and a pool small enough to force
preemption. Guarantees proven: every finished request equals a solo greedy run of it;
every block comes back; every byte comes back."""
import os

import numpy as np
import pytest

from metrale.engine import Scheduler, generate
from metrale.gpu_runtime import HostBackend
from tests.model.common import load

N_REQUESTS = int(os.environ.get("METRALE_SOAK_REQUESTS", "2000"))


@pytest.mark.slow
def test_soak_scheduler():
    be = HostBackend()
    m = load("llama_gqa", be, kv_blocks=24, block_size=4, max_batch=16)
    live0 = be.live_bytes()
    rng = np.random.default_rng(2026)
    shared = rng.integers(4, 256, 8).tolist()
    sched = Scheduler(m, chunk_tokens=48)
    reqs, cancelled = {}, set()
    submitted = 0
    while submitted < N_REQUESTS or sched.has_work():
        for _ in range(int(rng.integers(0, 7))):
            if submitted < N_REQUESTS:
                plen = int(rng.integers(1, 30))
                prompt = rng.integers(4, 256, plen).tolist()
                if rng.random() < 0.3:
                    prompt = shared + prompt
                n = int(rng.integers(1, 25))
                rid = sched.add_request(prompt, n, stop_token_ids=[3])
                reqs[rid] = (prompt, n)
                submitted += 1
        if rng.random() < 0.01 and sched.running:
            victim = sched.running[int(rng.integers(0, len(sched.running)))].request_id
            if sched.cancel(victim):
                cancelled.add(victim)
        if sched.has_work():
            sched.step()
    done = sched.finished
    assert len(done) == N_REQUESTS
    assert sched.preemptions > 0
    solo_cache = {}
    for rid, (prompt, n) in reqs.items():
        r = done[rid]
        if rid in cancelled:
            assert r.finish_reason == "cancelled"
            continue
        key = (tuple(prompt), n)
        if key not in solo_cache:
            solo_cache[key] = generate(m, prompt, n, stop_token_ids=[3]).tokens
        assert r.output == solo_cache[key], f"request {rid}"
    m.reclaim_prefix_blocks(m.num_total_blocks())
    assert m.num_free_blocks() == m.num_total_blocks()
    assert be.live_bytes() == live0
    print(f"soak: {N_REQUESTS} requests, {len(cancelled)} cancelled, "
          f"{sched.preemptions} preemptions, {sched.steps} steps")
