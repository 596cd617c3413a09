"""Twins run with one OpenBLAS thread and the caller's count comes back afterwards (spinning
BLAS workers would take the native GEMM's cores: metrale/gpu_runtime/blas_threads.py)."""
import numpy as np
import pytest

from metrale.gpu_runtime import HostBackend, blas_threads
from metrale.gpu_runtime.types import KernelHandle

BLAS = blas_threads.openblas()
pytestmark = pytest.mark.skipif(BLAS is None, reason="numpy's BLAS is not an OpenBLAS")


def test_limit_holds_one_thread_and_restores_the_count():
    before = BLAS.threads()
    BLAS.set_threads(2)
    try:
        with blas_threads.limit(BLAS):
            assert BLAS.threads() == 1
        assert BLAS.threads() == 2
        with pytest.raises(RuntimeError):
            with blas_threads.limit(BLAS):
                raise RuntimeError("a failing twin")
        assert BLAS.threads() == 2
    finally:
        BLAS.set_threads(before)


def test_a_twin_runs_with_one_blas_thread():
    be = HostBackend()
    seen = []
    before = BLAS.threads()
    BLAS.set_threads(2)
    try:
        kernel = KernelHandle("test", "probe", lambda ctx: seen.append(BLAS.threads()))
        be.launch(kernel, (1, 1, 1), (1, 1, 1), 0, 0, ())
        assert seen == [1] and BLAS.threads() == 2
        assert np.ones((64, 64)) @ np.ones(64) is not None   # BLAS still works after
    finally:
        BLAS.set_threads(before)
