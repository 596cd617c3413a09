"""`ModelLogits`: reading a forward pass's output — logits buffers, device argmax, hidden state.

Methods, defaults and docs follow the seed `model_logits.rs` (the supertrait of the
original engine's `Model`) and the upstream `argmax_batch_masked` of 2026-10-07
(`crates/model-engine/src/traits/model/logits.rs`). `logits_to_numpy` is additive.
A logits pointer may be any device pointer (a sampler's buffer, a draft model's logits):
rows are BF16 unless the pointer is inside the model's own FP32 logits buffer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from ..errors import Unsupported
from ..gpu_runtime.types import DevicePtr


class ModelLogits(ABC):
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of logits per row."""

    @abstractmethod
    def copy_logits_to_host(self, logits_ptr: DevicePtr, dst) -> None:
        """Copy logits to the host. A byte buffer (bytearray, memoryview, uint8 array)
        receives exactly `len(dst)` bytes from `logits_ptr`, as in the original; one row is
        `vocab_size * 2` bytes (BF16) or `* 4` (FP32). A typed numpy `dst` must match the
        row format: uint16 / ml_dtypes.bfloat16 for BF16 rows, float32 for FP32 rows."""

    def logits_to_numpy(self, logits_ptr: DevicePtr, n: int = 1) -> np.ndarray:
        """`n` logits rows at `logits_ptr` as a float32 `[n, vocab]` array (BF16 widened
        exactly). Additive: the original has no such method."""
        V = self.vocab_size()
        if self.logits_ptr_is_fp32(logits_ptr):
            out = np.empty((n, V), np.float32)
            self.copy_logits_to_host(logits_ptr, out)
            return out
        bits = np.empty((n, V), np.uint16)
        self.copy_logits_to_host(logits_ptr, bits)
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def logits_ptr_is_fp32(self, logits_ptr: DevicePtr) -> bool:
        """Whether `logits_ptr` holds FP32 logits (`vocab * 4` bytes per row). Default False;
        `TransformerModel` reports its `use_fp32_logits` (False unless loaded with
        `fp32_logits=True`)."""
        return False

    @abstractmethod
    def logits_buffer_ptr(self) -> DevicePtr:
        """The device logits buffer, where a verify pass leaves its `[k, vocab]` rows."""

    @abstractmethod
    def argmax_on_device(self, logits_ptr: DevicePtr, stream: int) -> int:
        """Argmax of one logits row, computed on the device."""

    @abstractmethod
    def argmax_batch(self, logits_ptr: DevicePtr, n: int, stream: int) -> list[int]:
        """Argmax of each of `n` logits rows on the device."""

    def argmax_batch_masked(self, logits_ptr: DevicePtr, n: int, masks: Sequence[Sequence[int]],
                            stream: int) -> list[int] | None:
        """The host greedy pick of each of `n` rows with `masks[i]` suppressed: the largest
        value, the highest index on ties. None when the device path cannot decide (a kept
        value not finite, too many mask ids, ...): the caller runs its host path unchanged.
        Default None."""
        return None

    @abstractmethod
    def hidden_after_norm(self) -> DevicePtr:
        """The post-final-norm hidden state of the last decode step (or of a prefill's last
        position)."""

    def decode_logits_fp32(self) -> bool:
        """Whether single-token decode writes FP32 logits, read from `decode_logits_ptr` at
        4 bytes per element. Default False; `TransformerModel` returns its
        `use_fp32_logits`."""
        return False

    def decode_logits_ptr(self) -> DevicePtr:
        """The buffer single-token decode last wrote its logits to: FP32 when
        `decode_logits_fp32()` is true, else BF16. The default raises, so a model must
        override it; `TransformerModel` does."""
        raise Unsupported("Model.decode_logits_ptr() must be overridden alongside "
                          "decode_logits_fp32() — default cannot return a valid pointer.")
