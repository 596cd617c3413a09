"""Which process of a multi-process launch this is: rank, world size and local rank, read
from the launcher's environment.

Launchers, in the order they are looked for (the first whose variables are all present wins):
  torchrun / torch.distributed.run   RANK, WORLD_SIZE, LOCAL_RANK
  Open MPI mpirun                    OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
                                     OMPI_COMM_WORLD_LOCAL_RANK
  MPICH / Intel MPI (Hydra mpiexec)  PMI_RANK, PMI_SIZE, MPI_LOCALRANKID (local rank; 0
                                     when absent)
  Slurm srun                         SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
The local rank picks the GPU of a rank on a CUDA device given as "cuda" or "auto".
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from typing import Mapping

from ...errors import TensorParallelError

# (launcher, rank variable, size variable, local-rank variable or None)
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
MPI_LAUNCHERS = ("openmpi", "mpich", "slurm")


@dataclass(frozen=True)
class RankInfo:
    """This process's place in its launch."""

    rank: int
    size: int
    local_rank: int
    launcher: str          # "torchrun" | "openmpi" | "mpich" | "slurm" | "single"

    @property
    def is_mpi(self) -> bool:
        """Started by an MPI launcher (mpi4py's COMM_WORLD holds exactly these ranks)."""
        return self.launcher in MPI_LAUNCHERS


def launcher_ranks(env: Mapping[str, str] | None = None) -> RankInfo:
    """The launch this process belongs to; a single process (rank 0 of 1) when no launcher's
    variables are set. TensorParallelError when a launcher's variables are malformed."""
    env = os.environ if env is None else env
    for launcher, rank_var, size_var, local_var in LAUNCHERS:
        if rank_var not in env or size_var not in env:
            continue
        rank = _int(env, rank_var, launcher)
        size = _int(env, size_var, launcher)
        local = _int(env, local_var, launcher) if local_var and local_var in env else 0
        if size < 1 or not 0 <= rank < size:
            raise TensorParallelError(f"{launcher}: {rank_var}={rank} is not a rank of "
                                      f"{size_var}={size}")
        if not 0 <= local <= rank:
            raise TensorParallelError(f"{launcher}: {local_var}={local} is not a local rank "
                                      f"of rank {rank}")
        return RankInfo(rank, size, local, launcher)
    return RankInfo(0, 1, 0, "single")


def launch_hint(n: int, argv: list[str] | None = None,
                orig_argv: list[str] | None = None) -> str:
    """How to start the command this process runs as `n` ranks, with mpiexec and with
    torchrun: the `metrale` command as typed, `python -m MODULE ...`, or `python SCRIPT ...`
    (YOUR_SCRIPT.py from an interactive session or `python -c`)."""
    argv = list(sys.argv if argv is None else argv)
    orig = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    python = orig[0] if orig else "python"
    prog, args = (argv[0], argv[1:]) if argv else ("", [])
    if os.path.basename(prog) == "metrale":          # the console script
        mpi, torch = ["metrale"], ["--no-python", "metrale"]
    elif len(orig) > len(argv) and orig[len(orig) - len(argv) - 1] == "-m":
        module = orig[len(orig) - len(argv)]         # python [options] -m MODULE args
        mpi, torch = [python, "-m", module], ["-m", module]
    elif prog in ("", "-c"):
        mpi, torch, args = [python, "YOUR_SCRIPT.py"], ["YOUR_SCRIPT.py"], []
    else:
        mpi, torch = [python, prog], [prog]
    return (f"mpiexec -n {n} {shlex.join(mpi + args)} or torchrun --nproc-per-node {n} "
            f"{shlex.join(torch + args)}")


def _int(env, name: str, launcher: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise TensorParallelError(f"{launcher}: environment variable {name}={env[name]!r} is "
                                  "not an integer") from None
