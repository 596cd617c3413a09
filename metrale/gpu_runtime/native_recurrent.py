"""HostBackend's native decode steps of the recurrent layers (`native/recurrent_f32.cpp`): the
gated delta rule's and Mamba2's one-token state updates, one read and one write of each
head's FP32 state, so that batch-1 decode on the CPU is bound by the state bytes.

Built like `native.py`'s library (the C++ compiler of `cxx.py`, `-march=native`, cached
under `<cache_root()>/host/` by source, flags, compiler and CPU) but on its own, with FMA
contraction off: the numpy twins (ops/gated_delta_rule.py, ops/mamba2_ssd.py) compute the
same float32 steps in the same order, so the library changes the speed and never the bits.
The twins use it where their backend runs native code (`HostBackend.native` is set) and
this library builds; otherwise numpy.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

from .cxx import build_host_library, load_host_library

SOURCE = Path(__file__).resolve().parent / "native" / "recurrent_f32.cpp"
FLAGS = ("-std=c++17", "-O3", "-fPIC", "-shared", "-fvisibility=default",
         "-ffp-contract=off", "-fno-math-errno")
TUNE = ("-march=native",)

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class RecurrentSteps:
    """The loaded library: `gdr_step(...)` and `ssd_step(...)` on raw host addresses."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._gdr, self._ssd = lib.mr_gdr_step, lib.mr_ssd_step
        self._gdr.restype = self._ssd.restype = None
        self._gdr.argtypes = [_P] * 7 + [_I64] * 4
        self._ssd.argtypes = [_P] * 7 + [_I64] * 4

    def gdr_step(self, state, kn, qn, v, e, beta, out, h0, h1, d_k, d_v) -> None:
        """Heads [h0, h1) of one sequence (addresses of float32 arrays; see the source)."""
        self._gdr(state, kn, qn, v, e, beta, out, h0, h1, d_k, d_v)

    def ssd_step(self, state, x, dtb, c, da, d, y, h0, h1, head_dim, d_state) -> None:
        self._ssd(state, x, dtb, c, da, d, y, h0, h1, head_dim, d_state)


def _build(tune) -> Path:
    return build_host_library((SOURCE,), (*FLAGS, *tune), "recurrent_f32",
                              "the CPU backend's native recurrent-layer steps")


@lru_cache(maxsize=1)
def try_load() -> RecurrentSteps | None:
    """The library, or None (said once, in the log) when this machine cannot build it."""
    return load_host_library(lambda tune: RecurrentSteps(_build(tune)), TUNE,
                             "the native recurrent-layer steps are unavailable; "
                             "the decode twins run in numpy, slower, with the same results")


def for_backend(backend) -> RecurrentSteps | None:
    """The library where `backend` runs native twins (HostBackend with `native` set)."""
    return try_load() if getattr(backend, "native", None) is not None else None
