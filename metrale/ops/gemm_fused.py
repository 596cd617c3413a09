"""Decode GEMMs with their neighbours fused in (the 16x16 tile of kernels/gemm_tc.cu, module
"gemm_tc", for BF16 W; of kernels/gemm_q.cu, module "gemm_q", for a quantized W given as a
gemm_q.QuantW): fewer launches per decode step, the same bits as the separate kernels.

    gemm_rmsnorm        y = rmsnorm(x; norm_weight, eps) @ W^T (+ b)  replaces rmsnorm + GEMM
                                                                            (+ add_bias)
    gemm_actmul_residual residual = bf16(residual + bf16(act_mul(gate_up) @ W^T))
                                                                 replaces act_mul + GEMM + add
    gemm_residual       residual = bf16(residual + bf16(x @ W^T))     replaces GEMM + add

A batch-1 decode step of an 8B model on an H100 is ~4 ms of weight reads over ~320 launches
of a few microseconds each: every launch that goes is ~1% (the emulator's estimate,
benchmarks/results/emu_profile.json). The kernel hands the MMAs exactly the X values that
rmsnorm / act_mul would have stored (the RMSNorm factor in kernels/norm_row.cuh's order, which
the rmsnorm kernel uses too; act() from kernels/activation.cuh), and the residual add is
rmsnorm's own (bf16 of the float sum of two BF16 values), so a row gets the bits of the
unfused sequence and the model may fuse its decode steps while prefill stays unfused
(layers.py). The twins are the unfused twins run in sequence on host scratch rows.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import NULL, DevicePtr
from .activation import ACTIVATIONS, act_f32
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs, check_sizes
from . import gemm_q
from .gemm_q import QuantW, fp8_rows_at, fp8_rows_twin, q4_rows_at, q4_rows_twin
from .gemm_tc import MODULE, TILES, gemm_rows_at, gemm_rows_twin
from .registry import twin
from .rmsnorm import rmsnorm_bits

_TILE = TILES["16x16"]
_MAX_GRID_Y = 65535


def _grid(what: str, m: int, n: int, k: int, w, **ptrs) -> tuple[int, int]:
    check_sizes(what, m=m, n=n, k=k)
    check_ptrs(what, **ptrs)
    if isinstance(w, QuantW):
        if (w.n, w.k) != (n, k):
            raise InvalidArgument(f"{what}: W of shape [{w.n}, {w.k}] used as [{n}, {k}]")
        w.check(what, m)
    else:
        check_ptrs(what, w_ptr=w)
    grid = _TILE.grid(m, n)
    if grid[1] > _MAX_GRID_Y:
        raise InvalidArgument(f"{what}: n = {n} exceeds {_MAX_GRID_Y * _TILE.bn} (grid.y limit)")
    return grid


def _launch(backend, stream, grid, w, fused: str, head: tuple, mnk: tuple, tail: tuple):
    """Launch W's entry for `fused` ("rmsnorm", "actmul_res", "res") with the arguments
    head, W's pointers, tail[0], (m, n, k), W's scalars, tail[1]: every entry's order."""
    if isinstance(w, QuantW):   # gemm_q_decode.cuh: one warp a CTA
        module, func, threads = gemm_q.MODULE, f"gemm_{w.fmt}_bf16_16x16_{fused}", 32
        ptrs = tuple(DevicePtr(p) for p in w.ptrs)
        scalars = tuple(np.int32(v) for v in w.scalars)
    else:
        module, func, threads = MODULE, f"gemm_tc_bf16_16x16_{fused}", _TILE.threads
        ptrs, scalars = (DevicePtr(w),), ()
    pre, post = tail
    backend.launch(backend.kernel(module, func), grid, (threads,), 0, stream,
                   (*head, *ptrs, *pre, *(np.int32(v) for v in mnk), *scalars, *post))


def _apart(what: str, a: str, a_ptr, a_bytes: int, b: str, b_ptr, b_bytes: int) -> None:
    a0, b0 = int(a_ptr), int(b_ptr)
    if a0 < b0 + b_bytes and b0 < a0 + a_bytes:
        raise InvalidArgument(f"{what}: {a} must not overlap {b} (other CTAs still read it)")


