"""Guarantee: an exception (KeyboardInterrupt included) raised at any point inside
`generate`, `speculative_generate` or a scheduler step leaves the model usable and the
pool's accounting exact. Proven by injecting the exception at every launch of a short run."""
import numpy as np
import pytest

from metrale.engine import Scheduler, generate, speculative_generate
from metrale.gpu_runtime import HostBackend
from tests.model.common import golden, load

PROMPT = golden("llama_gqa")["input_ids"][0, :7].tolist()


class Injector:
    """Wraps backend.launch / gemm_bf16 to raise KeyboardInterrupt at the n-th call."""

    def __init__(self, backend):
        self.backend, self.count, self.fire_at = backend, 0, None
        for name in ("launch", "gemm_bf16", "launch_graph", "copy_h2d_async", "copy_d2h"):
            setattr(backend, name, self._wrap(getattr(backend, name)))

    def _wrap(self, fn):
        def inner(*a, **k):
            self.count += 1
            if self.fire_at is not None and self.count == self.fire_at:
                raise KeyboardInterrupt(f"injected at call {self.count}")
            return fn(*a, **k)
        return inner


def count_calls(run):
    be = HostBackend()
    inj = Injector(be)
    run(be)
    return inj.count


def check_exact(m, be, live0):
    # prefill leaves the prompt's full blocks in the prefix cache (as the original does);
    # evicted, every block must be free again
    m.reclaim_prefix_blocks(m.num_total_blocks())
    assert m.num_free_blocks() == m.num_total_blocks()
    assert be.live_bytes() == live0


@pytest.mark.parametrize("graphs", [False, True])
def test_generate_interrupted_at_every_launch(graphs):
    be = HostBackend()
    m = load("llama_gqa", be, kv_blocks=16, block_size=4, graphs=graphs)
    want = generate(m, PROMPT, 5, stop_token_ids=[]).tokens
    m.reclaim_prefix_blocks(m.num_total_blocks())
    live0 = be.live_bytes()
    inj = Injector(be)
    generate(m, PROMPT, 5, stop_token_ids=[])
    total = inj.count
    assert total > 20
    faults = 0
    for n in range(1, total + 1, 3 if graphs else 1):
        inj.count, inj.fire_at = 0, n
        with pytest.raises(KeyboardInterrupt):
            generate(m, PROMPT, 5, stop_token_ids=[])
        faults += 1
        inj.fire_at = None
        check_exact(m, be, live0)
    assert generate(m, PROMPT, 5, stop_token_ids=[]).tokens == want
    assert faults >= total // 3


@pytest.mark.parametrize("graphs", [False, True])
def test_speculative_interrupted_at_every_launch(graphs):
    be = HostBackend()
    target = load("llama_gqa", be, kv_blocks=16, block_size=4, graphs=graphs)
    draft = load("qwen3", be, kv_blocks=16, block_size=4, graphs=graphs)
    want = generate(target, PROMPT, 6, stop_token_ids=[]).tokens
    # once through first: every decode graph is captured, so each run makes the same calls
    speculative_generate(target, draft, PROMPT, 6, k=3, stop_token_ids=[])
    draft.reclaim_prefix_blocks(draft.num_total_blocks())
    target.reclaim_prefix_blocks(target.num_total_blocks())
    live0 = be.live_bytes()
    inj = Injector(be)
    speculative_generate(target, draft, PROMPT, 6, k=3, stop_token_ids=[])
    total = inj.count
    for n in range(1, total + 1, 2):
        inj.count, inj.fire_at = 0, n
        with pytest.raises(KeyboardInterrupt):
            speculative_generate(target, draft, PROMPT, 6, k=3, stop_token_ids=[])
        inj.fire_at = None
        check_exact(target, be, live0)
        draft.reclaim_prefix_blocks(draft.num_total_blocks())
        assert draft.num_free_blocks() == draft.num_total_blocks()
    assert speculative_generate(target, draft, PROMPT, 6, k=3, stop_token_ids=[]).tokens == want


def test_scheduler_step_interrupted_then_resumed_gives_solo_outputs():
    be = HostBackend()
    m = load("mistral", be, kv_blocks=24, block_size=4, max_batch=4)
    rng = np.random.default_rng(3)
    reqs = [(rng.integers(4, 256, int(rng.integers(2, 14))).tolist(), int(rng.integers(1, 6)))
            for _ in range(6)]
    solo = [generate(m, p, n, stop_token_ids=[]).tokens for p, n in reqs]
    live0 = be.live_bytes()
    inj = Injector(be)
    faults = 0
    for n in range(1, 400, 7):
        sched = Scheduler(m, chunk_tokens=8)
        ids = [sched.add_request(p, k, stop_token_ids=[]) for p, k in reqs]
        inj.count, inj.fire_at = 0, n
        try:
            sched.run()
        except KeyboardInterrupt:
            faults += 1
            # accounting is exact right after the fault (cached prefixes aside) ...
            held = sum(len(r.seq.block_table) for r in sched.running if r.seq)
            assert held == 0
        inj.fire_at = None
        done = sched.run()   # ... and the same scheduler finishes with solo outputs
        assert [done[i].output for i in ids] == solo
        m.reclaim_prefix_blocks(m.num_total_blocks())
        check_exact(m, be, live0)
    assert faults > 20
