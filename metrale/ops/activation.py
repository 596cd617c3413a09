"""Activations (kernels/activation.cu): launchers and numpy twins. FP32 math, one BF16
rounding per stored element.

  act_mul: out[r, c] = bf16(act(g) * u), gate_up [n_rows, 2*I] = [gate | up], out [n_rows, I];
           act one of ACTIVATIONS: silu, gelu (erf), gelu_tanh, relu, quick_gelu; or
           "swiglu_clamp" (gpt-oss's experts, act_mul only): g' = min(g, limit),
           u' = clamp(u, -limit, limit), out = bf16((u' + 1) * g' * sigmoid(alpha * g'))
  gelu:    out = bf16(gelu(x)); approximate "none" (erf), "tanh", "quick" (x*sigmoid(1.702x))

HF computes act(gate) in BF16 before the multiply (two roundings); the fused kernel rounds
once (within one BF16 ulp of HF). Any sizes >= 1 (128-bit accesses when aligned).
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs as _check_ptrs
from .checks import check_sizes as _check_sizes
from .registry import twin

MODULE = "activation"
THREADS = 256
_MAX_BLOCKS = 8192
GELU_MODES = {"none": 0, "tanh": 1, "quick": 2}
# act_mul's `act` codes (kernels/activation.cu ACT_*)
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "quick_gelu": 4}
SWIGLU_CLAMP = 5   # act_mul's clamped SwiGLU (not an act(gate) * up: the fused GEMMs lack it)

_erf = np.frompyfunc(math.erf, 1, 1)


def act_mul(backend, stream: int, out_ptr, gate_up_ptr, n_rows: int, intermediate: int,
            act: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> None:
    """out = act(gate) * up (a gated MLP). gate_up: [n_rows, 2*intermediate] bf16 (gate
    columns first); out: [n_rows, intermediate] bf16; act: a key of ACTIVATIONS, or
    "swiglu_clamp" with its alpha and limit (finite, limit > 0)."""
    if act not in ACTIVATIONS and act != "swiglu_clamp":
        raise InvalidArgument(f"act_mul: act must be one of "
                              f"{sorted(ACTIVATIONS) + ['swiglu_clamp']}, got {act!r}")
    if act == "swiglu_clamp" and not (math.isfinite(alpha) and math.isfinite(limit)
                                      and limit > 0):
        raise InvalidArgument(f"act_mul: swiglu_clamp needs a finite alpha and limit > 0, "
                              f"got alpha={alpha}, limit={limit}")
    _check_sizes("act_mul", n_rows=n_rows, intermediate=intermediate)
    if 2 * int(intermediate) >= 2**31:
        raise InvalidArgument(f"act_mul: 2*intermediate must be < 2^31, got {2 * intermediate}")
    _check_ptrs("act_mul", out_ptr=out_ptr, gate_up_ptr=gate_up_ptr)
    # the blocks of one row share it (8 elements a thread): a decode row spans several SMs
    col_blocks = max(1, min(-(-int(intermediate) // (8 * THREADS)), 65535))
    backend.launch(backend.kernel(MODULE, "act_mul"), (int(n_rows), col_blocks), (THREADS,),
                   0, stream,
                   (DevicePtr(out_ptr), DevicePtr(gate_up_ptr), np.int32(n_rows),
                    np.int32(intermediate), np.int32(ACTIVATIONS.get(act, SWIGLU_CLAMP)),
                    np.float32(alpha), np.float32(limit)))


def gelu(backend, stream: int, out_ptr, x_ptr, n: int, approximate: str = "none") -> None:
    """out = gelu(x). x, out: [n] bf16 (out may equal x). approximate: "none" | "tanh" |
    "quick"."""
    if approximate not in GELU_MODES:
        raise InvalidArgument(f"gelu: approximate must be one of {sorted(GELU_MODES)}, "
                              f"got {approximate!r}")
    _check_sizes("gelu", n=n)
    _check_ptrs("gelu", out_ptr=out_ptr, x_ptr=x_ptr)
    chunks = -(-int(n) // 8)
    grid = max(1, min(-(-chunks // THREADS), _MAX_BLOCKS))
    backend.launch(backend.kernel(MODULE, "gelu"), (grid,), (THREADS,), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(x_ptr), np.int32(n),
                    np.int32(GELU_MODES[approximate])))


def silu_f32(g: np.ndarray) -> np.ndarray:
    """g / (1 + exp(-g)) in float32 (a new array; each step rounds as the kernel's)."""
    g = np.asarray(g, np.float32)
    with np.errstate(over="ignore"):
        e = np.negative(g)
        np.exp(e, out=e)
        e += np.float32(1.0)
        return np.divide(g, e, out=e)


def act_f32(g: np.ndarray, code: int) -> np.ndarray:
    """act(g) in FP32 for an ACTIVATIONS code (NaN for an unknown one, like the kernel)."""
    g = np.asarray(g, np.float32)
    if code == ACTIVATIONS["silu"]:
        return silu_f32(g)
    if code == ACTIVATIONS["relu"]:
        return np.where(g < 0, np.float32(0.0), g).astype(np.float32)  # NaN stays NaN
    gelu_mode = {ACTIVATIONS["gelu"]: 0, ACTIVATIONS["gelu_tanh"]: 1,
                 ACTIVATIONS["quick_gelu"]: 2}.get(code)
    if gelu_mode is None:
        return np.full(g.shape, np.nan, np.float32)
    return gelu_f32(g, gelu_mode)


def gelu_f32(x: np.ndarray, mode: int) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if mode == 0:
        e = _erf(x.astype(np.float64) * np.float64(0.7071067811865476)).astype(np.float32)
        return (np.float32(0.5) * x * (np.float32(1.0) + e)).astype(np.float32)
    if mode == 1:
        inner = np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)
        return (np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))).astype(np.float32)
    if mode == 2:
        with np.errstate(over="ignore"):
            return (x / (np.float32(1.0) + np.exp(np.float32(-1.702) * x))).astype(np.float32)
    raise InvalidArgument(f"gelu: unknown mode {mode}")


