"""ggml's block formats dequantized to float32, then BF16, at load.

A quantized row of K elements is K / QK blocks of the layouts below (ggml-common.h), each
block one record of little-endian fields; `d`, `m`, `dmin` are IEEE half floats; values
`y` are float32. Element `i` of a block:

  Q4_0  QK 32, 18 B: d f16 | qs[16] u8.      q = (qs[i] & 15 if i < 16 else qs[i-16] >> 4);
                                             y = d * (q - 8)
  Q4_1  QK 32, 20 B: d f16 | m f16 | qs[16]. q as Q4_0; y = d * q + m
  Q5_0  QK 32, 22 B: d f16 | qh u32 | qs[16]. q = Q4_0's nibble | ((qh >> i) & 1) << 4;
                                             y = d * (q - 16)
  Q5_1  QK 32, 24 B: d f16 | m f16 | qh u32 | qs[16]. q as Q5_0; y = d * q + m
  Q8_0  QK 32, 34 B: d f16 | qs[32] i8.      y = d * qs[i]
  Q4_K  QK 256, 144 B: d f16 | dmin f16 | scales[12] | qs[128]. Eight sub-blocks of 32
        with 6-bit scale sc[j] and min mn[j] (get_scale_min_k4): j < 4: sc = s[j] & 63,
        mn = s[j+4] & 63; j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
        mn = (s[j+4] >> 4) | (s[j] >> 6) << 4. Chunk c of 64 elements reads qs[32c:32c+32]:
        low nibbles are sub-block 2c, high nibbles sub-block 2c+1;
        y = (d * sc[j]) * q - dmin * mn[j]
  Q5_K  QK 256, 176 B: d | dmin | scales[12] | qh[32] | qs[128]. As Q4_K, and element l of
        sub-block j gets the high bit (qh[l] >> j) & 1: q = nibble | bit << 4
  Q6_K  QK 256, 210 B: ql[128] | qh[64] | scales[16] i8 | d f16. Half h (128 elements)
        reads ql[64h:64h+64], qh[32h:32h+32]; for l < 32 its four quarters are
        (ql[l] & 15, ql[l+32] & 15, ql[l] >> 4, ql[l+32] >> 4) | ((qh[l] >> 2k) & 3) << 4,
        k = 0..3 (quarter k at 32k + l); y = (d * scales[p // 16]) * (q - 32), p the
        element's position in the super-block
  Q2_K, Q3_K, IQ4_NL, IQ4_XS: through the device's planes (formats/gguf/packed.py splits the
        blocks, ops/gguf_planes.py's `dequant_f32` is their formula and layouts' one
        implementation, the one every GGUF kernel computes)
  F32 / F16 / BF16: plain values, ne[0] contiguous.

Exactness: in every format the product of the block scale(s) and q is exact in float32
(at most 11 + 8 + 6 significant bits, never more than one rounding, in Q6_K's last
multiply) and at most one addition follows, so the float32 values here are the exact real
values rounded once, whatever the order or FMA contraction of ggml's own loops; BF16 is
their round-to-nearest-even (ops/bf16.py). tests/formats/test_gguf_quants.py checks every
type against a float64 implementation of these layouts and against `gguf.quants`.
"""
from __future__ import annotations

import numpy as np

from ...errors import Unsupported
from ...ops.bf16 import f32_to_bf16
from ...ops.gguf_planes import dequant_f32
from .file import GGML_TYPES, file_type_name
from .packed import split_blocks

F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
Q2_K, Q3_K, IQ4_NL, IQ4_XS = 10, 11, 20, 23
# blocks dequantized per step: bounds the float32 temporaries at ~4 MiB
_CHUNK_ELEMENTS = 1 << 20


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """[n, 1] float32 of the f16 field at byte `at` of each block."""
    return blocks[:, at:at + 2].copy().view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: low nibbles, then high nibbles."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _high_bits(blocks: np.ndarray, at: int) -> np.ndarray:
    """[n, 32] bit i of the u32 at byte `at`, shifted to 16."""
    qh = blocks[:, at:at + 4].copy().view("<u4")          # [n, 1]
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _q4_0(b):
    return _half(b, 0) * (_nibbles(b[:, 2:18]).astype(np.float32) - 8)


def _q4_1(b):
    return _half(b, 0) * _nibbles(b[:, 4:20]).astype(np.float32) + _half(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:22]) | _high_bits(b, 2)
    return _half(b, 0) * (q.astype(np.float32) - 16)


def _q5_1(b):
    q = _nibbles(b[:, 8:24]) | _high_bits(b, 4)
    return _half(b, 0) * q.astype(np.float32) + _half(b, 2)


def _q8_0(b):
    return _half(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 12] packed bytes -> (sc, mn) [n, 8] of the 6-bit scales and mins."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], 1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] -> [n, 8, 32]: chunk c's low nibbles are sub-block 2c, high ones 2c+1."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    q = _k_nibbles(b[:, 16:144]).astype(np.float32)
    y = (_half(b, 0) * sc)[:, :, None] * q - (_half(b, 2) * mn)[:, :, None]
    return y.reshape(-1, 256)


def _q5_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]                                      # [n, 32]: bit j -> sub-block j
    hi = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (_k_nibbles(b[:, 48:176]) | (hi << 4)).astype(np.float32)
    y = (_half(b, 0) * sc)[:, :, None] * q - (_half(b, 2) * mn)[:, :, None]
    return y.reshape(-1, 256)


