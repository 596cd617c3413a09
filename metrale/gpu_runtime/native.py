"""HostBackend's native helpers: `native/exact_dot.cpp` compiled for this CPU on first use.

The GEMM twin's definition (f32 of numpy's pairwise float64 sum of the exact products,
metrale/ops/gemm_tc.py) computed directly, reading the BF16 weights as they are, with every
core: the .cpp replays numpy's summation order, so it returns the numpy path's bits
(tests/gpu_runtime/test_convert_cache.py compares both) with nothing to convert or cache. The library is built with the C++
compiler of `cxx.py` for the machine it runs on (`-march=native`) into
`<cache_root()>/host/`, keyed by the source, the flags, the compiler and the CPU, and
reused by every later process. Without a compiler HostBackend runs the numpy path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import DeviceError, KernelError
from .cxx import cache_root, compiler, compiler_version

log = logging.getLogger("metrale")

SOURCE = Path(__file__).resolve().parent / "native" / "exact_dot.cpp"
# IEEE double arithmetic (no -ffast-math: signed zeros, NaN and subnormals are kept); FMA
# contraction is allowed, the .cpp's argument holds for any rounding of its sums.
FLAGS = ("-std=c++17", "-O3", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden",
         "-ffp-contract=fast", "-fno-math-errno")
TUNE = ("-march=native",)

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def _cpu_identity(flags) -> str:
    """What `-march=native` resolves to here (the target options the compiler enables)."""
    proc = subprocess.run([compiler(), *flags, "-Q", "--help=target"], capture_output=True,
                          text=True, check=False)
    return proc.stdout if proc.returncode == 0 else ""


def _build(tune) -> Path:
    flags = [*FLAGS, *tune]
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update("\0".join(flags).encode())
    h.update(compiler_version().encode())
    h.update(_cpu_identity(tune).encode())
    out_dir = cache_root() / "host"
    out = out_dir / f"exact_dot-{h.hexdigest()[:20]}.so"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        lib = Path(tmp) / out.name
        proc = subprocess.run([compiler(), *flags, str(SOURCE), "-o", str(lib)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KernelError(f"{SOURCE.name}: the native build failed:\n"
                              f"{proc.stderr.strip()[-4000:]}")
        os.replace(lib, out)  # atomic: a concurrent build of the same hash is harmless
    return out


class NativeKernels:
    """The loaded library (see native/exact_dot.cpp): `pairwise_dot` (the twin's result),
    `pairwise_at` (it at listed elements) and `round_certified` (the float64-matmul path's
    rounding and error-bound test)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._dot = lib.md_pairwise_dot
        self._dot.restype = None
        self._dot.argtypes = [_P, _P, _I64, _I64, _I64, _P]
        self._at = lib.md_pairwise_at
        self._at.restype = None
        self._at.argtypes = [_P, _P, _I64, _P, _P, _I64, _P]
        self._round = lib.md_round_certified
        self._round.restype = _I64
        self._round.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P]
        lib.md_set_threads.argtypes = [ctypes.c_int]
        lib.md_set_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                           else (os.cpu_count() or 1))

    def pairwise_dot(self, x_bits: np.ndarray, w_bits: np.ndarray) -> np.ndarray:
        """x_bits [m, k], w_bits [n, k] C-contiguous uint16 BF16 -> float32 [m, n]: the GEMM
        twin's f32(G), bit for bit (gemm_tc.pairwise_dot_f32)."""
        m, k = x_bits.shape
        n = w_bits.shape[0]
        _check_rows("pairwise_dot", x_bits, w_bits)
        y = np.empty((m, n), np.float32)
        self._dot(x_bits.ctypes.data, w_bits.ctypes.data, m, n, k, y.ctypes.data)
        return y

    def pairwise_at(self, x_bits: np.ndarray, w_bits: np.ndarray, ii: np.ndarray,
                    jj: np.ndarray) -> np.ndarray:
        """float32 [len(ii)]: f32(G(x[ii[e]], w[jj[e]])), as pairwise_dot's elements."""
        k = x_bits.shape[1]
        _check_rows("pairwise_at", x_bits, w_bits)
        ii = np.ascontiguousarray(ii, np.int64)
        jj = np.ascontiguousarray(jj, np.int64)
        if ii.shape != jj.shape or ii.ndim != 1 or (ii.size and not (
                0 <= ii.min() and ii.max() < len(x_bits) and 0 <= jj.min() and
                jj.max() < len(w_bits))):
            raise ValueError("pairwise_at: ii, jj must be equal-length row indices in range")
        y = np.empty(ii.size, np.float32)
        self._at(x_bits.ctypes.data, w_bits.ctypes.data, k, ii.ctypes.data, jj.ctypes.data,
                 ii.size, y.ctypes.data)
        return y

    def round_certified(self, s: np.ndarray, k: int, x_stats, w_stats):
        """(y float32 [m, n], flat indices of the elements left unsure) for the float64 sums
        s [m, n] and per-row (norm, mag) of x [m] and w [n] (gemm_tc.pairwise_dot_f32)."""
        s = np.ascontiguousarray(s, np.float64)
        m, n = s.shape
        xn, xm = (np.ascontiguousarray(a, np.float64) for a in x_stats)
        wn, wm = (np.ascontiguousarray(a, np.float64) for a in w_stats)
        if xn.shape != xm.shape != (m,) or wn.shape != wm.shape != (n,):
            raise ValueError("round_certified: statistics must be [m] and [n]")
        y = np.empty((m, n), np.float32)
        unsure = np.empty(m * n, np.int64)
        count = self._round(s.ctypes.data, m, n, int(k), xn.ctypes.data, xm.ctypes.data,
                            wn.ctypes.data, wm.ctypes.data, y.ctypes.data, unsure.ctypes.data)
        return y, unsure[:count]


def _check_rows(what: str, x_bits, w_bits) -> None:
    if not (x_bits.flags.c_contiguous and w_bits.flags.c_contiguous and x_bits.ndim == 2 and
            w_bits.ndim == 2 and x_bits.dtype == w_bits.dtype == np.uint16 and
            w_bits.shape[1] == x_bits.shape[1]):
        raise ValueError(f"{what}: x_bits [m, k] and w_bits [n, k] must be C-contiguous "
                         "uint16")


@lru_cache(maxsize=1)
def load() -> NativeKernels:
    """Build (or find in the cache) and load the library; KernelError / DeviceError when
    this machine cannot (no compiler, or the build fails with and without -march=native)."""
    try:
        return NativeKernels(_build(TUNE))
    except KernelError:
        return NativeKernels(_build(()))   # a compiler without -march=native


@lru_cache(maxsize=1)
def try_load() -> NativeKernels | None:
    """`load()`, or None (said once, in the log) when this machine cannot build it."""
    try:
        return load()
    except (KernelError, DeviceError, OSError) as e:
        log.info("metrale: the CPU backend's native GEMM library is unavailable (%s); "
                 "its GEMMs run in numpy, slower, with the same results",
                 str(e).splitlines()[0])
        return None
