"""How `TransformerModel` reads a forward pass's output (its `ModelLogits` methods): host
copies, device argmax and the masked greedy pick over ANY device pointer — the model's own
arena, a sampler's buffer, a draft model's logits — bounds-checked against the allocation
that holds it (`backend.find_allocation`).

Row format: FP32 only inside the model's own logits arena with FP32 logits on; every other
pointer holds BF16 rows (the original's `logits_ptr_is_fp32`, trait_impl/meta.rs, is true
only for its FP32 buffer). Device argmax runs on the model's default stream whatever stream
handle it is given, as the original's (`trait_impl/meta_argmax.rs` ignores `_stream` and
launches on `default_stream()`): a port from Rust relies on it seeing every forward pass and
copy queued there. Here the default stream first waits (an event, on the device) for the
caller's stream when that is another stream, so work the caller queued there is seen too;
the ids are on the host when the call returns.
"""
from __future__ import annotations

import sys

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from ..gpu_runtime.views import check_device_range
from ..ops import argmax as argmax_ops
from .args import int_arg, ptr_arg
from .guard import exclusive


def _is_ml_bfloat16(dtype) -> bool:
    """Whether `dtype` is ml_dtypes.bfloat16 (BF16 rows may be read into such arrays),
    without importing ml_dtypes: its import takes 1-2 s (numpy 2.4, ml_dtypes 0.7), and
    an array of its dtype exists only where the caller imported it already."""
    ml = sys.modules.get("ml_dtypes")
    return ml is not None and dtype == ml.bfloat16


class LogitsReadout:
    def vocab_size(self) -> int:
        return self._meta.vocab_size

    def logits_buffer_ptr(self) -> DevicePtr:
        return self._ws.logits

    def decode_logits_ptr(self) -> DevicePtr:
        return self._ws.logits

    def decode_logits_fp32(self) -> bool:
        return self.use_fp32_logits

    def hidden_after_norm(self) -> DevicePtr:
        """Row r is the post-final-norm hidden state behind logits row r of the arena:
        the last decode step's rows, or a prefill's last position (row 0, or row_base + i
        in a batched prefill)."""
        return self._ws.final_hidden

    def logits_ptr_is_fp32(self, logits_ptr: DevicePtr) -> bool:
        if not self.use_fp32_logits:
            return False
        base = int(self._ws.logits)
        return base <= int(logits_ptr) < base + self._ws.logits_rows * self._meta.vocab_size * 4

    @exclusive
    def copy_logits_to_host(self, logits_ptr: DevicePtr, dst) -> None:
        what = "copy_logits_to_host"
        ptr = ptr_arg(what, "logits_ptr", logits_ptr)
        view, kind = _host_destination(dst, what)
        fp32 = self.logits_ptr_is_fp32(ptr)
        if kind is not None and kind != ("fp32" if fp32 else "bf16"):
            row = "FP32" if fp32 else "BF16"
            want = "float32" if fp32 else "uint16 or ml_dtypes.bfloat16"
            raise InvalidArgument(f"{what}: dst is a {dst.dtype} array but the rows at {ptr!r} "
                                  f"are {row}; pass a {want} array (or use logits_to_numpy)")
        self._device_range(ptr, view.size, what)
        self.backend.synchronize(self.default_stream())
        if view.size:
            self.backend.copy_d2h(ptr, view)

    @exclusive
    def argmax_on_device(self, logits_ptr: DevicePtr, stream: int) -> int:
        return self._argmax(logits_ptr, 1, stream, "argmax_on_device")[0]

    @exclusive
    def argmax_batch(self, logits_ptr: DevicePtr, n: int, stream: int) -> list[int]:
        n = int_arg("argmax_batch", "n", n, 1)
        return self._argmax(logits_ptr, n, stream, "argmax_batch")

    @exclusive
    def argmax_batch_masked(self, logits_ptr: DevicePtr, n: int, masks, stream: int):
        """Rule and the None cases as the original's `argmax_batch_masked_dispatch`
        (trait_impl/meta_argmax_masked.rs): None for n == 0, `len(masks) != n`, a NULL
        pointer, FP32 rows, a row with more than 8 distinct in-vocab ids, or any row the
        kernel cannot decide (a kept value not finite, every id suppressed)."""
        what = "argmax_batch_masked"
        self._stream_of(stream)   # a bad handle raises before anything is queued
        n = int_arg(what, "n", n, 0)
        rows = _mask_rows(masks, what)
        if isinstance(logits_ptr, (int, np.integer)) and int(logits_ptr) == 0:
            return None
        ptr = ptr_arg(what, "logits_ptr", logits_ptr)
        V, ws, b = self._meta.vocab_size, self._ws, self.backend
        if n == 0 or len(rows) != n or self.logits_ptr_is_fp32(ptr):
            return None
        packed = argmax_ops.pack_masks(rows, V)
        if packed is None:
            return None
        self._device_range(ptr, n * V * 2, what, align=2)
        stream = self._default_after(stream)
        ids: list[int] = []
        for r0 in range(0, n, ws.logits_rows):
            k = min(ws.logits_rows, n - r0)
            b.copy_h2d_async(packed[r0:r0 + k], ws.mask_ids, stream)
            argmax_ops.argmax_bf16_batch_masked(b, stream, ptr.offset(r0 * V * 2), ws.mask_ids,
                                                ws.argmax_out, k, V, V)
            ids += self._read_ids(k, stream)
        return None if any(i >= V for i in ids) else ids

    def _argmax(self, logits_ptr, n: int, stream: int, what: str) -> list[int]:
        self._stream_of(stream)   # a bad handle raises before anything is queued
        ptr = ptr_arg(what, "logits_ptr", logits_ptr)
        V, ws, b = self._meta.vocab_size, self._ws, self.backend
        fp32 = self.logits_ptr_is_fp32(ptr)
        eb = 4 if fp32 else 2
        self._device_range(ptr, n * V * eb, what, align=eb)
        stream = self._default_after(stream)
        ids: list[int] = []
        for r0 in range(0, n, ws.logits_rows):   # argmax_out holds logits_rows ids
            k = min(ws.logits_rows, n - r0)
            rows = ptr.offset(r0 * V * eb)
            if fp32:
                argmax_ops.argmax_fp32(b, stream, rows, ws.argmax_out, k, V)
            else:
                argmax_ops.argmax_bf16_batch(b, stream, rows, ws.argmax_out, k, V)
            ids += self._read_ids(k, stream)
        return ids

    def _read_ids(self, k: int, stream: int) -> list[int]:
        out = np.empty(k, np.uint32)
        self.backend.synchronize(stream)
        self.backend.copy_d2h(self._ws.argmax_out, out)
        return [int(x) for x in out]

    def _device_range(self, ptr: DevicePtr, nbytes: int, what: str, align: int = 1) -> None:
        """`nbytes` at `ptr` must lie inside one live device allocation (and be aligned)."""
        check_device_range(self.backend, ptr, nbytes, what, align)


