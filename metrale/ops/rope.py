"""Rotary position embedding (kernels/rope.cu): the host-side cos/sin table, the launchers and
the numpy twins of the in-place kernel (with Qwen3's optional per-head q/k RMSNorm first) and
of `rope_write_kv`, which also writes the token's k and v heads to the paged cache (the
model's one launch for both; `kv_cache.write_kv` alone is the same cache write).

Table: float32 [max_positions, head_dim]; row p holds cos(p * inv_freq[j]) * attention_factor
in columns [0, D/2) and sin(p * inv_freq[j]) * attention_factor in [D/2, D), computed in
float64 and cast once. inv_freq follows Hugging Face transformers' `modeling_rope_utils`
(default, linear, llama3, yarn; dynamic below its limit, where it is the default).

Kernel, per token t and per q/k head (NeoX rotate-half layout, x1 = x[:D/2], x2 = x[D/2:]):
    if a norm weight w is given:  x = bf16(x * rsqrt(mean(x^2) + eps) * w)      (fp32 math)
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

MODULE = "rope"
WARPS = 4  # heads per CTA (one warp per head)
MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------------------
# table
# --------------------------------------------------------------------------------------
def _get(obj, name, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        v = obj.get(name, default)
    else:
        v = getattr(obj, name, default)
    return default if v is None else v


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling,
                  max_positions: int | None = None) -> tuple[np.ndarray, float]:
    """`(inv_freq float64 [head_dim//2], attention_factor)` per HF modeling_rope_utils."""
    if head_dim < 2 or head_dim % 2:
        raise InvalidArgument(f"rope: head_dim must be even and >= 2, got {head_dim}")
    if not rope_theta > 0:
        raise InvalidArgument(f"rope: rope_theta must be > 0, got {rope_theta}")
    dim = int(head_dim)
    base = float(rope_theta)
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    pos_freqs = base ** exponents
    inv_freq = 1.0 / pos_freqs
    rope_type = _get(rope_scaling, "rope_type", None) or _get(rope_scaling, "type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "dynamic":
        # HF's dynamic NTK rope rescales only once a call reaches a position past
        # original_max_position_embeddings (= max_position_embeddings); below that it is the
        # default rope, and a table reaching past it is refused (HF's rescaling there
        # depends on how the tokens were chunked and batched).
        limit = _get(rope_scaling, "original_max_position_embeddings", None)
        if limit is None or (max_positions is not None and max_positions > int(limit)):
            raise InvalidArgument(f"rope: dynamic rope covers positions below "
                                  f"max_position_embeddings={limit}, not {max_positions}")
        return inv_freq, 1.0
    if rope_type == "linear":
        factor = float(_get(rope_scaling, "factor", 1.0))
        if not factor > 0:
            raise InvalidArgument(f"rope_scaling.factor must be > 0, got {factor}")
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        factor = float(_get(rope_scaling, "factor"))
        low = float(_get(rope_scaling, "low_freq_factor"))
        high = float(_get(rope_scaling, "high_freq_factor"))
        old_ctx = float(_get(rope_scaling, "original_max_position_embeddings"))
        if high == low:
            raise InvalidArgument("rope_scaling: llama3 needs high_freq_factor != low_freq_factor")
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2.0 * math.pi / inv_freq
        # long wavelengths (low frequencies) are divided by factor, short ones kept,
        # the band in between interpolated smoothly
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        orig = _get(rope_scaling, "original_max_position_embeddings", None) or max_positions
        if orig is None:
            raise InvalidArgument("rope_scaling: yarn needs original_max_position_embeddings")
        orig = float(orig)
        factor = _get(rope_scaling, "factor", None)
        if factor is None:
            if max_positions is None:
                raise InvalidArgument("rope_scaling: yarn needs factor")
            factor = max_positions / orig
        factor = float(factor)
        attention_factor = _get(rope_scaling, "attention_factor", None)
        mscale = _get(rope_scaling, "mscale", None)
        mscale_all_dim = _get(rope_scaling, "mscale_all_dim", None)

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)
        beta_fast = float(_get(rope_scaling, "beta_fast", None) or 32)
        beta_slow = float(_get(rope_scaling, "beta_slow", None) or 1)
        truncate = bool(_get(rope_scaling, "truncate", True))

        def correction_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
        extrap = 1.0 - ramp  # 1 where the original frequency is kept
        inv_interp = 1.0 / (factor * pos_freqs)
        return inv_interp * (1.0 - extrap) + inv_freq * extrap, float(attention_factor)
    raise InvalidArgument(f"rope_scaling.rope_type {rope_type!r} is not supported "
                          "(default, linear, dynamic, llama3, yarn)")


def rope_table(head_dim: int, max_positions: int, rope_theta: float,
               rope_scaling) -> np.ndarray:
    """Host-side float32 table [max_positions, head_dim]: cos in [:, :D/2], sin in [:, D/2:],
    both multiplied by the scaling type's attention factor (yarn), computed in float64."""
    if max_positions < 1:
        raise InvalidArgument(f"rope: max_positions must be >= 1, got {max_positions}")
    inv_freq, attn = rope_inv_freq(head_dim, rope_theta, rope_scaling, max_positions)
    ang = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(ang) * attn, np.sin(ang) * attn], axis=1).astype(np.float32)


