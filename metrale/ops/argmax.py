"""Device argmax (kernels/argmax.cu): launchers and the bit-exact numpy twin of its rule.

Rule (DESIGN §2): 1024 threads per row; thread t keeps the first strictly greater value of
t, t+1024, ... starting from (-1e30, 0); a halving tree takes the upper slot only when
strictly greater. NaN never wins; a row with nothing > -1e30 gives 0.
The masked host-greedy pick (`argmax_bf16_batch_masked`, below) is a different rule: the
highest index wins ties, suppressed ids never win, a non-finite kept value gives NO_ID.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .bf16 import bf16_to_f32
from .registry import twin

MODULE = "argmax"
THREADS = 1024
_FLOOR = np.float32(-1e30)


def _check(n_rows: int, vocab: int) -> None:
    if n_rows < 1:
        raise InvalidArgument(f"argmax: n_rows must be >= 1, got {n_rows}")
    if not 1 <= vocab < 2**31:
        raise InvalidArgument(f"argmax: vocab must be in [1, 2^31), got {vocab}")


def argmax_bf16(backend, stream: int, logits_ptr, out_ptr, vocab: int) -> None:
    """Argmax of one BF16 row. logits: [vocab] bf16; out: [1] uint32."""
    _check(1, vocab)
    backend.launch(backend.kernel(MODULE, "argmax_bf16"), (1,), (THREADS,), 0, stream,
                   (DevicePtr(logits_ptr), DevicePtr(out_ptr), np.int32(vocab)))


def argmax_bf16_batch(backend, stream: int, logits_ptr, out_ptr, n_rows: int,
                      vocab: int) -> None:
    """Argmax of each BF16 row. logits: [n_rows, vocab] bf16; out: [n_rows] uint32."""
    _check(n_rows, vocab)
    backend.launch(backend.kernel(MODULE, "argmax_bf16_batch"), (n_rows,), (THREADS,), 0,
                   stream, (DevicePtr(logits_ptr), DevicePtr(out_ptr), np.int32(n_rows),
                            np.int32(vocab)))


def argmax_fp32(backend, stream: int, logits_ptr, out_ptr, n_rows: int, vocab: int) -> None:
    """Argmax of each FP32 row. logits: [n_rows, vocab] float32; out: [n_rows] uint32."""
    _check(n_rows, vocab)
    backend.launch(backend.kernel(MODULE, "argmax_fp32"), (n_rows,), (THREADS,), 0, stream,
                   (DevicePtr(logits_ptr), DevicePtr(out_ptr), np.int32(n_rows),
                    np.int32(vocab)))


def argmax_rule(rows: np.ndarray) -> np.ndarray:
    """The device rule on host values. rows: [n, vocab] float32 -> [n] uint32."""
    rows = np.asarray(rows, dtype=np.float32)
    n, vocab = rows.shape
    n_iter = -(-vocab // THREADS)
    # [n, n_iter, 1024]: padding with NaN never wins, like the threads that scan nothing.
    padded = np.full((n, n_iter * THREADS), np.nan, dtype=np.float32)
    padded[:, :vocab] = rows
    cols = padded.reshape(n, n_iter, THREADS)
    clean = np.where(np.isnan(cols), -np.inf, cols)
    j = np.argmax(clean, axis=1)  # first position of each thread's maximum, [n, 1024]
    best = np.take_along_axis(clean, j[:, None, :], axis=1)[:, 0, :]
    won = best > _FLOOR
    val = np.where(won, best, _FLOOR).astype(np.float32)
    idx = np.where(won, j * THREADS + np.arange(THREADS), 0).astype(np.uint32)
    s = THREADS // 2
    while s >= 1:
        take = val[:, s:2 * s] > val[:, :s]
        val[:, :s] = np.where(take, val[:, s:2 * s], val[:, :s])
        idx[:, :s] = np.where(take, idx[:, s:2 * s], idx[:, :s])
        s //= 2
    return idx[:, 0].copy()


@twin(MODULE, "argmax_bf16")
def argmax_bf16_twin(ctx, logits_ptr, out_ptr, vocab) -> None:
    rows = bf16_to_f32(ctx.read(logits_ptr, int(vocab), np.uint16)).reshape(1, -1)
    ctx.view(out_ptr, 1, np.uint32)[:] = argmax_rule(rows)


@twin(MODULE, "argmax_bf16_batch")
def argmax_bf16_batch_twin(ctx, logits_ptr, out_ptr, n_rows, vocab) -> None:
    n, v = int(n_rows), int(vocab)
    rows = bf16_to_f32(ctx.read(logits_ptr, n * v, np.uint16)).reshape(n, v)
    ctx.view(out_ptr, n, np.uint32)[:] = argmax_rule(rows)


@twin(MODULE, "argmax_fp32")
def argmax_fp32_twin(ctx, logits_ptr, out_ptr, n_rows, vocab) -> None:
    n, v = int(n_rows), int(vocab)
    rows = ctx.read(logits_ptr, n * v, np.float32).reshape(n, v)
    ctx.view(out_ptr, n, np.uint32)[:] = argmax_rule(rows)


# -- masked host-greedy pick (kernels/argmax.cu::argmax_bf16_batch_masked) -------------------
# The original engine's `argmax_batch_masked` (2026-10-07; model-engine
# model/trait_impl/meta_argmax_masked.rs and kernels/gb10/common/argmax_feed.cu): among the
# ids not suppressed, the largest value with the HIGHEST index on ties (the host sampler's
# last-of-equal-maxima rule); NO_ID when a kept value is not finite or nothing is kept.
MASK_IDS = 8
MASKED_THREADS = 256
NO_ID = 0xFFFFFFFF


def pack_masks(masks, vocab: int) -> np.ndarray | None:
    """Per-row suppressed ids as the kernel reads them: [n, MASK_IDS] uint32, NO_ID-padded.

    As the original's `pack_masks`: ids outside [0, vocab) and repeats are dropped; a row
    with more than MASK_IDS distinct ids gives None (the device path cannot take it).
    """
    out = np.full((len(masks), MASK_IDS), NO_ID, np.uint32)
    for r, row in enumerate(masks):
        used: list[int] = []
        for i in row:
            i = int(i)
            if not 0 <= i < vocab or i in used:
                continue
            if len(used) == MASK_IDS:
                return None
            used.append(i)
        out[r, : len(used)] = used
    return out


def argmax_bf16_batch_masked(backend, stream: int, logits_ptr, masks_ptr, out_ptr,
                             n_rows: int, vocab: int, row_stride: int) -> None:
    """Masked host-greedy pick of each BF16 row. logits: [n_rows, row_stride] bf16 (first
    vocab read); masks: [n_rows, 8] uint32; out: [n_rows] uint32 (NO_ID = not decidable)."""
    _check(n_rows, vocab)
    if row_stride < vocab:
        raise InvalidArgument(f"argmax_masked: row_stride {row_stride} < vocab {vocab}")
    backend.launch(backend.kernel(MODULE, "argmax_bf16_batch_masked"), (n_rows,),
                   (MASKED_THREADS,), 0, stream,
                   (DevicePtr(logits_ptr), DevicePtr(masks_ptr), DevicePtr(out_ptr),
                    np.int32(n_rows), np.int32(vocab), np.int32(row_stride)))


def masked_greedy_rule(rows: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """The masked rule on host values. rows: [n, vocab] float32; masks: [n, 8] uint32 ->
    [n] uint32."""
    rows = np.asarray(rows, np.float32)
    n, vocab = rows.shape
    out = np.full(n, NO_ID, np.uint32)
    for r in range(n):
        keep = np.ones(vocab, bool)
        ids = masks[r][masks[r] < vocab].astype(np.int64)
        keep[ids] = False
        vals = rows[r][keep]
        if vals.size == 0 or not np.isfinite(vals).all():
            continue
        idx = np.flatnonzero(keep & (rows[r] == vals.max()))  # +0 == -0 here too
        out[r] = idx[-1]
    return out


@twin(MODULE, "argmax_bf16_batch_masked")
def argmax_bf16_batch_masked_twin(ctx, logits_ptr, masks_ptr, out_ptr, n_rows, vocab,
                                  row_stride) -> None:
    n, v, stride = int(n_rows), int(vocab), int(row_stride)
    bits = ctx.read(logits_ptr, (n - 1) * stride + v, np.uint16)
    rows = np.stack([bf16_to_f32(bits[r * stride:r * stride + v]) for r in range(n)])
    masks = ctx.read(masks_ptr, n * MASK_IDS, np.uint32).reshape(n, MASK_IDS)
    ctx.view(out_ptr, n, np.uint32)[:] = masked_greedy_rule(rows, masks)


# -- NaN / Inf count of logits rows (kernels/argmax.cu::count_nonfinite_*) ------------------
# The engine's check before it picks a token: not in the original engine.
NONFINITE_THREADS = 256


def count_nonfinite(backend, stream: int, logits_ptr, out_ptr, n_rows: int, vocab: int,
                    fp32: bool = False) -> None:
    """How many values of each row are NaN or +-inf. logits: [n_rows, vocab] bf16 (or
    float32 with `fp32`); out: [n_rows] uint32."""
    _check(n_rows, vocab)
    name = "count_nonfinite_fp32" if fp32 else "count_nonfinite_bf16"
    backend.launch(backend.kernel(MODULE, name), (n_rows,), (NONFINITE_THREADS,), 0, stream,
                   (DevicePtr(logits_ptr), DevicePtr(out_ptr), np.int32(n_rows),
                    np.int32(vocab)))


def nonfinite_counts(rows: np.ndarray) -> np.ndarray:
    """The kernel's count on host values (any float dtype). rows: [n, vocab] -> [n] uint32."""
    return np.count_nonzero(~np.isfinite(np.asarray(rows)), axis=1).astype(np.uint32)


@twin(MODULE, "count_nonfinite_bf16")
def count_nonfinite_bf16_twin(ctx, logits_ptr, out_ptr, n_rows, vocab) -> None:
    n, v = int(n_rows), int(vocab)
    bits = ctx.read(logits_ptr, n * v, np.uint16).reshape(n, v)
    # exponent all ones: NaN or inf (the kernel's test, on the bits)
    ctx.view(out_ptr, n, np.uint32)[:] = np.count_nonzero((bits & 0x7F80) == 0x7F80, axis=1)


@twin(MODULE, "count_nonfinite_fp32")
def count_nonfinite_fp32_twin(ctx, logits_ptr, out_ptr, n_rows, vocab) -> None:
    n, v = int(n_rows), int(vocab)
    rows = ctx.read(logits_ptr, n * v, np.float32).reshape(n, v)
    ctx.view(out_ptr, n, np.uint32)[:] = nonfinite_counts(rows)
