"""MXFP4 weights (gpt-oss's experts as released): the one formula that the grouped GEMM's
tile (kernels/moe_gemm.cu Mxfp4Format) and every host-side use compute. Each value is an
e2m1 code c (bit 3 the sign; magnitude {0, 0.5, 1, 1.5, 2, 3, 4, 6}) times its block's e8m0
scale 2^(s - 127), one scale per 32 consecutive values of a row; two codes a byte, value 2j
in the low nibble of byte j. With s in [SCALE_MIN, SCALE_MAX] every value is a normal float
of three significant bits: exact in FP32 and in BF16 (no rounding, no flush to zero).

Layout on the device: blocks uint8 [E, n, k / 2] (a row's k / 32 blocks of 16 bytes, in
order), scales uint8 [E, n, k / 32]: transformers' `*_blocks` [E, n, k / 32, 16] and
`*_scales` [E, n, k / 32] as stored.
"""
from __future__ import annotations

import numpy as np

from .bf16 import f32_to_bf16

BLOCK = 32                  # values per scale
SCALE_MIN, SCALE_MAX = 2, 252   # 0.5 * 2^(s-127) normal; 6 * 2^(s-127) finite
# e2m1 code -> value (transformers' FP4_VALUES)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequant_f32(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., n, k] of blocks uint8 [..., n, k / 2] and scales uint8 [..., n, k / 32]
    (exact)."""
    b = np.asarray(blocks, np.uint8)
    codes = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.uint8)
    codes[..., 0::2] = b & 0x0F
    codes[..., 1::2] = b >> 4
    vals = E2M1[codes]
    k = vals.shape[-1]
    scale = np.ldexp(np.float32(1.0), np.asarray(scales, np.int32) - 127).astype(np.float32)
    vals = vals.reshape(vals.shape[:-1] + (k // BLOCK, BLOCK)) * scale[..., None]
    return vals.reshape(vals.shape[:-2] + (k,)).astype(np.float32)


def dequant_bf16(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """uint16 BF16 bits [..., n, k] of the same values (exact: no rounding happens)."""
    return f32_to_bf16(dequant_f32(blocks, scales))
