"""The whisper_tiny fixture: loading it and reading its golden HF outputs."""
from __future__ import annotations

from pathlib import Path

import numpy as np

import metrale
from metrale.gpu_runtime import HostBackend

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "whisper_tiny"


def golden() -> dict:
    with np.load(FIXTURE / "golden.npz") as g:
        return {k: g[k] for k in g.files}


def load(backend=None, **options):
    return metrale.load(FIXTURE, backend or HostBackend(), progress=False, **options)


def rel_err(a, e) -> float:
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    return float(np.max(np.abs(a - e)) / np.max(np.abs(e)))
