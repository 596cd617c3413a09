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
import hashlib
import logging
import os
import tempfile
from functools import lru_cache
from pathlib import Path

from ..errors import DeviceError, KernelError
from .cxx import cache_root, compiler, compiler_version, run_build

log = logging.getLogger("metrale")

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
    flags = [*FLAGS, *tune]
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update("\0".join(flags).encode())
    h.update(compiler_version().encode())
    out = cache_root() / "host" / f"lora_f32-{h.hexdigest()[:20]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = Path(tmp) / out.name
        proc = run_build([[compiler(), *flags, str(SOURCE), "-o", str(lib)]],
                         "the CPU backend's native LoRA GEMMs")
        if proc.returncode != 0:
            raise KernelError(f"{SOURCE.name}: the native build failed:\n"
                              f"{proc.stderr.strip()[-4000:]}")
        os.replace(lib, out)   # atomic: a concurrent build of the same hash is harmless
    return out


@lru_cache(maxsize=1)
def try_load() -> LoraSteps | None:
    """The library, or None (said once, in the log) when this machine cannot build it."""
    try:
        try:
            return LoraSteps(_build(TUNE))
        except KernelError:        # a compiler without -march=native
            return LoraSteps(_build(()))
    except (KernelError, DeviceError, OSError) as e:
        log.info("metrale: the native LoRA GEMMs are unavailable (%s); the LoRA twins run in "
                 "numpy, slower, with the same results", str(e).splitlines()[0])
        return None


def for_backend(backend) -> LoraSteps | None:
    """The library where `backend` runs native twins (HostBackend with `native` set)."""
    return try_load() if getattr(backend, "native", None) is not None else None
