"""`HostBackend`: the device emulated on the host with numpy, for CPU runs and CI.

"Device memory" is host memory and a pointer is its host address, so pointer arithmetic in
model code is exercised exactly as on a GPU. Every allocation is remembered, and a twin can
only see memory through `LaunchContext.view`, which checks that the range lies inside one
live allocation: an out-of-bounds pointer in orchestration code fails loudly in CI instead
of reading a neighbour. Fresh allocations are filled with 0xFF bytes (a BF16/FP32 NaN), so a
read of memory nobody wrote shows up as NaN in the result.

Streams are all 0 and run synchronously. Graph capture records launches and async copies
and replays them, reading device buffers at replay time, which is how per-step values
(positions, lengths, block tables) must reach a captured graph on a real GPU too.
"""
from __future__ import annotations

import bisect
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import DeviceError, InvalidArgument, KernelError
from . import twins
from .types import DevicePtr, KernelHandle, check_launch_args

_ALIGN = 256  # same alignment cudaMalloc gives


@dataclass
class LaunchContext:
    """What a twin gets besides the kernel's own arguments."""

    backend: "HostBackend"
    grid: tuple
    block: tuple
    shared_mem: int

    def view(self, ptr, count: int, dtype) -> np.ndarray:
        """A writable numpy view of `count` elements of `dtype` at device address `ptr`."""
        return self.backend.view(ptr, count, dtype)


class HostBackend:
    """numpy implementation of `GpuBackend`; see the module docstring."""

    name = "cpu"

    def __init__(self, memory_limit_bytes: int | None = None) -> None:
        self._allocs: dict[int, np.ndarray] = {}  # address -> owning uint8 array
        self._sizes: dict[int, int] = {}
        self._starts: list[int] = []  # sorted addresses, for bounds checks
        self._live = 0
        self._peak = 0
        self._limit = memory_limit_bytes
        self._kernels: dict[tuple, KernelHandle] = {}
        self._events: dict[int, float] = {}
        self._next_event = 1
        self._graphs: dict[int, list[Callable[[], None]]] = {}
        self._next_graph = 1
        self._capture: list[Callable[[], None]] | None = None

    # memory -------------------------------------------------------------------------
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
        raw = np.full(max(nbytes, 1) + _ALIGN, 0xFF, dtype=np.uint8)
        base = raw.ctypes.data
        off = (-base) % _ALIGN
        buf = raw[off:off + max(nbytes, 1)]
        addr = buf.ctypes.data
        self._allocs[addr] = buf
        self._sizes[addr] = nbytes
        bisect.insort(self._starts, addr)
        self._live += nbytes
        self._peak = max(self._peak, self._live)
        return DevicePtr(addr)

    def free(self, ptr: DevicePtr) -> None:
        addr = int(ptr)
        if addr == 0:
            return  # free(NULL) is a no-op, as in the original engine's GpuBackend::free
        if addr not in self._allocs:
            raise InvalidArgument(f"free of {DevicePtr(addr)!r}: not an allocation of this backend")
        del self._allocs[addr]
        self._live -= self._sizes.pop(addr)
        self._starts.pop(bisect.bisect_left(self._starts, addr))

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

    def view(self, ptr, count: int, dtype) -> np.ndarray:
        """A bounds-checked writable view of `count` `dtype` elements at address `ptr`."""
        dtype = np.dtype(dtype)
        addr, count = int(ptr), int(count)
        nbytes = count * dtype.itemsize
        if count < 0:
            raise KernelError(f"view of {count} elements")
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr == 0:
            raise KernelError(f"address {DevicePtr(addr)!r} is not inside any live allocation")
        start = self._starts[i]
        size = self._sizes[start]
        if addr + nbytes > start + size:
            raise KernelError(
                f"range [{DevicePtr(addr)!r}, +{nbytes} bytes) runs past the end of its "
                f"allocation ({size} bytes at {DevicePtr(start)!r})")
        off = addr - start
        return self._allocs[start][off:off + nbytes].view(dtype)

    # copies ---------------------------------------------------------------------------
    def copy_h2d(self, src_bytes, dst_ptr: DevicePtr) -> None:
        self._no_sync_in_capture("copy_h2d")
        src = _bytes_of(src_bytes)
        self.view(dst_ptr, src.size, np.uint8)[:] = src

    def copy_d2h(self, src_ptr: DevicePtr, dst_buffer) -> None:
        self._no_sync_in_capture("copy_d2h")
        dst = _writable_bytes_of(dst_buffer)
        dst[:] = self.view(src_ptr, dst.size, np.uint8)

    def copy_d2d(self, src_ptr: DevicePtr, dst_ptr: DevicePtr, nbytes: int) -> None:
        self._no_sync_in_capture("copy_d2d")
        self._d2d(src_ptr, dst_ptr, nbytes)

    def _d2d(self, src_ptr, dst_ptr, nbytes) -> None:
        src = self.view(src_ptr, nbytes, np.uint8)
        self.view(dst_ptr, nbytes, np.uint8)[:] = src.copy()

    def copy_h2d_async(self, src_bytes, dst_ptr: DevicePtr, stream: int) -> None:
        # A captured h2d copy re-reads the host buffer at replay, as cudaMemcpyAsync does.
        src = _bytes_of(src_bytes)
        self._run(lambda: self.view(dst_ptr, src.size, np.uint8).__setitem__(slice(None), src))

    def copy_d2h_async(self, src_ptr: DevicePtr, dst_buffer, stream: int) -> None:
        dst = _writable_bytes_of(dst_buffer)
        self._run(lambda: dst.__setitem__(slice(None), self.view(src_ptr, dst.size, np.uint8)))

    def copy_d2d_async(self, src_ptr, dst_ptr, nbytes: int, stream: int) -> None:
        self._run(lambda: self._d2d(src_ptr, dst_ptr, nbytes))

    def memset(self, ptr: DevicePtr, value: int, nbytes: int) -> None:
        self._no_sync_in_capture("memset")
        self.view(ptr, nbytes, np.uint8)[:] = int(value) & 0xFF

    def memset_async(self, ptr: DevicePtr, value: int, nbytes: int, stream: int) -> None:
        self._run(lambda: self.view(ptr, nbytes, np.uint8).__setitem__(slice(None),
                                                                         int(value) & 0xFF))

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
        self._run(lambda: kernel.impl(ctx, *args))

    def gemm_bf16(self, m: int, n: int, k: int, x_ptr: DevicePtr, w_ptr: DevicePtr,
                  y_ptr: DevicePtr, stream: int) -> None:
        """Y[m, n] = X[m, k] @ W[n, k]^T in BF16, FP32 accumulation (cuBLAS's twin)."""
        gemm_twin = twins.lookup("cublas", "gemm_bf16")
        if gemm_twin is None:
            raise KernelError("gemm_bf16 has no twin registered (import metrale.ops)")
        self._run(lambda: gemm_twin(self, m, n, k, x_ptr, w_ptr, y_ptr))

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
        for op in self._graphs[graph]:
            op()

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
