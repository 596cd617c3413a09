"""The twin table: numpy implementations of kernels, keyed by `(module, function)`.

The device layer owns the table and the kernel layer fills it: `metrale.ops`' `@twin`
decorator registers each family's twins when its module is imported (importing any module
of `metrale.ops` imports them all, see `metrale/ops/__init__.py`), so `HostBackend` finds
every twin without importing the layer above it. A twin takes a `LaunchContext` followed by
exactly the arguments of the CUDA entry point, in order. `("cublas", "gemm_bf16")` is the
twin of `GpuBackend.gemm_bf16`, the one operation with no `.cu` source; it takes
`(backend, m, n, k, x_ptr, w_ptr, y_ptr)`.
"""
from __future__ import annotations

from typing import Callable

_TWINS: dict[tuple[str, str], Callable] = {}


def register(module: str, function: str, fn: Callable) -> None:
    """Register the twin of `kernels/<module>.cu::<function>` (twice is an error)."""
    key = (module, function)
    if key in _TWINS and _TWINS[key] is not fn:
        raise RuntimeError(f"twin {module}.{function} registered twice")
    _TWINS[key] = fn


def lookup(module: str, function: str) -> Callable | None:
    return _TWINS.get((module, function))


def modules() -> set[str]:
    return {m for m, _ in _TWINS}


def all_twins() -> dict[tuple[str, str], Callable]:
    return dict(_TWINS)
