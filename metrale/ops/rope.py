"""Rotary position embedding (kernels/rope.cu): the host-side cos/sin table, the launchers and
the numpy twins of the in-place kernel (with Qwen3's optional per-head q/k RMSNorm first) and
of `rope_write_kv`, which also writes the token's k and v heads to the paged cache (the
model's one launch for both; `kv_cache.write_kv` alone is the same cache write).

Table (ops/rope_table.py): float32 [max_positions, R], R the rotary dimension (head_dim, or
fewer for a partial rotary embedding); row p holds cos in [0, R/2) and sin in [R/2, R).

Kernel, per token t and per q/k head (NeoX rotate-half layout over the first R dims,
x1 = x[:R/2], x2 = x[R/2:R]; x[R:] passes through):
    if a norm weight w is given:  x = bf16(x * rsqrt(mean(x^2) + eps) * w)      (fp32 math)
                                  (gemma_norm: * (1 + w), Gemma3's q/k norm; the whole head)
    out1 = bf16(x1*cos - x2*sin),  out2 = bf16(x2*cos + x1*sin)
with cos/sin = table[positions[t]]. Positions are read from device memory; the kernel leaves a
token with a position outside [0, max_positions) untouched (it never reads outside the
table) and the twin raises KernelError for it, so callers must check positions on the host
(the model does) -- the launcher cannot read device positions.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument, KernelError
from ..gpu_runtime.types import NULL, DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16, round_bf16
from .checks import check_heads, check_ptrs, int_range
from .kv_cache import write_kv_twin
from .registry import twin
from .rope_table import rope_inv_freq, rope_table  # noqa: F401 (the table: rope_table.py)

MODULE = "rope"
WARPS = 4  # heads per CTA (one warp per head)
MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------
def _check(n_tokens, num_heads, num_kv_heads, head_dim, max_positions, norm_eps,
           what: str = "apply_rope", rotary_dim: int | None = None) -> int:
    """The checks of both launchers; returns the rotary dimension (head_dim when None)."""
    if n_tokens < 1:
        raise InvalidArgument(f"{what}: n_tokens must be >= 1, got {n_tokens}")
    check_heads(what, num_heads, num_kv_heads, head_dim, MAX_HEAD_DIM)
    rd = head_dim if rotary_dim is None else int(rotary_dim)
    if not (2 <= rd <= head_dim and rd % 2 == 0):
        raise InvalidArgument(f"{what}: rotary_dim must be even and in [2, head_dim="
                              f"{head_dim}], got {rotary_dim}")
    if max_positions < 1:
        raise InvalidArgument(f"{what}: max_positions must be >= 1, got {max_positions}")
    if (num_heads + 2 * num_kv_heads) * head_dim * max(n_tokens, max_positions) >= 2**31:
        raise InvalidArgument(f"{what}: qkv or table too large for 32-bit indexing")
    if not (norm_eps >= 0 and math.isfinite(norm_eps)):
        raise InvalidArgument(f"{what}: norm_eps must be finite and >= 0, got {norm_eps}")
    return rd


def apply_rope(backend, stream: int, qkv_ptr, positions_ptr, table_ptr, n_tokens: int,
               num_heads: int, num_kv_heads: int, head_dim: int, max_positions: int,
               q_norm_ptr=NULL, k_norm_ptr=NULL, norm_eps: float = 1e-6,
               rotary_dim: int | None = None, gemma_norm: bool = False) -> None:
    """Rotate the q and k heads of qkv [n_tokens, (H+2KV)*D] bf16 in place.

    positions: int32 [n_tokens] on the device, each in [0, max_positions) -- the caller
    checks (the kernel skips, the twin raises). table: float32 [max_positions, R] from
    `rope_table(R, ...)`, R = rotary_dim (default head_dim; a partial rotary embedding
    rotates the first R dims of each head, R even). q_norm/k_norm: optional bf16 [D] RMSNorm
    weights (Qwen3; with gemma_norm applied as (1 + w), Gemma 3), NULL for none.
    """
    n_tokens, num_heads, num_kv_heads = int(n_tokens), int(num_heads), int(num_kv_heads)
    head_dim, max_positions = int(head_dim), int(max_positions)
    rd = _check(n_tokens, num_heads, num_kv_heads, head_dim, max_positions, float(norm_eps),
                rotary_dim=rotary_dim)
    for name, p in (("qkv", qkv_ptr), ("positions", positions_ptr), ("table", table_ptr)):
        if int(p) == 0:
            raise InvalidArgument(f"apply_rope: {name} pointer is NULL")
    n_heads = num_heads + num_kv_heads
    grid = (n_tokens, -(-n_heads // WARPS))
    backend.launch(backend.kernel(MODULE, "apply_rope"), grid, (32 * WARPS,), 0, stream,
                   (DevicePtr(qkv_ptr), DevicePtr(positions_ptr), DevicePtr(table_ptr),
                    DevicePtr(q_norm_ptr), DevicePtr(k_norm_ptr), np.int32(n_tokens),
                    np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim),
                    np.int32(max_positions), np.float32(norm_eps), np.int32(rd),
                    np.int32(bool(gemma_norm))))


def rope_write_kv(backend, stream: int, qkv_ptr, positions_ptr, table_ptr, k_cache_ptr,
                  v_cache_ptr, slot_mapping_ptr, n_tokens: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, max_positions: int, q_norm_ptr=NULL,
                  k_norm_ptr=NULL, norm_eps: float = 1e-6, rotary_dim: int | None = None,
                  gemma_norm: bool = False) -> None:
    """`apply_rope` and `kv_cache.write_kv` in one launch: rotate the q and k heads of qkv
    [n_tokens, (H+2KV)*D] bf16 in place, then k_cache[slot_mapping[t]] = the rotated k heads
    of row t and v_cache[slot_mapping[t]] = its v heads (caches [num_blocks, block_size, KV,
    D] bf16; slot_mapping int32 [n_tokens], < 0 skips the token's cache write).

    positions, table, q_norm, k_norm, norm_eps, rotary_dim, gemma_norm: as `apply_rope`. qkv
    and both caches must be 4-byte aligned (v heads move as 32-bit words).
    """
    n_tokens, num_heads, num_kv_heads = int(n_tokens), int(num_heads), int(num_kv_heads)
    head_dim, max_positions = int(head_dim), int(max_positions)
    what = "rope_write_kv"
    rd = _check(n_tokens, num_heads, num_kv_heads, head_dim, max_positions, float(norm_eps),
                what, rotary_dim)
    check_ptrs(what, 1, positions=positions_ptr, table=table_ptr, slot_mapping=slot_mapping_ptr)
    check_ptrs(what, 4, qkv=qkv_ptr, k_cache=k_cache_ptr, v_cache=v_cache_ptr)
    grid = (n_tokens, -(-(num_heads + 2 * num_kv_heads) // WARPS))
    backend.launch(backend.kernel(MODULE, "rope_write_kv"), grid, (32 * WARPS,), 0, stream,
                   (DevicePtr(qkv_ptr), DevicePtr(positions_ptr), DevicePtr(table_ptr),
                    DevicePtr(q_norm_ptr), DevicePtr(k_norm_ptr), DevicePtr(k_cache_ptr),
                    DevicePtr(v_cache_ptr), DevicePtr(slot_mapping_ptr), np.int32(n_tokens),
                    np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim),
                    np.int32(max_positions), np.float32(norm_eps), np.int32(rd),
                    np.int32(bool(gemma_norm))))


# --------------------------------------------------------------------------------------
# twin
# --------------------------------------------------------------------------------------
def rms_norm_heads(x: np.ndarray, w: np.ndarray, eps: np.float32,
                   gemma_norm: bool = False) -> np.ndarray:
    """x float32 [..., D], w float32 [D] -> bf16-rounded float32 (the kernel's q/k norm;
    gemma_norm: the weight applies as 1 + w)."""
    d = x.shape[-1]
    ss = np.sum(x * x, axis=-1, keepdims=True, dtype=np.float32)
    r = (np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)).astype(np.float32)
    return round_bf16((x * r) * (w + np.float32(1.0) if gemma_norm else w))


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x float32 [n, heads, D]; cos/sin float32 [n, 1, R/2] -> float32 (not rounded): the
    first R dims rotated, the rest passed through."""
    h = cos.shape[-1]
    x1, x2 = x[..., :h], x[..., h:2 * h]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * h:]], axis=-1)


