"""`MpiGroup`: the ranks of an MPI launch, joined before anything that can fail on one rank:
MPI initialised and a communicator of the group's own, both bounded by the group's timeout,
with the host-side exchange the load's agreement runs on (model_engine/tp/model.py).

MPI_Init waits until every rank of the launch has called it, and mpi4py holds the GIL
while it does (at `import mpi4py.MPI`, and in `MPI.Init_thread`), so a rank whose peer
stopped before reaching MPI (a bad checkpoint seen by one rank, a crash in the program's
own code) would wait there forever, deaf even to its own timeout. `init_mpi` therefore
loads mpi4py without initialising MPI and calls the library's MPI_Init_thread through
ctypes (which releases the GIL) on a helper thread, waiting for it at most the timeout.
After a timeout the process must not call MPI again; it raises, and its exit makes the
launcher end the job (hydra ends a job whose rank exits after starting MPI but before
finishing it).

Install: `pip install 'metrale[mpi]'` (mpi4py and the `mpich` wheel, whose mpiexec goes
next to the interpreter).
"""
from __future__ import annotations

import atexit
import ctypes
import sys
import threading

import numpy as np

from ...errors import TensorParallelError, Unsupported
from .communicator import EXCHANGE_BYTES, Deadline, pack_payload, timeout_message, unpack_payloads
from .notice import FailureNotice
from .ranks import RankInfo

_ABORT_CODE = 70   # EX_SOFTWARE: the exit status of a job ended by a broken group
# MPI initialisation is once per process: one helper thread ever calls MPI_Init_thread
_init_lock = threading.Lock()
_init_thread: threading.Thread | None = None
_init_result: list[int] = []    # MPI_Init_thread's return code, once it returned


def init_mpi(ranks: RankInfo, timeout_s: float):
    """mpi4py's MPI module with MPI initialised (THREAD_MULTIPLE, as mpi4py asks), waiting
    at most `timeout_s` for the other ranks; TensorParallelError after it, Unsupported
    without mpi4py."""
    global _init_thread
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        try:
            import mpi4py
        except ImportError as e:
            raise Unsupported("tensor parallelism on the host backends needs mpi4py and an "
                              f"MPI library: pip install 'metrale[mpi]' ({e})") from None
        mpi4py.rc.initialize = False   # initialised below, bounded
        mpi4py.rc.finalize = True      # finalised by mpi4py at exit, as after its own init
        from mpi4py import MPI
    if MPI.Is_initialized():
        return MPI
    if MPI.Is_finalized():
        raise TensorParallelError("tensor parallel: MPI was finalized in this process; a "
                                  "new group cannot start")
    try:
        init = ctypes.CDLL(MPI.__file__).MPI_Init_thread   # the library mpi4py runs on
    except (AttributeError, OSError):   # a build that hides it: unbounded, as mpi4py does
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        return MPI
    init.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                     ctypes.POINTER(ctypes.c_int)]
    with _init_lock:
        if _init_thread is None:   # else a first call timed out: wait on for that one
            provided = ctypes.c_int()
            _init_thread = threading.Thread(
                target=lambda: _init_result.append(init(None, None, MPI.THREAD_MULTIPLE,
                                                        ctypes.byref(provided))),
                name="metrale-mpi-init", daemon=True)
            _init_thread.start()
        _init_thread.join(timeout_s)
        if _init_thread.is_alive():
            raise TensorParallelError(
                f"tensor parallel: rank {ranks.rank} of {ranks.size}: the other ranks did not "
                f"start MPI within {timeout_s:.1f} s: a rank stopped before it reached the "
                "tensor-parallel group (its own output says why), or the ranks were not "
                "started by one mpiexec")
    if _init_result[0] != 0:
        raise TensorParallelError(f"tensor parallel: MPI_Init_thread failed (code "
                                  f"{_init_result[0]})")
    return MPI


class MpiGroup:
    """The ranks of an MPI launch on a communicator of their own (MPI_Comm_idup of
    COMM_WORLD, so a program's own MPI traffic never meets the model's); every wait bounded
    by `timeout_s`. A timeout breaks the group: every later call raises at once, and the
    process calls MPI_Abort at exit so the launcher ends the other ranks instead of leaving
    them waiting for this one."""

    def __init__(self, ranks: RankInfo, *, timeout_s: float) -> None:
        MPI = init_mpi(ranks, timeout_s)
        self.MPI = MPI
        self.timeout_s = float(timeout_s)
        self._deadline = Deadline(timeout_s)
        self._broken: str | None = None
        self.comm = self.notice = None
        world = MPI.COMM_WORLD
        self.rank, self.size = world.Get_rank(), world.Get_size()
        if (self.rank, self.size) != (ranks.rank, ranks.size):
            raise TensorParallelError(
                f"tensor parallel: {ranks.launcher} says rank {ranks.rank} of {ranks.size} "
                f"but MPI's COMM_WORLD is rank {self.rank} of {self.size}: start every rank "
                "with the same mpiexec (mpi4py and mpiexec from the same MPI library)")
        comm, req = world.Idup()
        self.comm = comm
        self.wait(req, "creating the communicator (MPI_Comm_idup)")
        # a peer that fails mid-step tells the others at once (notice.py)
        self.notice = FailureNotice(MPI, comm, self.rank, self.size, self.timeout_s)
        self._exchange_recv = np.empty(self.size * EXCHANGE_BYTES, np.uint8)

    def exchange(self, payload: bytes) -> list[bytes]:
        """Every rank's `payload` (at most EXCHANGE_BYTES - 2 bytes), in rank order."""
        self.check()
        req = self.comm.Iallgather(pack_payload(payload), self._exchange_recv)
        self.wait(req, "the agreement exchange")
        return unpack_payloads(self._exchange_recv)

    def wait(self, req, what: str) -> None:
        """Wait for MPI request `req`, at most the timeout (then the group is broken), or
        until a peer announces that it failed mid-step (TensorParallelError naming it)."""
        def done() -> bool:
            self.check()
            return req.Test()
        self._deadline.wait(done, lambda waited: self._fail(what, waited))

    def announce_failure(self, text: str) -> None:
        """This rank failed mid-step with `text` (its error): the peers raise it, naming this
        rank, from the collective they wait in; the group is broken (notice.py)."""
        if self.notice is None or self._broken is not None:
            return
        self.notice.announce(text)
        self._broken = (f"tensor parallel: rank {self.rank} of {self.size} failed mid-step: "
                        f"{text}; the group is broken")

    def check(self) -> None:
        if self._broken is None and self.notice is not None and self.notice.poll():
            self._broken = self.notice.message
        if self._broken is not None:
            raise TensorParallelError(self._broken)
        if self.comm is None:
            raise TensorParallelError("tensor parallel: the communicator was closed")

    def close(self) -> None:
        if self.comm is not None and self._broken is None:
            if self.notice is not None:
                self.notice.cancel()
            self.comm.Free()
        self.comm = None

    def _fail(self, what: str, waited: float) -> None:
        self._broken = timeout_message(self.rank, self.size, what, waited)
        atexit.register(self.MPI.COMM_WORLD.Abort, _ABORT_CODE)
        raise TensorParallelError(self._broken)
