"""generate, speculative decoding, perplexity and embeddings on HostBackend."""
import math

import numpy as np
import pytest

import metrale
from metrale import InvalidArgument, Unsupported
from metrale.engine import SamplingParams, embed, generate, perplexity, speculative_generate
from metrale.generative import GenerativeModel
from metrale.gpu_runtime import HostBackend
from metrale.ops.argmax import argmax_rule
from tests.model.common import FIXTURES, golden, load, logits_rows


@pytest.fixture(scope="module")
def target():
    return load("llama_gqa")


@pytest.fixture(scope="module")
def prompt():
    return golden("llama_gqa")["input_ids"][0, :9].tolist()


def greedy_by_hand(m, prompt, n):
    """Teacher-free greedy through the raw pointer API, argmax read on the host."""
    s = m.default_stream()
    seq = m.alloc_sequence()
    out = []
    row = logits_rows(m, m.prefill(prompt, seq, s))
    for _ in range(n):
        out.append(int(argmax_rule(row)[0]))
        row = logits_rows(m, m.decode(out[-1], seq, s))
    m.free_sequence(seq)
    return out


def test_greedy_generate_is_the_argmax_chain_and_reproducible(target, prompt):
    streamed = []
    r = generate(target, prompt, 12, stop_token_ids=[], on_token=streamed.append)
    assert r.tokens == streamed == greedy_by_hand(target, prompt, 12)
    assert r.finish_reason == "length" and r.ttft_s > 0 and r.decode_tokens_per_s > 0
    assert generate(target, prompt, 12, stop_token_ids=[]).tokens == r.tokens
    gm = metrale.load_generative(FIXTURES / "llama_gqa", HostBackend(), progress=False)
    assert generate(gm, prompt, 12, stop_token_ids=[]).tokens == r.tokens
    assert target.num_free_blocks() == target.num_total_blocks()


def test_stop_tokens(target, prompt):
    full = generate(target, prompt, 12, stop_token_ids=[]).tokens
    stop = full[4]
    r = generate(target, prompt, 12, stop_token_ids=[stop])
    first = full.index(stop)
    assert r.tokens == full[:first + 1] and r.finish_reason == "stop"
    # None stops at the checkpoint's eos ids (generation_config wins: [2, 3])
    assert set(target.metadata().eos_token_ids) == {2, 3}
    r = generate(target, prompt, 40)
    assert r.finish_reason == "length" or r.tokens[-1] in (2, 3)


def test_seeded_sampling_is_reproducible(target, prompt):
    sp = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    a = generate(target, prompt, 10, sampling=sp, stop_token_ids=[])
    b = generate(target, prompt, 10, sampling=sp, stop_token_ids=[])
    c = generate(target, prompt, 10, sampling=SamplingParams(temperature=0.9, seed=8),
                 stop_token_ids=[])
    assert a.tokens == b.tokens and a.tokens != c.tokens
    pen = generate(target, prompt, 10, sampling=SamplingParams(repetition_penalty=1.3),
                   stop_token_ids=[])
    assert len(pen.tokens) == 10


def test_generate_bad_arguments(target, prompt):
    for kw in (dict(prompt_ids=[], max_new_tokens=3), dict(prompt_ids=[999], max_new_tokens=3),
               dict(prompt_ids=prompt, max_new_tokens=0)):
        with pytest.raises(InvalidArgument):
            generate(target, **kw)
    with pytest.raises(InvalidArgument):
        generate(object(), prompt, 3)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_speculative_equals_greedy_with_a_different_draft(target, prompt, k):
    draft = load("qwen3")   # another random model over the same 256-token vocabulary
    want = generate(target, prompt, 20, stop_token_ids=[]).tokens
    r = speculative_generate(target, draft, prompt, 20, k=k, stop_token_ids=[])
    assert r.tokens == want
    assert 0 <= r.accepted <= r.proposed
    assert target.num_free_blocks() == target.num_total_blocks()
    assert draft.num_free_blocks() == draft.num_total_blocks()


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_with_target_as_draft_accepts_everything(target, prompt, k):
    other = load("llama_gqa")
    want = generate(target, prompt, 18, stop_token_ids=[]).tokens
    r = speculative_generate(target, other, prompt, 18, k=k, stop_token_ids=[])
    assert r.tokens == want and r.accepted == r.proposed > 0


def test_speculative_rejects(target, prompt):
    with pytest.raises(Unsupported):
        speculative_generate(target, target, prompt, 4, sampling=SamplingParams(temperature=1.0))
    with pytest.raises(InvalidArgument):
        speculative_generate(target, target, prompt, 4, k=0)


def test_perplexity_equals_exp_mean_nll_of_the_golden_logits(target):
    g = golden("llama_gqa")
    ids = g["input_ids"][0]
    x = g["logits"].astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    want = math.exp(float(np.mean(lse[:-1] - x[np.arange(23), ids[1:]])))
    got = perplexity(target, ids.tolist())
    assert abs(got - want) / want < 0.01, (got, want)
    # chunked evaluation changes nothing; a strided window scores every token once
    assert abs(perplexity(target, ids.tolist(), chunk=5) - got) / got < 1e-6
    w = perplexity(target, ids.tolist(), window=8, stride=4)
    assert math.isfinite(w) and w > 1
    with pytest.raises(InvalidArgument):
        perplexity(target, [5])
    with pytest.raises(InvalidArgument):
        perplexity(target, ids.tolist(), window=8, stride=9)


def test_embeddings_equal_normalised_golden_hidden(target):
    g = golden("llama_gqa")
    ids = g["input_ids"][0]
    e = embed(target, [ids.tolist(), ids[:10].tolist()], pooling="last")
    want = g["hidden"][-1] / np.linalg.norm(g["hidden"][-1])
    assert e.shape == (2, 64) and np.allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)
    assert np.max(np.abs(e[0] - want)) < 0.02
    mean = embed(target, [ids.tolist()], pooling="mean", normalize=False)[0]
    assert np.max(np.abs(mean - g["hidden"].mean(0))) / np.abs(g["hidden"]).max() < 0.03
    with pytest.raises(InvalidArgument):
        embed(target, [ids.tolist()], pooling="max")


class TensorOnly(GenerativeModel):
    """A GenerativeModel that offers only the tensor contract (delegating to a decoder)."""

    def __init__(self, inner):
        self.inner = inner

    def metadata(self):
        return self.inner.metadata()

    @classmethod
    def load(cls, source, device="auto", **options):
        return cls(metrale.load_generative(source, device, **options))

    def create_kv_cache(self, config, batch=1):
        return self.inner.create_kv_cache(config, batch)

    def embed(self, tokens):
        return self.inner.embed(tokens)

    def prefill(self, input, cache, pos):
        return self.inner.prefill(input, cache, pos)

    def decode(self, input, cache):
        return self.inner.decode(input, cache)


def test_tensor_only_models_generate_the_same_tokens(target, prompt):
    gm = TensorOnly(metrale.load_generative(FIXTURES / "llama_gqa", HostBackend(),
                                            progress=False))
    want = generate(target, prompt, 8, stop_token_ids=[]).tokens
    assert generate(gm, prompt, 8, stop_token_ids=[]).tokens == want
    sp = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=3)
    assert generate(gm, prompt, 8, sampling=sp, stop_token_ids=[]).tokens == \
        generate(target, prompt, 8, sampling=sp, stop_token_ids=[]).tokens
