"""Starting tests/tp/worker.py under mpiexec from a test, and reading what its ranks wrote."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def mpiexec() -> str | None:
    """The mpiexec next to this interpreter (the `mpich` wheel's), else one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def require_mpi() -> str:
    """mpiexec, or a skip (a failure where CI demands MPI: METRALE_REQUIRE_MPI=1)."""
    exe = mpiexec()
    try:
        import mpi4py  # noqa: F401
        ok = exe is not None
        why = "no mpiexec"
    except ImportError:
        ok, why = False, "mpi4py is not installed (pip install 'metrale[mpi]')"
    if not ok:
        if os.environ.get("METRALE_REQUIRE_MPI", "0") not in ("", "0"):
            pytest.fail(f"tensor-parallel tests need MPI here: {why}")
        pytest.skip(why)
    return exe


def run_worker(out: Path, device: str, scenarios: str, *, ranks: int = 2, timeout: float = 600,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """`mpiexec -n ranks python -m tests.tp.worker out device scenarios` from the checkout;
    the completed process (stdout + stderr in .stdout) with its wall time in .wall_s."""
    exe = require_mpi()
    out.mkdir(parents=True, exist_ok=True)
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
             METRALE_TP_TEST_SIZE=str(ranks), **(env or {}))
    t0 = time.monotonic()
    proc = subprocess.run([exe, "-n", str(ranks), sys.executable, "-m", "tests.tp.worker",
                           str(out), device, scenarios], cwd=ROOT, env=e, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.wall_s = time.monotonic() - t0
    return proc


class Results:
    """What each rank of one worker run wrote."""

    def __init__(self, out: Path, ranks: int, proc) -> None:
        self.proc = proc
        self.facts = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
        self.arrays = []
        for r in range(ranks):
            with np.load(out / f"rank{r}.npz") as z:
                self.arrays.append({k: z[k] for k in z.files})

    def check_scenario(self, name: str) -> None:
        for f in self.facts:
            assert name in f["seconds"], f"rank {f['rank']}: scenario {name} did not finish\n" \
                f"{f['errors'].get(name, '')}\n{self.proc.stdout[-3000:]}"
            assert name not in f["errors"], f"rank {f['rank']}: {f['errors'][name]}"

    def same_on_every_rank(self, key: str) -> np.ndarray:
        first = self.arrays[0][key]
        for r, a in enumerate(self.arrays[1:], 1):
            assert np.array_equal(a[key], first), f"{key}: rank {r} differs from rank 0"
        return first
