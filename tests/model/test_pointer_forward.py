"""The forward methods as a scheduler ported from the Rust engine calls them (issue 18
items 4, 5, 6, 7, 9): where prefill's outputs go, the prefix cache inside prefill, the
Rust result types and call order, the probes with their Rust defaults, and batched
prefill refusing bad steps before anything runs."""
import numpy as np
import pytest

from metrale import CacheFull, InvalidArgument, Unsupported
from metrale.gpu_runtime import HostBackend
from metrale.model_engine import (MixedBatchResult, MixedForwardResult, ModelForward,
                                  PrefillSlice)
from tests.model.common import golden, load
from tests.model.stream_recorder import StreamRecordingBackend

NAME = "llama_gqa"
IDS = golden(NAME)["input_ids"][0].tolist()


@pytest.fixture
def model():
    return load(NAME, HostBackend(), kv_blocks=64, block_size=4)


def hidden_row(m, row=0):
    bits = np.empty(m._meta.hidden_size, np.uint16)
    m.backend.copy_d2h(m.hidden_after_norm().offset(row * bits.nbytes), bits)
    return bits


def test_prefill_writes_row_0_of_the_arena_and_the_hidden_state(model):
    m, s = model, model.default_stream()
    seq = m.alloc_sequence()
    p = m.prefill(IDS[:9], seq, s)
    assert p == m.decode_logits_ptr() == m.logits_buffer_ptr()
    last_normed = np.empty(m._meta.hidden_size, np.uint16)
    m.backend.copy_d2h(m._ws.normed.offset(8 * last_normed.nbytes), last_normed)
    assert np.array_equal(hidden_row(m), last_normed)
    # a decode step overwrites both, as a prefill of the next prompt does
    m.decode(IDS[9], seq, s)
    assert not np.array_equal(hidden_row(m), last_normed)
    q = m.alloc_sequence()
    p2 = m.prefill(IDS[:9], q, s)
    assert p2 == p and np.array_equal(hidden_row(m), last_normed)


def test_prompt_enters_the_prefix_cache_and_chunk_0_looks_it_up(model):
    m, s = model, model.default_stream()
    a = m.alloc_sequence()
    want = m.logits_to_numpy(m.prefill(IDS[:10], a, s))
    assert m._pool.num_cached() == 2              # the prompt's two full blocks
    b = m.alloc_sequence()
    # the caller passes prompt positions; chunk 0 takes the cached 8 tokens internally
    assert m.prefill_chunk(IDS[:10], b, 0, 3, False, s).is_null()
    assert b.seq_len == 8 and b.block_table[:2] == a.block_table[:2]
    got = m.logits_to_numpy(m.prefill_chunk(IDS[:10], b, 3, 7, True, s))
    assert np.allclose(got, want, atol=2e-2) and b.seq_len == 10
    c = m.alloc_sequence()
    bad = IDS[:10]
    bad[5] = (bad[5] + 1) % m.vocab_size()
    m.prefill_chunk(IDS[:10], c, 0, 2, False, s)
    with pytest.raises(InvalidArgument, match="cached tokens"):
        m.prefill_chunk(bad, c, 2, 8, True, s)
    assert m.reuse_prefix(m.alloc_sequence(), IDS[:10]) == 8   # still an explicit extra


def test_mixed_forward_takes_the_rust_arguments_and_keeps_decode_rows(model):
    m, s = model, model.default_stream()
    a, b = m.alloc_sequence(), m.alloc_sequence()
    m.prefill(IDS[:5], a, s)
    solo = load(NAME, HostBackend(), kv_blocks=64, block_size=4)
    sa = solo.alloc_sequence()
    solo.prefill(IDS[:5], sa, s)
    want_decode = solo.logits_to_numpy(solo.decode(IDS[5], sa, s))
    sb = solo.alloc_sequence()
    want_prefill = solo.logits_to_numpy(solo.prefill(IDS[:7][::-1], sb, s))
    res = m.mixed_forward([IDS[5]], [a], IDS[:7][::-1], b, 0, 7, True, s)
    assert isinstance(res, MixedForwardResult)
    V = m.vocab_size()
    assert res.prefill_logits == m.logits_buffer_ptr().offset(V * 2)   # after the decode row
    assert np.array_equal(m.logits_to_numpy(res.decode_logits), want_decode)
    assert np.array_equal(m.logits_to_numpy(res.prefill_logits), want_prefill)
    c = m.alloc_sequence()
    res = m.mixed_forward([], [], IDS[:9], c, 0, 4, False, s)
    assert res.decode_logits.is_null() and res.prefill_logits.is_null()


