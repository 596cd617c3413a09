"""The context limit is a stop, not an error (issue 14 item 2): generate, speculative
decoding and the scheduler stop with finish_reason "length" when prompt + output reach
max_seq_len (vLLM's max_model_len rule, issue 29), returning what they made; a prompt that
leaves no room for a new token is refused with its length, the limit and the load option
that raises it."""
import pytest

from metrale import InvalidArgument
from metrale.engine import Scheduler, generate, speculative_generate
from tests.model.common import load

LIMIT = 24


@pytest.fixture(scope="module")
def roomy():
    return load("llama_gqa", kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def short():
    return load("llama_gqa", kv_blocks=64, block_size=4, max_seq_len=LIMIT)


def all_free(m) -> bool:
    m.reclaim_prefix_blocks(m.num_total_blocks())   # blocks the prefix cache kept
    return m.num_free_blocks() == m.num_total_blocks()


def prompt(n):
    return [(7 * i + 5) % 250 + 4 for i in range(n)]


@pytest.mark.parametrize("plen", [1, 10, LIMIT - 1])
def test_generate_stops_at_the_limit_with_length(short, roomy, plen):
    p = prompt(plen)
    r = generate(short, p, 100, stop_token_ids=[])
    n = LIMIT - plen              # prompt + output <= max_seq_len
    assert r.finish_reason == "length" and len(r.tokens) == n
    assert r.extra.get("context_limit") is True
    # the tokens are the ones a model with room makes
    assert r.tokens == generate(roomy, p, n, stop_token_ids=[]).tokens
    assert all_free(short)
    # asking for exactly what fits is an ordinary max_new_tokens stop
    assert generate(short, p, n, stop_token_ids=[]).extra.get("context_limit") is None


def test_the_vllm_rule_40_prompt_tokens_under_48_give_8_new_tokens():
    """The issue's case: prompt + output <= max_seq_len, as vLLM's max_model_len."""
    m = load("llama_gqa", kv_blocks=64, block_size=4, max_seq_len=48)
    p = prompt(40)
    for r in (generate(m, p, 100, stop_token_ids=[]),
              speculative_generate(m, m, p, 100, k=3, stop_token_ids=[])):
        assert len(r.tokens) == 8 and r.finish_reason == "length"
        assert r.extra.get("context_limit") is True
    sched = Scheduler(m, chunk_tokens=16)
    rid = sched.add_request(p, 100, stop_token_ids=[])
    r = sched.run()[rid]
    assert len(r.output) == 8 and r.finish_reason == "length"
    assert all_free(m)


@pytest.mark.parametrize("plen", [LIMIT, LIMIT + 1])
def test_a_prompt_without_room_names_length_limit_and_option(short, plen):
    with pytest.raises(InvalidArgument) as e:
        generate(short, prompt(plen), 4)
    msg = str(e.value)
    assert f"prompt of {plen} tokens" in msg and f"limit of {LIMIT}" in msg
    assert "max_seq_len=N" in msg and "--max-seq-len" in msg
    if plen == LIMIT:
        assert "leaves no room for a new token" in msg and "prompt + output" in msg
    assert all_free(short)


def test_a_small_pool_names_kv_blocks():
    m = load("llama_gqa", kv_blocks=3, block_size=4)
    for plen in (12, 13):
        with pytest.raises(InvalidArgument, match="kv_blocks=N"):
            generate(m, prompt(plen), 2)
    r = generate(m, prompt(11), 5, stop_token_ids=[])
    assert r.finish_reason == "length" and len(r.tokens) == 1


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("plen", [5, LIMIT - 2, LIMIT - 1])
def test_speculative_stops_where_generate_stops(short, roomy, k, plen):
    p = prompt(plen)
    want = generate(short, p, 100, stop_token_ids=[])
    for draft in (roomy, load("qwen2", kv_blocks=64, block_size=4, max_seq_len=LIMIT - 3)):
        if plen > LIMIT - 3 and draft is not roomy:
            with pytest.raises(InvalidArgument, match="draft model"):
                speculative_generate(short, draft, p, 100, k=k, stop_token_ids=[])
            continue
        r = speculative_generate(short, draft, p, 100, k=k, stop_token_ids=[])
        assert r.tokens == want.tokens and r.finish_reason == "length"
        assert r.extra.get("context_limit") is True
        assert all_free(short)
        assert all_free(draft)
    for plen in (LIMIT, LIMIT + 1):
        with pytest.raises(InvalidArgument, match=f"prompt of {plen} tokens"):
            speculative_generate(short, roomy, prompt(plen), 4)


def test_scheduler_stops_each_request_at_the_limit(short):
    sched = Scheduler(short, chunk_tokens=8)
    lens = [3, LIMIT - 1, LIMIT - 2, 11]
    ids = [sched.add_request(prompt(n), 50, stop_token_ids=[]) for n in lens]
    done = sched.run()
    for rid, n in zip(ids, lens):
        r = done[rid]
        assert r.finish_reason == "length" and len(r.output) == LIMIT - n
        assert r.output == generate(short, prompt(n), 50, stop_token_ids=[]).tokens
    for plen in (LIMIT, LIMIT + 1):
        with pytest.raises(InvalidArgument, match=f"prompt of {plen} tokens"):
            sched.add_request(prompt(plen), 4)
    assert all_free(short)
