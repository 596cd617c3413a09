"""`perplexity`: exp(mean negative log-likelihood) of a token sequence, with a sliding
window for texts longer than the model's context (the Hugging Face strided evaluation).

Logits come through the tensor contract's `prefill_all_logits` in chunks of `chunk`
positions, each reduced to NLLs on the host at once, so memory stays bounded by
`chunk x vocab` whatever the text length.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..errors import InvalidArgument
from ..kv.config import CacheConfig
from .generate import check_prompt
from .models import generative_model


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(target) per row, in float64. logits: [n, vocab]; targets: [n]."""
    x = logits.astype(np.float64)
    mx = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - mx).sum(axis=1)) + mx[:, 0]
    return x[np.arange(len(targets)), targets] - lse


def perplexity(model, token_ids: Sequence[int], window: int | None = None,
               stride: int | None = None, chunk: int = 512) -> float:
    """Perplexity of `token_ids` (at least 2 tokens) under `model`.

    window: most tokens in one forward context (default: the whole text when it fits the
    model's max_seq_len, else that limit); stride: how far the window moves (default
    `window`); each token after the first is scored once, with as much left context as
    the window allows.
    """
    gm = generative_model(model)
    ids = check_prompt(token_ids, gm.metadata().vocab_size)
    if len(ids) < 2:
        raise InvalidArgument("perplexity needs at least 2 tokens")
    limit = getattr(getattr(gm, "model", None), "_max_seq_len", len(ids))
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
    nll, count, scored_to = 0.0, 0, 1   # tokens [1, scored_to) already scored
    begin = 0
    arr = np.asarray(ids, np.int32)
    while scored_to < len(ids):
        end = min(begin + window, len(ids))
        cache = gm.create_kv_cache(CacheConfig(max_seq_len=end - begin, block_size=block))
        try:
            for c0 in range(begin, end, chunk):
                c1 = min(c0 + chunk, end)
                emb = gm.embed(arr[None, c0:c1])
                from ..generative import to_numpy
                logits = to_numpy(gm.prefill_all_logits(emb, cache, range(c0 - begin, c1 - begin)))[0]
                # row i predicts token c0 + i + 1; score those not scored before
                lo = max(scored_to, c0 + 1)
                hi = min(c1 + 1, end)
                if hi > lo:
                    rows = np.arange(lo - 1 - c0, hi - 1 - c0)
                    nll -= float(_log_softmax_at(logits[rows], arr[lo:hi]).sum())
                    count += hi - lo
                    scored_to = hi
        finally:
            cache.free()
        if end == len(ids):
            break
        begin += stride
    return math.exp(nll / count)
