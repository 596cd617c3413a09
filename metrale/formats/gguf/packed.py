"""A GGUF tensor's blocks split into the device's planes (ops/gguf_planes.py: q, qh, meta),
byte for byte: the codes in k order, the scale fields as stored.

Where each element's code bits sit in a block (ggml-common.h; element i of the block,
lo = the bits that go to the q plane, hi = those of the qh plane):
  Q4_0 / Q4_1 / IQ4_NL  qs[16] at 2 / 4 / 2: lo = qs[i] & 15 (i < 16), qs[i - 16] >> 4
  Q5_0 / Q5_1           qh u32 at 2 / 4, qs at 6 / 8: lo as Q4_0, hi = (qh >> i) & 1
  Q8_0                  qs[32] at 2: lo = qs[i] (int8)
  Q2_K    scales[16] | qs[64] | d | dmin; i = 128 h + 32 j + l (l < 32):
          lo = (qs[32 h + l] >> 2 j) & 3
  Q3_K    hmask[32] | qs[64] | scales[12] | d; i as Q2_K: lo = (qs[32 h + l] >> 2 j) & 3,
          hi = (hmask[l] >> (4 h + j)) & 1
  Q4_K    d | dmin | scales[12] | qs[128]; i = 64 c + 32 u + l: lo = qs[32 c + l] >> 4 u & 15
  Q5_K    d | dmin | scales[12] | qh[32] | qs[128]; lo as Q4_K, hi = (qh[i % 32] >> i / 32) & 1
  Q6_K    ql[128] | qh[64] | scales[16] | d; i = 128 h + 32 u + l: lo = (ql[64 h + l + 32
          (u % 2)] >> 4 (u / 2)) & 15, hi = (qh[32 h + l] >> 2 u) & 3
  IQ4_XS  d | scales_h | scales_l[4] | qs[128]; i = 32 g + 16 u + l: lo = qs[16 g + l] >> 4 u
          & 15
and the meta bytes are the block's other fields in the order ops/gguf_planes.py lists.
`split_blocks` and `join_blocks` are each other's inverse (tests/formats/test_gguf_packed.py
checks both ways on random bytes).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...ops.gguf_planes import PACKED, pack_bits, plane_bytes, unpack_bits


class Planes(NamedTuple):
    """One tensor's planes on the host: q, qh (None without high bits), meta; uint8 rows."""
    q: np.ndarray
    qh: np.ndarray | None
    meta: np.ndarray
    ggml_type: int
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + (0 if self.qh is None else self.qh.nbytes) + self.meta.nbytes


def _nib32(qs: np.ndarray) -> np.ndarray:
    """[b, 16] bytes -> [b, 32]: low nibbles, then high nibbles."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _bits32(word: np.ndarray) -> np.ndarray:
    """[b, 4] bytes of a little-endian u32 -> [b, 32] its bits."""
    w = word.copy().view("<u4")                                  # [b, 1]
    return ((w >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q2_lo(qs: np.ndarray) -> np.ndarray:
    """[b, 64] -> [b, 256]: (qs[32 h + l] >> 2 j) & 3 at 128 h + 32 j + l."""
    q = qs.reshape(-1, 2, 1, 32)
    return ((q >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3).reshape(-1, 256)


def _codes(ggml_type: int, b: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(lo, hi, meta) of blocks b [blocks, block_bytes]: [blocks, QK] code bits in element
    order and [blocks, META_BYTES] scale bytes."""
    name = PACKED[ggml_type].name
    if name in ("Q4_0", "IQ4_NL"):
        return _nib32(b[:, 2:18]), None, b[:, 0:2]
    if name == "Q4_1":
        return _nib32(b[:, 4:20]), None, b[:, 0:4]
    if name == "Q5_0":
        return _nib32(b[:, 6:22]), _bits32(b[:, 2:6]), b[:, 0:2]
    if name == "Q5_1":
        return _nib32(b[:, 8:24]), _bits32(b[:, 4:8]), b[:, 0:4]
    if name == "Q8_0":
        return b[:, 2:34], None, b[:, 0:2]
    if name == "Q2_K":
        return _q2_lo(b[:, 16:80]), None, np.concatenate([b[:, 0:16], b[:, 80:84]], axis=1)
    if name == "Q3_K":
        hm = b[:, 0:32]                                           # bit 4 h + j of hmask[l]
        hi = (hm[:, None, None, :] >> (4 * np.arange(2, dtype=np.uint8)[:, None, None]
                                       + np.arange(4, dtype=np.uint8)[None, :, None])) & 1
        return _q2_lo(b[:, 32:96]), hi.reshape(-1, 256), b[:, 96:110]
    if name in ("Q4_K", "Q5_K"):
        qs = b[:, 16:144] if name == "Q4_K" else b[:, 48:176]
        q = qs.reshape(-1, 4, 1, 32)
        lo = np.concatenate([q & 15, q >> 4], axis=2).reshape(-1, 256)
        hi = None
        if name == "Q5_K":
            qh = b[:, 16:48]                                      # bit i / 32 of qh[i % 32]
            hi = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1)
            hi = hi.reshape(-1, 256)
        return lo, hi, b[:, 0:16]
    if name == "Q6_K":
        ql = b[:, 0:128].reshape(-1, 2, 2, 32)                    # [h, half of 64, l]
        lo = np.stack([ql[:, :, 0] & 15, ql[:, :, 1] & 15, ql[:, :, 0] >> 4,
                       ql[:, :, 1] >> 4], axis=2)                 # [b, h, u, l]
        qh = b[:, 128:192].reshape(-1, 2, 1, 32)
        hi = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
        return lo.reshape(-1, 256), hi.reshape(-1, 256), b[:, 192:210]
    if name == "IQ4_XS":
        q = b[:, 8:136].reshape(-1, 8, 1, 16)
        return np.concatenate([q & 15, q >> 4], axis=2).reshape(-1, 256), None, b[:, 0:8]
    raise KeyError(name)


