"""DeepSeek-V3's MTP module as the model's draft proposer (issue 42, MTP): loading (when
present, by option), its logits against the float64 reference (mtp_reference.py, given the
target's saved hidden rows), the pairs fed after a verify equal to feeding them at once,
batch invariance, speculative == greedy with MTP drafts (the fixture's random module, and a
module whose weights predict the target's greedy continuation, so drafts are accepted), the
ported K=2 verify step (tests/engine/test_rust_verify_k2_step.py, unchanged) on MTP drafts,
and what is refused."""
from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from metrale.engine import generate, speculative_generate
from metrale.errors import FormatError, InvalidArgument, Unsupported
from metrale.formats import open_source
from metrale.gpu_runtime import HostBackend, backend
from tests.conftest import emu_available
from tests.engine.test_rust_verify_k2_step import ActiveSeq, Counters, emit_token, \
    step_verify_k2
from tests.model.common import FIXTURES, assert_matches_golden, golden, load, logits_rows
from tests.model.mtp_reference import MtpReference

V3 = FIXTURES / "deepseek_v3"
MTP = "model.layers.3."
BACKENDS = ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])]


def prompt(n: int) -> list[int]:
    return [int(t) for t in golden("deepseek_v3")["input_ids"][0][:n]]


def saved_rows(m, n: int) -> np.ndarray:
    """The target hidden rows the last save_hidden_for_mtp kept, float64 [n, hidden]."""
    bits = np.empty((n, m._meta.hidden_size), np.uint16)
    m.backend.copy_d2h(m._mtp.buffers.saved, bits.view(np.uint8).reshape(-1))
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def mtp_logits(m, n: int) -> np.ndarray:
    return logits_rows(m, m.mtp_logits_ptr(), n)


def write_variant(dst, replace: dict, drop: tuple = ()) -> None:
    """A copy of the deepseek_v3 fixture with tensors replaced (float arrays, stored BF16)
    or dropped (names starting with a `drop` prefix)."""
    shutil.copytree(V3, dst)
    raw = (V3 / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = {k: raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in header.items() if not k.startswith(drop or ("\0",))}
    for k, x in replace.items():
        u = np.ascontiguousarray(x, np.float32).view(np.uint32)
        data[k] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
    out, off = {}, 0
    for k in sorted(data):
        shape = header[k]["shape"] if k not in replace else list(np.shape(replace[k]))
        out[k] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + len(data[k])]}
        off += len(data[k])
    h = json.dumps(out).encode()
    h += b" " * (-len(h) % 8)
    (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h +
                                            b"".join(data[k] for k in sorted(data)))


def oracle_variant(dst) -> None:
    """The fixture with an MTP module that predicts, from its input token alone, the token
    the target's greedy output most often puts after it: enorm 1, hnorm 0, eh_proj [256 I |
    0] (the block's own output is small beside it), head rows = the normalized embeddings
    of the tokens each id follows. Drafts are accepted where that guess is the target's."""
    m = load("deepseek_v3", mtp=False)
    follow: dict[int, dict[int, int]] = {}
    for n in (4, 9, 12):
        out = prompt(n)[-1:] + generate(m, prompt(n), 40).tokens
        for a, b in zip(out, out[1:]):
            follow.setdefault(a, {}).setdefault(b, 0)
            follow[a][b] += 1
    src = open_source(V3)
    emb = (np.asarray(src.read_bf16("model.embed_tokens.weight")).astype(np.uint32) << 16) \
        .view(np.float32).astype(np.float64)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    V, h = emb.shape
    head = np.zeros((V, h))
    for a, nxt in follow.items():
        head[max(nxt, key=nxt.get)] += 4 * unit[a]   # its logit: 4 sqrt(hidden)
    write_variant(dst, {MTP + "enorm.weight": np.ones(h), MTP + "hnorm.weight": np.zeros(h),
                        MTP + "eh_proj.weight": np.hstack([256 * np.eye(h), np.zeros((h, h))]),
                        MTP + "shared_head.norm.weight": np.ones(h),
                        MTP + "shared_head.head.weight": head})


