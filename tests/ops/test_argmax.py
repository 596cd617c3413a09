"""argmax family: the twin reproduces the original kernel's rule bit for bit (DESIGN §2)."""
import numpy as np
import pytest

from metrale.ops import argmax
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import real
from tests.helpers import Buffers


def reference_rule(row: np.ndarray) -> int:
    """A literal, loop-by-loop transcription of the kernel (slow, obviously right)."""
    row = [np.float32(x) for x in row]
    val = [np.float32(-1e30)] * 1024
    idx = [0] * 1024
    for t in range(1024):
        for i in range(t, len(row), 1024):
            if row[i] > val[t]:
                val[t], idx[t] = row[i], i
    s = 512
    while s >= 1:
        for t in range(s):
            if val[t + s] > val[t]:
                val[t], idx[t] = val[t + s], idx[t + s]
        s //= 2
    return idx[0]


def run_bf16(backend, rows_f32):
    rows_bits = f32_to_bf16(np.asarray(rows_f32, np.float32))
    n, v = rows_bits.shape
    with Buffers(backend) as b:
        lp, op = b.put(rows_bits), b.empty((n,), np.uint32)
        argmax.argmax_bf16_batch(backend, backend.default_stream(), lp, op, n, v)
        batch = b.get(op, (n,), np.uint32)
        singles = []
        for r in range(n):
            argmax.argmax_bf16(backend, backend.default_stream(), lp.offset(r * v * 2), op, v)
            singles.append(int(b.get(op, (1,), np.uint32)[0]))
    assert list(batch) == singles
    return batch


def run_fp32(backend, rows):
    rows = np.asarray(rows, np.float32)
    n, v = rows.shape
    with Buffers(backend) as b:
        lp, op = b.put(rows), b.empty((n,), np.uint32)
        argmax.argmax_fp32(backend, backend.default_stream(), lp, op, n, v)
        return b.get(op, (n,), np.uint32)


def tie_row(vocab, positions, base=-3.0, peak=5.0):
    row = np.full(vocab, base, np.float32)
    row[list(positions)] = peak
    return row


@pytest.mark.parametrize("positions,expected", [((1, 2), 2), ((5, 1030), 1030), ((3, 1027), 3)])
@pytest.mark.parametrize("runner", [run_bf16, run_fp32])
def test_crafted_ties(host, positions, expected, runner):
    row = tie_row(2048, positions)
    assert reference_rule(row) == expected
    assert int(runner(host, row[None])[0]) == expected


@pytest.mark.parametrize("runner", [run_bf16, run_fp32])
def test_nan_and_inf_rows(host, runner):
    v = 1500
    nan_row = np.full(v, np.nan, np.float32)
    ninf_row = np.full(v, -np.inf, np.float32)
    floor_row = np.full(v, -1e30, np.float32)
    mixed = np.full(v, np.nan, np.float32)
    mixed[700] = -2.0
    mixed[1200] = -1.0
    got = runner(host, np.stack([nan_row, ninf_row, floor_row, mixed]))
    assert list(got) == [0, 0, 0, 1200]


@pytest.mark.parametrize("vocab", [1, 7, 19, 111, 1023, 1024, 1025, 4097, 151936])
def test_random_rows_match_literal_rule(host, rng, vocab):
    # values on a coarse grid so BF16 rows have many exact ties
    rows = rng.integers(-8, 9, size=(2, vocab)).astype(np.float32)
    rows_bf = bf16_to_f32(f32_to_bf16(rows))
    got_bf = run_bf16(host, rows_bf)
    got_fp = run_fp32(host, rows)
    for r in range(2):
        if vocab <= 4097:
            assert int(got_bf[r]) == reference_rule(rows_bf[r])
            assert int(got_fp[r]) == reference_rule(rows[r])
        else:  # the literal rule is too slow at 151936; the max must still be hit
            assert rows[r, got_fp[r]] == rows[r].max()
    assert np.array_equal(argmax.argmax_rule(rows_bf), got_bf)


def negative_rows(rng, vocab):
    """Rows with no positive value, around the rule's floor (-1e30, index 0), and what the
    rule gives (None: not index 0, the literal rule says which): random values in [-5, -1]
    with -5 first; -1e29 everywhere but a lower first value; exactly -1e30 (0); below the
    floor (0); the floor with one -1e29 last (vocab - 1); the BF16 value just above the
    floor with index 0 below it; index 0 below the floor and every other value exactly at
    it (0: equal to the floor never wins, also where a thread scans several values). Each
    value is exact in BF16 or rounds to the same side of the floor, so the expectations
    hold for both runners."""
    just_above = bf16_to_f32(np.uint16(f32_to_bf16(np.float32(-1e30)) - 1))
    rows = np.empty((7, vocab), np.float32)
    rows[0] = rng.integers(-5, 0, size=vocab)
    rows[0, 0] = -5
    rows[1] = -1e29
    rows[1, 0] = -2e29
    rows[2] = -1e30
    rows[3] = -3e30
    rows[4] = -1e30
    rows[4, -1] = -1e29
    rows[5] = just_above
    rows[5, 0] = -3e30
    rows[6] = -1e30
    rows[6, 0] = -3e30
    want = [None, None, 0, 0, vocab - 1, None, 0] if vocab > 1 else [0] * 7
    return rows, want


