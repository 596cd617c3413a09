"""The engine on hybrid linear-attention models: speculative decoding equals plain greedy
(drafts accepted and rejected, the recurrent state rolled back in the target and in a
recurrent draft), and the reference scheduler (chunked prefill mixed with decode,
preemption, prefix reuse through prefix states) gives every request its solo output."""
import numpy as np
import pytest

from metrale.engine import Scheduler, generate, speculative_generate
from tests.model.common import golden, load

PROMPT = golden("qwen3_5_text")["input_ids"][0][:70].tolist()


@pytest.mark.parametrize("target_name", ["qwen3_5_text", "qwen3_next"])
def test_speculative_equals_greedy_on_a_hybrid_target(target_name):
    target = load(target_name)
    want = generate(target, PROMPT, 20, stop_token_ids=[]).tokens
    seen = set()
    for draft_name in (target_name, "qwen3_5_moe_text", "llama_gqa"):
        for k in (1, 3, 5):
            r = speculative_generate(target, load(draft_name), PROMPT, 20, k=k,
                                     stop_token_ids=[])
            assert r.tokens == want, f"{target_name} / draft {draft_name}, k={k}"
            seen.add("accepted" if r.accepted else "none")
            seen.add("rejected" if r.accepted < r.proposed else "all")
    assert {"accepted", "rejected"} <= seen, seen
    # the target itself as draft accepts everything; a recurrent draft rewound every round
    r = speculative_generate(target, load(target_name), PROMPT, 20, k=4, stop_token_ids=[])
    assert r.accepted == r.proposed > 0


def solo(model, prompt, n):
    return generate(model, prompt, n, stop_token_ids=[3]).tokens


def test_scheduler_on_a_hybrid_equals_solo_runs_with_preemption_and_prefix_reuse():
    m = load("qwen3_5_text", kv_blocks=60, block_size=4, max_batch=8, ssm_prefix_states=4)
    rng = np.random.default_rng(5)
    shared = rng.integers(4, 256, 70).tolist()    # past a 64-token checkpoint boundary
    reqs = []
    for i in range(24):
        prompt = rng.integers(4, 256, int(rng.integers(1, 30))).tolist()
        reqs.append((shared + prompt if i % 3 == 0 else prompt, int(rng.integers(2, 30))))
    reused, reuse = [], m.reuse_prefix

    def counting_reuse(seq, tokens):
        reused.append(reuse(seq, tokens))
        return reused[-1]
    m.reuse_prefix = counting_reuse   # the scheduler's lookups, counted
    sched = Scheduler(m, chunk_tokens=48)
    ids = []
    for i, (p, n) in enumerate(reqs):   # requests keep arriving while others run
        ids.append(sched.add_request(p, n, stop_token_ids=[3]))
        if i % 4 == 3:
            sched.step()
    done = sched.run()
    assert sched.preemptions > 0, "the pool was meant to be too small for everything at once"
    assert m.ssm_snapshot_occupancy()[0] > 0, "the shared prefix's state was kept"
    assert max(reused) == 64, "a later request reused the shared prefix through its state"
    for rid, (p, n) in zip(ids, reqs):
        assert done[rid].output == solo(m, p, n), f"request {rid}"
    assert m._states.num_free() == m._states.seq_slots
