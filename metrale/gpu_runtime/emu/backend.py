"""`EmuBackend`: HostBackend's memory model, but launches run the real `kernels/*.cu`.

Each `.cu` file is compiled with g++ through the shim (`build.py`) on first use and cached
across processes; `launch` checks every argument against the kernel's C parameter types
(count, pointer vs scalar, scalar width and signedness, pointer alignment, pointer inside a
live allocation) and then runs the kernel on fibers (`fiber.h`). cuBLAS has no source, so
`gemm_bf16` runs its twin; `launch_stats()` counts per kernel how launches ran.

Launch checks against the device's rules, always: the block size against the kernel's
`__launch_bounds__` (which the shim defines away, so the CPU would run it) and the device
limit of 1024 threads, and dynamic shared memory against 48 KiB (the CudaBackend never sets
cudaFuncAttributeMaxDynamicSharedMemorySize, so that is every kernel's limit on the GPU;
the opt-in limit would be 227 KiB per block on H100/H200; the GPU adds the kernel's static
__shared__, which the emulator does not know per kernel: NVRTC's figure is in
`metrale check-kernels`), each naming kernel and line.
Guard bytes: every allocation has GUARD_BYTES of slack after it (and its alignment
padding before) filled with GUARD_PATTERN; after every launch the slack of each allocation
its pointers point into is compared, and at free the allocation's own; a changed byte
raises KernelError naming the kernel and the offset (not under `sanitize`, where the
slack is poisoned and AddressSanitizer reports the access itself).

Modes (constructor arguments; `backend("emu")` reads them from the environment):
  sanitize — `METRALE_EMU_SANITIZE=1`: AddressSanitizer + UBSan builds. The process must
      have the ASan runtime preloaded (`LD_PRELOAD=$(g++ -print-file-name=libasan.so)
      ASAN_OPTIONS=detect_leaks=0`). Allocation slack and alignment padding are poisoned,
      and dynamic shared memory is exactly the requested size, so a read past either is
      reported with the kernel's file and line; fresh allocations are filled with 0xFF
      (HostBackend's `poison`), so a read of unwritten memory gives NaN.
  checks — `METRALE_EMU_CHECK=align,race` (or `all`): the instrumented build (check.h):
      "align" makes every 2/4/8/16-byte load or store through a misaligned address an
      error; "race" runs the shared-memory race detector and the cross-block global-memory
      detector. Not with `sanitize`.
  order — `METRALE_EMU_ORDER=forward|reverse|shuffle:SEED`: the order in which the threads
      of a block resume at every barrier, whether a warp that completed a warp operation
      runs on ahead of the others (reverse: depth first) or queues behind them (forward),
      and whether cp.async data lands at the wait (forward) or at once (reverse); shuffle
      draws each of these from SEED and a launch counter, so runs are reproducible.
  block_order — `METRALE_EMU_BLOCK_ORDER=forward|reverse|shuffle:SEED`: the order in which
      the blocks of a grid run (ascending linear id, descending, or a seeded permutation
      per launch), so one block reading what another writes shows up as a difference.
  count — hardware counters per launch (counters.h), kept in `launch_counters`; with
      `sample_blocks` only that many blocks of each grid run (evenly spaced), for counting
      at real model shapes (their outputs are then incomplete: profiling only).
  check_twins — every launch also runs the kernel's numpy twin and records how far the two
      results are apart (`twin_agreement()`, see twin_check.py); for measurements, slow.
"""
from __future__ import annotations

import ctypes
import os
import weakref
from collections import defaultdict
from pathlib import Path

import numpy as np

from ...errors import DeviceError, InvalidArgument, KernelError
from .. import kernel_source
from ..host import HostBackend
from ..types import DevicePtr, KernelHandle, check_launch_args
from .build import build_library
from .check_report import tally
from .library import CHECK_ALIGN, CHECK_RACE, ORDERS, EmuKernel, EmuLibrary
from .twin_check import TwinCheck

