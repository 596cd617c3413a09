"""The per-token steps of DeepSeek's multi-head latent attention around the latent-cache
attention (ops/attention_mla.py): launchers and numpy twins (module "mla_project").

  mla_rope_cache: rope on the qk_rope_head_dim tail of every head of q [n, H, nope + rope]
      (in place) and on the shared key kr [n, rope]; the cache row of each token becomes
      [c | rope(kr)] (c: the normalized latent [n, kv_lora_rank]) at slot_mapping[t]
      (slots < 0 are not written). The table is ops/rope_table.py's [positions, rope]
      (cos in [:rope/2], sin in [rope/2:]); pairs (x[2i], x[2i+1]) turn by frequency i
      (`pairs_adjacent`: DeepSeek-V2, V3 with rope_interleave) or (x[i], x[i + rope/2])
      (V3 without it). The adjacent pairs are written back in place, interleaved; HF's V3
      writes them de-interleaved, the same permutation for q and k, so every q . k is equal.
  mla_absorb_q: qa[t, h] = [bf16(q_nope[t, h] @ W_UK_h) | q_rope[t, h]], W_UK_h the first
      qk_nope_head_dim rows of head h's block of kv_b_proj [H * (nope + v_dim), R].
  mla_expand_v: o[t, h] = bf16(lat[t, h] @ W_UV_h^T), W_UV_h the last v_head_dim rows of
      head h's block of kv_b_proj.
Every product is a float32 sum over its own row and weights in a fixed order, so a token's
bits never depend on the batch.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument, KernelError
from ..gpu_runtime.types import DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "mla_project"
THREADS = 128
MAX_NOPE = 1024             # kernels/mla_project.cu MLA_PROJECT_MAX_NOPE (shared q row)


def mla_rope_cache(backend, stream: int, q_ptr, c_ptr, kr_ptr, positions_ptr, table_ptr,
                   cache_ptr, slots_ptr, n_tokens: int, num_heads: int, nope: int, rope: int,
                   kv_lora_rank: int, max_positions: int, pairs_adjacent: bool) -> None:
    """q bf16 [n, H, nope + rope] (rope tail turned in place); c bf16 [n, kv_lora_rank];
    kr bf16 [n, rope]; positions int32 [n]; table float32 [max_positions, rope]; cache bf16
    [slots, kv_lora_rank + rope]; slots int32 [n]."""
    what = "mla_rope_cache"
    check_sizes(what, n_tokens=n_tokens, num_heads=num_heads, nope=nope, rope=rope,
                kv_lora_rank=kv_lora_rank, max_positions=max_positions)
    if int(rope) % 2:
        raise InvalidArgument(f"{what}: rope must be even, got {rope}")
    check_ptrs(what, q_ptr=q_ptr, c_ptr=c_ptr, kr_ptr=kr_ptr, positions_ptr=positions_ptr,
               table_ptr=table_ptr, cache_ptr=cache_ptr, slots_ptr=slots_ptr)
    backend.launch(backend.kernel(MODULE, "mla_rope_cache"), (int(n_tokens),), (THREADS,), 0,
                   stream, (DevicePtr(q_ptr), DevicePtr(c_ptr), DevicePtr(kr_ptr),
                            DevicePtr(positions_ptr), DevicePtr(table_ptr),
                            DevicePtr(cache_ptr), DevicePtr(slots_ptr), np.int32(n_tokens),
                            np.int32(num_heads), np.int32(nope), np.int32(rope),
                            np.int32(kv_lora_rank), np.int32(max_positions),
                            np.int32(bool(pairs_adjacent))))


def mla_absorb_q(backend, stream: int, qa_ptr, q_ptr, kv_b_ptr, n_tokens: int,
                 num_heads: int, nope: int, rope: int, v_dim: int, kv_lora_rank: int) -> None:
    """qa bf16 [n, H, kv_lora_rank + rope] from q bf16 [n, H, nope + rope] and kv_b_proj
    bf16 [H * (nope + v_dim), kv_lora_rank]."""
    what = "mla_absorb_q"
    check_sizes(what, n_tokens=n_tokens, num_heads=num_heads, nope=nope, rope=rope,
                v_dim=v_dim, kv_lora_rank=kv_lora_rank)
    if int(nope) > MAX_NOPE:
        raise InvalidArgument(f"{what}: nope={nope} exceeds the kernel's {MAX_NOPE}")
    check_ptrs(what, qa_ptr=qa_ptr, q_ptr=q_ptr, kv_b_ptr=kv_b_ptr)
    backend.launch(backend.kernel(MODULE, "mla_absorb_q"), (int(n_tokens), int(num_heads)),
                   (THREADS,), 0, stream,
                   (DevicePtr(qa_ptr), DevicePtr(q_ptr), DevicePtr(kv_b_ptr),
                    np.int32(n_tokens), np.int32(num_heads), np.int32(nope), np.int32(rope),
                    np.int32(v_dim), np.int32(kv_lora_rank)))


def mla_expand_v(backend, stream: int, o_ptr, lat_ptr, kv_b_ptr, n_tokens: int,
                 num_heads: int, nope: int, v_dim: int, kv_lora_rank: int) -> None:
    """o bf16 [n, H, v_dim] from lat bf16 [n, H, kv_lora_rank] and kv_b_proj."""
    what = "mla_expand_v"
    check_sizes(what, n_tokens=n_tokens, num_heads=num_heads, nope=nope, v_dim=v_dim,
                kv_lora_rank=kv_lora_rank)
    check_ptrs(what, o_ptr=o_ptr, lat_ptr=lat_ptr, kv_b_ptr=kv_b_ptr)
    backend.launch(backend.kernel(MODULE, "mla_expand_v"), (int(n_tokens), int(num_heads)),
                   (THREADS,), 0, stream,
                   (DevicePtr(o_ptr), DevicePtr(lat_ptr), DevicePtr(kv_b_ptr),
                    np.int32(n_tokens), np.int32(num_heads), np.int32(nope), np.int32(v_dim),
                    np.int32(kv_lora_rank)))


def turn(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, adjacent: bool) -> np.ndarray:
    """float32 x [..., rope] turned by cos/sin [..., rope/2] (float32 steps)."""
    if adjacent:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


@twin(MODULE, "mla_rope_cache")
def _rope_cache_twin(ctx, q_ptr, c_ptr, kr_ptr, positions_ptr, table_ptr, cache_ptr,
                     slots_ptr, n_tokens, num_heads, nope, rope, kv_lora_rank, max_positions,
                     pairs_adjacent) -> None:
    n, H, dn, dr, R = (int(v) for v in (n_tokens, num_heads, nope, rope, kv_lora_rank))
    mp, half = int(max_positions), dr // 2
    pos = ctx.read(positions_ptr, n, np.int32).astype(np.int64)
    if ((pos < 0) | (pos >= mp)).any():
        raise KernelError(f"mla_rope_cache: a position outside the table [0, {mp})")
    table = ctx.read(table_ptr, mp * dr, np.float32).reshape(mp, dr)[pos]
    cos, sin = table[:, None, :half], table[:, None, half:]
    q = ctx.view(q_ptr, n * H * (dn + dr), np.uint16).reshape(n, H, dn + dr)
    qr = bf16_to_f32(q[:, :, dn:])
    q[:, :, dn:] = f32_to_bf16(turn(qr, cos, sin, bool(pairs_adjacent)))
    kr = bf16_to_f32(ctx.read(kr_ptr, n * dr, np.uint16)).reshape(n, 1, dr)
    k = f32_to_bf16(turn(kr, cos, sin, bool(pairs_adjacent))).reshape(n, dr)
    c = ctx.read(c_ptr, n * R, np.uint16).reshape(n, R)
    slots = ctx.read(slots_ptr, n, np.int32)
    for t in range(n):
        if slots[t] < 0:
            continue
        row = ctx.view(int(cache_ptr) + int(slots[t]) * (R + dr) * 2, R + dr, np.uint16)
        row[:R] = c[t]
        row[R:] = k[t]


def _kv_b(ctx, kv_b_ptr, H, dn, dv, R) -> np.ndarray:
    return bf16_to_f32(ctx.read(kv_b_ptr, H * (dn + dv) * R, np.uint16)).reshape(H, dn + dv, R)


@twin(MODULE, "mla_absorb_q")
def _absorb_twin(ctx, qa_ptr, q_ptr, kv_b_ptr, n_tokens, num_heads, nope, rope, v_dim,
                 kv_lora_rank) -> None:
    n, H, dn, dr, dv, R = (int(v) for v in (n_tokens, num_heads, nope, rope, v_dim,
                                            kv_lora_rank))
    w = _kv_b(ctx, kv_b_ptr, H, dn, dv, R)[:, :dn].astype(np.float64)     # [H, nope, R]
    q = ctx.read(q_ptr, n * H * (dn + dr), np.uint16).reshape(n, H, dn + dr)
    qa = ctx.view(qa_ptr, n * H * (R + dr), np.uint16).reshape(n, H, R + dr)
    qn = bf16_to_f32(q[:, :, :dn]).astype(np.float64)
    for t in range(n):        # per token: its bits never depend on the others
        for h in range(H):
            qa[t, h, :R] = f32_to_bf16((qn[t, h] @ w[h]).astype(np.float32))
    qa[:, :, R:] = q[:, :, dn:]


@twin(MODULE, "mla_expand_v")
def _expand_twin(ctx, o_ptr, lat_ptr, kv_b_ptr, n_tokens, num_heads, nope, v_dim,
                 kv_lora_rank) -> None:
    n, H, dn, dv, R = (int(v) for v in (n_tokens, num_heads, nope, v_dim, kv_lora_rank))
    w = _kv_b(ctx, kv_b_ptr, H, dn, dv, R)[:, dn:].astype(np.float64)     # [H, v_dim, R]
    lat = bf16_to_f32(ctx.read(lat_ptr, n * H * R, np.uint16)).reshape(n, H, R)
    o = ctx.view(o_ptr, n * H * dv, np.uint16).reshape(n, H, dv)
    for t in range(n):
        for h in range(H):
            o[t, h] = f32_to_bf16((w[h] @ lat[t, h].astype(np.float64)).astype(np.float32))
