"""Mamba2's selective state space scan (SSD) — kernels/mamba2_ssd.cu, module "mamba2_ssd": the
chunked scan of a prefill over a ragged batch and the one-token state update of decode, with
per-sequence FP32 states in a slot pool. Launchers and numpy twins.

Per token t and head h (group gr = h // (n_heads / n_groups), HF's repeat_interleave):
  dt   = clamp(softplus(dt_raw[t, h] + dt_bias[h]), dt_min, dt_max)  (softplus(x) = x > 20)
  A    = -exp(A_log[h]);  dA = exp(dt * A)
  S    = dA * S + (dt * B[t, gr]) (x) x[t, h]       S: [head_dim, d_state] FP32 (S[p, n])
  y[t, h, p] = bf16(sum_n S[p, n] C[t, gr, n] + D[h] x[t, h, p])
Prefill computes the same per chunk of `chunk_size` tokens (the model's config; chunks on the
grid of absolute positions, so calls split at multiples of chunk_size give the one-call bits):
with cum = inclusive cumsum of dt * A over the chunk and xt = dt * x,
  Y[l] = exp(cum_l) S C_l + sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) xt_s + D x_l
  S   <- exp(cum_L-1) S + sum_s exp(cum_L-1 - cum_s) xt_s (x) B_s
HF clamps dt to time_step_limit in its chunked scan only (mamba2_chunk_scan); its decode step
(mamba2_selective_state_update) does not: pass (0, inf) to `mamba2_step` to reproduce it.

Layouts (element strides; BF16 unless noted):
  x        rows [n_tokens, x_stride]: head h at x + t*x_stride + h*head_dim
  B, C     rows [n_tokens, bc_stride]: group gr at B + t*bc_stride + gr*d_state (C likewise;
           the conv output x|B|C gives x_stride == bc_stride)
  dt_raw   rows [n_tokens, dt_stride]: head h at column h (the in_proj output, before bias)
  A_log, dt_bias, D: FP32 [n_heads]
  out      [n_tokens, n_heads, head_dim] (y with the D skip; the gated norm is separate)
  state    slot s at state_pool + s * slot_stride: FP32 [n_heads, head_dim, d_state] (HF's
           ssm_states layout); `state_elements(...)` per slot
  slots, cu_seqlens [n_seqs + 1], start_pos: int32 device arrays (start_pos == 0: fresh,
           the slot is not read). Decode: row i is sequence i, its slot always read.
Restrictions: d_state in {32, 64, 128, 256}; head_dim a multiple of the CTA's column block
(block_p(d_state): 32, or 16 for d_state 256); chunk_size in [1, 256]; x_stride, bc_stride
and the x/B/C/out pointers 16-byte aligned in BF16 elements; slot_stride a multiple of 4 and
the state pool 16-byte aligned; n_heads a multiple of n_groups.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime import native_recurrent
from ..gpu_runtime.types import DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "mamba2_ssd"
THREADS = 128
D_STATES = (32, 64, 128, 256)
MAX_CHUNK = 256
_GRID_MAX = 65535


# Decay factors below 2^-64 are taken as 0. Their products with activations were subnormal
# float32 numbers (below 2^-126) often enough that a 2048-token Mamba2 prefill ran 3-7x
# slower on x86 (~100 cycles per subnormal operation); a term scaled by less than 2^-64 is
# far below float32 resolution next to the chunk's unscaled terms of its size (the GPU's
# fast-math exp flushes only below 2^-126; kernels and twins agree within the tolerances).
EXP_MIN_ARG = np.float32(-44.3614)   # ln(2^-64)


def exp_ftz(x) -> np.ndarray:
    """exp(x) in float32, 0 below 2^-64 (x < EXP_MIN_ARG)."""
    x = np.asarray(x, np.float32)
    return np.where(x < EXP_MIN_ARG, np.float32(0), np.exp(np.maximum(x, EXP_MIN_ARG)))


def block_p(d_state: int) -> int:
    """head_dim columns per prefill CTA: its state tile [block_p, d_state] is <= 16 KiB."""
    return min(32, 4096 // int(d_state))


def state_elements(n_heads: int, head_dim: int, d_state: int) -> int:
    """FP32 elements of one sequence's SSM state: n_heads * head_dim * d_state."""
    return int(n_heads) * int(head_dim) * int(d_state)


