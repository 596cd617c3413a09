"""The hybrid linear-attention models (qwen3_5_text, qwen3_next, qwen3_5_moe_text) against
golden Hugging Face fp32 logits of 100-token prompts (longer than one 64-token chunk of the
gated delta rule), through the pointer API's forward paths, on HostBackend (the twins) and
on the EmuBackend (the CUDA sources; `gpu`): prefill, chunked prefill then teacher-forced
decode, bit-equal splits at chunk boundaries, batch invariance, verify rows, batched and
mixed prefill, FP32 logits and decode graphs."""
import numpy as np
import pytest

from metrale.gpu_runtime import backend
from metrale.model_engine import HybridModel, PrefillSlice
from metrale.ops.argmax import argmax_rule
from tests.conftest import emu_available
from tests.model.common import assert_matches_golden, golden, load, logits_rows

# qwen3_5_vl: a released-style qwen3_5 checkpoint (text model under model.language_model.*,
# a vision tower and an MTP head skipped by name); nemotron_h: Mamba2 layers (chunk 32)
HYBRID_FIXTURES = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_vl", "nemotron_h"]
BACKENDS = ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])]


@pytest.fixture(params=BACKENDS)
def device_name(request):
    return request.param


@pytest.fixture(params=HYBRID_FIXTURES)
def case(request, device_name):
    name = request.param
    return name, load(name, backend(device_name)), golden(name)


def bits(m, ptr, n=1):
    out = np.empty((n, m.vocab_size()), np.uint16)
    m.copy_logits_to_host(ptr, out.view(np.uint8).reshape(-1))
    return out


def test_loads_as_a_hybrid_model(case):
    name, m, g = case
    assert isinstance(m, HybridModel) and m.has_ssm_layers()
    assert m.state_bytes_per_sequence() > 0 and m.state_pool_bytes() > m.state_bytes_per_sequence()


def test_prefill_last_logits(case):
    name, m, g = case
    ids = g["input_ids"][0].tolist()
    seq = m.alloc_sequence()
    ptr = m.prefill(ids, seq, m.default_stream())
    got = logits_rows(m, ptr)
    assert_matches_golden(got, g["logits"][-1], f"{name} prefill")
    assert m.argmax_on_device(ptr, m.default_stream()) == int(argmax_rule(got)[0])


@pytest.mark.parametrize("splits", [(70,), (30, 64, 81), (1, 65, 66)])
def test_chunked_prefill_then_teacher_forced_decode(case, splits):
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
    end = len(ids) if m.backend.name == "cpu" else bounds[-1] + 6   # emu: fewer steps
    rows = [logits_rows(m, m.decode(ids[t], seq, s))[0] for t in range(bounds[-1], end)]
    assert_matches_golden(np.stack(rows), g["logits"][bounds[-1]:end], f"{name} decode")


def test_prefill_split_at_the_chunk_boundary_is_bit_equal(case):
    """Prefilled whole or split at 64 (the gated delta rule's chunk): the same bits, and the
    same decode steps after; split elsewhere: within the tolerance."""
    name, m, g = case
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    whole = m.alloc_sequence()
    want = [bits(m, m.prefill(ids[:90], whole, s))]
    want += [bits(m, m.decode(t, whole, s)) for t in ids[90:93]]
    for bounds, exact in (((0, 64, 90), True), ((0, 40, 64, 90), True), ((0, 33, 90), False)):
        seq = m.alloc_sequence()
        for a, b in zip(bounds[:-1], bounds[1:]):
            p = m.prefill_chunk(ids[:90], seq, a, b - a, b == 90, s)
        if not exact:
            assert_matches_golden(logits_rows(m, p), g["logits"][89], f"{name} split 33")
            m.free_sequence(seq)
            continue
        got = [bits(m, p)] + [bits(m, m.decode(t, seq, s)) for t in ids[90:93]]
        for i, (x, y) in enumerate(zip(got, want)):
            assert np.array_equal(x, y), f"{name}: chunks {bounds}, row {i} != one pass"
        m.free_sequence(seq)


