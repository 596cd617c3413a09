"""tensor_parallel family: the rank-order sum of FP32 partials, the logits-shard concat and
the vocabulary-shard embedding, twins against formulas and kernels (emu) against twins."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import tensor_parallel as tp
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close, real
from tests.helpers import Buffers


def run_sum(backend, partials, offset_elems=0):
    r, c = partials.shape
    c -= offset_elems
    flat = np.ascontiguousarray(partials[:, offset_elems:]).reshape(-1)
    with Buffers(backend) as b:
        pp = b.put(np.concatenate([np.zeros(offset_elems, np.float32), flat]))
        op = b.empty((c + offset_elems,), np.uint16)
        tp.tp_sum_partials(backend, backend.default_stream(), op.offset(2 * offset_elems),
                           pp.offset(4 * offset_elems), c, r)
        return b.get(op, (c + offset_elems,), np.uint16)[offset_elems:]


def run_concat(backend, shards, row_bytes):
    k, n, sb = shards.shape
    with Buffers(backend) as b:
        sp = b.put(shards)
        op = b.empty((n, row_bytes), np.uint8)
        tp.tp_concat_shards(backend, backend.default_stream(), op, sp, n, row_bytes, sb, k)
        return b.get(op, (n, row_bytes), np.uint8)


def run_embedding(backend, table, ids, vocab_start):
    rows, h = table.shape
    with Buffers(backend) as b:
        tp_, ip = b.put(table), b.put(np.asarray(ids, np.int32))
        op = b.empty((len(ids), h), np.float32)
        tp.tp_embedding_shard(backend, backend.default_stream(), op, tp_, ip, len(ids), h,
                              vocab_start, rows)
        return b.get(op, (len(ids), h), np.float32)


def test_entry_points_exist():
    assert set(kernel_source.entry_points(tp.MODULE)) == {
        "tp_sum_partials", "tp_concat_shards", "tp_embedding_shard"}


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("count", [1, 7, 19, 111, 4097, 4096])
def test_sum_partials_matches_float64(host, rng, ranks, count):
    p = (rng.standard_normal((ranks, count)) * 3).astype(np.float32)
    got = run_sum(host, p)
    assert_close(bf16_to_f32(got), p.astype(np.float64).sum(0), "twin_bf16")
    # the fixed order: ((p0 + p1) + p2) + ... in float32, one rounding to bf16
    s = p[0].copy()
    for r in range(1, ranks):
        s = s + p[r]
    assert np.array_equal(got, f32_to_bf16(s))


def test_sum_partials_order_is_rank_order_not_pairwise(host):
    # 1 + 2^-24 + 2^-24 + ... : rank order loses every small term, a tree would keep some
    p = np.array([[1.0], [2.0**-24], [2.0**-24], [2.0**-24]], np.float32)
    got = bf16_to_f32(run_sum(host, p))
    assert got[0] == 1.0


def test_sum_partials_flushes_subnormals(host):
    tiny = np.float32(2.0**-130)   # subnormal in float32
    p = np.array([[tiny, 2.0**-125, -(2.0**-126), 5.0],
                  [tiny, -(2.0**-125) + 2.0**-127, 2.0**-127, -5.0]], np.float32)
    got = run_sum(host, p)
    # DAZ: tiny + tiny is 0, not 2^-129, and -2^-126 + 2^-127 is -2^-126; FTZ: the
    # subnormal 2^-127 = 2^-125 - (2^-125 - 2^-127) becomes a zero
    assert got[0] == 0
    assert bf16_to_f32(got)[1] == 0
    assert bf16_to_f32(got)[2] == np.float32(-(2.0**-126))
    assert got[3] == 0


def test_sum_partials_unaligned(host, rng):
    p = rng.standard_normal((3, 41)).astype(np.float32)
    got = run_sum(host, p, offset_elems=1)
    s = p[0, 1:] + p[1, 1:] + p[2, 1:]
    assert np.array_equal(got, f32_to_bf16(s))


@pytest.mark.parametrize("ranks,rows,row_elems,esize", [(2, 1, 256, 2), (2, 3, 255, 2),
                                                        (3, 7, 19, 4), (8, 5, 1000, 2),
                                                        (4, 2, 4097, 4)])
def test_concat_shards_matches_formula(host, rng, ranks, rows, row_elems, esize):
    shard = -(-row_elems // ranks)
    shards = rng.integers(0, 256, (ranks, rows, shard * esize), dtype=np.uint8)
    got = run_concat(host, shards, row_elems * esize)
    for r in range(rows):
        want = np.concatenate([shards[k, r] for k in range(ranks)])[:row_elems * esize]
        assert np.array_equal(got[r], want)


def test_concat_shards_drops_whole_padding_shards(host, rng):
    shards = rng.integers(0, 256, (4, 2, 6), dtype=np.uint8)
    got = run_concat(host, shards, 10)       # the third shard is cut, the fourth unused
    assert np.array_equal(got[1], np.concatenate([shards[0, 1], shards[1, 1, :4]]))


@pytest.mark.parametrize("hidden", [1, 7, 64, 4097])
def test_embedding_shard_matches_formula(host, rng, hidden):
    table = f32_to_bf16(rng.standard_normal((19, hidden)).astype(np.float32))
    start = 40
    ids = [40, 3, 58, 59, 41, 100, 0, 57]
    got = run_embedding(host, table, ids, start)
    for t, i in enumerate(ids):
        want = bf16_to_f32(table[i - start]) if start <= i < start + 19 else np.zeros(hidden)
        assert np.array_equal(got[t], want), (t, i)


def test_embedding_shards_sum_to_the_embedding(host, rng):
    vocab, hidden, ranks = 50, 24, 4
    shard = -(-vocab // ranks)
    full = f32_to_bf16(rng.standard_normal((ranks * shard, hidden)).astype(np.float32))
    ids = rng.integers(0, vocab, 33)
    parts = np.stack([run_embedding(host, full[k * shard:(k + 1) * shard], ids, k * shard)
                      for k in range(ranks)])
    summed = run_sum(host, parts.reshape(ranks, -1)).reshape(len(ids), hidden)
    assert np.array_equal(summed, full[ids])


def test_bad_arguments_raise_before_launch(host):
    with pytest.raises(InvalidArgument, match="count"):
        tp.tp_sum_partials(host, 0, 8, 8, 0, 2)
    with pytest.raises(InvalidArgument, match="n_ranks"):
        tp.tp_sum_partials(host, 0, 8, 8, 4, 0)
    with pytest.raises(InvalidArgument, match="n_ranks"):
        tp.tp_sum_partials(host, 0, 8, 8, 4, 65)
    with pytest.raises(InvalidArgument, match="NULL"):
        tp.tp_sum_partials(host, 0, 0, 8, 4, 2)
    with pytest.raises(InvalidArgument, match="exceed"):
        tp.tp_concat_shards(host, 0, 8, 8, 1, 20, 4, 2)
    with pytest.raises(InvalidArgument, match="vocab_start"):
        tp.tp_embedding_shard(host, 0, 8, 8, 8, 1, 4, -1, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks,count", [(1, 7), (2, 1), (2, 19), (3, 111), (2, 4097),
                                         (8, 4096), real(8, 64 * 8192), real(4, 2048 * 8192)])
@pytest.mark.parametrize("offset", [0, 1])
def test_gpu_sum_partials_matches_twin(device, host, rng, ranks, count, offset):
    p = (rng.standard_normal((ranks, count + offset)) * 4).astype(np.float32)
    p[:, ::7] *= np.float32(2.0**-124)   # near and below the smallest normal: FTZ paths
    assert np.array_equal(run_sum(device, p, offset), run_sum(host, p, offset))


@pytest.mark.gpu
@pytest.mark.parametrize("ranks,rows,row_bytes", [(2, 1, 512), (2, 3, 510), (3, 7, 76),
                                                  (8, 4, 2002), real(8, 64, 128256 * 2),
                                                  real(4, 16, 152064 * 4)])
def test_gpu_concat_shards_matches_twin(device, host, rng, ranks, rows, row_bytes):
    shard = -(-row_bytes // ranks)
    shards = rng.integers(0, 256, (ranks, rows, shard), dtype=np.uint8)
    assert np.array_equal(run_concat(device, shards, row_bytes),
                          run_concat(host, shards, row_bytes))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden,start", [(1, 1, 0), (7, 19, 3), (19, 111, 100),
                                               (64, 4097, 7), real(16032, 8192, 16032)])
def test_gpu_embedding_shard_matches_twin(device, host, rng, rows, hidden, start):
    table = f32_to_bf16(rng.standard_normal((rows, hidden)).astype(np.float32))
    ids = rng.integers(0, start + 2 * rows, 23)
    assert np.array_equal(run_embedding(device, table, ids, start),
                          run_embedding(host, table, ids, start))
