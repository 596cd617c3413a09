"""The batch-invariant tensor-core GEMM (kernels/gemm_tc.cu, module "gemm_tc"): every linear
layer of decode, verify and prefill, Y[m, n] = X[m, k] @ W[n, k]^T, BF16 in, FP32
accumulation, BF16 or FP32 out.

A row's result depends only on (x row, w row, k), never on m, its position in the batch or
the tile the launcher picks (the argument is in the .cu header), so decode_batch rows equal
solo decode, verify rows equal decode steps and chunked prefill equals whole prefill.

The twin is batch-invariant by construction: every element is the float32 rounding of a
float64 sum, in a fixed order, of the exact products of its two rows (pairwise_dot_f32;
for typical rows that sum is exact), found through one float64 matmul and rigorous
exactness / error bounds, so no BLAS blocking, thread split or row position can reach the
result.
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
# The 128x128 tile only when it still gives this many CTAs (about two per SM on an H200);
# below that the 64x32 tile's 8x more CTAs keep more SMs streaming W.
_BIG_TILE_MIN_CTAS = 256
# Twin working set: W is widened to float64 in chunks of about this many elements (rows per
# chunk depend only on k; chunking never changes a result, see pairwise_dot_f32).
_CHUNK_ELEMS = 1 << 22
# With the native library: up to this many rows of X its own loops (which read the BF16
# weights once) are the fast way; above it a float64 BLAS matmul over the cached float64
# W, with the native rounding test and G at the elements the test leaves unsure.
NATIVE_ROWS = 16


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


def gemm_tc(backend, stream: int, y_ptr, x_ptr, w_ptr, m: int, n: int, k: int,
            out_fp32: bool = False, tile: str | None = None) -> None:
    """Y[m, n] = X[m, k] @ W[n, k]^T on tensor cores, batch-invariant.

    x: [m, k] bf16; w: [n, k] bf16; y: [m, n] bf16, or float32 when out_fp32. Any m, n,
    k >= 1 and any alignment (16-byte-aligned x, w with k % 8 == 0 take the cp.async path).
    `tile` forces a configuration of TILES (tests, benchmarks); by default pick_tile.
    """
    check_sizes("gemm_tc", m=m, n=n, k=k)
    check_ptrs("gemm_tc", y_ptr=y_ptr, x_ptr=x_ptr, w_ptr=w_ptr)
    if tile is None:
        t = pick_tile(m, n)
    elif tile in TILES:
        t = TILES[tile]
    else:
        raise InvalidArgument(f"gemm_tc: tile {tile!r} is not one of {sorted(TILES)}")
    grid = t.grid(m, n)
    if grid[1] > _MAX_GRID_Y:
        raise InvalidArgument(f"gemm_tc: n = {n} exceeds {_MAX_GRID_Y * t.bn} for tile "
                              f"{t.name} (grid.y limit)")
    func = f"gemm_tc_{'fp32' if out_fp32 else 'bf16'}_{t.name}"
    backend.launch(backend.kernel(MODULE, func), grid, (t.threads,), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(x_ptr), DevicePtr(w_ptr), np.int32(m),
                    np.int32(n), np.int32(k)))


def _grid_magnitude(bits: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Per row of BF16 bits [r, k]: |row|_2 / 2^lsb, where every element of the row is an
    integer multiple of 2^lsb (a BF16 value with exponent field E >= 1 is M 2^(E - 134),
    M < 256; subnormals (E = 0) M 2^-133). All-zero rows give 0."""
    exp_field = np.where(bits & 0x7FFF, bits & 0x7F80, 0x7F80).min(axis=1) >> 7
    return np.ldexp(norms, 134 - np.maximum(exp_field, 1).astype(np.int32))


