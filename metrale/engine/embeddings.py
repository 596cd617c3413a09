"""`embed`: one vector per token sequence from the final-norm hidden states."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InvalidArgument
from ..kv.config import CacheConfig
from .generate import check_prompt
from .models import generative_model


def embed(model, batch_of_token_ids: Sequence[Sequence[int]], pooling: str = "last",
          normalize: bool = True) -> np.ndarray:
    """Embeddings `[n, hidden]` float32 (host numpy) of each token sequence.

    pooling: "last" (the final position's hidden state, for causal LMs) or "mean" (over
    every position); normalize: scale each vector to unit L2 norm. Hidden states holding
    NaN / Inf (weights that do, an overflow) raise NonFiniteLogits naming the input and
    position, instead of returning NaN vectors.
    """
    if pooling not in ("last", "mean"):
        raise InvalidArgument(f"embed: pooling must be 'last' or 'mean', got {pooling!r}")
    gm = generative_model(model)
    if not gm.supports_hidden_states():
        from ..errors import Unsupported
        raise Unsupported("embed: this model does not expose hidden states")
    seqs = list(batch_of_token_ids)
    if not seqs:
        raise InvalidArgument("embed: empty batch")
    block = getattr(getattr(gm, "model", None), "kv_block_size", lambda: 16)()
    from ..generative import to_numpy
    out = []
    for toks in seqs:
        ids = np.asarray([check_prompt(toks, gm.metadata().vocab_size)], np.int32)
        cache = gm.create_kv_cache(CacheConfig(max_seq_len=ids.shape[1], block_size=block))
        try:
            h = to_numpy(gm.prefill_hidden(gm.embed(ids), cache, range(0, ids.shape[1])))[0]
        finally:
            cache.free()
        _check_finite(h if pooling == "mean" else h[-1:], len(out),
                      0 if pooling == "mean" else ids.shape[1] - 1)
        v = h[-1] if pooling == "last" else h.astype(np.float64).mean(axis=0)
        v = np.asarray(v, np.float64)
        if normalize:
            v = v / max(np.linalg.norm(v), 1e-12)
        out.append(v.astype(np.float32))
    return np.stack(out)


def _check_finite(rows: np.ndarray, index: int, first_pos: int) -> None:
    """NonFiniteLogits when the hidden states `rows` ([n, hidden], positions first_pos, ...)
    of input `index` that pooling reads hold NaN / Inf: the first such position."""
    bad = ~np.isfinite(rows)
    if bad.any():
        from ..errors import NonFiniteLogits
        r = int(np.argmax(bad.any(axis=1)))
        raise NonFiniteLogits(
            f"embed: input {index}: the hidden state of sequence position {first_pos + r} "
            f"holds {int(bad[r].sum())} NaN/Inf value(s) of {rows.shape[1]}; the model's "
            "weights or activations are not finite (a checkpoint holding NaN/Inf, or an "
            "overflow), so it has no embedding")
