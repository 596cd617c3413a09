"""The dequantizing tensor-core GEMM (kernels/gemm_q.cu, module "gemm_q"): Y[m, n] =
X[m, k] @ dequant(W)[n, k]^T for 4-bit (GPTQ / AWQ, repacked) and float8_e4m3fn weights,
BF16 X, FP32 accumulation, BF16 or FP32 out.

`dequant(W)` is a BF16 matrix (`dequant_q4`, `dequant_fp8`: the formulas in the .cu
header), and the GEMM over it is exactly gemm_tc's, so the twin is `gemm_tc.dot_f32` on the
dequantized bits, computed natively with the dequantization inside the native GEMM's tile
(gpu_runtime/native/gemm_quant.cpp: the same bits, W read as packed) or, without a
compiler, in numpy. A row's result depends on (x row, W row, k) alone: batch invariance as
for BF16, and the same bits as gemm_tc on the dequantized weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument, KernelError
from ..gpu_runtime.types import NULL, DevicePtr
from .bf16 import f32_to_bf16
from .checks import check_ptrs, check_sizes
from .gemm_tc import TILES, dot_f32, resolve_tile
from .registry import twin

MODULE = "gemm_q"
FP8_MAX = 448.0


def e4m3_table() -> np.ndarray:
    """float32 [256]: the value of every float8_e4m3fn code (sign, 4 exponent bits with bias
    7, 3 mantissa bits; exponent 0 subnormal m * 2^-9; 0x7F / 0xFF NaN; no infinities)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e, m = (codes >> 3) & 15, codes & 7
    mag = np.where(e == 0, m * 2.0**-9, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))
    out = (sign * mag).astype(np.float32)
    out[(codes & 0x7F) == 0x7F] = np.nan
    return out


_E4M3 = e4m3_table()