def test_decode_batch_is_batch_invariant(case):
    name, m, g = case
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    lens = [3, 70, 1, 64, 99]
    seqs = []
    for L in lens:
        seq = m.alloc_sequence()
        m.prefill(ids[:L], seq, s)
        seqs.append(seq)
    ptr = m.decode_batch([ids[L] for L in lens], seqs, s)
    batch = bits(m, ptr, len(lens))
    got = logits_rows(m, ptr, len(lens))
    assert_matches_golden(got[[1, 3]], g["logits"][[70, 64]], f"{name} decode_batch")
    for i, L in enumerate(lens):
        solo = m.alloc_sequence()
        m.prefill(ids[:L], solo, s)
        assert np.array_equal(bits(m, m.decode(ids[L], solo, s))[0], batch[i]), \
            f"{name}: row {i} depends on the batch"
        m.free_sequence(solo)


def test_decode_verify_rows_equal_decode_steps_and_rollback_rewinds_the_state(case):
    name, m, g = case
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    seq, ref = m.alloc_sequence(), m.alloc_sequence()
    m.prefill(ids[:66], seq, s)
    m.prefill(ids[:66], ref, s)
    out = m.decode_verify(ids[66:72], seq, s)
    rows = bits(m, m.logits_buffer_ptr(), 6)
    assert out == [int(x) for x in argmax_rule(logits_rows(m, m.logits_buffer_ptr(), 6))]
    steps = [bits(m, m.decode(t, ref, s))[0] for t in ids[66:72]]
    assert all(np.array_equal(a, b) for a, b in zip(rows, steps)), f"{name}: verify != decode"
    m.rollback(seq, 4)   # keep 2 of the 6 rows: the state after them, not after all 6
    assert seq.seq_len == 68
    again = [bits(m, m.decode(t, seq, s))[0] for t in ids[68:71]]
    ref2 = m.alloc_sequence()
    m.prefill(ids[:66], ref2, s)
    m.decode(ids[66], ref2, s)
    m.decode(ids[67], ref2, s)
    want = [bits(m, m.decode(t, ref2, s))[0] for t in ids[68:71]]
    assert all(np.array_equal(a, b) for a, b in zip(again, want)), f"{name}: rollback state"


def test_batched_and_mixed_prefill_rows_equal_solo_prefills(case):
    name, m, g = case
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    solo = []
    for L in (70, 9, 80):
        q = m.alloc_sequence()
        solo.append(bits(m, m.prefill(ids[:L], q, s))[0])
        m.free_sequence(q)
    a, b, c, d = (m.alloc_sequence() for _ in range(4))
    m.prefill(ids[:4], d, s)
    rows_ptr, ptrs = m.mixed_forward_batch(
        [ids[4]], [d], [PrefillSlice(ids[:70], a, 0, 70, True),
                        PrefillSlice(ids[:9], b, 0, 9, True),
                        PrefillSlice(ids[:100], c, 0, 80, False)], s)
    assert ptrs[2].is_null()
    got = bits(m, m.logits_buffer_ptr(), 3)
    assert np.array_equal(got[1], solo[0]) and np.array_equal(got[2], solo[1])
    assert_matches_golden(logits_rows(m, rows_ptr), g["logits"][4], f"{name} mixed decode")
    p = m.prefill_chunk(ids, c, 80, 20, True, s)   # the chunked one finishes alone
    assert_matches_golden(logits_rows(m, p), g["logits"][99], f"{name} mixed chunk")


def test_fp32_logits_and_decode_graphs_equal_eager(case):
    name, m0, g = case
    m = load(name, m0.backend, fp32_logits=True, graphs=True)
    eager = load(name, m0.backend, fp32_logits=True, graphs=False)
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    seqs = [m.alloc_sequence(), m.alloc_sequence()]
    eseqs = [eager.alloc_sequence(), eager.alloc_sequence()]
    for mm, ss in ((m, seqs), (eager, eseqs)):
        mm.prefill(ids[:65], ss[0], s)
        mm.prefill(ids[:30], ss[1], s)
    for t in range(3):   # a batch of 2 on a graph padded to its rung (padding: the sink)
        p = m.decode_batch([ids[65 + t], ids[30 + t]], seqs, s)
        pe = eager.decode_batch([ids[65 + t], ids[30 + t]], eseqs, s)
        assert m.logits_ptr_is_fp32(p)
        got = logits_rows(m, p, 2)
        assert np.array_equal(got, logits_rows(eager, pe, 2)), f"{name}: graph != eager"
    assert_matches_golden(got, g["logits"][[67, 32]], f"{name} fp32+graphs")
