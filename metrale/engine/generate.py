"""`generate`: prompt in, new tokens out, streaming through `on_token`, stopping at stop ids,
after `max_new_tokens` or at the model's context limit (both `finish_reason="length"`, the
OpenAI/vLLM convention; the tokens made so far are returned). The context limit counts
prompt + output, as vLLM's `max_model_len`: a 40-token prompt under `max_seq_len=48` gets
at most 8 new tokens, and a prompt that leaves no room for one is refused.

Runs on the pointer API (prefill, then one `decode` per token, the next token chosen on the
device); a `GenerativeModel` that is not a decoder adapter runs through the tensor
contract instead, with the same sampling rule applied by its numpy twin on the host.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import InvalidArgument, Unsupported
from ..kv.config import CacheConfig
from .models import context_limit, eos_ids, generative_model, pointer_model
from .multimodal import image_prefill
from .sampler import DeviceSampler
from .sampling import SamplingParams, resolve_seed


@dataclass
class GenerationResult:
    """tokens: the new tokens only (a stop token that ended generation included);
    finish_reason: "stop" (a stop id), "length" (max_new_tokens or the context limit
    reached; `extra["context_limit"]` is True when the context limit stopped it)."""

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


def check_prompt_fits(prompt_len: int, model, what: str = "prompt",
                      room_for_output: bool = False) -> int | None:
    """The model's context limit (None when it has none); InvalidArgument naming the
    prompt length, the limit and the load option that raises it when the prompt alone does
    not fit, or, with `room_for_output` (generation: prompt + output <= limit), when it
    leaves no room for one new token."""
    limit = context_limit(model)
    if limit is not None and prompt_len > limit:
        raise InvalidArgument(f"{what} of {prompt_len} tokens exceeds the model's context "
                              f"limit of {limit} tokens; {limit_advice(model)}")
    if limit is not None and room_for_output and prompt_len >= limit:
        raise InvalidArgument(f"{what} of {prompt_len} tokens leaves no room for a new token "
                              f"in the model's context limit of {limit} tokens (prompt + "
                              f"output <= {limit}, vLLM's max_model_len rule); "
                              f"{limit_advice(model)}")
    return limit


def limit_advice(model) -> str:
    """Which load option raises the context limit of `model` (a pointer-API model)."""
    m = pointer_model(model)
    max_pos = m.metadata().max_position_embeddings
    pool = m.num_total_blocks() * m.kv_block_size()
    if m._max_seq_len >= max_pos:
        return (f"that is the checkpoint's max_position_embeddings ({max_pos}): shorten the "
                "prompt")
    if pool <= m._max_seq_len:
        return (f"the KV pool holds {m.num_total_blocks()} blocks of {m.kv_block_size()}: "
                f"load with more, metrale.load(..., kv_blocks=N) (at most "
                f"max_position_embeddings={max_pos} positions are usable)")
    return (f"load with metrale.load(..., max_seq_len=N) (command line: --max-seq-len N), up "
            f"to max_position_embeddings={max_pos}")


def resolve_stops(model, stop_token_ids) -> set[int]:
    return set(eos_ids(model)) if stop_token_ids is None else {int(t) for t in stop_token_ids}


def generate(model, prompt_ids: Sequence[int], max_new_tokens: int,
             sampling: SamplingParams | None = None, stop_token_ids=None,
             on_token: Callable[[int], None] | None = None,
             images=None, adapter=None) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids`.

    sampling: None is greedy (the device argmax rule). stop_token_ids: None stops at the
    checkpoint's eos ids; an empty list never stops early. on_token(id) is called for
    each new token as soon as it is chosen. Generation also stops ("length") when prompt +
    output reach the model's context (`max_seq_len`, counted as vLLM counts
    `max_model_len`); a prompt that leaves no room for a new token raises InvalidArgument
    naming both and the load option that raises the limit. Logits holding NaN / Inf raise
    NonFiniteLogits naming the position (the tokens made before it went to `on_token`).
    images (LLaVA): one preprocessed `[1, 3, H, W]` float32 image per image-token span of
    the prompt, in order (engine/multimodal.py). adapter: the LoRA adapter to generate with
    (a resident name or slot of a model loaded with LoRA slots; None: the active one, else
    the base model).
    """
    sampling = sampling or SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise InvalidArgument(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    pm = pointer_model(model)   # raises InvalidArgument for anything but a metrale model
    max_new = check_max_new(max_new_tokens)
    prompt = check_prompt(prompt_ids, model.metadata().vocab_size)
    stops = resolve_stops(model, stop_token_ids)
    if pm is None:
        if adapter is not None:
            raise Unsupported("generate: a LoRA adapter needs a metrale pointer-API model "
                              "(metrale.load(..., max_loras=N))")
        if images is not None and len(images):
            raise Unsupported("generate: images need a metrale pointer-API model "
                              "(metrale.load of a LLaVA checkpoint)")
        return _generate_tensor(generative_model(model), prompt, max_new, sampling, stops,
                                on_token)
    prefill = image_prefill(pm, prompt, images)
    limit = check_prompt_fits(len(prompt), pm, room_for_output=True)
    seq = pm.alloc_sequence(adapter=adapter)   # checked before anything runs
    return _generate_pointer(pm, prompt, max_new, sampling, stops, on_token, limit, prefill,
                             seq)


def _decode_loop(first, advance, max_new: int, stops, on_token,
                 max_out: int | None = None) -> GenerationResult:
    """The loop both paths share. first() -> the first new token (after the prompt);
    advance(tok, out) -> the next token after feeding `tok` (out: tokens so far).
    max_out: most new tokens the context allows (prompt + output <= limit), or None."""
    out: list[int] = []
    extra: dict = {}
    t0 = time.perf_counter()
    tok = first()
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    while True:
        reason = emit_tokens([tok], out, on_token, stops, max_new, max_out, extra)
        if reason is not None:
            break
        tok = advance(tok, out)
    dt = time.perf_counter() - t1
    rate = (len(out) - 1) / dt if len(out) > 1 and dt > 0 else 0.0
    return GenerationResult(out, reason, ttft, rate, extra=extra)


def emit_tokens(pending: list[int], out: list[int], on_token, stops, max_new: int,
                max_out: int | None, extra: dict) -> str | None:
    """Append the chosen tokens `pending` to `out` in order, each to `on_token`; the
    finish reason once one ends the generation, else None: "stop" at a stop token;
    "length" at `max_new` tokens or at `max_out` (the context left after the prompt; None:
    no limit), which also sets extra["context_limit"]."""
    for tok in pending:
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if tok in stops:
            return "stop"
        if len(out) >= max_new:
            return "length"
        if max_out is not None and len(out) >= max_out:   # prompt + output <= max_seq_len
            extra["context_limit"] = True
            return "length"
    return None


def _max_out(prompt_len: int, limit: int | None) -> int | None:
    """New tokens a context of `limit` tokens allows after the prompt: prompt + output <=
    limit (vLLM's max_model_len; the last token would need no position of its own, but it
    counts, as in vLLM)."""
    return None if limit is None else limit - prompt_len


def _generate_pointer(m, prompt, max_new, sampling, stops, on_token, limit,
                      prefill, seq) -> GenerationResult:
    stream = m.default_stream()
    seed = resolve_seed(sampling)
    sampler = DeviceSampler(m)

    def pick(ptr, step, history):
        def where(_):
            return (f"generate: new token {step} (the logits of sequence position "
                    f"{len(history) - 1})")
        return sampler.pick(ptr, [sampling], [seed], [step], [history], stream, where)[0]
    try:
        return _decode_loop(lambda: pick(prefill(prompt, seq, stream), 0, prompt),
                            lambda tok, out: pick(m.decode(tok, seq, stream), len(out),
                                                  prompt + out),
                            max_new, stops, on_token, _max_out(len(prompt), limit))
    finally:
        m.free_sequence(seq)
        sampler.free()


def _generate_tensor(gm, prompt, max_new, sampling, stops, on_token) -> GenerationResult:
    """For GenerativeModels without the pointer API: the same sampling rule, applied by the
    kernel's numpy twin to the logits the model returns."""
    from ..generative import to_numpy
    from ..ops import sampling as sampling_ops
    from ..ops.argmax import argmax_rule, nonfinite_counts
    from .sampler import check_finite
    seed = resolve_seed(sampling)
    params = sampling_ops.pack_params([sampling])

    def pick(logits, step, history):
        row = to_numpy(logits)[0][None]
        check_finite(nonfinite_counts(row).tolist(), row.shape[1],
                     lambda _: f"generate: new token {step} (the logits of sequence position "
                               f"{len(history) - 1})")
        if sampling.is_greedy and sampling.repetition_penalty == 1.0:
            return int(argmax_rule(row)[0])
        return int(sampling_ops.sample_host(row, params, [seed], [step],
                                            np.asarray([history], np.int32),
                                            np.asarray([len(history)], np.int32))[0])

    cache = gm.create_kv_cache(CacheConfig(max_seq_len=len(prompt) + max_new - 1,
                                           block_size=_block_size(gm)))
    try:
        ids = np.asarray([prompt], np.int32)
        return _decode_loop(
            lambda: pick(gm.prefill(gm.embed(ids), cache, range(0, len(prompt))), 0, prompt),
            lambda tok, out: pick(gm.decode(gm.embed(np.asarray([[tok]], np.int32)), cache),
                                  len(out), prompt + out),
            max_new, stops, on_token)
    finally:
        cache.free()


def _block_size(gm) -> int:
    inner = getattr(gm, "model", None)
    return inner.kv_block_size() if inner is not None and hasattr(inner, "kv_block_size") else 16
