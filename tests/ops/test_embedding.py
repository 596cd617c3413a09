"""embedding family: row gather; out-of-range ids give zero rows and read nothing; GGUF
tables kept at their bytes give dequant_bf16's rows on lookup."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.formats.gguf.packed import split_blocks
from metrale.gpu_runtime import NULL, kernel_source
from metrale.ops import embedding
from metrale.ops.bf16 import f32_to_bf16
from metrale.ops.gguf_planes import PACKED, dequant_bf16
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


# ------------------------------------------- GGUF tables: rows dequantized on lookup
GGUF_TYPES = sorted(PACKED)
GGUF_NAMES = [PACKED[t].name for t in GGUF_TYPES]


def run_gguf(backend, p, ids, out_byte_offset=0):
    """embedding_gguf_{type} launched by its contract (grid (n_tokens,), block 128; ids in
    range), out placed `out_byte_offset` bytes past an aligned address; returns the rows and
    whether the bytes around them kept their sentinel."""
    ids = np.asarray(ids, np.int32)
    n, k = ids.size, p.k
    pad = out_byte_offset // 2
    with Buffers(backend) as b:
        op = b.put(np.full(pad + n * k + 8, 0x7BAD, np.uint16))
        qh = NULL if p.qh is None else b.put(p.qh)
        name = f"embedding_gguf_{PACKED[p.ggml_type].name.lower()}"
        kernel = backend.kernel(embedding.MODULE, name)
        backend.launch(kernel, (n,), (embedding.THREADS,), 0, backend.default_stream(),
                       (op.offset(out_byte_offset), b.put(ids), b.put(p.q), qh, b.put(p.meta),
                        np.int32(n), np.int32(k)))
        raw = b.get(op, (pad + n * k + 8,), np.uint16)
    kept = (raw[:pad] == 0x7BAD).all() and (raw[pad + n * k:] == 0x7BAD).all()
    return raw[pad:pad + n * k].reshape(n, k), kept


def test_gguf_entry_points_exist():
    names = set(kernel_source.entry_points(embedding.MODULE))
    assert {f"embedding_gguf_{PACKED[t].name.lower()}" for t in GGUF_TYPES} <= names


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=GGUF_NAMES)
def test_gpu_gguf_rows_are_the_planes_bits(device, ggml_type):
    """Random stored bytes (NaN, infinite and subnormal scales among them): each token's
    row is dequant_bf16's row bit for bit (sign of zero, canonical NaN), at k = one block,
    several, and a real hidden size, out aligned (16-byte stores) or not (element
    stores), nothing written around the rows."""
    t = PACKED[ggml_type]
    rng = np.random.default_rng([5, ggml_type])
    vocab = 37
    for k in ((32, 7 * 32, 896) if t.qk == 32 else (256, 3 * 256, 1536)):
        raw = rng.integers(0, 256, vocab * k // t.qk * t.block_bytes, dtype=np.uint8)
        p = split_blocks(raw, ggml_type, vocab, k)
        with np.errstate(invalid="ignore", over="ignore"):   # inf * 0 scales
            table = dequant_bf16(p.q, p.qh, p.meta, ggml_type, k)
        ids = rng.integers(0, vocab, 19)
        ids[:3] = [0, vocab - 1, 0]
        for offset in (0, 2):
            got, kept = run_gguf(device, p, ids, offset)
            assert np.array_equal(got, table[ids]), (k, offset)
            assert kept, (k, offset)
