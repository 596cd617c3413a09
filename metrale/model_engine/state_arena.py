"""The device bytes of the recurrent-state pool (kv/state_pool.py): per recurrent layer, every
slot's FP32 state and BF16 conv window, laid out as the kernels address them.

    state  [layers][total_slots][state_stride]  float32   (layer l's pool: state_base(l))
    conv   [layers][total_slots][conv_stride]   bf16      (conv_base(l))

so slot s of layer l is at `state_base(l) + s * state_stride` elements, the
`state_pool + slot * slot_stride` of ops/gated_delta_rule.py, ops/mamba2_ssd.py and
ops/causal_conv1d.py. Copying or zeroing a slot touches every layer (2 * layers copies).
"""
from __future__ import annotations

from ..gpu_runtime.types import DevicePtr


def _round8(n: int) -> int:
    return -(-int(n) // 8) * 8


class StateArena:
    """Device memory for `total_slots` slots of `layers` recurrent layers, each slot holding
    `state_elements` FP32 and `conv_elements` BF16 values per layer."""

    def __init__(self, backend, layers: int, state_elements: int, conv_elements: int,
                 total_slots: int) -> None:
        self.backend, self.layers, self.total_slots = backend, int(layers), int(total_slots)
        # multiples of 8 elements: 16-byte aligned slots (the kernels' vector paths)
        self.state_stride, self.conv_stride = _round8(state_elements), _round8(conv_elements)
        self.state_bytes = self.state_stride * 4      # one slot of one layer
        self.conv_bytes = self.conv_stride * 2
        self._state = self._conv = None
        self._state = backend.alloc(self.layers * self.total_slots * self.state_bytes)
        try:
            self._conv = backend.alloc(self.layers * self.total_slots * self.conv_bytes)
        except BaseException:
            self.free()
            raise

    @staticmethod
    def estimate_bytes(layers: int, state_elements: int, conv_elements: int,
                       total_slots: int) -> int:
        return int(layers) * int(total_slots) * (_round8(state_elements) * 4 +
                                                 _round8(conv_elements) * 2)

    @property
    def nbytes(self) -> int:
        return self.layers * self.total_slots * (self.state_bytes + self.conv_bytes)

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one slot over every layer (one sequence's recurrent state)."""
        return self.layers * (self.state_bytes + self.conv_bytes)

    def state_base(self, layer: int) -> DevicePtr:
        return self._state.offset(layer * self.total_slots * self.state_bytes)

    def conv_base(self, layer: int) -> DevicePtr:
        return self._conv.offset(layer * self.total_slots * self.conv_bytes)

    def state_ptr(self, layer: int, slot: int) -> DevicePtr:
        return self.state_base(layer).offset(slot * self.state_bytes)

    def conv_ptr(self, layer: int, slot: int) -> DevicePtr:
        return self.conv_base(layer).offset(slot * self.conv_bytes)

    def copy_layer(self, layer: int, src: int, dst: int, stream: int) -> None:
        """Slot `src` -> slot `dst` of one layer (state and conv window)."""
        b = self.backend
        b.copy_d2d_async(self.state_ptr(layer, src), self.state_ptr(layer, dst),
                         self.state_bytes, stream)
        b.copy_d2d_async(self.conv_ptr(layer, src), self.conv_ptr(layer, dst),
                         self.conv_bytes, stream)

    def copy_slot(self, src: int, dst: int, stream: int) -> None:
        """Slot `src` -> slot `dst` of every layer."""
        for layer in range(self.layers):
            self.copy_layer(layer, src, dst, stream)

    def zero_slot(self, slot: int, stream: int) -> None:
        """The state of a sequence with nothing cached: zeros in every layer."""
        for layer in range(self.layers):
            self.backend.memset_async(self.state_ptr(layer, slot), 0, self.state_bytes, stream)
            self.backend.memset_async(self.conv_ptr(layer, slot), 0, self.conv_bytes, stream)

    def free(self) -> None:
        for p in (self._state, self._conv):
            if p is not None:
                self.backend.free(p)
        self._state = self._conv = None
