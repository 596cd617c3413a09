"""LoRA adapters through the engine: generate, speculative decoding (greedy equal to plain
greedy under the target's adapter) and the reference scheduler with requests naming
adapters (chunked prefill mixed with decode, prefix reuse within an adapter, preemption)."""
import numpy as np
import pytest

import metrale
from metrale.engine import Scheduler, generate, speculative_generate
from metrale.errors import InvalidArgument, Unsupported
from metrale.gpu_runtime import HostBackend
from tests.model.common import FIXTURES, golden
from tests.model.lora_util import adapter_dirs

IDS = golden("qwen2")["input_ids"][0].tolist()
NAMES = ["qv_r8", "all_r16_rslora", "pattern_r4"]


def load(**kw):
    return metrale.load(FIXTURES / "qwen2", HostBackend(), progress=False,
                        loras=adapter_dirs(NAMES), **kw)


@pytest.fixture(scope="module")
def model():
    return load()


def solo(m, prompt, n, adapter):
    """Greedy tokens by hand: prefill, then decode the argmax."""
    s = m.default_stream()
    seq = m.alloc_sequence(adapter=adapter)
    tok = m.argmax_on_device(m.prefill(prompt, seq, s), s)
    out = [tok]
    while len(out) < n:
        tok = m.argmax_on_device(m.decode(tok, seq, s), s)
        out.append(tok)
    m.free_sequence(seq)
    return out


def test_generate_runs_the_adapter(model):
    base = generate(model, IDS[:8], 10, stop_token_ids=[]).tokens
    outs = {}
    for a in NAMES:
        outs[a] = generate(model, IDS[:8], 10, stop_token_ids=[], adapter=a).tokens
        assert outs[a] == solo(model, IDS[:8], 10, a)
    assert len({tuple(t) for t in [base, *outs.values()]}) == 4, "the adapters change nothing"
    with pytest.raises(InvalidArgument, match="'nope' is not resident"):
        generate(model, IDS[:8], 4, adapter="nope")
    assert all(x.in_flight == 0 for x in model.lora_slots())


@pytest.mark.parametrize("draft_adapter", [None, "qv_r8"])
def test_speculative_greedy_equals_plain_greedy_under_the_adapter(model, draft_adapter):
    draft = load()
    want = generate(model, IDS[:6], 14, stop_token_ids=[], adapter="all_r16_rslora").tokens
    got = speculative_generate(model, draft, IDS[:6], 14, k=3, stop_token_ids=[],
                               adapter="all_r16_rslora", draft_adapter=draft_adapter)
    assert got.tokens == want and got.proposed > 0
    with pytest.raises(Unsupported):     # a draft without slots cannot take an adapter
        speculative_generate(model, metrale.load(FIXTURES / "qwen2", HostBackend(),
                                                 progress=False), IDS[:6], 4,
                             draft_adapter="qv_r8")


def test_scheduler_serves_requests_naming_adapters():
    m = load(kv_blocks=48, block_size=4)
    who = [None, "qv_r8", "all_r16_rslora", "qv_r8", "pattern_r4", None, "all_r16_rslora"]
    prompts = [IDS[:9], IDS[:13], IDS[2:14], IDS[:13], IDS[:7], IDS[3:20], IDS[2:14]]
    sched = Scheduler(m, chunk_tokens=6)
    rids = [sched.add_request(p, 8, stop_token_ids=[], adapter=a) for p, a in zip(prompts, who)]
    done = sched.run()
    for rid, p, a in zip(rids, prompts, who):
        assert done[rid].output == solo(m, p, 8, a), f"request {rid} ({a})"
    assert all(x.in_flight == 0 for x in m.lora_slots())


def test_scheduler_preemption_and_prefix_reuse_keep_outputs():
    m = load(kv_blocks=14, block_size=4)
    reused = []
    real = m.reuse_prefix
    m.reuse_prefix = lambda seq, toks: reused.append(real(seq, toks)) or reused[-1]
    who = ["qv_r8", "pattern_r4", "qv_r8", None]
    sched = Scheduler(m, chunk_tokens=8)
    rids = [sched.add_request(IDS[:12], 12, stop_token_ids=[], adapter=a) for a in who]
    done = sched.run()
    assert sched.preemptions > 0, "the pool was meant to force a preemption"
    assert max(reused) > 0, "no request reused a cached prefix"
    for rid, a in zip(rids, who):
        assert done[rid].output == solo(load(), IDS[:12], 12, a), f"request {rid} ({a})"


def test_scheduler_refuses_and_fails_unknown_adapters():
    m = load()
    sched = Scheduler(m)
    with pytest.raises(InvalidArgument, match="'nope' is not resident"):
        sched.add_request(IDS[:5], 3, adapter="nope")
    rid = sched.add_request(IDS[:5], 3, adapter="pattern_r4")
    ok = sched.add_request(IDS[:5], 3, adapter="qv_r8")
    m.unload_lora("pattern_r4")
    done = sched.run()
    assert done[rid].finish_reason == "error" and "pattern_r4" in done[rid].error
    assert done[ok].finish_reason == "length" and len(done[ok].output) == 3
    assert np.all([x.in_flight == 0 for x in m.lora_slots()])
