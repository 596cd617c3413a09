"""HostBackend's native LoRA twins (`native/lora_f32.cpp`): the grouped shrink and expand of
kernels/lora.cu in their float32 order, vectorised over the order's own lanes, so that a
decode step with adapters costs the CPU little more than the base GEMMs.

Built like `native_recurrent.py` (the C++ compiler of `cxx.py`, `-march=native`, FMA
contraction off, cached under `<cache_root()>/host/` by source, flags, compiler and CPU): the
numpy twins (ops/lora.py) define the same operations in the same order, so the library
changes the speed and never the bits. Used where the backend runs native code
(`HostBackend.native` is set) and this library builds; otherwise numpy.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

from .cxx import build_host_library, load_host_library

SOURCE = Path(__file__).resolve().parent / "native" / "lora_f32.cpp"
FLAGS = ("-std=c++17", "-O3", "-fPIC", "-shared", "-fvisibility=default",
         "-ffp-contract=off", "-fno-math-errno")
TUNE = ("-march=native", "-mprefer-vector-width=512")

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class LoraSteps:
    """The loaded library: `shrink(...)` and `expand(...)` on raw host addresses."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._shrink, self._expand = lib.mr_lora_shrink, lib.mr_lora_expand
        self._shrink.restype = self._expand.restype = None
        self._shrink.argtypes = [_P] * 3 + [_I64] * 2 + [_P] + [_I64] * 3
        self._expand.argtypes = [_P] * 2 + [_I64] * 2 + [_P] * 3 + [_I64] * 9

    def shrink(self, x, at_table, tiles, n_tiles, n_slots, t, m, k, c) -> None:
        """Addresses of x (bf16 [m, k]), the slots' `at` table, the tiles, t (float32
        [m, c]); see the source."""
        self._shrink(x, at_table, tiles, n_tiles, n_slots, t, m, k, c)

    def expand(self, y, t, t_split_stride, splits, bt_table, scale_pool, tiles, n_tiles,
               n_slots, m, n, rp, c, parts, part1, part2) -> None:
        self._expand(y, t, t_split_stride, splits, bt_table, scale_pool, tiles, n_tiles,
                     n_slots, m, n, rp, c, parts, part1, part2)


def _build(tune) -> Path:
    return build_host_library((SOURCE,), (*FLAGS, *tune), "lora_f32",
                              "the CPU backend's native LoRA GEMMs")


@lru_cache(maxsize=1)
def try_load() -> LoraSteps | None:
    """The library, or None (said once, in the log) when this machine cannot build it."""
    return load_host_library(lambda tune: LoraSteps(_build(tune)), TUNE,
                             "the native LoRA GEMMs are unavailable; "
                             "the LoRA twins run in numpy, slower, with the same results")


def for_backend(backend) -> LoraSteps | None:
    """The library where `backend` runs native twins (HostBackend with `native` set)."""
    return try_load() if getattr(backend, "native", None) is not None else None
