"""attend_base2, the twin of kernels/attention_tile.cuh that the prefill_attention and
dense_attention twins share: against a float64 softmax, masked keys, dtypes kept."""
import numpy as np

from metrale.ops.attention_tile import attend_base2
from tests.conftest import assert_close


def reference(scores, values):
    s = np.asarray(scores, np.float64) * np.log(2.0)  # base 2 -> natural
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ np.asarray(values, np.float64)


def test_matches_float64_softmax_and_ignores_masked_keys(rng):
    s = rng.standard_normal((3, 5, 40)) * 4
    v = rng.standard_normal((3, 40, 16))
    s[:, :, 7:] = -np.inf  # only keys 0..6 visible
    got = attend_base2(s, v)
    assert got.shape == (3, 5, 16) and got.dtype == np.float64
    assert_close(got, reference(s[..., :7], v[:, :7]), "twin_fp32")


def test_one_row_in_float32_stays_float32(rng):
    s = (rng.standard_normal(33) * 3).astype(np.float32)
    v = rng.standard_normal((33, 8)).astype(np.float32)
    got = attend_base2(s, v)
    assert got.shape == (8,) and got.dtype == np.float32
    assert_close(got, reference(s, v), "twin_fp32")


def test_a_single_visible_key_returns_its_value(rng):
    v = rng.standard_normal((4, 6))
    s = np.array([-np.inf, 3.0, -np.inf, -np.inf])
    np.testing.assert_array_equal(attend_base2(s, v), v[1])
