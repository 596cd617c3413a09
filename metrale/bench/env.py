"""Facts about the machine a benchmark ran on: device, GPU name, driver, CuPy and CUDA.

Every benchmark JSON of the project (`metrale bench`, `benchmarks/*.py`) starts with these
keys; GPU-only facts are None on the host backend.
"""
from __future__ import annotations

import platform
import shutil
import subprocess
import sys

from ..gpu_runtime.native import usable_cpus


def _cupy_version() -> str | None:
    """CuPy's version from its installed distribution's metadata (no import: importing CuPy
    costs over a second, which a CPU benchmark should not pay for a version string)."""
    import importlib.metadata as md
    for dist in md.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name == "cupy" or name.startswith("cupy-cuda") or name.startswith("cupy-rocm"):
            return str(dist.version)
    return None


def recorded_path(path, root=None) -> str:
    """`path` as a benchmark JSON records it, without the machine's own directories:
    relative to `root` (default: the current directory, the repository when a benchmark
    runs from it) when under it, "<metrale cache>/..." under metrale's cache directory,
    "python" for this interpreter; else the file name alone."""
    from pathlib import Path

    from ..gpu_runtime.cxx import cache_root
    p = Path(path).absolute()
    if str(path) == sys.executable or p == Path(sys.executable).absolute():
        return "python"
    for base, prefix in ((Path(root or ".").absolute(), ""),
                         (cache_root().absolute(), "<metrale cache>/")):
        try:
            return prefix + p.relative_to(base).as_posix()
        except ValueError:
            continue
    return p.name


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def nvidia_driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi, or the CUDA driver API version from CuPy
    when nvidia-smi is missing; None without a GPU."""
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            line = out.stdout.strip().splitlines()
            if out.returncode == 0 and line:
                return line[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        import cupy
        return f"cuda-driver-api {_cuda_version(int(cupy.cuda.runtime.driverGetVersion()))}"
    except Exception:
        return None


def cpu_info() -> dict:
    """{"model", "cpus", "flags"}: the CPU's model name (/proc/cpuinfo, else
    platform.processor()), the CPUs this process may run on, and the vector-unit flags
    that decide the host backend's speed (AVX2, AVX-512, BF16 dot products, AMX)."""
    model, flags = platform.processor() or None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": model, "cpus": usable_cpus(),
            "flags": [f for f in wanted if f in flags]}


def environment(backend) -> dict:
    """{"device", "gpu_name", "driver", "cupy", "cuda", "python", "platform", "cpu"}."""
    env = {"device": getattr(backend, "name", "cpu"), "gpu_name": None, "driver": None,
           "cupy": _cupy_version(), "cuda": None,
           "python": sys.version.split()[0], "platform": platform.platform(),
           "cpu": cpu_info()}
    if env["device"] == "cpu":   # which implementation of the GEMM twin ran (native.py)
        nat = getattr(backend, "native", None)
        env["cpu"]["gemm"] = "numpy" if nat is None else f"native {nat.kind}"
    if env["device"].startswith("cuda"):
        try:
            env["gpu_name"] = backend.device_name()
        except Exception:
            pass
        env["driver"] = nvidia_driver()
        try:
            import cupy
            env["cuda"] = _cuda_version(int(cupy.cuda.runtime.runtimeGetVersion()))
        except Exception:
            pass
    return env


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process in bytes (getrusage); None where the
    `resource` module is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # Linux: KiB
