"""Dense (non-paged) attention of one sequence (kernels/dense_attention.cu, module
"dense_attention"): launcher and numpy twin.

q rows [n_q] with row stride q_stride elements (head h at h*head_dim), k and v rows [n_kv]
with row stride kv_stride (kv head g at g*head_dim), out [n_q, num_heads*head_dim] bf16
contiguous. Query row i sits at absolute position q_offset + i; with `causal` it sees keys
j <= q_offset + i (and always j < n_kv). Used for Whisper's encoder self-attention, its
decoder cross-attention over precomputed K/V and its decoder self-attention over a
contiguous per-window KV buffer (q/k/v may live in one fused [n, 3*d] buffer, or k and v in
one [n, 2*d] buffer: pass the strides).

Scores are in base 2 like the kernel: s = (q . k) * scale * log2(e), p = exp2(s - max),
fp32 throughout, the output rounded once to bf16.

ROW INVARIANCE: a row's result depends only on its own query, its visible keys and values.
The kernel walks 32-key tiles from key 0 whatever n_q is; the twin computes every (row,
head) on its own over exactly the visible keys (one matrix-vector product each), so a decode
step over a KV buffer is bit-identical to the same row of a whole-prefix pass.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .attention_tile import attend_base2
from .bf16 import bf16_to_f32, f32_to_bf16
from .registry import twin

MODULE = "dense_attention"
THREADS = 128
MAX_HEAD_DIM = 256
_LOG2E = np.float32(1.4426950408889634)
_GRID_Y_MAX = 65535


def _variant(head_dim: int) -> tuple[int, int]:
    """(pairs per lane, query rows per CTA) for a head_dim."""
    maxp = -(-(head_dim // 2) // 32)
    maxp = 1 if maxp <= 1 else 2 if maxp <= 2 else 4
    return maxp, (16 if maxp == 4 else 32)


def smem_bytes(head_dim: int) -> int:
    _, bq = _variant(head_dim)
    return head_dim * (4 * bq + 128)


def dense_attention(backend, stream: int, out_ptr, q_ptr, k_ptr, v_ptr, n_q: int, n_kv: int,
                    num_heads: int, num_kv_heads: int, head_dim: int, q_stride: int,
                    kv_stride: int, scale: float, causal: bool, q_offset: int = 0) -> None:
    """out[n_q, H*D] = softmax(q K^T * scale [causal mask]) V, one sequence, dense K/V.

    See the module docstring for layouts. 128-bit loads when head_dim, q_stride and
    kv_stride are multiples of 8 and q/k/v are 16-byte aligned; 32-bit loads otherwise.
    """
    n_q, n_kv, q_offset = int(n_q), int(n_kv), int(q_offset)
    H, KV, D = int(num_heads), int(num_kv_heads), int(head_dim)
    q_stride, kv_stride, scale = int(q_stride), int(kv_stride), float(scale)
    what = "dense_attention"
    if not 1 <= n_q < 2**31:
        raise InvalidArgument(f"{what}: n_q must be in [1, 2^31), got {n_q}")
    if not 1 <= n_kv < 2**31:
        raise InvalidArgument(f"{what}: n_kv must be in [1, 2^31), got {n_kv}")
    if not 0 <= q_offset or q_offset + n_q >= 2**31:
        raise InvalidArgument(f"{what}: q_offset must be >= 0 with q_offset + n_q < 2^31, "
                              f"got q_offset {q_offset}")
    if H < 1 or KV < 1 or H % KV:
        raise InvalidArgument(f"{what}: num_heads ({H}) must be a positive multiple of "
                              f"num_kv_heads ({KV})")
    if H > _GRID_Y_MAX:
        raise InvalidArgument(f"{what}: num_heads {H} exceeds {_GRID_Y_MAX}")
    if D < 2 or D % 2 or D > MAX_HEAD_DIM:
        raise InvalidArgument(f"{what}: head_dim must be even and in [2, {MAX_HEAD_DIM}], "
                              f"got {D}")
    if q_stride < H * D or q_stride % 2:
        raise InvalidArgument(f"{what}: q_stride must be even and >= num_heads*head_dim = "
                              f"{H * D}, got {q_stride}")
    if kv_stride < KV * D or kv_stride % 2:
        raise InvalidArgument(f"{what}: kv_stride must be even and >= num_kv_heads*head_dim "
                              f"= {KV * D}, got {kv_stride}")
    if max(n_q * q_stride, n_kv * kv_stride, n_q * H * D) >= 2**62:
        raise InvalidArgument(f"{what}: buffers too large")
    if not (math.isfinite(scale) and scale > 0):
        raise InvalidArgument(f"{what}: scale must be finite and > 0, got {scale}")
    for name, p in (("out_ptr", out_ptr), ("q_ptr", q_ptr), ("k_ptr", k_ptr),
                    ("v_ptr", v_ptr)):
        if int(p) == 0:
            raise InvalidArgument(f"{what}: {name} is NULL")
        if int(p) % 4:
            raise InvalidArgument(f"{what}: {name} {DevicePtr(p)!r} is not 4-byte aligned")
    maxp, bq = _variant(D)
    vec8 = (D % 8 == 0 and q_stride % 8 == 0 and kv_stride % 8 == 0
            and all(int(p) % 16 == 0 for p in (q_ptr, k_ptr, v_ptr)))
    func = f"dense_attention_p{maxp}_v{8 if vec8 else 2}"
    backend.launch(backend.kernel(MODULE, func), (-(-n_q // bq), H), (THREADS,),
                   smem_bytes(D), stream,
                   (DevicePtr(out_ptr), DevicePtr(q_ptr), DevicePtr(k_ptr), DevicePtr(v_ptr),
                    np.int32(n_q), np.int32(n_kv), np.int32(H), np.int32(KV), np.int32(D),
                    np.int32(q_stride), np.int32(kv_stride), np.float32(scale),
                    np.int32(1 if causal else 0), np.int32(q_offset)))


def _rows(ctx, ptr, n, stride, heads, d) -> np.ndarray:
    """float32 [n, heads, d] of strided bf16 rows."""
    flat = ctx.read(ptr, (n - 1) * stride + heads * d, np.uint16)
    rows = np.lib.stride_tricks.as_strided(flat, shape=(n, heads * d),
                                           strides=(stride * 2, 2))
    return bf16_to_f32(rows).reshape(n, heads, d)


def _twin(ctx, out_ptr, q_ptr, k_ptr, v_ptr, n_q, n_kv, num_heads, num_kv_heads, head_dim,
          q_stride, kv_stride, scale, causal, q_offset) -> None:
    nq, nkv, H, KV, D = int(n_q), int(n_kv), int(num_heads), int(num_kv_heads), int(head_dim)
    causal, q_offset = bool(int(causal)), int(q_offset)
    q = _rows(ctx, q_ptr, nq, int(q_stride), H, D)
    k = _rows(ctx, k_ptr, nkv, int(kv_stride), KV, D)
    v = _rows(ctx, v_ptr, nkv, int(kv_stride), KV, D)
    sl2 = np.float32(np.float32(scale) * _LOG2E)
    out = np.empty((nq, H, D), np.float32)
    G = H // KV
    for g in range(KV):
        kg = np.ascontiguousarray(k[:, g, :])  # [n_kv, D]
        vg = np.ascontiguousarray(v[:, g, :])
        for h in range(g * G, (g + 1) * G):
            qh = np.ascontiguousarray(q[:, h, :])
            for i in range(nq):
                vis = min(nkv, q_offset + i + 1) if causal else nkv
                out[i, h] = attend_base2((kg[:vis] @ qh[i]) * sl2, vg[:vis])
    ctx.view(out_ptr, nq * H * D, np.uint16).reshape(nq, H * D)[:] = \
        f32_to_bf16(out.reshape(nq, H * D))


for _maxp in (1, 2, 4):
    for _vec in (8, 2):
        twin(MODULE, f"dense_attention_p{_maxp}_v{_vec}")(_twin)
