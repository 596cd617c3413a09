"""The Rust meaning of `TransformerModel`'s draft and verify methods (issue 29 §1), read
from the original's `impl ModelDraft for TransformerModel` (model/trait_impl/impl_draft.rs,
speculative.rs, impl_b1_decode.rs) and `decode_verify_dispatch` (trait_impl/verify_a.rs):
save_hidden_for_mtp copies a hidden row, run_mtp_propose_multi proposes nothing,
decode_draft is a decode step, decode_verify of no tokens is [], and decode of an empty
sequence takes its token at position 0."""
import numpy as np
import pytest

from metrale import InvalidArgument
from metrale.gpu_runtime import HostBackend
from metrale.ops import rmsnorm
from tests.model.common import golden, load

NAME = "llama_gqa"
IDS = golden(NAME)["input_ids"][0].tolist()


@pytest.fixture(scope="module")
def m():
    return load(NAME, HostBackend(), kv_blocks=64, block_size=4, max_batch=4)


def bits(m, ptr, n):
    out = np.empty(n, np.uint16)
    m.backend.copy_d2h(ptr, out)
    return out


def saved_row(m):
    return bits(m, m.mtp_hidden_ptr(), m.metadata().hidden_size)


def test_save_hidden_for_mtp_copies_the_pre_norm_row_of_the_last_pass(m):
    s, hid = m.default_stream(), m.metadata().hidden_size
    a, b = m.alloc_sequence(), m.alloc_sequence()
    m.prefill(IDS[:6], a, s)
    m.prefill(IDS[:6], b, s)
    # verify row 1 of [t0, t1] is the decode step of t1 after t0 (batch invariance) ...
    m.decode_verify(IDS[6:8], a, s)
    assert m.save_hidden_for_mtp(1, s) is None and m.last_mtp_hidden_idx() == 1
    from_verify = saved_row(m)
    m.decode(IDS[6], b, s)
    m.decode(IDS[7], b, s)
    m.save_hidden_for_mtp(0, s)
    assert np.array_equal(saved_row(m), from_verify)
    # ... and it is the hidden state before the final norm: norming it gives the row behind
    # the logits (hidden_after_norm row 0 of this decode)
    w = m._weights.norm
    out = m.backend.alloc(hid * 2)
    rmsnorm.rmsnorm(m.backend, s, out, m.mtp_hidden_ptr(), w, 1, hid, m.metadata().rms_norm_eps)
    assert np.array_equal(bits(m, out, hid), bits(m, m.hidden_after_norm(), hid))
    m.backend.free(out)
    with pytest.raises(InvalidArgument, match="token_idx"):
        m.save_hidden_for_mtp(m._ws.max_tokens, s)
    for q in (a, b):
        m.free_sequence(q)


def test_run_mtp_propose_multi_has_no_proposer_and_proposes_nothing(m):
    seq = m.alloc_sequence()
    assert m.run_mtp_propose_multi(IDS[0], 5, 3, seq, 0) == []
    assert m.run_mtp_propose_multi(IDS[0], 5, 3, seq, 0, grammar_bitmask=[1, 2]) == []
    assert m.run_mtp_propose(IDS[0], 5, seq, 0) is None and seq.seq_len == 0


def test_decode_draft_is_a_decode_step(m):
    s = m.default_stream()
    a, b = m.alloc_sequence(), m.alloc_sequence()
    m.prefill(IDS[:5], a, s)
    m.prefill(IDS[:5], b, s)
    V = m.vocab_size()
    p = m.decode_draft(IDS[5], a, s)
    assert p == m.decode_logits_ptr() and a.seq_len == 6 and a.tokens[-1] == IDS[5]
    want = bits(m, p, V)
    assert np.array_equal(bits(m, m.decode(IDS[5], b, s), V), want)
    for q in (a, b):
        m.free_sequence(q)


def test_decode_verify_of_no_tokens_is_empty_and_runs_nothing(m, monkeypatch):
    seq = m.alloc_sequence()
    m.prefill(IDS[:4], seq, 0)
    launches = []
    monkeypatch.setattr(m.backend, "launch", lambda *a, **k: launches.append(a))
    assert m.decode_verify([], seq, 0) == [] and launches == [] and seq.seq_len == 4
    m.free_sequence(seq)


def test_decode_verify_takes_up_to_the_workspace_rows(m):
    """The original has no fixed 16: k rows must fit its buffers. Here the bound is the
    workspace's rows, max(max_batch, 16), and every row still equals the decode step."""
    s = m.default_stream()
    k = m.max_verify_tokens()
    assert k == 16                               # max_batch=4 -> the 16-row floor
    wide = load(NAME, HostBackend(), kv_blocks=64, block_size=4, max_batch=24)
    assert wide.max_verify_tokens() == 24
    toks = (IDS * 3)[6:6 + 24]
    a, b = wide.alloc_sequence(), wide.alloc_sequence()
    wide.prefill(IDS[:6], a, s)
    wide.prefill(IDS[:6], b, s)
    got = wide.decode_verify(toks, a, s)
    want = [wide.argmax_on_device(wide.decode(t, b, s), s) for t in toks]
    assert got == want and len(got) == 24
    seq = m.alloc_sequence()
    m.prefill(IDS[:3], seq, s)
    with pytest.raises(InvalidArgument, match="17 tokens exceed the 16 verify rows"):
        m.decode_verify([1] * 17, seq, s)
    assert seq.seq_len == 3
    m.free_sequence(seq)


def test_decode_on_an_empty_sequence_runs_at_position_zero(m):
    """The original decodes an empty sequence's token at position 0 (its block table is
    grown first): the same logits as a one-token prefill; later steps follow on."""
    s, V = m.default_stream(), m.vocab_size()
    a, b = m.alloc_sequence(), m.alloc_sequence()
    got = bits(m, m.decode(IDS[0], a, s), V)
    assert a.seq_len == 1 and a.tokens == [IDS[0]]
    assert np.array_equal(got, bits(m, m.prefill(IDS[:1], b, s), V))
    assert m.decode_verify(IDS[1:4], a, s) == m.decode_verify(IDS[1:4], b, s)
    c, d = m.alloc_sequence(), m.alloc_sequence()
    rows = m.decode_batch([IDS[0], IDS[2]], [c, d], s)
    assert np.array_equal(bits(m, rows, V), got)
    for q in (a, b, c, d):
        m.free_sequence(q)
