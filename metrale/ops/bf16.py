"""BF16 <-> FP32 on the host, bit-exact with the device (`__float2bfloat16_rn`).

BF16 values live in `uint16` arrays. BF16 -> FP32 is exact (`bits << 16`); FP32 -> BF16
rounds to nearest, ties to even, and turns every NaN into the canonical BF16 NaN 0x7FFF, as
the device's `cvt.rn.bf16.f32` (what `__float2bfloat16_rn` compiles to on sm_80+) and the
EmuBackend do; a NaN's sign and payload are not kept.
"""
from __future__ import annotations

import numpy as np

CANONICAL_NAN = 0x7FFF  # CUDART_NAN_BF16


# The conversions run in HostBackend's native library (gpu_runtime/native/convert_bf16.cpp)
# when this machine could build it: one pass instead of numpy's several. Both are exact
# integer maps, so the bits are the same either way. FP32 -> BF16 goes there at every size
# (3-5 us a call against numpy's 6-16); the widening, one numpy pass, only from this many
# elements (below it the ctypes call costs more than it saves).
NATIVE_MIN_ELEMENTS = 1 << 14


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 BF16 bits (any shape) -> float32, exactly."""
    bits = np.asarray(bits, dtype=np.uint16)
    nat = _native() if bits.size >= NATIVE_MIN_ELEMENTS and bits.flags.c_contiguous else None
    if nat is not None:
        return nat.bf16_to_f32(bits, np.empty(bits.shape, np.float32))
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 (any shape) -> uint16 BF16 bits, round to nearest even, NaN -> 0x7FFF."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    nat = _native()
    if nat is not None:
        return nat.f32_to_bf16(x, np.empty(x.shape, np.uint16))
    return f32_to_bf16_numpy(x)


def f32_to_bf16_numpy(x: np.ndarray) -> np.ndarray:
    """`f32_to_bf16` in numpy alone (the rule the native conversion is checked against)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    t = u >> 16            # in place from here: this runs on every twin output
    t &= 1
    t += 0x7FFF
    t += u                 # wraps modulo 2^32 only for NaNs, replaced below
    t >>= 16
    out = t.astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        out[nan] = CANONICAL_NAN
    return out


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> float32 rounded through BF16 (what storing to a bf16 buffer does)."""
    return bf16_to_f32(f32_to_bf16(x))


def _native():
    """The native library, or None (no compiler): looked up once per process."""
    from ..gpu_runtime import native
    return native.try_load()