# --------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------
def _check(n_tokens, num_heads, num_kv_heads, head_dim, max_positions, norm_eps,
           what: str = "apply_rope") -> None:
    if n_tokens < 1:
        raise InvalidArgument(f"{what}: n_tokens must be >= 1, got {n_tokens}")
    check_heads(what, num_heads, num_kv_heads, head_dim, MAX_HEAD_DIM)
    if max_positions < 1:
        raise InvalidArgument(f"{what}: max_positions must be >= 1, got {max_positions}")
    if (num_heads + 2 * num_kv_heads) * head_dim * max(n_tokens, max_positions) >= 2**31:
        raise InvalidArgument(f"{what}: qkv or table too large for 32-bit indexing")
    if not (norm_eps >= 0 and math.isfinite(norm_eps)):
        raise InvalidArgument(f"{what}: norm_eps must be finite and >= 0, got {norm_eps}")


def apply_rope(backend, stream: int, qkv_ptr, positions_ptr, table_ptr, n_tokens: int,
               num_heads: int, num_kv_heads: int, head_dim: int, max_positions: int,
               q_norm_ptr=NULL, k_norm_ptr=NULL, norm_eps: float = 1e-6) -> None:
    """Rotate the q and k heads of qkv [n_tokens, (H+2KV)*D] bf16 in place.

    positions: int32 [n_tokens] on the device, each in [0, max_positions) -- the caller
    checks (the kernel skips, the twin raises). table: float32 [max_positions, D] from
    `rope_table`. q_norm/k_norm: optional bf16 [D] RMSNorm weights (Qwen3), NULL for none.
    """
    n_tokens, num_heads, num_kv_heads = int(n_tokens), int(num_heads), int(num_kv_heads)
    head_dim, max_positions = int(head_dim), int(max_positions)
    _check(n_tokens, num_heads, num_kv_heads, head_dim, max_positions, float(norm_eps))
    for name, p in (("qkv", qkv_ptr), ("positions", positions_ptr), ("table", table_ptr)):
        if int(p) == 0:
            raise InvalidArgument(f"apply_rope: {name} pointer is NULL")
    n_heads = num_heads + num_kv_heads
    grid = (n_tokens, -(-n_heads // WARPS))
    backend.launch(backend.kernel(MODULE, "apply_rope"), grid, (32 * WARPS,), 0, stream,
                   (DevicePtr(qkv_ptr), DevicePtr(positions_ptr), DevicePtr(table_ptr),
                    DevicePtr(q_norm_ptr), DevicePtr(k_norm_ptr), np.int32(n_tokens),
                    np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim),
                    np.int32(max_positions), np.float32(norm_eps)))


def rope_write_kv(backend, stream: int, qkv_ptr, positions_ptr, table_ptr, k_cache_ptr,
                  v_cache_ptr, slot_mapping_ptr, n_tokens: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, max_positions: int, q_norm_ptr=NULL,
                  k_norm_ptr=NULL, norm_eps: float = 1e-6) -> None:
    """`apply_rope` and `kv_cache.write_kv` in one launch: rotate the q and k heads of qkv
    [n_tokens, (H+2KV)*D] bf16 in place, then k_cache[slot_mapping[t]] = the rotated k heads
    of row t and v_cache[slot_mapping[t]] = its v heads (caches [num_blocks, block_size, KV,
    D] bf16; slot_mapping int32 [n_tokens], < 0 skips the token's cache write).

    positions, table, q_norm, k_norm, norm_eps: as `apply_rope`. qkv and both caches must be
    4-byte aligned (v heads move as 32-bit words).
    """
    n_tokens, num_heads, num_kv_heads = int(n_tokens), int(num_heads), int(num_kv_heads)
    head_dim, max_positions = int(head_dim), int(max_positions)
    what = "rope_write_kv"
    _check(n_tokens, num_heads, num_kv_heads, head_dim, max_positions, float(norm_eps), what)
    check_ptrs(what, 1, positions=positions_ptr, table=table_ptr, slot_mapping=slot_mapping_ptr)
    check_ptrs(what, 4, qkv=qkv_ptr, k_cache=k_cache_ptr, v_cache=v_cache_ptr)
    grid = (n_tokens, -(-(num_heads + 2 * num_kv_heads) // WARPS))
    backend.launch(backend.kernel(MODULE, "rope_write_kv"), grid, (32 * WARPS,), 0, stream,
                   (DevicePtr(qkv_ptr), DevicePtr(positions_ptr), DevicePtr(table_ptr),
                    DevicePtr(q_norm_ptr), DevicePtr(k_norm_ptr), DevicePtr(k_cache_ptr),
                    DevicePtr(v_cache_ptr), DevicePtr(slot_mapping_ptr), np.int32(n_tokens),
                    np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim),
                    np.int32(max_positions), np.float32(norm_eps)))


# --------------------------------------------------------------------------------------
# twin
# --------------------------------------------------------------------------------------
def rms_norm_heads(x: np.ndarray, w: np.ndarray, eps: np.float32) -> np.ndarray:
    """x float32 [..., D], w float32 [D] -> bf16-rounded float32 (the kernel's q/k norm)."""
    d = x.shape[-1]
    ss = np.sum(x * x, axis=-1, keepdims=True, dtype=np.float32)
    r = (np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)).astype(np.float32)
    return round_bf16((x * r) * w)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x float32 [n, heads, D]; cos/sin float32 [n, 1, D/2] -> float32 (not rounded)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


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
                 max_positions, norm_eps) -> bool:
    """apply_rope (k_cache_ptr 0) or rope_write_kv in the native library (the same bits,
    native/norm_rope_act.cpp) once every address and index is checked here; False (nothing
    written) where it cannot run or a check fails: the numpy twin then runs and raises."""
    nat = ctx.native_rows
    if nat is None:
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
                    num_heads, num_kv_heads, head_dim, max_positions, norm_eps) -> None:
    if _native_rope(ctx, qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr, 0, 0, 0,
                    n_tokens, num_heads, num_kv_heads, head_dim, max_positions, norm_eps):
        return
    n, h, kv, d, mp = (int(n_tokens), int(num_heads), int(num_kv_heads), int(head_dim),
                       int(max_positions))
    row = (h + 2 * kv) * d
    qkv = ctx.view(qkv_ptr, n * row, np.uint16).reshape(n, h + 2 * kv, d)
    pos = _checked_positions(ctx, positions_ptr, n, mp)
    table = ctx.read(table_ptr, mp * d, np.float32).reshape(mp, d)
    x = bf16_to_f32(qkv[:, :h + kv])
    eps = np.float32(norm_eps)
    if int(q_norm_ptr):
        wq = bf16_to_f32(ctx.read(q_norm_ptr, d, np.uint16))
        x[:, :h] = rms_norm_heads(x[:, :h], wq, eps)
    if int(k_norm_ptr):
        wk = bf16_to_f32(ctx.read(k_norm_ptr, d, np.uint16))
        x[:, h:] = rms_norm_heads(x[:, h:], wk, eps)
    cs = table[pos]  # [n, D]
    out = rotate(x, cs[:, None, :d // 2], cs[:, None, d // 2:])
    qkv[:, :h + kv] = f32_to_bf16(out)


@twin(MODULE, "rope_write_kv")
def rope_write_kv_twin(ctx, qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr,
                       k_cache_ptr, v_cache_ptr, slot_mapping_ptr, n_tokens, num_heads,
                       num_kv_heads, head_dim, max_positions, norm_eps) -> None:
    """apply_rope's twin, then write_kv's (the kernel's result, by its definition)."""
    if _native_rope(ctx, qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr,
                    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, n_tokens, num_heads,
                    num_kv_heads, head_dim, max_positions, norm_eps):
        return
    apply_rope_twin(ctx, qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr, n_tokens,
                    num_heads, num_kv_heads, head_dim, max_positions, norm_eps)
    write_kv_twin(ctx, qkv_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, n_tokens,
                  num_heads, num_kv_heads, head_dim)
