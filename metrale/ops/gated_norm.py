"""The norms and gates of the hybrid families (kernels/gated_norm.cu, module "gated_norm"):
launchers and numpy twins.

  rmsnorm_offset       RMSNorm with one rounding, out = bf16(x * rsqrt(mean(x^2) + eps) *
                       (offset + w)): offset 1 is the zero-centred norm of Qwen3-Next /
                       Qwen3.5, 0 Nemotron-H's; an optional fused residual add;
                       `rmsnorm_offset_heads` runs it over the q and k heads of a qkv row
                       (the q/k norms), each with its weight
  rmsnorm_gated        the gated RMSNorm of a linear-attention / Mamba output, per group:
                       norm_first (Qwen): bf16(bf16(bf16(x * inv) * w) * silu(z));
                       gate first (Nemotron-H): bf16(bf16(x * silu(z) * inv) * w)
  sigmoid_gate_mul     x = bf16(x * bf16(sigmoid(g))): the output gate of the gated attention
  relu2                x = bf16(max(x, 0)^2): Nemotron-H's non-gated MLP activation

Layouts and rounding: kernels/gated_norm.cu's opening comment. The twins compute the same
FP32 formulas (numpy's sum order: within the BF16 tolerance of the kernels').
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import NULL, DevicePtr
from .activation import silu_f32
from .bf16 import bf16_to_f32, f32_to_bf16, round_bf16
from .checks import check_ptrs, check_sizes
from .registry import twin
from .rmsnorm import whole_or_apart

MODULE = "gated_norm"
ROWS_PER_CTA = 4          # GN_ROWS_PER_CTA
GATE_THREADS = 256


def _eps(what: str, eps: float) -> None:
    if not (math.isfinite(float(eps)) and float(eps) >= 0.0):
        raise InvalidArgument(f"{what}: eps must be finite and >= 0, got {eps}")


def _launch_offset(backend, stream, out_ptr, x_ptr, w_a, w_b, residual_ptr, n_tokens,
                   heads_a, heads_b, dim, stride, eps, what, offset=1.0) -> None:
    check_sizes(what, n_tokens=n_tokens, dim=dim, stride=stride, heads=heads_a + heads_b)
    _eps(what, eps)
    check_ptrs(what, out_ptr=out_ptr, x_ptr=x_ptr, w_a=w_a)
    if heads_b:
        check_ptrs(what, w_b=w_b)
    if int(stride) < (int(heads_a) + int(heads_b)) * int(dim):
        raise InvalidArgument(f"{what}: stride {stride} is shorter than the "
                              f"{int(heads_a) + int(heads_b)} rows of {dim} it holds")
    rows = int(n_tokens) * (int(heads_a) + int(heads_b))
    if rows >= 2**31:
        raise InvalidArgument(f"{what}: {rows} rows exceed the kernel's 32-bit row index")
    backend.launch(backend.kernel(MODULE, "rmsnorm_offset"), (-(-rows // ROWS_PER_CTA),),
                   (32 * ROWS_PER_CTA,), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(x_ptr), DevicePtr(w_a),
                    DevicePtr(w_b if heads_b else NULL), DevicePtr(residual_ptr or NULL),
                    np.int32(n_tokens), np.int32(heads_a), np.int32(heads_b), np.int32(dim),
                    np.int32(stride), np.float32(eps), np.float32(offset)))


def rmsnorm_offset(backend, stream: int, out_ptr, x_ptr, weight_ptr, n_rows: int, hidden: int,
                   eps: float, residual_ptr=NULL, offset: float = 1.0) -> None:
    """out = bf16(x * rsqrt(mean(x^2) + eps) * (offset + w)), row by row (offset 1: the
    zero-centred norm; 0: w as it is). x, out [n_rows, hidden] bf16, weight [hidden] bf16.
    With residual_ptr ([n_rows, hidden] bf16): residual = bf16(residual + x) in place first,
    and the stored row is normalized. out may equal x."""
    if float(offset) not in (0.0, 1.0):
        raise InvalidArgument(f"rmsnorm_offset: offset must be 0 or 1, got {offset}")
    _launch_offset(backend, stream, out_ptr, x_ptr, weight_ptr, NULL, residual_ptr, n_rows,
                   1, 0, hidden, hidden, eps, "rmsnorm_offset", offset)


def rmsnorm_offset_heads(backend, stream: int, qkv_ptr, q_weight_ptr, k_weight_ptr,
                         n_tokens: int, q_heads: int, k_heads: int, head_dim: int,
                         row_stride: int, eps: float) -> None:
    """The zero-centred norm over each head of the first q_heads + k_heads heads of every
    row of qkv [n_tokens, row_stride] bf16, in place: q heads with q_weight [head_dim], the
    k heads after them with k_weight [head_dim]."""
    _launch_offset(backend, stream, qkv_ptr, qkv_ptr, q_weight_ptr, k_weight_ptr, NULL,
                   n_tokens, q_heads, k_heads, head_dim, row_stride, eps,
                   "rmsnorm_offset_heads")


def rmsnorm_gated(backend, stream: int, out_ptr, x_ptr, z_ptr, weight_ptr, n_tokens: int,
                  width: int, group: int, w_len: int, z_stride: int, eps: float,
                  norm_first: bool) -> None:
    """The gated RMSNorm over groups of `group` elements of x [n_tokens, width] bf16 (module
    docstring); z: row t at z + t * z_stride (bf16); weight [w_len] bf16 (w_len = group:
    shared by the groups, or width); out [n_tokens, width] bf16 (may equal x)."""
    what = "rmsnorm_gated"
    check_sizes(what, n_tokens=n_tokens, width=width, group=group, w_len=w_len,
                z_stride=z_stride)
    _eps(what, eps)
    check_ptrs(what, out_ptr=out_ptr, x_ptr=x_ptr, z_ptr=z_ptr, weight_ptr=weight_ptr)
    if int(width) % int(group):
        raise InvalidArgument(f"{what}: width {width} is not a multiple of group {group}")
    if int(w_len) not in (int(group), int(width)):
        raise InvalidArgument(f"{what}: w_len {w_len} must be group ({group}) or width "
                              f"({width})")
    if int(z_stride) < int(width):
        raise InvalidArgument(f"{what}: z_stride {z_stride} is less than width {width}")
    rows = int(n_tokens) * (int(width) // int(group))
    backend.launch(backend.kernel(MODULE, "rmsnorm_gated"), (-(-rows // ROWS_PER_CTA),),
                   (32 * ROWS_PER_CTA,), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(x_ptr), DevicePtr(z_ptr),
                    DevicePtr(weight_ptr), np.int32(n_tokens), np.int32(width),
                    np.int32(group), np.int32(w_len), np.int32(z_stride), np.float32(eps),
                    np.int32(1 if norm_first else 0)))


def sigmoid_gate_mul(backend, stream: int, x_ptr, g_ptr, n_tokens: int, width: int,
                     g_stride: int) -> None:
    """x[t, c] = bf16(x[t, c] * bf16(sigmoid(g[t, c]))) in place; x [n_tokens, width] bf16,
    g row t at g + t * g_stride (bf16)."""
    what = "sigmoid_gate_mul"
    check_sizes(what, n_tokens=n_tokens, width=width, g_stride=g_stride)
    check_ptrs(what, x_ptr=x_ptr, g_ptr=g_ptr)
    if int(g_stride) < int(width):
        raise InvalidArgument(f"{what}: g_stride {g_stride} is less than width {width}")
    backend.launch(backend.kernel(MODULE, "sigmoid_gate_mul"), (int(n_tokens),),
                   (GATE_THREADS,), 0, stream,
                   (DevicePtr(x_ptr), DevicePtr(g_ptr), np.int32(n_tokens), np.int32(width),
                    np.int32(g_stride)))


def relu2(backend, stream: int, x_ptr, n: int) -> None:
    """x = bf16(max(x, 0)^2) in place; x [n] bf16."""
    check_sizes("relu2", n=n)
    check_ptrs("relu2", x_ptr=x_ptr)
    grid = max(1, min(-(-int(n) // GATE_THREADS), 65535))
    backend.launch(backend.kernel(MODULE, "relu2"), (grid,), (GATE_THREADS,), 0, stream,
                   (DevicePtr(x_ptr), np.int64(n)))


# ---- the twins ------------------------------------------------------------------------------
def _inv_rms(v: np.ndarray, eps) -> np.ndarray:
    """float32 [..., 1]: rsqrt(sum(v^2) / n + eps) over the last axis of float32 v."""
    ss = np.sum(v * v, axis=-1, keepdims=True, dtype=np.float32)
    return (np.float32(1.0) / np.sqrt(ss / np.float32(v.shape[-1]) + np.float32(eps))) \
        .astype(np.float32)


def _rows(ctx, ptr, n_tokens: int, stride: int, width: int) -> np.ndarray:
    """[n_tokens, width] uint16 view of strided BF16 rows."""
    flat = ctx.view(ptr, (n_tokens - 1) * stride + width, np.uint16)
    return np.lib.stride_tricks.as_strided(flat, (n_tokens, width), (2 * stride, 2))


def _offset_weight(ctx, w_ptr, d: int, offset) -> np.ndarray:
    """float32 (offset + w) [d], converted once and cached with the weight's allocation (a
    decode step would convert it at every launch)."""
    def convert():
        return np.float32(offset) + bf16_to_f32(ctx.read(w_ptr, d, np.uint16))
    w = ctx.backend.converted(w_ptr, 2 * d, f"gated_norm.offset{float(offset)}", convert,
                              4 * d)
    return convert() if w is None else w


@twin(MODULE, "rmsnorm_offset")
def _offset_twin(ctx, out_ptr, x_ptr, w_a, w_b, residual_ptr, n_tokens, heads_a, heads_b, dim,
                 stride, eps, offset) -> None:
    n, ha, hb, d, s = (int(v) for v in (n_tokens, heads_a, heads_b, dim, stride))
    h = ha + hb
    nat = ctx.native_rows
    if nat is not None and not hb and s == h * d and \
            whole_or_apart(n * s * 2, x_ptr, out_ptr, residual_ptr):
        # contiguous rows of one weight (every norm but the q/k heads'): the native row
        # routine's offset mode gives the bits below (native/norm_rope_act.cpp)
        nat.rmsnorm(ctx.write_addr(out_ptr, n * s * 2), ctx.read_addr(x_ptr, n * s * 2),
                    ctx.read_addr(w_a, d * 2),
                    ctx.write_addr(residual_ptr, n * s * 2) if int(residual_ptr) else 0,
                    n * ha, d, float(eps), 2, float(offset))
        return
    if s == h * d:   # contiguous rows (every norm but the q/k heads'): plain views
        x = ctx.read(x_ptr, n * s, np.uint16).reshape(n, h, d)
        res = ctx.view(residual_ptr, n * s, np.uint16).reshape(n, h, d) \
            if int(residual_ptr) else None
    else:
        x = np.array(_rows(ctx, x_ptr, n, s, h * d)).reshape(n, h, d)
        res = _rows(ctx, residual_ptr, n, s, h * d).reshape(n, h, d) \
            if int(residual_ptr) else None
    v = bf16_to_f32(x)
    if res is not None:
        summed = f32_to_bf16(bf16_to_f32(res) + v)
        res[:] = summed
        v = bf16_to_f32(summed)
    w = _offset_weight(ctx, w_a, d, offset)
    if hb:
        w = np.concatenate([np.broadcast_to(w, (ha, d)),
                            np.broadcast_to(_offset_weight(ctx, w_b, d, offset), (hb, d))])
    y = f32_to_bf16((v * _inv_rms(v, eps)) * w)
    if s == h * d:
        ctx.view(out_ptr, n * s, np.uint16).reshape(n, h, d)[:] = y
    else:
        _rows(ctx, out_ptr, n, s, h * d).reshape(n, h, d)[:] = y


@twin(MODULE, "rmsnorm_gated")
def _gated_twin(ctx, out_ptr, x_ptr, z_ptr, w_ptr, n_tokens, width, group, w_len, z_stride,
                eps, norm_first) -> None:
    n, width, group, w_len = int(n_tokens), int(width), int(group), int(w_len)
    g = width // group
    x = bf16_to_f32(ctx.read(x_ptr, n * width, np.uint16)).reshape(n, g, group)
    z = bf16_to_f32(np.array(_rows(ctx, z_ptr, n, int(z_stride), width))).reshape(n, g, group)
    w = bf16_to_f32(ctx.read(w_ptr, w_len, np.uint16))
    w = (np.tile(w, g) if w_len == group else w).reshape(g, group)
    s = silu_f32(z)
    if int(norm_first):
        y = round_bf16(round_bf16(x * _inv_rms(x, eps)) * w[None]) * s
    else:
        h = x * s
        y = round_bf16(h * _inv_rms(h, eps)) * w[None]
    ctx.view(out_ptr, n * width, np.uint16).reshape(n, g, group)[:] = f32_to_bf16(y)


def sigmoid_f32(g: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-g)) in float32."""
    g = np.asarray(g, np.float32)
    with np.errstate(over="ignore"):
        return (np.float32(1) / (np.float32(1) + np.exp(-g))).astype(np.float32)


@twin(MODULE, "sigmoid_gate_mul")
def _gate_twin(ctx, x_ptr, g_ptr, n_tokens, width, g_stride) -> None:
    n, width = int(n_tokens), int(width)
    x = ctx.view(x_ptr, n * width, np.uint16).reshape(n, width)
    gate = bf16_to_f32(np.array(_rows(ctx, g_ptr, n, int(g_stride), width)))
    x[:] = f32_to_bf16(bf16_to_f32(x) * round_bf16(sigmoid_f32(gate)))


@twin(MODULE, "relu2")
def _relu2_twin(ctx, x_ptr, n) -> None:
    x = ctx.view(x_ptr, int(n), np.uint16)
    v = np.maximum(bf16_to_f32(x), np.float32(0))
    x[:] = f32_to_bf16(v * v)
