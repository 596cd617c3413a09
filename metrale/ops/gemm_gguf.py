"""The GEMM over GGUF weights kept at their bytes (modules "gemm_gguf" and "gemm_gguf_k"):
Y[m, n] = X[m, k] @
dequant(W)[n, k]^T, W in the planes of ops/gguf_planes.py (q, qh, meta of one ggml type),
BF16 X, FP32 accumulation, BF16 or FP32 out, Y rows `ldy` elements apart.

`dequant(W)` is ops/gguf_planes.py's BF16 matrix: the bits the load-time dequantizer gives
(formats/gguf/quants.py), so a model's logits are the same whether its GGUF weights stay
packed or are dequantized at load. The GEMM over it is gemm_tc's (`dot_f32`'s fixed k
order), so a row's result depends on (x row, W row, k) alone: batch invariance as for BF16.

Kernel entry points (kernels/gemm_gguf.cu for the 32-element block types, gemm_gguf_k.cu for
the 256-element ones: `module_of`): `gemm_gguf_{type}_{out}_{tile}` with type the lower-case
ggml name (q4_0, q4_k, iq4_xs, ...), out bf16 | fp32 and tile one of ops/gemm_tc.py's TILES,
each taking
    (y, x, q, qh, meta, m, n, k, ldy)
y [m, ldy] (the first n columns written), x bf16 [m, k], q / qh / meta uint8 planes
([n, q_row], [n, qh_row] or NULL, [n, meta_row]) aligned as `plane_alignment` says, k % QK
== 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import NULL, DevicePtr
from .bf16 import f32_to_bf16
from .checks import check_ptrs, check_sizes
from .gemm_tc import TILES, dot_f32, resolve_tile
from .gguf_planes import PACKED, dequant_bf16, plane_bytes
from .registry import twin

MODULE = "gemm_gguf"          # the 32-element block types (kernels/gemm_gguf.cu)
MODULE_K = "gemm_gguf_k"      # the 256-element ones: K-quants, IQ4_XS (kernels/gemm_gguf_k.cu)


def module_of(ggml_type: int) -> str:
    """The kernel module holding `ggml_type`'s entry points (two files: NVRTC compile time)."""
    return MODULE if PACKED[ggml_type].qk == 32 else MODULE_K


