"""Moving numpy arrays to and from any backend's raw pointers, for kernel tests."""
from __future__ import annotations

import numpy as np

from metrale.gpu_runtime import DevicePtr


class Buffers:
    """Allocations made for one test; `free_all()` returns them (tests check leaks)."""

    def __init__(self, backend):
        self.backend = backend
        self.ptrs: list[DevicePtr] = []

    def put(self, arr: np.ndarray) -> DevicePtr:
        arr = np.ascontiguousarray(arr)
        p = self.backend.alloc(arr.nbytes)
        self.ptrs.append(p)
        self.backend.copy_h2d(arr, p)
        return p

    def empty(self, shape, dtype) -> DevicePtr:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        p = self.backend.alloc(n)
        self.ptrs.append(p)
        return p

    def get(self, ptr, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        self.backend.synchronize(self.backend.default_stream())
        self.backend.copy_d2h(ptr, out)
        return out

    def free_all(self) -> None:
        for p in self.ptrs:
            self.backend.free(p)
        self.ptrs.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free_all()