def _check(what, x_stride, bc_stride, dt_stride, slot_stride, n_seqs, n_heads, n_groups,
           head_dim, d_state, dt_min, dt_max, ptrs, prefill: bool) -> None:
    check_sizes(what, x_stride=x_stride, bc_stride=bc_stride, dt_stride=dt_stride,
                slot_stride=slot_stride, n_seqs=n_seqs, n_heads=n_heads, n_groups=n_groups,
                head_dim=head_dim, d_state=d_state)
    if int(n_heads) % int(n_groups):
        raise InvalidArgument(f"{what}: n_heads ({n_heads}) must be a multiple of n_groups "
                              f"({n_groups})")
    if int(d_state) not in D_STATES:
        raise InvalidArgument(f"{what}: d_state must be one of {D_STATES}, got {d_state}")
    bp = block_p(d_state) if prefill else 4
    if int(head_dim) % bp:
        raise InvalidArgument(f"{what}: head_dim ({head_dim}) must be a multiple of {bp} "
                              f"with d_state {d_state}")
    for name, v in (("x_stride", x_stride), ("bc_stride", bc_stride)):
        if int(v) % 8:
            raise InvalidArgument(f"{what}: {name} ({v}) must be a multiple of 8 "
                                  "(16-byte rows)")
    if int(slot_stride) < state_elements(n_heads, head_dim, d_state) or int(slot_stride) % 4:
        raise InvalidArgument(f"{what}: slot_stride ({slot_stride}) must be a multiple of 4 "
                              f"and hold the state of {state_elements(n_heads, head_dim, d_state)}"
                              " elements")
    lo, hi = float(dt_min), float(dt_max)
    if math.isnan(lo) or math.isnan(hi) or lo > hi or lo < 0:
        raise InvalidArgument(f"{what}: dt limits must satisfy 0 <= dt_min <= dt_max, got "
                              f"({dt_min}, {dt_max})")
    if int(n_seqs) > _GRID_MAX or int(n_heads) > _GRID_MAX:
        raise InvalidArgument(f"{what}: n_seqs and n_heads must be at most {_GRID_MAX}")
    check_ptrs(what, **ptrs)
    for name in ("out_ptr", "x_ptr", "b_ptr", "c_ptr", "state_pool_ptr"):
        if int(ptrs[name]) % 16:
            raise InvalidArgument(f"{what}: {name} must be 16-byte aligned")


def _args(out_ptr, x_ptr, x_stride, b_ptr, c_ptr, bc_stride, dt_ptr, dt_stride, a_log_ptr,
          dt_bias_ptr, d_ptr, dt_min, dt_max, state_pool_ptr, slot_stride, slots_ptr) -> tuple:
    return (DevicePtr(out_ptr), DevicePtr(x_ptr), np.int32(x_stride), DevicePtr(b_ptr),
            DevicePtr(c_ptr), np.int32(bc_stride), DevicePtr(dt_ptr), np.int32(dt_stride),
            DevicePtr(a_log_ptr), DevicePtr(dt_bias_ptr), DevicePtr(d_ptr), np.float32(dt_min),
            np.float32(dt_max), DevicePtr(state_pool_ptr), np.int64(slot_stride),
            DevicePtr(slots_ptr))


