"""One thread at a time per model, as in the original engine.

A second thread calling into a model while a call is in flight gets `ConcurrentUse`
instead of corrupting shared workspaces; the same thread may re-enter (prefill calls
prefill_chunk).
"""
from __future__ import annotations

import functools
import inspect
import threading

from ..errors import ConcurrentUse


class CallGuard:
    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self):
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUse("this model is in use by another thread; drive a model from "
                                "one thread at a time (or load a second model)")
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def call(self, name: str, args: dict):
        """The context one public call `name(**args)` runs in: this guard itself (a
        tensor-parallel rank's guard adds its agreement step, agreement.py)."""
        return self


def exclusive(method):
    """Decorator: run `method` under `self._guard`."""
    names = list(inspect.signature(method).parameters)[1:]

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._guard.call(method.__name__, {**dict(zip(names, args)), **kwargs}):
            return method(self, *args, **kwargs)
    return wrapper
