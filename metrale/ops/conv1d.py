"""1-D convolution over time-major rows (kernels/conv1d.cu, module "conv1d"): the Whisper
conv stem (conv1: k=3, stride 1, pad 1; conv2: k=3, stride 2, pad 1), bias and an optional
exact (erf) GELU fused. Launcher and numpy twin.

Layouts (time-major, what the transformer rows want):
  x   [length, c_in] bf16
  w   [c_out, kernel_size, c_in] bf16 — HF's Conv1d weight [c_out, c_in, k] permuted
      (0, 2, 1) once at load (`hf_weight_to_tap_major`)
  b   [c_out] bf16
  out [l_out, c_out] bf16, l_out = (length + 2*padding - kernel_size) // stride + 1
out[t, co] = act(b[co] + sum_{kk, ci} w[co, kk, ci] * x[t*stride - padding + kk, ci]), rows
of x outside [0, length) read as zero; FP32 math, one BF16 rounding.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .activation import gelu_f32
from .bf16 import bf16_to_f32, f32_to_bf16
from .registry import twin

MODULE = "conv1d"
THREADS = 256
TILE_M = 64  # output rows (time) per CTA
TILE_N = 64  # output channels per CTA
_GRID_Y_MAX = 65535


def output_length(length: int, kernel_size: int, stride: int, padding: int) -> int:
    """Output rows of a convolution: (length + 2*padding - kernel_size) // stride + 1."""
    return (int(length) + 2 * int(padding) - int(kernel_size)) // int(stride) + 1


def hf_weight_to_tap_major(w_bits: np.ndarray) -> np.ndarray:
    """HF Conv1d weight [c_out, c_in, k] -> this kernel's [c_out, k, c_in] (contiguous)."""
    if w_bits.ndim != 3:
        raise InvalidArgument(f"conv1d weight must be 3-D [c_out, c_in, k], got {w_bits.shape}")
    return np.ascontiguousarray(np.transpose(w_bits, (0, 2, 1)))


def conv1d(backend, stream: int, out_ptr, x_ptr, w_ptr, bias_ptr, c_in: int, c_out: int,
           length: int, kernel_size: int, stride: int, padding: int, gelu: bool) -> None:
    """out[l_out, c_out] = act(conv1d(x[length, c_in], w[c_out, k, c_in]) + b), time-major.

    `gelu`: apply the exact (erf) GELU before the store. See the module docstring.
    """
    sizes = dict(c_in=c_in, c_out=c_out, length=length, kernel_size=kernel_size,
                 stride=stride)
    for name, v in sizes.items():
        if not 1 <= int(v) < 2**31:
            raise InvalidArgument(f"conv1d: {name} must be in [1, 2^31), got {v}")
    if not 0 <= int(padding) < 2**30:
        raise InvalidArgument(f"conv1d: padding must be in [0, 2^30), got {padding}")
    c_in, c_out, length = int(c_in), int(c_out), int(length)
    kernel_size, stride, padding = int(kernel_size), int(stride), int(padding)
    if kernel_size * c_in >= 2**31:
        raise InvalidArgument(f"conv1d: kernel_size * c_in = {kernel_size * c_in} exceeds 2^31")
    l_out = output_length(length, kernel_size, stride, padding)
    if l_out < 1:
        raise InvalidArgument(f"conv1d: length {length} with padding {padding} is shorter than "
                              f"kernel_size {kernel_size} (no output rows)")
    if l_out * c_out >= 2**31 or length * c_in >= 2**31:
        raise InvalidArgument("conv1d: input or output exceeds 2^31 elements")
    for name, p in (("out_ptr", out_ptr), ("x_ptr", x_ptr), ("w_ptr", w_ptr),
                    ("bias_ptr", bias_ptr)):
        if int(p) == 0:
            raise InvalidArgument(f"conv1d: {name} is NULL")
    grid_y = -(-c_out // TILE_N)
    if grid_y > _GRID_Y_MAX:
        raise InvalidArgument(f"conv1d: c_out {c_out} exceeds {_GRID_Y_MAX * TILE_N}")
    vec = c_in % 8 == 0 and int(x_ptr) % 16 == 0 and int(w_ptr) % 16 == 0
    func = "conv1d_v8" if vec else "conv1d_v1"
    backend.launch(backend.kernel(MODULE, func), (-(-l_out // TILE_M), grid_y), (THREADS,), 0,
                   stream,
                   (DevicePtr(out_ptr), DevicePtr(x_ptr), DevicePtr(w_ptr), DevicePtr(bias_ptr),
                    np.int32(c_in), np.int32(c_out), np.int32(length), np.int32(kernel_size),
                    np.int32(stride), np.int32(padding), np.int32(l_out),
                    np.int32(1 if gelu else 0)))


def conv1d_f32(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int, padding: int,
               gelu: bool) -> np.ndarray:
    """float32 reference: x [length, c_in], w [c_out, k, c_in], b [c_out] -> [l_out, c_out]."""
    length, c_in = x.shape
    c_out, k, _ = w.shape
    l_out = output_length(length, k, stride, padding)
    xp = np.zeros((length + 2 * padding + stride, c_in), np.float32)
    xp[padding:padding + length] = x
    # im2col: cols[t, kk, ci] = xp[t*stride + kk, ci]
    cols = np.empty((l_out, k, c_in), np.float32)
    for kk in range(k):
        cols[:, kk, :] = xp[kk:kk + stride * (l_out - 1) + 1:stride]
    y = cols.reshape(l_out, k * c_in) @ w.reshape(c_out, k * c_in).T
    y += b[None, :]
    return gelu_f32(y, 0) if gelu else y.astype(np.float32)


def _twin(ctx, out_ptr, x_ptr, w_ptr, bias_ptr, c_in, c_out, length, kernel_size, stride,
          padding, l_out, gelu) -> None:
    ci, co, n, k = int(c_in), int(c_out), int(length), int(kernel_size)
    lo = int(l_out)
    x = bf16_to_f32(ctx.read(x_ptr, n * ci, np.uint16)).reshape(n, ci)
    w = bf16_to_f32(ctx.read(w_ptr, co * k * ci, np.uint16)).reshape(co, k, ci)
    b = bf16_to_f32(ctx.read(bias_ptr, co, np.uint16))
    y = conv1d_f32(x, w, b, int(stride), int(padding), bool(int(gelu)))
    ctx.view(out_ptr, lo * co, np.uint16).reshape(lo, co)[:] = f32_to_bf16(y)


twin(MODULE, "conv1d_v8")(_twin)
twin(MODULE, "conv1d_v1")(_twin)