def mamba2_prefill(backend, stream: int, out_ptr, x_ptr, x_stride: int, b_ptr, c_ptr,
                   bc_stride: int, dt_ptr, dt_stride: int, a_log_ptr, dt_bias_ptr, d_ptr,
                   dt_min: float, dt_max: float, state_pool_ptr, slot_stride: int, slots_ptr,
                   cu_seqlens_ptr, start_pos_ptr, n_seqs: int, n_heads: int, n_groups: int,
                   head_dim: int, d_state: int, chunk_size: int) -> None:
    """Chunked SSD scan over a ragged batch, each sequence's state read from its slot
    (start_pos > 0) and the final state written back. Layouts: the module docstring.
    Grid (head_dim / block_p(d_state), n_heads, n_seqs), block 128."""
    what = "mamba2_prefill"
    ptrs = dict(out_ptr=out_ptr, x_ptr=x_ptr, b_ptr=b_ptr, c_ptr=c_ptr, dt_ptr=dt_ptr,
                a_log_ptr=a_log_ptr, dt_bias_ptr=dt_bias_ptr, d_ptr=d_ptr,
                state_pool_ptr=state_pool_ptr, slots_ptr=slots_ptr,
                cu_seqlens_ptr=cu_seqlens_ptr, start_pos_ptr=start_pos_ptr)
    _check(what, x_stride, bc_stride, dt_stride, slot_stride, n_seqs, n_heads, n_groups,
           head_dim, d_state, dt_min, dt_max, ptrs, True)
    if not 1 <= int(chunk_size) <= MAX_CHUNK:
        raise InvalidArgument(f"{what}: chunk_size must be in [1, {MAX_CHUNK}], got "
                              f"{chunk_size}")
    backend.launch(backend.kernel(MODULE, f"mamba2_prefill_n{int(d_state)}"),
                   (int(head_dim) // block_p(d_state), int(n_heads), int(n_seqs)), (THREADS,),
                   0, stream,
                   _args(out_ptr, x_ptr, x_stride, b_ptr, c_ptr, bc_stride, dt_ptr, dt_stride,
                         a_log_ptr, dt_bias_ptr, d_ptr, dt_min, dt_max, state_pool_ptr,
                         slot_stride, slots_ptr)
                   + (DevicePtr(cu_seqlens_ptr), DevicePtr(start_pos_ptr), np.int32(n_heads),
                      np.int32(n_groups), np.int32(head_dim), np.int32(chunk_size)))


def mamba2_step(backend, stream: int, out_ptr, x_ptr, x_stride: int, b_ptr, c_ptr,
                bc_stride: int, dt_ptr, dt_stride: int, a_log_ptr, dt_bias_ptr, d_ptr,
                dt_min: float, dt_max: float, state_pool_ptr, slot_stride: int, slots_ptr,
                n_seqs: int, n_heads: int, n_groups: int, head_dim: int,
                d_state: int) -> None:
    """One decode token per sequence (row i = sequence i, state in slots[i], updated in
    place). Grid (n_heads, n_seqs), block 128."""
    what = "mamba2_step"
    ptrs = dict(out_ptr=out_ptr, x_ptr=x_ptr, b_ptr=b_ptr, c_ptr=c_ptr, dt_ptr=dt_ptr,
                a_log_ptr=a_log_ptr, dt_bias_ptr=dt_bias_ptr, d_ptr=d_ptr,
                state_pool_ptr=state_pool_ptr, slots_ptr=slots_ptr)
    _check(what, x_stride, bc_stride, dt_stride, slot_stride, n_seqs, n_heads, n_groups,
           head_dim, d_state, dt_min, dt_max, ptrs, False)
    backend.launch(backend.kernel(MODULE, "mamba2_step"), (int(n_heads), int(n_seqs)),
                   (THREADS,), 0, stream,
                   _args(out_ptr, x_ptr, x_stride, b_ptr, c_ptr, bc_stride, dt_ptr, dt_stride,
                         a_log_ptr, dt_bias_ptr, d_ptr, dt_min, dt_max, state_pool_ptr,
                         slot_stride, slots_ptr)
                   + (np.int32(n_heads), np.int32(n_groups), np.int32(head_dim),
                      np.int32(d_state)))


# ---- the math in numpy (FP32, the twins' definition) ------------------------------------
def dt_f32(dt_raw: np.ndarray, dt_bias: np.ndarray, dt_min: float, dt_max: float) -> np.ndarray:
    """clamp(softplus(dt_raw + dt_bias), dt_min, dt_max), float32 [.., n_heads]."""
    x = dt_raw + dt_bias
    with np.errstate(over="ignore"):
        sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, np.float32(20)))))
    return np.clip(sp, np.float32(dt_min), np.float32(dt_max)).astype(np.float32)


