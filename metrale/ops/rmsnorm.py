"""The norm family (kernels/rmsnorm.cu, module "rmsnorm"): RMSNorm with an optional fused
residual add, and LayerNorm. Launchers and numpy twins.

RMSNorm order (HF LlamaRMSNorm / Qwen2RMSNorm with BF16 weights, `weight *
hidden_states.to(input_dtype)`): normalize in FP32, round to BF16, multiply by the BF16
weight in FP32, round to BF16. With `residual_ptr`: residual = bf16(residual + x) is stored
back first and the stored row is normalized (HF's BF16 `residual + hidden_states`).
`weight_mode` (WEIGHT_MODES) picks how the weight applies: "llama" the two roundings above;
"once" bf16(x * inv * w), one rounding (HF GptOssRMSNorm); "gemma" bf16(x * inv * (1 + w)),
one rounding (HF Gemma2RMSNorm / Gemma3RMSNorm, whose weights are stored centred on 0).
LayerNorm: FP32 mean and variance (two-pass), (x - mu) * rsqrt(var + eps) * w + b, one
rounding (torch's LayerNorm kernel for BF16 input).

RMSNorm: one warp per row, 4 rows per CTA, in the fixed order of kernels/norm_row.cuh (the
decode GEMM that normalizes its own X tiles, ops/gemm_fused.py, sums in that order too).
LayerNorm: one CTA per row. Any hidden >= 1 (128-bit accesses when hidden % 8 == 0 and every
pointer is 16-byte aligned, one element per access otherwise). out may equal x.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import NULL, DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16, round_bf16
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "rmsnorm"
RMSNORM_ROWS_PER_CTA = 4   # NORM_ROWS_PER_CTA of kernels/rmsnorm.cu
# rmsnorm's weight modes (kernels/norm_row.cuh RMS_WEIGHT_*)
WEIGHT_MODES = {"llama": 0, "once": 1, "gemma": 2}


def _threads(hidden: int) -> int:
    """About one 8-element vector (or one element on the scalar path) per thread."""
    units = hidden // 8 if hidden % 8 == 0 else hidden
    return int(min(1024, max(32, -(-units // 32) * 32)))


def _check(what: str, n_rows: int, hidden: int, eps: float, **ptrs) -> None:
    check_sizes(what, n_rows=n_rows, hidden=hidden)
    if not (math.isfinite(float(eps)) and float(eps) >= 0.0):
        raise InvalidArgument(f"{what}: eps must be finite and >= 0, got {eps}")
    check_ptrs(what, **ptrs)


def rmsnorm(backend, stream: int, out_ptr, x_ptr, weight_ptr, n_rows: int, hidden: int,
            eps: float, residual_ptr=NULL, weight_mode: str = "llama") -> None:
    """out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w), row by row (`weight_mode` "once":
    bf16(x * rsqrt(..) * w); "gemma": bf16(x * rsqrt(..) * (1 + w))).

    x, out: [n_rows, hidden] bf16; weight: [hidden] bf16. With residual_ptr ([n_rows,
    hidden] bf16): residual = bf16(residual + x) in place, then out = rmsnorm(residual) * w.
    """
    _check("rmsnorm", n_rows, hidden, eps, out_ptr=out_ptr, x_ptr=x_ptr, weight_ptr=weight_ptr)
    if weight_mode not in WEIGHT_MODES:
        raise InvalidArgument(f"rmsnorm: weight_mode must be one of {sorted(WEIGHT_MODES)}, "
                              f"got {weight_mode!r}")
    if residual_ptr is None:
        residual_ptr = NULL
    backend.launch(backend.kernel(MODULE, "rmsnorm"),
                   (-(-int(n_rows) // RMSNORM_ROWS_PER_CTA),), (32 * RMSNORM_ROWS_PER_CTA,),
                   0, stream,
                   (DevicePtr(out_ptr), DevicePtr(x_ptr), DevicePtr(weight_ptr),
                    DevicePtr(residual_ptr), np.int32(n_rows), np.int32(hidden),
                    np.float32(eps), np.int32(WEIGHT_MODES[weight_mode])))


def layernorm(backend, stream: int, out_ptr, x_ptr, weight_ptr, bias_ptr, n_rows: int,
              hidden: int, eps: float) -> None:
    """out = bf16((x - mean) * rsqrt(var + eps) * w + b), row by row (biased variance).

    x, out: [n_rows, hidden] bf16; weight, bias: [hidden] bf16.
    """
    _check("layernorm", n_rows, hidden, eps, out_ptr=out_ptr, x_ptr=x_ptr,
           weight_ptr=weight_ptr, bias_ptr=bias_ptr)
    backend.launch(backend.kernel(MODULE, "layernorm"), (int(n_rows),),
                   (_threads(int(hidden)),), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(x_ptr), DevicePtr(weight_ptr),
                    DevicePtr(bias_ptr), np.int32(n_rows), np.int32(hidden), np.float32(eps)))


def whole_or_apart(nbytes: int, *ptrs) -> bool:
    """Each pair of the non-NULL ranges [p, p + nbytes) identical or disjoint (what the
    native row routine handles: it reads a row whole before writing it)."""
    ps = sorted({int(p) for p in ptrs if int(p)})
    return all(b - a >= nbytes for a, b in zip(ps, ps[1:]))


@twin(MODULE, "rmsnorm")
def rmsnorm_twin(ctx, out_ptr, x_ptr, weight_ptr, residual_ptr, n_rows, hidden, eps,
                 weight_mode) -> None:
    r, h, mode = int(n_rows), int(hidden), int(weight_mode)
    nat = ctx.native_rows
    if nat is not None and whole_or_apart(r * h * 2, x_ptr, out_ptr, residual_ptr):
        # the same bits as below (native/norm_rope_act.cpp), a few microseconds a row;
        # its modes: 0 llama, 1 once, 2 w + offset (gemma: offset 1)
        nat.rmsnorm(ctx.write_addr(out_ptr, r * h * 2), ctx.read_addr(x_ptr, r * h * 2),
                    ctx.read_addr(weight_ptr, h * 2),
                    ctx.write_addr(residual_ptr, r * h * 2) if int(residual_ptr) else 0,
                    r, h, float(eps), mode, 1.0 if mode == WEIGHT_MODES["gemma"] else 0.0)
        return
    x_all = ctx.read(x_ptr, r * h, np.uint16).reshape(r, h)
    w = bf16_to_f32(ctx.read(weight_ptr, h, np.uint16))
    res_all = ctx.view(residual_ptr, r * h, np.uint16).reshape(r, h) \
        if int(residual_ptr) != 0 else None
    out = ctx.view(out_ptr, r * h, np.uint16).reshape(r, h)
    if np.may_share_memory(x_all, out) or \
            (res_all is not None and np.may_share_memory(x_all, res_all)):
        x_all = x_all.copy()   # in place: blocks must not see rows another block wrote

    def rows(lo: int, hi: int) -> None:   # one row's result never depends on another's
        x = bf16_to_f32(x_all[lo:hi])
        if res_all is not None:
            res = res_all[lo:hi]
            s = f32_to_bf16(bf16_to_f32(res) + x)
            res[:] = s
            x = bf16_to_f32(s)
        out[lo:hi] = rmsnorm_bits(x, w, eps, mode)
    ctx.map_blocks(r, max(1, (1 << 18) // h), rows)   # ~1 MiB of float32 per block


def rmsnorm_bits(x: np.ndarray, w: np.ndarray, eps: float, mode: int = 0) -> np.ndarray:
    """The twin's RMSNorm of float32 rows x [r, h] (BF16 values) with weight w [h] (float32
    of BF16) in weight mode `mode` (a WEIGHT_MODES value, checked by the launcher): BF16
    bits [r, h]. numpy's pairwise float32 sum of squares."""
    h = x.shape[1]
    ss = np.sum(x * x, axis=1, dtype=np.float32)
    inv = (np.float32(1.0) / np.sqrt(ss / np.float32(h) + np.float32(eps))).astype(np.float32)
    if mode == WEIGHT_MODES["llama"]:
        return f32_to_bf16(round_bf16(x * inv[:, None]) * w[None, :])
    scale = w + np.float32(1.0) if mode == WEIGHT_MODES["gemma"] else w
    return f32_to_bf16((x * inv[:, None]) * scale[None, :])


@twin(MODULE, "layernorm")
def layernorm_twin(ctx, out_ptr, x_ptr, weight_ptr, bias_ptr, n_rows, hidden, eps) -> None:
    r, h = int(n_rows), int(hidden)
    x = bf16_to_f32(ctx.read(x_ptr, r * h, np.uint16)).reshape(r, h)
    w = bf16_to_f32(ctx.read(weight_ptr, h, np.uint16))
    b = bf16_to_f32(ctx.read(bias_ptr, h, np.uint16))
    mu = (np.sum(x, axis=1, dtype=np.float32) / np.float32(h)).astype(np.float32)
    d = x - mu[:, None]
    var = (np.sum(d * d, axis=1, dtype=np.float32) / np.float32(h)).astype(np.float32)
    inv = (np.float32(1.0) / np.sqrt(var + np.float32(eps))).astype(np.float32)
    y = (d * inv[:, None]) * w[None, :] + b[None, :]
    ctx.view(out_ptr, r * h, np.uint16).reshape(r, h)[:] = f32_to_bf16(y)
