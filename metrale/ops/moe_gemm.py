"""The grouped tensor-core GEMM over routed experts (kernels/moe_gemm.cu, module
"moe_gemm"): y[p] = x[p / row_div] @ W[e]^T for every pair p in expert e's row list.

Each element is gemm_tc's (the same k16 MMA steps in the same order), so the twin is
gemm_tc's twin applied expert by expert: `dot_f32` of the gathered rows against W[e],
computed by HostBackend's native GEMM (the CPU path's expert compute) or numpy. A row's
bits depend on (x row, W[e] row, k) only: not on the tile, the other rows of its expert or
the batch.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .bf16 import f32_to_bf16
from .checks import check_ptrs, check_sizes
from . import gemm_tc
from .gemm_tc import Tile, dot_f32, widen_steps
from .moe_router import MAX_EXPERTS
from .registry import twin

MODULE = "moe_gemm"
_MAX_GRID_Y = 65535


# kernels/moe_gemm.cu has gemm_tc.cu's three tile configurations (same names and sizes)
TILES = gemm_tc.TILES


def pick_tile(n_pairs: int, num_experts: int) -> Tile:
    """The tile for a launch of n_pairs rows over num_experts experts (speed only: every
    tile gives the same bits). By the mean rows per hit expert, assuming all are hit:
    <= 16 (decode, small batches) the 16-row tile streams each expert's W once; up to 64
    the 64x32; beyond (prefill) the 128x128."""
    rows = int(n_pairs) / max(1, min(int(num_experts), int(n_pairs)))
    if rows <= 16:
        return TILES["16x16"]
    return TILES["64x32"] if rows <= 64 else TILES["128x128"]


def max_tiles(n_pairs: int, num_experts: int, bm: int) -> int:
    """An upper bound of sum_e ceil(count_e / bm) over any routing of n_pairs pairs: the
    grid's x size (moe_route counts the real tiles on the device)."""
    hit = min(int(num_experts), int(n_pairs))
    return (int(n_pairs) + hit * (bm - 1)) // bm


def moe_gemm(backend, stream: int, y_ptr, x_ptr, w_ptr, sorted_pairs_ptr, expert_offsets_ptr,
             tile_offsets_ptr, n_pairs: int, num_experts: int, n: int, k: int, row_div: int,
             out_fp32: bool = False, tile: str = "16x16") -> None:
    """Y[p] = X[p // row_div] @ W[e]^T for the pairs of every expert e (moe_route's lists).

    x: bf16 [*, k]; w: bf16 [num_experts, n, k]; y: [n_pairs, n] bf16 or float32 (out_fp32);
    sorted_pairs int32 [n_pairs]; expert_offsets, tile_offsets int32 [num_experts + 1], the
    latter from moe_route with block_m = TILES[tile].bm (the tile must be the one routed
    for). n_pairs sizes the grid.
    """
    check_sizes("moe_gemm", n_pairs=n_pairs, n=n, k=k, row_div=row_div)
    if not 1 <= int(num_experts) <= MAX_EXPERTS:
        raise InvalidArgument(f"moe_gemm: num_experts must be in [1, {MAX_EXPERTS}], got "
                              f"{num_experts}")
    if int(num_experts) * int(n) * int(k) >= 2**40:
        raise InvalidArgument("moe_gemm: the expert weights exceed 2^40 elements")
    check_ptrs("moe_gemm", y_ptr=y_ptr, x_ptr=x_ptr, w_ptr=w_ptr,
               sorted_pairs_ptr=sorted_pairs_ptr, expert_offsets_ptr=expert_offsets_ptr,
               tile_offsets_ptr=tile_offsets_ptr)
    if tile not in TILES:
        raise InvalidArgument(f"moe_gemm: tile {tile!r} is not one of {sorted(TILES)}")
    t = TILES[tile]
    grid = (max_tiles(n_pairs, num_experts, t.bm), -(-int(n) // t.bn))
    if grid[1] > _MAX_GRID_Y:
        raise InvalidArgument(f"moe_gemm: n = {n} exceeds {_MAX_GRID_Y * t.bn} for tile "
                              f"{t.name} (grid.y limit)")
    func = f"moe_gemm_{'fp32' if out_fp32 else 'bf16'}_{t.name}"
    backend.launch(backend.kernel(MODULE, func), grid, (t.threads,), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(x_ptr), DevicePtr(w_ptr),
                    DevicePtr(sorted_pairs_ptr), DevicePtr(expert_offsets_ptr),
                    DevicePtr(tile_offsets_ptr), np.int32(num_experts), np.int32(n),
                    np.int32(k), np.int32(row_div)))


def _moe_gemm_twin(ctx, y_ptr, x_ptr, w_ptr, pairs_ptr, offsets_ptr, tiles_ptr, num_experts,
                   n, k, row_div, out_fp32: bool) -> None:
    E, n, k, div = int(num_experts), int(n), int(k), int(row_div)
    offsets = ctx.read(offsets_ptr, E + 1, np.int32).astype(np.int64)
    total = int(offsets[E])
    if total == 0:
        return
    pairs = ctx.read(pairs_ptr, total, np.int32).astype(np.int64)
    x_rows = int((pairs // div).max()) + 1
    x_bits = ctx.read(x_ptr, x_rows * k, np.uint16).reshape(x_rows, k)
    w_all = ctx.read(w_ptr, E * n * k, np.uint16).reshape(E, n, k)
    y = ctx.view(y_ptr, (int(pairs.max()) + 1) * n,
                 np.float32 if out_fp32 else np.uint16).reshape(-1, n)
    be = ctx.backend
    native = getattr(be, "native", None)
    cached = getattr(be, "converted", None)
    for e in range(E):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if lo == hi:
            continue
        rows = pairs[lo:hi]
        xg = np.ascontiguousarray(x_bits[rows // div])
        if native is not None:
            out = np.empty((hi - lo, n), np.float32 if out_fp32 else np.uint16)
            native.gemm(xg, w_all[e], out)
        else:   # numpy: each expert's W widened once, within the backend's cache budget
            we = w_all[e]
            w_f64 = None if cached is None else cached(
                DevicePtr(w_ptr).offset(e * n * k * 2), n * k * 2, "gemm_tc.f64",
                lambda we=we: widen_steps(we), 8 * n * (-(-k // 32) * 32))
            out = dot_f32(xg, we, None, w_f64)
            if not out_fp32:
                out = f32_to_bf16(out)
        y[rows] = out


def _register_twins() -> None:
    for name in TILES:
        twin(MODULE, f"moe_gemm_bf16_{name}")(
            lambda ctx, y, x, w, p, o, t, E, n, k, d:
            _moe_gemm_twin(ctx, y, x, w, p, o, t, E, n, k, d, False))
        twin(MODULE, f"moe_gemm_fp32_{name}")(
            lambda ctx, y, x, w, p, o, t, E, n, k, d:
            _moe_gemm_twin(ctx, y, x, w, p, o, t, E, n, k, d, True))


_register_twins()
