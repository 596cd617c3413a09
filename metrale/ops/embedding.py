"""Token embedding gather (kernels/embedding.cu): launchers and numpy twins.

`embedding`: out[t] = table[ids[t]] for 0 <= ids[t] < vocab, else a zero row (nothing is
read for a bad id; the model validates ids on the host before launching, this is the
kernel's defined memory-safe behaviour). Any hidden >= 1 (128-bit copies when hidden % 8 ==
0 and aligned).

`embedding_gguf`: the same gather from a table kept at its GGUF bytes (the planes of
ops/gguf_planes.py), each row dequantized on lookup to the bits of `dequant_bf16` (the
load-time dequantizer's). Entry `embedding_gguf_{type}` (type the lower-case ggml name) with
arguments (out, ids, q, qh, meta, n_tokens, k): grid (n_tokens,), block (128,), no dynamic
shared memory, qh NULL for types without high bits. The kernel reads row ids[t] unchecked
(it has no vocab): the launcher checks the ids, given on the host as the caller uploaded
them, before it launches.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .checks import check_ptrs, check_sizes, int_range
from .gemm_gguf import check_planes
from .gguf_planes import PACKED, dequant_bf16, plane_bytes
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


def gguf_kernel_name(ggml_type: int) -> str:
    return f"embedding_gguf_{PACKED[ggml_type].name.lower()}"


def embedding_gguf(backend, stream: int, out_ptr, token_ids_ptr, q_ptr, qh_ptr, meta_ptr,
                   n_tokens: int, k: int, vocab: int, ggml_type: int, ids: np.ndarray) -> None:
    """out[t, :] = dequant(W)[ids[t], :], W [vocab, k] in the planes q, qh (NULL without
    high bits), meta of `ggml_type` (ops/gguf_planes.py). ids: [n_tokens] int32 on the
    device at token_ids_ptr, and the same values on the host (`ids`), each checked
    0 <= id < vocab here; out: [n_tokens, k] bf16."""
    what = f"embedding_gguf ({PACKED[ggml_type].name if ggml_type in PACKED else ggml_type})"
    check_sizes(what, n_tokens=n_tokens, k=k, vocab=vocab)
    check_ptrs(what, out_ptr=out_ptr, token_ids_ptr=token_ids_ptr)
    check_planes(what, k, ggml_type, q_ptr, qh_ptr, meta_ptr)
    ids = np.asarray(ids)
    if ids.shape != (int(n_tokens),):
        raise InvalidArgument(f"{what}: ids has shape {ids.shape}, not ({n_tokens},)")
    lo, hi = int_range(ids)
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise InvalidArgument(f"{what}: token id {bad} at index "
                              f"{int(np.flatnonzero(ids == bad)[0])} is outside "
                              f"[0, vocab={vocab})")
    backend.launch(backend.kernel(MODULE, gguf_kernel_name(ggml_type)), (int(n_tokens),),
                   (THREADS,), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(token_ids_ptr), DevicePtr(q_ptr),
                    DevicePtr(qh_ptr), DevicePtr(meta_ptr), np.int32(n_tokens), np.int32(k)))


def embedding_gguf_twin(ctx, out_ptr, token_ids_ptr, q_ptr, qh_ptr, meta_ptr, n_tokens, k,
                        ggml_type: int) -> None:
    n, k = int(n_tokens), int(k)
    ids = ctx.read(token_ids_ptr, n, np.int32).astype(np.int64)
    lo, hi = int_range(ids)
    if lo < 0:   # the kernel would read before the table: the launcher's check was skipped
        raise InvalidArgument(f"embedding_gguf: token id {lo} < 0 reached the kernel")
    rows = hi + 1   # the table's rows up to the largest id (a read past it is refused)
    q_row, qh_row, meta_row = plane_bytes(ggml_type, k)
    q = ctx.read(q_ptr, rows * q_row, np.uint8).reshape(rows, q_row)[ids]
    qh = ctx.read(qh_ptr, rows * qh_row, np.uint8).reshape(rows, qh_row)[ids] if qh_row \
        else None
    meta = ctx.read(meta_ptr, rows * meta_row, np.uint8).reshape(rows, meta_row)[ids]
    with np.errstate(over="ignore", invalid="ignore"):   # inf / NaN scales stay so
        bits = dequant_bf16(q, qh, meta, ggml_type, k)
    ctx.view(out_ptr, n * k, np.uint16).reshape(n, k)[:] = bits


def _register_gguf_twins() -> None:
    for ggml_type in PACKED:
        twin(MODULE, gguf_kernel_name(ggml_type))(
            lambda ctx, out, ids, q, qh, meta, n, k, _t=ggml_type:
            embedding_gguf_twin(ctx, out, ids, q, qh, meta, n, k, _t))


_register_gguf_twins()