# loading -------------------------------------------------------------------------------
def test_mtp_loads_when_present_and_by_option(tmp_path):
    be = HostBackend()
    live0 = be.live_bytes()
    m = load("deepseek_v3", be)
    assert m.has_proposer() and not m.has_self_speculative()
    with_mtp, mtp_weights = be.live_bytes(), m.weight_bytes()
    m.teardown()
    off = load("deepseek_v3", be, mtp=False)
    assert not off.has_proposer() and be.live_bytes() < with_mtp
    h, V = 64, 256   # the MTP layer's own tensors: eh_proj, 3 norms, head and embedding
    assert mtp_weights - off.weight_bytes() > 2 * (2 * h * h + 2 * V * h + 3 * h)
    seq = off.alloc_sequence()
    off.prefill(prompt(4), seq, 0)
    assert off.run_mtp_propose_multi(5, 4, 2, seq, 0) == []   # no proposer: no drafts
    off.free_sequence(seq)
    off.teardown()
    assert be.live_bytes() == live0
    with pytest.raises(Unsupported, match="no multi-token-prediction module"):
        load("deepseek_v2", mtp=True)
    write_variant(tmp_path / "no_mtp", {}, drop=(MTP,))
    assert not load(tmp_path / "no_mtp").has_proposer()   # a checkpoint without it
    with pytest.raises(FormatError, match="enorm"):
        load(tmp_path / "no_mtp", mtp=True)
    write_variant(tmp_path / "half", {}, drop=(MTP + "eh_proj",))
    with pytest.raises(FormatError, match="eh_proj"):   # present but incomplete: named
        load(tmp_path / "half")


# the module against the float64 reference ---------------------------------------------
@pytest.mark.parametrize("device_name", BACKENDS)
def test_mtp_logits_match_float64_reference(device_name):
    m = load("deepseek_v3", backend(device_name))
    ref = MtpReference(open_source(V3), V3 / "config.json")
    ids = prompt(10)
    seq = m.alloc_sequence()
    first = m.argmax_on_device(m.prefill(ids, seq, 0), 0)
    m.save_hidden_for_mtp(len(ids) - 1, 0)
    drafts = m.run_mtp_propose_multi(first, len(ids), 3, seq, 0)
    want, ref_drafts = ref.propose(ids, saved_rows(m, len(ids)), first, 3, drafts)
    assert_matches_golden(mtp_logits(m, 3), want, f"{device_name}: MTP logits (3-draft chain)")
    assert ref_drafts == drafts
    m.free_sequence(seq)


def test_pairs_fed_after_verify_equal_feeding_them_at_once():
    """A propose after verify rounds (accept, reject, rollback, trim) gives the bits of a
    propose that feeds the same pairs in one pass after one prefill."""
    m = load("deepseek_v3")
    ids = prompt(6)
    seq = m.alloc_sequence()
    last = m.argmax_on_device(m.prefill(ids, seq, 0), 0)
    m.save_hidden_for_mtp(len(ids) - 1, 0)
    w = generate(m, ids, 12, stop_token_ids=[]).tokens
    m.run_mtp_propose_multi(last, seq.seq_len, 2, seq, 0)
    out = [last]
    for accept in (1, 2, 0):   # a partial accept, a full accept, a reject
        forced = [w[len(out) + i] if i < accept else (w[len(out) + i] + 1) % 256
                  for i in range(2)]
        verdict = m.decode_verify([last] + forced, seq, 0)
        j = 0
        while j < 2 and forced[j] == verdict[j]:
            j += 1
        assert j == accept
        m.rollback(seq, 2 - j)
        m.save_hidden_for_mtp(j, 0)
        m.trim_proposer_state(seq, j, 0)
        out += forced[:j] + [verdict[j]]
        last = out[-1]
        drafts = m.run_mtp_propose_multi(last, seq.seq_len, 3, seq, 0)
    got = mtp_logits(m, 3)
    assert out == w[:len(out)]
    fresh = m.alloc_sequence()
    m.prefill(ids + out[:-1], fresh, 0)
    m.save_hidden_for_mtp(len(ids) + len(out) - 2, 0)
    assert m.run_mtp_propose_multi(last, fresh.seq_len, 3, fresh, 0) == drafts
    assert np.array_equal(mtp_logits(m, 3), got)
    m.free_sequence(seq)
    m.free_sequence(fresh)


