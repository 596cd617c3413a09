"""BF16 <-> FP32 casts of flat buffers (kernels/cast.cu): launchers and numpy twins.

`bf16_to_f32` is exact (`bits << 16`); `f32_to_bf16` rounds to nearest even, NaN-safe,
bit-identical to `__float2bfloat16_rn` (metrale.ops.bf16). Any n >= 1; the kernel uses
128-bit accesses when both pointers are 16-byte aligned and handles the n % 8 tail.
"""
from __future__ import annotations

import numpy as np

from ..gpu_runtime.types import DevicePtr
from . import bf16 as _bf
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "cast"
THREADS = 256
_MAX_BLOCKS = 8192


def _check(what: str, n: int, **ptrs) -> None:
    check_sizes(what, n=n)
    check_ptrs(what, **ptrs)


def _grid(n: int) -> int:
    chunks = -(-int(n) // 8)
    return max(1, min(-(-chunks // THREADS), _MAX_BLOCKS))


def bf16_to_f32(backend, stream: int, out_ptr, x_ptr, n: int) -> None:
    """out[i] = float(x[i]). x: [n] bf16; out: [n] float32."""
    _check("bf16_to_f32", n, out_ptr=out_ptr, x_ptr=x_ptr)
    backend.launch(backend.kernel(MODULE, "bf16_to_f32"), (_grid(n),), (THREADS,), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(x_ptr), np.int32(n)))


def f32_to_bf16(backend, stream: int, out_ptr, x_ptr, n: int) -> None:
    """out[i] = bf16_rn(x[i]). x: [n] float32; out: [n] bf16."""
    _check("f32_to_bf16", n, out_ptr=out_ptr, x_ptr=x_ptr)
    backend.launch(backend.kernel(MODULE, "f32_to_bf16"), (_grid(n),), (THREADS,), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(x_ptr), np.int32(n)))


@twin(MODULE, "bf16_to_f32")
def bf16_to_f32_twin(ctx, out_ptr, x_ptr, n) -> None:
    n = int(n)
    src = _bf.bf16_to_f32(ctx.read(x_ptr, n, np.uint16))
    ctx.view(out_ptr, n, np.float32)[:] = src


@twin(MODULE, "f32_to_bf16")
def f32_to_bf16_twin(ctx, out_ptr, x_ptr, n) -> None:
    n = int(n)
    src = _bf.f32_to_bf16(ctx.read(x_ptr, n, np.float32))
    ctx.view(out_ptr, n, np.uint16)[:] = src
