"""The `@twin` decorator: registers a family's numpy twins in the device layer's table.

`HostBackend.kernel(module, func)` looks twins up in `metrale.gpu_runtime.twins`; this
module only fills it (the kernel layer imports the device layer, never the reverse).
"""
from __future__ import annotations

from typing import Callable

from ..gpu_runtime import twins as _table


def twin(module: str, function: str):
    """Decorator registering the numpy twin of `kernels/<module>.cu::<function>`."""
    def deco(fn: Callable) -> Callable:
        _table.register(module, function, fn)
        return fn
    return deco


def lookup_twin(module: str, function: str) -> Callable | None:
    return _table.lookup(module, function)


def all_twins() -> dict[tuple[str, str], Callable]:
    return _table.all_twins()
