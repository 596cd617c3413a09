"""A tensor-parallel rank's slice of a quantized linear (FP8 with block, channel or tensor
scales; 4-bit GPTQ / AWQ, act-order included), cut from the repacked host layout of
formats/quant/ (HostFp8, HostQ4) and kept quantized: the slice dequantizes to exactly the
same slice of the dequantized whole, so a rank's GEMM multiplies the same BF16 values.

Column-parallel (q/k/v, gate/up, the output head: rows [a, b) of W [n, k]):
  FP8  the rows' codes and the scale rows they use: a shard boundary inside a 128-row
       block keeps, on each side, the rows it owns and that block's scales (vLLM refuses
       this case; e.g. 8 KV heads of 128 over 16 ranks meet it).
  4-bit the rows' codes, scales and zeros (and their act-order tables).
Row-parallel (o_proj, down_proj: columns [a, b) of W, the rank's slice of k):
  FP8  the columns' codes; a scale column per gcd(block_k, a) columns (each a copy of the
       block it lies in), so a slice starting inside a block needs no new rounding; refused
       when that is not a multiple of 8 (the kernels read 8 codes a scale).
  4-bit groups along k split on group boundaries only: a slice that cuts a group is
       refused naming the tensor and the group size. With act-order (g_idx), the groups the
       slice's columns use, renumbered, and its part of the table.
Refusals are decided from the metadata alone (`check_columns`) before anything is read.
"""
from __future__ import annotations

from math import gcd

import numpy as np

from ...errors import Unsupported
from ...formats.quant.fp8 import HostFp8
from ...formats.quant.int4 import HostQ4, pack_rows
from ...ops.gemm_q import fp8_row_bytes, q4_row_bytes


def check_columns(qc, module: str, k: int, a: int, b: int, where: str) -> None:
    """Unsupported naming `module` when columns [a, b) of its [*, k] weight cannot be a
    rank's slice in qc's format."""
    if qc.kind == "int4":
        gs = k if qc.group_size == -1 else qc.group_size
        if qc.desc_act:   # any column may hold any group: the slice keeps what it uses
            if a % 8 or b % 8:
                raise Unsupported(f"{where}: tensor {module}: a rank's input columns "
                                  f"[{a}, {b}) do not start and end on 8-column words")
            return
        if a % gs or b % gs:
            raise Unsupported(f"{where}: tensor {module}: a rank's input columns [{a}, {b}) "
                              f"cut a 4-bit group (group_size {gs}); the ranks must split "
                              "on group boundaries")
        return
    if qc.strategy == "block" and -(-k // qc.block[1]) > 1 and gcd(qc.block[1], a) % 8:
        raise Unsupported(f"{where}: tensor {module}: a rank's input columns start at {a}, "
                          f"inside an FP8 scale block of {qc.block[1]} columns and not on an "
                          "8-column boundary")


def fp8_rows(h: HostFp8, a: int, b: int, pad_to: int | None = None) -> HostFp8:
    """Rows [a, b) of h (zero rows appended up to `pad_to`: a padded vocabulary slice)."""
    used, local = np.unique(h.scale_row[a:b], return_inverse=True)
    q = h.q[a:b]
    rows = local.astype(np.int32)
    if pad_to is not None and pad_to > b - a:   # zero codes: zero products, any scale
        q = np.concatenate([q, np.zeros((pad_to - (b - a), q.shape[1]), np.uint8)])
        rows = np.concatenate([rows, np.zeros(pad_to - (b - a), np.int32)])
    return HostFp8(np.ascontiguousarray(q), np.ascontiguousarray(h.scales[used]), rows, h.k,
                   h.block_k)


def fp8_columns(h: HostFp8, a: int, b: int) -> HostFp8:
    """Columns [a, b) of h (check_columns passed): block scales re-cut per gcd(block_k, a)
    columns, each the scale of the block its columns lie in."""
    k = b - a
    q = np.zeros((h.n, fp8_row_bytes(k)), np.uint8)
    q[:, :k] = h.q[:, a:b]
    if h.scales.shape[1] == 1:   # per channel / tensor: one scale covers the row
        return HostFp8(q, h.scales, h.scale_row, k, fp8_row_bytes(k))
    step = gcd(h.block_k, a) if a else h.block_k
    cols = (a + step * np.arange(-(-k // step))) // h.block_k
    return HostFp8(q, np.ascontiguousarray(h.scales[:, cols]), h.scale_row, k, step)


def q4_rows(h: HostQ4, a: int, b: int) -> HostQ4:
    """Rows [a, b) of h; act-order keeps only the tables those rows use."""
    gidx = gidx_row = None
    if h.gidx is not None:
        used, local = np.unique(h.gidx_row[a:b], return_inverse=True)
        gidx, gidx_row = np.ascontiguousarray(h.gidx[used]), local.astype(np.int32)
    return HostQ4(np.ascontiguousarray(h.q[a:b]), np.ascontiguousarray(h.scales[a:b]),
                  np.ascontiguousarray(h.zeros[a:b]), gidx, gidx_row, h.k, h.group_size)


def q4_columns(h: HostQ4, a: int, b: int) -> HostQ4:
    """Columns [a, b) of h (check_columns passed): whole groups, or with act-order the
    groups the columns use, renumbered."""
    k = b - a
    words = h.q[:, :q4_row_bytes(h.k) // 4]
    codes = ((words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15)
    codes = codes.reshape(h.n, -1)[:, a:b].astype(np.uint8)
    q = pack_rows(np.ascontiguousarray(codes))
    if h.gidx is None:
        g0, g1 = a // h.group_size, -(-b // h.group_size)
        return HostQ4(q, np.ascontiguousarray(h.scales[:, g0:g1]),
                      np.ascontiguousarray(h.zeros[:, g0:g1]), None, None, k, h.group_size)
    tables = h.gidx[:, a:b]
    used, local = np.unique(tables, return_inverse=True)
    return HostQ4(q, np.ascontiguousarray(h.scales[:, used]),
                  np.ascontiguousarray(h.zeros[:, used]),
                  local.reshape(tables.shape).astype(np.int32), h.gidx_row, k, h.group_size)


def rows(h, a: int, b: int, pad_to: int | None = None):
    """Rows [a, b) of a HostFp8 / HostQ4 (pad_to: FP8 only, the output head)."""
    if isinstance(h, HostFp8):
        return fp8_rows(h, a, b, pad_to)
    if pad_to is not None and pad_to != b - a:
        raise Unsupported("a padded vocabulary slice of a 4-bit output head is not supported")
    return q4_rows(h, a, b)


def columns(h, a: int, b: int):
    return fp8_columns(h, a, b) if isinstance(h, HostFp8) else q4_columns(h, a, b)