def chunk_bounds(start_pos: int, length: int, chunk_size: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of a call's chunks on the grid of absolute positions."""
    out, lo = [], 0
    while lo < length:
        hi = min(length, lo + chunk_size - (start_pos + lo) % chunk_size)
        out.append((lo, hi))
        lo = hi
    return out


def chunked_f32(x, Bg, Cg, dt, A, D, state, start_pos: int, chunk_size: int):
    """One sequence, all heads: x [H, n, P], Bg, Cg [G, n, N] (per group; head h uses group
    h // (H / G)), dt [H, n], A, D [H], state [H, P, N] (updated in place) -> y [H, n, P]
    float32. C B^T is formed once per group, the products with the states per head."""
    H, n, P = x.shape
    G, N = Bg.shape[0], Bg.shape[2]
    hg = H // G
    y = np.empty((H, n, P), np.float32)
    for lo, hi in chunk_bounds(start_pos, n, chunk_size):
        L = hi - lo
        X, Bc, Cc = x[:, lo:hi], Bg[:, lo:hi], Cg[:, lo:hi]
        d = dt[:, lo:hi]
        cum = np.cumsum(d * A[:, None], axis=1, dtype=np.float32)
        lower = np.tril(np.ones((L, L), bool))
        decay = exp_ftz(np.where(lower, cum[:, :, None] - cum[:, None, :], np.float32(-np.inf)))
        xt = X * d[:, :, None]
        # every matmul on C-contiguous operands: numpy hands a transposed view to a slow loop
        # on some shapes (measured 0.3 ms against 190 ms for this C B^T)
        bt = np.ascontiguousarray(Bc.transpose(0, 2, 1))                    # [G, N, L]
        ct = np.ascontiguousarray(Cc.transpose(0, 2, 1))
        cb = Cc @ bt                                                        # [G, L, L]
        m = (cb[:, None] * decay.reshape(G, hg, L, L)).reshape(H, L, L)
        s_c = (state.reshape(G, hg, P, N) @ ct[:, None]).reshape(H, P, L)   # (S C^T)
        y[:, lo:hi] = exp_ftz(cum)[:, :, None] * s_c.transpose(0, 2, 1) + m @ xt + \
            D[:, None, None] * X
        to_end = exp_ftz(cum[:, -1:] - cum)
        state *= exp_ftz(cum[:, -1])[:, None, None]
        bx = bt[:, None] @ (xt * to_end[:, :, None]).reshape(G, hg, L, P)   # [G, hg, N, P]
        state += bx.reshape(H, N, P).transpose(0, 2, 1)
    return y


def step_f32(x, Bh, Ch, dt, A, D, state, native=None):
    """One token, all heads: x [H, P], Bh, Ch [H, N] (groups repeated), dt, A, D [H], state
    [H, P, N] (updated in place) -> y [H, P]: S = S exp(dt A) + x (dt B)^T (each product
    rounded, then the sum); y = dot(S, C) + D x, the dot in 8 lanes (lane l sums n = l,
    l + 8, ... in order from +0, then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))).
    `native` (gpu_runtime/native_recurrent.py) computes the same bits in one pass."""
    H, P, N = state.shape
    dA = exp_ftz(dt * A)
    dtB = (dt[:, None] * Bh).astype(np.float32)
    if native is not None:
        args = [np.ascontiguousarray(a, np.float32) for a in (x, dtB, Ch, dA, D)]
        y = np.empty((H, P), np.float32)
        native.ssd_step(state.ctypes.data, *(a.ctypes.data for a in args), y.ctypes.data, 0,
                        H, P, N)
        return y
    state *= dA[:, None, None]
    state += x[:, :, None] * dtB[:, None, :]
    prod = (state * Ch[:, None, :]).reshape(H, P, N // 8, 8)
    lane = prod[:, :, 0, :].copy()
    for j in range(1, N // 8):
        lane += prod[:, :, j, :]
    acc = ((lane[..., 0] + lane[..., 1]) + (lane[..., 2] + lane[..., 3])) + \
        ((lane[..., 4] + lane[..., 5]) + (lane[..., 6] + lane[..., 7]))
    return acc + D[:, None] * x


# ---- the twins ------------------------------------------------------------------------------
class _Layout:
    """The device tensors of one launch, read as numpy."""

    def __init__(self, ctx, x, x_stride, b, c, bc_stride, dtp, dt_stride, a_log, dt_bias, d,
                 dt_min, dt_max, pool, slot_stride, H, G, P, N):
        self.ctx, self.x, self.b, self.c, self.dtp, self.pool = ctx, x, b, c, dtp, pool
        self.xs, self.bcs, self.dts, self.ss = int(x_stride), int(bc_stride), int(dt_stride), \
            int(slot_stride)
        self.H, self.G, self.P, self.N = int(H), int(G), int(P), int(N)
        self.A = -np.exp(ctx.read(a_log, self.H, np.float32))
        self.dt_bias = ctx.read(dt_bias, self.H, np.float32)
        self.D = ctx.read(d, self.H, np.float32)
        self.lim = (float(dt_min), float(dt_max))

    def rows(self, ptr, lo, n, width, stride):
        """float32 [n, width] of BF16 rows lo..lo+n (a decode step reads one row per
        sequence: the single-row case skips the strided view)."""
        start = DevicePtr(ptr).offset(2 * lo * stride)
        if n == 1:
            return bf16_to_f32(self.ctx.read(start, width, np.uint16)).reshape(1, width)
        flat = self.ctx.read(start, (n - 1) * stride + width, np.uint16)
        return bf16_to_f32(np.lib.stride_tricks.as_strided(flat, (n, width), (2 * stride, 2)))

    def inputs(self, lo: int, n: int):
        """(x [H, n, P], B, C [G, n, N] per group, dt [H, n]) of rows lo..lo+n."""
        H, G, P, N = self.H, self.G, self.P, self.N
        x = self.rows(self.x, lo, n, H * P, self.xs).reshape(n, H, P).transpose(1, 0, 2)
        B = self.rows(self.b, lo, n, G * N, self.bcs).reshape(n, G, N).transpose(1, 0, 2)
        C = self.rows(self.c, lo, n, G * N, self.bcs).reshape(n, G, N).transpose(1, 0, 2)
        dt = dt_f32(self.rows(self.dtp, lo, n, H, self.dts), self.dt_bias, *self.lim)
        return (np.ascontiguousarray(x), np.ascontiguousarray(B), np.ascontiguousarray(C),
                dt.T.copy())

    def state(self, slot: int) -> np.ndarray:
        if slot < 0:
            raise InvalidArgument(f"mamba2_ssd: slot {slot} is negative")
        n = self.H * self.P * self.N
        return self.ctx.view(DevicePtr(self.pool).offset(4 * slot * self.ss), n,
                             np.float32).reshape(self.H, self.P, self.N)

    def out_rows(self, out, lo: int, n: int) -> np.ndarray:
        w = self.H * self.P
        return self.ctx.view(DevicePtr(out).offset(2 * lo * w), n * w, np.uint16).reshape(
            n, self.H, self.P)


def _prefill_twin(ctx, out, x, x_stride, b, c, bc_stride, dtp, dt_stride, a_log, dt_bias, d,
                  dt_min, dt_max, pool, slot_stride, slots_ptr, cu_ptr, start_ptr, H, G, P,
                  chunk_size, *, N: int) -> None:
    lay = _Layout(ctx, x, x_stride, b, c, bc_stride, dtp, dt_stride, a_log, dt_bias, d, dt_min,
                  dt_max, pool, slot_stride, H, G, P, N)
    n_seqs = int(ctx.grid[2])
    cu = ctx.read(cu_ptr, n_seqs + 1, np.int32).astype(np.int64)
    slots = ctx.read(slots_ptr, n_seqs, np.int32)
    start = ctx.read(start_ptr, n_seqs, np.int32)
    for i in range(n_seqs):
        lo, n = int(cu[i]), int(cu[i + 1] - cu[i])
        if n <= 0:
            continue
        st = lay.state(int(slots[i]))
        s0 = np.zeros_like(st) if int(start[i]) == 0 else st.copy()
        y = chunked_f32(*lay.inputs(lo, n), lay.A, lay.D, s0, int(start[i]), int(chunk_size))
        lay.out_rows(out, lo, n)[:] = f32_to_bf16(y.transpose(1, 0, 2))
        st[:] = s0


for _n in D_STATES:
    twin(MODULE, f"mamba2_prefill_n{_n}")(
        lambda ctx, *args, _n=_n: _prefill_twin(ctx, *args, N=_n))


@twin(MODULE, "mamba2_step")
def _step_twin(ctx, out, x, x_stride, b, c, bc_stride, dtp, dt_stride, a_log, dt_bias, d, dt_min,
               dt_max, pool, slot_stride, slots_ptr, H, G, P, N) -> None:
    lay = _Layout(ctx, x, x_stride, b, c, bc_stride, dtp, dt_stride, a_log, dt_bias, d, dt_min,
                  dt_max, pool, slot_stride, H, G, P, N)
    n_seqs = int(ctx.grid[1])
    slots = ctx.read(slots_ptr, n_seqs, np.int32)
    xx, B, C, dt = lay.inputs(0, n_seqs)
    grp = np.arange(lay.H) // (lay.H // lay.G)
    B, C = B[grp], C[grp]                                   # [H, n, N]: each head's group
    o = lay.out_rows(out, 0, n_seqs)
    native = native_recurrent.for_backend(ctx.backend)
    states = [lay.state(int(s)) for s in slots]    # bounds-checked views, before any write

    def seqs(lo: int, hi: int) -> None:  # each sequence alone: its bits never depend on the batch
        for i in range(lo, hi):
            o[i] = f32_to_bf16(step_f32(xx[:, i], B[:, i], C[:, i], dt[:, i], lay.A, lay.D,
                                        states[i], native))
    ctx.map_blocks(n_seqs, 1, seqs)
