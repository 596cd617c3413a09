"""The backend's array types (numpy on CPU, CuPy on CUDA) and copies to and from the host."""
from __future__ import annotations

import numpy as np


def to_numpy(x) -> np.ndarray:
    """Copy any array metrale returns (numpy or CuPy) to a host numpy array."""
    if isinstance(x, np.ndarray):
        return x
    get = getattr(x, "get", None)
    if callable(get):  # cupy.ndarray
        return get()
    return np.asarray(x)


def to_backend(backend, host: np.ndarray):
    """A host array as the backend's array type (a device copy on CUDA)."""
    if backend.name.startswith("cuda"):
        import cupy
        return cupy.asarray(host)
    return host
