"""The grouped tensor-core GEMM over routed experts (kernels/moe_gemm.cu, module
"moe_gemm"): y[p] = x[p / row_div] @ W[e]^T for every pair p in expert e's row list.

Each element is gemm_tc's (the same k16 MMA steps in the same order), so the twin is
gemm_tc's twin applied expert by expert: `dot_f32` of the gathered rows against W[e],
computed by HostBackend's native GEMM (the CPU path's expert compute) or numpy. A row's
bits depend on (x row, W[e] row, k) only: not on the tile, the other rows of its expert or
the batch. Option `bias_ptr` (bf16 [num_experts, n], gpt-oss's expert biases): y[p] =
x @ W[e]^T + bias[e], added to the FP32 product before its one rounding.

`moe_gemm_mxfp4`: the same GEMM with W as MXFP4 blocks and scales (ops/mxfp4.py), each value
dequantized exactly to BF16 in the tile: the bits of `moe_gemm` run on the dequantized W,
which is what its twin computes.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import NULL, DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs, check_sizes
from . import gemm_tc
from .gemm_tc import Tile, dot_f32, widen_steps
from .moe_router import MAX_EXPERTS
from .mxfp4 import dequant_bf16
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


def route_grid(what: str, n_pairs: int, num_experts: int, n: int, row_div: int, tile: str):
    """(tile, grid) of a grouped GEMM launch `what` over n_pairs routed rows (every
    moe_gemm* launcher's shared checks: sizes, the expert count, the tile, grid.y)."""
    check_sizes(what, n_pairs=n_pairs, row_div=row_div)
    if not 1 <= int(num_experts) <= MAX_EXPERTS:
        raise InvalidArgument(f"{what}: num_experts must be in [1, {MAX_EXPERTS}], got "
                              f"{num_experts}")
    if tile not in TILES:
        raise InvalidArgument(f"{what}: tile {tile!r} is not one of {sorted(TILES)}")
    t = TILES[tile]
    grid = (max_tiles(n_pairs, num_experts, t.bm), -(-int(n) // t.bn))
    if grid[1] > _MAX_GRID_Y:
        raise InvalidArgument(f"{what}: n = {n} exceeds {_MAX_GRID_Y * t.bn} for tile "
                              f"{t.name} (grid.y limit)")
    return t, grid


def moe_gemm(backend, stream: int, y_ptr, x_ptr, w_ptr, sorted_pairs_ptr, expert_offsets_ptr,
             tile_offsets_ptr, n_pairs: int, num_experts: int, n: int, k: int, row_div: int,
             out_fp32: bool = False, tile: str = "16x16", bias_ptr=NULL) -> None:
    """Y[p] = X[p // row_div] @ W[e]^T (+ bias[e]) for the pairs of every expert e
    (moe_route's lists).

    x: bf16 [*, k]; w: bf16 [num_experts, n, k]; y: [n_pairs, n] bf16 or float32 (out_fp32);
    sorted_pairs int32 [n_pairs]; expert_offsets, tile_offsets int32 [num_experts + 1], the
    latter from moe_route with block_m = TILES[tile].bm (the tile must be the one routed
    for); bias_ptr: bf16 [num_experts, n] or NULL. n_pairs sizes the grid.
    """
    check_sizes("moe_gemm", n=n, k=k)
    t, grid = route_grid("moe_gemm", n_pairs, num_experts, n, row_div, tile)
    if int(num_experts) * int(n) * int(k) >= 2**40:
        raise InvalidArgument("moe_gemm: the expert weights exceed 2^40 elements")
    check_ptrs("moe_gemm", y_ptr=y_ptr, x_ptr=x_ptr, w_ptr=w_ptr,
               sorted_pairs_ptr=sorted_pairs_ptr, expert_offsets_ptr=expert_offsets_ptr,
               tile_offsets_ptr=tile_offsets_ptr)
    func = f"moe_gemm_{'fp32' if out_fp32 else 'bf16'}_{t.name}"
    backend.launch(backend.kernel(MODULE, func), grid, (t.threads,), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(x_ptr), DevicePtr(w_ptr),
                    DevicePtr(sorted_pairs_ptr), DevicePtr(expert_offsets_ptr),
                    DevicePtr(tile_offsets_ptr), np.int32(num_experts), np.int32(n),
                    np.int32(k), np.int32(row_div), DevicePtr(bias_ptr)))


def moe_gemm_mxfp4(backend, stream: int, y_ptr, x_ptr, blocks_ptr, scales_ptr,
                   sorted_pairs_ptr, expert_offsets_ptr, tile_offsets_ptr, n_pairs: int,
                   num_experts: int, n: int, k: int, row_div: int, out_fp32: bool = False,
                   tile: str = "16x16", bias_ptr=NULL) -> None:
    """`moe_gemm` with W given as MXFP4: blocks uint8 [num_experts, n, k / 2] (16-byte
    aligned), scales uint8 [num_experts, n, k / 32] (ops/mxfp4.py); k % 32 == 0."""
    check_sizes("moe_gemm_mxfp4", n=n, k=k)
    if int(k) % 32:
        raise InvalidArgument(f"moe_gemm_mxfp4: k must be a multiple of 32, got {k}")
    t, grid = route_grid("moe_gemm_mxfp4", n_pairs, num_experts, n, row_div, tile)
    check_ptrs("moe_gemm_mxfp4", 16, blocks_ptr=blocks_ptr)
    check_ptrs("moe_gemm_mxfp4", y_ptr=y_ptr, x_ptr=x_ptr, scales_ptr=scales_ptr,
               sorted_pairs_ptr=sorted_pairs_ptr, expert_offsets_ptr=expert_offsets_ptr,
               tile_offsets_ptr=tile_offsets_ptr)
    func = f"moe_gemm_mxfp4_{'fp32' if out_fp32 else 'bf16'}_{t.name}"
    backend.launch(backend.kernel(MODULE, func), grid, (t.threads,), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(x_ptr), DevicePtr(blocks_ptr),
                    DevicePtr(scales_ptr), DevicePtr(sorted_pairs_ptr),
                    DevicePtr(expert_offsets_ptr), DevicePtr(tile_offsets_ptr),
                    np.int32(num_experts), np.int32(n), np.int32(k), np.int32(row_div),
                    DevicePtr(bias_ptr)))


def _mxfp4_twin(ctx, y_ptr, x_ptr, blocks_ptr, scales_ptr, pairs_ptr, offsets_ptr, tiles_ptr,
                num_experts, n, k, row_div, bias_ptr, out_fp32: bool) -> None:
    """The BF16 twin on the dequantized experts (cached per buffer by the backend)."""
    E, n, k = int(num_experts), int(n), int(k)
    nbytes = E * n * k // 2
    blocks = ctx.read(blocks_ptr, nbytes, np.uint8).reshape(E, n, k // 2)
    scales = ctx.read(scales_ptr, E * n * k // 32, np.uint8).reshape(E, n, k // 32)
    cached = getattr(ctx.backend, "converted", None)
    w = None if cached is None else cached(DevicePtr(blocks_ptr), nbytes, "mxfp4.bf16",
                                           lambda: dequant_bf16(blocks, scales), E * n * k * 2)
    if w is None:   # no cache, or over its budget
        w = dequant_bf16(blocks, scales)
    _moe_gemm_twin(ctx, y_ptr, x_ptr, None, pairs_ptr, offsets_ptr, tiles_ptr, E, n, k,
                   row_div, bias_ptr, out_fp32, w_host=w)


def _moe_gemm_twin(ctx, y_ptr, x_ptr, w_ptr, pairs_ptr, offsets_ptr, tiles_ptr, num_experts,
                   n, k, row_div, bias_ptr, out_fp32: bool, w_host=None) -> None:
    E, n, k, div = int(num_experts), int(n), int(k), int(row_div)
    bias = (bf16_to_f32(ctx.read(bias_ptr, E * n, np.uint16)).reshape(E, n)
            if int(bias_ptr) else None)
    offsets = ctx.read(offsets_ptr, E + 1, np.int32).astype(np.int64)
    total = int(offsets[E])
    if total == 0:
        return
    pairs = ctx.read(pairs_ptr, total, np.int32).astype(np.int64)
    x_rows = int((pairs // div).max()) + 1
    x_bits = ctx.read(x_ptr, x_rows * k, np.uint16).reshape(x_rows, k)
    w_all = (ctx.read(w_ptr, E * n * k, np.uint16).reshape(E, n, k) if w_host is None
             else w_host)
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
            f32 = out_fp32 or bias is not None   # the bias joins the FP32 product
            out = np.empty((hi - lo, n), np.float32 if f32 else np.uint16)
            native.gemm(xg, w_all[e], out)
            if bias is not None:
                out += bias[e][None, :]
                if not out_fp32:
                    out = f32_to_bf16(out)
        else:   # numpy: each expert's W widened once, within the backend's cache budget
            we = w_all[e]
            w_f64 = None if cached is None or w_host is not None else cached(
                DevicePtr(w_ptr).offset(e * n * k * 2), n * k * 2, "gemm_tc.f64",
                lambda we=we: widen_steps(we), 8 * n * (-(-k // 32) * 32))
            out = dot_f32(xg, we, None, w_f64)
            if bias is not None:
                out = out + bias[e][None, :]
            if not out_fp32:
                out = f32_to_bf16(out)
        y[rows] = out


def _register_twins() -> None:
    for name in TILES:
        twin(MODULE, f"moe_gemm_bf16_{name}")(
            lambda ctx, y, x, w, p, o, t, E, n, k, d, b:
            _moe_gemm_twin(ctx, y, x, w, p, o, t, E, n, k, d, b, False))
        twin(MODULE, f"moe_gemm_fp32_{name}")(
            lambda ctx, y, x, w, p, o, t, E, n, k, d, b:
            _moe_gemm_twin(ctx, y, x, w, p, o, t, E, n, k, d, b, True))
        for out, f32 in (("bf16", False), ("fp32", True)):
            twin(MODULE, f"moe_gemm_mxfp4_{out}_{name}")(
                lambda ctx, y, x, bl, sc, p, o, t, E, n, k, d, b, f32=f32:
                _mxfp4_twin(ctx, y, x, bl, sc, p, o, t, E, n, k, d, b, f32))


_register_twins()
