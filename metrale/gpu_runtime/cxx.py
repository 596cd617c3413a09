"""The host C++ compiler and the build cache shared by the two things metrale compiles on
the CPU: the EmuBackend's kernel libraries (`emu/build.py`) and the HostBackend's native
helpers (`native.py`, `native_recurrent.py`, `native_lora.py`, built by
`build_host_library`)."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from ..errors import DeviceError, KernelError
from ..progress import say

log = logging.getLogger("metrale")


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


@lru_cache(maxsize=8)
def cpu_identity(flags: tuple) -> str:
    """What `flags` (`-march=native`) select on this CPU: the target options the compiler
    enables with them ("" when it cannot say)."""
    proc = subprocess.run([compiler(), *flags, "-Q", "--help=target"], capture_output=True,
                          text=True, check=False)
    return proc.stdout if proc.returncode == 0 else ""


def build_host_library(sources, flags, stem: str, what: str, headers=()) -> Path:
    """The shared library of the C++ `sources` built with `flags`, from
    `<cache_root()>/host/` when built before. Its name hashes the sources and `headers`, the
    flags, the compiler and what the flags select on this CPU, so a cache shared by
    machines never hands one CPU another's `-march=native` build; a concurrent build of
    the same name is harmless (built in a temporary directory, renamed atomically).
    KernelError naming the sources when the compiler fails."""
    flags = tuple(flags)
    h = hashlib.sha256(b"".join(Path(f).read_bytes() for f in (*sources, *headers)))
    h.update("\0".join(flags).encode())
    h.update(compiler_version().encode())
    h.update(cpu_identity(flags).encode())
    out = cache_root() / "host" / f"{stem}-{h.hexdigest()[:20]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = Path(tmp) / out.name
        proc = run_build([[compiler(), *flags, *map(str, sources), "-o", str(lib)]], what)
        if proc.returncode != 0:
            raise KernelError(f"{', '.join(Path(f).name for f in sources)}: the native build "
                              f"failed:\n{proc.stderr.strip()[-4000:]}")
        os.replace(lib, out)
    return out


def load_host_library(open_library, tune, unavailable: str):
    """`open_library(tune)`, else `open_library(())` when the tuned build fails (a compiler
    without -march=native), else None with `unavailable` (what runs instead) said once in
    the log when this machine cannot build it at all."""
    try:
        try:
            return open_library(tune)
        except KernelError:
            return open_library(())
    except (KernelError, DeviceError, OSError) as e:
        log.info("metrale: %s (%s)", unavailable, str(e).splitlines()[0])
        return None
