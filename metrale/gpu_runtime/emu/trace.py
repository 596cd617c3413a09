"""A model's device work at a real model shape, recorded without memory and replayed on the
EmuBackend's counters with sampled blocks (what `metrale check-kernels --profile` counts).

`TraceBackend` takes the place of a GPU: allocations are address ranges with nothing behind
them, copies keep the bytes of small host buffers only (positions, block tables, token ids:
what steers the kernels), launches are recorded, nothing runs. A Llama-3.1-8B step is
recorded in seconds with weights read from `ZeroSource` (zeros, never touched).

`replay` runs a recorded segment on an EmuBackend built with `count=True, sample_blocks=S`
and memory that is not filled (`ProfileEmuBackend`): 16 GB of weights cost address space
only, the small copies are replayed in order so every kernel sees its real lengths and
tables, and each launch runs S evenly spaced blocks of its grid. Outputs are then partial
(later kernels read zeros or partial data), which changes no address a kernel touches
except where a kernel's addresses depend on data a previous kernel computed (none here:
positions, lengths and tables come from the host).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from ...errors import KernelError
from ..host import HostBackend
from ..types import DevicePtr, KernelHandle, check_launch_args
from .backend import EmuBackend

KEEP_COPY_BYTES = 1 << 20   # host copies up to this size keep their bytes for the replay
_ALIGN = 256


@dataclass
class Op:
    kind: str                      # alloc, free, h2d, d2d, memset, launch, gemm
    args: tuple
    data: bytes | None = None      # h2d: the bytes (small copies only)


@dataclass
class Segment:
    name: str
    start: int
    end: int = -1


@dataclass
class Trace:
    ops: list[Op] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)


class TraceBackend(HostBackend):
    """A `GpuBackend` that records allocations, copies and launches and runs nothing."""

    name = "trace"
    # records what a GPU would run: padded graph rungs, graphs only when asked
    decode_graphs_by_default = False
    pads_decode_graphs = True

    def __init__(self, memory_bytes: int = 141 * 10**9) -> None:
        super().__init__(memory_bytes, convert_cache_bytes=0, native=False)
        self.trace = Trace()
        self._next = 1 << 40

    def begin_segment(self, name: str) -> None:
        self.trace.segments.append(Segment(name, len(self.trace.ops)))

    def end_segment(self) -> None:
        self.trace.segments[-1].end = len(self.trace.ops)

    # memory: address ranges only -------------------------------------------------------
    def alloc(self, nbytes: int) -> DevicePtr:
        nbytes = int(nbytes)
        if self._limit is not None and self._live + nbytes > self._limit:
            raise KernelError(f"trace: out of memory ({nbytes} bytes more than "
                              f"{self._limit - self._live} free)")
        addr = self._next
        self._next += -(-max(nbytes, 1) // _ALIGN) * _ALIGN + _ALIGN
        self._sizes[addr] = nbytes
        bisect.insort(self._starts, addr)
        self._live += nbytes
        self.trace.ops.append(Op("alloc", (addr, nbytes)))
        return DevicePtr(addr)

    def free(self, ptr: DevicePtr) -> None:
        addr = int(ptr)
        if not addr:
            return
        self._live -= self._sizes.pop(addr)
        self._starts.pop(bisect.bisect_left(self._starts, addr))
        self._located.clear()   # (HostMemory.free's memo of checked ranges)
        self.trace.ops.append(Op("free", (addr,)))

    def _h2d(self, src: np.ndarray, dst_ptr) -> None:
        data = src.tobytes() if src.nbytes <= KEEP_COPY_BYTES else None
        self.trace.ops.append(Op("h2d", (int(dst_ptr), int(src.nbytes)), data))

    def copy_d2h(self, src_ptr: DevicePtr, dst_buffer) -> None:
        np.asarray(dst_buffer).view(np.uint8)[...] = 0

    def copy_d2h_async(self, src_ptr, dst_buffer, stream: int) -> None:
        self.copy_d2h(src_ptr, dst_buffer)

    def _d2d(self, src_ptr, dst_ptr, nbytes) -> None:
        self.trace.ops.append(Op("d2d", (int(src_ptr), int(dst_ptr), int(nbytes))))

    def _memset(self, ptr, value, nbytes) -> None:
        self.trace.ops.append(Op("memset", (int(ptr), int(value), int(nbytes))))

    def view(self, ptr, count: int, dtype):
        raise KernelError("trace: device memory cannot be viewed while recording")

    read = view

    # kernels: recorded -------------------------------------------------------------------
    def kernel(self, module: str, func: str) -> KernelHandle:
        return KernelHandle(module, func, None)

    def launch(self, kernel: KernelHandle, grid, block, shared_mem: int, stream: int,
               args) -> None:
        grid3, block3 = check_launch_args(kernel, grid, block, args)
        self._run(lambda: self.trace.ops.append(
            Op("launch", (kernel.module, kernel.function, grid3, block3, int(shared_mem),
                          tuple(args)))))

    def gemm_bf16(self, m, n, k, x_ptr, w_ptr, y_ptr, stream) -> None:
        self._run(lambda: self.trace.ops.append(
            Op("gemm", (int(m), int(n), int(k), int(x_ptr), int(w_ptr), int(y_ptr)))))


class ZeroSource:
    """A `ModelSource` with another source's config and shapes and all-zero weights, made
    with np.zeros (pages the OS hands out only when written: a TraceBackend never does)."""

    def __init__(self, source) -> None:
        self._source = source
        self.description = source.description

    def __getattr__(self, name):
        return getattr(self._source, name)

    def read_bf16(self, name: str) -> np.ndarray:
        return np.zeros(self._source.tensor_shape(name), np.uint16)


class ProfileEmuBackend(EmuBackend):
    """EmuBackend for replays: counters on; grids of up to `full_grid` blocks run whole,
    larger ones `sample_blocks` evenly spaced blocks; allocations are zero pages that take
    memory only where a kernel writes."""

    def __init__(self, sample_blocks: int = 16, full_grid: int = 512) -> None:
        # poison=False: lazily zeroed pages (host_memory.py), whatever the environment says
        super().__init__(count=True, sample_blocks=sample_blocks, poison=False)
        self.full_grid = int(full_grid)

    def blocks_to_run(self, grid3) -> int:
        return 0 if grid3[0] * grid3[1] * grid3[2] <= self.full_grid else self.sample_blocks


def _launch_key(module, func, grid, block, smem, args, allocation) -> tuple:
    """What a launch's counters depend on: the kernel, its geometry and scalars, and for each
    pointer its allocation's size and offset within it modulo 4 KiB (the address bits that
    decide sectors and banks). The layers of a model repeat the same keys."""
    key = [module, func, tuple(grid), tuple(block), int(smem)]
    for a in args:
        if isinstance(a, DevicePtr):
            base, size = allocation(int(a)) if int(a) else (0, 0)
            key.append(("p", size, (int(a) - base) % 4096))
        else:
            key.append((type(a).__name__, a.item()))
    return tuple(key)


def replay(trace: Trace, segment: str, be: ProfileEmuBackend) -> list[dict]:
    """Run `trace` on `be` up to the end of `segment`, launching only the segment's kernels;
    returns their counter records (EmuBackend.launch_counters entries). A launch whose key
    (`_launch_key`) was counted before reuses those counters ("repeat": True) instead of
    running again: the 32 layers of a step are counted once."""
    seg = next((s for s in trace.segments if s.name == segment), None)
    if seg is None or seg.end < 0:
        raise KernelError(f"trace has no finished segment {segment!r}")
    starts: list[int] = []
    real: dict[int, tuple[int, int]] = {}   # virtual base -> (real address, size)

    def to_real(addr: int) -> int:
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0:
            raise KernelError(f"trace: address 0x{addr:x} is in no allocation")
        base = starts[i]
        ptr, size = real[base]
        if addr > base + max(size, 1):
            raise KernelError(f"trace: address 0x{addr:x} is past its allocation")
        return ptr + (addr - base)

    first = len(be.launch_counters)
    counted: dict[tuple, dict] = {}

    def allocation(addr: int) -> tuple[int, int]:
        base = starts[bisect.bisect_right(starts, addr) - 1]
        return base, real[base][1]

    try:
        for i, op in enumerate(trace.ops[:seg.end]):
            if op.kind == "alloc":
                addr, n = op.args
                real[addr] = (int(be.alloc(n)), n)
                bisect.insort(starts, addr)
            elif op.kind == "free":
                be.free(DevicePtr(real.pop(op.args[0])[0]))
                starts.pop(bisect.bisect_left(starts, op.args[0]))
            elif op.kind == "h2d" and op.data is not None:
                be.copy_h2d(np.frombuffer(op.data, np.uint8), DevicePtr(to_real(op.args[0])))
            elif op.kind == "d2d" and op.args[2] <= KEEP_COPY_BYTES:
                be.copy_d2d(DevicePtr(to_real(op.args[0])), DevicePtr(to_real(op.args[1])),
                            op.args[2])
            elif op.kind == "memset" and op.args[2] <= KEEP_COPY_BYTES:
                be.memset(DevicePtr(to_real(op.args[0])), op.args[1], op.args[2])
            elif op.kind == "launch" and i >= seg.start:
                module, func, grid, block, smem, args = op.args
                key = _launch_key(module, func, grid, block, smem, args, allocation)
                if key in counted:
                    be.launch_counters.append(dict(counted[key], repeat=True))
                    continue
                args = [DevicePtr(to_real(int(a))) if isinstance(a, DevicePtr) and int(a) else a
                        for a in args]
                be.launch(be.kernel(module, func), grid, block, smem, 0, args)
                counted[key] = be.launch_counters[-1]
            elif op.kind == "gemm" and i >= seg.start:
                be.launch_counters.append({"kernel": "cublas.gemm_bf16", "gemm": op.args[:3]})
    finally:
        for ptr, _ in real.values():
            be.free(DevicePtr(ptr))
    return be.launch_counters[first:]
