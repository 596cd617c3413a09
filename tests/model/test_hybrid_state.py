"""The recurrent-state pool and the original's SSM-state contract on a hybrid model
(qwen3_5_text fixture, HostBackend): slots per sequence and the full-pool error, checkpoint /
rollback_ssm_states / commit_accepted_prefix around a verify (a refused call copies nothing),
the decode-rollback ring, KV rollback that moves the state with it or refuses, fork, and
prefix reuse through prefix states at checkpoint boundaries."""
import json

import numpy as np
import pytest

from metrale import CacheFull, InvalidArgument, Unsupported
from metrale.kv import prefix_keys
from tests.model.common import FIXTURES, golden, load

NAME = "qwen3_5_text"
IDS = golden(NAME)["input_ids"][0].tolist()


def state_of(m, seq=None, slot=None) -> bytes:
    """Every layer's state and conv window of a slot, as bytes."""
    a = m._arena
    slot = seq.ssm_slot if slot is None else slot
    out = b""
    m.synchronize(0)
    for layer in range(a.layers):
        for ptr, n in ((a.state_ptr(layer, slot), a.state_bytes),
                       (a.conv_ptr(layer, slot), a.conv_bytes)):
            buf = np.empty(n, np.uint8)
            m.backend.copy_d2h(ptr, buf)
            out += buf.tobytes()
    return out


def bits(m, ptr):
    out = np.empty(m.vocab_size(), np.uint16)
    m.copy_logits_to_host(ptr, out.view(np.uint8))
    return out


@pytest.fixture
def m():
    return load(NAME, max_batch=4, decode_rollback_ring_slots=2, ssm_verify_states=6)


def fresh(m, n):
    seq = m.alloc_sequence()
    m.prefill(IDS[:n], seq, 0)
    return seq


# --- the pool -------------------------------------------------------------------------------
def test_each_sequence_takes_a_slot_and_a_full_pool_raises_cache_full():
    m = load(NAME, max_batch=4, max_sequences=2)
    a, b = m.alloc_sequence(), m.alloc_sequence()
    assert {a.ssm_slot, b.ssm_slot} == {0, 1}
    with pytest.raises(CacheFull, match="recurrent state pool exhausted.*max_sequences"):
        m.alloc_sequence()
    m.free_sequence(a)
    m.free_sequence(a)   # idempotent: the slot is returned once
    c = m.alloc_sequence()
    assert c.ssm_slot == 0 and m._states.num_free() == 0
    m.prefill(IDS[:10], c, 0)
    m.prefill(IDS[:10], b, 0)   # the pool's sequences run; their states are theirs
    assert state_of(m, b) == state_of(m, c)


def test_memory_plan_and_bytes_count_the_state_pool():
    m = load(NAME, max_batch=4, max_sequences=3, ssm_prefix_states=2, ssm_verify_states=5)
    g = m._meta.hybrid.gdn
    per_layer = g.num_v_heads * g.k_head_dim * g.v_head_dim * 4 + \
        (g.conv_kernel - 1) * g.conv_dim * 2
    assert m.state_bytes_per_sequence() == per_layer * len(m._meta.hybrid.recurrent_layers)
    slots = 3 + 1 + 5 + 2   # live, sink, verify, prefix
    assert m.state_pool_bytes() == slots * m.state_bytes_per_sequence()
    assert m.memory_plan.total_bytes >= m.state_pool_bytes() + m.weight_bytes()


def test_bad_load_options_are_refused():
    for kw in (dict(max_sequences=0), dict(ssm_verify_states=0),
               dict(decode_rollback_ring_slots=-1), dict(ssm_prefix_states="4")):
        with pytest.raises(InvalidArgument, match=list(kw)[0]):
            load(NAME, **kw)


# --- checkpoint and rollback around a verify ---------------------------------------------------
def test_has_ssm_layers_and_the_probes(m):
    assert m.has_ssm_layers() and not m.decode_rollback_unsupported()
    assert m.decode_rollback_ring_slots() == 2
    assert m.ssm_checkpoint_interval() == 64 and m.max_verify_tokens() == 6
    plain = load("qwen3")
    assert not plain.has_ssm_layers() and plain.decode_rollback_unsupported() is False
    assert plain.decode_rollback_ring_slots() == 0 and plain.ssm_snapshot_occupancy() is None
    seq = plain.alloc_sequence()
    plain.checkpoint_ssm_states(seq)            # nothing to checkpoint: the defaults
    assert plain.rollback_ssm_states(seq, 3) is None
    assert load(NAME).decode_rollback_unsupported()   # no ring by default


