"""`device_array`: a zero-copy array over any device range, for handing logits rows or
hidden states to other libraries (`torch.from_dlpack`, `np.from_dlpack`, CuPy, JAX).

Additive: the original engine has no such call. The range is bounds-checked against the
allocation that contains it (`backend.find_allocation`), like the logits methods.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from .types import DevicePtr


def check_device_range(backend, ptr, nbytes: int, what: str, align: int = 1) -> None:
    """`nbytes` at `ptr` must lie inside one live allocation of `backend` and be
    `align`-byte aligned; InvalidArgument naming `what` otherwise."""
    found = backend.find_allocation(ptr)
    if found is None:
        raise InvalidArgument(f"{what}: {ptr!r} is not inside any live device allocation")
    base, size = found
    if int(ptr) + nbytes > int(base) + size:
        raise InvalidArgument(f"{what}: {nbytes} bytes at {ptr!r} run past the end of its "
                              f"allocation ({size} bytes at {base!r})")
    if int(ptr) % align:
        raise InvalidArgument(f"{what}: {ptr!r} is not {align}-byte aligned")


def _dtype(dtype) -> np.dtype:
    """np.dtype(dtype), where a name numpy does not know ("bfloat16", "float8_e4m3fn", ...)
    is looked up in ml_dtypes, imported then (it is imported lazily, so numpy may not have
    seen its names yet)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        if not isinstance(dtype, str):
            raise
        import ml_dtypes
        found = getattr(ml_dtypes, dtype.strip(), None)
        if found is None:
            raise
        return np.dtype(found)


def device_array(ptr, shape, dtype, device):
    """An array of `shape` and `dtype` viewing device memory at `ptr`, without a copy.

    device: the model (or backend) that owns the memory — on the host the allocation
    table lives in its backend, so the owner must be named. Returns a numpy array on the
    host backends and a CuPy array (over `UnownedMemory`) on CUDA; both support
    `__dlpack__`, the CuPy one also `__cuda_array_interface__`. The array is valid while
    the memory is: a logits row until the next forward pass on that model.
    """
    backend = getattr(device, "backend", device)
    if not hasattr(backend, "find_allocation"):
        raise InvalidArgument(f"device_array: device must be a metrale model or backend, got "
                              f"{type(device).__name__}")
    if isinstance(ptr, (bool, np.bool_)) or not isinstance(ptr, (int, np.integer)) or ptr <= 0:
        raise InvalidArgument(f"device_array: ptr must be a non-NULL DevicePtr, got {ptr!r}")
    ptr = DevicePtr(int(ptr))
    try:
        dtype = _dtype(dtype)
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    except TypeError:
        raise InvalidArgument(f"device_array: bad shape {shape!r} or dtype {dtype!r}") from None
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"device_array: shape {shape} has a negative dimension")
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    check_device_range(backend, ptr, nbytes, "device_array", dtype.itemsize)
    if backend.name.startswith("cuda"):
        cp = backend.cp
        mem = cp.cuda.UnownedMemory(int(ptr), nbytes, backend, backend.device_id)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))
    # host memory: a view of the allocation's own buffer, which it keeps alive
    return backend.view(ptr, count, dtype).reshape(shape)
