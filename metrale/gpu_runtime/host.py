"""`HostBackend`: the device emulated on the host with numpy, for CPU runs and CI.

"Device memory" is host memory and a pointer is its host address, so pointer arithmetic in
model code is exercised exactly as on a GPU. The allocation table, the bounds-checked views
twins see memory through and the conversion cache are `host_memory.HostMemory`.

Converted copies of allocations (the GEMM twin's float64 weights, numpy path) live
in `convert_cache` until the allocation is written or freed: every way memory here is
written reports it (copies, memsets, a launch's writable views, a writable view handed
out, see `convert_cache.py`), and twins read their inputs through `read`, which hands
out read-only views. `native` is the compiled GEMM twin (`native.py`), which widens the
BF16 weights in registers and caches nothing; None where it cannot be built.

Streams are all 0 and run synchronously. Graph capture records launches and async copies
and replays them, reading device buffers at replay time, which is how per-step values
(positions, lengths, block tables) must reach a captured graph on a real GPU too.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import DeviceError, InvalidArgument, KernelError
from . import blas_threads, twins
from . import native as _native
from .host_memory import HostMemory
from .types import DevicePtr, KernelHandle, check_launch_args


@dataclass
class LaunchContext:
    """What a twin gets besides the kernel's own arguments."""

    backend: "HostBackend"
    grid: tuple
    block: tuple
    shared_mem: int

    def view(self, ptr, count: int, dtype) -> np.ndarray:
        """A writable numpy view of `count` elements of `dtype` at device address `ptr`
        (what the kernel writes: the allocation's cached conversions are dropped)."""
        return self.backend.view(ptr, count, dtype)

    def read(self, ptr, count: int, dtype) -> np.ndarray:
        """A read-only view of `count` elements of `dtype` at `ptr` (what the kernel reads)."""
        return self.backend.read(ptr, count, dtype)

    def read_addr(self, ptr, nbytes: int) -> int:
        """`ptr` as an int once [ptr, ptr + nbytes) is checked to lie in one allocation
        (for a native twin that reads it; `read` without the numpy view)."""
        addr, nbytes = int(ptr), int(nbytes)
        if (addr, nbytes) not in self.backend._located:   # (else checked already)
            self.backend._locate(addr, nbytes, nbytes)
        return addr

    def write_addr(self, ptr, nbytes: int) -> int:
        """`read_addr` for a range the twin writes (recorded as `view` records it)."""
        start, _ = self.backend._locate(int(ptr), int(nbytes), int(nbytes))
        if self.backend._launch_writes is not None:
            self.backend._launch_writes.add(start)
        self.backend.convert_cache.drop(start)
        return int(ptr)

    def scratch(self, slot: str, nbytes: int) -> int:
        """The address of this thread's host scratch buffer `slot` (at least nbytes,
        64-byte aligned; kept between launches): the rows a fused twin passes from one
        native routine to the next by address (numpy temporaries and their ctypes
        addresses cost microseconds a launch)."""
        bufs = self.backend._scratch.__dict__
        have = bufs.get(slot)
        if have is None or have.nbytes < nbytes + 64:
            have = bufs[slot] = np.empty(max(int(nbytes), 1) + 64, np.uint8)
            bufs[slot + ".addr"] = (have.ctypes.data + 63) // 64 * 64
        return bufs[slot + ".addr"]

    @property
    def native_rows(self):
        """The native library when its norm/rope/activation routines may run (they give
        the numpy twins' bits here, native.py's load check), else None."""
        nat = self.backend.native
        return nat if nat is not None and nat.row_twins else None

    def map_blocks(self, n: int, block: int, fn: Callable[[int, int], None]) -> None:
        """fn(lo, hi) over [0, n) in consecutive blocks of `block` items, spread over the
        backend's twin threads. Only for items that are computed independently (rows of
        a norm, sequences of attention), so the bits never depend on the split."""
        self.backend.map_blocks(n, block, fn)