def test_prompt_in_chunks_feeds_the_mtp_every_pair():
    """A prompt prefilled in chunks of 4 (each chunk saved and fed with num_drafts 0) gives
    the MTP the bits of one whole prefill; speculative_generate does it for a long prompt."""
    whole, chunked = load("deepseek_v3"), load("deepseek_v3", max_prefill_tokens=4)
    ids = prompt(11)
    rows = []
    for m in (whole, chunked):
        seq = m.alloc_sequence()
        for c0 in range(0, len(ids), m.max_prefill_tokens()):
            n = min(m.max_prefill_tokens(), len(ids) - c0)
            logits = m.prefill_chunk(ids, seq, c0, n, c0 + n == len(ids), 0)
            m.save_hidden_for_mtp(n - 1, 0)
            if c0 + n < len(ids):
                assert m.run_mtp_propose_multi(ids[c0 + n], c0 + n, 0, seq, 0) == []
        last = m.argmax_on_device(logits, 0)
        rows.append((m.run_mtp_propose_multi(last, len(ids), 3, seq, 0), mtp_logits(m, 3)))
        m.free_sequence(seq)
    assert rows[0][0] == rows[1][0] and np.array_equal(rows[0][1], rows[1][1])
    r = speculative_generate(chunked, None, ids, 20, k=2)
    assert r.tokens == generate(whole, ids, 20).tokens
    assert r.proposed == speculative_generate(whole, None, ids, 20, k=2).proposed


@pytest.mark.parametrize("device_name", BACKENDS)
def test_mtp_drafts_are_batch_invariant(device_name):
    """A sequence's MTP drafts and logits over two rounds are the same bits alone and with
    another sequence prefilled, proposed for and verified between its rounds."""
    m = load("deepseek_v3", backend(device_name))

    def verify_round(seq, last, d):
        verdict = m.decode_verify([last] + d, seq, 0)
        j = 0
        while j < len(d) and d[j] == verdict[j]:
            j += 1
        m.rollback(seq, len(d) - j)
        m.save_hidden_for_mtp(j, 0)
        m.trim_proposer_state(seq, j, 0)
        return verdict[j]

    def other_work():
        o = m.alloc_sequence()
        ids = prompt(11)[::-1]
        t = m.argmax_on_device(m.prefill(ids, o, 0), 0)
        m.save_hidden_for_mtp(len(ids) - 1, 0)
        verify_round(o, t, m.run_mtp_propose_multi(t, o.seq_len, 3, o, 0))
        return o

    def run(interleave):
        seq = m.alloc_sequence()
        ids = prompt(7)
        last = m.argmax_on_device(m.prefill(ids, seq, 0), 0)
        m.save_hidden_for_mtp(len(ids) - 1, 0)
        d = m.run_mtp_propose_multi(last, seq.seq_len, 2, seq, 0)
        got, others = [(d, mtp_logits(m, 2))], []
        for _ in range(3):   # as a scheduler steps: others run between propose and verify
            if interleave:
                others.append(other_work())
            last = verify_round(seq, last, d)
            d = m.run_mtp_propose_multi(last, seq.seq_len, 2, seq, 0)
            got.append((d, mtp_logits(m, 2)))
        for s in [seq] + others:
            m.free_sequence(s)
        return got

    alone, mixed = run(False), run(True)
    for (d1, r1), (d2, r2) in zip(alone, mixed):
        assert d1 == d2 and np.array_equal(r1, r2)


# speculative == greedy -----------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_with_mtp_drafts_equals_greedy(k, tmp_path):
    oracle_variant(tmp_path / "oracle")
    rates = {}
    for name, m in (("random", load("deepseek_v3")), ("oracle", load(tmp_path / "oracle"))):
        acc = prop = 0
        for n in (3, 4, 9, 12):
            r = speculative_generate(m, None, prompt(n), 40, k=k)
            assert r.tokens == generate(m, prompt(n), 40).tokens, (name, n)
            acc, prop = acc + r.accepted, prop + r.proposed
        rates[name] = (acc, prop)
        print(f"k={k} {name} MTP: {acc}/{prop} drafts accepted ({acc / prop:.1%})")
    assert rates["oracle"][0] > 0 and rates["oracle"][0] < rates["oracle"][1]


