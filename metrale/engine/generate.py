"""`generate`: prompt in, new tokens out, streaming through `on_token`, stopping at stop ids.

Runs on the pointer API (prefill, then one `decode` per token, the next token chosen on the
device); a `GenerativeModel` that is not a decoder adapter runs through the tensor
contract instead, with the same sampling rule applied by its numpy twin on the host.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import InvalidArgument
from ..kv.config import CacheConfig
from .models import eos_ids, generative_model, pointer_model
from .sampler import DeviceSampler
from .sampling import SamplingParams, resolve_seed


@dataclass
class GenerationResult:
    """tokens: the new tokens only (a stop token that ended generation included);
    finish_reason: "stop" (a stop id), "length" (max_new_tokens reached)."""

    tokens: list[int]
    finish_reason: str
    ttft_s: float
    decode_tokens_per_s: float
    accepted: int = 0   # speculative decoding only: draft tokens the target accepted
    proposed: int = 0   # speculative decoding only: draft tokens proposed
    extra: dict = field(default_factory=dict)


def check_prompt(prompt_ids, vocab: int) -> list[int]:
    try:
        ids = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, np.ndarray)
                                else prompt_ids)]
    except (TypeError, ValueError):
        raise InvalidArgument("prompt_ids must be a sequence of ints") from None
    if not ids:
        raise InvalidArgument("prompt_ids is empty")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidArgument(f"prompt token id {bad[0]} is outside [0, vocab_size={vocab})")
    return ids


def check_max_new(max_new_tokens) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise InvalidArgument(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    return int(max_new_tokens)


def resolve_stops(model, stop_token_ids) -> set[int]:
    return set(eos_ids(model)) if stop_token_ids is None else {int(t) for t in stop_token_ids}


def generate(model, prompt_ids: Sequence[int], max_new_tokens: int,
             sampling: SamplingParams | None = None, stop_token_ids=None,
             on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids`.

    sampling: None is greedy (the device argmax rule). stop_token_ids: None stops at the
    checkpoint's eos ids; an empty list never stops early. on_token(id) is called for
    each new token as soon as it is chosen.
    """
    sampling = sampling or SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise InvalidArgument(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    pm = pointer_model(model)   # raises InvalidArgument for anything but a metrale model
    max_new = check_max_new(max_new_tokens)
    prompt = check_prompt(prompt_ids, model.metadata().vocab_size)
    stops = resolve_stops(model, stop_token_ids)
    if pm is None:
        return _generate_tensor(generative_model(model), prompt, max_new, sampling, stops,
                                on_token)
    return _generate_pointer(pm, prompt, max_new, sampling, stops, on_token)


def _generate_pointer(m, prompt, max_new, sampling, stops, on_token) -> GenerationResult:
    stream = m.default_stream()
    seed = resolve_seed(sampling)
    sampler = DeviceSampler(m)
    seq = m.alloc_sequence()
    out: list[int] = []
    try:
        t0 = time.perf_counter()
        ptr = m.prefill(prompt, seq, stream)
        tok = sampler.pick(ptr, [sampling], [seed], [0], [prompt], stream)[0]
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        reason = "length"
        while True:
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if tok in stops:
                reason = "stop"
                break
            if len(out) >= max_new:
                break
            ptr = m.decode(tok, seq, stream)
            tok = sampler.pick(ptr, [sampling], [seed], [len(out)], [prompt + out], stream)[0]
        dt = time.perf_counter() - t1
    finally:
        m.free_sequence(seq)
        sampler.free()
    return GenerationResult(out, reason, ttft, (len(out) - 1) / dt if len(out) > 1 and dt > 0
                            else 0.0)


def _generate_tensor(gm, prompt, max_new, sampling, stops, on_token) -> GenerationResult:
    from ..generative import to_numpy
    from ..ops import sampling as sampling_ops
    seed = resolve_seed(sampling)
    params = sampling_ops.pack_params([sampling])

    def pick(logits_row, step, history):
        if sampling.is_greedy and sampling.repetition_penalty == 1.0:
            from ..ops.argmax import argmax_rule
            return int(argmax_rule(logits_row[None])[0])
        ids = np.asarray([history], np.int32)
        return int(sampling_ops.sample_host(logits_row[None], params, [seed], [step], ids,
                                            np.asarray([len(history)], np.int32))[0])

    cache = gm.create_kv_cache(CacheConfig(max_seq_len=len(prompt) + max_new,
                                           block_size=_block_size(gm)))
    out: list[int] = []
    try:
        t0 = time.perf_counter()
        ids = np.asarray([prompt], np.int32)
        logits = to_numpy(gm.prefill(gm.embed(ids), cache, range(0, len(prompt))))[0]
        tok = pick(logits, 0, prompt)
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        reason = "length"
        while True:
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if tok in stops:
                reason = "stop"
                break
            if len(out) >= max_new:
                break
            emb = gm.embed(np.asarray([[tok]], np.int32))
            logits = to_numpy(gm.decode(emb, cache))[0]
            tok = pick(logits, len(out), prompt + out)
        dt = time.perf_counter() - t1
    finally:
        cache.free()
    return GenerationResult(out, reason, ttft, (len(out) - 1) / dt if len(out) > 1 and dt > 0
                            else 0.0)


def _block_size(gm) -> int:
    inner = getattr(gm, "model", None)
    return inner.kv_block_size() if inner is not None and hasattr(inner, "kv_block_size") else 16
