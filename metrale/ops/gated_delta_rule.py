"""The gated delta rule of gated DeltaNet (Qwen3-Next, Qwen3.5) — kernels/gated_delta_rule.cu,
module "gated_delta_rule": the chunked prefill over a ragged batch and the recurrent decode
step, both reading and writing per-sequence FP32 states in a slot pool. Launchers and numpy
twins.

Per token t of a sequence and value head h (key head kh = h // (n_v_heads / n_k_heads), the
repeat_interleave grouping of HF):
  g     = -exp(A_log[h]) * softplus(a[t, h] + dt_bias[h])     (softplus(x) = x above 20)
  beta  = sigmoid(b[t, h])
  k^    = k[t, kh] / sqrt(|k[t, kh]|^2 + 1e-6)                 (HF's l2norm, in the kernels)
  q^    = q[t, kh] / sqrt(|q[t, kh]|^2 + 1e-6) / sqrt(d_k)
  S     = exp(g) * S                                           S: [d_k, d_v] FP32
  u     = beta * (v[t, h] - S^T k^)
  S     = S + k^ u^T
  out[t, h] = bf16(S^T q^)
Prefill computes the same in chunks of 64 tokens, FLA's WY/UT form: within a chunk (gamma =
cumsum g, D[i, j] = exp(gamma_i - gamma_j) for j <= i, else 0)
  A  = strictly-lower(beta_i k^_i . k^_j * D)      X = (I + A)^-1 (beta * (V - exp(gamma) K^ S))
  O  = (exp(gamma) Q^) S + (Q^ K^T * D) X          S <- exp(gamma_L) S + (K^ exp(gamma_L - gamma))^T X
The chunk grid is the sequence's absolute positions (chunk c = positions [64c, 64c + 64)): a
prefill that starts at start_pos continues a partial chunk, so a prompt prefilled in one call
or in calls split at multiples of 64 runs the same chunks and gives the same bits.

Layouts (element strides; BF16 unless noted):
  q, k, v  rows [n_tokens, qkv_stride]: head kh of q at q + t*qkv_stride + kh*d_k, of k
           likewise, value head h at v + t*qkv_stride + h*d_v (the conv output q|k|v)
  a, b     rows [n_tokens, ab_stride]: head h at a + t*ab_stride + h
  A_log, dt_bias  FP32 [n_v_heads]
  out      [n_tokens, n_v_heads, d_v]
  state pool: slot s at state_pool + s * slot_stride elements: FP32 [n_v_heads, d_k, d_v]
           (HF's recurrent_state layout), `state_elements(...)` per slot
  slots, cu_seqlens [n_seqs + 1], start_pos: int32 device arrays. start_pos[i] == 0: a fresh
           sequence (zero initial state, the slot is not read); > 0: the slot holds the state
           after start_pos tokens. Decode (row i = sequence i) always reads its slot.
Restrictions: d_k a multiple of 16 in [16, 128], d_v a multiple of 32, qkv_stride a multiple
of 8, slot_stride a multiple of 4, the out/q/k/v/state pointers 16-byte aligned, n_v_heads a
multiple of n_k_heads.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime import native_recurrent
from ..gpu_runtime.types import DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "gated_delta_rule"
THREADS = 128
CHUNK = 64          # GDR_CHUNK: tokens per chunk (absolute positions)
BLOCK_V = 32        # GDR_BV: value columns per CTA
MAX_DK = 128
EPS = np.float32(1e-6)
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


def state_elements(n_v_heads: int, d_k: int, d_v: int) -> int:
    """FP32 elements of one sequence's recurrent state: n_v_heads * d_k * d_v."""
    return int(n_v_heads) * int(d_k) * int(d_v)