def _q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 64)
    qh = b[:, 128:192].reshape(-1, 2, 32)
    lo = np.stack([ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4,
                   ql[:, :, 32:] >> 4], axis=2)           # [n, 2, 4, 32]
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = (lo | (hi << 4)).astype(np.float32).reshape(-1, 16, 16) - 32
    scale = _half(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)   # [n, 16]
    return (scale[:, :, None] * q).reshape(-1, 256)


def _through_planes(ggml_type: int):
    """The dequantizer of `ggml_type` from its planes: each block a row of one block."""
    qk = GGML_TYPES[ggml_type][1]

    def dequant(b):
        p = split_blocks(b.reshape(-1), ggml_type, b.shape[0], qk)
        return dequant_f32(p.q, p.qh, p.meta, ggml_type, qk)
    return dequant


BLOCK_DEQUANT = {Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0,
                 Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k,
                 **{t: _through_planes(t) for t in (Q2_K, Q3_K, IQ4_NL, IQ4_XS)}}
SUPPORTED = (F32, F16, BF16, *BLOCK_DEQUANT)
SUPPORTED_NAMES = tuple(GGML_TYPES[t][0] for t in SUPPORTED)


def check_supported(ggml_type: int, where: str) -> None:
    """Unsupported naming the type when it is not one of SUPPORTED."""
    if ggml_type not in SUPPORTED:
        name = GGML_TYPES.get(ggml_type, (f"ggml type {ggml_type}",))[0]
        raise Unsupported(f"{where}: tensor type {name} is not supported (supported: "
                          f"{', '.join(SUPPORTED_NAMES)})")


def check_tensor_types(tensors, fields: dict, where: str) -> None:
    """Unsupported naming the file's general.file_type and every stored type not in
    SUPPORTED, with its tensor count and a first tensor (file order), most tensors first:
    an IQ4_XS file holds a few IQ4_NL tensors too, and naming only the first tensor's type
    would misname the file."""
    bad: dict[str, list[str]] = {}
    for info in tensors.values():
        if info.ggml_type not in SUPPORTED:
            bad.setdefault(info.type_name, []).append(info.name)
    if not bad:
        return
    kinds = ", ".join(f"{t} ({len(names)} tensor{'s' if len(names) > 1 else ''}, e.g. "
                      f"{names[0]})" for t, names in sorted(bad.items(),
                                                            key=lambda kv: -len(kv[1])))
    ftype = file_type_name(fields)
    what = f"a {ftype} file (general.file_type)" if ftype else "the file"
    raise Unsupported(f"{where}: {what} holds tensor types metrale cannot read: {kinds} "
                      f"(supported: {', '.join(SUPPORTED_NAMES)})")


def dequantize_f32(raw: np.ndarray, ggml_type: int, n: int) -> np.ndarray:
    """`n` float32 values of the stored bytes `raw` (uint8) of one tensor, flat."""
    check_supported(ggml_type, "dequantize")
    if ggml_type == F32:
        return raw.view("<f4")[:n].copy()
    if ggml_type == F16:
        return raw.view("<f2")[:n].astype(np.float32)
    if ggml_type == BF16:
        return (raw.view("<u2")[:n].astype(np.uint32) << 16).view(np.float32)
    _, qk, size = GGML_TYPES[ggml_type]
    with np.errstate(invalid="ignore", over="ignore"):   # inf / NaN scales stay so
        return BLOCK_DEQUANT[ggml_type](raw.reshape(-1, size)).reshape(-1)[:n]


def dequantize_bf16(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...],
                    out: np.ndarray | None = None, native: bool | None = None) -> np.ndarray:
    """uint16 BF16 bits [*shape] of a stored tensor (`raw`: its uint8 bytes): its float32
    values (dequantize_f32) rounded to nearest even; BF16 tensors are copied as they are.

    native: the compiled loop of gpu_runtime/native/dequant_gguf.cpp (None: where this
    machine has it, False: numpy, in chunks that keep the float32 temporaries small).
    A type the library lacks (it says so: Q2_K, Q3_K, IQ4_NL, IQ4_XS there today) takes
    numpy either way. The bits are the same either way."""
    check_supported(ggml_type, "dequantize")
    n = int(np.prod(shape, dtype=np.int64))
    _, qk, size = GGML_TYPES[ggml_type]
    if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size != n // qk * size or n % qk:
        raise ValueError(f"dequantize_bf16: {n} elements of {GGML_TYPES[ggml_type][0]} "
                         f"take {n // qk * size} bytes, got {raw.size}")
    if out is None:
        out = np.empty(n, np.uint16)
    flat = out.reshape(-1)
    if ggml_type == BF16:
        flat[:] = raw.view("<u2")
        return out.reshape(shape)
    lib = _native() if native is None or native else None
    if native and lib is None:
        raise Unsupported("dequantize_bf16(native=True): the native library is unavailable")
    if lib is not None and lib.gguf_dequant_bf16(ggml_type, np.ascontiguousarray(raw), flat):
        return out.reshape(shape)
    step = max(_CHUNK_ELEMENTS // qk, 1) * qk           # elements per chunk, whole blocks
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        part = raw[lo // qk * size:hi // qk * size]
        flat[lo:hi] = f32_to_bf16(dequantize_f32(part, ggml_type, hi - lo))
    return out.reshape(shape)


def _native():
    from ...gpu_runtime import native
    lib = native.try_load()
    return lib if lib is not None and hasattr(lib, "gguf_dequant_bf16") else None
