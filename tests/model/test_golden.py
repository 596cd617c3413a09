"""The whole decoder path against golden Hugging Face logits, through every forward method of
the pointer API, for every fixture architecture: on HostBackend (the twins), and on the
EmuBackend (the CUDA sources themselves; marked `gpu`, so it runs with the kernel tests)."""
import numpy as np
import pytest

from metrale.gpu_runtime import backend
from metrale.model_engine import PrefillSlice
from metrale.ops.argmax import argmax_rule
from tests.conftest import emu_available
from tests.model.common import (DECODER_FIXTURES, FAMILY_FIXTURES, assert_matches_golden, golden,
                                load, logits_rows)

BACKENDS = ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])]


@pytest.fixture(params=BACKENDS)
def device_name(request):
    return request.param


@pytest.fixture(params=DECODER_FIXTURES + FAMILY_FIXTURES)
def case(request, device_name):
    name = request.param
    return name, load(name, backend(device_name)), golden(name)


def test_prefill_last_logits(case):
    name, m, g = case
    ids = g["input_ids"][0].tolist()
    seq = m.alloc_sequence()
    ptr = m.prefill(ids, seq, m.default_stream())
    assert seq.seq_len == len(ids) and len(seq.block_table) == -(-len(ids) // m.kv_block_size())
    got = logits_rows(m, ptr)
    assert_matches_golden(got, g["logits"][-1], f"{name} prefill")
    # device argmax follows the rule on the very row it read
    assert m.argmax_on_device(ptr, m.default_stream()) == int(argmax_rule(got)[0])


@pytest.mark.parametrize("splits", [(1,), (5, 7), (3, 9, 15), (16, 17)])
def test_prefill_chunks_then_teacher_forced_decode(case, splits):
    name, m, g = case
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    seq = m.alloc_sequence()
    bounds = [0, *splits]
    for a, b in zip(bounds[:-1], bounds[1:]):
        last = b == bounds[-1]
        p = m.prefill_chunk(ids[:bounds[-1]], seq, a, b - a, last, s)
        assert p.is_null() != last
    assert_matches_golden(logits_rows(m, p), g["logits"][bounds[-1] - 1], f"{name} chunked")
    rows = []
    for t in range(bounds[-1], len(ids)):
        rows.append(logits_rows(m, m.decode(ids[t], seq, s))[0])
    assert_matches_golden(np.stack(rows), g["logits"][bounds[-1]:], f"{name} decode")


def test_chunked_prefill_equals_whole_prefill_bits(case):
    """A prompt prefilled in chunks against its cached prefix gives the whole prompt's logits
    and the same decode steps after it, bit for bit (the prefill attention aligns its key
    tiles to absolute positions; on these fixtures' head dims it is the tensor-core one)."""
    name, m, g = case
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    whole = m.alloc_sequence()
    want = [logits_rows(m, m.prefill(ids[:20], whole, s))]
    want += [logits_rows(m, m.decode(t, whole, s)) for t in ids[20:23]]
    for bounds in ((0, 5, 12, 20), (0, 1, 2, 19, 20)):
        seq = m.alloc_sequence()
        for a, b in zip(bounds[:-1], bounds[1:]):
            p = m.prefill_chunk(ids[:20], seq, a, b - a, b == 20, s)
        got = [logits_rows(m, p)] + [logits_rows(m, m.decode(t, seq, s)) for t in ids[20:23]]
        for i, (x, y) in enumerate(zip(got, want)):
            assert np.array_equal(x, y), f"{name}: chunks {bounds}, row {i} != whole prefill"
        m.free_sequence(seq)


def test_decode_batch_mixed_lengths_is_batch_invariant(case):
    name, m, g = case
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    lens = [3, 11, 1, 18, 7]
    seqs = []
    for L in lens:
        seq = m.alloc_sequence()
        m.prefill(ids[:L], seq, s)
        seqs.append(seq)
    ptr = m.decode_batch([ids[L] for L in lens], seqs, s)
    batch_bits = np.empty((len(lens), m.vocab_size()), np.uint16)
    m.copy_logits_to_host(ptr, batch_bits.view(np.uint8).reshape(-1))
    got = logits_rows(m, ptr, len(lens))
    assert_matches_golden(got, g["logits"][lens], f"{name} decode_batch")
    assert m.argmax_batch(ptr, len(lens), s) == [int(x) for x in argmax_rule(got)]
    # each row equals the same step run alone, bit for bit
    for i, L in enumerate(lens):
        solo = m.alloc_sequence()
        m.prefill(ids[:L], solo, s)
        p = m.decode(ids[L], solo, s)
        bits = np.empty(m.vocab_size(), np.uint16)
        m.copy_logits_to_host(p, bits.view(np.uint8))
        assert np.array_equal(bits, batch_bits[i]), f"{name}: row {i} depends on the batch"


def test_decode_verify_rows_equal_decode_steps(case):
    name, m, g = case
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    seq = m.alloc_sequence()
    m.prefill(ids[:10], seq, s)
    out = m.decode_verify(ids[10:16], seq, s)
    rows = logits_rows(m, m.logits_buffer_ptr(), 6)
    assert out == [int(x) for x in argmax_rule(rows)]
    assert_matches_golden(rows, g["logits"][10:16], f"{name} verify")
    m.rollback(seq, 3)
    assert seq.seq_len == 13 and seq.tokens == ids[:13]
    ref = m.alloc_sequence()
    m.prefill(ids[:10], ref, s)
    for t in range(10, 16):
        want = logits_rows(m, m.decode(ids[t], ref, s))[0]
        assert np.array_equal(want, rows[t - 10]), f"{name}: verify row {t} != decode step"


def test_batched_prefill_defaults_place_rows(case):
    name, m, g = case
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    a, b, c = m.alloc_sequence(), m.alloc_sequence(), m.alloc_sequence()
    m.prefill(ids[:4], c, s)
    rows_ptr, ptrs = m.mixed_forward_batch(
        [ids[4]], [c],
        [PrefillSlice(ids[:9], a, 0, 9, True), PrefillSlice(ids[:20], b, 0, 8, False)], s)
    assert ptrs[1].is_null() and not ptrs[0].is_null()
    got = logits_rows(m, m.logits_buffer_ptr(), 2)
    assert_matches_golden(got, g["logits"][[4, 8]], f"{name} mixed_forward_batch")


def test_fp32_logits_and_graphs(case):
    name, m0, g = case
    m = load(name, m0.backend, fp32_logits=True, graphs=True)
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    seq = m.alloc_sequence()
    p = m.prefill(ids[:12], seq, s)
    assert m.logits_ptr_is_fp32(p) and m.decode_logits_fp32()
    rows = [logits_rows(m, p)[0]]
    for t in range(12, 20):
        p = m.decode(ids[t], seq, s)
        assert p == m.decode_logits_ptr()
        rows.append(logits_rows(m, p)[0])
    assert_matches_golden(np.stack(rows), g["logits"][11:20], f"{name} fp32+graphs")
    # graph replay equals eager bit for bit
    eager = load(name, m0.backend, fp32_logits=True, graphs=False)
    e_seq = eager.alloc_sequence()
    eager.prefill(ids[:12], e_seq, s)
    for t in range(12, 20):
        pe = eager.decode(ids[t], e_seq, s)
    assert np.array_equal(logits_rows(eager, pe), rows[-1][None])
