"""Speculative decoding: a draft model proposes k tokens, the target verifies them in one
`decode_verify` pass, rejected positions are rolled back in both models.

Greedy only: the target's verify rows are computed exactly like its decode steps (same
kernels, per-row reduction order), so the output equals `generate`'s greedy output token
for token, whatever the draft proposes — up to the target's context limit (prompt + output
<= its max_seq_len, vLLM's max_model_len rule), where both stop with
`finish_reason="length"`. Near a limit the draft proposes fewer tokens; once the draft's
own context is full the target goes on alone, one verify row per token. Target logits
holding NaN / Inf raise NonFiniteLogits naming the position.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

from ..errors import InvalidArgument, Unsupported
from ..model_engine.transformer import MAX_VERIFY_ROWS
from .generate import (GenerationResult, check_max_new, check_prompt, check_prompt_fits,
                       emit_tokens, resolve_stops)
from .models import pointer_model
from .sampler import DeviceSampler
from .sampling import SamplingParams


def speculative_generate(target, draft, prompt_ids: Sequence[int], max_new_tokens: int,
                         k: int = 4, sampling: SamplingParams | None = None,
                         stop_token_ids=None,
                         on_token: Callable[[int], None] | None = None, adapter=None,
                         draft_adapter=None) -> GenerationResult:
    """Greedy generation of up to `max_new_tokens` tokens, `k` draft proposals per round.

    `target` and `draft`: TransformerModels or decoder GenerativeModels sharing the
    vocabulary. `draft` None: the target's own proposer drafts (DeepSeek-V3's MTP module,
    mtp_speculative.py; no adapters). `adapter` / `draft_adapter`: the LoRA adapter each runs (as `generate`'s);
    the output is plain greedy's under the target's adapter. Returns a GenerationResult
    with `accepted` / `proposed` draft counts.
    """
    if sampling is not None and not (sampling.is_greedy and sampling.repetition_penalty == 1):
        raise Unsupported("speculative_generate implements greedy verification only "
                          "(temperature 0, no repetition penalty)")
    if draft is None:
        if adapter is not None or draft_adapter is not None:
            raise Unsupported("speculative_generate with the model's own proposer takes no "
                              "adapters")
        from .mtp_speculative import mtp_speculative_generate
        return mtp_speculative_generate(target, prompt_ids, max_new_tokens, k=k,
                                        stop_token_ids=stop_token_ids, on_token=on_token)
    tm, dm = pointer_model(target), pointer_model(draft)
    if tm is None or dm is None:
        raise Unsupported("speculative_generate needs decoder models with the pointer API")
    if tm.vocab_size() != dm.vocab_size():
        raise InvalidArgument(f"draft vocab_size {dm.vocab_size()} != target vocab_size "
                              f"{tm.vocab_size()}: the draft must share the vocabulary")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < MAX_VERIFY_ROWS:
        raise InvalidArgument(f"k must be an int in [1, {MAX_VERIFY_ROWS - 1}], got {k!r}")
    max_new = check_max_new(max_new_tokens)
    prompt = check_prompt(prompt_ids, tm.vocab_size())
    stops = resolve_stops(target, stop_token_ids)
    t_limit = check_prompt_fits(len(prompt), tm, room_for_output=True)
    d_limit = check_prompt_fits(len(prompt), dm, "prompt (for the draft model)")
    ts, ds = tm.default_stream(), dm.default_stream()
    tseq, dseq = tm.alloc_sequence(adapter=adapter), None   # (a bad adapter: nothing made)
    checker = DeviceSampler(tm)   # the target's logits are checked for NaN / Inf
    out: list[int] = []
    accepted = proposed = 0
    reason = "length"
    extra: dict = {}
    try:
        dseq = dm.alloc_sequence(adapter=draft_adapter)
        t0 = time.perf_counter()
        last = checker.greedy(tm.prefill(prompt, tseq, ts), 1, ts, lambda _: (
            f"speculative_generate: new token 0 (the logits of sequence position "
            f"{len(prompt) - 1})"))[0]
        ttft = time.perf_counter() - t0
        dm.prefill(prompt, dseq, ds)
        t1 = time.perf_counter()
        pending = [last]          # chosen tokens not yet fed to the target
        while True:
            end = emit_tokens(pending, out, on_token, stops, max_new, t_limit - len(prompt),
                              extra)
            if end is not None:
                reason = end
                break
            # the target holds prompt + out[:-1] (so does the draft while it proposes)
            fed = len(prompt) + len(out) - 1
            last = out[-1]
            # the draft proposes up to k tokens: never more than are still wanted, than the
            # context lets the output grow (the verify adds up to kk + 1 tokens, and prompt +
            # output <= t_limit) or the draft can hold (kk + 1 positions)
            kk = max(0, min(k, max_new - len(out), t_limit - fed - 2, d_limit - fed - 1))
            proposals, feed = [], last
            if kk and dm.has_ssm_layers():   # a recurrent draft rewinds to this checkpoint
                dm.checkpoint_ssm_states(dseq)
            for _ in range(kk):
                feed = dm.argmax_on_device(dm.decode(feed, dseq, ds), ds)
                proposals.append(feed)
            verdict = tm.decode_verify([last] + proposals, tseq, ts)  # kk + 1 argmax ids
            j = 0
            while j < kk and proposals[j] == verdict[j]:
                j += 1
            # the rows whose ids are emitted (accepted drafts' checks and the bonus token)
            checker.check(tm.logits_buffer_ptr(), j + 1, ts, lambda r: (
                f"speculative_generate: new token {len(out) + r} (the logits of sequence "
                f"position {fed + r})"))
            accepted += j
            proposed += kk
            tm.rollback(tseq, kk - j)              # keep last + accepted proposals
            if kk and dm.has_ssm_layers():
                # decode steps cannot be rewound one by one in a recurrent draft: back to
                # the checkpoint, then the kept tokens again as verify rows (each row the
                # bits of a decode step)
                dm.rollback(dseq, kk)
                dm.decode_verify([last] + proposals[:j + (j == kk)], dseq, ds)
            elif kk and j == kk:
                dm.decode(proposals[-1], dseq, ds)   # the draft never consumed its last one
            elif kk:
                dm.rollback(dseq, kk - 1 - j)
            pending = proposals[:j] + [verdict[j]]
        dt = time.perf_counter() - t1
    finally:
        tm.free_sequence(tseq)
        checker.free()
        if dseq is not None:
            dm.free_sequence(dseq)
    rate = (len(out) - 1) / dt if len(out) > 1 and dt > 0 else 0.0
    return GenerationResult(out, reason, ttft, rate, accepted=accepted, proposed=proposed,
                            extra=extra)

