"""`ModelLogits`: reading a forward pass's output — logits buffers, device argmax, hidden state.

Methods, defaults and docs follow the seed `model_logits.rs` (the supertrait of the
original engine's `Model`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..errors import Unsupported
from ..gpu_runtime.types import DevicePtr


class ModelLogits(ABC):
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of logits per row."""

    @abstractmethod
    def copy_logits_to_host(self, logits_ptr: DevicePtr, dst) -> None:
        """Copy logits rows to the host; `dst` is `vocab_size * 2` bytes per BF16 row
        (`* 4` per FP32 row). A larger `dst` copies that many whole rows."""

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

    @abstractmethod
    def hidden_after_norm(self) -> DevicePtr:
        """The post-final-norm hidden state of the last decode step."""

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
