"""Sliding-window layers in the paged cache (model_engine/kv_groups.py): their blocks are
released by the block pool once no live query's window reads them, so a long sequence holds
at most ceil(window / block_size) + 1 blocks of each such layer; the window pool is sized
for a step's rows; prefix caching restores only what it can; rollback is refused past what
the window layers kept. The logits stay those of the unreleased cache (the goldens of every
windowed fixture run with release on: test_golden.py, test_field_fixtures.py)."""
import numpy as np
import pytest

import metrale
from metrale.errors import InvalidArgument
from metrale.formats.source import MemorySource
from metrale.gpu_runtime import HostBackend
from metrale.kv.block_pool import EVICTED
from tests.model.common import logits_rows

WINDOW, BS = 64, 16
BOUND = -(-WINDOW // BS) + 1           # blocks a sequence may hold per sliding layer
GEMMA3 = dict(model_type="gemma3_text", vocab_size=128, hidden_size=32, intermediate_size=64,
              num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              sliding_window=WINDOW, sliding_window_pattern=6, max_position_embeddings=16384)


def model(**kw):
    return metrale.load(MemorySource(GEMMA3, seed=3), HostBackend(), progress=False,
                        block_size=BS, **kw)


def held(seq):
    return [b for b in seq.window_table if b != EVICTED]


def test_an_8k_sequence_holds_at_most_window_plus_one_block_per_sliding_layer():
    m = model(max_prefill_tokens=2048, kv_blocks=600, max_batch=4)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 128, 8192).tolist()
    s = m.default_stream()
    seq = m.alloc_sequence()
    m.prefill(ids, seq, s)                       # four passes of 2048 tokens
    full, win = m._kv_groups
    assert len(win.layers) == 5 and len(full.layers) == 1
    assert len(seq.block_table) == 512 and len(seq.window_table) == 512
    assert len(held(seq)) <= BOUND, len(held(seq))
    for t in rng.integers(3, 128, 40).tolist():  # decode steps keep the bound
        m.decode(int(t), seq, s)
        assert len(held(seq)) <= BOUND
    assert m.decode_verify(rng.integers(3, 128, 6).tolist(), seq, s)
    assert len(held(seq)) <= BOUND + 1           # a step's new block, until the next step
    # the window pool: sized for the step's rows, not for the context, and what is not
    # held is back in it (or in the prefix cache: the prompt's last window blocks)
    assert win.pool.num_total() < 0.5 * full.pool.num_total()
    assert len(held(seq)) <= win.pool.num_total() - win.pool.num_free() <= \
        len(held(seq)) + win.pool.num_cached()
    # bytes the sequence holds in the sliding layers vs what a full cache would hold
    per_block = 2 * BS * 1 * 16 * 2
    kept = len(held(seq)) * per_block * len(win.layers)
    unbounded = len(seq.window_table) * per_block * len(win.layers)
    assert kept / unbounded < 0.011
    m.free_sequence(seq)   # what stays held is the prompt's prefix-cache entries
    for g in (full, win):
        assert g.pool.num_free() + g.pool.num_cached() == g.pool.num_total()
    assert win.pool.num_cached() <= BOUND and full.pool.num_cached() == 512


def test_rollback_past_the_released_window_is_refused():
    m = model()
    ids = list(range(3, 103))
    seq = m.alloc_sequence()
    m.prefill(ids, seq, m.default_stream())
    # the query at 100 reads keys from 37 on: blocks 0-1 released, so a query at p < 95
    # (whose window starts before position 32) cannot run any more
    assert seq.window_table[:3] == [EVICTED, EVICTED, seq.window_table[2]] and \
        seq.window_table[2] != EVICTED
    m.rollback(seq, 5)                           # to 95: its window starts at 32
    with pytest.raises(InvalidArgument, match="released .* from position 95"):
        m.rollback(seq, 1)
    assert seq.seq_len == 95                     # nothing changed
    m.decode(5, seq, m.default_stream())
    m.rollback(seq, seq.seq_len)                 # back to empty: always possible
    assert seq.seq_len == 0 and seq.window_table == []


def test_prefix_cache_reuses_only_what_the_window_layers_can_restore():
    m = model()
    s = m.default_stream()
    rng = np.random.default_rng(1)
    a = rng.integers(3, 128, 200).tolist()
    first = m.alloc_sequence()
    m.prefill(a, first, s)                       # caches full blocks 0-11, window 8-11
    cont = a + rng.integers(3, 128, 9).tolist()
    seq = m.alloc_sequence()
    got = logits_rows(m, m.prefill(cont, seq, s))
    assert seq.window_table[:8] == [EVICTED] * 8
    ref = model()
    want = logits_rows(ref, ref.prefill(cont, ref.alloc_sequence(), s))
    assert np.array_equal(got, want)
    # a prompt sharing only the first 100 tokens: its window blocks are gone, no reuse
    other = a[:100] + rng.integers(3, 128, 30).tolist()
    seq2 = m.alloc_sequence()
    assert m.reuse_prefix(seq2, other) == 0
    got2 = logits_rows(m, m.prefill(other, seq2, s))
    want2 = logits_rows(ref, ref.prefill(other, ref.alloc_sequence(), s))
    assert np.array_equal(got2, want2)


def test_forks_and_batches_share_window_blocks_exactly():
    m = model()
    s = m.default_stream()
    ids = list(range(3, 93))
    seq = m.alloc_sequence()
    m.prefill(ids, seq, s)
    twin = m.fork_sequence(seq)                  # shares every held block (copy on write)
    a = logits_rows(m, m.decode(7, seq, s))
    b = logits_rows(m, m.decode(7, twin, s))
    assert np.array_equal(a, b)
    batch = logits_rows(m, m.decode_batch([9, 9], [seq, twin], s), 2)
    assert np.array_equal(batch[0], batch[1])


def test_info_shows_kv_bytes_per_token_of_full_and_windowed_layers(tmp_path, capsys):
    import json

    from metrale.cli import main
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GEMMA3))
    src = MemorySource(GEMMA3)
    from tests.formats.st_util import tensors_bytes
    (d / "model.safetensors").write_bytes(tensors_bytes(
        {n: ("BF16", src.read_bf16(n)) for n in src.tensor_names()}))
    assert main(["info", str(d)]) == 0
    out = capsys.readouterr().out
    assert "KV cache       64 B per token in 1 full layer" in out
    assert ("320 B per token in 5 sliding-window layers (window 64: at most 5 blocks of 16 "
            "tokens, 25.0 KiB, held per sequence)") in out
    assert main(["info", str(d), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kv_bytes_per_token_full_layers"] == 64
    assert info["kv_bytes_per_token_window_layers"] == 320
    assert info["kv_bytes_per_token"] == 384