class HostBackend(HostMemory):
    """numpy implementation of `GpuBackend`; see the module docstring."""

    name = "cpu"
    # replaying the captured twin calls skips the model code and the launch checks (about a
    # sixth of a batch-1 step on SmolLM2-135M); one graph per row count, unpadded
    decode_graphs_by_default = True
    pads_decode_graphs = False

    def __init__(self, memory_limit_bytes: int | None = None, *,
                 convert_cache_bytes: int | None = None, native: bool | None = None,
                 poison: bool | None = None) -> None:
        """memory_limit_bytes: the simulated device's size (None: the host's RAM).
        convert_cache_bytes: budget for cached conversions of allocations (float64 weights
        for the GEMM twin's numpy path; default half the RAM available now, 0 caches none).
        native: the compiled GEMM twin (None: when this machine can build it, True:
        required, False: numpy only, much slower; the results are the same bits).
        poison: fill fresh allocations with 0xFF (NaN) instead of lazily zeroed pages, so a
        read of unwritten memory shows (host_memory.py); None: METRALE_POISON_MEMORY=1."""
        if poison is None:
            poison = os.environ.get("METRALE_POISON_MEMORY", "0") not in ("", "0")
        super().__init__(memory_limit_bytes, convert_cache_bytes, poison)
        self._kernels: dict[tuple, KernelHandle] = {}
        self._events: dict[int, float] = {}
        self._next_event = 1
        self._graphs: dict[int, list[Callable[[], None]]] = {}
        self._next_graph = 1
        self._capture: list[Callable[[], None]] | None = None
        self._replaying = False
        self.native = (_native.load() if native else
                       None if native is not None else _native.try_load())
        # twins run with one BLAS thread: spinning OpenBLAS workers would take the
        # native GEMM's cores (blas_threads.py)
        self._blas = blas_threads.openblas()
        # numpy releases the GIL inside its loops, so twins spread independent rows over
        # one thread per CPU (map_blocks); made on first use
        self._twin_threads = _native.usable_cpus()
        self._twin_pool: ThreadPoolExecutor | None = None
        self._scratch = threading.local()   # LaunchContext.scratch's buffers, per thread
        self._twin_pool_pid = 0

    # copies ---------------------------------------------------------------------------
    def copy_h2d(self, src_bytes, dst_ptr: DevicePtr) -> None:
        self._no_sync_in_capture("copy_h2d")
        self._h2d(_bytes_of(src_bytes), dst_ptr)

    def _h2d(self, src: np.ndarray, dst_ptr) -> None:
        dst, base = self._write_view(dst_ptr, src.size)
        dst[:] = src
        self._wrote(base)

    def copy_d2h(self, src_ptr: DevicePtr, dst_buffer) -> None:
        self._no_sync_in_capture("copy_d2h")
        dst = _writable_bytes_of(dst_buffer)
        dst[:] = self.read(src_ptr, dst.size, np.uint8)

    def copy_d2d(self, src_ptr: DevicePtr, dst_ptr: DevicePtr, nbytes: int) -> None:
        self._no_sync_in_capture("copy_d2d")
        self._d2d(src_ptr, dst_ptr, nbytes)

    def _d2d(self, src_ptr, dst_ptr, nbytes) -> None:
        src = self.read(src_ptr, nbytes, np.uint8)
        dst, base = self._write_view(dst_ptr, nbytes)
        dst[:] = src.copy()
        self._wrote(base)

    def copy_h2d_async(self, src_bytes, dst_ptr: DevicePtr, stream: int) -> None:
        # A captured h2d copy re-reads the host buffer at replay, as cudaMemcpyAsync does.
        src = _bytes_of(src_bytes)
        self._run(lambda: self._h2d(src, dst_ptr))

    def copy_d2h_async(self, src_ptr: DevicePtr, dst_buffer, stream: int) -> None:
        dst = _writable_bytes_of(dst_buffer)
        self._run(lambda: dst.__setitem__(slice(None), self.read(src_ptr, dst.size, np.uint8)))

    def copy_d2d_async(self, src_ptr, dst_ptr, nbytes: int, stream: int) -> None:
        self._run(lambda: self._d2d(src_ptr, dst_ptr, nbytes))

    def write_host(self, ptr: DevicePtr, nbytes: int, fill: Callable[[np.ndarray], None]) -> None:
        """`fill(dst)` writes the `nbytes` at `ptr` through a writable uint8 view: a host
        producer (a GGUF dequantizer) writes straight into device memory, which is host
        memory here, instead of into a buffer that copy_h2d then copies."""
        self._no_sync_in_capture("write_host")
        dst, base = self._write_view(ptr, nbytes)
        try:
            fill(dst)
        finally:
            self._wrote(base)

    def memset(self, ptr: DevicePtr, value: int, nbytes: int) -> None:
        self._no_sync_in_capture("memset")
        self._memset(ptr, value, nbytes)

    def _memset(self, ptr, value, nbytes) -> None:
        dst, base = self._write_view(ptr, nbytes)
        dst[:] = int(value) & 0xFF
        self._wrote(base)

    def memset_async(self, ptr: DevicePtr, value: int, nbytes: int, stream: int) -> None:
        self._run(lambda: self._memset(ptr, value, nbytes))

    # kernels --------------------------------------------------------------------------
    def kernel(self, module: str, func: str) -> KernelHandle:
        key = (module, func)
        h = self._kernels.get(key)
        if h is None:
            impl = twins.lookup(module, func)
            if impl is None:
                raise KernelError(f"kernel {module}.{func} has no numpy twin registered "
                                  "(metrale/ops/<family>.py registers it with @twin when "
                                  "metrale.ops is imported)")
            h = self._kernels[key] = KernelHandle(module, func, impl)
        return h

    def has_module(self, module: str) -> bool:
        return module in twins.modules()

    def launch(self, kernel: KernelHandle, grid, block, shared_mem: int, stream: int,
               args: Sequence) -> None:
        grid3, block3 = check_launch_args(kernel, grid, block, args)
        ctx = LaunchContext(self, grid3, block3, int(shared_mem))
        args = tuple(args)
        self._run(lambda: self._tracked(kernel.impl, ctx, *args))

    def map_blocks(self, n: int, block: int, fn: Callable[[int, int], None]) -> None:
        """`LaunchContext.map_blocks`: fn(lo, hi) per block, on the calling thread when
        there is one block or one CPU (stopping at an exception), else on the twin
        threads, where the first exception is raised after every block has finished."""
        n, block = int(n), max(1, int(block))
        spans = [(lo, min(n, lo + block)) for lo in range(0, n, block)]
        if len(spans) <= 1 or self._twin_threads <= 1:
            for lo, hi in spans:
                fn(lo, hi)
            return
        if self._twin_pool is None or self._twin_pool_pid != os.getpid():
            # (again in a forked child, which has none of the parent's threads)
            self._twin_pool = ThreadPoolExecutor(self._twin_threads,
                                                 thread_name_prefix="metrale-twin")
            self._twin_pool_pid = os.getpid()
        futures = [self._twin_pool.submit(fn, lo, hi) for lo, hi in spans]
        errors = [f.exception() for f in futures]   # waits for all
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def host_task(self, fn: Callable[[], None], stream: int) -> None:
        """Run `fn()` in stream order as a launch would run: now, or at replay when a graph
        is being captured; the views it takes with `view` count as the task's writes. What
        a library call on a CUDA stream is (an MPI collective of `comm/mpi.py`)."""
        self._run(lambda: self._tracked(fn))

    def _tracked(self, fn, *args) -> None:
        """Run a twin; every allocation it got a writable view of drops its conversions
        when it returns (a twin's writes all happen during its call)."""
        outer, self._launch_writes = self._launch_writes, set()
        try:
            if self._replaying:     # launch_graph holds the BLAS limit for all its twins
                fn(*args)
            else:
                with blas_threads.limit(self._blas):
                    fn(*args)
        finally:
            wrote, self._launch_writes = self._launch_writes, outer
            for base in wrote:
                self.convert_cache.drop(base)
            if outer is not None:
                outer |= wrote

    def gemm_bf16(self, m: int, n: int, k: int, x_ptr: DevicePtr, w_ptr: DevicePtr,
                  y_ptr: DevicePtr, stream: int) -> None:
        """Y[m, n] = X[m, k] @ W[n, k]^T in BF16, FP32 accumulation (cuBLAS's twin)."""
        gemm_twin = twins.lookup("cublas", "gemm_bf16")
        if gemm_twin is None:
            raise KernelError("gemm_bf16 has no twin registered (import metrale.ops)")
        self._run(lambda: self._tracked(gemm_twin, self, m, n, k, x_ptr, w_ptr, y_ptr))

    def has_gemm(self) -> bool:
        return True

    # streams, events, graphs ----------------------------------------------------------
    def default_stream(self) -> int:
        return 0

    def create_stream(self) -> int:
        return 0

    def synchronize(self, stream: int) -> None:
        return None

    def create_event(self) -> int:
        e = self._next_event
        self._next_event += 1
        self._events[e] = 0.0
        return e

    def record_event(self, event: int, stream: int) -> None:
        self._run(lambda: self._events.__setitem__(event, time.perf_counter()))

    def stream_wait_event(self, stream: int, event: int) -> None:
        return None

    def event_synchronize(self, event: int) -> None:
        return None

    def event_query(self, event: int) -> bool:
        return True

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return (self._events[end] - self._events[start]) * 1e3

    def destroy_event(self, event: int) -> None:
        self._events.pop(event, None)

    def begin_capture(self, stream: int) -> None:
        if self._capture is not None:
            raise DeviceError("begin_capture: a capture is already in progress")
        self._capture = []

    def end_capture(self, stream: int) -> int:
        if self._capture is None:
            raise DeviceError("end_capture without begin_capture")
        g = self._next_graph
        self._next_graph += 1
        self._graphs[g], self._capture = self._capture, None
        return g

    def launch_graph(self, graph: int, stream: int) -> None:
        if graph not in self._graphs:
            raise InvalidArgument(f"launch_graph: unknown graph {graph}")
        # one BLAS limit around the whole replay rather than two library calls per twin
        with blas_threads.limit(self._blas):
            self._replaying = True
            try:
                for op in self._graphs[graph]:
                    op()
            finally:
                self._replaying = False

    def destroy_graph(self, graph: int) -> None:
        self._graphs.pop(graph, None)

    def is_capturing(self) -> bool:
        return self._capture is not None

    # device facts ---------------------------------------------------------------------
    def sm_count(self) -> int:
        return os.cpu_count() or 1

    def device_name(self) -> str:
        return "cpu (HostBackend)"

    # internals ------------------------------------------------------------------------
    def _run(self, op: Callable[[], None]) -> None:
        if self._capture is not None:
            self._capture.append(op)
        else:
            op()

    def _no_sync_in_capture(self, what: str) -> None:
        if self._capture is not None:
            raise DeviceError(f"{what} is synchronous and illegal during graph capture; "
                              "use the _async form")


def _bytes_of(buf) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InvalidArgument("host buffer must be C-contiguous")
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


def _writable_bytes_of(buf) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous or not buf.flags.writeable:
            raise InvalidArgument("destination buffer must be C-contiguous and writable")
        return buf.reshape(-1).view(np.uint8)
    mv = memoryview(buf)
    if mv.readonly:
        raise InvalidArgument("destination buffer is read-only")
    return np.frombuffer(mv.cast("B"), dtype=np.uint8)