def _checked_positions(ctx, positions_ptr, n: int, mp: int) -> np.ndarray:
    """positions int64 [n], each in [0, mp), else the KernelError the kernel's caller gets."""
    pos = ctx.read(positions_ptr, n, np.int32).astype(np.int64)
    bad = (pos < 0) | (pos >= mp)
    if bad.any():
        t = int(np.argmax(bad))
        raise KernelError(f"rope.apply_rope: positions[{t}] = {pos[t]} outside the table "
                          f"[0, {mp}) (callers must check positions before launching)")
    return pos


def _native_rope(ctx, qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr,
                 v_cache_ptr, slot_mapping_ptr, n_tokens, num_heads, num_kv_heads, head_dim,
                 max_positions, norm_eps, rot_dim, gemma_norm) -> bool:
    """apply_rope (k_cache_ptr 0) or rope_write_kv in the native library (the same bits,
    native/norm_rope_act.cpp) once every address and index is checked here; False (nothing
    written) where it cannot run or a check fails: the numpy twin then runs and raises.
    The library rotates whole heads with a plain q/k norm: partial rotary and the Gemma norm
    take the numpy twin."""
    nat = ctx.native_rows
    if nat is None or int(rot_dim) != int(head_dim) or int(gemma_norm):
        return False
    n, h, kv, d, mp = (int(n_tokens), int(num_heads), int(num_kv_heads), int(head_dim),
                       int(max_positions))
    try:
        pos = ctx.read(positions_ptr, n, np.int32)
        if n:
            lo, hi = int_range(pos)
            if lo < 0 or hi >= mp:
                return False
        kc = vc = slots = 0
        if int(k_cache_ptr):
            s = ctx.read(slot_mapping_ptr, n, np.int32)
            top = int_range(s)[1] + 1 if n else 0
            if top > 0:   # the rows up to the highest slot written
                kc = ctx.write_addr(k_cache_ptr, top * kv * d * 2)
                vc = ctx.write_addr(v_cache_ptr, top * kv * d * 2)
                slots = s.ctypes.data
        nat.rope_write_kv(
            ctx.write_addr(qkv_ptr, n * (h + 2 * kv) * d * 2), pos.ctypes.data,
            ctx.read_addr(table_ptr, mp * d * 4),
            ctx.read_addr(q_norm_ptr, d * 2) if int(q_norm_ptr) else 0,
            ctx.read_addr(k_norm_ptr, d * 2) if int(k_norm_ptr) else 0,
            kc, vc, slots, n, h, kv, d, float(norm_eps))
    except KernelError:
        return False
    return True


