"""Speculative decoding with the target's own draft proposer (DeepSeek-V3's MTP module):
`speculative_generate(model, None, ...)` for a model whose `has_proposer()` is true.

Each round goes through the original's `ModelDraft` contract as its verify steps do:
`decode_verify([last] + drafts)`, the rejected rows rolled back, `save_hidden_for_mtp` of
the accepted row, `trim_proposer_state`, then `run_mtp_propose_multi` for the next round's
drafts; a round the proposer drafts nothing for is a plain decode step followed by the same
save and propose. Greedy only, and token for token `generate`'s greedy output (every verify
row is computed as a decode step), whatever the drafts.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

from ..errors import InvalidArgument, Unsupported
from ..model_engine.transformer import MAX_VERIFY_ROWS
from .generate import GenerationResult, check_max_new, check_prompt, check_prompt_fits, \
    emit_tokens, resolve_stops
from .models import pointer_model
from .sampler import DeviceSampler


def mtp_speculative_generate(target, prompt_ids: Sequence[int], max_new_tokens: int,
                             k: int = 1, stop_token_ids=None,
                             on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Greedy generation of up to `max_new_tokens` tokens with up to `k` MTP drafts per
    round. Returns a GenerationResult with `accepted` / `proposed` draft counts."""
    tm = pointer_model(target)
    if tm is None or not tm.has_proposer():
        raise Unsupported("speculative_generate without a draft model needs a model with its "
                          "own draft proposer (DeepSeek-V3 loaded with its MTP module)")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < MAX_VERIFY_ROWS:
        raise InvalidArgument(f"k must be an int in [1, {MAX_VERIFY_ROWS - 1}], got {k!r}")
    max_new = check_max_new(max_new_tokens)
    prompt = check_prompt(prompt_ids, tm.vocab_size())
    stops = resolve_stops(target, stop_token_ids)
    t_limit = check_prompt_fits(len(prompt), tm, room_for_output=True)
    ts = tm.default_stream()
    seq = tm.alloc_sequence()
    checker = DeviceSampler(tm)
    out: list[int] = []
    accepted = proposed = 0
    reason, extra = "length", {}
    try:
        t0 = time.perf_counter()
        # the prompt in chunks of one pass each; after each, the MTP is fed the chunk's
        # pairs (the last one's with the next chunk's first token), so it sees all of them
        step = tm.max_prefill_tokens()
        for c0 in range(0, len(prompt), step):
            n = min(step, len(prompt) - c0)
            logits = tm.prefill_chunk(prompt, seq, c0, n, c0 + n == len(prompt), ts)
            tm.save_hidden_for_mtp(n - 1, ts)
            if c0 + n < len(prompt):
                tm.run_mtp_propose_multi(prompt[c0 + n], c0 + n, 0, seq, ts)
        last = checker.greedy(logits, 1, ts, lambda _: (
            f"speculative_generate: new token 0 (the logits of sequence position "
            f"{len(prompt) - 1})"))[0]
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        pending = [last]
        while True:
            end = emit_tokens(pending, out, on_token, stops, max_new, t_limit - len(prompt),
                              extra)
            if end is not None:
                reason = end
                break
            fed, last = len(prompt) + len(out) - 1, out[-1]   # the cache holds `fed` tokens
            kk = max(0, min(k, max_new - len(out), t_limit - fed - 2))
            drafts = tm.run_mtp_propose_multi(last, fed, kk, seq, ts) if kk else []
            if not drafts:   # a plain decode step, then the proposer sees its row
                tok = checker.greedy(tm.decode(last, seq, ts), 1, ts, lambda _: (
                    f"speculative_generate: new token {len(out)} (the logits of sequence "
                    f"position {fed})"))[0]
                tm.save_hidden_for_mtp(0, ts)
                tm.trim_proposer_state(seq, 0, ts)
                pending = [tok]
                continue
            verdict = tm.decode_verify([last] + drafts, seq, ts)
            j = 0
            while j < len(drafts) and drafts[j] == verdict[j]:
                j += 1
            checker.check(tm.logits_buffer_ptr(), j + 1, ts, lambda r: (
                f"speculative_generate: new token {len(out) + r} (the logits of sequence "
                f"position {fed + r})"))
            accepted += j
            proposed += len(drafts)
            tm.rollback(seq, len(drafts) - j)
            tm.save_hidden_for_mtp(j, ts)            # the accepted row: the bonus's hidden
            tm.trim_proposer_state(seq, j, ts)
            pending = drafts[:j] + [verdict[j]]
        dt = time.perf_counter() - t1
    finally:
        tm.free_sequence(seq)
        checker.free()
    rate = (len(out) - 1) / dt if len(out) > 1 and dt > 0 else 0.0
    return GenerationResult(out, reason, ttft, rate, accepted=accepted, proposed=proposed,
                            extra=extra)
