"""`EmuBackend`: HostBackend's memory model, but launches run the real `kernels/*.cu`.

Each `.cu` file is compiled with g++ through the shim (`build.py`) on first use and cached
across processes; `launch` checks every argument against the kernel's C parameter types
(count, pointer vs scalar, scalar width and signedness, pointer alignment, pointer inside a
live allocation) and then runs the kernel on fibers (`fiber.h`). cuBLAS has no source, so
`gemm_bf16` runs its twin; `launch_stats()` counts per kernel how launches ran.

Modes (constructor arguments; `backend("emu")` reads them from the environment):
  sanitize — `METRALE_EMU_SANITIZE=1`: AddressSanitizer + UBSan builds. The process must
      have the ASan runtime preloaded (`LD_PRELOAD=$(g++ -print-file-name=libasan.so)
      ASAN_OPTIONS=detect_leaks=0`). Allocation slack and alignment padding are poisoned,
      and dynamic shared memory is exactly the requested size, so a read past either is
      reported with the kernel's file and line; fresh allocations are filled with 0xFF
      (HostBackend's `poison`), so a read of unwritten memory gives NaN.
  order — `METRALE_EMU_ORDER=forward|reverse|shuffle:SEED`: the order in which the threads
      of a block resume at every barrier, whether a warp that completed a warp operation
      runs on ahead of the others (reverse: depth first) or queues behind them (forward),
      and whether cp.async data lands at the wait (forward) or at once (reverse); shuffle
      draws each of these from SEED and a launch counter, so runs are reproducible.
  check_twins — every launch also runs the kernel's numpy twin and records how far the two
      results are apart (`twin_agreement()`, see twin_check.py); for measurements, slow.
"""
from __future__ import annotations

import ctypes
import os
import weakref
from collections import defaultdict
from pathlib import Path

from ...errors import DeviceError, InvalidArgument, KernelError
from .. import kernel_source
from ..host import HostBackend
from ..types import DevicePtr, KernelHandle, check_launch_args
from .build import build_library
from .library import ORDERS, EmuKernel, EmuLibrary
from .twin_check import TwinCheck

# Dynamic shared memory a launch may ask for without cudaFuncSetAttribute, on every GPU.
MAX_DYNAMIC_SHARED = 48 * 1024


def parse_order(spec: str | None) -> tuple[int, int]:
    """"forward" | "reverse" | "shuffle:SEED" -> (order code, seed)."""
    spec = (spec or "forward").strip().lower()
    name, _, seed = spec.partition(":")
    if name not in ORDERS or (name == "shuffle") != bool(seed):
        raise InvalidArgument(f"emu order {spec!r}: expected 'forward', 'reverse' or "
                              "'shuffle:SEED'")
    try:
        return ORDERS[name], int(seed or 0)
    except ValueError:
        raise InvalidArgument(f"emu order {spec!r}: SEED must be an integer") from None


def asan_runtime_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return False


