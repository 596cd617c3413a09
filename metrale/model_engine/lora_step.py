"""One forward pass's LoRA work: which rows carry which adapter slot, as device tiles, and
the shrink + expand that `run_decoder` (layers.py) runs after each fused projection.

`LoraStep.plan(pool, row_slots, stream, graph_rows)` uploads the tiles and returns the
step, or None when no row has an adapter: then the pass launches nothing extra (and a
decode step may still take the fused GEMMs). Decode gives every row its own tile (its
neighbours' adapters differ), and with `graph_rows` exactly that many tiles, padding and
base rows marked slot -1, so a captured graph's grid fits every step of its rung; prefill
groups each sequence's rows into tiles of up to eight. The bits of a row are the same
either way (ops/lora.py).
"""
from __future__ import annotations

import numpy as np

from ..ops import lora
from .tp.lora_shard import ROW_PARALLEL


class LoraStep:
    """The tiles of one pass (already on the device) and the launches of each group; `tp`: a
    tensor-parallel rank's combines (tp/runtime.py), whose communicator gathers the ranks'
    partial x A^T of the row-parallel projections (tp/lora_shard.py)."""

    def __init__(self, pool, n_tiles: int, rows_per_tile: int, tp=None) -> None:
        self.pool, self.n_tiles, self.rows_per_tile, self.tp = pool, n_tiles, rows_per_tile, tp

    @staticmethod
    def plan(pool, row_slots, stream: int, graph_rows: int | None = None,
             decode: bool = True, tp=None) -> "LoraStep | None":
        """The step of a pass whose rows have `row_slots` (-1: no adapter), or None."""
        if pool is None or all(s < 0 for s in row_slots):
            return None
        if decode:
            n = len(row_slots) if graph_rows is None else graph_rows
            tiles = np.full((n, 3), -1, np.int32)
            tiles[:, 0] = np.arange(n)
            tiles[:, 1] = 1
            tiles[:len(row_slots), 2] = row_slots
            per = 1
        else:
            tiles, per = lora.build_tiles(row_slots, 8), 8
        pool.backend.copy_h2d_async(np.ascontiguousarray(tiles), pool.tiles, stream)
        return LoraStep(pool, len(tiles), per, tp)

    def apply(self, backend, stream: int, layer: int, group: str, y_ptr, x_ptr,
              m: int) -> None:
        """y[m, n] (the group's base output, bias added) += its LoRA delta for the rows of
        the tiles; x[m, k] is the group's input."""
        p = self.pool
        r = p.region(layer, group)
        if r is None:
            return
        lora.lora_shrink(backend, stream, p.t, x_ptr, p.ptr(r.a_off), r.a_stride, p.tiles,
                         self.n_tiles, m, r.k, r.c, p.n_slots, self.rows_per_tile)
        t, splits = p.t, 1
        if self.tp is not None and group in ROW_PARALLEL:   # this rank's part of x A^T
            self.tp.before_collective()
            self.tp.comm.all_gather(p.t, p.t_all, m * r.c, np.float32, stream)
            t, splits = p.t_all, self.tp.size
        lora.lora_expand(backend, stream, y_ptr, t, p.ptr(r.b_off), r.b_stride,
                         p.ptr(r.s_off), p.tiles, self.n_tiles, m, r.n, r.rp, r.ends,
                         p.n_slots, self.rows_per_tile, splits=splits, t_split_stride=m * r.c)