# Dynamic shared memory a launch may ask for without cudaFuncSetAttribute, on every GPU.
MAX_DYNAMIC_SHARED = 48 * 1024
MAX_BLOCK_THREADS = 1024
GUARD_BYTES = 256          # slack after every allocation (HostMemory._guard_bytes)
GUARD_PATTERN = 0xA5       # neither the 0xFF fill of fresh memory nor zero
CHECKS = {"align": CHECK_ALIGN, "race": CHECK_RACE}


def parse_checks(spec) -> int:
    """"align,race" | "all" | "" (or an iterable of names) -> CHECK_* flags."""
    if spec is None:
        return 0
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip().lower() for n in names if n and n.strip()]
    if names in (["all"], ["1"]):
        names = list(CHECKS)
    if names == ["0"]:
        return 0
    bad = [n for n in names if n not in CHECKS]
    if bad:
        raise InvalidArgument(f"emu checks {spec!r}: expected a comma-separated subset of "
                              f"{', '.join(CHECKS)}, or 'all'")
    flags = 0
    for n in names:
        flags |= CHECKS[n]
    return flags


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
    # it runs the kernels, so graphed decode pads as on a GPU; graphs only when a test asks
    decode_graphs_by_default = False
    pads_decode_graphs = True
    _guard_bytes = GUARD_BYTES

    def __init__(self, memory_limit_bytes: int | None = None, *, sanitize: bool = False,
                 order: str = "forward", block_order: str = "forward", checks=None,
                 count: bool = False, sample_blocks: int = 0,
                 check_twins: bool = False, poison: bool | None = None) -> None:
        # sanitize mode always poisons fresh memory (NaN reads of unwritten bytes)
        super().__init__(memory_limit_bytes, poison=True if sanitize else poison)
        self._twin_check = TwinCheck() if check_twins else None
        self.sanitize = bool(sanitize)
        self.order, self._seed = parse_order(order)
        self.block_order, self._block_seed = parse_order(block_order)
        self.checks = parse_checks(checks)
        self.check_names = [n for n, flag in CHECKS.items() if self.checks & flag]
        self.count = bool(count)
        self.sample_blocks = int(sample_blocks)
        if self.sanitize and (self.checks or self.count):
            raise InvalidArgument("EmuBackend: sanitize (AddressSanitizer) cannot be combined "
                                  "with checks or counters (both instrument the build)")
        self.flavour = ("asan" if self.sanitize else
                        "check" if self.checks or self.count else "plain")
        # CHECK_COUNT records, one per launch: kernel, launch geometry, counters
        self.launch_counters: list[dict] = []
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
        """The backend `backend("emu")` builds: modes from METRALE_EMU_SANITIZE, _ORDER,
        _BLOCK_ORDER and _CHECK."""
        return cls(memory_limit_bytes,
                   sanitize=os.environ.get("METRALE_EMU_SANITIZE", "0") not in ("", "0"),
                   order=os.environ.get("METRALE_EMU_ORDER") or "forward",
                   block_order=os.environ.get("METRALE_EMU_BLOCK_ORDER") or "forward",
                   checks=os.environ.get("METRALE_EMU_CHECK") or None)

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
        so, entries = build_library(path, flavour=self.flavour,
                                    header_dirs=[kernel_source.kernels_dir()])
        return EmuLibrary(so, Path(path).stem, entries, self.flavour)

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
        self._check_launch_rules(impl, block3, shared_mem)
        packed = impl.pack(tuple(args), self.find_allocation)
        self._stats[kernel.name]["compiled"] += 1
        self._launch_count += 1
        seed = self._seed * 1_000_003 + self._launch_count
        block_seed = self._block_seed * 1_000_003 + self._launch_count
        # The allocations the pointers point into: what the kernel may touch (the checks
        # and counters see them; writable = some non-const pointer points there), whose
        # cached conversions (HostMemory.convert_cache) go and whose guard bytes are
        # checked when it has run.
        ranges: dict[int, list] = {}
        for a, p in zip(args, impl.params):
            if p.kind == "p" and isinstance(a, DevicePtr) and int(a):
                base, size = self.find_allocation(a)
                r = ranges.setdefault(int(base), [int(base), max(int(size), 1), False])
                r[2] = r[2] or not p.c_type.startswith("const")
        record = {"kernel": kernel.name, "grid": grid3, "block": block3,
                  "shared_mem": shared_mem,
                  "scalars": [a.item() for a in args if not isinstance(a, DevicePtr)]
                  } if self.count else None

        def run() -> None:
            finding = None
            try:
                out = impl.run(packed, grid3, block3, shared_mem, self.order, seed,
                               self.block_order, block_seed, self.checks,
                               self.blocks_to_run(grid3), [tuple(r) for r in ranges.values()],
                               count=self.count)
                if record is not None:
                    record["counters"] = out
                    self.launch_counters.append(record)
            except KernelError as e:
                finding = str(e)
                raise
            finally:
                if self.checks:   # the line at exit (check_report.py)
                    tally().record(kernel.name, self.check_names, finding)
                for base in ranges:
                    self.convert_cache.drop(base)
            if not self.sanitize:
                for base in ranges:
                    self._check_guard(base, f"kernel {kernel.name}")
        if self._twin_check is None:
            self._run(run)
        else:
            check = self._twin_check
            args = tuple(args)
            self._run(lambda: check.launch(self, kernel, args, grid3, block3, shared_mem, run))

    def blocks_to_run(self, grid3) -> int:
        """How many blocks of this grid run (evenly spaced); 0: all."""
        return self.sample_blocks

    def _check_launch_rules(self, impl: EmuKernel, block3, shared_mem: int) -> None:
        """The device's launch rules that the CPU would not enforce (module docstring)."""
        threads = block3[0] * block3[1] * block3[2]
        if impl.max_threads and threads > impl.max_threads:
            raise KernelError(f"{impl.name} ({impl.where}): block of {threads} threads is "
                              f"over its __launch_bounds__({impl.max_threads}); the GPU "
                              "refuses the launch (too many resources requested)")
        if threads > MAX_BLOCK_THREADS:
            raise KernelError(f"{impl.name} ({impl.where}): block of {threads} threads is "
                              f"over the device limit of {MAX_BLOCK_THREADS}")
        if not 0 <= shared_mem <= MAX_DYNAMIC_SHARED:
            raise KernelError(f"{impl.name} ({impl.where}): {shared_mem} bytes of dynamic "
                              f"shared memory (at most {MAX_DYNAMIC_SHARED} without an opt-in "
                              "attribute, which the CudaBackend does not set)")

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

    # memory: guard bytes around each allocation (poisoned under the sanitizer) ----------
    def _guard_zones(self, addr: int):
        """(whole over-allocated block, bytes before the allocation, offset of its end)."""
        raw = self._allocs[addr].base
        return raw, addr - raw.ctypes.data, addr - raw.ctypes.data + self._sizes[addr]

    def _check_guard(self, addr: int, who: str) -> None:
        if addr not in self._allocs:
            return
        raw, head, tail = self._guard_zones(addr)
        for lo, hi, side in ((0, head, "before"), (tail, raw.nbytes, "after")):
            bad = np.flatnonzero(raw[lo:hi] != GUARD_PATTERN)
            if bad.size:
                off = (int(bad[0]) + lo) - head
                self._set_guard(addr)  # reported once
                raise KernelError(
                    f"{who} wrote outside an allocation: byte {off:+d} from the start of the "
                    f"{self._sizes[addr]}-byte allocation at 0x{addr:x} ("
                    f"{abs(off) if off < 0 else off - self._sizes[addr]} bytes {side} it; "
                    f"{bad.size} guard bytes changed)")

    def _set_guard(self, addr: int) -> None:
        raw, head, tail = self._guard_zones(addr)
        raw[:head] = GUARD_PATTERN
        raw[tail:] = GUARD_PATTERN

    def free(self, ptr: DevicePtr) -> None:
        error = None
        if int(ptr) and not self.sanitize:
            try:
                self._check_guard(int(ptr), "a kernel launched while it was allocated")
            except KernelError as e:
                error = e
        super().free(ptr)
        if error is not None:
            raise error

    def alloc(self, nbytes: int) -> DevicePtr:
        ptr = super().alloc(nbytes)
        if self._asan is None:
            self._set_guard(int(ptr))
        else:
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