def plane_alignment(ggml_type: int) -> tuple[int, int, int]:
    """(q, qh, meta): the byte alignment the kernels need of each plane's base pointer.

    q 16 (16-byte cp.async; rows are 16-byte multiples); meta the largest power of two that
    divides a block's meta bytes, at most 16 (a block's fields are read at that width: Q4_K
    one 16-byte load, Q3_K / Q6_K 2-byte ones); qh likewise for a block's qh bytes (4 for
    Q5_0 / Q5_1, 16 for the K-quants; 1 where there is no qh plane). Each row then starts
    aligned too, so a row-offset view of a plane keeps them."""
    t = PACKED[ggml_type]

    def pow2(nbytes: int) -> int:
        return min(16, nbytes & -nbytes) if nbytes else 1
    return 16, pow2(t.qk * t.high_bits // 8), pow2(t.meta_bytes)


def kernel_name(ggml_type: int, out_fp32: bool, tile: str) -> str:
    return f"gemm_gguf_{PACKED[ggml_type].name.lower()}_{'fp32' if out_fp32 else 'bf16'}_{tile}"


def check_planes(what: str, k, ggml_type, q_ptr, qh_ptr, meta_ptr) -> None:
    """The checks of a W in planes every GGUF kernel reads (gemm_gguf, embedding_gguf): a
    packed type, whole blocks along k, a qh plane exactly where the type has high bits, and
    each plane's base aligned as plane_alignment says (InvalidArgument)."""
    if ggml_type not in PACKED:
        raise InvalidArgument(f"{what}: ggml type {ggml_type!r} is not kept packed (packed: "
                              f"{', '.join(t.name for t in PACKED.values())})")
    t = PACKED[ggml_type]
    q_align, qh_align, meta_align = plane_alignment(ggml_type)
    check_ptrs(what, meta_align, meta_ptr=meta_ptr)
    check_ptrs(what, q_align, q_ptr=q_ptr)
    if k % t.qk:
        raise InvalidArgument(f"{what}: k = {k} must be a multiple of {t.name}'s block of "
                              f"{t.qk}")
    if (int(qh_ptr) != 0) != (t.high_bits > 0):
        raise InvalidArgument(f"{what}: {t.name} " + ("needs a qh plane" if t.high_bits else
                                                      "has no qh plane (pass NULL)"))
    if t.high_bits:
        check_ptrs(what, qh_align, qh_ptr=qh_ptr)


def check_gguf(what: str, m, n, k, ldy, ggml_type, q_ptr, qh_ptr, meta_ptr) -> None:
    """gemm_gguf's argument checks (InvalidArgument before any launch)."""
    check_sizes(what, m=m, n=n, k=k, ldy=ldy)
    check_planes(what, k, ggml_type, q_ptr, qh_ptr, meta_ptr)
    if ldy < n:
        raise InvalidArgument(f"{what}: ldy = {ldy} is less than n = {n}")


@dataclass(frozen=True)
class GgufW:
    """A GGUF W [n, k] on the device: its planes' pointers and type."""
    q: DevicePtr
    qh: DevicePtr           # NULL for types without high bits
    meta: DevicePtr
    ggml_type: int
    n: int
    k: int

    def run(self, backend, stream: int, y_ptr, x_ptr, m: int, out_fp32: bool = False,
            ldy: int | None = None, tile: str | None = None) -> None:
        gemm_gguf(backend, stream, y_ptr, x_ptr, self.q, self.qh, self.meta, m, self.n,
                  self.k, self.ggml_type, ldy=ldy, out_fp32=out_fp32, tile=tile)


def gemm_gguf(backend, stream: int, y_ptr, x_ptr, q_ptr, qh_ptr, meta_ptr, m: int, n: int,
              k: int, ggml_type: int, ldy: int | None = None, out_fp32: bool = False,
              tile: str | None = None) -> None:
    """Y[m, :n] = X[m, k] @ dequant(W)[n, k]^T on tensor cores, batch-invariant.

    x: [m, k] bf16; q, qh (NULL for types without high bits), meta: W's planes
    (ops/gguf_planes.py) for `ggml_type`; y: [m, ldy] bf16, or float32 when out_fp32
    (ldy default n)."""
    what = f"gemm_gguf ({PACKED[ggml_type].name if ggml_type in PACKED else ggml_type})"
    ldy = n if ldy is None else ldy
    check_ptrs(what, y_ptr=y_ptr, x_ptr=x_ptr)
    check_gguf(what, m, n, k, ldy, ggml_type, q_ptr, qh_ptr, meta_ptr)
    t = resolve_tile(m, n, tile, what)
    threads = 32 if t.name == "16x16" else t.threads
    kernel = backend.kernel(module_of(ggml_type), kernel_name(ggml_type, out_fp32, t.name))
    backend.launch(kernel, t.grid(m, n), (threads,), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(x_ptr), DevicePtr(q_ptr), DevicePtr(qh_ptr),
                    DevicePtr(meta_ptr), np.int32(m), np.int32(n), np.int32(k),
                    np.int32(ldy)))


# --------------------------------------------------------------------------- the twins
def read_planes(ctx, q_ptr, qh_ptr, meta_ptr, ggml_type: int, n: int, k: int):
    """(q, qh or None, meta) host views of W's planes at device addresses."""
    q_row, qh_row, meta_row = plane_bytes(ggml_type, k)
    q = ctx.read(q_ptr, n * q_row, np.uint8).reshape(n, q_row)
    qh = ctx.read(qh_ptr, n * qh_row, np.uint8).reshape(n, qh_row) if qh_row else None
    return q, qh, ctx.read(meta_ptr, n * meta_row, np.uint8).reshape(n, meta_row)


def gguf_rows_at(ctx, q_ptr, qh_ptr, meta_ptr, ggml_type: int, n: int, k: int):
    """gemm(y_addr, x_addr, m, out_fp32=False, ldy=n) -> bool: the twin on host rows given by
    address (x [m, k] BF16 bits, y rows ldy apart, float32 or BF16 bits, both checked by the
    caller) through the native library, W's plane ranges checked here; None without the
    library (the gemm_q.q4_rows_at of GGUF W). The call returns False, having written
    nothing, where the library does not take the type."""
    native = getattr(ctx.backend, "native", None)
    if native is None:
        return None
    q_row, qh_row, meta_row = plane_bytes(ggml_type, k)
    w = (ctx.read_addr(q_ptr, n * q_row), ctx.read_addr(qh_ptr, n * qh_row) if qh_row else 0,
         ctx.read_addr(meta_ptr, n * meta_row))
    return lambda y_addr, x_addr, m, out_fp32=False, ldy=n: native.gemm_gguf_at(
        ggml_type, x_addr, *w, m, n, k, ldy, y_addr, out_fp32)


