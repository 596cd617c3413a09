"""`MpiCommunicator`: the `Communicator` protocol over mpi4py, for the host backends.

HostBackend / EmuBackend "device" memory is host memory, so a collective hands MPI numpy
views of the buffers themselves. Each collective is one task on the backend's stream
(`host_task`: run now, or recorded and run at replay when a graph is being captured, as a
CUDA graph replays NCCL calls). Non-blocking MPI calls (Iallgather, ...) polled against the
group's timeout: MPICH's blocking calls would wait forever for a peer that hangs or left.

A broken group (a timeout) cannot be used again: MPI has no way to cancel the collective
in flight. At exit the process then calls MPI_Abort, so the launcher ends the other ranks
instead of leaving them waiting for this one (mpiexec's own rule for a rank killed by a
signal does the same).

Install: `pip install 'metrale[mpi]'` (mpi4py and the `mpich` wheel, whose mpiexec goes
next to the interpreter).
"""
from __future__ import annotations

import atexit

import numpy as np

from ...errors import TensorParallelError, Unsupported
from .communicator import (EXCHANGE_BYTES, Deadline, check_collective, pack_payload, timeout_message,
                   unpack_payloads)
from .ranks import RankInfo

_ABORT_CODE = 70   # EX_SOFTWARE: the exit status of a job ended by a broken group


def import_mpi():
    """mpi4py's MPI module (initialises MPI), or Unsupported naming the extra to install."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise Unsupported("tensor parallelism on the host backends needs mpi4py and an MPI "
                          f"library: pip install 'metrale[mpi]' ({e})") from None
    return MPI


class MpiCommunicator:
    """A tensor-parallel group of the host backends over MPI; see the module docstring."""

    name = "mpi"

    def __init__(self, backend, ranks: RankInfo, *, timeout_s: float) -> None:
        MPI = import_mpi()
        self._MPI = MPI
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self._deadline = Deadline(timeout_s)
        self._broken: str | None = None
        world = MPI.COMM_WORLD
        self.rank, self.size = world.Get_rank(), world.Get_size()
        if (self.rank, self.size) != (ranks.rank, ranks.size):
            raise TensorParallelError(
                f"tensor parallel: {ranks.launcher} says rank {ranks.rank} of {ranks.size} "
                f"but MPI's COMM_WORLD is rank {self.rank} of {self.size}: start every rank "
                "with the same mpiexec (mpi4py and mpiexec from the same MPI library)")
        # a communicator of its own, so a program's own MPI traffic never meets the model's
        self._comm, req = world.Idup()
        self._wait(req, "creating the communicator (MPI_Comm_idup)")
        self._exchange_recv = np.empty(self.size * EXCHANGE_BYTES, np.uint8)

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
        req = self._comm.Iallgather(pack_payload(payload), self._exchange_recv)
        self._wait(req, "the agreement exchange")
        return unpack_payloads(self._exchange_recv)

    def wait(self, stream: int) -> None:
        self._check()   # host collectives complete inside their task

    def close(self) -> None:
        if self._comm is not None and self._broken is None:
            self._comm.Free()
        self._comm = None

    # internals ------------------------------------------------------------------------
    def _task(self, stream: int, what: str, start) -> None:
        """Run collective `start()` (returns an MPI request) in stream order, bounded."""
        self._check()
        self.backend.host_task(lambda: self._wait(start(), what), stream)

    def _read(self, ptr, count, dt) -> np.ndarray:
        return self.backend.read(ptr, int(count), dt)

    def _view(self, ptr, count, dt) -> np.ndarray:
        return self.backend.view(ptr, int(count), dt)

    def _wait(self, req, what: str) -> None:
        self._deadline.wait(req.Test, lambda waited: self._fail(what, waited))

    def _check(self) -> None:
        if self._broken is not None:
            raise TensorParallelError(self._broken)
        if self._comm is None:
            raise TensorParallelError("tensor parallel: the communicator was closed")

    def _fail(self, what: str, waited: float) -> None:
        self._broken = timeout_message(self.rank, self.size, what, waited)
        atexit.register(self._MPI.COMM_WORLD.Abort, _ABORT_CODE)
        raise TensorParallelError(self._broken)