def swiglu_clamp_f32(g: np.ndarray, u: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """gpt-oss's clamped SwiGLU in float32 steps, as the kernel."""
    a, lim = np.float32(alpha), np.float32(limit)
    gc = np.minimum(np.asarray(g, np.float32), lim)
    uc = np.clip(np.asarray(u, np.float32), -lim, lim)
    with np.errstate(over="ignore"):
        sig = gc / (np.float32(1.0) + np.exp(-a * gc))
    return ((uc + np.float32(1.0)) * sig).astype(np.float32)


@twin(MODULE, "act_mul")
def act_mul_twin(ctx, out_ptr, gate_up_ptr, n_rows, intermediate, act, alpha, limit) -> None:
    r, i = int(n_rows), int(intermediate)
    nat = ctx.native_rows
    if nat is not None and int(act) == ACTIVATIONS["silu"] and \
            (int(out_ptr) + r * i * 2 <= int(gate_up_ptr) or
             int(gate_up_ptr) + r * i * 4 <= int(out_ptr)):
        # native/norm_rope_act.cpp: C's expf where numpy has its own SIMD exp (2 ulps apart
        # at most in float32, so the BF16 output differs only on a rounding boundary)
        nat.silu_mul(ctx.write_addr(out_ptr, r * i * 2), ctx.read_addr(gate_up_ptr, r * i * 4),
                     r, i)
        return
    gate_up = ctx.read(gate_up_ptr, r * 2 * i, np.uint16).reshape(r, 2 * i)
    out = ctx.view(out_ptr, r * i, np.uint16).reshape(r, i)

    def rows(lo: int, hi: int) -> None:   # rows are independent
        gu = bf16_to_f32(gate_up[lo:hi])
        if int(act) == SWIGLU_CLAMP:
            out[lo:hi] = f32_to_bf16(swiglu_clamp_f32(gu[:, :i], gu[:, i:], float(alpha),
                                                      float(limit)))
            return
        with np.errstate(invalid="ignore"):
            y = act_f32(gu[:, :i], int(act))
            y *= gu[:, i:]
        out[lo:hi] = f32_to_bf16(y)
    # blocks of ~1 MiB of float32 keep the temporaries in cache
    ctx.map_blocks(r, max(1, (1 << 20) // (8 * i)), rows)


@twin(MODULE, "gelu")
def gelu_twin(ctx, out_ptr, x_ptr, n, mode) -> None:
    n = int(n)
    x = bf16_to_f32(ctx.read(x_ptr, n, np.uint16))
    ctx.view(out_ptr, n, np.uint16)[:] = f32_to_bf16(gelu_f32(x, int(mode)))
