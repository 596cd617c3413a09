"""`perplexity`: exp(mean negative log-likelihood) of a token sequence, with a sliding
window for texts longer than the model's context (Hugging Face's strided evaluation).

Windows are `[begin, begin + window)` with `begin` stepping by `stride`; each window scores
the tokens that no earlier window scored, every one with the whole window before it as
context. So every token after the first is scored exactly once. A token needs at least one
token of context inside its window, so consecutive windows must overlap: a stride equal to
the window (the default) steps by `window - 1` (HF's recipe with stride == window leaves
the first token of every later window unscored). The result carries the number of tokens
scored (`len(ids) - 1`).

Logits come through the tensor contract's `prefill_all_logits` in chunks of `chunk`
positions, each reduced to NLLs on the host at once, so memory stays bounded by
`chunk x vocab` whatever the text length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import InvalidArgument, NonFiniteLogits
from ..kv.config import CacheConfig
from ..ops.argmax import nonfinite_counts
from .generate import check_prompt
from .models import context_limit, generative_model


@dataclass(frozen=True)
class PerplexityResult:
    """perplexity = exp(nll / tokens_scored); windows: forward contexts evaluated;
    step: how far each window moved (`min(stride, window - 1)`)."""

    perplexity: float
    nll: float
    tokens_scored: int
    windows: int
    window: int
    step: int


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(target) per row, in float64. logits: [n, vocab]; targets: [n]."""
    x = logits.astype(np.float64)
    mx = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - mx).sum(axis=1)) + mx[:, 0]
    return x[np.arange(len(targets)), targets] - lse


_MAX_LOG = math.log(np.finfo(np.float64).max)


def _check_finite(rows: np.ndarray, first_pos: int) -> None:
    """NonFiniteLogits naming the first of `rows` (the logits of positions first_pos, ...)
    that holds NaN / Inf."""
    from .sampler import nonfinite_message
    counts = nonfinite_counts(rows)
    bad = np.flatnonzero(counts)
    if bad.size:
        r = int(bad[0])
        raise NonFiniteLogits(nonfinite_message(
            f"perplexity: the logits of sequence position {first_pos + r} (scoring token "
            f"{first_pos + r + 1})", int(counts[r]), rows.shape[1]))


def window_plan(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) of each window over `n_tokens` tokens: the window
    `[begin, end)` scores tokens `[first_scored, end)`; together they cover [1, n) once."""
    step = min(stride, window - 1)
    plan, scored_to, begin = [], 1, 0
    while scored_to < n_tokens:
        end = min(begin + window, n_tokens)
        if end > scored_to:
            plan.append((begin, end, scored_to))
            scored_to = end
        begin += step
    return plan


def perplexity_details(model, token_ids: Sequence[int], window: int | None = None,
                       stride: int | None = None, chunk: int = 512,
                       on_progress=None) -> PerplexityResult:
    """Perplexity of `token_ids` (at least 2 tokens) under `model`, with the counts.

    window: most tokens in one forward context (default: the whole text when it fits the
    model's max_seq_len, else that limit); stride: how far the window moves (default
    `window`; at most `window - 1` is used); `on_progress(scored, total)` is called after
    each forward pass with the tokens scored so far and the number to score.
    """
    gm = generative_model(model)
    ids = check_prompt(token_ids, gm.metadata().vocab_size)
    if len(ids) < 2:
        raise InvalidArgument("perplexity needs at least 2 tokens")
    limit = context_limit(gm, default=len(ids))
    window = min(len(ids), limit) if window is None else window
    stride = window if stride is None else stride
    for name, v in (("window", window), ("stride", stride), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgument(f"perplexity: {name} must be a positive int, got {v!r}")
    if window < 2 or window > limit:
        raise InvalidArgument(f"perplexity: window {window} must be in [2, max_seq_len={limit}]")
    if stride > window:
        raise InvalidArgument(f"perplexity: stride {stride} > window {window} would skip tokens")
    block = getattr(getattr(gm, "model", None), "kv_block_size", lambda: 16)()
    from ..generative import to_numpy
    arr = np.asarray(ids, np.int32)
    plan = window_plan(len(ids), window, stride)
    nll, count = 0.0, 0
    for begin, end, first in plan:
        cache = gm.create_kv_cache(CacheConfig(max_seq_len=end - begin, block_size=block))
        try:
            for c0 in range(begin, end, chunk):
                c1 = min(c0 + chunk, end)
                # row i of this chunk predicts token c0 + i + 1; score [first, end) only
                lo, hi = max(first, c0 + 1), min(c1 + 1, end)
                logits = to_numpy(gm.prefill_all_logits(gm.embed(arr[None, c0:c1]), cache,
                                                        range(c0 - begin, c1 - begin)))[0]
                if hi > lo:
                    rows = np.arange(lo - 1 - c0, hi - 1 - c0)
                    _check_finite(logits[rows], lo - 1)
                    nll -= float(_log_softmax_at(logits[rows], arr[lo:hi]).sum())
                    count += hi - lo
                if on_progress is not None:
                    on_progress(count, len(ids) - 1)
        finally:
            cache.free()
    assert count == len(ids) - 1, (count, len(ids))
    if not nll / count < _MAX_LOG:   # exp would overflow (finite logits, but enormous)
        raise NonFiniteLogits(f"perplexity: exp(mean NLL {nll / count:.6g}) over {count} "
                              "tokens is not a finite float64")
    return PerplexityResult(perplexity=math.exp(nll / count), nll=nll, tokens_scored=count,
                            windows=len(plan), window=window, step=min(stride, window - 1))


def perplexity(model, token_ids: Sequence[int], window: int | None = None,
               stride: int | None = None, chunk: int = 512) -> float:
    """Perplexity of `token_ids` under `model` (see `perplexity_details` for the counts)."""
    return perplexity_details(model, token_ids, window, stride, chunk).perplexity