def test_mixed_forward_batch_order_rows_and_nulls():
    be = StreamRecordingBackend()
    m = load(NAME, be, kv_blocks=64, block_size=4)
    s, V = 0, m.vocab_size()
    d = [m.alloc_sequence() for _ in range(2)]
    for q in d:
        m.prefill(IDS[:4], q, s)
    p = [m.alloc_sequence() for _ in range(3)]
    be.log.clear()
    res = m.mixed_forward_batch([7, 8], d, [PrefillSlice(IDS[:6], p[0], 0, 6, True),
                                          PrefillSlice(IDS[:12], p[1], 0, 5, False),
                                          PrefillSlice(IDS[3:9], p[2], 0, 6, True)], s)
    assert isinstance(res, MixedBatchResult) and res.decode_logits == m.logits_buffer_ptr()
    base = m.logits_buffer_ptr()
    assert res.prefill_logits == [base.offset(2 * V * 2), type(base)(0), base.offset(4 * V * 2)]
    # decode_batch, then a sync of the default stream, then the prefill rows (both run the
    # same GEMM kernel; their attention kernels tell them apart)
    ops = [op for op, _ in be.log]
    last_decode = max(i for i, op in enumerate(ops) if "decode_attention" in op)
    first_prefill = min(i for i, op in enumerate(ops) if "prefill_attention" in op)
    assert last_decode < first_prefill
    assert ("sync", be.DEFAULT) in be.log[last_decode:first_prefill]
    assert p[1].seq_len == 5 and p[0].seq_len == 6


def test_prefill_batch_chunk_rows_falls_back_to_row_0_like_rust(model):
    m, s, V = model, model.default_stream(), model.vocab_size()
    seqs = [m.alloc_sequence() for _ in range(2)]
    ptrs = m.prefill_batch_chunk_rows([PrefillSlice(IDS[:5], seqs[0], 0, 5, True),
                                       PrefillSlice(IDS[2:9], seqs[1], 0, 7, True)], s,
                                      m._ws.logits_rows - 1)
    assert ptrs == [m.logits_buffer_ptr(), m.logits_buffer_ptr().offset(V * 2)]
    assert all(q.seq_len == len(t) for q, t in zip(seqs, (IDS[:5], IDS[2:9])))


def count_launches(m, monkeypatch):
    calls = []
    orig = m.backend.launch
    monkeypatch.setattr(m.backend, "launch", lambda *a, **k: (calls.append(a[0]), orig(*a, **k)))
    monkeypatch.setattr(m.backend, "gemm_bf16", lambda *a, **k: calls.append("gemm"))
    return calls


@pytest.mark.parametrize("bad", [
    lambda m, q: [PrefillSlice(IDS[:5], q[0], 0, 5, True),
                  PrefillSlice(IDS[:5], q[1], 0, 9, True)],        # beyond its prompt
    lambda m, q: [PrefillSlice(IDS[:5], q[0], 0, 5, True),
                  PrefillSlice(IDS[:5], q[0], 0, 5, True)],        # a sequence twice
    lambda m, q: [PrefillSlice(IDS[:5], q[0], 0, 5, True),
                  PrefillSlice(IDS[:5], q[1], 2, 3, True)],        # a gap
    lambda m, q: [PrefillSlice([1], m.alloc_sequence(), 0, 1, True)
                  for _ in range(m._ws.logits_rows + 1)],          # more rows than the arena
])
def test_batched_prefill_refuses_a_bad_step_before_any_launch(model, monkeypatch, bad):
    m, s = model, model.default_stream()
    q = [m.alloc_sequence() for _ in range(2)]
    free0 = m.num_free_blocks()
    calls = count_launches(m, monkeypatch)
    with pytest.raises(InvalidArgument):
        m.prefill_batch_chunk_rows(bad(m, q), s, 0)
    assert calls == [] and q[0].seq_len == 0 and m.num_free_blocks() == free0


