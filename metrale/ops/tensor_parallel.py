"""Tensor-parallel combines (kernels/tensor_parallel.cu): launchers and numpy twins.

  tp_sum_partials:    out[i] = bf16(p[0][i] + p[1][i] + ... + p[R-1][i]), rank order, FP32
  tp_concat_shards:   out[r] = shards[0][r] | shards[1][r] | ... cut to row_bytes
  tp_embedding_shard: out[t] = float(table[ids[t] - vocab_start]) if this rank holds the id,
                      else zeros

The rank-order sum is what makes a row-parallel layer's output the same bits whatever the
batch: the summation order of an element never depends on how many elements are reduced or
where they sit (an all-reduce's order does). The twin adds with the device's flush-to-zero
(`-ftz=true`: subnormal inputs and results are signed zeros) in the same order.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .bf16 import f32_to_bf16
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "tensor_parallel"
THREADS = 256
MAX_RANKS = 64
_MAX_BLOCKS = 8192
_TINY = np.float32(np.finfo(np.float32).tiny)   # 2^-126, the smallest normal float32


def _check_ranks(what: str, n_ranks: int) -> None:
    if not 1 <= int(n_ranks) <= MAX_RANKS:
        raise InvalidArgument(f"{what}: n_ranks must be in [1, {MAX_RANKS}], got {n_ranks}")


def tp_sum_partials(backend, stream: int, out_ptr, partials_ptr, count: int,
                    n_ranks: int) -> None:
    """out[count] bf16 = the rank-order FP32 sum of partials[n_ranks, count] float32."""
    check_sizes("tp_sum_partials", count=count)
    _check_ranks("tp_sum_partials", n_ranks)
    check_ptrs("tp_sum_partials", out_ptr=out_ptr, partials_ptr=partials_ptr)
    n4 = -(-int(count) // 4)
    grid = max(1, min(-(-n4 // THREADS), _MAX_BLOCKS))
    backend.launch(backend.kernel(MODULE, "tp_sum_partials"), (grid,), (THREADS,), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(partials_ptr), np.int32(count),
                    np.int32(n_ranks)))


def tp_concat_shards(backend, stream: int, out_ptr, shards_ptr, n_rows: int, row_bytes: int,
                     shard_bytes: int, n_ranks: int) -> None:
    """out[n_rows, row_bytes] = each row's shards side by side, from shards[n_ranks, n_rows,
    shard_bytes]; row_bytes <= n_ranks * shard_bytes (the padding of the last is dropped)."""
    check_sizes("tp_concat_shards", n_rows=n_rows, row_bytes=row_bytes,
                shard_bytes=shard_bytes)
    _check_ranks("tp_concat_shards", n_ranks)
    if int(row_bytes) > int(shard_bytes) * int(n_ranks):
        raise InvalidArgument(f"tp_concat_shards: row_bytes {row_bytes} exceed {n_ranks} "
                              f"shards of {shard_bytes} bytes")
    check_ptrs("tp_concat_shards", out_ptr=out_ptr, shards_ptr=shards_ptr)
    backend.launch(backend.kernel(MODULE, "tp_concat_shards"), (int(n_rows), int(n_ranks)),
                   (THREADS,), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(shards_ptr), np.int32(n_rows),
                    np.int32(row_bytes), np.int32(shard_bytes), np.int32(n_ranks)))


def tp_embedding_shard(backend, stream: int, out_ptr, table_ptr, token_ids_ptr, n_tokens: int,
                       hidden: int, vocab_start: int, shard_rows: int) -> None:
    """out[n_tokens, hidden] float32: the rows of ids in [vocab_start, vocab_start +
    shard_rows) from table[shard_rows, hidden] bf16, widened exactly; zeros elsewhere."""
    check_sizes("tp_embedding_shard", n_tokens=n_tokens, hidden=hidden, shard_rows=shard_rows)
    if not 0 <= int(vocab_start) < 2**31:
        raise InvalidArgument(f"tp_embedding_shard: vocab_start must be in [0, 2^31), got "
                              f"{vocab_start}")
    check_ptrs("tp_embedding_shard", out_ptr=out_ptr, table_ptr=table_ptr,
               token_ids_ptr=token_ids_ptr)
    backend.launch(backend.kernel(MODULE, "tp_embedding_shard"), (int(n_tokens),), (THREADS,),
                   0, stream,
                   (DevicePtr(out_ptr), DevicePtr(table_ptr), DevicePtr(token_ids_ptr),
                    np.int32(n_tokens), np.int32(hidden), np.int32(vocab_start),
                    np.int32(shard_rows)))


def flush_subnormals(x: np.ndarray) -> np.ndarray:
    """float32 with every subnormal replaced by a zero of its sign (the device's -ftz)."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < _TINY, np.copysign(np.float32(0), x), x).astype(np.float32)


def sum_partials_reference(partials: np.ndarray) -> np.ndarray:
    """The rank-order FP32 sum with flush-to-zero, [n_ranks, count] -> [count] float32."""
    p = np.asarray(partials, np.float32)
    s = p[0].copy()
    for r in range(1, p.shape[0]):
        s = flush_subnormals(flush_subnormals(s) + flush_subnormals(p[r]))
    return s


@twin(MODULE, "tp_sum_partials")
def tp_sum_partials_twin(ctx, out_ptr, partials_ptr, count, n_ranks) -> None:
    c, r = int(count), int(n_ranks)
    p = ctx.read(partials_ptr, r * c, np.float32).reshape(r, c)
    out = ctx.view(out_ptr, c, np.uint16)

    def rows(lo: int, hi: int) -> None:
        out[lo:hi] = f32_to_bf16(sum_partials_reference(p[:, lo:hi]))
    ctx.map_blocks(c, 1 << 16, rows)   # elements are independent: any split, same bits


@twin(MODULE, "tp_concat_shards")
def tp_concat_shards_twin(ctx, out_ptr, shards_ptr, n_rows, row_bytes, shard_bytes,
                          n_ranks) -> None:
    n, rb, sb, k = int(n_rows), int(row_bytes), int(shard_bytes), int(n_ranks)
    shards = ctx.read(shards_ptr, k * n * sb, np.uint8).reshape(k, n, sb)
    out = ctx.view(out_ptr, n * rb, np.uint8).reshape(n, rb)
    out[:] = shards.transpose(1, 0, 2).reshape(n, k * sb)[:, :rb]


@twin(MODULE, "tp_embedding_shard")
def tp_embedding_shard_twin(ctx, out_ptr, table_ptr, token_ids_ptr, n_tokens, hidden,
                            vocab_start, shard_rows) -> None:
    t, h, v0, rows = int(n_tokens), int(hidden), int(vocab_start), int(shard_rows)
    local = ctx.read(token_ids_ptr, t, np.int32).astype(np.int64) - v0
    table = ctx.read(table_ptr, rows * h, np.uint16).reshape(rows, h)
    out = ctx.view(out_ptr, t * h, np.float32).reshape(t, h)
    mine = (local >= 0) & (local < rows)
    bits = table[np.where(mine, local, 0)].astype(np.uint32) << 16
    bits[~mine] = 0
    out[:] = bits.view(np.float32)