@pytest.mark.parametrize("checkpoint", [True, False])
@pytest.mark.parametrize("accepted", [0, 1, 3, 5])
def test_rollback_ssm_states_gives_the_state_after_the_accepted_rows(m, accepted, checkpoint):
    """The original's meaning: num_accepted rows of the last verify kept (0: the checkpoint,
    which the verify saves itself too), whatever KV length the caller sets; here it must
    equal decoding those rows alone."""
    seq, ref = fresh(m, 66), fresh(m, 66)
    if checkpoint:
        m.checkpoint_ssm_states(seq)
    m.decode_verify(IDS[66:71], seq, 0)
    m.rollback_ssm_states(seq, accepted)
    for t in IDS[66:66 + accepted]:
        m.decode(t, ref, 0)
    if accepted < 5:
        assert state_of(m, seq) == state_of(m, ref)
    m.free_sequence(seq)
    m.free_sequence(ref)


def test_a_one_row_verify_keeps_the_state_before_it(m):
    seq, ref = fresh(m, 30), fresh(m, 30)
    m.decode_verify(IDS[30:31], seq, 0)
    m.rollback_ssm_states(seq, 0)
    assert state_of(m, seq) == state_of(m, ref)


def test_a_refused_rollback_copies_nothing(m):
    seq, other = fresh(m, 30), fresh(m, 20)
    m.decode_verify(IDS[30:33], seq, 0)
    live = state_of(m, seq)
    with pytest.raises(InvalidArgument, match="after 4 rows.*No copy"):
        m.rollback_ssm_states(seq, 4)   # more rows than the verify had
    with pytest.raises(InvalidArgument, match=f"sequence {other.seq_id} has no verify"):
        m.rollback_ssm_states(other, 1)
    assert state_of(m, seq) == live
    m.decode(IDS[33], seq, 0)           # a later pass retires the verify's states
    live = state_of(m, seq)
    with pytest.raises(InvalidArgument, match="no verify states"):
        m.rollback_ssm_states(seq, 1)
    assert state_of(m, seq) == live
    for s in (seq, other):
        m.free_sequence(s)


def test_commit_accepted_prefix(m):
    seq, ref = fresh(m, 40), fresh(m, 40)
    m.decode_verify(IDS[40:44], seq, 0)
    full = state_of(m, seq)
    m.commit_accepted_prefix(seq, 4, 4)   # full accept: the live state is it
    assert state_of(m, seq) == full
    for bad in ((0, 4), (5, 4)):
        with pytest.raises(InvalidArgument, match="commit keeps 1..k"):
            m.commit_accepted_prefix(seq, *bad)
    m.commit_accepted_prefix(seq, 2, 4)
    m.decode(IDS[40], ref, 0)
    m.decode(IDS[41], ref, 0)
    assert state_of(m, seq) == state_of(m, ref)
    m.free_sequence(seq)
    m.free_sequence(ref)


def test_kv_rollback_moves_the_state_or_refuses(m):
    seq, ref = fresh(m, 50), fresh(m, 50)
    m.decode_verify(IDS[50:56], seq, 0)
    m.rollback(seq, 3)                  # within the verify: the state after 3 rows
    for t in IDS[50:53]:
        m.decode(t, ref, 0)
    assert state_of(m, seq) == state_of(m, ref) and seq.seq_len == 53
    m.decode(IDS[53], seq, 0)
    with pytest.raises(InvalidArgument, match="cannot be rewound"):
        m.rollback(seq, 2)              # decode steps are not a verify: refused
    assert seq.seq_len == 54
    m.rollback(seq, 54)                 # to 0: a fresh sequence, prefilled again alike
    a = bits(m, m.prefill(IDS[:20], seq, 0))
    b = bits(m, m.prefill(IDS[:20], m.alloc_sequence(), 0))
    assert np.array_equal(a, b)


def test_decode_rollback_ring(m):
    seq, ref = fresh(m, 20), fresh(m, 20)
    m.save_decode_ssm_snapshot(seq, 1)
    saved = state_of(m, seq)
    for t in IDS[20:23]:
        m.decode(t, seq, 0)
    assert state_of(m, seq) != saved
    m.restore_decode_ssm_snapshot(seq, 1)
    assert state_of(m, seq) == saved == state_of(m, ref)
    m.rollback(seq, 3)   # the KV back to the snapshot's position, the restored state kept
    assert seq.seq_len == 20
    assert np.array_equal(bits(m, m.decode(IDS[20], seq, 0)), bits(m, m.decode(IDS[20], ref, 0)))
    with pytest.raises(InvalidArgument, match="ring_slot"):
        m.save_decode_ssm_snapshot(seq, 2)
    no_ring = load(NAME)
    with pytest.raises(Unsupported, match="decode_rollback_ring_slots=0"):
        no_ring.save_decode_ssm_snapshot(no_ring.alloc_sequence(), 0)