class EmuBackend(HostBackend):
    """`GpuBackend` on the CPU that runs the CUDA sources themselves; see the module doc."""

    name = "emu"

    def __init__(self, memory_limit_bytes: int | None = None, *, sanitize: bool = False,
                 order: str = "forward", check_twins: bool = False,
                 poison: bool | None = None) -> None:
        # sanitize mode always poisons fresh memory (NaN reads of unwritten bytes)
        super().__init__(memory_limit_bytes, poison=True if sanitize else poison)
        self._twin_check = TwinCheck() if check_twins else None
        self.sanitize = bool(sanitize)
        self.order, self._seed = parse_order(order)
        self._launch_count = 0
        self._libs: dict[str, EmuLibrary] = {}
        self._stats: dict[str, dict[str, int]] = defaultdict(lambda: {"compiled": 0, "twin": 0})
        self._asan = None
        if self.sanitize:
            if not asan_runtime_loaded():
                raise DeviceError(
                    "EmuBackend(sanitize=True) needs the AddressSanitizer runtime loaded "
                    "first: run Python under LD_PRELOAD=$(g++ -print-file-name=libasan.so) "
                    "ASAN_OPTIONS=detect_leaks=0")
            rt = ctypes.CDLL(None)  # getattr: a literal __asan_ name would be mangled here
            self._asan = (getattr(rt, "__asan_poison_memory_region"),
                          getattr(rt, "__asan_unpoison_memory_region"))

    @classmethod
    def from_env(cls, memory_limit_bytes: int | None = None) -> "EmuBackend":
        """The backend `backend("emu")` builds: modes from METRALE_EMU_SANITIZE/_ORDER."""
        return cls(memory_limit_bytes,
                   sanitize=os.environ.get("METRALE_EMU_SANITIZE", "0") not in ("", "0"),
                   order=os.environ.get("METRALE_EMU_ORDER") or "forward")

    # kernels --------------------------------------------------------------------------
    def library(self, module: str) -> EmuLibrary:
        """The built library of `kernels/<module>.cu` (compiled on first use)."""
        lib = self._libs.get(module)
        if lib is None:
            lib = self.load_source(kernel_source.module_path(module))
            self._libs[module] = lib
        return lib

    def load_source(self, path) -> EmuLibrary:
        """Build and load any `.cu` file (the emulator's own tests use this)."""
        so, names = build_library(path, sanitize=self.sanitize,
                                  header_dirs=[kernel_source.kernels_dir()])
        return EmuLibrary(so, Path(path).stem, names)

    def kernel(self, module: str, func: str) -> KernelHandle:
        key = (module, func)
        h = self._kernels.get(key)
        if h is None:
            h = self._kernels[key] = KernelHandle(module, func, self.library(module).kernel(func))
        return h

    def kernel_from(self, lib: EmuLibrary, func: str) -> KernelHandle:
        return KernelHandle(lib.module, func, lib.kernel(func))

    def has_module(self, module: str) -> bool:
        return kernel_source.has_module(module)

    def launch(self, kernel: KernelHandle, grid, block, shared_mem: int, stream: int,
               args) -> None:
        grid3, block3 = check_launch_args(kernel, grid, block, args)
        impl = kernel.impl
        if not isinstance(impl, EmuKernel):
            raise KernelError(f"{kernel.name}: not a kernel of this EmuBackend")
        shared_mem = int(shared_mem)
        if not 0 <= shared_mem <= MAX_DYNAMIC_SHARED:
            raise KernelError(f"{kernel.name}: {shared_mem} bytes of dynamic shared memory "
                              f"(at most {MAX_DYNAMIC_SHARED} without an opt-in attribute)")
        packed = impl.pack(tuple(args), self.find_allocation)
        self._stats[kernel.name]["compiled"] += 1
        self._launch_count += 1
        seed = self._seed * 1_000_003 + self._launch_count
        # The kernel may write wherever its pointers point: those allocations' cached
        # conversions (HostMemory.convert_cache) go when it has run.
        touched = {int(self.find_allocation(a)[0]) for a in args
                   if isinstance(a, DevicePtr) and int(a)}

        def run() -> None:
            try:
                impl.run(packed, grid3, block3, shared_mem, self.order, seed)
            finally:
                for base in touched:
                    self.convert_cache.drop(base)
        if self._twin_check is None:
            self._run(run)
        else:
            check = self._twin_check
            args = tuple(args)
            self._run(lambda: check.launch(self, kernel, args, grid3, block3, shared_mem, run))

    def gemm_bf16(self, m, n, k, x_ptr, w_ptr, y_ptr, stream) -> None:
        self._stats["cublas.gemm_bf16"]["twin"] += 1
        super().gemm_bf16(m, n, k, x_ptr, w_ptr, y_ptr, stream)

    def twin_agreement(self) -> dict[str, dict]:
        """Per kernel, with check_twins on: elements compared, differing, max ulps."""
        return self._twin_check.report() if self._twin_check else {}

    def launch_stats(self) -> dict[str, dict[str, int]]:
        """Per kernel ("module.function"): launches run `compiled` and run as a `twin`."""
        return {k: dict(v) for k, v in self._stats.items()}

    def device_name(self) -> str:
        mode = " + ASan/UBSan" if self.sanitize else ""
        return f"cpu (EmuBackend: kernels/*.cu compiled with g++{mode})"

    # memory: under the sanitizer, the bytes around each allocation are poisoned ----------
    def alloc(self, nbytes: int) -> DevicePtr:
        ptr = super().alloc(nbytes)
        if self._asan is not None:
            raw = self._allocs[int(ptr)].base  # the whole over-allocated block
            lo, hi = raw.ctypes.data, raw.ctypes.data + raw.nbytes
            self._poison(lo, int(ptr) - lo)
            end = int(ptr) + int(nbytes)
            self._poison(end, hi - end)
            # Unpoison when numpy lets the block go (free, or the backend dropped unfreed):
            # numpy may hand small blocks out again from its own cache, without malloc.
            weakref.finalize(raw, self._asan[1], ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo))
        return ptr

    def _poison(self, addr: int, n: int) -> None:
        if n > 0:
            self._asan[0](ctypes.c_void_p(addr), ctypes.c_size_t(n))
