"""`OwnedBuffers`: the device allocations one object (a model's weights, a workspace, a
vision tower) makes over its life and frees together."""
from __future__ import annotations

from .types import DevicePtr


class OwnedBuffers:
    """Mixin: `_alloc` / `_own` record allocations, `free` releases every one once. The
    class sets `self.backend` and `self._owned = []` in its __init__."""

    backend: object
    _owned: list[DevicePtr]

    def _alloc(self, nbytes: int) -> DevicePtr:
        """A new allocation of nbytes, freed by `free`."""
        return self._own(self.backend.alloc(nbytes))

    def _own(self, ptr: DevicePtr) -> DevicePtr:
        """Take ownership of `ptr` (freed by `free`); returns it."""
        self._owned.append(ptr)
        return ptr

    def free(self) -> None:
        """Free every owned allocation (again: nothing)."""
        for p in self._owned:
            self.backend.free(p)
        self._owned.clear()