def q4_row_bytes(k: int) -> int:
    """Bytes of one packed 4-bit row: k rounded up to 32 codes (16-byte rows)."""
    return -(-int(k) // 32) * 16


def fp8_row_bytes(k: int) -> int:
    """Bytes of one FP8 row: k rounded up to 32 (whole 32-code blocks)."""
    return -(-int(k) // 32) * 32


def q4_groups_of(n: int, k: int, group_size: int, gidx=None, gidx_row=None) -> np.ndarray:
    """int64 [n, k] (or [1, k] for every row): the group of each (row, input): act-order
    gidx[gidx_row[j], k], else k // group_size."""
    if gidx is not None:
        tables = np.asarray(gidx, np.int64).reshape(-1, k)
        return tables[np.asarray(gidx_row, np.int64)[:n]]
    return (np.arange(k, dtype=np.int64) // int(group_size))[None]


def dequant_q4(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, k: int,
               group_size: int, gidx=None, gidx_row=None) -> np.ndarray:
    """Packed 4-bit W -> BF16 bits [n, k]: w = bf16_rn(f32(q - z) * s), exact before the one
    rounding. q uint32 [n, kp / 8] (code of k at bits 4 (k % 8) of word k // 8), scales
    uint16 FP16 bits [n, groups], zeros uint8 [n, groups]; group of (j, k):
    gidx[gidx_row[j], k] (gidx int32 [parts, k]) or k // group_size."""
    n = q.shape[0]
    shifts = (4 * np.arange(8, dtype=np.uint32))
    codes = ((q[:, :, None] >> shifts) & 15).reshape(n, -1)[:, :k].astype(np.float32)
    g = np.broadcast_to(q4_groups_of(n, k, group_size, gidx, gidx_row), (n, k))
    s = np.take_along_axis(scales.view(np.float16).astype(np.float32), g, axis=1)
    z = np.take_along_axis(zeros.astype(np.float32), g, axis=1)
    return f32_to_bf16((codes - z) * s)


def dequant_fp8(q: np.ndarray, scales: np.ndarray, scale_row: np.ndarray, k: int,
                block_k: int) -> np.ndarray:
    """FP8 W -> BF16 bits [n, k]: w = bf16_rn(f32_rn(e4m3(q) * s)), s =
    scales[scale_row[j], k // block_k]. q uint8 [n, kp], scales float32 [rows, k_blocks]."""
    vals = _E4M3[q[:, :k]]
    s = scales[np.asarray(scale_row, np.int64)][:, np.arange(k) // int(block_k)]
    with np.errstate(over="ignore", invalid="ignore"):
        return f32_to_bf16(vals * s.astype(np.float32))


@dataclass(frozen=True)
class QuantW:
    """A quantized W [n, k] as the fused decode GEMMs take it (ops/gemm_fused.py): fmt "q4"
    with ptrs (q, scales, zeros, gidx, gidx_row) and scalars (groups, group_size), or "fp8"
    with ptrs (q, scales, scale_row) and scalars (k_blocks, block_k): gemm_q4 / gemm_fp8's
    arguments, in their order."""
    fmt: str
    ptrs: tuple
    scalars: tuple
    n: int
    k: int

    def __post_init__(self) -> None:
        if self.fmt not in ("q4", "fp8"):
            raise InvalidArgument(f"QuantW: unknown quantized format {self.fmt!r} (q4, fp8)")

    def check(self, what: str, m: int) -> None:
        """gemm_q4 / gemm_fp8's argument checks for an [m, k] x (InvalidArgument)."""
        check = check_q4 if self.fmt == "q4" else check_fp8
        check(what, m, self.n, self.k, *self.ptrs, *self.scalars)

    def run(self, backend, stream: int, y_ptr, x_ptr, m: int, out_fp32: bool = False,
            tile: str | None = None) -> None:
        """Y[m, n] = X[m, k] @ dequant(W)^T: gemm_q4 / gemm_fp8 with this W."""
        gemm = gemm_q4 if self.fmt == "q4" else gemm_fp8
        gemm(backend, stream, y_ptr, x_ptr, *self.ptrs, m, self.n, self.k, *self.scalars,
             out_fp32=out_fp32, tile=tile)


def check_q4(what: str, m, n, k, q_ptr, scales_ptr, zeros_ptr, gidx_ptr, gidx_row_ptr,
             groups, group_size) -> None:
    """gemm_q4's argument checks (InvalidArgument before any launch)."""
    check_sizes(what, m=m, n=n, k=k, groups=groups)
    check_ptrs(what, scales_ptr=scales_ptr, zeros_ptr=zeros_ptr)
    check_ptrs(what, 16, q_ptr=q_ptr)
    if k % 8:
        raise InvalidArgument(f"{what}: k = {k} must be a multiple of 8 (8 codes a word)")
    if (int(gidx_ptr) == 0) != (int(gidx_row_ptr) == 0):
        raise InvalidArgument(f"{what}: gidx and gidx_row go together (both NULL or neither)")
    if int(gidx_ptr) == 0:
        if group_size < 8 or group_size % 8 or -(-k // group_size) > groups:
            raise InvalidArgument(f"{what}: group_size {group_size} must be a positive "
                                  f"multiple of 8 with ceil(k / group_size) <= groups "
                                  f"({groups})")


def check_fp8(what: str, m, n, k, q_ptr, scales_ptr, scale_row_ptr, k_blocks,
              block_k) -> None:
    """gemm_fp8's argument checks (InvalidArgument before any launch)."""
    check_sizes(what, m=m, n=n, k=k, k_blocks=k_blocks, block_k=block_k)
    check_ptrs(what, scales_ptr=scales_ptr, scale_row_ptr=scale_row_ptr)
    check_ptrs(what, 16, q_ptr=q_ptr)
    if block_k % 8 or k_blocks != -(-k // block_k):
        raise InvalidArgument(f"{what}: block_k {block_k} must be a multiple of 8 and "
                              f"k_blocks ({k_blocks}) = ceil(k / block_k)")


def _threads(tile) -> int:
    """Threads of a tile's CTA: the 16x16 entries are gemm_q_decode.cuh's one-warp tile."""
    return 32 if tile.name == "16x16" else tile.threads


def gemm_q4(backend, stream: int, y_ptr, x_ptr, q_ptr, scales_ptr, zeros_ptr, gidx_ptr,
            gidx_row_ptr, m: int, n: int, k: int, groups: int, group_size: int,
            out_fp32: bool = False, tile: str | None = None) -> None:
    """Y[m, n] = X[m, k] @ dequant_q4(W)[n, k]^T on tensor cores, batch-invariant.

    x: [m, k] bf16; q: uint32 [n, kp / 8] (16-byte aligned); scales: uint16 FP16 [n,
    groups]; zeros: uint8 [n, groups]; act-order: gidx int32 [parts, k] and gidx_row int32
    [n] (row j's groups are gidx[gidx_row[j]]), or both NULL (group k // group_size,
    group_size % 8 == 0); y: [m, n] bf16, or float32 when out_fp32. k % 8 == 0.
    """
    what = "gemm_q4"
    check_ptrs(what, y_ptr=y_ptr, x_ptr=x_ptr)
    check_q4(what, m, n, k, q_ptr, scales_ptr, zeros_ptr, gidx_ptr, gidx_row_ptr, groups,
             group_size)
    t = resolve_tile(m, n, tile, what)
    func = f"gemm_q4_{'fp32' if out_fp32 else 'bf16'}_{t.name}"
    backend.launch(backend.kernel(MODULE, func), t.grid(m, n), (_threads(t),), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(x_ptr), DevicePtr(q_ptr),
                    DevicePtr(scales_ptr), DevicePtr(zeros_ptr), DevicePtr(gidx_ptr),
                    DevicePtr(gidx_row_ptr), np.int32(m), np.int32(n), np.int32(k),
                    np.int32(groups),
                    np.int32(group_size)))


def gemm_fp8(backend, stream: int, y_ptr, x_ptr, q_ptr, scales_ptr, scale_row_ptr,
             m: int, n: int, k: int, k_blocks: int, block_k: int, out_fp32: bool = False,
             tile: str | None = None) -> None:
    """Y[m, n] = X[m, k] @ dequant_fp8(W)[n, k]^T on tensor cores, batch-invariant.

    x: [m, k] bf16; q: uint8 [n, kp] float8_e4m3fn codes (16-byte aligned, kp = k rounded
    up to 32); scales: float32 [rows, k_blocks]; scale_row: int32 [n]; block_k % 8 == 0,
    k_blocks = ceil(k / block_k); y: [m, n] bf16, or float32 when out_fp32.
    """
    what = "gemm_fp8"
    check_ptrs(what, y_ptr=y_ptr, x_ptr=x_ptr)
    check_fp8(what, m, n, k, q_ptr, scales_ptr, scale_row_ptr, k_blocks, block_k)
    t = resolve_tile(m, n, tile, what)
    func = f"gemm_fp8_{'fp32' if out_fp32 else 'bf16'}_{t.name}"
    backend.launch(backend.kernel(MODULE, func), t.grid(m, n), (_threads(t),), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(x_ptr), DevicePtr(q_ptr),
                    DevicePtr(scales_ptr), DevicePtr(scale_row_ptr), np.int32(m),
                    np.int32(n), np.int32(k), np.int32(k_blocks), np.int32(block_k)))


# --------------------------------------------------------------------------- the twins
def _finish(ctx, y: np.ndarray, x_bits, w_bits) -> None:
    native = getattr(ctx.backend, "native", None)
    if native is not None:
        native.gemm(x_bits, np.ascontiguousarray(w_bits), y)
        return
    y32 = dot_f32(x_bits, w_bits)
    y[:] = y32 if y.dtype == np.float32 else f32_to_bf16(y32)


def _plain_rows(x: np.ndarray, y: np.ndarray, n: int, k: int) -> bool:
    """x [m, k] BF16 bits and y [m, n] float32 / BF16 bits, C-contiguous, y writable: what
    the native GEMMs take by address."""
    return (x.dtype == np.uint16 and y.dtype in (np.float32, np.uint16) and
            x.flags.c_contiguous and y.flags.c_contiguous and y.flags.writeable and
            x.ndim == 2 and y.ndim == 2 and x.shape[1] == k and y.shape == (len(x), n))


def _scale_rows(ctx, r_ptr, n: int) -> int:
    """1 + the largest of FP8 W's scale_row [n] (its scales' row count read), checked >= 0."""
    def count() -> int:
        rows = ctx.read(r_ptr, n, np.int32)
        if n and int(rows.min()) < 0:
            raise KernelError(f"gemm_fp8: scale_row at {DevicePtr(r_ptr)!r} holds a negative "
                              "row")
        return int(rows.max()) + 1 if n else 0
    cached = ctx.backend.converted(r_ptr, n * 4, "gemm_q.scale_rows", count, 8)
    return count() if cached is None else cached


def q4_rows_at(ctx, q_ptr, s_ptr, z_ptr, g_ptr, n: int, k: int, groups: int, gs: int):
    """gemm(y_addr, x_addr, m, out_fp32=False): q4_rows_twin on host rows given by address
    (x [m, k] BF16 bits, y [m, n] BF16 bits or float32, both checked by the caller), W's
    ranges checked here; None where the native library does not take it (no library,
    act-order)."""
    native = getattr(ctx.backend, "native", None)
    if native is None or int(g_ptr) != 0:
        return None
    w = (ctx.read_addr(q_ptr, n * q4_row_bytes(k)), ctx.read_addr(s_ptr, n * groups * 2),
         ctx.read_addr(z_ptr, n * groups))
    return lambda y_addr, x_addr, m, out_fp32=False: native.gemm_q4_at(
        x_addr, *w, m, n, k, groups, gs, y_addr, out_fp32)


def fp8_rows_at(ctx, q_ptr, s_ptr, r_ptr, n: int, k: int, kb: int, bk: int):
    """As q4_rows_at for FP8 W (scale_row checked as fp8_rows_twin checks it)."""
    native = getattr(ctx.backend, "native", None)
    if native is None:
        return None
    n_rows = _scale_rows(ctx, r_ptr, n)
    w = (ctx.read_addr(q_ptr, n * fp8_row_bytes(k)), ctx.read_addr(s_ptr, n_rows * kb * 4),
         ctx.read_addr(r_ptr, n * 4))
    return lambda y_addr, x_addr, m, out_fp32=False: native.gemm_fp8_at(
        x_addr, *w, m, n, k, kb, bk, y_addr, out_fp32)


def _rows_by_address(gemm_at, y: np.ndarray, x: np.ndarray, n: int, k: int) -> bool:
    """gemm_at (q4_rows_at's or fp8_rows_at's, or None) on host arrays x and y where the
    native library takes them by address (the decode step's ~100 GEMMs: no views); False
    where it does not, having done nothing."""
    if gemm_at is None or not _plain_rows(x, y, n, k):
        return False
    gemm_at(y.ctypes.data, x.ctypes.data, len(x), y.dtype == np.float32)
    return True


def q4_rows_twin(ctx, y: np.ndarray, x: np.ndarray, q_ptr, s_ptr, z_ptr, g_ptr, gr_ptr,
                 n: int, k: int, groups: int, gs: int) -> None:
    """y [m, n] (float32, or uint16 BF16 bits) = x [m, k] (BF16 bits, any host array) @
    dequant_q4(W)^T, W's data at device addresses: the twin's arithmetic, also the GEMM
    step of the fused decode twins (ops/gemm_fused.py)."""
    if _rows_by_address(q4_rows_at(ctx, q_ptr, s_ptr, z_ptr, g_ptr, n, k, groups, gs), y, x,
                        n, k):
        return
    words = q4_row_bytes(k) // 4
    native = getattr(ctx.backend, "native", None)
    q = ctx.read(q_ptr, n * words, np.uint32).reshape(n, words)
    s = ctx.read(s_ptr, n * groups, np.uint16).reshape(n, groups)
    z = ctx.read(z_ptr, n * groups, np.uint8).reshape(n, groups)
    g = rows = None
    if int(g_ptr) != 0:
        rows = ctx.read(gr_ptr, n, np.int32)
        g = ctx.read(g_ptr, (int(rows.max()) + 1) * k, np.int32).reshape(-1, k)
    x = np.ascontiguousarray(x)
    if native is not None and hasattr(native, "gemm_q4"):
        native.gemm_q4(x, q, s, z, g, rows, k, gs, y)
        return
    _finish(ctx, y, x, dequant_q4(q, s, z, k, gs, g, rows))


def fp8_rows_twin(ctx, y: np.ndarray, x: np.ndarray, q_ptr, s_ptr, r_ptr, n: int, k: int,
                  kb: int, bk: int) -> None:
    """As q4_rows_twin for FP8 W (dequant_fp8)."""
    if _rows_by_address(fp8_rows_at(ctx, q_ptr, s_ptr, r_ptr, n, k, kb, bk), y, x, n, k):
        return
    kp = fp8_row_bytes(k)
    # scale_row's largest row (it bounds the scales read), cached with the allocation's
    # conversions (dropped when scale_row is written); a negative row refused
    n_rows = _scale_rows(ctx, r_ptr, n)
    native = getattr(ctx.backend, "native", None)
    q = ctx.read(q_ptr, n * kp, np.uint8).reshape(n, kp)
    rows = ctx.read(r_ptr, n, np.int32)
    s = ctx.read(s_ptr, n_rows * kb, np.float32).reshape(n_rows, kb)
    x = np.ascontiguousarray(x)
    if native is not None and hasattr(native, "gemm_fp8"):
        native.gemm_fp8(x, q, s, rows, k, bk, y)
        return
    _finish(ctx, y, x, dequant_fp8(q, s, rows, k, bk))


def _out(ctx, y_ptr, m: int, n: int, out_fp32: bool) -> np.ndarray:
    return ctx.view(y_ptr, m * n, np.float32 if out_fp32 else np.uint16).reshape(m, n)


def _gemm_q4_twin(ctx, y_ptr, x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, gr_ptr, m, n, k, groups,
                  gs, out_fp32: bool) -> None:
    m, n, k = int(m), int(n), int(k)
    x = ctx.read(x_ptr, m * k, np.uint16).reshape(m, k)
    q4_rows_twin(ctx, _out(ctx, y_ptr, m, n, out_fp32), x, q_ptr, s_ptr, z_ptr, g_ptr,
                 gr_ptr, n, k, int(groups), int(gs))


def _gemm_fp8_twin(ctx, y_ptr, x_ptr, q_ptr, s_ptr, r_ptr, m, n, k, k_blocks, block_k,
                   out_fp32: bool) -> None:
    m, n, k = int(m), int(n), int(k)
    x = ctx.read(x_ptr, m * k, np.uint16).reshape(m, k)
    fp8_rows_twin(ctx, _out(ctx, y_ptr, m, n, out_fp32), x, q_ptr, s_ptr, r_ptr, n, k,
                  int(k_blocks), int(block_k))


def _register_twins() -> None:
    for name in TILES:
        for out, fp32 in (("bf16", False), ("fp32", True)):
            twin(MODULE, f"gemm_q4_{out}_{name}")(
                lambda ctx, y, x, q, s, z, g, grow, m, n, k, gr, gs, _f=fp32:
                _gemm_q4_twin(ctx, y, x, q, s, z, g, grow, m, n, k, gr, gs, _f))
            twin(MODULE, f"gemm_fp8_{out}_{name}")(
                lambda ctx, y, x, q, s, r, m, n, k, kb, bk, _f=fp32:
                _gemm_fp8_twin(ctx, y, x, q, s, r, m, n, k, kb, bk, _f))


_register_twins()

__all__ = ["gemm_q4", "gemm_fp8", "QuantW", "check_q4", "check_fp8", "q4_rows_twin",
           "fp8_rows_twin", "dequant_q4", "dequant_fp8", "e4m3_table", "NULL",
           "q4_row_bytes", "fp8_row_bytes", "FP8_MAX"]
