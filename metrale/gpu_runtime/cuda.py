"""`CudaBackend`: the device through CuPy (RawModules, cuBLAS, streams, events, graphs).

Memory: every `alloc` takes a block from CuPy's default memory pool on the null-stream
arena and keeps its `MemoryPointer` alive until `free`. Models allocate weights, the KV
pool and workspaces once at load time and never inside a step, so the pool's per-stream
reuse hazard (CUPY_NOTES §7.1) cannot arise, and graphs only ever see long-lived buffers.

Streams: `default_stream()` is a non-blocking stream this backend owns (the legacy NULL
stream can be neither captured nor overlapped). Stream handle 0 means that default stream
in every method, as in the original engine where callers pass the conventional 0 and work
runs on the model's default stream; CUDA's legacy stream is never used. Kernels are built from `kernels/<module>.cu`
with NVRTC on first use and cached per module; the source hash of every header goes into
the options so CuPy's disk cache never serves a stale binary.
"""
from __future__ import annotations

import bisect
import threading
from typing import Sequence

import numpy as np

from ..errors import DeviceError, InvalidArgument, KernelError
from . import kernel_source
from .types import DevicePtr, KernelHandle, check_launch_args


class CudaBackend:
    """CuPy implementation of `GpuBackend` for one device."""

    decode_graphs_by_default = True
    pads_decode_graphs = True

    def __init__(self, device_id: int = 0) -> None:
        try:
            import cupy as cp
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise DeviceError(f"CuPy is not importable: {e}") from e
        self.cp = cp
        self.device_id = int(device_id)
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception as e:
            raise DeviceError(f"no usable CUDA device: {e}") from e
        if not 0 <= self.device_id < n:
            raise DeviceError(f"cuda:{self.device_id} requested but {n} device(s) visible")
        self._dev = cp.cuda.Device(self.device_id)
        self._dev.use()
        self.name = f"cuda:{self.device_id}"
        self._mem: dict[int, object] = {}
        self._sizes: dict[int, int] = {}
        self._starts: list[int] = []  # sorted allocation addresses, for find_allocation
        self._live = 0
        self._peak = 0
        self._modules: dict[str, object] = {}
        self._kernels: dict[tuple, KernelHandle] = {}
        self._streams: dict[int, object] = {}
        self._events: dict[int, object] = {}
        self._graphs: dict[int, object] = {}
        self._next_graph = 1
        self._lock = threading.Lock()
        self._default = cp.cuda.Stream(non_blocking=True)
        self._streams[self._default.ptr] = self._default
        self._has_cublas: bool | None = None
        self._one = np.array(1.0, np.float32)
        self._zero = np.array(0.0, np.float32)

    # memory -------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DevicePtr:
        nbytes = int(nbytes)
        if nbytes < 0:
            raise InvalidArgument(f"alloc: nbytes must be >= 0, got {nbytes}")
        try:
            mp = self.cp.cuda.alloc(max(nbytes, 1))
        except self.cp.cuda.memory.OutOfMemoryError as e:
            raise DeviceError(f"out of device memory allocating {nbytes} bytes "
                              f"({self.free_memory()} bytes free): {e}") from e
        self._mem[mp.ptr] = mp
        self._sizes[mp.ptr] = nbytes
        bisect.insort(self._starts, mp.ptr)
        self._live += nbytes
        self._peak = max(self._peak, self._live)
        return DevicePtr(mp.ptr)

    def free(self, ptr: DevicePtr) -> None:
        addr = int(ptr)
        if addr == 0:
            return  # free(NULL) is a no-op, as in the original engine's GpuBackend::free
        if addr not in self._mem:
            raise InvalidArgument(f"free of {DevicePtr(addr)!r}: not an allocation of this backend")
        del self._mem[addr]
        self._live -= self._sizes.pop(addr)
        self._starts.pop(bisect.bisect_left(self._starts, addr))

    def find_allocation(self, ptr) -> tuple[DevicePtr, int] | None:
        """`(base, nbytes)` of the allocation containing device address `ptr`: this backend's
        own allocations first, then any other device memory (CuPy arrays, torch tensors via
        DLPack) through the driver's `cuMemGetAddressRange`. None when `ptr` is not device
        memory."""
        addr = int(ptr)
        if addr <= 0:
            return None
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            base = self._starts[i]
            size = self._sizes[base]
            if addr < base + size or addr == base:
                return DevicePtr(base), size
        from cuda.bindings import driver
        err, base, size = driver.cuMemGetAddressRange(driver.CUdeviceptr(addr))
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        return DevicePtr(int(base)), int(size)

    def live_bytes(self) -> int:
        return self._live

    def peak_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._live

    def total_memory(self) -> int:
        return int(self.cp.cuda.runtime.memGetInfo()[1])

    def free_memory(self) -> int:
        # Blocks cached by CuPy's pool but unused count as free for our purposes.
        pool = self.cp.get_default_memory_pool()
        return int(self.cp.cuda.runtime.memGetInfo()[0]) + int(pool.free_bytes())

    # copies ---------------------------------------------------------------------------
    def copy_h2d(self, src_bytes, dst_ptr: DevicePtr) -> None:
        src = _host_bytes(src_bytes)
        self.cp.cuda.runtime.memcpy(int(dst_ptr), src.ctypes.data, src.nbytes,
                                    self.cp.cuda.runtime.memcpyHostToDevice)

    def copy_d2h(self, src_ptr: DevicePtr, dst_buffer) -> None:
        dst = _host_bytes(dst_buffer, writable=True)
        self.synchronize(self.default_stream())
        self.cp.cuda.runtime.memcpy(dst.ctypes.data, int(src_ptr), dst.nbytes,
                                    self.cp.cuda.runtime.memcpyDeviceToHost)

    def copy_d2d(self, src_ptr: DevicePtr, dst_ptr: DevicePtr, nbytes: int) -> None:
        self.cp.cuda.runtime.memcpy(int(dst_ptr), int(src_ptr), int(nbytes),
                                    self.cp.cuda.runtime.memcpyDeviceToDevice)

    def copy_h2d_async(self, src_bytes, dst_ptr: DevicePtr, stream: int) -> None:
        # The caller keeps `src_bytes` alive until the stream passes this copy (pinned
        # buffers for true asynchrony; pageable ones make CUDA stage the copy).
        src = _host_bytes(src_bytes)
        self.cp.cuda.runtime.memcpyAsync(int(dst_ptr), src.ctypes.data, src.nbytes,
                                         self.cp.cuda.runtime.memcpyHostToDevice,
                                         self._handle(stream))

    def copy_d2h_async(self, src_ptr: DevicePtr, dst_buffer, stream: int) -> None:
        dst = _host_bytes(dst_buffer, writable=True)
        self.cp.cuda.runtime.memcpyAsync(dst.ctypes.data, int(src_ptr), dst.nbytes,
                                         self.cp.cuda.runtime.memcpyDeviceToHost,
                                         self._handle(stream))

    def copy_d2d_async(self, src_ptr, dst_ptr, nbytes: int, stream: int) -> None:
        self.cp.cuda.runtime.memcpyAsync(int(dst_ptr), int(src_ptr), int(nbytes),
                                         self.cp.cuda.runtime.memcpyDeviceToDevice,
                                         self._handle(stream))

    def memset(self, ptr: DevicePtr, value: int, nbytes: int) -> None:
        self.cp.cuda.runtime.memset(int(ptr), int(value), int(nbytes))

    def memset_async(self, ptr: DevicePtr, value: int, nbytes: int, stream: int) -> None:
        self.cp.cuda.runtime.memsetAsync(int(ptr), int(value), int(nbytes),
                                         self._handle(stream))

    # kernels --------------------------------------------------------------------------
    def kernel(self, module: str, func: str) -> KernelHandle:
        key = (module, func)
        h = self._kernels.get(key)
        if h is not None:
            return h
        with self._lock:
            mod = self._modules.get(module)
            if mod is None:
                src, src_hash = kernel_source.read_source(module)
                opts = [*kernel_source.NVRTC_OPTIONS, f"-I{kernel_source.kernels_dir()}",
                        f"-DMETRALE_SRC_HASH={src_hash}"]
                inc = kernel_source.cuda_include_dir()
                if inc:
                    opts.append(f"-I{inc}")
                mod = self.cp.RawModule(code=src, options=tuple(opts), backend="nvrtc")
                self._modules[module] = mod
            try:
                fn = mod.get_function(func)
            except Exception as e:
                raise KernelError(f"kernel {module}.{func}: {e}") from e
            h = self._kernels[key] = KernelHandle(module, func, fn)
        return h

    def has_module(self, module: str) -> bool:
        return kernel_source.has_module(module)

    def launch(self, kernel: KernelHandle, grid, block, shared_mem: int, stream: int,
               args: Sequence) -> None:
        grid3, block3 = check_launch_args(kernel, grid, block, args)
        packed = tuple(np.uint64(a) if isinstance(a, DevicePtr) else a for a in args)
        kernel.impl(grid3, block3, packed, shared_mem=int(shared_mem),
                    stream=self._stream(stream))

    def gemm_bf16(self, m: int, n: int, k: int, x_ptr: DevicePtr, w_ptr: DevicePtr,
                  y_ptr: DevicePtr, stream: int) -> None:
        """Y[m, n] = X[m, k] @ W[n, k]^T, BF16 in/out, FP32 compute, through cuBLAS.

        Row-major nn.Linear layout maps to column-major gemmEx(OP_T, OP_N, n, m, k)
        (CUPY_NOTES §2). Not capturable in a CUDA graph (CuPy's cuBLAS refuses capture).
        """
        from cupy_backends.cuda.libs import cublas
        s = self._stream(stream)
        with s:
            h = self.cp.cuda.device.get_cublas_handle()
            cublas.setStream(h, s.ptr)
            cublas.gemmEx(h, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, int(n), int(m), int(k),
                          self._one.ctypes.data, int(w_ptr), 14, int(k), int(x_ptr), 14,
                          int(k), self._zero.ctypes.data, int(y_ptr), 14, int(n),
                          cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)

    def has_gemm(self) -> bool:
        """Whether cuBLAS can be loaded (CuPy finds libcublas lazily; a driver-only machine
        without the CUDA libraries has none, and GEMMs then fall back to the GEMV kernel)."""
        if self._has_cublas is None:
            try:
                from cupy_backends.cuda.libs import cublas  # noqa: F401
                self._has_cublas = True
            except ImportError as e:
                import logging
                logging.getLogger("metrale").warning(
                    "metrale: cuBLAS not loadable (%s); GEMMs use the GEMV kernel "
                    "(install cupy-cuda12x[ctk] or a CUDA toolkit for speed)", e)
                self._has_cublas = False
        return self._has_cublas

    # streams, events, graphs ----------------------------------------------------------
    def default_stream(self) -> int:
        return int(self._default.ptr)

    def create_stream(self) -> int:
        s = self.cp.cuda.Stream(non_blocking=True)
        self._streams[s.ptr] = s
        return int(s.ptr)

    def synchronize(self, stream: int) -> None:
        self._stream(stream).synchronize()

    def _stream(self, stream: int):
        if int(stream) == 0:
            return self._default  # 0 is the default stream, never CUDA's legacy stream
        s = self._streams.get(int(stream))
        if s is None:
            s = self._streams[int(stream)] = self.cp.cuda.ExternalStream(int(stream))
        return s

    def bind_to_thread(self) -> None:
        """Make this backend's device current on the calling thread."""
        self._dev.use()

    def _handle(self, stream: int) -> int:
        """The raw stream handle for a runtime call (0 -> the default stream)."""
        return int(self._stream(stream).ptr)

    def stream_handle(self, stream: int) -> int:
        """The `cudaStream_t` a library call on `stream` takes (0 -> the default stream)."""
        return self._handle(stream)

    def pinned_host(self, nbytes: int) -> np.ndarray:
        """A page-locked host buffer of `nbytes` uint8 (asynchronous copies to and from it
        never block the host); it lives as long as the array."""
        mem = self.cp.cuda.alloc_pinned_memory(int(nbytes))
        return np.frombuffer(mem, np.uint8, int(nbytes))

    def create_event(self) -> int:
        e = self.cp.cuda.Event()
        self._events[e.ptr] = e
        return int(e.ptr)

    def record_event(self, event: int, stream: int) -> None:
        self._events[int(event)].record(self._stream(stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._stream(stream).wait_event(self._events[int(event)])

    def event_synchronize(self, event: int) -> None:
        self._events[int(event)].synchronize()

    def event_query(self, event: int) -> bool:
        return bool(self._events[int(event)].done)

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return float(self.cp.cuda.get_elapsed_time(self._events[int(start)],
                                                   self._events[int(end)]))

    def destroy_event(self, event: int) -> None:
        self._events.pop(int(event), None)

    def begin_capture(self, stream: int) -> None:
        self._stream(stream).begin_capture()

    def end_capture(self, stream: int) -> int:
        g = self._stream(stream).end_capture()
        gid = self._next_graph
        self._next_graph += 1
        self._graphs[gid] = g
        return gid

    def launch_graph(self, graph: int, stream: int) -> None:
        g = self._graphs.get(int(graph))
        if g is None:
            raise InvalidArgument(f"launch_graph: unknown graph {graph}")
        g.launch(stream=self._stream(stream))

    def destroy_graph(self, graph: int) -> None:
        self._graphs.pop(int(graph), None)

    def is_capturing(self) -> bool:
        return bool(self._default.is_capturing())

    # device facts ---------------------------------------------------------------------
    def sm_count(self) -> int:
        return int(self._dev.attributes["MultiProcessorCount"])

    def device_name(self) -> str:
        props = self.cp.cuda.runtime.getDeviceProperties(self.device_id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)


def _host_bytes(buf, writable: bool = False) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InvalidArgument("host buffer must be C-contiguous")
        if writable and not buf.flags.writeable:
            raise InvalidArgument("destination buffer is read-only")
        return buf.reshape(-1).view(np.uint8)
    mv = memoryview(buf)
    if writable and mv.readonly:
        raise InvalidArgument("destination buffer is read-only")
    return np.frombuffer(mv.cast("B"), dtype=np.uint8)