def test_a_step_the_pool_cannot_hold_changes_nothing(monkeypatch):
    m = load(NAME, HostBackend(), kv_blocks=6, block_size=4)
    s = m.default_stream()
    a = m.alloc_sequence()
    m.prefill(IDS[:10], a, s)                      # 3 blocks, 2 of them cached
    q = [m.alloc_sequence() for _ in range(2)]
    calls = count_launches(m, monkeypatch)
    with pytest.raises(CacheFull, match="KV cache exhausted"):
        m.mixed_forward_batch([5], [a], [PrefillSlice(IDS[:10], q[0], 0, 10, True),
                                         PrefillSlice(IDS[::-1][:12], q[1], 0, 12, True)], s)
    assert calls == [] and a.seq_len == 10
    assert q[0].seq_len == 0 and q[0].block_table == []        # its prefix lookup undone
    assert m.num_free_blocks() == 3


def test_forward_defaults_are_the_rust_defaults(model):
    m, s = model, model.default_stream()
    assert ModelForward.kv_block_size(m) is None and m.kv_block_size() == 4
    assert not m.supports_beam() and not m.is_mla() and m.hc_mult() == 0
    assert m.prefill_tail_split(IDS) is None
    with pytest.raises(Unsupported, match="beam search"):
        m.generate_beam_batch([])
    a, b = m.alloc_sequence(), m.alloc_sequence()
    want = m.logits_to_numpy(m.prefill(IDS[:6][::-1], a, s))
    got = m.logits_to_numpy(m.prefill_twophase(IDS[:6][::-1], b, 2, s))
    assert np.array_equal(got, want)
    assert m.normalize_ssm_states(a, s) is None
    assert PrefillSlice._fields == ("prompt_tokens", "seq", "chunk_start", "chunk_len",
                                    "is_last_chunk")


def test_probes_answer_with_the_rust_defaults(model):
    m = model
    expect = {
        "poll_innerq": None, "has_proposer": False, "has_self_speculative": False,
        "dflash_gamma": None, "mtp_propose_batch_max": 1, "dflash_capture_band": 0,
        "has_ssm_layers": False, "decode_rollback_unsupported": False,
        "decode_rollback_ring_slots": 0, "ssm_snapshot_occupancy": None, "is_ep": False,
        "ep_protocol_v2": False, "supports_device_token_feed": False,
        "sync_secondary": None, "fed_step_settled": None,
    }
    for name, want in expect.items():
        assert getattr(m, name)() == want, name
    assert m.adapter_id_for(-1) == 0 and m.acquire_adapter_slot(3) == -1
    assert m.mtp_slot_draft_capacity(0) > 2**40 and m.ep_broadcast_tokens([1, 2]) == []
    assert m.run_mtp_propose(1, 0, None, 0) is None and not m.can_batch_verify([2, 3])
    assert m.forward_disclosure().forward == "legacy" and m.set_forward("legacy") is None
    for refuse in (lambda: m.set_forward("circuit"), lambda: m.set_active_lora("x"),
                   lambda: m.decode_batch_fed([], [], 0), lambda: m.generate_speculative([1], None, 2),
                   lambda: m.decode_verify_batched([1], [1], [], 0)):
        with pytest.raises(Unsupported):
            refuse()
    e = m.create_event()
    m.record_event(e, 0)
    m.stream_wait_event(m.create_stream(), e)
    assert m.event_query(e) is True and m.event_synchronize(e) is None


