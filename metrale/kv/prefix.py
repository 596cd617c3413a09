"""Keys of block-aligned token prefixes, for the prefix cache.

Key i names the whole prefix tokens[0 : (i+1) * block_size]: a BLAKE2b digest chained over
the blocks, so equal keys mean equal prefixes (not merely equal last blocks). A `namespace`
other than 0 (a LoRA adapter's id, model_engine/adapters.py) starts the chain: the same
tokens under two adapters have different K/V, so they never share a key.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def prefix_keys(tokens: Sequence[int], block_size: int, n_blocks: int | None = None,
                namespace: int = 0) -> list[bytes]:
    """Chain digests of the first `n_blocks` full blocks of `tokens` (all full ones if None),
    in `namespace` (0: the base model's keys)."""
    full = len(tokens) // block_size
    n = full if n_blocks is None else min(n_blocks, full)
    arr = np.asarray(tokens[: n * block_size], dtype=np.int64)
    keys, prev = [], (int(namespace).to_bytes(8, "little") if namespace else b"")
    for i in range(n):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(arr[i * block_size:(i + 1) * block_size].tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys
