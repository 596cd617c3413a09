"""The grouped expert GEMM over quantized experts (kernels/moe_gemm_q.cu, module
"moe_gemm_q"): y[p] = x[p / row_div] @ dequant(W[e])^T for every pair p in expert e's row
list, W[e] 4-bit (GPTQ / AWQ repacked, ops/gemm_q.py `gemm_q4`'s layout per expert) or
float8_e4m3fn with float32 scales (`gemm_fp8`'s).

Each expert's values are dequantized with gemm_q's formula (`dequant_q4`, `dequant_fp8`)
inside the tile, and the GEMM over them is moe_gemm's, which is gemm_tc's element by
element: a row's bits are gemm_tc's row of x against the dequantized W[e], whatever the
tile, the batch or which other tokens chose e. The twin is therefore gemm_q's twin
(`q4_rows_twin`, `fp8_rows_twin`: the native CPU GEMM with the dequantization in its tile,
or numpy) applied expert by expert to the gathered rows.

Layout (all experts stacked): q4: q uint32 [E, n, kp / 8], scales uint16 [E, n, groups],
zeros uint8 [E, n, groups], act-order gidx int32 [tables, k] + gidx_row int32 [E, n]
(global table numbers) or both NULL. fp8: q uint8 [E, n, kp], scales float32 [rows,
k_blocks] (every expert's rows), scale_row int32 [E, n] (global row numbers).
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .checks import check_ptrs
from .gemm_q import check_fp8, check_q4, fp8_row_bytes, fp8_rows_twin, q4_row_bytes, q4_rows_twin
from .moe_gemm import TILES, route_grid
from .registry import twin

MODULE = "moe_gemm_q"


def moe_gemm_q4(backend, stream: int, y_ptr, x_ptr, q_ptr, scales_ptr, zeros_ptr, gidx_ptr,
                gidx_row_ptr, sorted_pairs_ptr, expert_offsets_ptr, tile_offsets_ptr,
                n_pairs: int, num_experts: int, n: int, k: int, row_div: int, groups: int,
                group_size: int, out_fp32: bool = False, tile: str = "16x16") -> None:
    """Y[p] = X[p // row_div] @ dequant_q4(W[e])^T for the pairs of every expert e.

    x bf16 [*, k]; W as the module doc says (q 16-byte aligned, k % 8 == 0); y [n_pairs, n]
    bf16 or float32 (out_fp32); sorted_pairs int32 [n_pairs], expert_offsets, tile_offsets
    int32 [num_experts + 1] from moe_route with block_m = TILES[tile].bm.
    """
    what = "moe_gemm_q4"
    t, grid = route_grid(what, n_pairs, num_experts, n, row_div, tile)
    check_q4(what, 1, n, k, q_ptr, scales_ptr, zeros_ptr, gidx_ptr, gidx_row_ptr, groups,
             group_size)
    if int(num_experts) * int(n) * q4_row_bytes(k) >= 2**40:
        raise InvalidArgument(f"{what}: the expert weights exceed 2^40 bytes")
    check_ptrs(what, y_ptr=y_ptr, x_ptr=x_ptr, sorted_pairs_ptr=sorted_pairs_ptr,
               expert_offsets_ptr=expert_offsets_ptr, tile_offsets_ptr=tile_offsets_ptr)
    func = f"moe_gemm_q4_{'fp32' if out_fp32 else 'bf16'}_{t.name}"
    backend.launch(backend.kernel(MODULE, func), grid, (t.threads,), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(x_ptr), DevicePtr(q_ptr),
                    DevicePtr(scales_ptr), DevicePtr(zeros_ptr), DevicePtr(gidx_ptr),
                    DevicePtr(gidx_row_ptr), DevicePtr(sorted_pairs_ptr),
                    DevicePtr(expert_offsets_ptr), DevicePtr(tile_offsets_ptr),
                    np.int32(num_experts), np.int32(n), np.int32(k), np.int32(row_div),
                    np.int32(groups), np.int32(group_size)))


def moe_gemm_fp8(backend, stream: int, y_ptr, x_ptr, q_ptr, scales_ptr, scale_row_ptr,
                 sorted_pairs_ptr, expert_offsets_ptr, tile_offsets_ptr, n_pairs: int,
                 num_experts: int, n: int, k: int, row_div: int, k_blocks: int, block_k: int,
                 out_fp32: bool = False, tile: str = "16x16") -> None:
    """Y[p] = X[p // row_div] @ dequant_fp8(W[e])^T for the pairs of every expert e.

    x bf16 [*, k]; W as the module doc says (q 16-byte aligned, block_k % 8 == 0, k_blocks
    = ceil(k / block_k)); y, the row lists and the tile as `moe_gemm_q4`.
    """
    what = "moe_gemm_fp8"
    t, grid = route_grid(what, n_pairs, num_experts, n, row_div, tile)
    check_fp8(what, 1, n, k, q_ptr, scales_ptr, scale_row_ptr, k_blocks, block_k)
    if int(num_experts) * int(n) * fp8_row_bytes(k) >= 2**40:
        raise InvalidArgument(f"{what}: the expert weights exceed 2^40 bytes")
    check_ptrs(what, y_ptr=y_ptr, x_ptr=x_ptr, sorted_pairs_ptr=sorted_pairs_ptr,
               expert_offsets_ptr=expert_offsets_ptr, tile_offsets_ptr=tile_offsets_ptr)
    func = f"moe_gemm_fp8_{'fp32' if out_fp32 else 'bf16'}_{t.name}"
    backend.launch(backend.kernel(MODULE, func), grid, (t.threads,), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(x_ptr), DevicePtr(q_ptr),
                    DevicePtr(scales_ptr), DevicePtr(scale_row_ptr),
                    DevicePtr(sorted_pairs_ptr), DevicePtr(expert_offsets_ptr),
                    DevicePtr(tile_offsets_ptr), np.int32(num_experts), np.int32(n),
                    np.int32(k), np.int32(row_div), np.int32(k_blocks), np.int32(block_k)))


# --------------------------------------------------------------------------- the twins
def _grouped_twin(ctx, y_ptr, x_ptr, pairs_ptr, offsets_ptr, num_experts, n, k, row_div,
                  out_fp32: bool, expert_rows) -> None:
    """Expert by expert: the gathered x rows through `expert_rows(y, x, e)` (gemm_q's twin
    on expert e's W), written to the pairs' rows of y."""
    E, n, k, div = int(num_experts), int(n), int(k), int(row_div)
    offsets = ctx.read(offsets_ptr, E + 1, np.int32).astype(np.int64)
    total = int(offsets[E])
    if total == 0:
        return
    pairs = ctx.read(pairs_ptr, total, np.int32).astype(np.int64)
    x_rows = int((pairs // div).max()) + 1
    x_bits = ctx.read(x_ptr, x_rows * k, np.uint16).reshape(x_rows, k)
    dt = np.float32 if out_fp32 else np.uint16
    y = ctx.view(y_ptr, (int(pairs.max()) + 1) * n, dt).reshape(-1, n)
    for e in range(E):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if lo == hi:
            continue
        rows = pairs[lo:hi]
        out = np.empty((hi - lo, n), dt)
        expert_rows(out, np.ascontiguousarray(x_bits[rows // div]), e)
        y[rows] = out


def _q4_twin(ctx, y, x, q, s, z, g, gr, pairs, offsets, tiles, E, n, k, div, groups, gs,
             out_fp32: bool) -> None:
    n, k, groups = int(n), int(k), int(groups)
    qb, sb = n * q4_row_bytes(k), n * groups

    def rows(out, xg, e):
        q4_rows_twin(ctx, out, xg, DevicePtr(q).offset(e * qb), DevicePtr(s).offset(e * sb * 2),
                     DevicePtr(z).offset(e * sb), g,
                     DevicePtr(gr).offset(e * n * 4) if int(gr) else gr, n, k, groups, int(gs))
    _grouped_twin(ctx, y, x, pairs, offsets, E, n, k, div, out_fp32, rows)


def _fp8_twin(ctx, y, x, q, s, r, pairs, offsets, tiles, E, n, k, div, kb, bk,
              out_fp32: bool) -> None:
    n, k = int(n), int(k)
    qb = n * fp8_row_bytes(k)

    def rows(out, xg, e):
        fp8_rows_twin(ctx, out, xg, DevicePtr(q).offset(e * qb), s,
                      DevicePtr(r).offset(e * n * 4), n, k, int(kb), int(bk))
    _grouped_twin(ctx, y, x, pairs, offsets, E, n, k, div, out_fp32, rows)


def _register_twins() -> None:
    for name in TILES:
        for out, f32 in (("bf16", False), ("fp32", True)):
            twin(MODULE, f"moe_gemm_q4_{out}_{name}")(
                lambda ctx, y, x, q, s, z, g, gr, p, o, t, E, n, k, d, G, gs, f32=f32:
                _q4_twin(ctx, y, x, q, s, z, g, gr, p, o, t, E, n, k, d, G, gs, f32))
            twin(MODULE, f"moe_gemm_fp8_{out}_{name}")(
                lambda ctx, y, x, q, s, r, p, o, t, E, n, k, d, kb, bk, f32=f32:
                _fp8_twin(ctx, y, x, q, s, r, p, o, t, E, n, k, d, kb, bk, f32))


_register_twins()