def gemm_rmsnorm(backend, stream: int, y_ptr, x_ptr, w, norm_weight_ptr, m: int, n: int,
                 k: int, eps: float, bias_ptr=NULL) -> None:
    """y[m, n] = rmsnorm(x[m, k]; norm_weight, eps) @ W[n, k]^T (+ bias), BF16 out.

    x: [m, k] bf16 (the residual stream); norm_weight: [k] bf16; w: W bf16 [n, k] (a
    pointer) or a gemm_q.QuantW; bias: [n] bf16 or NULL; y: [m, n] bf16, not overlapping x.
    Bits: rmsnorm.rmsnorm into a buffer, gemm_tc / gemm_q, then elementwise.add_bias.
    """
    grid = _grid("gemm_rmsnorm", m, n, k, w, y_ptr=y_ptr, x_ptr=x_ptr,
                 norm_weight_ptr=norm_weight_ptr)
    bias_ptr = NULL if bias_ptr is None else bias_ptr
    if not (math.isfinite(float(eps)) and float(eps) >= 0.0):
        raise InvalidArgument(f"gemm_rmsnorm: eps must be finite and >= 0, got {eps}")
    _apart("gemm_rmsnorm", "y", y_ptr, m * n * 2, "x", x_ptr, m * k * 2)
    _launch(backend, stream, grid, w, "rmsnorm", (DevicePtr(y_ptr), DevicePtr(x_ptr)),
            (m, n, k), ((DevicePtr(norm_weight_ptr), DevicePtr(bias_ptr)), (np.float32(eps),)))


def gemm_actmul_residual(backend, stream: int, residual_ptr, gate_up_ptr, w, m: int,
                         n: int, k: int, act: str = "silu") -> None:
    """residual[m, n] = bf16(residual + bf16(act_mul(gate_up) @ W[n, k]^T)).

    gate_up: [m, 2k] bf16 (gate columns, then up: act_mul's input); act: a key of
    ACTIVATIONS (as act_mul); w: W bf16 [n, k] (a pointer) or a gemm_q.QuantW; residual:
    [m, n] bf16, not overlapping gate_up. Bits: act_mul, gemm_tc / gemm_q, then the residual
    add of rmsnorm.
    """
    grid = _grid("gemm_actmul_residual", m, n, k, w, residual_ptr=residual_ptr,
                 gate_up_ptr=gate_up_ptr)
    if act not in ACTIVATIONS:
        raise InvalidArgument(f"gemm_actmul_residual: act must be one of "
                              f"{sorted(ACTIVATIONS)}, got {act!r}")
    _apart("gemm_actmul_residual", "residual", residual_ptr, m * n * 2, "gate_up",
           gate_up_ptr, m * k * 4)
    _launch(backend, stream, grid, w, "actmul_res",
            (DevicePtr(residual_ptr), DevicePtr(gate_up_ptr)), (m, n, k),
            ((), (np.int32(ACTIVATIONS[act]),)))


def gemm_residual(backend, stream: int, residual_ptr, x_ptr, w, m: int, n: int,
                  k: int) -> None:
    """residual[m, n] = bf16(residual + bf16(x[m, k] @ W[n, k]^T)).

    x: [m, k] bf16; w: W bf16 [n, k] (a pointer) or a gemm_q.QuantW; residual: [m, n] bf16,
    not overlapping x.
    """
    grid = _grid("gemm_residual", m, n, k, w, residual_ptr=residual_ptr, x_ptr=x_ptr)
    _apart("gemm_residual", "residual", residual_ptr, m * n * 2, "x", x_ptr, m * k * 2)
    _launch(backend, stream, grid, w, "res", (DevicePtr(residual_ptr), DevicePtr(x_ptr)),
            (m, n, k), ((), ()))


# ---- twins: the unfused twins in sequence, on host scratch rows ----------------------------

def _add_residual(ctx, residual_ptr, y_bits: np.ndarray) -> None:
    """residual = bf16(residual + y), rmsnorm's residual add (float sum, one rounding)."""
    m, n = y_bits.shape
    nat = ctx.native_rows
    if nat is not None:   # the same bits without numpy's per-call cost (3 temporaries)
        nat.add_bf16(ctx.write_addr(residual_ptr, m * n * 2), y_bits.ctypes.data, m * n)
        return
    res = ctx.view(residual_ptr, m * n, np.uint16).reshape(m, n)
    res[:] = f32_to_bf16(bf16_to_f32(res) + bf16_to_f32(y_bits))


