"""Moving numpy arrays to and from any backend's raw pointers, for kernel tests; the GEMM
twin's implementations."""
from __future__ import annotations

import platform
from contextlib import contextmanager
from functools import lru_cache

import numpy as np
import pytest

from metrale.gpu_runtime import DevicePtr, native


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


GEMM_PATHS = ("dp", "fma", "avx2", "portable", "numpy")


@contextmanager
def gemm_twin_path(path: str):
    """The GEMM twin implementation `path` of GEMM_PATHS for `ops.gemm_tc.dot_f32`'s
    `native` argument: the native library with VDPBF16PS ("dp") or float32 FMAs ("fma"),
    built without AVX-512 ("avx2": gemm_avx2.h's 8-lane tiles), built with
    -DMD_PORTABLE (float64 steps, the non-x86 path), or None (numpy).
    Skips where this machine cannot run it; restores the library's default."""
    if path == "numpy":
        yield None
        return
    lib = native.try_load()
    if lib is None:
        pytest.skip("no C++ compiler: the native GEMM twin cannot be built")
    if path in ("avx2", "portable"):
        yield _variant(path)
        return
    if lib.set_dp(path == "dp") != (path == "dp"):
        pytest.skip("this CPU has no VDPBF16PS path (or it failed the load-time check)")
    try:
        yield lib
    finally:
        lib.set_dp(True)   # the default: on where built and checked


@lru_cache(maxsize=None)
def _variant(path: str):
    if path == "avx2" and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the AVX2 build needs an x86-64 CPU")
    flag = "-mno-avx512f" if path == "avx2" else "-DMD_PORTABLE"
    return native.NativeKernels(native._build((*native.TUNE, flag)))
