"""`MpiCommunicator`: the `Communicator` protocol over mpi4py, for the host backends.

HostBackend / EmuBackend "device" memory is host memory, so a collective hands MPI numpy
views of the buffers themselves. Each collective is one task on the backend's stream
(`host_task`: run now, or recorded and run at replay when a graph is being captured, as a
CUDA graph replays NCCL calls). Non-blocking MPI calls (Iallgather, ...) polled against the
group's timeout: MPICH's blocking calls would wait forever for a peer that hangs or left.

The group itself (MPI initialisation, the communicator, the bounded waits, what a timeout
breaks) is comm/mpi_group.py's `MpiGroup`: load_rank joins it before anything that can fail on
one rank and hands it here; opened alone (`group=None`), the communicator joins its own.
"""
from __future__ import annotations

import numpy as np

from ...errors import TensorParallelError
from .communicator import check_collective, check_counts
from .mpi_group import MpiGroup
from .ranks import RankInfo


class MpiCommunicator:
    """A tensor-parallel group of the host backends over MPI; see the module docstring."""

    name = "mpi"

    def __init__(self, backend, ranks: RankInfo, *, timeout_s: float,
                 group: MpiGroup | None = None) -> None:
        self._owns_group = group is None
        self.group = MpiGroup(ranks, timeout_s=timeout_s) if group is None else group
        self.backend = backend
        self.rank, self.size = self.group.rank, self.group.size
        self.timeout_s = self.group.timeout_s
        self._MPI = self.group.MPI
        self._comm = self.group.comm
        self._closed = False

    # device collectives -----------------------------------------------------------------
    def all_gather(self, send_ptr, recv_ptr, count: int, dtype, stream: int) -> None:
        dt = check_collective("all_gather", count, dtype)
        self._task(stream, "all_gather", lambda: self._comm.Iallgather(
            self._read(send_ptr, count, dt), self._view(recv_ptr, self.size * count, dt)))

    def all_to_all(self, send_ptr, recv_ptr, count: int, dtype, stream: int) -> None:
        dt = check_collective("all_to_all", count, dtype)
        n = self.size * int(count)
        self._task(stream, "all_to_all", lambda: self._comm.Ialltoall(
            self._read(send_ptr, n, dt), self._view(recv_ptr, n, dt)))

    def all_to_all_v(self, send_ptr, send_counts, recv_ptr, recv_counts, dtype,
                     stream: int) -> None:
        """MPI_Alltoallv over the segments of the counts (comm/communicator.py)."""
        dt = check_collective("all_to_all_v", 1, dtype)
        sc = check_counts("all_to_all_v send", send_counts, self.size)
        rc = check_counts("all_to_all_v recv", recv_counts, self.size)

        def start():
            send = self._read(send_ptr, sum(sc), dt) if sum(sc) else np.empty(0, dt)
            recv = self._view(recv_ptr, sum(rc), dt) if sum(rc) else np.empty(0, dt)
            return self._comm.Ialltoallv([send, (sc, _displs(sc))],
                                         [recv, (rc, _displs(rc))])
        self._task(stream, "all_to_all_v", start)

    def all_reduce(self, send_ptr, recv_ptr, count: int, dtype, stream: int) -> None:
        dt = check_collective("all_reduce", count, dtype, reduce=True)

        def start():
            send = self._read(send_ptr, count, dt)
            if int(send_ptr) == int(recv_ptr):
                send = send.copy()   # MPI_IN_PLACE has its own rules; a copy is simpler
            return self._comm.Iallreduce(send, self._view(recv_ptr, count, dt),
                                         op=self._MPI.SUM)
        self._task(stream, "all_reduce", start)

    def broadcast(self, ptr, count: int, dtype, root: int, stream: int) -> None:
        dt = check_collective("broadcast", count, dtype)
        if not 0 <= int(root) < self.size:
            raise TensorParallelError(f"broadcast: root {root} is not a rank of {self.size}")
        self._task(stream, "broadcast", lambda: self._comm.Ibcast(
            self._view(ptr, count, dt), root=int(root)))

    def barrier(self, stream: int) -> None:
        self._task(stream, "barrier", lambda: self._comm.Ibarrier())

    # host side ----------------------------------------------------------------------------
    def exchange(self, payload: bytes) -> list[bytes]:
        self._check()
        return self.group.exchange(payload)

    def wait(self, stream: int) -> None:
        self._check()   # host collectives complete inside their task

    def announce_failure(self, text: str) -> None:
        """This rank failed mid-step: the peers raise, naming it (comm/notice.py)."""
        self.group.announce_failure(text)

    def close(self) -> None:
        self._closed = True
        if self._owns_group:
            self.group.close()

    # internals ------------------------------------------------------------------------
    def _task(self, stream: int, what: str, start) -> None:
        """Run collective `start()` (returns an MPI request) in stream order, bounded."""
        self._check()
        self.backend.host_task(lambda: self.group.wait(start(), what), stream)

    def _read(self, ptr, count, dt) -> np.ndarray:
        return self.backend.read(ptr, int(count), dt)

    def _view(self, ptr, count, dt) -> np.ndarray:
        return self.backend.view(ptr, int(count), dt)

    def _check(self) -> None:
        if self._closed:
            raise TensorParallelError("tensor parallel: the communicator was closed")
        self.group.check()


def _displs(counts: list[int]) -> list[int]:
    """Each segment's offset: the counts before it."""
    return [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]
