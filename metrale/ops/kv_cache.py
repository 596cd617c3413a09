"""Paged KV cache writes (kernels/kv_cache.cu) and block copy-on-write.

Layout per layer: k_cache, v_cache each [num_blocks, block_size, num_kv_heads, head_dim]
bf16, i.e. rows of KV*D values indexed by slot = block_id * block_size + offset.
`write_kv` copies token t's k and v heads from the fused qkv buffer
[n_tokens, (H + 2KV) * D] into row slot_mapping[t] (int32; < 0 skips the token).
`copy_blocks` copies one whole block (k and v) with two async device-to-device copies.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument, KernelError
from ..gpu_runtime.types import DevicePtr
from .checks import check_heads
from .registry import twin

MODULE = "kv_cache"
THREADS = 128
MAX_HEAD_DIM = 256


def _check_heads(what, num_heads, num_kv_heads, head_dim) -> None:
    check_heads(what, num_heads, num_kv_heads, head_dim, MAX_HEAD_DIM)


def write_kv(backend, stream: int, qkv_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
             n_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """k_cache[slot_mapping[t]] = k heads of qkv row t; same for v. Slots < 0 are skipped."""
    n_tokens, num_heads = int(n_tokens), int(num_heads)
    num_kv_heads, head_dim = int(num_kv_heads), int(head_dim)
    if n_tokens < 1:
        raise InvalidArgument(f"write_kv: n_tokens must be >= 1, got {n_tokens}")
    if n_tokens >= 2**31:
        raise InvalidArgument(f"write_kv: n_tokens {n_tokens} exceeds the grid limit")
    _check_heads("write_kv", num_heads, num_kv_heads, head_dim)
    for name, p in (("qkv", qkv_ptr), ("k_cache", k_cache_ptr), ("v_cache", v_cache_ptr),
                    ("slot_mapping", slot_mapping_ptr)):
        if int(p) == 0:
            raise InvalidArgument(f"write_kv: {name} pointer is NULL")
    backend.launch(backend.kernel(MODULE, "write_kv"), (n_tokens,), (THREADS,), 0, stream,
                   (DevicePtr(qkv_ptr), DevicePtr(k_cache_ptr), DevicePtr(v_cache_ptr),
                    DevicePtr(slot_mapping_ptr), np.int32(n_tokens), np.int32(num_heads),
                    np.int32(num_kv_heads), np.int32(head_dim)))


def copy_blocks(backend, stream: int, k_cache_ptr, v_cache_ptr, src_block: int,
                dst_block: int, block_size: int, num_kv_heads: int, head_dim: int) -> None:
    """Copy block `src_block` onto `dst_block` in both caches (copy-on-write of a fork).

    Two `copy_d2d_async` on `stream`; no kernel. src and dst must differ.
    """
    src_block, dst_block = int(src_block), int(dst_block)
    block_size, num_kv_heads, head_dim = int(block_size), int(num_kv_heads), int(head_dim)
    if src_block < 0 or dst_block < 0:
        raise InvalidArgument(f"copy_blocks: block ids must be >= 0, got src={src_block} "
                              f"dst={dst_block}")
    if src_block == dst_block:
        raise InvalidArgument(f"copy_blocks: src and dst are the same block ({src_block})")
    if block_size < 1:
        raise InvalidArgument(f"copy_blocks: block_size must be >= 1, got {block_size}")
    _check_heads("copy_blocks", num_kv_heads, num_kv_heads, head_dim)
    for name, p in (("k_cache", k_cache_ptr), ("v_cache", v_cache_ptr)):
        if int(p) == 0:
            raise InvalidArgument(f"copy_blocks: {name} pointer is NULL")
    nbytes = block_size * num_kv_heads * head_dim * 2
    for base in (DevicePtr(k_cache_ptr), DevicePtr(v_cache_ptr)):
        backend.copy_d2d_async(base.offset(src_block * nbytes), base.offset(dst_block * nbytes),
                               nbytes, stream)


@twin(MODULE, "write_kv")
def write_kv_twin(ctx, qkv_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, n_tokens,
                  num_heads, num_kv_heads, head_dim) -> None:
    n, h, kv, d = int(n_tokens), int(num_heads), int(num_kv_heads), int(head_dim)
    row = kv * d
    qkv = ctx.read(qkv_ptr, n * (h + 2 * kv) * d, np.uint16).reshape(n, (h + 2 * kv) * d)
    slots = ctx.read(slot_mapping_ptr, n, np.int32)
    live = np.flatnonzero(slots >= 0)
    if live.size:
        dst = slots[live].astype(np.int64)
        try:   # one bounds-checked view of each cache up to the highest slot written
            top = int(dst.max()) + 1
            kc = ctx.view(k_cache_ptr, top * row, np.uint16).reshape(top, row)
            vc = ctx.view(v_cache_ptr, top * row, np.uint16).reshape(top, row)
        except KernelError:
            kc = None      # the loop below names the first slot outside the cache
        if kc is not None and np.unique(dst).size == dst.size:
            kc[dst] = qkv[live, h * d:(h + kv) * d]
            vc[dst] = qkv[live, (h + kv) * d:]
            return
    for t in range(n):   # repeated slots (the last token wins) or a slot outside the cache
        slot = int(slots[t])
        if slot < 0:
            continue
        try:
            kdst = ctx.view(int(k_cache_ptr) + slot * row * 2, row, np.uint16)
            vdst = ctx.view(int(v_cache_ptr) + slot * row * 2, row, np.uint16)
        except KernelError as e:
            raise KernelError(f"kv_cache.write_kv: slot_mapping[{t}] = {slot} is outside "
                              f"the cache: {e}") from None
        kdst[:] = qkv[t, h * d:(h + kv) * d]
        vdst[:] = qkv[t, (h + kv) * d:]
