"""embedding family: row gather; out-of-range ids give zero rows and read nothing."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import embedding
from metrale.ops.bf16 import f32_to_bf16
from tests.helpers import Buffers


def run(backend, table_bits, ids):
    vocab, hidden = table_bits.shape
    ids = np.asarray(ids, np.int32)
    n = ids.size
    with Buffers(backend) as b:
        tp, ip, op = b.put(table_bits), b.put(ids), b.empty((n, hidden), np.uint16)
        embedding.embedding(backend, backend.default_stream(), op, tp, ip, n, hidden, vocab)
        return b.get(op, (n, hidden), np.uint16)


def make_table(rng, vocab, hidden):
    return f32_to_bf16(rng.standard_normal((vocab, hidden)).astype(np.float32))


def reference(table, ids):
    ids = np.asarray(ids, np.int64)
    out = np.zeros((ids.size, table.shape[1]), np.uint16)
    ok = (ids >= 0) & (ids < table.shape[0])
    out[ok] = table[ids[ok]]
    return out


def test_entry_points_exist():
    assert "embedding" in kernel_source.entry_points(embedding.MODULE)


@pytest.mark.parametrize("hidden", [1, 7, 19, 111, 4097, 4096])
@pytest.mark.parametrize("n_tokens", [1, 7, 19])
def test_gather_matches_reference(host, rng, hidden, n_tokens):
    vocab = 37
    table = make_table(rng, vocab, hidden)
    ids = rng.integers(0, vocab, n_tokens)
    assert np.array_equal(run(host, table, ids), reference(table, ids))


def test_out_of_range_ids_give_zero_rows(host, rng):
    vocab, hidden = 11, 24
    table = make_table(rng, vocab, hidden)
    ids = [0, -1, 10, 11, 2**31 - 1, -(2**31), 5]
    got = run(host, table, ids)
    assert np.array_equal(got, reference(table, ids))
    assert not got[[1, 3, 4, 5]].any()
    assert np.array_equal(got[2], table[10])


def test_bad_sizes_raise_before_launch(host):
    for args, name in (((0, 8, 8), "n_tokens"), ((1, 0, 8), "hidden"), ((1, 8, 0), "vocab")):
        with pytest.raises(InvalidArgument, match=name):
            embedding.embedding(host, 0, 8, 8, 8, *args)
    with pytest.raises(InvalidArgument, match="NULL"):
        embedding.embedding(host, 0, 8, 0, 8, 1, 1, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [1, 7, 19, 111, 4097, 4096, 3584, 5120])
def test_gpu_matches_twin(device, host, rng, hidden):
    vocab = 1000
    table = make_table(rng, vocab, hidden)
    ids = rng.integers(0, vocab, 300)
    ids[::17] = -5
    ids[::23] = vocab
    assert np.array_equal(run(device, table, ids), run(host, table, ids))
