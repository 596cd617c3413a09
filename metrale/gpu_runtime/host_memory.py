"""HostBackend's memory: the allocation table, bounds-checked views and the conversions
cached per allocation (`convert_cache.py`).

Every allocation is remembered, and a twin can only see memory through `view` (writable)
or `read` (read-only), which check that the range lies inside one live allocation: an
out-of-bounds pointer in orchestration code fails loudly in CI instead of reading a
neighbour. Fresh allocations are zeroed lazily: the OS maps zero pages on first touch, so
a large KV pool costs nothing until used. From LAZY_MAP_MIN bytes they are anonymous
mmaps in 4 KiB pages: numpy asks for transparent huge pages on large arrays, and there the
first touch of each 2 MiB page zeroes all of it (with compaction on a busy machine, 7-45 ms
a touch measured here: a 5-token prefill spent 0.7 s writing its first KV rows into a
3 GiB pool). With `poison` they are filled with
0xFF bytes (a BF16/FP32 NaN), so a read of memory nobody wrote shows up as NaN in the
result. Poisoning writes every byte up front (seconds for a multi-GiB pool), so it is on
where it finds bugs: the test suite (METRALE_POISON_MEMORY=1, tests/conftest.py) and the
EmuBackend's sanitize mode, not on a user's load. Writes are reported to the conversion
cache: a launch's writable views (collected in `_launch_writes` and dropped when the launch
returns, see HostBackend._tracked), copies and memsets (`_write_view` + `_wrote`), and
writable views handed out anywhere else, which pin their allocation while they live.
"""
from __future__ import annotations

import bisect
import mmap
import os
import weakref
from typing import Callable

import numpy as np

from ..errors import DeviceError, InvalidArgument, KernelError
from .convert_cache import ConvertCache, default_budget
from .types import DevicePtr

_ALIGN = 256  # same alignment cudaMalloc gives
LAZY_MAP_MIN = 16 << 20
_LOCATED_MAX = 1 << 14   # _locate's memo, cleared when full


