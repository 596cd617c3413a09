"""Vision-tower helpers (kernels/vision.cu, module "vision"): CLIP patch embedding.
Launchers and numpy twins. FP32 math, one BF16 rounding per stored element.

  patchify:        pixels float32 [C, H, W] -> out bf16 [(H/p)*(W/p), C*p*p], the im2col of
                   a stride-p, kernel-p convolution (column order c, ky, kx: the conv weight
                   [hidden, C, p, p] read as [hidden, C*p*p]). The patch embedding is then
                   one GEMM: patches @ W^T.
  class_pos_embed: x [n_rows, hidden] bf16 in place: row 0 = cls + pos[0], row r = x[r] +
                   pos[r] (CLIP's `cat([class, patches]) + position_embedding`).
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16
from .registry import twin

MODULE = "vision"
THREADS = 256


def _check_sizes(what: str, **sizes) -> None:
    for name, v in sizes.items():
        if isinstance(v, bool) or not 1 <= int(v) < 2**31:
            raise InvalidArgument(f"{what}: {name} must be in [1, 2^31), got {v}")


def _check_ptrs(what: str, **ptrs) -> None:
    for name, p in ptrs.items():
        if int(p) == 0:
            raise InvalidArgument(f"{what}: {name} is NULL")


def num_patches(height: int, width: int, patch: int) -> int:
    return (int(height) // int(patch)) * (int(width) // int(patch))


def patchify(backend, stream: int, out_ptr, pixels_ptr, channels: int, height: int,
             width: int, patch: int) -> None:
    """out [(H/p)*(W/p), C*p*p] bf16 = im2col of pixels [C, H, W] float32 (one image)."""
    _check_sizes("patchify", channels=channels, height=height, width=width, patch=patch)
    if int(patch) > int(height) or int(patch) > int(width):
        raise InvalidArgument(f"patchify: patch {patch} exceeds the image ({height}x{width})")
    if int(channels) * int(height) * int(width) >= 2**31:
        raise InvalidArgument("patchify: channels * height * width must be < 2^31")
    if int(channels) * int(patch) * int(patch) >= 2**31:
        raise InvalidArgument("patchify: channels * patch^2 must be < 2^31")
    _check_ptrs("patchify", out_ptr=out_ptr, pixels_ptr=pixels_ptr)
    n = num_patches(height, width, patch)
    backend.launch(backend.kernel(MODULE, "patchify"), (n,), (THREADS,), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(pixels_ptr), np.int32(channels),
                    np.int32(height), np.int32(width), np.int32(patch)))


def class_pos_embed(backend, stream: int, x_ptr, cls_ptr, pos_ptr, n_rows: int,
                    hidden: int) -> None:
    """x[0] = bf16(cls + pos[0]); x[r] = bf16(x[r] + pos[r]) for r >= 1, in place.
    x, pos: [n_rows, hidden] bf16; cls: [hidden] bf16."""
    _check_sizes("class_pos_embed", n_rows=n_rows, hidden=hidden)
    _check_ptrs("class_pos_embed", x_ptr=x_ptr, cls_ptr=cls_ptr, pos_ptr=pos_ptr)
    backend.launch(backend.kernel(MODULE, "class_pos_embed"), (int(n_rows),), (THREADS,), 0,
                   stream, (DevicePtr(x_ptr), DevicePtr(cls_ptr), DevicePtr(pos_ptr),
                            np.int32(n_rows), np.int32(hidden)))


def patchify_f32(pixels: np.ndarray, patch: int) -> np.ndarray:
    """[C, H, W] -> [(H/p)*(W/p), C*p*p] float32 (the reference im2col)."""
    c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels[:, :gh * patch, :gw * patch].reshape(c, gh, patch, gw, patch)
    return np.ascontiguousarray(x.transpose(1, 3, 0, 2, 4).reshape(gh * gw, c * patch * patch))


@twin(MODULE, "patchify")
def patchify_twin(ctx, out_ptr, pixels_ptr, channels, height, width, patch) -> None:
    c, h, w, p = int(channels), int(height), int(width), int(patch)
    px = ctx.read(pixels_ptr, c * h * w, np.float32).reshape(c, h, w)
    n = num_patches(h, w, p)
    ctx.view(out_ptr, n * c * p * p, np.uint16).reshape(n, c * p * p)[:] = \
        f32_to_bf16(patchify_f32(px, p))


@twin(MODULE, "class_pos_embed")
def class_pos_embed_twin(ctx, x_ptr, cls_ptr, pos_ptr, n_rows, hidden) -> None:
    r, d = int(n_rows), int(hidden)
    x = ctx.view(x_ptr, r * d, np.uint16).reshape(r, d)
    cls = bf16_to_f32(ctx.read(cls_ptr, d, np.uint16))
    pos = bf16_to_f32(ctx.read(pos_ptr, r * d, np.uint16)).reshape(r, d)
    base = bf16_to_f32(x)
    base[0] = cls
    x[:] = f32_to_bf16(base + pos)
