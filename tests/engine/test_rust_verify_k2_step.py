"""The Rust server's single-sequence K=2 verify step, ported line by line in meaning,
driving a `TransformerModel` on HostBackend (issue 29 §1).

Ported from `crates/server/src/scheduler/verify_k2_step.rs` (`step_verify_k2`): sync the
secondary, EP broadcasts (a no-op on one rank), one 2-row `decode_verify_graphed` of
`[last_token, draft]`, accept when the draft equals the first pick, then on accept emit the
draft and the bonus token, commit both rows, `dflash_eagle_accept_append`,
`save_hidden_for_mtp(1)`, `trim_proposer_state`, `run_mtp_propose_multi`; on reject pop
the draft off the sequence by hand (`seq_len -= 1; tokens.pop()`), trim, commit one row,
emit the pick, `save_hidden_for_mtp(0)`, propose. The picks are the raw device argmax (no
logit processors: `verify_pick_all_with_pipeline` returns them unchanged), no logprobs, no
MTP catch-up ring (off unless METRALE_MTP_CATCHUP).

This model has no MTP head: `run_mtp_propose_multi` returns [] and the step keeps its
pending drafts (Rust's `Ok(_) => {}` arm). Between steps a draft model refreshes them for
some requests, as the server's external-drafter paths do; the others keep stale drafts.
Every request must produce exactly its solo greedy output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from metrale.engine import generate
from metrale.gpu_runtime import HostBackend
from tests.model.common import load


@dataclass
class ActiveSeq:           # the server's ActiveSeq, the fields the step reads
    rid: int
    seq: object
    last_token: int
    max_tokens: int
    stop_ids: set
    pending_drafts: list = field(default_factory=list)
    output: list = field(default_factory=list)
    finished: bool = False


@dataclass
class Counters:            # the k2_accepts / k2_rejects of SpecStats
    accepts: int = 0
    rejects: int = 0
    saved_rows: list = field(default_factory=list)


def emit_token(a: ActiveSeq, tok: int) -> None:
    """`emit_step::emit_token`: append, finish on a stop id or at max_tokens."""
    a.output.append(tok)
    if tok in a.stop_ids or len(a.output) >= a.max_tokens:
        a.finished = True


def drafter_accepted(a: ActiveSeq, n: int) -> int:
    return n


def step_verify_k2(model, a: ActiveSeq, stats: Counters, drafts, num_drafts: int) -> None:
    model.sync_secondary()
    tokens_k2 = [a.last_token, drafts[0]]
    model.ep_broadcast_cmd_for_seq(a.seq.seq_id, 0xFFFFFFF2)
    for t in tokens_k2:
        model.ep_broadcast_cmd(t)
    result_vec = model.decode_verify_graphed(tokens_k2, a.seq, 0)
    v0, v1 = result_vec[0], result_vec[1]
    accepted = drafts[0] == v0
    model.ep_broadcast_cmd(int(accepted))
    if accepted:
        emit_token(a, drafts[0])
        if not a.finished:
            emit_token(a, v1)
        if a.finished:
            return
        a.last_token = v1
        model.commit_accepted_prefix(a.seq, 2, 2)
        model.dflash_eagle_accept_append(a.seq)
        model.save_hidden_for_mtp(1, 0)
        stats.saved_rows.append(model.last_mtp_hidden_idx())
        model.trim_proposer_state(a.seq, drafter_accepted(a, 1), 0)
        d = model.run_mtp_propose_multi(v1, a.seq.seq_len, num_drafts, a.seq, 0, None)
        if d:
            a.pending_drafts = d
        stats.accepts += 1
        model.decode_marconi_checkpoint(a.seq)
    else:
        a.seq.seq_len -= 1
        a.seq.tokens.pop()
        model.trim_proposer_state(a.seq, drafter_accepted(a, 0), 0)
        model.commit_accepted_prefix(a.seq, 1, 2)
        emit_token(a, v0)
        if a.finished:
            return
        a.last_token = v0
        model.save_hidden_for_mtp(0, 0)
        stats.saved_rows.append(model.last_mtp_hidden_idx())
        d = model.run_mtp_propose_multi(v0, a.seq.seq_len, num_drafts, a.seq, 0, None)
        if d:
            a.pending_drafts = d
        stats.rejects += 1
        model.decode_marconi_checkpoint(a.seq)


class Drafter:
    """A draft model kept in step with one target sequence: its greedy next token after
    the target's cached tokens and `last_token`."""

    def __init__(self, dm):
        self.dm, self.seq = dm, dm.alloc_sequence()

    def propose(self, a: ActiveSeq) -> list[int]:
        dm, s = self.dm, self.seq
        ctx = list(a.seq.tokens) + [a.last_token]
        common = 0
        while common < min(len(s.tokens), len(ctx) - 1) and s.tokens[common] == ctx[common]:
            common += 1
        dm.rollback(s, s.seq_len - common)
        if s.seq_len == 0:
            return [dm.argmax_on_device(dm.prefill(ctx, s, 0), 0)]
        return [dm.decode_verify(ctx[common:], s, 0)[-1]]

    def free(self):
        self.dm.free_sequence(self.seq)


def test_ported_verify_k2_step_equals_solo_greedy_runs():
    be = HostBackend()
    m = load("llama_gqa", be, kv_blocks=48, block_size=4)
    dm = load("llama_gqa", HostBackend(), kv_blocks=48, block_size=4)   # a perfect drafter
    noisy = load("qwen2", HostBackend(), kv_blocks=48, block_size=4)    # mostly wrong
    rng = np.random.default_rng(29)
    live0 = be.live_bytes()
    stats = Counters()
    active, drafters, want = [], {}, {}
    for rid in range(6):
        prompt = rng.integers(4, 250, int(rng.integers(1, 14))).tolist()
        max_tokens = int(rng.integers(2, 16))
        stops = {int(rng.integers(4, 250))} if rid % 3 == 2 else set()
        want[rid] = generate(m, prompt, max_tokens, stop_token_ids=stops).tokens
        seq = m.alloc_sequence()
        first = m.argmax_on_device(m.prefill(prompt, seq, 0), 0)
        a = ActiveSeq(rid, seq, first, max_tokens, stops, pending_drafts=[(first + 7) % 250])
        emit_token(a, first)
        if rid % 3 != 1:                   # rid % 3 == 1 keeps its stale first draft
            drafters[rid] = Drafter(dm if rid % 3 == 0 else noisy)
        active.append(a)
    while any(not a.finished for a in active):
        for a in active:                   # one K=2 step per request, round robin
            if a.finished:
                continue
            if a.rid in drafters:
                a.pending_drafts = drafters[a.rid].propose(a)
            step_verify_k2(m, a, stats, a.pending_drafts, 1)
            if a.finished:
                m.cache_sequence(a.seq)
                m.free_sequence(a.seq)
    for a in active:
        assert a.output == want[a.rid], f"request {a.rid}"
    assert stats.accepts > 0 and stats.rejects > 0, (stats.accepts, stats.rejects)
    assert set(stats.saved_rows) == {0, 1}
    for d in drafters.values():
        d.free()
    m.reclaim_prefix_blocks(m.num_total_blocks())
    assert m.num_free_blocks() == m.num_total_blocks() and be.live_bytes() == live0