def _host_destination(dst, what: str) -> tuple[np.ndarray, str | None]:
    """dst as writable bytes, and the row format a typed numpy dst demands (None: bytes)."""
    if isinstance(dst, np.ndarray):
        if not dst.flags.c_contiguous or not dst.flags.writeable:
            raise InvalidArgument(f"{what}: dst must be C-contiguous and writable")
        if dst.dtype == np.uint8:
            kind = None
        elif dst.dtype == np.uint16 or _is_ml_bfloat16(dst.dtype):
            kind = "bf16"
        elif dst.dtype == np.float32:
            kind = "fp32"
        else:
            raise InvalidArgument(f"{what}: dst dtype {dst.dtype} is not a logits format: use "
                                  "uint8 (raw bytes), uint16 / ml_dtypes.bfloat16 (BF16 rows) "
                                  "or float32 (FP32 rows)")
        return dst.reshape(-1).view(np.uint8), kind
    try:
        mv = memoryview(dst)
    except TypeError:
        raise InvalidArgument(f"{what}: dst must be a bytearray, memoryview or numpy array, "
                              f"got {type(dst).__name__}") from None
    if mv.readonly or not mv.c_contiguous:
        raise InvalidArgument(f"{what}: dst must be C-contiguous and writable")
    return np.frombuffer(mv.cast("B"), dtype=np.uint8), None


def _mask_rows(masks, what: str) -> list[list[int]]:
    try:
        rows = [list(r) for r in masks]
    except TypeError:
        raise InvalidArgument(f"{what}: masks must be a sequence of id sequences") from None
    for r in rows:
        for i in r:
            if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
                raise InvalidArgument(f"{what}: mask id {i!r} is not an int")
    return rows
