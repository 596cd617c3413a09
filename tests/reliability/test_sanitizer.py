"""GPU-only: compute-sanitizer memcheck and racecheck over the tiny preset's prefill,
decode_batch and decode_verify (benchmarks/sanitize_run.py). Clean means 0 errors."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_clean(tool):
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(exe).exists():
        pytest.skip("compute-sanitizer not installed")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([exe, "--tool", tool, "--error-exitcode", "9", sys.executable,
                           str(ROOT / "benchmarks" / "sanitize_run.py")],
                          capture_output=True, text=True, timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert "sanitize workload done" in out, out[-3000:]
    assert proc.returncode == 0 and "ERROR SUMMARY: 0 errors" in out, out[-3000:]