def _rmsnorm_twin(ctx, y_ptr, x_ptr, norm_weight_ptr, bias_ptr, m, n, k, eps, gemm,
                  gemm_at=None) -> None:
    """rmsnorm's twin into host rows, gemm(y, rows) (W's GEMM twin), add_bias's formula.
    gemm_at(y_addr, rows_addr, m): the same GEMM on addresses (native), or None."""
    m, n, k = int(m), int(n), int(k)
    nat = ctx.native_rows
    if nat is not None and gemm_at is not None:   # by address: no numpy rows or views
        normed_addr = ctx.scratch("x", m * k * 2)
        nat.rmsnorm(normed_addr, ctx.read_addr(x_ptr, m * k * 2),
                    ctx.read_addr(norm_weight_ptr, k * 2), 0, m, k, float(eps))
        y_addr = ctx.write_addr(y_ptr, m * n * 2)
        gemm_at(y_addr, normed_addr, m)
        if int(bias_ptr):   # add_bias's formula: the residual add's, row by row
            bias_addr = ctx.read_addr(bias_ptr, n * 2)
            for r in range(m):
                nat.add_bf16(y_addr + r * n * 2, bias_addr, n)
        return
    normed = np.empty((m, k), np.uint16)
    if nat is not None:   # rmsnorm's twin bit for bit (native/norm_rope_act.cpp)
        nat.rmsnorm(normed.ctypes.data, ctx.read_addr(x_ptr, m * k * 2),
                    ctx.read_addr(norm_weight_ptr, k * 2), 0, m, k, float(eps))
    else:
        normed[:] = rmsnorm_bits(bf16_to_f32(ctx.read(x_ptr, m * k, np.uint16).reshape(m, k)),
                                 bf16_to_f32(ctx.read(norm_weight_ptr, k, np.uint16)), eps)
    y = ctx.view(y_ptr, m * n, np.uint16).reshape(m, n)
    gemm(y, normed)
    if int(bias_ptr):   # add_bias's formula: the residual add's, row by row
        bias = np.ascontiguousarray(ctx.read(bias_ptr, n, np.uint16))
        if nat is not None:
            for r in range(m):
                nat.add_bf16(y[r].ctypes.data, bias.ctypes.data, n)
        else:
            y[:] = f32_to_bf16(bf16_to_f32(y) + bf16_to_f32(bias)[None, :])


def _actmul_residual_twin(ctx, residual_ptr, gate_up_ptr, m, n, k, act, gemm,
                          gemm_at=None) -> None:
    """act_mul's twin into host rows, gemm(y, rows), the residual add (gemm_at: as in
    _rmsnorm_twin)."""
    m, n, k = int(m), int(n), int(k)
    nat = ctx.native_rows
    if nat is not None and gemm_at is not None and int(act) == ACTIVATIONS["silu"]:
        act_addr, y_addr = ctx.scratch("x", m * k * 2), ctx.scratch("y", m * n * 2)
        nat.silu_mul(act_addr, ctx.read_addr(gate_up_ptr, m * k * 4), m, k)
        gemm_at(y_addr, act_addr, m)
        nat.add_bf16(ctx.write_addr(residual_ptr, m * n * 2), y_addr, m * n)
        return
    act_bits = np.empty((m, k), np.uint16)
    if nat is not None and int(act) == ACTIVATIONS["silu"]:   # as act_mul's twin chooses
        nat.silu_mul(act_bits.ctypes.data, ctx.read_addr(gate_up_ptr, m * k * 4), m, k)
    else:
        gu = bf16_to_f32(ctx.read(gate_up_ptr, m * 2 * k, np.uint16).reshape(m, 2 * k))
        with np.errstate(invalid="ignore"):
            act_bits[:] = f32_to_bf16(act_f32(gu[:, :k], int(act)) * gu[:, k:])
    y = np.empty((m, n), np.uint16)
    gemm(y, act_bits)
    _add_residual(ctx, residual_ptr, y)


def _residual_twin(ctx, residual_ptr, x_ptr, m, n, k, gemm, gemm_at=None) -> None:
    m, n, k = int(m), int(n), int(k)
    nat = ctx.native_rows
    if nat is not None and gemm_at is not None:
        y_addr = ctx.scratch("y", m * n * 2)
        gemm_at(y_addr, ctx.read_addr(x_ptr, m * k * 2), m)
        nat.add_bf16(ctx.write_addr(residual_ptr, m * n * 2), y_addr, m * n)
        return
    y = np.empty((m, n), np.uint16)
    gemm(y, ctx.read(x_ptr, m * k, np.uint16).reshape(m, k))
    _add_residual(ctx, residual_ptr, y)