def _check(what: str, qkv_stride, ab_stride, slot_stride, n_seqs, n_k_heads, n_v_heads, d_k,
           d_v, ptrs: dict) -> None:
    check_sizes(what, qkv_stride=qkv_stride, ab_stride=ab_stride, slot_stride=slot_stride,
                n_seqs=n_seqs, n_k_heads=n_k_heads, n_v_heads=n_v_heads, d_k=d_k, d_v=d_v)
    if int(n_v_heads) % int(n_k_heads):
        raise InvalidArgument(f"{what}: n_v_heads ({n_v_heads}) must be a multiple of "
                              f"n_k_heads ({n_k_heads})")
    if int(d_k) % 16 or int(d_k) > MAX_DK:
        raise InvalidArgument(f"{what}: d_k must be a multiple of 16 in [16, {MAX_DK}], "
                              f"got {d_k}")
    if int(d_v) % BLOCK_V:
        raise InvalidArgument(f"{what}: d_v must be a multiple of {BLOCK_V}, got {d_v}")
    if int(qkv_stride) % 8:
        raise InvalidArgument(f"{what}: qkv_stride ({qkv_stride}) must be a multiple of 8 "
                              "(16-byte rows)")
    if int(slot_stride) < state_elements(n_v_heads, d_k, d_v):
        raise InvalidArgument(f"{what}: slot_stride ({slot_stride}) is less than the state of "
                              f"{state_elements(n_v_heads, d_k, d_v)} elements")
    if int(n_seqs) > _GRID_MAX or int(n_v_heads) > _GRID_MAX:
        raise InvalidArgument(f"{what}: n_seqs and n_v_heads must be at most {_GRID_MAX}")
    if int(slot_stride) % 4:
        raise InvalidArgument(f"{what}: slot_stride ({slot_stride}) must be a multiple of 4 "
                              "(16-byte state rows)")
    check_ptrs(what, **ptrs)
    for name in ("out_ptr", "q_ptr", "k_ptr", "v_ptr", "state_pool_ptr"):
        if int(ptrs[name]) % 16:
            raise InvalidArgument(f"{what}: {name} must be 16-byte aligned")


def _args(out_ptr, q_ptr, k_ptr, v_ptr, qkv_stride, a_ptr, b_ptr, ab_stride, a_log_ptr,
          dt_bias_ptr, state_pool_ptr, slot_stride, slots_ptr) -> tuple:
    return (DevicePtr(out_ptr), DevicePtr(q_ptr), DevicePtr(k_ptr), DevicePtr(v_ptr),
            np.int32(qkv_stride), DevicePtr(a_ptr), DevicePtr(b_ptr), np.int32(ab_stride),
            DevicePtr(a_log_ptr), DevicePtr(dt_bias_ptr), DevicePtr(state_pool_ptr),
            np.int64(slot_stride), DevicePtr(slots_ptr))


