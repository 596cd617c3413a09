"""Depthwise causal conv1d with a per-sequence state (kernels/causal_conv1d.cu, module
"causal_conv1d"): the short convolution of gated DeltaNet (q|k|v channels) and Mamba2
(x|B|C channels). Launchers and numpy twins.

Per channel c: out[t, c] = bf16(act(sum_j w[c, j] * x[t - (W-1) + j, c] + bias[c])), FP32,
taps in ascending j, each product and sum rounded on its own (no FMA), bias last, act =
SiLU or identity. Inputs before a sequence's first row come from its state slot, or are zero
for a fresh sequence (start_pos == 0: the slot is not read).

Layouts (element strides; BF16 unless noted):
  x    [n_tokens, x_stride]   the channels are the first `channels` of each row
  out  [n_tokens, out_stride]
  w    [channels, W]          HF's Conv1d weight [channels, 1, W] without its middle axis
  bias [channels] or NULL
  state pool: slot s at state_pool + s * slot_stride elements, [W-1, channels] BF16,
              time-major (row W-2 the newest input); `state_elements(channels, W)` per slot.
  slots int32 [n_seqs], cu_seqlens int32 [n_seqs + 1], start_pos int32 [n_seqs] on device.
Prefill: the rows of sequence i are cu_seqlens[i] .. cu_seqlens[i+1]; its state is read
(unless start_pos[i] == 0) and the last W-1 inputs are written back, so a prefill split
anywhere continues bit-exactly. Update (decode): row i is sequence i's one new token.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import NULL, DevicePtr
from .activation import silu_f32
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs, check_sizes, int_range
from .registry import twin

MODULE = "causal_conv1d"
THREADS = 128
TILE = 64              # tokens per prefill tile (CC_TILE)
MAX_WIDTH = 4
_GRID_MAX = 65535


def state_elements(channels: int, width: int) -> int:
    """BF16 elements of one sequence's conv state: (W - 1) * channels."""
    return (int(width) - 1) * int(channels)


def _check(what, out_stride, x_stride, slot_stride, channels, width, n_seqs, ptrs) -> bool:
    """Validate sizes and pointers; return whether the 8-channel vector path applies."""
    check_sizes(what, channels=channels, n_seqs=n_seqs, out_stride=out_stride,
                x_stride=x_stride, slot_stride=slot_stride)
    if not 2 <= int(width) <= MAX_WIDTH:
        raise InvalidArgument(f"{what}: width must be in [2, {MAX_WIDTH}], got {width}")
    if int(x_stride) < int(channels) or int(out_stride) < int(channels):
        raise InvalidArgument(f"{what}: x_stride ({x_stride}) and out_stride ({out_stride}) "
                              f"must be >= channels ({channels})")
    if int(slot_stride) < state_elements(channels, width):
        raise InvalidArgument(f"{what}: slot_stride ({slot_stride}) is less than the state "
                              f"of {state_elements(channels, width)} elements")
    if int(n_seqs) > _GRID_MAX:
        raise InvalidArgument(f"{what}: n_seqs {n_seqs} exceeds {_GRID_MAX}")
    check_ptrs(what, **ptrs)
    vec = all(int(v) % 8 == 0 for v in (channels, x_stride, out_stride, slot_stride))
    return vec and all(int(p) % 16 == 0 for p in ptrs.values())


