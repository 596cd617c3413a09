"""Argument checks shared by the public pointer-API methods (before anything launches)."""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr


def int_arg(what: str, name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi], else InvalidArgument naming the argument."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{what}: {name} must be an int, got {type(value).__name__}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidArgument(f"{what}: {name}={v} outside [{lo}, {hi}]")
    return v


def ptr_arg(what: str, name: str, value) -> DevicePtr:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or int(value) <= 0:
        raise InvalidArgument(f"{what}: {name} must be a non-NULL DevicePtr, got {value!r}")
    return DevicePtr(int(value))


def bool_arg(what: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(f"{what}: {name} must be a bool, got {type(value).__name__}")
    return bool(value)


def list_arg(what: str, value) -> list:
    """`value` (any iterable) as a list, else InvalidArgument."""
    try:
        return list(value)
    except TypeError:
        raise InvalidArgument(f"{what}: expected a sequence, got {type(value).__name__}") from None
