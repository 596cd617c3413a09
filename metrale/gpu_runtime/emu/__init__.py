"""The EmuBackend: the real CUDA sources of `kernels/` compiled with g++ and run on the CPU
through a shim that emulates the CUDA execution model (fibers, barriers, warp intrinsics).
See `backend.py` for the backend, `build.py` for the build, `fiber.h` for the model."""
from .backend import EmuBackend

__all__ = ["EmuBackend"]
