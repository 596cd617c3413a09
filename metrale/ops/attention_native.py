"""The paged decode attention twins' native path (ops/attention.py's `_decode_split_twin` and
`decode_attention_combine_twin` run these where HostBackend's native library is loaded):
the bounds checks made here as wholes before the library (gpu_runtime/native/
attention_f32.cpp) is called with raw host addresses. Each returns False having written
nothing where a check fails; the numpy twin then runs and raises its own error.
"""
from __future__ import annotations

import numpy as np

from ..errors import KernelError
from .checks import int_range


def _held(ctx, ptr, nbytes: int) -> bool:
    """Whether [ptr, ptr + nbytes) lies in one live allocation: what a bounds-checked
    `ctx.read` of it accepts, without making the array."""
    alloc = ctx.backend.find_allocation(ptr)
    return alloc is not None and int(ptr) + nbytes <= int(alloc[0]) + alloc[1]


def _cache_blocks(ctx, cache_ptr, blk_bytes: int) -> int:
    """Whole cache blocks from cache_ptr to the end of its allocation (0 outside any): a
    block table entry below it is one `gather_paged`'s bounds-checked read accepts."""
    alloc = ctx.backend.find_allocation(cache_ptr)
    return 0 if alloc is None else (int(alloc[0]) + alloc[1] - int(cache_ptr)) // blk_bytes


def decode_split_native(ctx, native, out_ptr, workspace_ptr, qkv_ptr, k_cache_ptr,
                        v_cache_ptr, block_tables_ptr, kv_lens_ptr, ns, h, kv, d, bs, mb, msp,
                        scale, w) -> bool:
    """The split twin in HostBackend's native library (gpu_runtime/native/attention_f32.cpp:
    this formula, its own fixed float32 summation order), or False having written nothing
    where a check fails: the numpy path then runs and raises the twin's error. Checked here
    as wholes: the lengths, block tables and query rows it reads, out and the workspace it
    writes (through `ctx.view`, which records the write); natively: each sequence's length
    and used table entries against the capacity and the caches' allocations."""
    if not (_held(ctx, kv_lens_ptr, ns * 4) and _held(ctx, block_tables_ptr, ns * mb * 4)
            and _held(ctx, qkv_ptr, ((ns - 1) * (h + 2 * kv) * d + h * d) * 2)):
        return False
    try:
        ctx.view(out_ptr, ns * h * d, np.uint16)
        if msp > 1:
            ctx.view(workspace_ptr, ns * h * msp * (d + 2), np.float32)
    except KernelError:
        return False
    blk_bytes = bs * kv * d * 2
    return native.decode_attention_split(
        out_ptr, workspace_ptr if msp > 1 else 0, qkv_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, kv_lens_ptr, ns, h, kv, d, bs, mb, msp, scale, w,
        _cache_blocks(ctx, k_cache_ptr, blk_bytes), _cache_blocks(ctx, v_cache_ptr, blk_bytes))


def decode_combine_native(ctx, native, out_ptr, workspace_ptr, kv_lens_ptr, ns, h, d, bs,
                          mb, msp, w, split_tokens: int) -> bool:
    """The combine twin in the native library (the numpy arithmetic below, step for step),
    or False having written nothing where the numpy path must run (and raise)."""
    try:
        top = int_range(ctx.read(kv_lens_ptr, ns, np.int32))[1]
        if top <= min(split_tokens, mb * bs):
            return True   # every sequence in one split (and within the capacity): no work
        ctx.view(out_ptr, ns * h * d, np.uint16)
    except KernelError:
        return False
    if msp > 1 and not _held(ctx, workspace_ptr, ns * h * msp * (d + 2) * 4):
        return False
    return native.decode_attention_combine(out_ptr, workspace_ptr if msp > 1 else 0,
                                           kv_lens_ptr, ns, h, d, bs, mb, msp, w)
