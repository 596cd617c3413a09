"""Keys of block-aligned token prefixes, for the prefix cache.

Key i names the whole prefix tokens[0 : (i+1) * block_size]: a BLAKE2b digest chained over
the blocks, so equal keys mean equal prefixes (not merely equal last blocks). A `salt` starts
the chain: prefixes whose K/V differ for the same tokens get keys of their own (a LoRA
adapter's sequences, model_engine/adapters.py; a LongRoPE sequence rotated with its long
factors throughout); the empty salt gives the base model's plain keys.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def prefix_keys(tokens: Sequence[int], block_size: int, n_blocks: int | None = None,
                salt: bytes = b"") -> list[bytes]:
    """Chain digests of the first `n_blocks` full blocks of `tokens` (all full ones if None),
    the chain started at `salt`."""
    full = len(tokens) // block_size
    n = full if n_blocks is None else min(n_blocks, full)
    arr = np.asarray(tokens[: n * block_size], dtype=np.int64)
    keys, prev = [], bytes(salt)
    for i in range(n):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(arr[i * block_size:(i + 1) * block_size].tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys
