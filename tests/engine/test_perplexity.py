"""Strided perplexity scores every token after the first exactly once, each with as much
left context as its window allows (issue 14 item 3), checked against a float64 reference
that scores token by token with a fresh prefill of its context."""
import math

import numpy as np
import pytest

from metrale.engine import perplexity, perplexity_details
from metrale.engine.perplexity import window_plan
from tests.model.common import golden, load

N = 40


@pytest.fixture(scope="module")
def model():
    return load("llama_gqa", kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def ids():
    g = golden("llama_gqa")["input_ids"][0].tolist()
    return (g * (N // len(g) + 1))[:N]


def context_start(i: int, window: int, stride: int) -> int:
    """Where the context of token i begins: windows start at multiples of the step
    (stride, but at most window - 1 so that consecutive windows overlap), and token i is
    scored by the first window that reaches past it."""
    step = min(stride, window - 1)
    k = 0
    while k * step + window <= i:
        k += 1
    return k * step


def reference_nll(m, ids, window, stride) -> tuple[float, int]:
    """float64 sum of -log p(token i | its context) over i = 1..n-1, one prefill each."""
    s = m.default_stream()
    nll = 0.0
    for i in range(1, len(ids)):
        b = context_start(i, window, stride)
        assert 0 <= b < i and i - b <= window - 1 + (b == 0)
        seq = m.alloc_sequence()
        row = m.logits_to_numpy(m.prefill(ids[b:i], seq, s))[0].astype(np.float64)
        m.free_sequence(seq)
        mx = row.max()
        nll -= row[ids[i]] - (mx + math.log(np.exp(row - mx).sum()))
    return nll, len(ids) - 1


@pytest.mark.parametrize("window, stride", [(8, 8), (8, 3), (16, 16), (16, 5), (7, 1),
                                            (N, N), (12, 11)])
def test_matches_the_float64_token_by_token_reference(model, ids, window, stride):
    want, n = reference_nll(model, ids, window, stride)
    got = perplexity_details(model, ids, window=window, stride=stride, chunk=5)
    assert got.tokens_scored == n == N - 1
    # the model rows are batch invariant, so only float64 summation order differs
    assert got.nll == pytest.approx(want, rel=1e-9)
    assert got.perplexity == pytest.approx(math.exp(want / n), rel=1e-9)
    assert perplexity(model, ids, window=window, stride=stride) == \
        pytest.approx(got.perplexity, rel=1e-6)


@pytest.mark.parametrize("n", [2, 3, 17, 40])
@pytest.mark.parametrize("window, stride", [(2, 2), (2, 1), (5, 5), (5, 2), (9, 4), (9, 9)])
def test_the_plan_covers_every_token_once(n, window, stride):
    seen = []
    for begin, end, first in window_plan(n, window, stride):
        assert end - begin <= window and begin < first < end + 1 and first > begin
        seen.extend(range(first, end))
    assert seen == list(range(1, n))


def test_default_window_is_the_whole_text_when_it_fits(model, ids):
    d = perplexity_details(model, ids)
    assert d.windows == 1 and d.tokens_scored == N - 1 and d.window == N