def causal_conv1d_prefill(backend, stream: int, out_ptr, out_stride: int, x_ptr,
                          x_stride: int, w_ptr, bias_ptr, state_pool_ptr, slot_stride: int,
                          slots_ptr, cu_seqlens_ptr, start_pos_ptr, n_seqs: int,
                          max_seqlen: int, channels: int, width: int,
                          silu: bool = True) -> None:
    """Causal conv over a ragged batch of sequences, reading and writing their states.

    out/x: [n_tokens, *_stride] bf16 rows (sequence i = rows cu_seqlens[i]..[i+1]);
    w [channels, width] bf16; bias [channels] bf16 or NULL; state pool as in the module
    docstring. `max_seqlen` only sizes the grid (any value >= 1 is correct).
    """
    what = "causal_conv1d_prefill"
    check_sizes(what, max_seqlen=max_seqlen)
    vec = _check(what, out_stride, x_stride, slot_stride, channels, width, n_seqs,
                 dict(out_ptr=out_ptr, x_ptr=x_ptr, w_ptr=w_ptr, state_pool_ptr=state_pool_ptr,
                      slots_ptr=slots_ptr, cu_seqlens_ptr=cu_seqlens_ptr,
                      start_pos_ptr=start_pos_ptr))
    bias_ptr = NULL if bias_ptr is None else bias_ptr
    if int(bias_ptr) % 16:
        vec = False
    per_block = THREADS * (8 if vec else 1)
    grid = (-(-int(channels) // per_block), int(n_seqs),
            min(_GRID_MAX, -(-int(max_seqlen) // TILE)))
    func = "causal_conv1d_prefill_v8" if vec else "causal_conv1d_prefill_v1"
    backend.launch(backend.kernel(MODULE, func), grid, (THREADS,), 0, stream,
                   (DevicePtr(out_ptr), np.int32(out_stride), DevicePtr(x_ptr),
                    np.int32(x_stride), DevicePtr(w_ptr), DevicePtr(bias_ptr),
                    DevicePtr(state_pool_ptr), np.int64(slot_stride), DevicePtr(slots_ptr),
                    DevicePtr(cu_seqlens_ptr), DevicePtr(start_pos_ptr), np.int32(channels),
                    np.int32(width), np.int32(1 if silu else 0)))


def causal_conv1d_update(backend, stream: int, out_ptr, out_stride: int, x_ptr, x_stride: int,
                         w_ptr, bias_ptr, state_pool_ptr, slot_stride: int, slots_ptr,
                         n_seqs: int, channels: int, width: int, silu: bool = True) -> None:
    """One decode token per sequence: out[i] = conv(state of slots[i] ++ x[i]); the state
    shifts by one input. Layouts as causal_conv1d_prefill (row i = sequence i)."""
    what = "causal_conv1d_update"
    vec = _check(what, out_stride, x_stride, slot_stride, channels, width, n_seqs,
                 dict(out_ptr=out_ptr, x_ptr=x_ptr, w_ptr=w_ptr, state_pool_ptr=state_pool_ptr,
                      slots_ptr=slots_ptr))
    bias_ptr = NULL if bias_ptr is None else bias_ptr
    if int(bias_ptr) % 16:
        vec = False
    per_block = THREADS * (8 if vec else 1)
    func = "causal_conv1d_update_v8" if vec else "causal_conv1d_update_v1"
    backend.launch(backend.kernel(MODULE, func), (-(-int(channels) // per_block), int(n_seqs)),
                   (THREADS,), 0, stream,
                   (DevicePtr(out_ptr), np.int32(out_stride), DevicePtr(x_ptr),
                    np.int32(x_stride), DevicePtr(w_ptr), DevicePtr(bias_ptr),
                    DevicePtr(state_pool_ptr), np.int64(slot_stride), DevicePtr(slots_ptr),
                    np.int32(channels), np.int32(width), np.int32(1 if silu else 0)))


# ---- the twins ------------------------------------------------------------------------------
def conv_rows_f32(ext: np.ndarray, taps: np.ndarray, bias: np.ndarray | None,
                  silu: bool) -> np.ndarray:
    """The kernel's formula: ext [W-1+n, C] float32 (state rows, then inputs), taps [W, C]
    float32 (w transposed) -> [n, C] float32 (before the BF16 store), in the kernel's
    rounding order."""
    width = taps.shape[0]
    n = ext.shape[0] - (width - 1)
    acc = taps[0] * ext[0:n]
    for j in range(1, width):
        acc += taps[j] * ext[j:j + n]      # float32 product, then float32 sum: no FMA
    if bias is not None:
        acc += bias
    return silu_f32(acc) if silu else acc


def _rows(ctx, ptr, first: int, n: int, stride: int, channels: int) -> np.ndarray:
    """[n, channels] uint16 view of rows first..first+n of a strided BF16 matrix."""
    if n == 0:
        return np.zeros((0, channels), np.uint16)
    flat = ctx.read(DevicePtr(ptr).offset(2 * first * stride), (n - 1) * stride + channels,
                    np.uint16)
    return np.lib.stride_tricks.as_strided(flat, (n, channels), (2 * stride, 2))


def _out_rows(ctx, ptr, first: int, n: int, stride: int, channels: int) -> np.ndarray:
    flat = ctx.view(DevicePtr(ptr).offset(2 * first * stride), (n - 1) * stride + channels,
                    np.uint16)
    return np.lib.stride_tricks.as_strided(flat, (n, channels), (2 * stride, 2))


def _slot_view(ctx, pool, slot: int, slot_stride: int, rows: int, channels: int) -> np.ndarray:
    if slot < 0:
        raise InvalidArgument(f"causal_conv1d: slot {slot} is negative")
    return ctx.view(DevicePtr(pool).offset(2 * slot * slot_stride), rows * channels,
                    np.uint16).reshape(rows, channels)


def _params(ctx, w_ptr, bias_ptr, channels: int, width: int):
    """(taps [W, channels] = w transposed, bias [channels] or None) as float32, converted
    once and cached with their allocation (a decode step would convert them every launch)."""
    def convert():
        return np.ascontiguousarray(bf16_to_f32(ctx.read(w_ptr, channels * width,
                                                         np.uint16)).reshape(channels, width).T)
    nbytes = channels * width * 2
    w = ctx.backend.converted(w_ptr, nbytes, "causal_conv1d.w", convert, 2 * nbytes)
    w = convert() if w is None else w
    if int(bias_ptr) == 0:
        return w, None

    def convert_b():
        return bf16_to_f32(ctx.read(bias_ptr, channels, np.uint16))
    b = ctx.backend.converted(bias_ptr, channels * 2, "causal_conv1d.bias", convert_b,
                              channels * 4)
    return w, (convert_b() if b is None else b)


def _prefill_twin(ctx, out_ptr, out_stride, x_ptr, x_stride, w_ptr, bias_ptr, pool,
                  slot_stride, slots_ptr, cu_ptr, start_ptr, channels, width, silu) -> None:
    C, W, n = int(channels), int(width), int(ctx.grid[1])
    w, bias = _params(ctx, w_ptr, bias_ptr, C, W)
    cu = ctx.read(cu_ptr, n + 1, np.int32).astype(np.int64)
    slots = ctx.read(slots_ptr, n, np.int32)
    start = ctx.read(start_ptr, n, np.int32)
    if n and int_range(np.diff(cu))[0] < 0:
        raise InvalidArgument("causal_conv1d_prefill: cu_seqlens must be non-decreasing")
    for i in range(n):
        first, length = int(cu[i]), int(cu[i + 1] - cu[i])
        if length == 0:
            continue
        st = _slot_view(ctx, pool, int(slots[i]), int(slot_stride), W - 1, C)
        old = np.zeros((W - 1, C), np.uint16) if int(start[i]) == 0 else st.copy()
        ext = np.concatenate([old, _rows(ctx, x_ptr, first, length, int(x_stride), C)])
        y = conv_rows_f32(bf16_to_f32(ext), w, bias, bool(int(silu)))
        _out_rows(ctx, out_ptr, first, length, int(out_stride), C)[:] = f32_to_bf16(y)
        st[:] = ext[-(W - 1):]


def _update_twin(ctx, out_ptr, out_stride, x_ptr, x_stride, w_ptr, bias_ptr, pool,
                 slot_stride, slots_ptr, channels, width, silu) -> None:
    C, W, n = int(channels), int(width), int(ctx.grid[1])
    w, bias = _params(ctx, w_ptr, bias_ptr, C, W)
    slots = ctx.read(slots_ptr, n, np.int32)
    x = _rows(ctx, x_ptr, 0, n, int(x_stride), C)
    states = [_slot_view(ctx, pool, int(s), int(slot_stride), W - 1, C) for s in slots]
    # every sequence at once: ext[j] is tap j's input row of each sequence ([W, n, C])
    ext = np.empty((W, n, C), np.uint16)
    for i, st in enumerate(states):
        ext[:W - 1, i] = st
    ext[W - 1] = x
    y = _taps_f32(bf16_to_f32(ext), w, bias, bool(int(silu)))
    _out_rows(ctx, out_ptr, 0, n, int(out_stride), C)[:] = f32_to_bf16(y)
    for i, st in enumerate(states):
        st[:] = ext[1:, i]


def _taps_f32(ext: np.ndarray, w: np.ndarray, bias, silu: bool) -> np.ndarray:
    """conv_rows_f32 for one output row per sequence: ext [W, n, C] float32, w [W, C] -> [n, C], the
    same rounding order (product, then sum, taps ascending, bias last)."""
    acc = w[0] * ext[0]
    for j in range(1, w.shape[0]):
        acc += w[j] * ext[j]
    if bias is not None:
        acc += bias
    return silu_f32(acc) if silu else acc


for _v in ("v8", "v1"):
    twin(MODULE, f"causal_conv1d_prefill_{_v}")(_prefill_twin)
    twin(MODULE, f"causal_conv1d_update_{_v}")(_update_twin)
