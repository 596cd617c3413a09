"""Converted copies of HostBackend allocations (BF16 weights widened to float64 for the numpy
path of the GEMM twin), kept until the allocation is written or freed.

Soundness rests on HostBackend reporting every write: `drop(base)` runs after a copy or
memset into the allocation at `base`, when a launch (a twin, or an emulated kernel) got a
writable view of it or a pointer into it, and when it is freed. A writable view handed out
outside a launch (`HostBackend.view`, `device_array`) may be written at any later time, so
while one is alive its allocation is `pinned` and never served from the cache.

Budget: conversions are admitted first come, first served while their bytes fit
`budget_bytes`; one that does not fit is not cached (`lookup` returns None and the caller
converts for that call alone). Nothing is evicted to make room, so a model larger than the
budget keeps a fixed cached part instead of thrashing.
"""
from __future__ import annotations

from typing import Callable, NamedTuple



class _Entry(NamedTuple):
    value: object
    nbytes: int


def default_budget() -> int:
    """Half of the RAM available now (Linux MemAvailable; else the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    import os
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") // 2
    except (ValueError, OSError):
        return 0


class ConvertCache:
    """Per allocation `base`: values keyed by `(offset, nbytes, kind)`; see the module doc."""

    def __init__(self, budget_bytes: int) -> None:
        if int(budget_bytes) < 0:
            raise ValueError(f"convert_cache_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.used_bytes = 0
        self.hits = self.misses = self.refused = 0
        self._by_base: dict[int, dict[tuple, _Entry]] = {}
        self._pinned: dict[int, int] = {}   # base -> live writable views outside launches

    def lookup(self, base: int, offset: int, nbytes: int, kind: str,
               convert: Callable[[], object], size: int):
        """The cached value for `(offset, nbytes, kind)` of allocation `base`, converting
        (`convert()`, whose result holds `size` bytes) on a miss. None when the allocation is
        pinned or `size` does not fit the budget: the caller converts without caching."""
        if base in self._pinned:
            self.refused += 1
            return None
        entries = self._by_base.get(base)
        key = (int(offset), int(nbytes), kind)
        if entries is not None:
            e = entries.get(key)
            if e is not None:
                self.hits += 1
                return e.value
        if self.used_bytes + size > self.budget_bytes:
            self.refused += 1
            return None
        self.misses += 1
        value = convert()
        self._by_base.setdefault(base, {})[key] = _Entry(value, int(size))
        self.used_bytes += int(size)
        return value

    def drop(self, base: int) -> None:
        """Forget every conversion of allocation `base` (it was written or freed)."""
        entries = self._by_base.pop(base, None)
        if entries:
            self.used_bytes -= sum(e.nbytes for e in entries.values())

    def pin(self, base: int) -> None:
        self.drop(base)
        self._pinned[base] = self._pinned.get(base, 0) + 1

    def unpin(self, base: int) -> None:
        """A writable view of `base` is gone; it may have written, so conversions drop."""
        left = self._pinned.get(base, 0) - 1
        if left > 0:
            self._pinned[base] = left
        else:
            self._pinned.pop(base, None)
        self.drop(base)

    def stats(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "used_bytes": self.used_bytes,
                "hits": self.hits, "misses": self.misses, "refused": self.refused,
                "allocations": len(self._by_base), "pinned": len(self._pinned)}