@pytest.mark.parametrize("device_name", BACKENDS[1:])
def test_speculative_with_mtp_drafts_equals_greedy_on_emu(device_name):
    m = load("deepseek_v3", backend(device_name))
    r = speculative_generate(m, None, prompt(9), 24, k=3)
    assert r.tokens == generate(m, prompt(9), 24).tokens and r.proposed > 0


def test_ported_k2_verify_step_with_mtp_drafts_equals_greedy(tmp_path):
    """tests/engine/test_rust_verify_k2_step.py's port of `step_verify_k2`, unchanged, on
    MTP drafts: the original's bootstrap (prefill, save_hidden_for_mtp of the last row,
    run_mtp_propose_multi), then K=2 steps round robin over the requests."""
    oracle_variant(tmp_path / "oracle")
    for path in (V3, tmp_path / "oracle"):
        be = HostBackend()
        m = load(path, be)
        rng = np.random.default_rng(42)
        stats, active, want = Counters(), [], {}
        for rid in range(4):
            ids = rng.integers(4, 250, int(rng.integers(2, 12))).tolist()
            max_tokens = int(rng.integers(8, 24))
            want[rid] = generate(m, ids, max_tokens).tokens
            seq = m.alloc_sequence()
            first = m.argmax_on_device(m.prefill(ids, seq, 0), 0)
            m.save_hidden_for_mtp(len(ids) - 1, 0)
            a = ActiveSeq(rid, seq, first, max_tokens, set(), pending_drafts=[])
            emit_token(a, first)
            a.pending_drafts = m.run_mtp_propose_multi(first, seq.seq_len, 1, seq, 0)
            active.append(a)
        while any(not a.finished for a in active):
            for a in active:
                if a.finished:
                    continue
                step_verify_k2(m, a, stats, a.pending_drafts, 1)
                if a.finished:
                    m.free_sequence(a.seq)
        for a in active:
            assert a.output == want[a.rid], (path.name, a.rid)
        print(f"{path.name}: K=2 accepts {stats.accepts}, rejects {stats.rejects}")
        assert stats.rejects > 0
        if path != V3:
            assert stats.accepts > 0


# refused ---------------------------------------------------------------------------------
def test_propose_arguments_are_checked():
    m = load("deepseek_v3")
    seq = m.alloc_sequence()
    m.prefill(prompt(5), seq, 0)
    m.save_hidden_for_mtp(4, 0)
    with pytest.raises(InvalidArgument, match="position=4"):
        m.run_mtp_propose_multi(3, 4, 1, seq, 0)
    with pytest.raises(InvalidArgument, match="token=256"):
        m.run_mtp_propose_multi(256, 5, 1, seq, 0)
    with pytest.raises(InvalidArgument, match="num_drafts"):
        m.run_mtp_propose_multi(3, 5, -1, seq, 0)
    with pytest.raises(Unsupported, match="grammar_bitmask"):
        m.run_mtp_propose_multi(3, 5, 1, seq, 0, [0])
    with pytest.raises(InvalidArgument, match="num_accepted"):
        m.trim_proposer_state(seq, -1, 0)
    with pytest.raises(Unsupported, match="speculative_generate"):
        m.generate_speculative(prompt(5), None, 2)
    with pytest.raises(Unsupported, match="adapters"):
        speculative_generate(m, None, prompt(5), 4, adapter="x")
    assert len(m.run_mtp_propose_multi(3, 5, 1, seq, 0)) == 1
    assert m.run_mtp_propose(3, 5, seq, 0) is not None
    m.decode(3, seq, 0)   # the saved rows end at position 4: no context for position 6
    assert m.run_mtp_propose_multi(8, 6, 1, seq, 0) == []
    m.free_sequence(seq)