def test_verify_variants_check_their_width(model):
    m, s = model, model.default_stream()
    a, b = m.alloc_sequence(), m.alloc_sequence()
    m.prefill(IDS[:5], a, s)
    m.prefill(IDS[:5], b, s)
    assert m.decode_verify_graphed_k3(IDS[5:8], a, s) == m.decode_verify(IDS[5:8], b, s)
    with pytest.raises(InvalidArgument, match="exactly 2"):
        m.decode_verify_graphed(IDS[5:8], a, s)


def test_reference_scheduler_reserves_blocks_through_the_api(monkeypatch):
    from metrale.engine import Scheduler
    m = load(NAME, HostBackend(), kv_blocks=64, block_size=4)
    calls = []
    orig = m.reserve_blocks
    monkeypatch.setattr(m, "reserve_blocks", lambda seq, n: (calls.append(n), orig(seq, n))[1])
    sched = Scheduler(m, chunk_tokens=6)
    rid = sched.add_request(IDS[:14], 3, stop_token_ids=[])
    assert len(sched.run()[rid].output) == 3 and calls


def _logits(m, ptr):
    V = m.vocab_size()
    bits = np.empty(V, np.uint16)
    m.backend.copy_d2h(ptr, bits)
    return bits


def test_batched_prefill_shares_passes_and_equals_each_slice_alone(monkeypatch):
    """Slices whose rest fits one pass run together (one prefill attention launch per
    layer for the group), with every logits row, hidden row and later decode step equal
    bit for bit to the same slice prefilled alone; a group past max_tokens splits."""
    m = load(NAME, HostBackend(), kv_blocks=64, block_size=4, max_prefill_tokens=16)
    solo = load(NAME, HostBackend(), kv_blocks=64, block_size=4, max_prefill_tokens=16)
    s, layers = m.default_stream(), m._meta.num_layers
    prompts = [IDS[:6], IDS[:12], IDS[3:9], IDS[1:4], IDS[::-1][:7]]
    q = [m.alloc_sequence() for _ in prompts]
    m.prefill(prompts[3][:2], q[3], s)           # a sequence continuing from position 2
    slices = [PrefillSlice(prompts[0], q[0], 0, 6, True),
              PrefillSlice(prompts[1], q[1], 0, 5, False),      # not the last chunk
              PrefillSlice(prompts[2], q[2], 0, 6, True),
              PrefillSlice(prompts[3], q[3], 2, 1, True),
              PrefillSlice(prompts[4], q[4], 0, 7, True)]       # 6+5+6+1 = 18 > 16: splits
    calls = count_launches(m, monkeypatch)
    ptrs = m.prefill_batch_chunk(slices, s)
    monkeypatch.undo()
    attn = [c for c in calls if "prefill_attention" in str(c)]
    assert len(attn) == 2 * layers           # [0, 1, 2] then [3, 4]: two passes
    assert ptrs[1].is_null()
    for i, sl in enumerate(slices):
        r = solo.alloc_sequence()
        if i == 3:
            solo.prefill(prompts[3][:2], r, s)
            want = solo.prefill_chunk(prompts[3], r, 2, 1, True, s)
        elif sl.is_last_chunk:
            want = solo.prefill(sl.prompt_tokens, r, s)
        else:
            solo.prefill_chunk(sl.prompt_tokens, r, 0, 5, False, s)
        if sl.is_last_chunk:
            assert np.array_equal(_logits(m, ptrs[i]), _logits(solo, want)), i
            assert np.array_equal(hidden_row(m, i), hidden_row(solo, 0)), i
            got_d = _logits(m, m.decode(5, q[i], s))
            assert np.array_equal(got_d, _logits(solo, solo.decode(5, r, s))), i
        assert q[i].seq_len == r.seq_len and q[i].tokens == r.tokens
        solo.free_sequence(r)
