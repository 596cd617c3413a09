"""The padded batch ladder: which batch sizes decode pads to, so CUDA graphs are keyed by a
few shapes instead of one per batch size.

Rule and edge cases from the original engine's `padded_batch_n`
(`crates/model-engine/src/traits/model.rs`): the smallest rung >= n, or n itself above 128.
There is no rung 1, so a single row pads to 2, and n = 0 gives 2 (the first rung).
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument

GRAPH_BATCH_LADDER = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def padded_batch_n(n: int) -> int:
    """The padded batch size for `n` live rows: the smallest ladder rung >= n, else n."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise InvalidArgument(f"padded_batch_n: n must be an int >= 0, got {n!r}")
    for rung in GRAPH_BATCH_LADDER:
        if rung >= n:
            return rung
    return int(n)
