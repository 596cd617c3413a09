"""`FailureNotice`: how a rank that fails in the middle of a step (after the step's agreement,
model_engine/agreement.py: an exception in a collective, e.g. an expert-parallel all-to-all,
or in a kernel launch between two) ends the job at once instead of leaving its peers
waiting in their next collective until the group's timeout.

The failing rank sends every peer a notice on a tag of its own (point to point beside the
collectives, which never match it) and writes one line on stderr:
    metrale: rank 1 of 2 failed mid-step: RuntimeError: ...; ending the tensor-parallel job
A peer polls for a notice in every bounded wait (MpiGroup.wait): on one it acknowledges,
breaks its group and raises TensorParallelError "tensor parallel: rank 1 of 2 failed
mid-step: RuntimeError: ..." from the collective it was in. Then every rank exits and the
job ends: the failing rank, once every peer acknowledged (or after the timeout), calls
MPI_Abort at exit; a peer waits at exit for that abort (at most the timeout) and aborts
itself after it, so no rank is killed before it has raised its error. mpiexec's status is
non-zero (MPI_Abort's code 70, or the launcher's for the ranks it killed).
"""
from __future__ import annotations

import atexit
import sys
import time

import numpy as np

NOTICE_TAG, ACK_TAG = 0x3E7A, 0x3E7B
NOTICE_BYTES = 512
ABORT_CODE = 70   # EX_SOFTWARE, as a timeout's abort (mpi_group.py)


class FailureNotice:
    """The notices of one MPI group (its communicator `comm`); see the module docstring."""

    def __init__(self, MPI, comm, rank: int, size: int, timeout_s: float) -> None:
        self.MPI, self.comm = MPI, comm
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._buf = np.zeros(NOTICE_BYTES, np.uint8)
        self._status = MPI.Status()
        self._recv = comm.Irecv(self._buf, source=MPI.ANY_SOURCE, tag=NOTICE_TAG)
        self._sends: list = []
        self.message: str | None = None   # what broke the group, once it did
        # a program that exits without closing its group: the receive is withdrawn before
        # mpi4py finalizes MPI (atexit runs last-registered first), not left pending there
        atexit.register(self._withdraw)

    def poll(self) -> str | None:
        """The failure a peer announced (this rank's message for it), else None."""
        if self.message is not None:
            return self.message
        if self._recv is None or not self._recv.Test(self._status):
            return None
        self._recv = None
        peer = self._status.Get_source()
        text = bytes(self._buf).rstrip(b"\0").decode(errors="replace")
        self.message = (f"tensor parallel: rank {peer} of {self.size} failed mid-step: {text}; "
                        "the group is broken")
        ack = np.ones(1, np.uint8)
        self._sends.append((self.comm.Isend(ack, dest=peer, tag=ACK_TAG), ack))
        atexit.register(self._await_abort)
        return self.message

    def announce(self, text: str) -> None:
        """This rank failed mid-step with `text`: tell every peer, once."""
        if self.message is not None:
            return
        self.message = text
        data = np.zeros(NOTICE_BYTES, np.uint8)
        raw = text.encode()[:NOTICE_BYTES - 1]
        data[:len(raw)] = np.frombuffer(raw, np.uint8)
        for peer in range(self.size):
            if peer != self.rank:
                self._sends.append((self.comm.Isend(data, dest=peer, tag=NOTICE_TAG), data))
        sys.stderr.write(f"metrale: rank {self.rank} of {self.size} failed mid-step: {text}; "
                         "ending the tensor-parallel job\n")
        sys.stderr.flush()
        atexit.register(self._abort_after_acks)

    def cancel(self) -> None:
        """Withdraw the pending receive (before the communicator is freed); once."""
        atexit.unregister(self._withdraw)
        self._withdraw()

    def _withdraw(self) -> None:
        if self._recv is not None and self.message is None:
            self._recv.Cancel()
            self._recv.Wait()
            self._recv = None

    # at exit ---------------------------------------------------------------------------
    def _abort_after_acks(self) -> None:
        """Abort once every peer acknowledged or announced a failure of its own (ranks that
        failed alike acknowledge nothing), at most the timeout after exit began."""
        waiting = {}
        for peer in range(self.size):
            if peer != self.rank:
                buf = np.zeros(1, np.uint8)
                waiting[peer] = (self.comm.Irecv(buf, source=peer, tag=ACK_TAG), buf)
        end = time.monotonic() + self.timeout_s
        while waiting and time.monotonic() < end:
            for peer in [p for p, (r, _) in waiting.items() if r.Test()]:
                del waiting[peer]
            if self._recv is not None and self._recv.Test(self._status):
                waiting.pop(self._status.Get_source(), None)
                self._recv = self.comm.Irecv(self._buf, source=self.MPI.ANY_SOURCE,
                                             tag=NOTICE_TAG)
            time.sleep(0.002)
        self.MPI.COMM_WORLD.Abort(ABORT_CODE)

    def _await_abort(self) -> None:
        time.sleep(self.timeout_s)   # the failing rank's abort ends this process first
        self.MPI.COMM_WORLD.Abort(ABORT_CODE)
