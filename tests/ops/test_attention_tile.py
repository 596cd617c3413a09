"""attend_base2, the twin of kernels/attention_tile.cuh that the prefill_attention and
dense_attention twins share: against a float64 softmax, masked keys, dtypes kept; and
attend_base2_bf16p, the tensor-core tile's closed form, against the online softmax it
stands for, run tile by tile as kernels/attention_tc.cu does."""
import numpy as np
import pytest

from metrale.ops.attention_tile import attend_base2, attend_base2_bf16p
from metrale.ops.bf16 import round_bf16
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


def online_bf16p(s, v, key_pos, tile):
    """The kernel's loop for one row, in float64 but for the BF16 rounding of p (float32
    exp2 against the running max, like the kernel): s [T] base 2, v [T, D]."""
    s = np.asarray(s, np.float32)
    m, l_sum, acc = -np.inf, 0.0, np.zeros(v.shape[1])
    for t in range(key_pos[0] // tile, key_pos[-1] // tile + 1):
        sel = (key_pos >= t * tile) & (key_pos < (t + 1) * tile)
        m_new = max(m, float(s[sel].max()))
        ref = 0.0 if m_new == -np.inf else m_new
        alpha = 1.0 if m_new == m else 2.0 ** (m - ref)
        p = round_bf16(np.exp2(s[sel] - np.float32(ref))).astype(np.float64)
        l_sum = l_sum * alpha + p.sum()
        acc = acc * alpha + p @ v[sel]
        m = m_new
    return acc / l_sum if l_sum > 0 else acc


@pytest.mark.parametrize("first,tile", [(0, 64), (5, 64), (37, 16), (130, 64)])
def test_bf16p_closed_form_is_the_tiled_online_softmax(rng, first, tile):
    t = 150
    s = (rng.standard_normal((4, t)) * 6).astype(np.float32)
    s[1, 100:] = -np.inf                # a causal row
    s[2, :70] = -np.inf                 # a windowed row: early tiles fully masked
    s[3, ::3] = -np.inf
    v = rng.standard_normal((t, 24))
    pos = np.arange(first, first + t)
    got = attend_base2_bf16p(s, v, pos, tile)
    want = np.stack([online_bf16p(s[r], v, pos, tile) for r in range(4)])
    assert_close(got, want, "twin_fp32")
    # P in BF16 moves the result by BF16-level amounts, not more
    assert_close(got, attend_base2(s.astype(np.float64), v), "twin_bf16")


def test_bf16p_tiles_sit_at_absolute_positions(rng):
    """The same scores at other positions fall into other tiles: rounding against another
    running max gives other bits (why the kernel aligns tiles to positions, not chunks)."""
    s = (rng.standard_normal((6, 128)) * 8).astype(np.float32)
    v = rng.standard_normal((128, 16))
    a = attend_base2_bf16p(s, v, np.arange(0, 128), 64)
    assert np.array_equal(a, attend_base2_bf16p(s, v, np.arange(128, 256), 64))
    assert not np.array_equal(a, attend_base2_bf16p(s, v, np.arange(32, 160), 64))


def test_bf16p_single_key_and_fully_masked_row(rng):
    v = rng.standard_normal((4, 6))
    s = np.array([[-np.inf, 3.0, -np.inf, -np.inf], [-np.inf] * 4])
    got = attend_base2_bf16p(s, v, np.arange(60, 64), 16)
    np.testing.assert_array_equal(got[0], v[1])
    np.testing.assert_array_equal(got[1], np.zeros(6))  # no NaN