@twin(MODULE, "apply_rope")
def apply_rope_twin(ctx, qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr, n_tokens,
                    num_heads, num_kv_heads, head_dim, max_positions, norm_eps, rot_dim,
                    gemma_norm) -> None:
    if _native_rope(ctx, qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr, 0, 0, 0,
                    n_tokens, num_heads, num_kv_heads, head_dim, max_positions, norm_eps,
                    rot_dim, gemma_norm):
        return
    n, h, kv, d, mp = (int(n_tokens), int(num_heads), int(num_kv_heads), int(head_dim),
                       int(max_positions))
    rd, gemma = int(rot_dim), bool(int(gemma_norm))
    row = (h + 2 * kv) * d
    qkv = ctx.view(qkv_ptr, n * row, np.uint16).reshape(n, h + 2 * kv, d)
    pos = _checked_positions(ctx, positions_ptr, n, mp)
    table = ctx.read(table_ptr, mp * rd, np.float32).reshape(mp, rd)
    x = bf16_to_f32(qkv[:, :h + kv])
    eps = np.float32(norm_eps)
    if int(q_norm_ptr):
        wq = bf16_to_f32(ctx.read(q_norm_ptr, d, np.uint16))
        x[:, :h] = rms_norm_heads(x[:, :h], wq, eps, gemma)
    if int(k_norm_ptr):
        wk = bf16_to_f32(ctx.read(k_norm_ptr, d, np.uint16))
        x[:, h:] = rms_norm_heads(x[:, h:], wk, eps, gemma)
    cs = table[pos]  # [n, R]
    out = rotate(x, cs[:, None, :rd // 2], cs[:, None, rd // 2:])
    qkv[:, :h + kv] = f32_to_bf16(out)


@twin(MODULE, "rope_write_kv")
def rope_write_kv_twin(ctx, qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr,
                       k_cache_ptr, v_cache_ptr, slot_mapping_ptr, n_tokens, num_heads,
                       num_kv_heads, head_dim, max_positions, norm_eps, rot_dim,
                       gemma_norm) -> None:
    """apply_rope's twin, then write_kv's (the kernel's result, by its definition)."""
    if _native_rope(ctx, qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr,
                    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, n_tokens, num_heads,
                    num_kv_heads, head_dim, max_positions, norm_eps, rot_dim, gemma_norm):
        return
    apply_rope_twin(ctx, qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr, n_tokens,
                    num_heads, num_kv_heads, head_dim, max_positions, norm_eps, rot_dim,
                    gemma_norm)
    write_kv_twin(ctx, qkv_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, n_tokens,
                  num_heads, num_kv_heads, head_dim)
