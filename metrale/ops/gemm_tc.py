"""The batch-invariant tensor-core GEMM (kernels/gemm_tc.cu, module "gemm_tc"): every linear
layer of decode, verify and prefill, Y[m, n] = X[m, k] @ W[n, k]^T, BF16 in, FP32
accumulation, BF16 or FP32 out.

A row's result depends only on (x row, w row, k), never on m, its position in the batch or
the tile the launcher picks (the argument is in the .cu header), so decode_batch rows equal
solo decode, verify rows equal decode steps and chunked prefill equals whole prefill.

The twin is batch-invariant by construction: every element is a float32 sum of the exact
products of its two rows in one fixed order that depends on k alone, subnormals flushed
(`dot_f32`: what the CPU's BF16 dot-product instruction computes), computed by the native
library (gpu_runtime/native.py) or, without a C++ compiler, by numpy, with the same bits;
no BLAS is involved, so no blocking, thread split or row position can reach the result.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "gemm_tc"
_MAX_GRID_Y = 65535
# The 128x128 tile only when it still gives this many CTAs (about one per SM on an H200);
# below that the 64x32 tile's 8x more CTAs keep more SMs streaming W. The EmuBackend's
# counters (check-kernels --profile) put the 64x32 tile's prefill GEMMs at ~4x more
# shared-memory wavefronts (ldmatrix + cp.async) per tensor-core FLOP than 128x128's: at
# 128-255 CTAs the big tile is the faster one by the estimate (it was 256 before).
_BIG_TILE_MIN_CTAS = 128
# The numpy twin's working set: about this many float64 temporaries per column chunk
# (chunking never changes a result: each element is computed from its two rows alone).
_CHUNK_ELEMS = 1 << 22


@dataclass(frozen=True)
class Tile:
    """One CTA tile configuration of kernels/gemm_tc.cu (its header has the table)."""
    name: str
    bm: int
    bn: int
    threads: int

    def grid(self, m: int, n: int) -> tuple[int, int]:
        return -(-int(m) // self.bm), -(-int(n) // self.bn)


TILES = {t.name: t for t in (Tile("16x16", 16, 16, 64), Tile("64x32", 64, 32, 128),
                             Tile("128x128", 128, 128, 256))}


def pick_tile(m: int, n: int) -> Tile:
    """The tile for an (m, n) launch: speed only, every tile gives the same bits.

    m <= 16 (decode): 16x16, n / 16 CTAs streaming W. Up to 64 rows, or while the big tile
    would leave the GPU short of CTAs: 64x32. Prefill-sized launches: 128x128.
    """
    if m <= 16:
        tile = TILES["16x16"]
    elif m > 64 and math.prod(TILES["128x128"].grid(m, n)) >= _BIG_TILE_MIN_CTAS:
        tile = TILES["128x128"]
    else:
        tile = TILES["64x32"]
    if tile.grid(m, n)[1] > _MAX_GRID_Y:  # only for n > 1M: the widest tile still fits
        tile = TILES["128x128"]
    return tile


def resolve_tile(m: int, n: int, tile: str | None, what: str) -> Tile:
    """`tile` (a name of TILES) or pick_tile's choice; InvalidArgument for an unknown name or
    a grid past the grid.y limit."""
    if tile is None:
        t = pick_tile(m, n)
    elif tile in TILES:
        t = TILES[tile]
    else:
        raise InvalidArgument(f"{what}: tile {tile!r} is not one of {sorted(TILES)}")
    if t.grid(m, n)[1] > _MAX_GRID_Y:
        raise InvalidArgument(f"{what}: n = {n} exceeds {_MAX_GRID_Y * t.bn} for tile "
                              f"{t.name} (grid.y limit)")
    return t


def gemm_tc(backend, stream: int, y_ptr, x_ptr, w_ptr, m: int, n: int, k: int,
            out_fp32: bool = False, tile: str | None = None) -> None:
    """Y[m, n] = X[m, k] @ W[n, k]^T on tensor cores, batch-invariant.

    x: [m, k] bf16; w: [n, k] bf16; y: [m, n] bf16, or float32 when out_fp32. Any m, n,
    k >= 1 and any alignment (16-byte-aligned x, w with k % 8 == 0 take the cp.async path).
    `tile` forces a configuration of TILES (tests, benchmarks); by default pick_tile.
    """
    check_sizes("gemm_tc", m=m, n=n, k=k)
    check_ptrs("gemm_tc", y_ptr=y_ptr, x_ptr=x_ptr, w_ptr=w_ptr)
    t = resolve_tile(m, n, tile, "gemm_tc")
    grid = t.grid(m, n)
    func = f"gemm_tc_{'fp32' if out_fp32 else 'bf16'}_{t.name}"
    backend.launch(backend.kernel(MODULE, func), grid, (t.threads,), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(x_ptr), DevicePtr(w_ptr), np.int32(m),
                    np.int32(n), np.int32(k)))


def dot_f32(x_bits: np.ndarray, w_bits: np.ndarray, native=None,
            w_f64: np.ndarray | None = None) -> np.ndarray:
    """x_bits [m, k], w_bits [n, k] uint16 BF16 -> float32 [m, n], the twin's definition:

    per element, a BF16 subnormal input counts as 0 and both rows are zero-padded to k32
    (k rounded up to a multiple of 32); 16 float32 lanes, and for each block of 32
    positions in order, lane l adds the product at 32b + 2l + 1, then the one at 32b + 2l,
    each step one rounding of (lane + exact product), a result that is tiny after rounding
    (below 2^-126 when rounded to 24 bits with an unbounded exponent) flushed to 0; then
    lanes l + (l + 8), + (l + 4), + (l + 2), (0) + (1), in float32, flushed alike; + 0 (an
    exact zero is +0, as the kernel's accumulator gives); a NaN is the canonical
    0x7FC00000. That is what the CPU's BF16 dot-product instruction (VDPBF16PS) computes,
    so the native library runs it at that instruction's rate. The order depends on k
    alone, so a row's result is a function of its two rows: batch invariance by
    construction. FP32 accumulation like the kernel's (whose tensor-core order differs: the
    GPU tests compare within the table's bound). `native` (gpu_runtime/native.py) computes
    the same bits fast; `w_f64`: W already in step order (`widen_steps`) for the numpy
    path (the backend's cache).
    """
    if native is not None:
        x_bits, w_bits = np.ascontiguousarray(x_bits), np.ascontiguousarray(w_bits)
        return native.gemm(x_bits, w_bits, np.empty((len(x_bits), len(w_bits)), np.float32))
    m, k = x_bits.shape
    n = w_bits.shape[0]
    steps = 2 * -(-k // 32)
    x = widen_steps(x_bits).reshape(m, 1, steps, 16)
    y = np.empty((m, n), np.float32)
    step = max(1, _CHUNK_ELEMS // (16 * m))   # columns per chunk: temporaries ~ 2^22
    for j0 in range(0, n, step):
        w = (w_f64[j0:j0 + step] if w_f64 is not None else
             widen_steps(w_bits[j0:j0 + step]))
        w = w.reshape(1, len(w), steps, 16)
        acc = np.zeros((m, w.shape[1], 16), np.float32)
        tmp = np.empty(acc.shape, np.float64)
        tiny = np.empty(acc.shape, bool)
        with np.errstate(over="ignore", invalid="ignore"):   # Inf and NaN as IEEE says
            for s in range(steps):
                # the product is exact in float64 and so is adding it to a float32 lane
                # unless the two are over 2^36 apart, when both roundings give the larger
                # one: the float32 rounding of tmp is the one rounding the formula asks for.
                # Near 2^-126 the sum is exact, so comparing it with the point from which it
                # rounds up to 2^-126 is the formula's tininess test.
                np.multiply(x[:, :, s], w[:, :, s], out=tmp)
                tmp += acc
                np.less(np.abs(tmp), _TINY_BELOW, out=tiny)
                tmp[tiny] = 0.0
                acc[...] = tmp
            a = _flush(acc[..., :8] + acc[..., 8:])   # sums of normals: exact when tiny
            a = _flush(a[..., :4] + a[..., 4:])
            a = _flush(a[..., :2] + a[..., 2:])
            y[:, j0:j0 + step] = _flush(a[..., 0] + a[..., 1]) + np.float32(0.0)
    y[np.isnan(y)] = np.uint32(0x7FC00000).view(np.float32)
    return y


# |sum| below this rounds (24 bits, unbounded exponent) to below 2^-126: flushed
_TINY_BELOW = 2.0**-126 - 2.0**-151
_MIN_NORMAL = np.float32(2.0**-126)


def _flush(a: np.ndarray) -> np.ndarray:
    """float32 a with |a| < 2^-126 set to +0, in place; returns a."""
    a[np.abs(a) < _MIN_NORMAL] = 0.0
    return a


def widen_steps(bits: np.ndarray) -> np.ndarray:
    """BF16 bits [r, k] -> float64 [r, k32] in the formula's step order: per block of 32
    positions its 16 odd ones, then its 16 even ones; subnormals as 0, zero-padded."""
    r, k = bits.shape
    nb = -(-k // 32)
    padded = np.zeros((r, nb * 32), np.uint16)
    padded[:, :k] = np.where((bits & 0x7F80) == 0, 0, bits)
    pairs = padded.reshape(r, nb, 16, 2)[..., ::-1]   # [r, block, lane, (odd, even)]
    return bf16_to_f32(np.ascontiguousarray(pairs.transpose(0, 1, 3, 2))).reshape(
        r, nb * 32).astype(np.float64)


def _gemm_tc_twin(ctx, y_ptr, x_ptr, w_ptr, m, n, k, out_fp32: bool) -> None:
    m, n, k = int(m), int(n), int(k)
    x_bits = ctx.read(x_ptr, m * k, np.uint16).reshape(m, k)
    y = ctx.view(y_ptr, m * n, np.float32 if out_fp32 else np.uint16).reshape(m, n)
    gemm_rows_twin(ctx, y, x_bits, w_ptr, n, k)


def gemm_rows_twin(ctx, y: np.ndarray, x_bits: np.ndarray, w_ptr, n: int, k: int) -> None:
    """The twin's arithmetic: y [m, n] (float32, or uint16 BF16 bits: rounded) = x_bits
    [m, k] (BF16 bits, any host array) @ W[n, k]^T, W at device address w_ptr; also the
    GEMM step of the fused decode twins (ops/gemm_fused.py)."""
    w_bits = ctx.read(w_ptr, n * k, np.uint16).reshape(n, k)
    be = ctx.backend
    native = getattr(be, "native", None)
    if native is not None:   # straight into y, BF16 rounding included
        native.gemm(np.ascontiguousarray(x_bits), w_bits, y)
        return
    cached = getattr(be, "converted", None)   # numpy: W widened once, within the budget
    w_f64 = None if cached is None else cached(
        w_ptr, n * k * 2, "gemm_tc.f64", lambda: widen_steps(w_bits),
        8 * n * (-(-k // 32) * 32))
    y32 = dot_f32(x_bits, w_bits, None, w_f64)
    y[:] = y32 if y.dtype == np.float32 else f32_to_bf16(y32)


def gemm_rows_at(ctx, w_ptr, n: int, k: int):
    """gemm(y_addr, x_addr, m): gemm_rows_twin on host rows given by address (x [m, k] BF16
    bits, y [m, n] BF16 bits, checked by the caller), W's range checked here; None without
    the native library."""
    native = getattr(ctx.backend, "native", None)
    if native is None:
        return None
    w_addr = ctx.read_addr(w_ptr, n * k * 2)
    return lambda y_addr, x_addr, m: native.gemm_at(x_addr, w_addr, m, n, k, y_addr, False)


def _register_twins() -> None:
    for name in TILES:
        twin(MODULE, f"gemm_tc_bf16_{name}")(
            lambda ctx, y, x, w, m, n, k: _gemm_tc_twin(ctx, y, x, w, m, n, k, False))
        twin(MODULE, f"gemm_tc_fp32_{name}")(
            lambda ctx, y, x, w, m, n, k: _gemm_tc_twin(ctx, y, x, w, m, n, k, True))


_register_twins()
