"""The Rust server's batched mixed step, ported line by line in meaning, driving a
`TransformerModel` on HostBackend (issue 18, "Done when").

Ported from `crates/server/src/scheduler/.../run_batched_mixed_step` (the batched mixed
step) and `prefill_plan::plan_chunk_len` (model-engine), with the preemption rule of the
server's `decode_batch_with_preemption`: an error whose text contains "KV cache exhausted"
with more than one sequence running preempts one and retries. Greedy only, like the
model's device argmax. Every request must produce exactly what it produces alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from metrale.engine import generate
from metrale.gpu_runtime import HostBackend
from metrale.model_engine import PrefillSlice
from tests.model.common import load

MAX_PREFILL_TOKENS = 10


def plan_chunk_len(offset, total, proposed, block_size, split):
    """`prefill_plan::plan_chunk_len`: a non-last chunk ends on a block boundary, then at
    the tail split, then is rounded down to a multiple of 4."""
    if proposed == 0 or offset + proposed >= total:
        return proposed
    end = offset + proposed
    if block_size:
        aligned = end // block_size * block_size
        if aligned > offset:
            end = aligned
    if split is not None and offset < split < end:
        end = split
    n = end - offset
    return n // 4 * 4 if n >= 4 else n


def plan_chunk_len_grid(offset, total, proposed, block_size, split, grid):
    """`prefill_plan::plan_chunk_len_grid`: with a grid G, chunks end on multiples of G."""
    if grid and proposed > 0:
        return 0 if offset >= total else min((offset // grid + 1) * grid, total) - offset
    return plan_chunk_len(offset, total, proposed, block_size, split)


@dataclass
class Request:
    rid: int
    prompt: list
    max_new: int
    output: list = field(default_factory=list)


@dataclass
class Prefilling:          # the server's PrefillInProgress
    req: Request
    prompt_tokens: list
    seq: object
    chunk_offset: int = 0


@dataclass
class Active:              # the server's ActiveSeq
    req: Request
    seq: object
    last_token: int


def run_batched_mixed_step(model, active, prefilling, prefill_stream, prefill_event):
    """One mixed step; returns the prefills that finished, with their first token."""
    model.poll_innerq()
    chunk_lens, is_last = [], []
    for p in prefilling:
        remaining = len(p.prompt_tokens) - p.chunk_offset
        chunk_len = min(remaining, remaining if model.is_mla() else MAX_PREFILL_TOKENS)
        chunk_len = plan_chunk_len_grid(p.chunk_offset, len(p.prompt_tokens), chunk_len,
                                        model.kv_block_size(),
                                        model.prefill_tail_split(p.prompt_tokens),
                                        model.prefill_grid(p.prompt_tokens))
        chunk_lens.append(chunk_len)
        is_last.append(p.chunk_offset + chunk_len >= len(p.prompt_tokens))
    result = model.mixed_forward_batch(
        [a.last_token for a in active], [a.seq for a in active],
        [PrefillSlice(p.prompt_tokens, p.seq, p.chunk_offset, chunk_lens[i], is_last[i])
         for i, p in enumerate(prefilling)], prefill_stream)
    model.record_event(prefill_event, prefill_stream)
    model.stream_wait_event(model.default_stream(), prefill_event)
    assert len(result.prefill_logits) == len(prefilling)
    completed = []
    for i, p in enumerate(prefilling):
        p.chunk_offset += chunk_lens[i]
        if not is_last[i]:
            continue
        logits = result.prefill_logits[i]
        assert not logits.is_null(), "marked is_last but the model returned NULL logits"
        completed.append((p, model.argmax_on_device(logits, 0)))
    if active and not result.decode_logits.is_null():
        ids = model.argmax_batch(result.decode_logits, len(active), 0)
        for a, tok in zip(active, ids):
            a.req.output.append(tok)
            a.last_token = tok
    return completed


class Server:
    """The loop around the step: admission, promotion, finishing, preemption."""

    def __init__(self, model, max_running=6):
        self.m, self.max_running = model, max_running
        self.waiting, self.prefilling, self.active, self.done = [], [], [], {}
        self.prefill_stream = model.create_stream()
        self.prefill_event = model.create_event()
        self.preemptions = 0

    def admit(self):
        m, bs = self.m, self.m.kv_block_size()
        while self.waiting and len(self.prefilling) + len(self.active) < self.max_running:
            r = self.waiting[0]
            prompt = r.prompt + r.output          # a preempted request recomputes its tokens
            need = -(-len(prompt) // bs) + len(self.active) + len(self.prefilling)
            if m.num_free_blocks() < need:
                m.reclaim_prefix_blocks(need - m.num_free_blocks())
            if m.num_free_blocks() < need and (self.active or self.prefilling):
                return
            self.waiting.pop(0)
            self.prefilling.append(Prefilling(r, prompt, m.alloc_sequence_for(
                len(r.prompt) + r.max_new)))

    def release(self, seq):
        self.m.cache_sequence(seq)
        self.m.free_sequence(seq)

    def preempt(self, e) -> bool:
        """The server's rule: only a "KV cache exhausted" error, only with more than one
        sequence in flight; the victim is the newest."""
        if "KV cache exhausted" not in str(e) or len(self.active) + len(self.prefilling) < 2:
            return False
        victim = self.prefilling.pop() if self.prefilling else self.active.pop()
        self.release(victim.seq)
        self.waiting.insert(0, victim.req)
        self.preemptions += 1
        return True

    def step(self):
        self.admit()
        while True:
            try:
                completed = run_batched_mixed_step(self.m, self.active, self.prefilling,
                                                   self.prefill_stream, self.prefill_event)
                break
            except Exception as e:  # noqa: BLE001 - the server matches the error text
                if not self.preempt(e):
                    raise
        for a in list(self.active):
            self.finish_if_done(a)
        for p, first in completed:
            self.prefilling.remove(p)
            p.req.output.append(first)
            a = Active(p.req, p.seq, first)
            self.active.append(a)
            self.finish_if_done(a)

    def finish_if_done(self, a):
        if len(a.req.output) >= a.req.max_new:
            self.active.remove(a)
            self.release(a.seq)
            self.done[a.req.rid] = a.req.output

    def run(self, requests):
        self.waiting = list(requests)
        while self.waiting or self.prefilling or self.active:
            self.step()
        return self.done


def test_plan_chunk_len_matches_the_rust_rule():
    assert plan_chunk_len(0, 30, 10, 4, None) == 8      # ends on a block boundary
    assert plan_chunk_len(0, 30, 10, 4, 6) == 4         # then at the split, then x4
    assert plan_chunk_len(8, 17, 9, 4, None) == 9       # the last chunk is unchanged
    assert plan_chunk_len(0, 30, 3, 4, None) == 3
    assert plan_chunk_len_grid(5, 30, 10, 4, None, 8) == 3   # to the next multiple of G


def test_ported_mixed_step_equals_solo_greedy_runs():
    be = HostBackend()
    m = load("llama_gqa", be, kv_blocks=22, block_size=4, max_batch=8)
    rng = np.random.default_rng(18)
    shared = rng.integers(4, 256, 9).tolist()
    reqs = []
    for i in range(24):
        prompt = rng.integers(4, 256, int(rng.integers(1, 26))).tolist()
        if i % 3 == 0:
            prompt = shared + prompt
        reqs.append(Request(i, prompt, int(rng.integers(1, 14))))
    live0 = be.live_bytes()
    server = Server(m)
    done = server.run(reqs)
    assert len(done) == len(reqs)
    assert server.preemptions > 0, "the pool was meant to force preemption"
    for r in reqs:
        want = generate(m, r.prompt, r.max_new, stop_token_ids=[]).tokens
        assert done[r.rid] == want, f"request {r.rid}"
    m.reclaim_prefix_blocks(m.num_total_blocks())
    assert m.num_free_blocks() == m.num_total_blocks() and be.live_bytes() == live0
