"""Argument checks every launcher makes before it launches (CuPy checks nothing)."""
from __future__ import annotations

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr


def check_sizes(what: str, **sizes) -> None:
    """Each size in [1, 2^31): kernels index with 32-bit ints."""
    for name, v in sizes.items():
        if not 1 <= int(v) < 2**31:
            raise InvalidArgument(f"{what}: {name} must be in [1, 2^31), got {v}")


def check_ptrs(what: str, align: int = 1, **ptrs) -> None:
    """Each pointer non-NULL and `align`-byte aligned (vector loads need it)."""
    for name, p in ptrs.items():
        if int(p) == 0:
            raise InvalidArgument(f"{what}: {name} is NULL")
        if int(p) % align:
            raise InvalidArgument(f"{what}: {name} pointer {DevicePtr(p)!r} is not "
                                  f"{align}-byte aligned")


def check_heads(what: str, num_heads: int, num_kv_heads: int, head_dim: int,
                max_head_dim: int) -> None:
    """GQA layout: heads >= 1, num_heads a multiple of num_kv_heads, head_dim even."""
    if num_heads < 1 or num_kv_heads < 1:
        raise InvalidArgument(f"{what}: num_heads ({num_heads}) and num_kv_heads "
                              f"({num_kv_heads}) must be >= 1")
    if num_heads % num_kv_heads:
        raise InvalidArgument(f"{what}: num_heads ({num_heads}) must be a multiple of "
                              f"num_kv_heads ({num_kv_heads})")
    if head_dim < 2 or head_dim % 2 or head_dim > max_head_dim:
        raise InvalidArgument(f"{what}: head_dim must be even and in [2, {max_head_dim}], "
                              f"got {head_dim}")


def int_range(a) -> tuple[int, int]:
    """(min, max) of a non-empty integer array as ints: a twin's check of its index rows
    (positions, slots, lengths). A decode step's arrays hold one value per sequence, where
    numpy's reductions cost ~2 us each and a list ~0.2."""
    if a.size <= 64:
        vals = a.ravel().tolist()
        return min(vals), max(vals)
    return int(a.min()), int(a.max())