def row_stats(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BF16 bits [r, k] -> (norm, mag) float64 [r]: each row's 2-norm and grid magnitude
    (`_grid_magnitude`), what the exactness and error-bound tests of pairwise_dot_f32 use."""
    r, k = bits.shape
    norm, mag = np.empty(r), np.empty(r)
    step = max(1, _CHUNK_ELEMS // k)
    for j0 in range(0, r, step):
        b = bits[j0:j0 + step]
        f = bf16_to_f32(b).astype(np.float64)
        norm[j0:j0 + step] = np.sqrt(np.einsum("jk,jk->j", f, f))
        mag[j0:j0 + step] = _grid_magnitude(b, norm[j0:j0 + step])
    return norm, mag


@dataclass
class WeightSide:
    """What the twin may use besides the bits of W: per-row (norm, mag) of W, the whole W
    as float64 [n, k] (None: widened slice by slice into `scratch`, a reused buffer), the
    native library (gpu_runtime/native.py; None: numpy only)."""
    stats: tuple | None = None
    f64: np.ndarray | None = None
    native: object = None
    scratch: object = None


def pairwise_dot_f32(x_bits: np.ndarray, w_bits: np.ndarray,
                     side: WeightSide | None = None) -> np.ndarray:
    """x_bits [m, k], w_bits [n, k] uint16 BF16 -> float32 [m, n]: f32(G(x[i], w[j])).

    G is numpy's float64 sum of the k exact products x[i, :] * w[j, :] (BF16 x BF16 is exact
    in float64) along a contiguous row: pairwise summation in a fixed order that depends
    only on k, so G is a function of the two rows alone. Computing G for every element is
    slow in numpy, so a float64 sum s in some other order (one float64 matmul) stands in
    for it wherever f32(s) = f32(G) is certain:
    * exact: every product is an integer multiple of 2^(lsb_x + lsb_w) and every partial sum
      is at most |x| |w| (Cauchy-Schwarz) in magnitude; when that is <= 2^52 such units,
      every partial sum in any order is exact, so s = G = the exact sum (typical rows);
    * otherwise |s - exact| <= (k - 1) 2^-53 sum|p| <= (k - 1) 2^-53 |x| |w|, and G is as
      close; with a 4x margin e bounds both, so where s - e and s + e round to the same
      float32 every value in between does, G included.
    Only the remaining elements (none with a NaN/Inf) evaluate G. +0.0 makes an exact zero
    +0, as the kernel's accumulator (which starts at +0) gives. `side` only changes the
    speed. The native library evaluates G itself, in numpy's order
    (gpu_runtime/native/exact_dot.cpp): for every element when there is no float64 W or
    few rows (decode: it reads the BF16 weights once), else for the unsure elements of the
    float64-matmul path, whose rounding and test it also does.
    """
    side = side or WeightSide()
    m, k = x_bits.shape
    n = w_bits.shape[0]
    native = side.native
    if native is not None:
        x_bits, w_bits = np.ascontiguousarray(x_bits), np.ascontiguousarray(w_bits)
        if side.f64 is None or m <= NATIVE_ROWS:
            return native.pairwise_dot(x_bits, w_bits)
    x_stats = row_stats(x_bits)
    w_stats = side.stats if side.stats is not None else row_stats(w_bits)
    x = bf16_to_f32(x_bits).astype(np.float64)
    x_norm, x_mag = x_stats
    y = np.empty((m, n), np.float32)
    step = max(1, _CHUNK_ELEMS // k)
    for j0 in range(0, n, step):
        w = _widened(w_bits, side, j0, step)
        w_norm, w_mag = w_stats[0][j0:j0 + step], w_stats[1][j0:j0 + step]
        s = x @ w.T + 0.0
        if native is not None:
            yc, flat = native.round_certified(s, k, x_stats, (w_norm, w_mag))
            if len(flat):
                ii, jj = np.divmod(flat, s.shape[1])
                yc[ii, jj] = native.pairwise_at(x_bits, w_bits[j0:j0 + step], ii, jj)
            y[:, j0:j0 + step] = yc
            continue
        yc = s.astype(np.float32)
        if x_mag.max() * w_mag.max() > 2.0**52:  # else every element is exact
            inexact = np.outer(x_mag, w_mag) > 2.0**52
            e = (k + 4) * 2.0**-51 * np.outer(x_norm, w_norm) + np.abs(s) * 2.0**-51
            with np.errstate(invalid="ignore"):  # inf - inf where a row holds an Inf
                unsure = (s - e).astype(np.float32) != (s + e).astype(np.float32)
            ii, jj = np.nonzero(unsure & inexact & np.isfinite(s))
            if len(ii):
                _row_sums_at(yc, (ii, jj), x_bits, w_bits[j0:j0 + step], x, w)
        y[:, j0:j0 + step] = yc
    return y


def _widened(w_bits, side: WeightSide, j0: int, step: int) -> np.ndarray:
    """Rows [j0, j0 + step) of W as float64: from the cached whole, else widened into the
    scratch buffer (the same slicing for every m)."""
    if side.f64 is not None:
        return side.f64[j0:j0 + step]
    wb = w_bits[j0:j0 + step]
    if side.scratch is None:
        return bf16_to_f32(wb).astype(np.float64)
    out = side.scratch(wb.size).reshape(wb.shape)
    np.copyto(out, bf16_to_f32(wb))
    return out


def _row_sums_at(y, where, x_bits, w_bits, x=None, w=None) -> None:
    """y[i, j] = f32(G(x[i], w[j])) at the elements `where` = (ii, jj): numpy's pairwise
    float64 row sum of the exact products. x, w: float64 rows when the caller has them."""
    ii, jj = where
    step = max(1, _CHUNK_ELEMS // x_bits.shape[1])
    for u0 in range(0, len(ii), step):
        i, j = ii[u0:u0 + step], jj[u0:u0 + step]
        xi = x[i] if x is not None else bf16_to_f32(x_bits[i]).astype(np.float64)
        wj = w[j] if w is not None else bf16_to_f32(w_bits[j]).astype(np.float64)
        y[i, j] = (np.sum(xi * wj, axis=1) + 0.0).astype(np.float32)


def twin_weight_side(ctx, w_ptr, w_bits: np.ndarray, m: int) -> WeightSide:
    """W's statistics (always cached) and its float64 copy when the backend's conversion
    budget admits it (else widened slice by slice into the cache's scratch buffer), and
    the native library. With the native library and at most NATIVE_ROWS rows of X, or
    beyond the budget, nothing is converted (it reads the BF16 weights itself)."""
    be = ctx.backend
    native = getattr(be, "native", None)
    cached = getattr(be, "converted", None)
    if cached is None or (native is not None and m <= NATIVE_ROWS):
        return WeightSide(native=native)
    n, k = w_bits.shape
    f64 = cached(w_ptr, n * k * 2, "gemm_tc.f64", lambda: _widen_all(w_bits), 8 * n * k)
    if native is not None and f64 is None:
        return WeightSide(native=native)
    stats = cached(w_ptr, n * k * 2, "gemm_tc.row_stats", lambda: row_stats(w_bits),
                   16 * n, always=True)
    return WeightSide(stats=stats, f64=f64, native=native, scratch=be.convert_cache.scratch)


def _widen_all(w_bits) -> np.ndarray:
    out = np.empty(w_bits.shape, np.float64)
    step = max(1, _CHUNK_ELEMS // w_bits.shape[1])
    for j0 in range(0, w_bits.shape[0], step):
        np.copyto(out[j0:j0 + step], bf16_to_f32(w_bits[j0:j0 + step]))
    return out


def _gemm_tc_twin(ctx, y_ptr, x_ptr, w_ptr, m, n, k, out_fp32: bool) -> None:
    m, n, k = int(m), int(n), int(k)
    x_bits = ctx.read(x_ptr, m * k, np.uint16).reshape(m, k)
    w_bits = ctx.read(w_ptr, n * k, np.uint16).reshape(n, k)
    y = pairwise_dot_f32(x_bits, w_bits, twin_weight_side(ctx, w_ptr, w_bits, m))
    if out_fp32:
        ctx.view(y_ptr, m * n, np.float32).reshape(m, n)[:] = y
    else:
        ctx.view(y_ptr, m * n, np.uint16).reshape(m, n)[:] = f32_to_bf16(y)


def _register_twins() -> None:
    for name in TILES:
        twin(MODULE, f"gemm_tc_bf16_{name}")(
            lambda ctx, y, x, w, m, n, k: _gemm_tc_twin(ctx, y, x, w, m, n, k, False))
        twin(MODULE, f"gemm_tc_fp32_{name}")(
            lambda ctx, y, x, w, m, n, k: _gemm_tc_twin(ctx, y, x, w, m, n, k, True))


_register_twins()
