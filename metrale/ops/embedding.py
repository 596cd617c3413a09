"""Token embedding gather (kernels/embedding.cu): launcher and numpy twin.

out[t] = table[ids[t]] for 0 <= ids[t] < vocab, else a zero row (nothing is read for a bad
id; the model validates ids on the host before launching, this is the kernel's defined
memory-safe behaviour). Any hidden >= 1 (128-bit copies when hidden % 8 == 0 and aligned).
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .registry import twin

MODULE = "embedding"
THREADS = 128


def embedding(backend, stream: int, out_ptr, table_ptr, token_ids_ptr, n_tokens: int,
              hidden: int, vocab: int) -> None:
    """out[t, :] = table[ids[t], :]. table: [vocab, hidden] bf16; ids: [n_tokens] int32 on
    the device; out: [n_tokens, hidden] bf16."""
    for name, v in (("n_tokens", n_tokens), ("hidden", hidden), ("vocab", vocab)):
        if not 1 <= int(v) < 2**31:
            raise InvalidArgument(f"embedding: {name} must be in [1, 2^31), got {v}")
    for name, p in (("out_ptr", out_ptr), ("table_ptr", table_ptr),
                    ("token_ids_ptr", token_ids_ptr)):
        if int(p) == 0:
            raise InvalidArgument(f"embedding: {name} is NULL")
    backend.launch(backend.kernel(MODULE, "embedding"), (int(n_tokens),), (THREADS,), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(table_ptr), DevicePtr(token_ids_ptr),
                    np.int32(n_tokens), np.int32(hidden), np.int32(vocab)))


@twin(MODULE, "embedding")
def embedding_twin(ctx, out_ptr, table_ptr, token_ids_ptr, n_tokens, hidden, vocab) -> None:
    t, h, v = int(n_tokens), int(hidden), int(vocab)
    ids = ctx.read(token_ids_ptr, t, np.int32).astype(np.int64)
    table = ctx.read(table_ptr, v * h, np.uint16).reshape(v, h)
    out = ctx.view(out_ptr, t * h, np.uint16).reshape(t, h)
    valid = (ids >= 0) & (ids < v)
    rows = table[np.where(valid, ids, 0)]  # gathers a copy first: safe if out aliases table
    rows[~valid] = 0
    out[:] = rows
