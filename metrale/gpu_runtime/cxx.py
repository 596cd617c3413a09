"""The host C++ compiler and the build cache shared by the two things metrale compiles on
the CPU: the EmuBackend's kernel libraries (`emu/build.py`) and the HostBackend's native
helpers (`native.py`)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from ..errors import DeviceError
from ..progress import say


@lru_cache(maxsize=1)
def compiler() -> str:
    """The C++ compiler: `$CXX`, else g++. DeviceError when there is none."""
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise DeviceError(f"no C++ compiler: {cxx!r} was not found (install g++ >= 11, or "
                          "set CXX)")
    return path


@lru_cache(maxsize=1)
def compiler_version() -> str:
    return subprocess.run([compiler(), "--version"], capture_output=True, text=True,
                          check=False).stdout.strip()


def cache_root() -> Path:
    """Where built libraries live: $METRALE_CACHE_DIR, else the user cache directory."""
    base = os.environ.get("METRALE_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "metrale"


def run_build(steps, what: str) -> subprocess.CompletedProcess:
    """Run the compiler command lines `steps` in turn (stopping at the first that fails),
    saying that `what` is built before and how long it took after, terminal or not (a first
    run builds for a minute or more on two cores: a silent wait is never a mystery);
    returns the last process run."""
    t0 = time.perf_counter()
    say(f"building {what} (first use on this machine; cached for later runs)")
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            return proc
    say(f"built {what} in {time.perf_counter() - t0:.1f} s")
    return proc
