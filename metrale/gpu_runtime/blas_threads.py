"""numpy's OpenBLAS held to one thread while a HostBackend twin runs.

Why: OpenBLAS worker threads busy-wait for a while after every multi-threaded call (a
twin's small batched matmul in attention, say), and on a machine with few cores they take
the cores the native GEMM twin (native.py) runs on next: measured on 2 cores, a
Qwen2.5-0.5B-shaped prefill's GEMMs took 1.29 s instead of 0.70 s. The twins' own BLAS
calls are small, so one thread costs them little. Scoped to the launch (the previous
count is restored), so the user's numpy is left as it was.

Found the way threadpoolctl does it: the OpenBLAS library numpy loaded is looked up in
/proc/self/maps and its `*openblas_set_num_threads*` entry points are called through
ctypes. Where there is none (MKL, Accelerate, not Linux) `limit()` does nothing.
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from functools import lru_cache

# (getter, setter) names across OpenBLAS builds: scipy-openblas wheels (64-bit ints,
# prefixed and suffixed), 64-bit-int builds, plain builds
_NAMES = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
          ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
          ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
          ("openblas_get_num_threads", "openblas_set_num_threads"))


class _OpenBlas:
    def __init__(self, get, set_) -> None:
        self._get, self._set = get, set_

    def threads(self) -> int:
        return int(self._get())

    def set_threads(self, n: int) -> None:
        self._set(int(n))


@lru_cache(maxsize=1)
def openblas():
    """The OpenBLAS numpy uses, or None when it cannot be found or controlled."""
    import numpy  # noqa: F401  (loads the BLAS library this looks for)
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f
                     if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return None
    for path in sorted(p for p in paths if p.startswith("/")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get_name, set_name in _NAMES:
            get, set_ = getattr(lib, get_name, None), getattr(lib, set_name, None)
            if get is not None and set_ is not None:
                get.restype, get.argtypes = ctypes.c_int, []
                set_.restype, set_.argtypes = None, [ctypes.c_int]
                return _OpenBlas(get, set_)
    return None


@contextmanager
def limit(blas):
    """One BLAS thread inside the block (`blas` from `openblas()`, None: no change)."""
    if blas is None:
        yield
        return
    before = blas.threads()
    if before <= 1:
        yield
        return
    blas.set_threads(1)
    try:
        yield
    finally:
        blas.set_threads(before)