def split_blocks(raw: np.ndarray, ggml_type: int, n: int, k: int) -> Planes:
    """The planes of a tensor [n, k] stored as `raw` (uint8, n * k / QK blocks)."""
    t = PACKED[ggml_type]
    blocks = raw.reshape(n * (k // t.qk), t.block_bytes)
    lo, hi, meta = _codes(ggml_type, blocks)
    q_row, qh_row, meta_row = plane_bytes(ggml_type, k)
    q = pack_bits(lo.reshape(n, k), t.low_bits, q_row)
    qh = pack_bits(hi.reshape(n, k), t.high_bits, qh_row) if t.high_bits else None
    return Planes(q, qh, np.ascontiguousarray(meta.reshape(n, meta_row)), ggml_type, n, k)


def join_blocks(p: Planes) -> np.ndarray:
    """The stored bytes (uint8, flat) of planes `p`: split_blocks' inverse."""
    t = PACKED[p.ggml_type]
    nb = p.n * (p.k // t.qk)
    lo = unpack_bits(p.q, t.low_bits, p.k).reshape(nb, t.qk)
    hi = unpack_bits(p.qh, t.high_bits, p.k).reshape(nb, t.qk) if t.high_bits else None
    meta = p.meta.reshape(nb, t.meta_bytes)
    out = np.zeros((nb, t.block_bytes), np.uint8)
    name = t.name

    def nibbles(at, codes):           # 32 codes -> 16 bytes at `at`
        out[:, at:at + 16] = codes[:, :16] | (codes[:, 16:] << 4)

    def word(at, bits):               # 32 bits -> a little-endian u32 at `at`
        w = np.bitwise_or.reduce(bits.astype(np.uint32) << np.arange(32, dtype=np.uint32),
                                 axis=1)
        out[:, at:at + 4] = w.astype("<u4").view(np.uint8).reshape(-1, 4)

    def q2(at, codes):                # 256 2-bit codes -> 64 bytes at `at` (_q2_lo's inverse)
        c = codes.reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :,
                                                                               None]
        out[:, at:at + 64] = np.bitwise_or.reduce(c, axis=2).reshape(-1, 64)

    if name in ("Q4_0", "IQ4_NL", "Q4_1", "Q5_0", "Q5_1"):
        m = {"Q4_0": 2, "IQ4_NL": 2, "Q4_1": 4, "Q5_0": 2, "Q5_1": 4}[name]
        out[:, :m] = meta
        if hi is not None:
            word(m, hi)
        nibbles(m + (4 if hi is not None else 0), lo)
    elif name == "Q8_0":
        out[:, 0:2], out[:, 2:34] = meta, lo
    elif name == "Q2_K":
        out[:, 0:16], out[:, 80:84] = meta[:, 0:16], meta[:, 16:20]
        q2(16, lo)
    elif name == "Q3_K":
        h = hi.reshape(-1, 2, 4, 32) << (4 * np.arange(2, dtype=np.uint8)[:, None, None]
                                         + np.arange(4, dtype=np.uint8)[None, :, None])
        out[:, 0:32] = np.bitwise_or.reduce(h.reshape(-1, 8, 32), axis=1)
        q2(32, lo)
        out[:, 96:110] = meta
    elif name in ("Q4_K", "Q5_K"):
        out[:, 0:16] = meta
        c = lo.reshape(-1, 4, 2, 32)
        at = 16 if name == "Q4_K" else 48
        out[:, at:at + 128] = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128)
        if name == "Q5_K":
            h = hi.reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]
            out[:, 16:48] = np.bitwise_or.reduce(h, axis=1)
    elif name == "Q6_K":
        c = lo.reshape(-1, 2, 4, 32)
        out[:, 0:128] = np.stack([c[:, :, 0] | (c[:, :, 2] << 4), c[:, :, 1] | (c[:, :, 3] << 4)],
                                 axis=2).reshape(-1, 128)
        h = hi.reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
        out[:, 128:192] = np.bitwise_or.reduce(h, axis=2).reshape(-1, 64)
        out[:, 192:210] = meta
    elif name == "IQ4_XS":
        out[:, 0:8] = meta
        c = lo.reshape(-1, 8, 2, 16)
        out[:, 8:136] = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128)
    else:
        raise KeyError(name)
    return out.reshape(-1)
