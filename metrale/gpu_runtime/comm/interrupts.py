"""Ending a whole tensor-parallel job at once when one of its ranks is interrupted (SIGINT:
a signal to one rank, or Ctrl-C in the terminal, which mpiexec forwards to every rank).

A rank cannot stop alone: the others would wait in their next collective until the group's
timeout, and a KeyboardInterrupt unwinding through a model call would send its agreement
record into a collective the others started for something else. So while this process is
one rank of a tensor-parallel group (an `AbortOnInterrupt` is held from `load` to
`teardown`), SIGINT raises no KeyboardInterrupt: the rank writes one line on stderr and
ends the job with status 130 (128 + SIGINT, the shell's convention): MPI_Abort on
COMM_WORLD when MPI runs (the launcher kills every rank), else its own exit (torchrun then
ends the other workers).

Python runs a handler in the main thread between bytecodes, not in the C signal context, so
MPI_Abort from it is as safe as from any Python code (a C-level handler could not call
MPI); the handler runs at once while a rank polls a collective (the polls sleep), and after
a long C call (a GEMM) returns. A program that installed its own SIGINT handler keeps it:
only Python's default one is replaced, and it is put back when the last group closes.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

from ...errors import TensorParallelError

INTERRUPTED_STATUS = 130
# a rank interrupted before it joined MPI joins it before aborting, so the abort reaches the
# others (they join within moments: nothing slow comes before it in `load`); then it gives up
JOIN_BEFORE_ABORT_S = 30.0


class _Handler:
    """The process's one SIGINT handler while groups are held (signals are per process)."""
    lock = threading.Lock()
    held = 0
    previous = None
    rank, size = 0, 1
    aborting = False


class AbortOnInterrupt:
    """While held, SIGINT ends the whole job (see the module docstring). Installed only from
    the main thread and only over Python's default handler; `release()` when the group
    closes."""

    def __init__(self, rank: int, size: int) -> None:
        self._active = False
        if threading.current_thread() is not threading.main_thread():
            return   # signal handlers belong to the main thread
        with _Handler.lock:
            if _Handler.held == 0:
                if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                    return   # the program handles SIGINT itself
                _Handler.previous = signal.signal(signal.SIGINT, _on_sigint)
            _Handler.held += 1
            _Handler.rank, _Handler.size = rank, size
            self._active = True

    def release(self) -> None:
        if not self._active:
            return
        self._active = False
        with _Handler.lock:
            _Handler.held -= 1
            if (_Handler.held == 0 and threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signal.SIGINT) is _on_sigint):
                signal.signal(signal.SIGINT, _Handler.previous)


def _on_sigint(signum, frame) -> None:
    if _Handler.held == 0:   # released from another thread, which cannot restore handlers
        signal.default_int_handler(signum, frame)
    abort_job(_Handler.rank, _Handler.size)


def abort_job(rank: int, size: int, status: int = INTERRUPTED_STATUS) -> None:
    """Write "metrale: rank R of N interrupted; ..." on stderr and end every rank of the job
    with `status`; never returns (a second SIGINT meanwhile is ignored)."""
    if _Handler.aborting:
        return
    _Handler.aborting = True
    _say_interrupted(rank, size)
    _end_job(status)


def end_interrupted_job(tensor_parallel_size) -> None:
    """For a command's KeyboardInterrupt path (the `metrale` CLI): when this process is one
    rank of a tensor-parallel launch (`tensor_parallel_size` > 1 under a launcher of more
    than one process), end the whole job as `abort_job` does and never return; else return,
    and the caller reports the interrupt as on one device. A rank interrupted before it
    joined MPI joins it first (at most JOIN_BEFORE_ABORT_S), so that the abort reaches the
    others instead of leaving them waiting for this rank."""
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
            or tensor_parallel_size <= 1:
        return
    from .ranks import launcher_ranks
    try:
        ranks = launcher_ranks()
    except TensorParallelError:
        return
    if ranks.size <= 1:
        return
    _Handler.aborting = True
    _say_interrupted(ranks.rank, ranks.size)
    if ranks.is_mpi:
        from .mpi_group import init_mpi
        try:
            init_mpi(ranks, JOIN_BEFORE_ABORT_S)
        except BaseException:   # no mpi4py, no peers, or interrupted again: exit alone
            pass
    _end_job(INTERRUPTED_STATUS)


def _say_interrupted(rank: int, size: int) -> None:
    try:   # what the program printed before goes out first
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:   # a flush the signal interrupted; the line below still goes out
        pass
    line = f"metrale: rank {rank} of {size} interrupted; aborting the tensor-parallel job\n"
    try:
        os.write(2, line.encode())   # unbuffered: the process ends right after
    except OSError:
        pass


# the launcher forwards a rank's stderr on its own time; aborting at once lost the line in
# about 1 run of 10 when the whole group got Ctrl-C (hydra tearing down); none in 60 after this
_FORWARD_S = 0.1


def _end_job(status: int) -> None:
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        time.sleep(_FORWARD_S)
        try:   # MPICH adds a line of its own ("Abort(130) on node ..."): one line is enough
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
        except OSError:
            pass
        MPI.COMM_WORLD.Abort(status)
    os._exit(status)
