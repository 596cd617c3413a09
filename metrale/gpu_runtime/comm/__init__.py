"""Opening the communicator of a tensor-parallel rank: NCCL on CUDA, MPI on the host
backends (the protocol is communicator.py's `Communicator`)."""
from __future__ import annotations

from ...errors import Unsupported
from .communicator import DEFAULT_TIMEOUT_S, Communicator
from .ranks import RankInfo


def join_group(ranks: RankInfo, *, timeout_s: float = DEFAULT_TIMEOUT_S):
    """The launch's ranks joined before any device communicator (comm/mpi_group.py's
    `MpiGroup`: MPI initialised and a host exchange, bounded by `timeout_s`), for the ranks
    of an MPI launcher; None for the others (torchrun: no channel exists before NCCL's, and
    torchrun ends the other workers when one fails)."""
    if not ranks.is_mpi:
        return None
    from .mpi_group import MpiGroup
    return MpiGroup(ranks, timeout_s=timeout_s)


def open_communicator(backend, ranks: RankInfo, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                      rendezvous: str | None = None, group=None) -> Communicator:
    """The communicator of `backend`'s kind for the launch `ranks`: NCCL on CUDA, MPI on the
    host backends. `rendezvous` ("host:port") is where NCCL's unique id is handed out when
    the ranks were not started by an MPI launcher (default MASTER_ADDR:MASTER_PORT+1).
    `group`: the `join_group` this rank joined (the MPI communicator runs on it and leaves
    closing it to its owner); None: the MPI communicator joins a group of its own."""
    if backend.name.startswith("cuda"):
        from .nccl import NcclCommunicator
        return NcclCommunicator.create(backend, ranks, timeout_s=timeout_s,
                                       rendezvous=rendezvous)
    if not ranks.is_mpi:
        raise Unsupported(f"tensor parallelism on {backend.name} runs over MPI: start the "
                          f"ranks with mpiexec (these were started by {ranks.launcher})")
    from .mpi import MpiCommunicator
    return MpiCommunicator(backend, ranks, timeout_s=timeout_s, group=group)
