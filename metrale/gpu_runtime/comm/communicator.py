"""`Communicator`: the collectives of a tensor-parallel group, on device pointers and streams.

One small protocol, two implementations (DESIGN §6), opened by comm/__init__.py:
  `MpiCommunicator`  (comm/mpi.py)  mpi4py over the host backends (HostBackend, EmuBackend),
                     whose device memory is host memory: what CI runs with `mpiexec -n 2`.
  `NcclCommunicator` (comm/nccl.py) NCCL through CuPy's bindings on a `CudaBackend`: the
                     collectives go on the given stream and can be captured in a CUDA graph.

Device collectives (`count` elements of `dtype` per rank; np.float32, np.int32, np.uint16
for BF16 bits, np.uint8):
  all_gather(send, recv, count)   recv [size, count] <- every rank's send [count], rank order
  all_to_all(send, recv, count)   recv[r] <- rank r's send[self.rank]; send, recv [size, count]
  all_to_all_v(send, send_counts, recv, recv_counts)
                                  the same with a count per peer (host lists of `size` ints,
                                  0 allowed): send holds the segments for ranks 0..size-1 back
                                  to back, recv gets rank r's segment for this rank at
                                  sum(recv_counts[:r]); every rank's send_counts[q] must equal
                                  rank q's recv_counts[its rank] (expert parallelism's
                                  dispatch and combine, model_engine/tp/expert_parallel.py)
  all_reduce(send, recv, count)   recv = the sum over ranks (float32 / int32); the order is the
                                  library's, so the model never uses it for activations
  broadcast(ptr, count, root)     ptr <- root's ptr
  barrier(stream)
Host side: `exchange(payload)` gives every rank's `payload` (at most EXCHANGE_BYTES bytes) in
rank order, the agreement step before a model call launches anything; `wait(stream)` blocks
until the stream's work is done. Every wait is bounded by the group's timeout: a peer that died,
hung or stopped calling gives `TensorParallelError` instead of a hang, and the group is broken
from then on (every later call raises at once).
"""
from __future__ import annotations

import time
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from ...errors import InvalidArgument, TensorParallelError

EXCHANGE_BYTES = 1024
DTYPES = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint16), np.dtype(np.uint8))
REDUCE_DTYPES = (np.dtype(np.float32), np.dtype(np.int32))
DEFAULT_TIMEOUT_S = 300.0


@runtime_checkable
class Communicator(Protocol):
    rank: int
    size: int
    name: str            # "mpi" | "nccl"
    timeout_s: float

    def all_gather(self, send_ptr, recv_ptr, count: int, dtype, stream: int) -> None: ...
    def all_to_all(self, send_ptr, recv_ptr, count: int, dtype, stream: int) -> None: ...
    def all_to_all_v(self, send_ptr, send_counts, recv_ptr, recv_counts, dtype,
                     stream: int) -> None: ...
    def all_reduce(self, send_ptr, recv_ptr, count: int, dtype, stream: int) -> None: ...
    def broadcast(self, ptr, count: int, dtype, root: int, stream: int) -> None: ...
    def barrier(self, stream: int) -> None: ...
    def exchange(self, payload: bytes) -> list[bytes]: ...
    def wait(self, stream: int) -> None: ...
    def close(self) -> None: ...


def check_collective(what: str, count: int, dtype, reduce: bool = False) -> np.dtype:
    """The numpy dtype of a collective's elements, after checking count and type."""
    dt = np.dtype(dtype)
    allowed = REDUCE_DTYPES if reduce else DTYPES
    if dt not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise InvalidArgument(f"{what}: dtype {dt} is not one of {names}"
                              + (" (BF16 sums are left to the fixed-order tp_sum_partials)"
                                 if reduce and dt == np.uint16 else ""))
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or \
            not 1 <= int(count) < 2**31:
        raise InvalidArgument(f"{what}: count must be an int in [1, 2^31), got {count!r}")
    return dt


def check_counts(what: str, counts, size: int) -> list[int]:
    """An all_to_all_v's per-peer counts as ints, after checking their number and range."""
    try:
        out = [int(c) for c in counts]
    except (TypeError, ValueError):
        raise InvalidArgument(f"{what}: counts must be {size} ints, got {counts!r}") from None
    if len(out) != size or any(c < 0 for c in out) or sum(out) >= 2**31:
        raise InvalidArgument(f"{what}: counts must be {size} ints >= 0 summing below 2^31, "
                              f"got {out}")
    return out


def pack_payload(payload: bytes) -> np.ndarray:
    """`payload` in a zero-padded EXCHANGE_BYTES buffer behind its 2-byte length."""
    if len(payload) > EXCHANGE_BYTES - 2:
        raise InvalidArgument(f"exchange: payload of {len(payload)} bytes exceeds "
                              f"{EXCHANGE_BYTES - 2}")
    buf = np.zeros(EXCHANGE_BYTES, np.uint8)
    buf[:2] = (len(payload) & 0xFF, len(payload) >> 8)
    buf[2:2 + len(payload)] = np.frombuffer(payload, np.uint8)
    return buf


def unpack_payloads(bufs: np.ndarray) -> list[bytes]:
    """Every rank's payload from the gathered [size, EXCHANGE_BYTES] buffers."""
    out = []
    for row in np.asarray(bufs, np.uint8).reshape(-1, EXCHANGE_BYTES):
        n = int(row[0]) | int(row[1]) << 8
        out.append(bytes(row[2:2 + min(n, EXCHANGE_BYTES - 2)]))
    return out


class Deadline:
    """Polls `done()` until it is true or `timeout_s` passes: busy for the first few polls
    (collectives of a decode step finish in microseconds), then sleeping up to 1 ms between
    polls, so a rank waiting for a slow peer leaves the CPU to it."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)

    def wait(self, done: Callable[[], bool], on_timeout: Callable[[float], None]) -> None:
        start = time.monotonic()
        polls, nap = 0, 20e-6
        while not done():
            polls += 1
            if polls > 64:
                waited = time.monotonic() - start
                if waited > self.timeout_s:
                    on_timeout(waited)
                    raise TensorParallelError("timeout")   # on_timeout raises; never here
                time.sleep(nap)
                nap = min(nap * 2, 1e-3)


def timeout_message(rank: int, size: int, what: str, waited: float) -> str:
    return (f"tensor parallel: rank {rank} of {size}: {what} got no answer from the other "
            f"ranks within {waited:.1f} s: a peer died, hung or stopped calling the model. "
            "The group is broken; every later call on it fails")