def test_fork_copies_the_state(m):
    seq = fresh(m, 45)
    child = m.fork_sequence(seq)
    assert child.ssm_slot != seq.ssm_slot and state_of(m, child) == state_of(m, seq)
    a, b = bits(m, m.decode(IDS[45], seq, 0)), bits(m, m.decode(IDS[45], child, 0))
    assert np.array_equal(a, b)
    m.free_sequence(seq)
    m.free_sequence(child)


# --- prefix reuse through prefix states -------------------------------------------------------
def test_prefix_reuse_restores_the_state_at_a_checkpoint_boundary():
    m = load(NAME, max_batch=4, ssm_prefix_states=2)
    first = m.alloc_sequence()
    want = bits(m, m.prefill(IDS[:90], first, 0))   # keeps the state at 64
    m.free_sequence(first)
    assert m.ssm_snapshot_occupancy() == (1, 2)
    seq = m.alloc_sequence()
    got = bits(m, m.prefill(IDS[:90], seq, 0))
    assert np.array_equal(got, want), "a reused prefix must give the fresh prefill's logits"
    other = m.alloc_sequence()
    assert m.reuse_prefix(other, IDS[:100]) == 64 and other.seq_len == 64
    kept = m._states.prefix_lookup(prefix_keys(IDS[:64], m.kv_block_size())[-1])
    assert state_of(m, other) == state_of(m, slot=kept)


def test_a_prefix_without_its_state_is_not_reused():
    m = load(NAME, max_batch=4, ssm_prefix_states=0)
    first = m.alloc_sequence()
    m.prefill(IDS[:90], first, 0)
    m.cache_sequence(first)
    m.free_sequence(first)
    assert m._pool.num_cached() > 0           # the KV blocks are cached ...
    seq = m.alloc_sequence()
    assert m.reuse_prefix(seq, IDS[:90]) == 0  # ... but without a state they are not reused
    assert seq.seq_len == 0 and seq.block_table == []


def test_decode_marconi_checkpoint_keeps_a_decoded_state():
    m = load(NAME, max_batch=4, ssm_prefix_states=4)
    seq = fresh(m, 60)
    for t in IDS[60:64]:
        m.decode(t, seq, 0)
        m.decode_marconi_checkpoint(seq)         # only seq_len 64 is a boundary
    assert m.ssm_snapshot_occupancy() == (1, 4)
    other = m.alloc_sequence()
    assert m.reuse_prefix(other, IDS[:80]) == 64
    assert state_of(m, other) == state_of(m, seq)


def test_info_shows_the_state_per_sequence_and_the_pool(capsys):
    from metrale.cli import main
    from tests.model.common import FIXTURES
    assert main(["info", str(FIXTURES / NAME), "--batch", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    m = load(NAME, max_batch=3)   # the pool a load with the same batch allocates
    r = d["recurrent"]
    assert r["state_bytes_per_sequence"] == m.state_bytes_per_sequence() > 0
    assert r["state_pool_bytes"] == m.state_pool_bytes()
    assert d["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 2   # the 2 full-attention layers only
    assert d["decode_step_bytes"] > d["decode_step_weight_bytes"] + 2 * r["state_bytes_per_sequence"]
    assert main(["info", str(FIXTURES / NAME)]) == 0
    out = capsys.readouterr().out
    assert "state pool" in out and "gated DeltaNet on layers 0, 2, 3" in out


def test_tensor_api_paged_matches_the_pointer_api_and_contiguous_is_refused():
    import metrale
    from metrale.kv import CacheConfig
    g = metrale.load_generative(FIXTURES / NAME, device="cpu", progress=False)
    cache = g.create_kv_cache(CacheConfig("paged", max_seq_len=256, block_size=16))
    x = g.embed(np.asarray([IDS[:71]], np.int32))
    logits = metrale.to_numpy(g.prefill(x[:, :70], cache, range(0, 70)))[0]
    step = metrale.to_numpy(g.decode(x[:, 70:71], cache))[0]
    m = load(NAME)
    seq = m.alloc_sequence()
    want = [bits(m, m.prefill(IDS[:70], seq, 0)), bits(m, m.decode(IDS[70], seq, 0))]
    from metrale.ops.bf16 import bf16_to_f32
    assert np.array_equal(logits, bf16_to_f32(want[0])) and \
        np.array_equal(step, bf16_to_f32(want[1]))
    contiguous = g.create_kv_cache(CacheConfig("contiguous", max_seq_len=64, block_size=16))
    with pytest.raises(Unsupported, match="contiguous KV cache is not supported"):
        g.prefill(x[:, :8], contiguous, range(0, 8))
