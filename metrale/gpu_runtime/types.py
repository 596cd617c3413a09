"""Plain handle types of the device layer: pointers, kernel handles, launch arguments."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import KernelError


class DevicePtr(int):
    """A raw device address (a host address on `HostBackend`). `NULL` is 0."""

    NULL: "DevicePtr"

    def __new__(cls, value: int = 0) -> "DevicePtr":
        if int(value) < 0:
            raise KernelError(f"DevicePtr must be >= 0, got {value}")
        return super().__new__(cls, int(value))

    def is_null(self) -> bool:
        return int(self) == 0

    def offset(self, nbytes: int) -> "DevicePtr":
        """The address `nbytes` past this one (NULL stays an error: offsetting NULL is a bug)."""
        if self.is_null():
            raise KernelError("offset() on a NULL DevicePtr")
        return DevicePtr(int(self) + int(nbytes))

    def __repr__(self) -> str:
        return f"DevicePtr(0x{int(self):x})"


DevicePtr.NULL = DevicePtr(0)
NULL = DevicePtr.NULL


@dataclass(frozen=True)
class KernelHandle:
    """A loaded kernel: `(module, function)` names plus the backend's callable."""

    module: str
    function: str
    impl: Callable[..., Any]

    @property
    def name(self) -> str:
        return f"{self.module}.{self.function}"


# Scalar types a kernel argument may have. A bare Python int would be passed by CuPy as
# a 64-bit `long long` (CUPY_NOTES §3), silently misaligning every later argument of a
# kernel that declares `int`, so launches accept only explicitly sized numpy scalars.
_SCALAR_TYPES = (np.int32, np.uint32, np.int64, np.uint64, np.float32)
_MAX_BLOCK = (1024, 1024, 64)
_MAX_GRID = (2**31 - 1, 65535, 65535)


def check_launch_args(kernel: KernelHandle, grid, block, args) -> tuple:
    """Validate a launch before it happens; returns `(grid3, block3)`.

    Pointers must be `DevicePtr`; scalars must be np.int32/np.uint32/np.int64/np.uint64/
    np.float32. Grid and block dimensions must be positive and the block at most 1024.
    """
    grid3 = _dim3(grid, "grid", kernel)
    block3 = _dim3(block, "block", kernel)
    if block3[0] * block3[1] * block3[2] > 1024:
        raise KernelError(f"{kernel.name}: block {block3} has more than 1024 threads")
    # CUDA's limits on every GPU metrale supports; a launch beyond them fails on the device.
    for what, dims, limit in (("block", block3, _MAX_BLOCK), ("grid", grid3, _MAX_GRID)):
        for axis, d, lim in zip("xyz", dims, limit):
            if d > lim:
                raise KernelError(f"{kernel.name}: {what}.{axis} = {d} exceeds CUDA's limit "
                                  f"of {lim}")
    for i, a in enumerate(args):
        if isinstance(a, DevicePtr) or isinstance(a, _SCALAR_TYPES):
            continue
        raise KernelError(
            f"{kernel.name}: argument {i} is {type(a).__name__}; pass DevicePtr for pointers "
            "and np.int32/np.float32 (or another sized numpy scalar) for scalars"
        )
    return grid3, block3


def _dim3(d, what: str, kernel: KernelHandle) -> tuple:
    t = tuple(int(x) for x in (d if isinstance(d, (tuple, list)) else (d,)))
    if not 1 <= len(t) <= 3:
        raise KernelError(f"{kernel.name}: {what} must have 1 to 3 dimensions, got {d!r}")
    t = t + (1,) * (3 - len(t))
    if any(x <= 0 for x in t):
        raise KernelError(f"{kernel.name}: {what} dimensions must be positive, got {d!r}")
    return t
