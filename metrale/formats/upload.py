"""Moving a source's BF16 weights onto a backend, with a byte progress bar and throughput log.

Callers check every tensor first (`check_tensors(source, expected_tensors(meta))`), so a bad
checkpoint fails before the first byte reaches the device. BF16 tensors go from the mmap
straight to `copy_h2d`, so a checkpoint is never held in host RAM twice.
"""
from __future__ import annotations

import logging
import sys
import time

import numpy as np
from tqdm.auto import tqdm

from ..errors import FormatError, InvalidArgument
from ..gpu_runtime.types import DevicePtr
from ..progress import Ticker

log = logging.getLogger("metrale")


class WeightUploader:
    """Context manager that uploads tensors of `source` to `backend` and counts bytes.

    `total_bytes` sizes the progress bar (BF16 bytes of everything that will be uploaded);
    with `progress` a bar on a terminal, else (a log, CI) a line every few seconds once the
    load has taken two (`Ticker`: quick loads say nothing). On exit the bar closes and the
    load throughput (GB/s) is logged at DEBUG level.
    """

    def __init__(self, backend, source, total_bytes: int, desc: str = "weights",
                 progress: bool = True) -> None:
        self.backend = backend
        self.progress = progress
        self.source = source
        self.total_bytes = int(total_bytes)
        self.desc = desc
        self.bytes_uploaded = 0
        self._bar = None
        self._ticker = None
        self._t0 = 0.0
        self.seconds = 0.0

    def __enter__(self) -> "WeightUploader":
        # disable=None hides the bar when stderr is not a terminal (CI, logs).
        self._bar = tqdm(total=self.total_bytes, desc=self.desc, unit="B", unit_scale=True,
                         unit_divisor=1024, disable=None if self.progress else True,
                         leave=False)
        if self.progress and not sys.stderr.isatty():
            self._ticker = Ticker(f"loading {self.desc}")
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.backend.synchronize(self.backend.default_stream())
        self.seconds = time.perf_counter() - self._t0
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._ticker is not None and not exc[0]:
            self._ticker.done(f"{_gib(self.bytes_uploaded)} loaded")
        log.debug("metrale: loaded %.3f GB of weights from %s in %.2f s (%.2f GB/s)",
                  self.bytes_uploaded / 1e9, self.source.description, self.seconds,
                  self.throughput_gbps())

    def throughput_gbps(self) -> float:
        """Bytes uploaded / seconds so far, in GB/s (1e9 bytes)."""
        secs = self.seconds or (time.perf_counter() - self._t0)
        return self.bytes_uploaded / 1e9 / max(secs, 1e-9)

    def _advance(self, nbytes: int) -> None:
        self.bytes_uploaded += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
        if self._ticker is not None:
            self._ticker.tick(f"{100 * self.bytes_uploaded // max(self.total_bytes, 1)}% of "
                              f"{_gib(self.total_bytes)}")

    def upload(self, name: str) -> DevicePtr:
        """Allocate and fill a device buffer with tensor `name` as BF16 ([*shape] uint16)."""
        if self._direct():
            nbytes = 2 * int(np.prod(self.source.tensor_shape(name), dtype=np.int64))
            ptr = self.backend.alloc(nbytes)
            try:
                self._write_direct(name, ptr, nbytes)
            except BaseException:
                self.backend.free(ptr)
                raise
            return ptr
        return self.upload_bytes(self._read(name))

    def _direct(self) -> bool:
        """A source that converts into a given buffer (GGUF: `read_bf16_into`) on a backend
        whose device memory is host memory (`write_host`): no staging copy."""
        return hasattr(self.source, "read_bf16_into") and hasattr(self.backend, "write_host")

    def _write_direct(self, name: str, ptr, nbytes: int) -> None:
        self.backend.write_host(ptr, nbytes,
                                lambda dst: self.source.read_bf16_into(name, dst.view(np.uint16)))
        self._advance(nbytes)

    def upload_into(self, names: list[str], dst_ptr) -> int:
        """Write tensors `names`, concatenated along dim 0, as BF16 at `dst_ptr`; bytes written.

        Fused weights (e.g. q|k|v or gate|up) are built this way: every tensor must have
        the same trailing dimensions.
        """
        # every shape is checked before the first byte is written
        shapes = [tuple(self.source.tensor_shape(n)) for n in names]
        for name, shape in zip(names, shapes):
            if shape[1:] != shapes[0][1:]:
                raise FormatError(f"{self.source.description}: tensor {name!r} has shape "
                                  f"{list(shape)}; cannot concatenate along dim 0 with "
                                  f"trailing dims {list(shapes[0][1:])} of {names[0]!r}")
        off = 0
        for name, shape in zip(names, shapes):
            if self._direct():
                nbytes = 2 * int(np.prod(shape, dtype=np.int64))
                self._write_direct(name, DevicePtr(dst_ptr).offset(off), nbytes)
                off += nbytes
                continue
            arr = self._read(name)
            self.backend.copy_h2d(arr, DevicePtr(dst_ptr).offset(off))
            off += arr.nbytes
            self._advance(arr.nbytes)
        return off

    def upload_array(self, arr_bf16: np.ndarray, dst_ptr=None) -> DevicePtr:
        """Upload a host uint16 BF16 array (a derived weight) to `dst_ptr`, or a new buffer."""
        arr = np.ascontiguousarray(arr_bf16)
        if arr.dtype != np.uint16:
            raise InvalidArgument(f"upload_array: expected uint16 BF16 bits, got {arr.dtype}")
        ptr = self.backend.alloc(arr.nbytes) if dst_ptr is None else DevicePtr(dst_ptr)
        self.backend.copy_h2d(arr, ptr)
        self._advance(arr.nbytes)
        return ptr

    def upload_bytes(self, arr: np.ndarray) -> DevicePtr:
        """Upload a host array of any dtype (quantized weights, scales) to a new buffer."""
        arr = np.ascontiguousarray(arr)
        ptr = self.backend.alloc(arr.nbytes)
        try:
            self.backend.copy_h2d(arr, ptr)
        except BaseException:
            self.backend.free(ptr)
            raise
        self._advance(arr.nbytes)
        return ptr

    def _read(self, name: str) -> np.ndarray:
        arr = self.source.read_bf16(name)
        if arr.dtype != np.uint16:
            raise FormatError(f"{self.source.description}: read_bf16({name!r}) returned "
                              f"{arr.dtype}, not uint16 BF16 bits")
        # mmap views are C-contiguous already; this only copies odd sources.
        return np.ascontiguousarray(arr)


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
