"""The twin registry: numpy implementations of kernels, keyed by `(module, function)`.

`HostBackend.kernel(module, func)` looks a twin up here. A twin takes a `LaunchContext`
(grid, block and a bounds-checked `view(ptr, count, dtype)`) followed by exactly the
arguments the CUDA entry point takes, in the same order.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

_TWINS: dict[tuple[str, str], Callable] = {}
_loaded = False


def twin(module: str, function: str):
    """Decorator registering the numpy twin of `kernels/<module>.cu::<function>`."""
    def deco(fn: Callable) -> Callable:
        key = (module, function)
        if key in _TWINS and _TWINS[key] is not fn:
            raise RuntimeError(f"twin {module}.{function} registered twice")
        _TWINS[key] = fn
        return fn
    return deco


def _load_all() -> None:
    """Import every module of `metrale.ops` so their @twin decorators run."""
    global _loaded
    if _loaded:
        return
    import metrale.ops as pkg
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name != "registry":
            importlib.import_module(f"metrale.ops.{info.name}")
    _loaded = True


def lookup_twin(module: str, function: str) -> Callable | None:
    _load_all()
    return _TWINS.get((module, function))


def twin_modules() -> set[str]:
    _load_all()
    return {m for m, _ in _TWINS}


def all_twins() -> dict[tuple[str, str], Callable]:
    _load_all()
    return dict(_TWINS)