@twin(MODULE, "gemm_tc_bf16_16x16_rmsnorm")
def gemm_rmsnorm_twin(ctx, y_ptr, x_ptr, w_ptr, norm_weight_ptr, bias_ptr, m, n, k,
                      eps) -> None:
    _rmsnorm_twin(ctx, y_ptr, x_ptr, norm_weight_ptr, bias_ptr, m, n, k, eps,
                  lambda y, xb: gemm_rows_twin(ctx, y, xb, w_ptr, int(n), int(k)),
                  gemm_rows_at(ctx, w_ptr, int(n), int(k)))


@twin(MODULE, "gemm_tc_bf16_16x16_actmul_res")
def gemm_actmul_residual_twin(ctx, residual_ptr, gate_up_ptr, w_ptr, m, n, k, act) -> None:
    _actmul_residual_twin(ctx, residual_ptr, gate_up_ptr, m, n, k, act,
                          lambda y, xb: gemm_rows_twin(ctx, y, xb, w_ptr, int(n), int(k)),
                          gemm_rows_at(ctx, w_ptr, int(n), int(k)))


@twin(MODULE, "gemm_tc_bf16_16x16_res")
def gemm_residual_twin(ctx, residual_ptr, x_ptr, w_ptr, m, n, k) -> None:
    _residual_twin(ctx, residual_ptr, x_ptr, m, n, k,
                   lambda y, xb: gemm_rows_twin(ctx, y, xb, w_ptr, int(n), int(k)),
                   gemm_rows_at(ctx, w_ptr, int(n), int(k)))


# the quantized entries (gemm_q.cu): W's pointers after x, its scalars after (m, n, k)
# (the GEMM on host rows as arrays, and by address where the native library takes it)
def _q4_gemm(ctx, q, s, z, g, gr, n, k, groups, gs):
    n, k, groups, gs = int(n), int(k), int(groups), int(gs)
    return (lambda y, xb: q4_rows_twin(ctx, y, xb, q, s, z, g, gr, n, k, groups, gs),
            q4_rows_at(ctx, q, s, z, g, n, k, groups, gs))


def _fp8_gemm(ctx, q, s, r, n, k, kb, bk):
    n, k, kb, bk = int(n), int(k), int(kb), int(bk)
    return (lambda y, xb: fp8_rows_twin(ctx, y, xb, q, s, r, n, k, kb, bk),
            fp8_rows_at(ctx, q, s, r, n, k, kb, bk))


@twin(gemm_q.MODULE, "gemm_q4_bf16_16x16_rmsnorm")
def gemm_q4_rmsnorm_twin(ctx, y, x, q, s, z, g, gr, norm, bias, m, n, k, groups, gs, eps):
    _rmsnorm_twin(ctx, y, x, norm, bias, m, n, k, eps, *_q4_gemm(ctx, q, s, z, g, gr, n, k,
                                                                  groups, gs))


@twin(gemm_q.MODULE, "gemm_q4_bf16_16x16_actmul_res")
def gemm_q4_actmul_residual_twin(ctx, res, gu, q, s, z, g, gr, m, n, k, groups, gs, act):
    _actmul_residual_twin(ctx, res, gu, m, n, k, act,
                          *_q4_gemm(ctx, q, s, z, g, gr, n, k, groups, gs))


@twin(gemm_q.MODULE, "gemm_q4_bf16_16x16_res")
def gemm_q4_residual_twin(ctx, res, x, q, s, z, g, gr, m, n, k, groups, gs):
    _residual_twin(ctx, res, x, m, n, k, *_q4_gemm(ctx, q, s, z, g, gr, n, k, groups, gs))


@twin(gemm_q.MODULE, "gemm_fp8_bf16_16x16_rmsnorm")
def gemm_fp8_rmsnorm_twin(ctx, y, x, q, s, r, norm, bias, m, n, k, kb, bk, eps):
    _rmsnorm_twin(ctx, y, x, norm, bias, m, n, k, eps, *_fp8_gemm(ctx, q, s, r, n, k, kb, bk))


@twin(gemm_q.MODULE, "gemm_fp8_bf16_16x16_actmul_res")
def gemm_fp8_actmul_residual_twin(ctx, res, gu, q, s, r, m, n, k, kb, bk, act):
    _actmul_residual_twin(ctx, res, gu, m, n, k, act, *_fp8_gemm(ctx, q, s, r, n, k, kb, bk))


@twin(gemm_q.MODULE, "gemm_fp8_bf16_16x16_res")
def gemm_fp8_residual_twin(ctx, res, x, q, s, r, m, n, k, kb, bk):
    _residual_twin(ctx, res, x, m, n, k, *_fp8_gemm(ctx, q, s, r, n, k, kb, bk))
