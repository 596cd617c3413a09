"""llama.cpp's block formats kept at their bytes on the device: the plane layout and its
dequantization (the formula every GGUF kernel and twin computes).

A GGUF tensor W [n, k] (k contiguous, k % QK == 0) is stored as rows of k / QK blocks; each
block interleaves its codes with its scales (ggml-common.h). On the device each row is
split into three planes holding exactly the block's bytes, rearranged so that codes are in
k order and 16-byte aligned (formats/gguf/packed.py writes them):

  q     uint8 [n, q_row]   the low LOW_BITS bits of every element's code, element e at bit
                           (e * LOW_BITS) % 8 of byte (e * LOW_BITS) // 8 (two 4-bit codes a
                           byte, low nibble first); Q8_0's 8-bit codes are its int8 bytes.
                           q_row = k * LOW_BITS / 8 rounded up to 16 (zero padding)
  qh    uint8 [n, qh_row]  the high HIGH_BITS bits of every element's code the same way
                           (1 bit: Q5_0, Q5_1, Q5_K, Q3_K; 2 bits: Q6_K), qh_row = k *
                           HIGH_BITS / 8; no plane (NULL, qh_row 0) for the others
  meta  uint8 [n, (k / QK) * META_BYTES]  each block's scale fields, byte for byte as
                           stored, in block order:
      Q4_0 d | Q4_1 d, m | Q5_0 d | Q5_1 d, m | Q8_0 d | IQ4_NL d          (f16 each)
      Q2_K scales[16], d, dmin | Q3_K scales[12], d | Q4_K, Q5_K d, dmin, scales[12]
      Q6_K scales[16] (int8), d | IQ4_XS d, scales_h (u16), scales_l[4]

Bytes held: q + qh + meta = the file's bytes (plus q's row padding to 16 bytes: none when k
is a multiple of 256 at 4 bits, of 128 at 2 or 8).

Element e of a row is element i = e % QK of block b = e // QK. Its value is
  y = bf16_rn(s * c)        (types without a min)     y = bf16_rn(s * c + mn) (with one)
with float32 arithmetic, s and mn from the block's meta (sub-block j = i // SUB), c from its
code (lo: the q plane's bits, hi: the qh plane's):
  Q4_0    c = lo - 8                  s = d
  Q4_1    c = lo                      s = d                   mn = m
  Q5_0    c = (lo | hi << 4) - 16     s = d
  Q5_1    c = lo | hi << 4            s = d                   mn = m
  Q8_0    c = int8(lo)                s = d
  IQ4_NL  c = KVALUES[lo]             s = d
  Q2_K    c = lo          (SUB 16)    s = d * (sc & 15)       mn = -(dmin * (sc >> 4)),
                                      sc = scales[j]
  Q3_K    c = lo - (0 if hi else 4)   s = d * (sc - 32), sc the 6-bit scale j of scales[12]
          (SUB 16)                    (ggml's kmask unpacking: `q3k_scales`)
  Q4_K    c = lo          (SUB 32)    s = d * sc              mn = -(dmin * mn6), (sc, mn6)
  Q5_K    c = lo | hi << 4 (SUB 32)   the 6-bit pair j of scales[12] (get_scale_min_k4)
  Q6_K    c = (lo | hi << 4) - 32     s = d * int8(scales[j]) (SUB 16)
  IQ4_XS  c = KVALUES[lo]  (SUB 32)   s = d * (ls - 32), ls = (scales_l[j / 2] >> 4 (j % 2)
                                      & 15) | ((scales_h >> 2 j) & 3) << 4
Every s is exact in float32 (an f16 times an integer of at most 8 bits), so is s * c but for
at most one rounding, and mn is exact: y is the exact real value of ggml's formula rounded
once, whatever the order or FMA contraction, which is why these are the same bits as the
load-time dequantizer (formats/gguf/quants.py) computes from the blocks. The sign of a zero
follows the formula (s * c of a negative s and c = 0 is -0; + mn is added only where the
type has a min), as ggml's does.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .bf16 import f32_to_bf16


class PackedType(NamedTuple):
    name: str
    qk: int           # elements per block
    block_bytes: int
    low_bits: int     # bits per code in the q plane
    high_bits: int    # bits per code in the qh plane (0: none)
    meta_bytes: int   # scale bytes per block in the meta plane
    sub: int          # elements per scale (sub-block)
    has_min: bool


# ggml type id -> layout (ids from ggml.h, as formats/gguf/file.py's GGML_TYPES)
PACKED = {
    2: PackedType("Q4_0", 32, 18, 4, 0, 2, 32, False),
    3: PackedType("Q4_1", 32, 20, 4, 0, 4, 32, True),
    6: PackedType("Q5_0", 32, 22, 4, 1, 2, 32, False),
    7: PackedType("Q5_1", 32, 24, 4, 1, 4, 32, True),
    8: PackedType("Q8_0", 32, 34, 8, 0, 2, 32, False),
    10: PackedType("Q2_K", 256, 84, 2, 0, 20, 16, True),
    11: PackedType("Q3_K", 256, 110, 2, 1, 14, 16, False),
    12: PackedType("Q4_K", 256, 144, 4, 0, 16, 32, True),
    13: PackedType("Q5_K", 256, 176, 4, 1, 16, 32, True),
    14: PackedType("Q6_K", 256, 210, 4, 2, 18, 16, False),
    20: PackedType("IQ4_NL", 32, 18, 4, 0, 2, 32, False),
    23: PackedType("IQ4_XS", 256, 136, 4, 0, 8, 32, False),
}
for _t in PACKED.values():   # the planes hold exactly a block's bytes
    assert _t.qk * (_t.low_bits + _t.high_bits) // 8 + _t.meta_bytes == _t.block_bytes, _t

# IQ4_NL / IQ4_XS: the non-linear 4-bit grid (ggml-common.h kvalues_iq4nl)
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                   np.int8)


def plane_bytes(ggml_type: int, k: int) -> tuple[int, int, int]:
    """(q_row, qh_row, meta_row): bytes of one row of each plane for a row of k elements."""
    t = PACKED[ggml_type]
    return (-(-k * t.low_bits // 8 // 16) * 16, k * t.high_bits // 8,
            k // t.qk * t.meta_bytes)


def unpack_bits(plane: np.ndarray, bits: int, k: int) -> np.ndarray:
    """uint8 [n, k]: the `bits`-bit fields of each row of `plane` (uint8 [n, bytes]) in
    element order (element e at bit (e * bits) % 8 of byte (e * bits) // 8)."""
    per = 8 // bits
    shifts = (bits * np.arange(per, dtype=np.uint8))
    fields = (plane[:, :, None] >> shifts) & ((1 << bits) - 1)
    return fields.reshape(plane.shape[0], -1)[:, :k]


def pack_bits(fields: np.ndarray, bits: int, row_bytes: int) -> np.ndarray:
    """The inverse of unpack_bits: uint8 [n, k] fields -> uint8 [n, row_bytes] (zero pad)."""
    n, k = fields.shape
    per = 8 // bits
    out = np.zeros((n, row_bytes), np.uint8)
    f = fields
    if k % per:
        f = np.zeros((n, -(-k // per) * per), np.uint8)
        f[:, :k] = fields
    # strided ORs over whole rows (a load splits every weight through here: 5-6x faster
    # than one reduce over [n, k / per, per])
    if bits == 1:
        packed = np.packbits(f, axis=1, bitorder="little")
    else:
        packed = f[:, 0::per].copy()
        for i in range(1, per):
            packed |= f[:, i::per] << np.uint8(bits * i)
    out[:, :packed.shape[1]] = packed
    return out


def _f16(meta: np.ndarray, at: int) -> np.ndarray:
    """[n, blocks] float32 of the f16 field at byte `at` of each block's meta [n, blocks, M]."""
    return meta[:, :, at:at + 2].copy().view("<f2")[..., 0].astype(np.float32)


def q3k_scales(s12: np.ndarray) -> np.ndarray:
    """[..., 12] packed Q3_K scale bytes -> [..., 16] 6-bit scales (0..63; ggml's aux / kmask
    unpacking: scale j < 8 takes the low nibble (j < 8: bytes 0..7 low, then high nibbles
    for 8..15) and 2 high bits from bytes 8..11)."""
    lo = np.concatenate([s12[..., 0:8] & 15, s12[..., 0:8] >> 4], axis=-1)
    tmp = s12[..., 8:12]
    hi = np.concatenate([(tmp >> (2 * i)) & 3 for i in range(4)], axis=-1)
    return lo | (hi << 4)


def k4_scales(s12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] packed Q4_K / Q5_K scale bytes -> (sc, mn) [..., 8] (get_scale_min_k4)."""
    sc = np.concatenate([s12[..., 0:4] & 63,
                         (s12[..., 8:12] & 15) | ((s12[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s12[..., 4:8] & 63,
                         (s12[..., 8:12] >> 4) | ((s12[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def sub_scales(ggml_type: int, meta: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(s, mn) float32 [n, blocks, QK / SUB] of every sub-block (mn None without a min)."""
    t = PACKED[ggml_type]
    name = t.name
    if name in ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL"):
        return _f16(meta, 0)[..., None], None
    if name in ("Q4_1", "Q5_1"):
        return _f16(meta, 0)[..., None], _f16(meta, 2)[..., None]
    if name == "Q2_K":
        sc = meta[:, :, 0:16]
        d, dmin = _f16(meta, 16)[..., None], _f16(meta, 18)[..., None]
        return d * (sc & 15).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32))
    if name == "Q3_K":
        sc = q3k_scales(meta[:, :, 0:12]).astype(np.float32)
        return _f16(meta, 12)[..., None] * (sc - 32), None
    if name in ("Q4_K", "Q5_K"):
        sc, mn = k4_scales(meta[:, :, 4:16])
        d, dmin = _f16(meta, 0)[..., None], _f16(meta, 2)[..., None]
        return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
    if name == "Q6_K":
        sc = meta[:, :, 0:16].view(np.int8).astype(np.float32)
        return _f16(meta, 16)[..., None] * sc, None
    if name == "IQ4_XS":
        sh = meta[:, :, 2:4].copy().view("<u2")[..., 0].astype(np.int32)   # [n, blocks]
        sl = meta[:, :, 4:8].astype(np.int32)
        j = np.arange(8)
        ls = ((sl[..., j // 2] >> (4 * (j % 2))) & 15) | (((sh[..., None] >> (2 * j)) & 3) << 4)
        return _f16(meta, 0)[..., None] * (ls - 32).astype(np.float32), None
    raise KeyError(name)


def codes(ggml_type: int, lo: np.ndarray, hi: np.ndarray | None) -> np.ndarray:
    """float32 c of every element from its low and high code bits (uint8 [n, k])."""
    name = PACKED[ggml_type].name
    if name in ("IQ4_NL", "IQ4_XS"):
        return KVALUES[lo].astype(np.float32)
    if name == "Q8_0":
        return lo.view(np.int8).astype(np.float32)
    q = lo.astype(np.int16)
    if hi is not None and name != "Q3_K":
        q = q | (hi.astype(np.int16) << 4)
    offset = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}.get(name, 0)
    if name == "Q3_K":
        offset = np.where(hi != 0, 0, 4)
    return (q - offset).astype(np.float32)


def dequant_f32(q: np.ndarray, qh: np.ndarray | None, meta: np.ndarray, ggml_type: int,
                k: int) -> np.ndarray:
    """float32 [n, k] of planes q uint8 [n, q_row], qh uint8 [n, qh_row] (or None), meta
    uint8 [n, meta_row]: the module docstring's formula."""
    t = PACKED[ggml_type]
    n, blocks = q.shape[0], k // t.qk
    lo = unpack_bits(q, t.low_bits, k)
    hi = unpack_bits(qh, t.high_bits, k) if t.high_bits else None
    c = codes(ggml_type, lo, hi).reshape(n, blocks, t.qk // t.sub, t.sub)
    s, mn = sub_scales(ggml_type, meta.reshape(n, blocks, t.meta_bytes))
    with np.errstate(over="ignore", invalid="ignore"):   # inf / NaN scales stay so
        y = s[..., None] * c
        if mn is not None:
            y = y + mn[..., None]
    return y.reshape(n, k)


def dequant_bf16(q: np.ndarray, qh: np.ndarray | None, meta: np.ndarray, ggml_type: int,
                 k: int) -> np.ndarray:
    """uint16 BF16 bits [n, k] of the planes (dequant_f32, rounded to nearest even)."""
    return f32_to_bf16(dequant_f32(q, qh, meta, ggml_type, k))