class HostMemory:
    """The memory half of `HostBackend` (which adds launches, streams, events, graphs)."""

    _capture: list | None = None   # set by HostBackend: no allocation during capture
    _guard_bytes = 0               # extra slack after each allocation (EmuBackend's guards)

    def __init__(self, memory_limit_bytes: int | None,
                 convert_cache_bytes: int | None, poison: bool = False) -> None:
        self.poison = bool(poison)
        self._allocs: dict[int, np.ndarray] = {}  # address -> owning uint8 array
        self._sizes: dict[int, int] = {}
        self._starts: list[int] = []  # sorted addresses, for bounds checks
        self._located: dict[tuple, tuple] = {}   # _locate's checked ranges, until a free
        self._live = 0
        self._peak = 0
        self._limit = memory_limit_bytes
        self.convert_cache = ConvertCache(default_budget() if convert_cache_bytes is None
                                          else convert_cache_bytes)
        self._launch_writes: set | None = None   # bases a running launch may write

    def alloc(self, nbytes: int) -> DevicePtr:
        nbytes = int(nbytes)
        if nbytes < 0:
            raise InvalidArgument(f"alloc: nbytes must be >= 0, got {nbytes}")
        if self._capture is not None:
            raise DeviceError("alloc during graph capture: allocate every buffer before capture")
        if self._limit is not None and self._live + nbytes > self._limit:
            raise DeviceError(
                f"out of memory: alloc of {nbytes} bytes with {self._limit - self._live} "
                f"bytes free (memory_limit_bytes={self._limit})")
        size = max(nbytes, 1) + _ALIGN + self._guard_bytes
        if self.poison:
            raw = np.full(size, 0xFF, dtype=np.uint8)
        elif size >= LAZY_MAP_MIN:   # page-aligned, zero pages mapped on first touch
            raw = np.frombuffer(mmap.mmap(-1, size), np.uint8)
        else:
            raw = np.zeros(size, dtype=np.uint8)
        base = raw.ctypes.data
        off = (-base) % _ALIGN
        buf = raw[off:off + max(nbytes, 1)]
        addr = buf.ctypes.data
        self._allocs[addr] = buf
        self._sizes[addr] = nbytes
        bisect.insort(self._starts, addr)
        self._live += nbytes
        self._peak = max(self._peak, self._live)
        self.convert_cache.drop(addr)   # a reused address starts with nothing cached
        return DevicePtr(addr)

    def free(self, ptr: DevicePtr) -> None:
        addr = int(ptr)
        if addr == 0:
            return  # free(NULL) is a no-op, as in the original engine's GpuBackend::free
        if addr not in self._allocs:
            raise InvalidArgument(f"free of {DevicePtr(addr)!r}: not an allocation of this backend")
        del self._allocs[addr]
        self._located.clear()
        self._live -= self._sizes.pop(addr)
        self._starts.pop(bisect.bisect_left(self._starts, addr))
        self.convert_cache.drop(addr)

    def live_bytes(self) -> int:
        return self._live

    def find_allocation(self, ptr) -> tuple[DevicePtr, int] | None:
        """`(base, nbytes)` of the live allocation containing address `ptr`, else None."""
        addr = int(ptr)
        i = bisect.bisect_right(self._starts, addr) - 1
        if addr <= 0 or i < 0:
            return None
        base = self._starts[i]
        size = self._sizes[base]
        if addr < base + size or addr == base:
            return DevicePtr(base), size
        return None

    def peak_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._live

    def total_memory(self) -> int:
        if self._limit is not None:
            return self._limit
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def free_memory(self) -> int:
        if self._limit is not None:
            return self._limit - self._live
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def _locate(self, addr: int, nbytes: int, count: int) -> tuple[int, np.ndarray]:
        """(base, owning array) of the live allocation holding [addr, addr + nbytes)."""
        if count < 0:
            raise KernelError(f"view of {count} elements")
        # the ranges twins pass recur every decode step: remembered until a free (one dict
        # lookup instead of ~1 us of bisect and checks, ~800 times a step)
        hit = self._located.get((addr, nbytes))
        if hit is not None:
            return hit
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr == 0:
            raise KernelError(f"address {DevicePtr(addr)!r} is not inside any live allocation")
        start = self._starts[i]
        size = self._sizes[start]
        if addr + nbytes > start + size:
            raise KernelError(
                f"range [{DevicePtr(addr)!r}, +{nbytes} bytes) runs past the end of its "
                f"allocation ({size} bytes at {DevicePtr(start)!r})")
        if len(self._located) >= _LOCATED_MAX:
            self._located.clear()
        hit = self._located[(addr, nbytes)] = (start, self._allocs[start])
        return hit

    def view(self, ptr, count: int, dtype) -> np.ndarray:
        """A bounds-checked writable view of `count` `dtype` elements at address `ptr`.

        Inside a launch the twin's writes end with the launch; a view handed out anywhere
        else may be written later, so its allocation is pinned (nothing of it is served
        from `convert_cache`) until the view and every view made from it are gone."""
        dtype = np.dtype(dtype)
        addr, count = int(ptr), int(count)
        nbytes = count * dtype.itemsize
        start, buf = self._locate(addr, nbytes, count)
        off = addr - start
        if self._launch_writes is not None:
            self._launch_writes.add(start)
            self.convert_cache.drop(start)
            return buf[off:off + nbytes].view(dtype)
        # Over a memoryview, views derived from `out` keep `out` alive (numpy stops
        # collapsing .base there), so the finalizer runs when the last of them goes.
        out = np.frombuffer(memoryview(buf[off:off + nbytes]), dtype)
        self.convert_cache.pin(start)
        weakref.finalize(out, self.convert_cache.unpin, start)
        return out

    def read(self, ptr, count: int, dtype) -> np.ndarray:
        """A bounds-checked read-only view of `count` `dtype` elements at address `ptr`."""
        dtype = np.dtype(dtype)
        addr, count = int(ptr), int(count)
        nbytes = count * dtype.itemsize
        start, buf = self._locate(addr, nbytes, count)
        out = buf[addr - start:addr - start + nbytes].view(dtype)
        out.flags.writeable = False
        return out

    def converted(self, ptr, nbytes: int, kind: str, convert: Callable[[], object],
                  size: int):
        """`convert()` of the `nbytes` at `ptr`, cached under `kind` until that allocation is
        written or freed (`size`: bytes the result holds). None when the budget refuses it
        or a writable view of it is out."""
        start, _ = self._locate(int(ptr), int(nbytes), 0)
        return self.convert_cache.lookup(start, int(ptr) - start, nbytes, kind, convert,
                                         size)

    def _write_view(self, ptr, nbytes: int) -> tuple[np.ndarray, int]:
        """(writable uint8 view, base) for a copy or memset; the caller writes, then drops."""
        addr = int(ptr)
        start, buf = self._locate(addr, int(nbytes), int(nbytes))
        return buf[addr - start:addr - start + int(nbytes)], start

    def _wrote(self, base: int) -> None:
        self.convert_cache.drop(base)
