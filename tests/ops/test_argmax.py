"""argmax family: the twin reproduces the original kernel's rule bit for bit (DESIGN §2)."""
import numpy as np
import pytest

from metrale.ops import argmax
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
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
