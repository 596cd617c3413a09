"""HostBackend's native helpers: `native/exact_dot.cpp` compiled for this CPU on first use.

The GEMM twin's hot loop (exact BF16 row dot products, metrale/ops/gemm_tc.py) reads the
BF16 weights directly instead of widening them to float64 first, with every core; what it
computes is spelled out in the .cpp header, and it returns the same bits as the numpy
path (tests/gpu_runtime/test_native.py compares both). The library is built with the C++
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
    """The loaded library: `exact_dot` and `bf16_to_f64` (see native/exact_dot.cpp)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._dot = lib.md_exact_dot
        self._dot.restype = _I64
        self._dot.argtypes = [_P, _P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P]
        self._stats = lib.md_row_stats
        self._stats.restype = None
        self._stats.argtypes = [_P, _I64, _I64, _P, _P]
        self._widen = lib.md_bf16_to_f64
        self._widen.restype = None
        self._widen.argtypes = [_P, _I64, _P]
        lib.md_set_threads.argtypes = [ctypes.c_int]
        lib.md_set_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                           else (os.cpu_count() or 1))

    def exact_dot(self, x_bits: np.ndarray, w_bits: np.ndarray, x_stats, w_stats):
        """x_bits [m, k], w_bits [n, k] C-contiguous uint16; stats: (norm, mag) float64 per
        row. Returns (y float32 [m, n], unsure uint8 [m, n] or None when nothing is)."""
        m, k = x_bits.shape
        n = w_bits.shape[0]
        if not (x_bits.flags.c_contiguous and w_bits.flags.c_contiguous and
                x_bits.dtype == w_bits.dtype == np.uint16 and w_bits.shape[1] == k):
            raise ValueError("exact_dot: x_bits [m, k] and w_bits [n, k] must be "
                             "C-contiguous uint16")
        y = np.empty((m, n), np.float32)
        unsure = np.zeros((m, n), np.uint8)
        xn, xm = (np.ascontiguousarray(a, np.float64) for a in x_stats)
        wn, wm = (np.ascontiguousarray(a, np.float64) for a in w_stats)
        count = self._dot(x_bits.ctypes.data, w_bits.ctypes.data, m, n, k, xn.ctypes.data,
                          xm.ctypes.data, wn.ctypes.data, wm.ctypes.data, y.ctypes.data,
                          unsure.ctypes.data)
        return y, (unsure if count else None)

    def row_stats(self, bits: np.ndarray, norm: np.ndarray, mag: np.ndarray) -> None:
        """norm, mag (float64 [r], C-contiguous) = per-row 2-norm and grid magnitude of the
        BF16 bits [r, k] (C-contiguous)."""
        r, k = bits.shape
        if not (bits.flags.c_contiguous and bits.dtype == np.uint16 and norm.shape == (r,)
                and mag.shape == (r,) and norm.dtype == mag.dtype == np.float64):
            raise ValueError("row_stats: bits must be C-contiguous uint16 [r, k], norm and "
                             "mag float64 [r]")
        self._stats(bits.ctypes.data, r, k, norm.ctypes.data, mag.ctypes.data)

    def bf16_to_f64(self, bits: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (float64, C-contiguous, bits.size elements) = the BF16 bits widened."""
        bits = np.ascontiguousarray(bits, np.uint16)
        if out.dtype != np.float64 or out.size != bits.size or not out.flags.c_contiguous:
            raise ValueError("bf16_to_f64: out must be a C-contiguous float64 array of "
                             f"{bits.size} elements")
        self._widen(bits.ctypes.data, bits.size, out.ctypes.data)
        return out


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
