"""SamplingParams validation and the float64 definition `filtered_distribution`."""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.engine.sampling import SamplingParams, filtered_distribution, resolve_seed
from metrale.errors import InvalidArgument, MetraleError

SP = SamplingParams


def test_defaults_are_greedy():
    p = SP()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.seed) == \
        (0.0, 0, 1.0, 0.0, 1.0, None)
    assert p.is_greedy
    assert not SP(temperature=0.7).is_greedy


def test_frozen_and_normalised():
    p = SP(temperature=1, top_k=np.int64(5), top_p=Fraction(1, 2), min_p=np.float32(0.25),
           repetition_penalty=np.float64(1.5), seed=np.uint64(2**64 - 1))
    assert type(p.temperature) is float and p.temperature == 1.0
    assert type(p.top_k) is int and p.top_k == 5
    assert p.top_p == 0.5 and p.min_p == 0.25 and p.repetition_penalty == 1.5
    assert type(p.seed) is int and p.seed == 2**64 - 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0  # type: ignore[misc]
    assert p == SP(temperature=1.0, top_k=5, top_p=0.5, min_p=0.25, repetition_penalty=1.5,
                   seed=2**64 - 1)


GOOD = {
    "temperature": [0, 0.0, 1e-6, 1.0, 100.0],
    "top_k": [0, 1, 50, 2**40],
    "top_p": [1e-9, 0.5, 1.0, 1],
    "min_p": [0, 0.0, 0.5, 1.0],
    "repetition_penalty": [1e-3, 1.0, 1.3, 10],
    "seed": [None, 0, 1, 2**64 - 1],
}

BAD = {
    "temperature": [-1e-9, -1.0, math.nan, math.inf, -math.inf, "1.0", None, True, 1j],
    "top_k": [-1, 1.0, 2.5, "3", None, False, math.nan],
    "top_p": [0, 0.0, -0.1, 1.0000001, 2, math.nan, math.inf, None, "0.9"],
    "min_p": [-1e-9, 1.01, math.nan, -math.inf, None, "0"],
    "repetition_penalty": [0, 0.0, -1.0, math.nan, math.inf, None, True],
    "seed": [-1, 2**64, 1.0, "7", True, math.nan],
}


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in GOOD.items() for v in vs])
def test_good_values(field, value):
    p = SP(**{field: value})
    assert getattr(p, field) == value


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in BAD.items() for v in vs],
                         ids=lambda x: repr(x))
def test_bad_values_name_the_field(field, value):
    with pytest.raises(InvalidArgument, match=field):
        SP(**{field: value})


def test_huge_int_float_fields_are_invalid_argument():
    with pytest.raises(InvalidArgument, match="temperature"):
        SP(temperature=10**400)
    with pytest.raises(InvalidArgument, match="top_p"):
        SP(top_p=Fraction(10**400, 3))


_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2),
    st.fractions(), st.complex_numbers(allow_nan=True), st.text(max_size=5),
    st.just(np.float32(0.5)), st.just(np.int32(3)), st.lists(st.integers(), max_size=2))


@settings(max_examples=400, deadline=None)
@given(t=_ANY, k=_ANY, p=_ANY, mp=_ANY, rp=_ANY, seed=_ANY)
def test_fuzz_never_raises_anything_else(t, k, p, mp, rp, seed):
    try:
        sp = SP(temperature=t, top_k=k, top_p=p, min_p=mp, repetition_penalty=rp, seed=seed)
    except InvalidArgument as e:
        assert isinstance(e, MetraleError)
        return
    assert sp.temperature >= 0 and math.isfinite(sp.temperature)
    assert sp.top_k >= 0 and 0 < sp.top_p <= 1 and 0 <= sp.min_p <= 1
    assert sp.repetition_penalty > 0
    assert sp.seed is None or 0 <= sp.seed < 2**64


def test_resolve_seed():
    assert resolve_seed(SP(seed=5)) == 5
    s = resolve_seed(SP())
    assert 0 <= s < 2**64


# --------------------------------------------------------------------------- definition
def probs_row(p):
    return np.log(np.asarray(p, np.float64)).astype(np.float32)


