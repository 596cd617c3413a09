"""In-place BF16 elementwise updates (kernels/elementwise.cu): launchers and numpy twins.

  add_bias:    x[r, :] = bf16(x[r, :] + bias)   (FP32 math, one rounding)
  add_inplace: x       = bf16(x + y)
  scale_inplace: x     = bf16(x * s)           (Gemma's embedding normalizer, a BF16 value)
  softcap_inplace: x   = tanh(x / cap) * cap   (BF16 or FP32 x: Gemma's final logit cap)

Any sizes >= 1: the kernels use 128-bit accesses when the pointers are 16-byte aligned (and,
for add_bias, width % 8 == 0) and fall back to one element per access otherwise.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs as _check_ptrs
from .checks import check_sizes as _check_sizes
from .registry import twin

MODULE = "elementwise"
THREADS = 256
_MAX_BLOCKS = 8192


def add_bias(backend, stream: int, x_ptr, bias_ptr, n_rows: int, width: int) -> None:
    """x[r, :] += bias in place. x: [n_rows, width] bf16; bias: [width] bf16."""
    _check_sizes("add_bias", n_rows=n_rows, width=width)
    _check_ptrs("add_bias", x_ptr=x_ptr, bias_ptr=bias_ptr)
    backend.launch(backend.kernel(MODULE, "add_bias"), (int(n_rows),), (THREADS,), 0, stream,
                   (DevicePtr(x_ptr), DevicePtr(bias_ptr), np.int32(n_rows), np.int32(width)))


def add_inplace(backend, stream: int, x_ptr, y_ptr, n: int) -> None:
    """x += y in place. x, y: [n] bf16."""
    _check_sizes("add_inplace", n=n)
    _check_ptrs("add_inplace", x_ptr=x_ptr, y_ptr=y_ptr)
    chunks = -(-int(n) // 8)
    grid = max(1, min(-(-chunks // THREADS), _MAX_BLOCKS))
    backend.launch(backend.kernel(MODULE, "add_inplace"), (grid,), (THREADS,), 0, stream,
                   (DevicePtr(x_ptr), DevicePtr(y_ptr), np.int32(n)))


def _grid(n: int) -> int:
    return max(1, min(-(-(-(-int(n) // 8)) // THREADS), _MAX_BLOCKS))


def scale_inplace(backend, stream: int, x_ptr, scale: float, n: int) -> None:
    """x = bf16(x * scale) in place. x: [n] bf16; scale: a finite float (float32)."""
    _check_sizes("scale_inplace", n=n)
    _check_ptrs("scale_inplace", x_ptr=x_ptr)
    if not math.isfinite(scale):
        raise InvalidArgument(f"scale_inplace: scale must be finite, got {scale}")
    backend.launch(backend.kernel(MODULE, "scale_inplace"), (_grid(n),), (THREADS,), 0, stream,
                   (DevicePtr(x_ptr), np.float32(scale), np.int32(n)))


def softcap_inplace(backend, stream: int, x_ptr, cap: float, n: int, fp32: bool = False) -> None:
    """x = tanh(x / cap) * cap in place, FP32 math. x: [n] bf16 (one rounding) or float32
    (`fp32`); cap finite > 0."""
    _check_sizes("softcap_inplace", n=n)
    _check_ptrs("softcap_inplace", x_ptr=x_ptr)
    if not (math.isfinite(cap) and cap > 0):
        raise InvalidArgument(f"softcap_inplace: cap must be finite and > 0, got {cap}")
    backend.launch(backend.kernel(MODULE, "softcap_inplace"),
                   (max(1, min(-(-int(n) // THREADS), _MAX_BLOCKS)) if fp32 else _grid(n),),
                   (THREADS,), 0, stream,
                   (DevicePtr(x_ptr), np.float32(cap), np.int32(n), np.int32(bool(fp32))))


def softcap_f32(x: np.ndarray, cap: float) -> np.ndarray:
    """tanh(x / cap) * cap in float32 steps, as the kernel."""
    c = np.float32(cap)
    return (np.tanh(np.asarray(x, np.float32) / c) * c).astype(np.float32)


@twin(MODULE, "scale_inplace")
def scale_inplace_twin(ctx, x_ptr, scale, n) -> None:
    x = ctx.view(x_ptr, int(n), np.uint16)
    x[:] = f32_to_bf16(bf16_to_f32(x) * np.float32(scale))


@twin(MODULE, "softcap_inplace")
def softcap_inplace_twin(ctx, x_ptr, cap, n, is_fp32) -> None:
    n = int(n)
    if int(is_fp32):
        x = ctx.view(x_ptr, n, np.float32)
        x[:] = softcap_f32(x, float(cap))
        return
    x = ctx.view(x_ptr, n, np.uint16)
    x[:] = f32_to_bf16(softcap_f32(bf16_to_f32(x), float(cap)))


@twin(MODULE, "add_bias")
def add_bias_twin(ctx, x_ptr, bias_ptr, n_rows, width) -> None:
    r, w = int(n_rows), int(width)
    x = ctx.view(x_ptr, r * w, np.uint16).reshape(r, w)
    b = bf16_to_f32(ctx.read(bias_ptr, w, np.uint16))
    x[:] = f32_to_bf16(bf16_to_f32(x) + b[None, :])


@twin(MODULE, "add_inplace")
def add_inplace_twin(ctx, x_ptr, y_ptr, n) -> None:
    n = int(n)
    x = ctx.view(x_ptr, n, np.uint16)
    y = bf16_to_f32(ctx.read(y_ptr, n, np.uint16))  # a copy: safe when y aliases x
    x[:] = f32_to_bf16(bf16_to_f32(x) + y)