def gdr_prefill(backend, stream: int, out_ptr, q_ptr, k_ptr, v_ptr, qkv_stride: int, a_ptr,
                b_ptr, ab_stride: int, a_log_ptr, dt_bias_ptr, state_pool_ptr,
                slot_stride: int, slots_ptr, cu_seqlens_ptr, start_pos_ptr, n_seqs: int,
                n_k_heads: int, n_v_heads: int, d_k: int, d_v: int) -> None:
    """Chunked gated delta rule over a ragged batch; each sequence's state is read from its
    slot (start_pos > 0) and the final state written back. Layouts: the module docstring.
    Grid (d_v / 32, n_v_heads, n_seqs), block 128: one CTA per (sequence, head, 32 value
    columns) walks the sequence's chunks in order."""
    what = "gdr_prefill"
    ptrs = dict(out_ptr=out_ptr, q_ptr=q_ptr, k_ptr=k_ptr, v_ptr=v_ptr, a_ptr=a_ptr,
                b_ptr=b_ptr, a_log_ptr=a_log_ptr, dt_bias_ptr=dt_bias_ptr,
                state_pool_ptr=state_pool_ptr, slots_ptr=slots_ptr,
                cu_seqlens_ptr=cu_seqlens_ptr, start_pos_ptr=start_pos_ptr)
    _check(what, qkv_stride, ab_stride, slot_stride, n_seqs, n_k_heads, n_v_heads, d_k, d_v,
           ptrs)
    backend.launch(backend.kernel(MODULE, "gdr_prefill"),
                   (int(d_v) // BLOCK_V, int(n_v_heads), int(n_seqs)), (THREADS,), 0, stream,
                   _args(out_ptr, q_ptr, k_ptr, v_ptr, qkv_stride, a_ptr, b_ptr, ab_stride,
                         a_log_ptr, dt_bias_ptr, state_pool_ptr, slot_stride, slots_ptr)
                   + (DevicePtr(cu_seqlens_ptr), DevicePtr(start_pos_ptr), np.int32(n_k_heads),
                      np.int32(n_v_heads), np.int32(d_k), np.int32(d_v)))


def gdr_decode(backend, stream: int, out_ptr, q_ptr, k_ptr, v_ptr, qkv_stride: int, a_ptr,
               b_ptr, ab_stride: int, a_log_ptr, dt_bias_ptr, state_pool_ptr, slot_stride: int,
               slots_ptr, n_seqs: int, n_k_heads: int, n_v_heads: int, d_k: int,
               d_v: int) -> None:
    """One recurrent step per sequence (row i = sequence i, state in slots[i], updated in
    place). Grid (d_v / 32, n_v_heads, n_seqs), block 128."""
    what = "gdr_decode"
    ptrs = dict(out_ptr=out_ptr, q_ptr=q_ptr, k_ptr=k_ptr, v_ptr=v_ptr, a_ptr=a_ptr,
                b_ptr=b_ptr, a_log_ptr=a_log_ptr, dt_bias_ptr=dt_bias_ptr,
                state_pool_ptr=state_pool_ptr, slots_ptr=slots_ptr)
    _check(what, qkv_stride, ab_stride, slot_stride, n_seqs, n_k_heads, n_v_heads, d_k, d_v,
           ptrs)
    backend.launch(backend.kernel(MODULE, "gdr_decode"),
                   (int(d_v) // BLOCK_V, int(n_v_heads), int(n_seqs)), (THREADS,), 0, stream,
                   _args(out_ptr, q_ptr, k_ptr, v_ptr, qkv_stride, a_ptr, b_ptr, ab_stride,
                         a_log_ptr, dt_bias_ptr, state_pool_ptr, slot_stride, slots_ptr)
                   + (np.int32(n_k_heads), np.int32(n_v_heads), np.int32(d_k), np.int32(d_v)))


# ---- the math in numpy (FP32, the twins' definition) ------------------------------------
def gates_f32(a: np.ndarray, b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray):
    """(g, beta) float32 [.., n_v_heads] from a, b float32 and the FP32 parameters."""
    x = a + dt_bias
    with np.errstate(over="ignore"):
        sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, np.float32(20)))))
        g = -np.exp(a_log) * sp
        beta = np.float32(1) / (np.float32(1) + np.exp(-b))
    return g.astype(np.float32), beta.astype(np.float32)


def normalized_qk(q: np.ndarray, k: np.ndarray, ratio: int):
    """q, k float32 [n, n_k_heads, d_k] -> (q^, k^) float32 [n, n_v_heads, d_k]: L2-normalised
    (eps 1e-6 under the root), q^ also scaled by 1/sqrt(d_k), key heads repeated `ratio`
    times (head h uses key head h // ratio)."""
    d_k = q.shape[-1]
    rk = np.float32(1) / np.sqrt((k * k).sum(-1) + EPS)
    rq = np.float32(1) / np.sqrt((q * q).sum(-1) + EPS)
    rq *= np.float32(1 / np.sqrt(d_k))
    kn, qn = k * rk[..., None], q * rq[..., None]
    if ratio > 1:
        kn, qn = np.repeat(kn, ratio, axis=1), np.repeat(qn, ratio, axis=1)
    return qn, kn