def test_plain_softmax_and_temperature():
    row = np.float32([1.0, 2.0, 3.0])
    for t in (0.5, 1.0, 3.0):
        ref = np.exp(np.float64(row) / t)
        np.testing.assert_allclose(filtered_distribution(row, SP(temperature=t)),
                                   ref / ref.sum(), rtol=1e-12)


def test_top_k_keeps_ties():
    row = np.float32([1.0, 3.0, 2.0, 2.0, 0.5])
    d = filtered_distribution(row, SP(temperature=1.0, top_k=2))
    assert np.nonzero(d)[0].tolist() == [1, 2, 3]
    d = filtered_distribution(row, SP(temperature=1.0, top_k=1))
    assert d.tolist() == [0, 1, 0, 0, 0]
    assert np.count_nonzero(filtered_distribution(row, SP(temperature=1.0, top_k=9))) == 5


def test_top_p_mass_strictly_above():
    row = probs_row([0.5, 0.3, 0.15, 0.05])
    d = filtered_distribution(row, SP(temperature=1.0, top_p=0.79))
    np.testing.assert_allclose(d, [0.625, 0.375, 0, 0], rtol=1e-6)
    d = filtered_distribution(row, SP(temperature=1.0, top_p=0.81))
    assert np.count_nonzero(d) == 3
    d = filtered_distribution(row, SP(temperature=1.0, top_p=1e-9))
    assert d.tolist() == [1, 0, 0, 0]  # at least one token
    tie = probs_row([0.3, 0.3, 0.3, 0.1])
    assert np.count_nonzero(filtered_distribution(tie, SP(temperature=1.0, top_p=0.1))) == 3


def test_min_p_relative_to_top():
    row = probs_row([0.4, 0.2, 0.1, 0.3])
    d = filtered_distribution(row, SP(temperature=1.0, min_p=0.45))
    np.testing.assert_allclose(d, [0.4 / 0.9, 0.2 / 0.9, 0, 0.3 / 0.9], rtol=1e-6)
    assert filtered_distribution(row, SP(temperature=1.0, min_p=1.0)).tolist() == [1, 0, 0, 0]


def test_hf_order_top_k_then_top_p_then_min_p():
    row = probs_row([0.35, 0.25, 0.2, 0.1, 0.1])
    p = SP(temperature=1.0, top_k=3, top_p=0.7, min_p=0.8)
    # top_k: {0,1,2} renormalised 0.4375/0.3125/0.25; top_p 0.7: mass above 2 is 0.75 ->
    # {0,1}; min_p 0.8 of 0.4375/0.75=0.583: 0.3125/0.75=0.4167 < 0.467 -> {0}
    assert filtered_distribution(row, p).tolist() == [1, 0, 0, 0, 0]
    p = SP(temperature=1.0, top_k=3, top_p=0.7, min_p=0.7)
    np.testing.assert_allclose(filtered_distribution(row, p), [0.35 / 0.6, 0.25 / 0.6, 0, 0, 0],
                               rtol=1e-6)


def test_penalty_and_greedy():
    row = np.float32([2.0, 1.9, -1.0])
    assert filtered_distribution(row, SP()).tolist() == [1, 0, 0]
    assert filtered_distribution(row, SP(repetition_penalty=1.1), [0, 0, 7, -1]).tolist() == \
        [0, 1, 0]
    d = filtered_distribution(row, SP(temperature=1.0, repetition_penalty=2.0), [0, 2, 2])
    ref = np.exp([1.0, 1.9, -2.0])
    np.testing.assert_allclose(d, ref / ref.sum(), rtol=1e-6)


def test_nan_and_masked_rows():
    row = np.float32([np.nan, 1.0, -np.inf, 1.0])
    np.testing.assert_allclose(filtered_distribution(row, SP(temperature=1.0)),
                               [0, 0.5, 0, 0.5])
    allinf = np.full(4, -np.inf, np.float32)
    assert filtered_distribution(allinf, SP(temperature=1.0)).tolist() == [1, 0, 0, 0]
    with pytest.raises(InvalidArgument):
        filtered_distribution(np.zeros(0, np.float32), SP())
