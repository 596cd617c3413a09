"""Numpy twin of kernels/attention_tile.cuh, the flash-attention tile that prefill_attention
(attention.py) and dense_attention (dense_attention.py) share.

The kernel walks 32-key tiles with an online softmax (running max m, sum l, rescaled acc);
the closed form it computes per query row is

    p = exp2(s - max(s)),   out = (p @ V) / sum(p)

over base-2 scores s = (q . k) * scale * log2(e), masked keys -inf. Both twins call
`attend_base2` with their own scores, so a change to this math lands once.
"""
from __future__ import annotations

import numpy as np


def attend_base2(scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Softmax-weighted values over the last axis of base-2 `scores`.

    scores [..., T] (masked keys -inf, at least one finite per row), values [..., T, D]
    -> [..., D] in the inputs' dtype (the prefill twin passes float64, the dense twin
    float32; the sum of p is taken in that dtype too).
    """
    p = np.exp2(scores - scores.max(axis=-1, keepdims=True))
    return np.matmul(p, values) / p.sum(axis=-1, keepdims=True, dtype=p.dtype)