@pytest.mark.parametrize("vocab", [1, 7, 19, 111, 4097])
@pytest.mark.parametrize("runner", [run_bf16, run_fp32])
def test_all_negative_rows_start_from_the_floor(host, rng, vocab, runner):
    """No positive value: the rule's floor (-1e30, index 0), not 0, is what a value must
    beat, and only strictly (a row at or below -1e30 gives 0)."""
    rows, want = negative_rows(rng, vocab)
    seen = bf16_to_f32(f32_to_bf16(rows)) if runner is run_bf16 else rows
    got = [int(g) for g in runner(host, rows)]
    assert got == [reference_rule(r) for r in seen]
    assert all(g == w if w is not None else g != 0 for g, w in zip(got, want)), got
    assert rows[0, got[0]] == rows[0].max() < 0


def test_bad_sizes_raise_before_launch(host):
    from metrale import MetraleError
    with pytest.raises(MetraleError, match="vocab"):
        argmax.argmax_bf16(host, 0, 8, 8, 0)
    with pytest.raises(MetraleError, match="n_rows"):
        argmax.argmax_fp32(host, 0, 8, 8, 0, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [1, 7, 19, 111, 1023, 1024, 1025, 4097, 32000, 151936])
def test_gpu_matches_twin(device, host, rng, vocab):
    rows = rng.integers(-8, 9, size=(3, vocab)).astype(np.float32)
    rows[1, ::3] = np.nan
    rows[2] = -np.inf
    assert np.array_equal(run_bf16(device, rows), run_bf16(host, rows))
    assert np.array_equal(run_fp32(device, rows), run_fp32(host, rows))
    for positions in ((1, 2), (5, 1030), (3, 1027)):
        if max(positions) < vocab:
            row = tie_row(vocab, positions)[None]
            assert np.array_equal(run_bf16(device, row), run_bf16(host, row))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [1, 7, 19, 111, 4097])
def test_gpu_all_negative_rows_match_twin(device, host, rng, vocab):
    rows, want = negative_rows(rng, vocab)
    for runner in (run_bf16, run_fp32):
        got = runner(device, rows)
        assert np.array_equal(got, runner(host, rows)), runner.__name__
        assert all(g == w if w is not None else g != 0 for g, w in zip(got, want)), got


# -- masked host-greedy pick ------------------------------------------------------------------
NO_ID = argmax.NO_ID


def masked_reference(row, suppressed) -> int:
    """The rule written out in float64: the kept id with the largest (value, index)."""
    vals = [float(x) for x in np.asarray(row, np.float64)]
    kept = [i for i in range(len(vals)) if i not in set(suppressed)]
    if not kept or not all(np.isfinite(vals[i]) for i in kept):
        return NO_ID
    return max(kept, key=lambda i: (vals[i], i))


def run_masked(backend, rows_f32, masks, stride=None):
    rows = np.asarray(rows_f32, np.float32)
    n, v = rows.shape
    stride = stride or v
    bits = np.full((n, stride), f32_to_bf16(np.float32(1000.0)), np.uint16)
    bits[:, :v] = f32_to_bf16(rows)
    packed = argmax.pack_masks(masks, v)
    with Buffers(backend) as b:
        lp, mp, op = b.put(bits), b.put(packed), b.empty((n,), np.uint32)
        argmax.argmax_bf16_batch_masked(backend, backend.default_stream(), lp, mp, op, n, v,
                                        stride)
        return b.get(op, (n,), np.uint32)


def constructed_case(rng, width, case):
    """Twelve crafted rows per width: zeros, a floor, ties at both ends, the max suppressed,
    NaN/inf (kept and suppressed), everything suppressed, junk mask ids, -0 vs +0."""
    x = bf16_to_f32(f32_to_bf16(rng.standard_normal(width).astype(np.float32)))
    m = []
    if case == 0:
        x[:] = 0
    elif case == 1:
        x[:] = -3e30
    elif case == 2:
        x[0] = x[-1] = 100
    elif case == 3:
        m = [int(np.argmax(x))]
    elif case == 4:
        x[0] = np.nan
    elif case == 5:
        x[0] = np.inf
    elif case == 6:
        x[0] = -np.inf
    elif case == 7:
        x[0] = np.nan
        m = [0]
    elif case == 8:
        m = list(range(min(width, 8)))
    elif case == 9:
        m = [0, 0, NO_ID, width + 1]
    elif case == 10:
        x[:] = 0
        x[0] = -0.0
    elif case == 11:
        x[:] = -np.inf
    return x, m


