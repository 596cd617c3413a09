"""The LoRA twins' native path on HostBackend (gpu_runtime/native_lora.py): the same float32
operations in the same order as ops/lora.py's numpy twins, over each slot's A and B laid out
once for the order's lanes (`at`, `bt`, BF16: cached per slot in the backend's conversion
cache until the pool is written, i.e. until the next adapter load).

`shrink(ctx, ...)` / `expand(ctx, ...)` return False when the library is unavailable (the
numpy twin runs instead).
"""
from __future__ import annotations

import numpy as np

from ..gpu_runtime import native_lora
from ..gpu_runtime.types import DevicePtr


def lane_major(a_bits: np.ndarray) -> np.ndarray:
    """A [c, k] BF16 bits -> BF16 bits [c, K8, 128]: element u of lane l of row q is
    A[q, (u // 8) * 1024 + 8 l + u % 8] (0 past k), K8 = ceil(k / 1024) * 8."""
    c, k = a_bits.shape
    steps = -(-k // 1024)
    a = np.zeros((c, steps * 1024), np.uint16)
    a[:, :k] = a_bits
    return np.ascontiguousarray(a.reshape(c, steps, 128, 8).transpose(0, 1, 3, 2)).reshape(
        c, steps * 8, 128)


def _tiles(ctx, tiles_ptr):
    tiles = np.ascontiguousarray(ctx.read(tiles_ptr, 3 * int(ctx.grid[0]), np.int32))
    slots = {int(s) for s in tiles[2::3].tolist()}
    return tiles, slots


def _table(ctx, pool, slots, n_slots: int, stride: int, nbytes: int, kind: str, convert,
           size: int):
    """(uintp [n_slots]: each used slot's converted array, the arrays). The table of a set of
    slots is cached too (beside the arrays it points to), so a launch costs one lookup."""
    def build():
        table = np.zeros(n_slots, np.uintp)
        keep = []
        for s in slots:
            if not 0 <= s < n_slots:
                continue
            p = DevicePtr(pool).offset(2 * s * stride)
            arr = ctx.backend.converted(p, nbytes, kind, lambda p=p: convert(p), size)
            if arr is None:               # over the cache's budget: this launch only
                arr = convert(p)
            keep.append(arr)
            table[s] = arr.ctypes.data
        return table, keep
    key = f"{kind}.table.{sorted(slots)}"
    got = ctx.backend.converted(pool, 2 * n_slots * stride, key, build, 8 * n_slots)
    return got if got is not None else build()


def shrink(ctx, t_ptr, x_ptr, a_pool, a_slot_stride, tiles_ptr, m, k, c, n_slots) -> bool:
    lib = native_lora.for_backend(ctx.backend)
    if lib is None:
        return False
    tiles, slots = _tiles(ctx, tiles_ptr)
    kp = -(-k // 1024) * 1024
    table, keep = _table(
        ctx, a_pool, slots, n_slots, a_slot_stride, c * k * 2, "lora.at",
        lambda p: lane_major(ctx.read(p, c * k, np.uint16).reshape(c, k)), c * kp * 2)
    lib.shrink(ctx.read_addr(x_ptr, m * k * 2), table.ctypes.data, tiles.ctypes.data,
               len(tiles) // 3, n_slots, ctx.write_addr(t_ptr, m * c * 4), m, k, c)
    del keep
    return True


def expand(ctx, y_ptr, t_ptr, t_split_stride, splits, b_pool, b_slot_stride, scale_pool,
           tiles_ptr, m, n, rp, c, parts, part1, part2, n_slots) -> bool:
    lib = native_lora.for_backend(ctx.backend)
    if lib is None:
        return False
    tiles, slots = _tiles(ctx, tiles_ptr)
    table, keep = _table(
        ctx, b_pool, slots, n_slots, b_slot_stride, n * rp * 2, "lora.bt",
        lambda p: np.ascontiguousarray(ctx.read(p, n * rp, np.uint16).reshape(n, rp).T),
        n * rp * 2)
    t_bytes = ((splits - 1) * t_split_stride + m * c) * 4
    lib.expand(ctx.write_addr(y_ptr, m * n * 2), ctx.read_addr(t_ptr, t_bytes), t_split_stride,
               splits, table.ctypes.data, ctx.read_addr(scale_pool, n_slots * parts * 4),
               tiles.ctypes.data, len(tiles) // 3, n_slots, m, n, rp, c, parts, part1, part2)
    del keep
    return True
