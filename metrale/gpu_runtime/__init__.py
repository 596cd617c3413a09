"""Layer 1: the device as raw pointers and streams (`GpuBackend`) and its two backends."""
from __future__ import annotations

import ctypes
import logging
import os
import re
import sys

from ..errors import DeviceError, InvalidArgument
from .host import HostBackend, LaunchContext
from .protocol import GpuBackend
from .types import NULL, DevicePtr, KernelHandle

__all__ = ["GpuBackend", "HostBackend", "CudaBackend", "EmuBackend", "DevicePtr", "KernelHandle",
           "NULL", "LaunchContext", "backend", "backend_for", "cuda_available"]

log = logging.getLogger("metrale")


def __getattr__(name):
    if name == "CudaBackend":  # imported lazily: importing CuPy costs ~0.6 s
        from .cuda import CudaBackend
        return CudaBackend
    if name == "EmuBackend":
        from .emu import EmuBackend
        return EmuBackend
    raise AttributeError(name)


def _nvidia_device_nodes() -> list[str]:
    """The driver's device nodes under /dev (a container given one GPU has /dev/nvidiactl and
    that GPU's /dev/nvidiaN)."""
    try:
        names = os.listdir("/dev")
    except OSError:
        return []
    return [n for n in names if n in ("nvidiactl", "dxg") or re.fullmatch(r"nvidia\d+", n)]


def gpu_ruled_out() -> str:
    """Why this machine cannot have a usable CUDA GPU, from cheap facts (no CuPy import, which
    costs over a second of CPU): CUDA_VISIBLE_DEVICES hiding every device, no NVIDIA device
    node (Linux: /dev/nvidiactl, /dev/nvidiaN; WSL: /dev/dxg), or no loadable driver library.
    "" when a GPU may be there and CuPy should be asked."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles", "none"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    if sys.platform.startswith("linux") and not _nvidia_device_nodes():
        return "no NVIDIA device node (/dev/nvidiactl, /dev/nvidiaN or WSL's /dev/dxg)"
    driver = {"win32": "nvcuda.dll", "darwin": ""}.get(sys.platform, "libcuda.so.1")
    if not driver:
        return "CUDA has no driver for macOS"
    try:
        ctypes.CDLL(driver)
    except OSError:
        return f"the NVIDIA driver library ({driver}) is not installed"
    return ""


def cuda_available() -> tuple[bool, str]:
    """Whether CuPy sees a usable GPU, and why not when it does not. The cheap facts of
    `gpu_ruled_out` are asked first, so a machine without a GPU never imports CuPy."""
    why = gpu_ruled_out()
    if why:
        return False, why
    try:
        import cupy
    except Exception as e:
        return False, f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        if not cupy.cuda.is_available():
            return False, "CuPy sees no CUDA device"
        cupy.cuda.Device(0).compute_capability
    except Exception as e:
        return False, f"CUDA device unusable ({type(e).__name__}: {e})"
    return True, ""


def backend(device: str | None = "auto") -> GpuBackend:
    """Pick a backend: "auto" | "cpu" | "emu" | "cuda" | "cuda:N".

    `None` or "auto" honour the `METRALE_DEVICE` environment variable first; "auto" is CUDA
    when CuPy sees a usable GPU, else CPU with one log line saying why. "emu" runs the CUDA
    sources on the CPU (`EmuBackend`, modes from METRALE_EMU_SANITIZE / METRALE_EMU_ORDER).
    """
    if device is None or device == "auto":
        device = os.environ.get("METRALE_DEVICE") or "auto"
    if not isinstance(device, str):
        raise InvalidArgument(f"device must be a string like 'cpu' or 'cuda:0', got {device!r}")
    device = device.strip().lower()
    if device == "cpu":
        return HostBackend()
    if device == "emu":
        from .emu import EmuBackend
        return EmuBackend.from_env()
    if device == "auto":
        ok, why = cuda_available()
        if ok:
            from .cuda import CudaBackend
            return CudaBackend(0)
        log.info("metrale: no usable GPU (%s); running on CPU with HostBackend", why)
        return HostBackend()
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if not m:
        raise InvalidArgument(f"device {device!r}: expected 'auto', 'cpu', 'emu', 'cuda' or 'cuda:N'")
    ok, why = cuda_available()
    if not ok:
        raise DeviceError(f"device {device!r} requested but {why}")
    from .cuda import CudaBackend
    return CudaBackend(int(m.group(1) or 0))


def backend_for(device) -> GpuBackend:
    """The backend a load call runs on: a backend instance as given, a device string
    ("auto" | "cpu" | "emu" | "cuda[:N]") through `backend(device)`."""
    # Tests share one backend to account for every byte; two models can share a device's
    # backend the same way.
    if hasattr(device, "launch") and hasattr(device, "alloc"):
        return device
    return backend(device)
