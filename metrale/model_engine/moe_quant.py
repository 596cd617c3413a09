"""Quantized routed experts on the device (FP8 fine-grained / compressed-tensors, GPTQ with
or without act-order, AWQ; formats/quant/ reads each expert's linears as the dense
families' linears are read), kept packed in ops/moe_gemm_q.py's layout: every expert's
gate and up fused as [gate rows | up rows] (the BF16 experts' layout, moe_weights.py), down
alone, all experts stacked. ops.moe_gemm_q dequantizes them inside its tiles with gemm_q's
formula, so the values multiplied are those of the dequantized checkpoint.

A layer whose experts the config quantizes only in part is uploaded as BF16, each quantized
expert linear dequantized by that same formula (the same values either way)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats.quant.fp8 import HostFp8, concat_fp8
from ..formats.quant.int4 import HostQ4, concat_q4
from ..formats.quant.layout import dequant_bits
from ..gpu_runtime.types import NULL
from ..ops import moe_gemm_q


@dataclass
class QuantExperts:
    """One projection of every expert, W [E, n, k] quantized on the device: fmt "q4" with
    ptrs (q, scales, zeros, gidx, gidx_row) and scalars (groups, group_size), or "fp8" with
    ptrs (q, scales, scale_row) and scalars (k_blocks, block_k): ops.moe_gemm_q's order."""
    fmt: str
    ptrs: tuple
    scalars: tuple
    n: int
    k: int
    nbytes: int

    def run(self, backend, stream: int, y_ptr, x_ptr, lists, n_pairs: int, num_experts: int,
            row_div: int, out_fp32: bool = False, tile: str = "16x16") -> None:
        """y[p] = x[p // row_div] @ dequant(W[e_p])^T over moe_route's lists."""
        gemm = moe_gemm_q.moe_gemm_q4 if self.fmt == "q4" else moe_gemm_q.moe_gemm_fp8
        gemm(backend, stream, y_ptr, x_ptr, *self.ptrs, *lists, n_pairs, num_experts, self.n,
             self.k, row_div, *self.scalars, out_fp32=out_fp32, tile=tile)


def upload_quant_experts(weights, up, meta, b: str):
    """(gate_up, down) of the MoE block at prefix `b` ("model.layers.{i}.mlp."): each a
    QuantExperts when the config quantizes every expert linear of the layer, a BF16
    DevicePtr ([E, n, k]) when it quantizes some, None when it quantizes none."""
    qc, src = meta.quantization, up.source
    moe, h = meta.moe, meta.hidden_size
    i, E = moe.expert_intermediate_size, moe.num_experts
    gate, upn, down = moe.expert_proj
    projs = ((f"{gate}", i, h), (f"{upn}", i, h), (f"{down}", h, i))
    mods = [[(f"{b}experts.{e}.{p}", n, k) for p, n, k in projs] for e in range(E)]
    conv = [qc.converts(m) for row in mods for m, _, _ in row]
    if not any(conv):
        return None
    if not all(conv):   # BF16, each quantized part dequantized exactly
        def bits(m, n, k):
            return dequant_bits(qc.read(src, m, n, k)) if qc.converts(m) else \
                np.asarray(src.read_bf16(m + ".weight"))
        gu = np.stack([np.concatenate([bits(*row[0]), bits(*row[1])]) for row in mods])
        dn = np.stack([bits(*row[2]) for row in mods])
        return (weights._own(up.upload_array(gu)), weights._own(up.upload_array(dn)))
    hosts = [[qc.read(src, m, n, k) for m, n, k in row] for row in mods]
    if isinstance(hosts[0][0], HostQ4):
        tables_everywhere(hosts)
        gu = [concat_q4([r[0], r[1]]) for r in hosts]
        return (upload_q4_experts(weights, up, gu, 2 * i, h), upload_q4_experts(weights, up,
                                                                  [r[2] for r in hosts], h, i))
    gu = [concat_fp8([r[0], r[1]]) for r in hosts]
    return (upload_fp8_experts(weights, up, gu, 2 * i, h), upload_fp8_experts(weights, up,
                                                                [r[2] for r in hosts], h, i))


def tables_everywhere(hosts: list[list[HostQ4]]) -> None:
    """Act-order in some linear of the layer: every part gets a table (k // group_size
    written out where its g_idx was trivial), so all experts share one table layout."""
    if all(p.gidx is None for row in hosts for p in row):
        return
    for row in hosts:
        for p in row:
            if p.gidx is None:
                p.gidx = (np.arange(p.k) // p.group_size).astype(np.int32)[None]
                p.gidx_row = np.zeros(p.n, np.int32)


def upload_q4_experts(weights, up, parts: list[HostQ4], n: int, k: int) -> QuantExperts:
    own = weights._own
    arrays = [np.stack([getattr(p, a) for p in parts]) for a in ("q", "scales", "zeros")]
    g = gr = NULL
    extra = 0
    if parts[0].gidx is not None:   # tables numbered globally: expert e's after e-1's
        offs = np.cumsum([0] + [len(p.gidx) for p in parts[:-1]])
        tables = np.concatenate([p.gidx for p in parts]).astype(np.int32)
        rows = np.stack([p.gidx_row + o for p, o in zip(parts, offs)]).astype(np.int32)
        g, gr = own(up.upload_bytes(tables)), own(up.upload_bytes(rows))
        extra = tables.nbytes + rows.nbytes
    ptrs = tuple(own(up.upload_bytes(np.ascontiguousarray(a))) for a in arrays)
    return QuantExperts("q4", (*ptrs, g, gr), (parts[0].scales.shape[1], parts[0].group_size),
                        n, k, sum(a.nbytes for a in arrays) + extra)


def upload_fp8_experts(weights, up, parts: list[HostFp8], n: int, k: int) -> QuantExperts:
    own = weights._own
    offs = np.cumsum([0] + [len(p.scales) for p in parts[:-1]])
    q = np.stack([p.q for p in parts])
    scales = np.ascontiguousarray(np.concatenate([p.scales for p in parts]), np.float32)
    rows = np.stack([p.scale_row + o for p, o in zip(parts, offs)]).astype(np.int32)
    ptrs = (own(up.upload_bytes(q)), own(up.upload_bytes(scales)), own(up.upload_bytes(rows)))
    return QuantExperts("fp8", ptrs, (scales.shape[1], parts[0].block_k), n, k,
                        q.nbytes + scales.nbytes + rows.nbytes)