def chunk_bounds(start_pos: int, length: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of a call's chunks: the 64-token grid of absolute positions."""
    out, lo = [], 0
    while lo < length:
        hi = min(length, lo + CHUNK - (start_pos + lo) % CHUNK)
        out.append((lo, hi))
        lo = hi
    return out


def chunked_f32(qn, kn, v, g, beta, state, start_pos: int):
    """One sequence, all heads: qn, kn [H, n, d_k], v [H, n, d_v], g, beta [H, n], state
    [H, d_k, d_v] (updated in place) -> out [H, n, d_v] float32."""
    H, n, d_v = v.shape
    out = np.empty((H, n, d_v), np.float32)
    for lo, hi in chunk_bounds(start_pos, n):
        L = hi - lo
        K, Q, V = kn[:, lo:hi], qn[:, lo:hi], v[:, lo:hi]
        # matmuls on C-contiguous operands (numpy gives some transposed views a slow loop)
        kt = np.ascontiguousarray(K.transpose(0, 2, 1))
        gam = np.cumsum(g[:, lo:hi], axis=1, dtype=np.float32)
        lower = np.tril(np.ones((L, L), bool))
        diff = np.where(lower, gam[:, :, None] - gam[:, None, :], np.float32(-np.inf))
        decay = exp_ftz(diff)                                        # D, zero above
        eg = exp_ftz(gam)
        bt = beta[:, lo:hi]
        A = bt[:, :, None] * (K @ kt) * decay
        A[:, np.arange(L), np.arange(L)] = 0                        # strictly lower
        A += np.eye(L, dtype=np.float32)
        R = V - (eg[:, :, None] * K) @ state
        X = np.linalg.solve(A, bt[:, :, None] * R).astype(np.float32)
        out[:, lo:hi] = (eg[:, :, None] * Q) @ state + ((Q @ kt) * decay) @ X
        to_end = exp_ftz(gam[:, -1:] - gam)
        state *= exp_ftz(gam[:, -1])[:, None, None]
        state += (kt * to_end[:, None, :]) @ X
    return out


def step_f32(qn, kn, v, g, beta, state, native=None):
    """One token, all heads: qn, kn [H, d_k], v [H, d_v], g, beta [H], state [H, d_k, d_v]
    (updated in place) -> out [H, d_v]. With e = exp(g), from the old state:
    a = S^T k, c = S^T q, kq = k . q (sums over d_k in ascending order from +0, each product
    rounded: no FMA), u = beta (v - e a), out = e c + u kq, S = e S + k u^T. `native`
    (gpu_runtime/native_recurrent.py) computes the same bits in one pass over the state."""
    H, d_k, d_v = state.shape
    e = exp_ftz(g)
    if native is not None:
        args = [np.ascontiguousarray(a, np.float32) for a in (kn, qn, v, e, beta)]
        out = np.empty((H, d_v), np.float32)
        native.gdr_step(state.ctypes.data, *(a.ctypes.data for a in args), out.ctypes.data,
                        0, H, d_k, d_v)
        return out
    a = np.zeros((H, d_v), np.float32)
    c = np.zeros((H, d_v), np.float32)
    kq = np.zeros(H, np.float32)
    for i in range(d_k):
        row = state[:, i, :]
        a += row * kn[:, i:i + 1]
        c += row * qn[:, i:i + 1]
        kq += kn[:, i] * qn[:, i]
    u = beta[:, None] * (v - e[:, None] * a)
    out = e[:, None] * c + u * kq[:, None]
    state *= e[:, None, None]
    state += kn[:, :, None] * u[:, None, :]
    return out


# ---- the twins ------------------------------------------------------------------------------
class _Layout:
    """The device tensors of one launch, read as numpy (rows of token range [lo, hi))."""

    def __init__(self, ctx, q, k, v, qkv_stride, a, b, ab_stride, a_log, dt_bias, pool,
                 slot_stride, Hk, Hv, dk, dv):
        self.ctx, self.q, self.k, self.v, self.a, self.b = ctx, q, k, v, a, b
        self.qs, self.abs_, self.pool, self.ss = int(qkv_stride), int(ab_stride), pool, \
            int(slot_stride)
        self.Hk, self.Hv, self.dk, self.dv = int(Hk), int(Hv), int(dk), int(dv)
        self.a_log = ctx.read(a_log, self.Hv, np.float32)
        self.dt_bias = ctx.read(dt_bias, self.Hv, np.float32)

    def rows(self, ptr, lo, n, width, stride):
        """float32 [n, width] of BF16 rows lo..lo+n (a decode step reads one row per
        sequence: the single-row case skips the strided view)."""
        start = DevicePtr(ptr).offset(2 * lo * stride)
        if n == 1:
            return bf16_to_f32(self.ctx.read(start, width, np.uint16)).reshape(1, width)
        flat = self.ctx.read(start, (n - 1) * stride + width, np.uint16)
        return bf16_to_f32(np.lib.stride_tricks.as_strided(flat, (n, width), (2 * stride, 2)))

    def inputs(self, lo: int, n: int):
        """(q^, k^ [n, Hv, dk], v [n, Hv, dv], g, beta [n, Hv]) of rows lo..lo+n, token-major
        (a decode step's row i is sequence i's; the prefill transposes to heads first)."""
        Hk, Hv, dk, dv = self.Hk, self.Hv, self.dk, self.dv
        q = self.rows(self.q, lo, n, Hk * dk, self.qs).reshape(n, Hk, dk)
        k = self.rows(self.k, lo, n, Hk * dk, self.qs).reshape(n, Hk, dk)
        v = self.rows(self.v, lo, n, Hv * dv, self.qs).reshape(n, Hv, dv)
        a = self.rows(self.a, lo, n, Hv, self.abs_)
        b = self.rows(self.b, lo, n, Hv, self.abs_)
        g, beta = gates_f32(a, b, self.a_log, self.dt_bias)
        qn, kn = normalized_qk(q, k, Hv // Hk)
        return qn, kn, v, g, beta

    def state(self, slot: int) -> np.ndarray:
        if slot < 0:
            raise InvalidArgument(f"gated_delta_rule: slot {slot} is negative")
        n = self.Hv * self.dk * self.dv
        return self.ctx.view(DevicePtr(self.pool).offset(4 * slot * self.ss), n,
                             np.float32).reshape(self.Hv, self.dk, self.dv)

    def out_rows(self, out, lo: int, n: int) -> np.ndarray:
        w = self.Hv * self.dv
        return self.ctx.view(DevicePtr(out).offset(2 * lo * w), n * w, np.uint16).reshape(
            n, self.Hv, self.dv)


@twin(MODULE, "gdr_prefill")
def _prefill_twin(ctx, out, q, k, v, qkv_stride, a, b, ab_stride, a_log, dt_bias, pool,
                  slot_stride, slots_ptr, cu_ptr, start_ptr, Hk, Hv, dk, dv) -> None:
    lay = _Layout(ctx, q, k, v, qkv_stride, a, b, ab_stride, a_log, dt_bias, pool, slot_stride,
                  Hk, Hv, dk, dv)
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
        heads_first = [np.ascontiguousarray(np.swapaxes(a, 0, 1)) for a in lay.inputs(lo, n)]
        y = chunked_f32(*heads_first, s0, int(start[i]))
        lay.out_rows(out, lo, n)[:] = f32_to_bf16(y.transpose(1, 0, 2))
        st[:] = s0


@twin(MODULE, "gdr_decode")
def _decode_twin(ctx, out, q, k, v, qkv_stride, a, b, ab_stride, a_log, dt_bias, pool,
                 slot_stride, slots_ptr, Hk, Hv, dk, dv) -> None:
    lay = _Layout(ctx, q, k, v, qkv_stride, a, b, ab_stride, a_log, dt_bias, pool, slot_stride,
                  Hk, Hv, dk, dv)
    n_seqs = int(ctx.grid[2])
    slots = ctx.read(slots_ptr, n_seqs, np.int32)
    qn, kn, vv, g, beta = lay.inputs(0, n_seqs)
    o = lay.out_rows(out, 0, n_seqs)
    native = native_recurrent.for_backend(ctx.backend)
    states = [lay.state(int(s)) for s in slots]    # bounds-checked views, before any write

    def seqs(lo: int, hi: int) -> None:  # each sequence alone: its bits never depend on the batch
        for i in range(lo, hi):
            o[i] = f32_to_bf16(step_f32(qn[i], kn[i], vv[i], g[i], beta[i], states[i],
                                        native))
    ctx.map_blocks(n_seqs, 1, seqs)
