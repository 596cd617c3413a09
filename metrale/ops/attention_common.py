"""What the paged attention launchers share (ops/attention.py's prefill, attention_decode.py's
split-K decode, attention_tc.py's tensor-core prefill): the kernels' constants, the argument
checks every launch makes, and the per-head sink logits the twins read.

Options of every paged attention kernel (kernels/attention.cu, attention_tc.cu), off by
default: `softcap` > 0 caps each score as softcap * tanh(score / softcap) (Gemma 2's
attn_logit_softcapping, score = q.k * scale); `sinks_ptr` (fp32 [num_heads]) gives head h a
learned sink logit that joins the softmax's denominator only (gpt-oss).
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument
from .checks import check_heads, check_ptrs

MODULE = "attention"
THREADS = 128
WARPS = 4
MAX_HEAD_DIM = 256
DECODE_SPLIT_TOKENS = 256
LOG2E = np.float32(1.4426950408889634)
GRID_YZ_MAX = 65535


def check_common(what, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq,
                 scale, sliding_window, softcap=0.0, sinks_ptr=0) -> None:
    """The checks of every paged attention launch; InvalidArgument naming the argument."""
    check_heads(what, num_heads, num_kv_heads, head_dim, MAX_HEAD_DIM)
    if block_size < 1:
        raise InvalidArgument(f"{what}: block_size must be >= 1, got {block_size}")
    if max_blocks_per_seq < 1:
        raise InvalidArgument(f"{what}: max_blocks_per_seq must be >= 1, got "
                              f"{max_blocks_per_seq}")
    if block_size * max_blocks_per_seq >= 2**31:
        raise InvalidArgument(f"{what}: block_size * max_blocks_per_seq exceeds 2^31")
    if not (math.isfinite(scale) and scale > 0):
        raise InvalidArgument(f"{what}: scale must be finite and > 0, got {scale}")
    if sliding_window < 0 or sliding_window >= 2**31:
        raise InvalidArgument(f"{what}: sliding_window must be in [0, 2^31), got "
                              f"{sliding_window}")
    if num_heads > GRID_YZ_MAX:
        raise InvalidArgument(f"{what}: num_heads {num_heads} exceeds {GRID_YZ_MAX}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise InvalidArgument(f"{what}: softcap must be finite and >= 0 (0: off), got "
                              f"{softcap}")
    if int(sinks_ptr):
        check_ptrs(what, 4, sinks=sinks_ptr)


def sinks_base2(ctx, sinks_ptr, num_heads: int) -> np.ndarray | None:
    """float32 [num_heads] sink logits times log2(e) (as the kernels scale them), or None
    when sinks_ptr is NULL."""
    if not int(sinks_ptr):
        return None
    return ctx.read(sinks_ptr, int(num_heads), np.float32) * LOG2E