@pytest.mark.parametrize("width", [1, 2, 7, 255, 256, 257, 1000])
def test_masked_crafted_cases_match_float64_reference(host, width):
    rng = np.random.default_rng(77)
    rows, masks = zip(*(constructed_case(rng, width, c) for c in range(12)))
    got = run_masked(host, np.stack(rows), list(masks))
    want = [masked_reference(r, m) for r, m in zip(rows, masks)]
    assert [int(g) for g in got] == want
    # the tie policy really is the last index, not the first or the device argmax's
    assert want[0] == width - 1 and want[10] == width - 1
    if width > 1:
        assert want[2] == width - 1 and int(argmax.argmax_rule(rows[2][None])[0]) == 0


def test_masked_rows_are_independent_and_stride_padding_is_never_read(host):
    rows = np.array([[4, 9, 9], [4, 9, 9], [np.nan, 2, 3]], np.float32)
    # stride 4: the padding column holds 1000, which must never win
    got = run_masked(host, rows, [[1], [1, 2], [0]], stride=4)
    assert list(got) == [2, 0, 2]


def test_masked_random_ties_match_reference(host, rng):
    rows = rng.integers(-4, 5, size=(6, 1500)).astype(np.float32)
    masks = [rng.choice(1500, size=k, replace=False).tolist() for k in (0, 1, 3, 8, 8, 2)]
    masks[4][0] = int(np.flatnonzero(rows[4] == rows[4].max())[-1])  # suppress the winner
    got = run_masked(host, rows, masks)
    assert [int(g) for g in got] == [masked_reference(r, m) for r, m in zip(rows, masks)]


def test_pack_masks_drops_repeats_and_junk_and_refuses_nine_ids():
    packed = argmax.pack_masks([[2, 2, 99, 4, -1], []], 10)
    assert packed[0, :2].tolist() == [2, 4] and (packed[0, 2:] == NO_ID).all()
    assert (packed[1] == NO_ID).all()
    assert argmax.pack_masks([list(range(9))], 10) is None
    assert argmax.pack_masks([list(range(9))], 8) is not None   # id 8 is out of range


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1, 7, 255, 256, 257, 1000, 32000])
def test_gpu_masked_matches_twin(device, host, rng, width):
    rows, masks = zip(*(constructed_case(rng, width, c) for c in range(12)))
    rows = np.stack(rows)
    assert np.array_equal(run_masked(device, rows, list(masks)), run_masked(host, rows, list(masks)))
    grid = rng.integers(-3, 4, size=(4, width)).astype(np.float32)
    gm = [rng.choice(width, size=min(width, k), replace=False).tolist() for k in (0, 1, 5, 8)]
    assert np.array_equal(run_masked(device, grid, gm, stride=width + 3),
                          run_masked(host, grid, gm, stride=width + 3))


# -- NaN / Inf count of logits rows ------------------------------------------------------------
def run_nonfinite(backend, rows, fp32, offset=0):
    """count_nonfinite over rows (float32 values; BF16 bits unless fp32), the rows placed
    `offset` elements into the buffer (a misaligned row takes the scalar path)."""
    rows = np.asarray(rows, np.float32)
    n, v = rows.shape
    data = rows if fp32 else f32_to_bf16(rows)
    flat = np.concatenate([np.zeros(offset, data.dtype), data.reshape(-1)])
    with Buffers(backend) as b:
        lp, op = b.put(flat), b.empty((n,), np.uint32)
        argmax.count_nonfinite(backend, backend.default_stream(),
                               lp.offset(offset * flat.itemsize), op, n, v, fp32=fp32)
        return b.get(op, (n,), np.uint32)


def nonfinite_rows(rng, vocab):
    """Rows with no, some, scattered and all non-finite values (NaN, +inf, -inf), and the
    largest finite BF16 / FP32 values, which must not count."""
    rows = rng.standard_normal((5, vocab)).astype(np.float32)
    rows[1, rng.integers(0, vocab, 3)] = np.nan
    rows[2, ::7] = np.inf
    rows[2, 3::11] = -np.inf
    rows[3] = np.nan
    rows[4, :] = 3.3e38          # finite in BF16 (max 3.39e38) and FP32
    rows[4, -1] = -np.inf
    return rows


@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize("vocab", [1, 7, 19, 111, 4097])
def test_count_nonfinite_twin_counts_exactly(host, rng, vocab, fp32):
    rows = nonfinite_rows(rng, vocab)
    want = [int(np.count_nonzero(~np.isfinite(r.astype(np.float64)))) for r in rows]
    assert list(run_nonfinite(host, rows, fp32)) == want
    assert list(argmax.nonfinite_counts(rows)) == want


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [1, 7, 19, 111, 1024, 4097, real(151936)])
def test_gpu_count_nonfinite_matches_twin(device, host, rng, vocab):
    rows = nonfinite_rows(rng, vocab)
    for fp32 in (False, True):
        for offset in (0, 1):          # the 128-bit path and the scalar one
            assert np.array_equal(run_nonfinite(device, rows, fp32, offset),
                                  run_nonfinite(host, rows, fp32, offset))
