"""The fixed-order sum of a token's expert outputs (kernels/moe_combine.cu): launcher and
numpy twin.

  out[t] = bf16( (...((0 + w[t,0] y[t*k]) + w[t,1] y[t*k+1]) ... + w[t,k-1] y[t*k+k-1])
                 + sigmoid(gate[t]) shared[t] )

every * and + one float32 rounding, in the token's top-k slot order (never the order the
experts ran in), the shared term only when `shared` is given (its gate only when
`shared_gate` is; without one it weighs 1). `out_fp32=True` (entry moe_combine_f32) stores
the float32 sum unrounded: a tensor-parallel rank's partial (model_engine/tp/moe_shard.py).
"""
from __future__ import annotations

import numpy as np

from ..gpu_runtime.types import NULL, DevicePtr
from .bf16 import f32_to_bf16
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "moe_combine"
THREADS = 256


def moe_combine(backend, stream: int, out_ptr, expert_out_ptr, topk_weights_ptr, n_tokens: int,
                hidden: int, top_k: int, shared_ptr=NULL, shared_gate_ptr=NULL,
                out_fp32: bool = False) -> None:
    """out bf16 (float32 when `out_fp32`) [n_tokens, hidden] = the weighted sum above.
    expert_out float32 [n_tokens * top_k, hidden]; topk_weights float32 [n_tokens, top_k];
    shared float32 [n_tokens, hidden] or NULL; shared_gate float32 [n_tokens] (gate logits)
    or NULL."""
    check_sizes("moe_combine", n_tokens=n_tokens, hidden=hidden, top_k=top_k)
    check_ptrs("moe_combine", out_ptr=out_ptr, expert_out_ptr=expert_out_ptr,
               topk_weights_ptr=topk_weights_ptr)
    name = "moe_combine_f32" if out_fp32 else "moe_combine"
    backend.launch(backend.kernel(MODULE, name), (int(n_tokens),), (THREADS,), 0,
                   stream, (DevicePtr(out_ptr), DevicePtr(expert_out_ptr),
                            DevicePtr(topk_weights_ptr), DevicePtr(shared_ptr),
                            DevicePtr(shared_gate_ptr), np.int32(n_tokens), np.int32(hidden),
                            np.int32(top_k)))


def sigmoid_f32(g: np.ndarray) -> np.ndarray:
    """1 / (1 + expf(-g)) in float32, each step rounded as the kernel's."""
    g = np.asarray(g, np.float32)
    with np.errstate(over="ignore"):
        e = np.exp(np.negative(g))
        e += np.float32(1.0)
        return np.float32(1.0) / e


def combine_f32(y: np.ndarray, w: np.ndarray, shared=None, gate=None) -> np.ndarray:
    """float32 [n, hidden]: the sum in slot order (y [n, k, hidden], w [n, k]), before the
    BF16 rounding."""
    acc = np.zeros((y.shape[0], y.shape[2]), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for s in range(y.shape[1]):
            acc += w[:, s, None] * y[:, s]
        if shared is not None:
            g = np.ones(len(acc), np.float32) if gate is None else sigmoid_f32(gate)
            acc += g[:, None] * shared
    return acc


@twin(MODULE, "moe_combine")
def _combine_twin(ctx, out_ptr, y_ptr, w_ptr, shared_ptr, gate_ptr, n_tokens, hidden,
                  top_k) -> None:
    _combine(ctx, out_ptr, y_ptr, w_ptr, shared_ptr, gate_ptr, n_tokens, hidden, top_k, False)


@twin(MODULE, "moe_combine_f32")
def _combine_f32_twin(ctx, out_ptr, y_ptr, w_ptr, shared_ptr, gate_ptr, n_tokens, hidden,
                      top_k) -> None:
    _combine(ctx, out_ptr, y_ptr, w_ptr, shared_ptr, gate_ptr, n_tokens, hidden, top_k, True)


def _combine(ctx, out_ptr, y_ptr, w_ptr, shared_ptr, gate_ptr, n_tokens, hidden, top_k,
             fp32: bool) -> None:
    n, h, k = int(n_tokens), int(hidden), int(top_k)
    y = ctx.read(y_ptr, n * k * h, np.float32).reshape(n, k, h)
    w = ctx.read(w_ptr, n * k, np.float32).reshape(n, k)
    shared = None if int(shared_ptr) == 0 else ctx.read(shared_ptr, n * h, np.float32).reshape(n, h)
    gate = None if int(gate_ptr) == 0 else ctx.read(gate_ptr, n, np.float32)
    out = ctx.view(out_ptr, n * h, np.float32 if fp32 else np.uint16).reshape(n, h)

    def rows(lo: int, hi: int) -> None:   # tokens are independent
        acc = combine_f32(y[lo:hi], w[lo:hi], None if shared is None else shared[lo:hi],
                          None if gate is None else gate[lo:hi])
        out[lo:hi] = acc if fp32 else f32_to_bf16(acc)
    ctx.map_blocks(n, max(1, (1 << 20) // (4 * h * (k + 1))), rows)