def _row_stride(x: np.ndarray, y: np.ndarray, n: int, k: int) -> int:
    """y's row stride in elements where the native GEMM takes x and y by address (x [m, k]
    BF16 bits C-contiguous, y [m, n] float32 / BF16 bits with contiguous rows), else 0."""
    ok = (x.dtype == np.uint16 and y.dtype in (np.float32, np.uint16) and x.ndim == 2 and
          y.ndim == 2 and x.flags.c_contiguous and y.flags.writeable and x.shape[1] == k and
          y.shape == (len(x), n) and y.strides[1] == y.itemsize and
          y.strides[0] % y.itemsize == 0 and y.strides[0] >= n * y.itemsize)
    return y.strides[0] // y.itemsize if ok else 0


def gguf_rows_twin(ctx, y: np.ndarray, x: np.ndarray, q_ptr, qh_ptr, meta_ptr,
                   ggml_type: int, n: int, k: int) -> None:
    """y [m, n] (float32, or uint16 BF16 bits; may be a strided view) = x [m, k] (BF16
    bits) @ dequant(W)^T, W's planes at device addresses: the twin's arithmetic (natively,
    W dequantized in the GEMM's tiles, where the library is; else dequant_bf16 and
    gemm_tc's dot_f32)."""
    ldy = _row_stride(x, y, n, k)
    gemm_at = gguf_rows_at(ctx, q_ptr, qh_ptr, meta_ptr, ggml_type, n, k) if ldy else None
    if gemm_at is not None and gemm_at(y.ctypes.data, x.ctypes.data, len(x),
                                       y.dtype == np.float32, ldy):
        return
    w = dequant_bf16(*read_planes(ctx, q_ptr, qh_ptr, meta_ptr, ggml_type, n, k), ggml_type, k)
    x = np.ascontiguousarray(x)
    native = getattr(ctx.backend, "native", None)
    if native is not None:
        out = np.empty(y.shape, y.dtype)
        native.gemm(x, np.ascontiguousarray(w), out)
        y[:] = out
        return
    y32 = dot_f32(x, w)
    y[:] = y32 if y.dtype == np.float32 else f32_to_bf16(y32)


def _gemm_gguf_twin(ctx, y_ptr, x_ptr, q_ptr, qh_ptr, meta_ptr, m, n, k, ldy, ggml_type,
                    out_fp32: bool) -> None:
    m, n, k, ldy = int(m), int(n), int(k), int(ldy)
    dtype = np.float32 if out_fp32 else np.uint16
    y_count = (m - 1) * ldy + n   # the last row needs only n of its ldy elements
    gemm_at = gguf_rows_at(ctx, q_ptr, qh_ptr, meta_ptr, ggml_type, n, k)
    if gemm_at is not None and gemm_at(   # by address: no numpy views on the decode path
            ctx.write_addr(y_ptr, y_count * np.dtype(dtype).itemsize),
            ctx.read_addr(x_ptr, m * k * 2), m, out_fp32, ldy):
        return
    x = ctx.read(x_ptr, m * k, np.uint16).reshape(m, k)
    y = ctx.view(y_ptr, y_count, dtype)
    rows = np.lib.stride_tricks.as_strided(y, (m, n), (ldy * y.itemsize, y.itemsize))
    gguf_rows_twin(ctx, rows, x, q_ptr, qh_ptr, meta_ptr, ggml_type, n, k)


def _register_twins() -> None:
    for ggml_type in PACKED:
        for name in TILES:
            for fp32 in (False, True):
                twin(module_of(ggml_type), kernel_name(ggml_type, fp32, name))(
                    lambda ctx, y, x, q, qh, meta, m, n, k, ldy, _t=ggml_type, _f=fp32:
                    _gemm_gguf_twin(ctx, y, x, q, qh, meta, m, n, k, ldy, _t, _f))


_register_twins()

__all__ = ["gemm_gguf", "GgufW", "check_gguf", "check_planes", "gguf_rows_at",
           "gguf_rows_twin", "kernel_name", "module_of", "plane_alignment", "NULL"]
