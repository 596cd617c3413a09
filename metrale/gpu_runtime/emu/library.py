"""A built kernel library loaded with ctypes: its entry points, their C signatures, launches."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import KernelError
from ..types import DevicePtr


class LaunchConfig(ctypes.Structure):
    """Mirror of `emu::LaunchConfig` in fiber.h."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_ulonglong), ("order", ctypes.c_int),
                ("seed", ctypes.c_ulonglong)]


# C scalar kind (from emu::describe) -> (numpy scalar type launchers must pass, ctypes type)
_SCALARS = {
    "i4": (np.int32, ctypes.c_int32), "u4": (np.uint32, ctypes.c_uint32),
    "i8": (np.int64, ctypes.c_int64), "u8": (np.uint64, ctypes.c_uint64),
    "f4": (np.float32, ctypes.c_float),
}
ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2}
_ERR_BYTES = 1024


@dataclass(frozen=True)
class Param:
    kind: str    # "p" pointer, or a key of _SCALARS, or something launches cannot pass
    align: int   # pointee alignment for pointers
    c_type: str  # as the compiler spells it, for messages


def parse_signature(sig: str) -> list[Param]:
    """`emu_sig__<name>()`'s string ("p2:const __nv_bfloat16*,i4:int,") -> parameters."""
    params = []
    for item in filter(None, sig.split(",")):
        code, _, c_type = item.partition(":")
        if code.startswith("p"):
            params.append(Param("p", int(code[1:]), c_type))
        else:
            params.append(Param(code, 0, c_type))
    return params


class EmuKernel:
    """One entry point of a library: checks a launch's arguments, then runs it."""

    def __init__(self, lib: ctypes.CDLL, module: str, name: str) -> None:
        self.name = f"{module}.{name}"
        try:
            self._fn = getattr(lib, f"emu_launch__{name}")
            sig_fn = getattr(lib, f"emu_sig__{name}")
        except AttributeError:
            raise KernelError(f"kernel {self.name} is not an entry point of {module}.cu "
                              "(no extern \"C\" __global__ function of that name)") from None
        sig_fn.restype = ctypes.c_char_p
        self.params = parse_signature(sig_fn().decode())
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_char_p,
                             ctypes.c_int]

    def pack(self, args, find_allocation) -> tuple:
        """Check every argument against the C parameter; returns what `run` needs.

        `find_allocation(addr)` is the `(base, size)` of the live allocation holding `addr`,
        or None: a pointer argument must be NULL or point into an allocation.
        """
        if len(args) != len(self.params):
            raise KernelError(f"{self.name}: {len(args)} arguments for {len(self.params)} "
                              "parameters")
        values = []
        for i, (a, p) in enumerate(zip(args, self.params)):
            if p.kind == "p":
                if not isinstance(a, DevicePtr):
                    raise KernelError(f"{self.name}: argument {i} ({p.c_type}) must be a "
                                      f"DevicePtr, got {type(a).__name__}")
                addr = int(a)
                if addr:
                    if addr % p.align:
                        raise KernelError(f"{self.name}: argument {i} ({p.c_type}) pointer "
                                          f"{a!r} is not {p.align}-byte aligned")
                    if find_allocation(addr) is None:
                        raise KernelError(f"{self.name}: argument {i} ({p.c_type}) pointer "
                                          f"{a!r} is not inside any live allocation")
                values.append(ctypes.c_uint64(addr))
                continue
            want = _SCALARS.get(p.kind)
            if want is None:
                raise KernelError(f"{self.name}: parameter {i} has C type {p.c_type}, which "
                                  "a launch cannot pass")
            if type(a) is not want[0]:
                raise KernelError(f"{self.name}: argument {i} ({p.c_type}) must be "
                                  f"np.{want[0].__name__}, got {type(a).__name__}")
            values.append(want[1](a.item()))
        argv = (ctypes.c_void_p * max(len(values), 1))(
            *[ctypes.addressof(v) for v in values])
        return values, argv

    def run(self, packed, grid3, block3, shared_mem: int, order: int, seed: int) -> None:
        """Run the launch; raises KernelError with the emulator's diagnostic on a failure."""
        _, argv = packed
        cfg = LaunchConfig((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3),
                           int(shared_mem), int(order), int(seed) & (2**64 - 1))
        err = ctypes.create_string_buffer(_ERR_BYTES)
        if self._fn(ctypes.byref(cfg), argv, err, _ERR_BYTES):
            raise KernelError(f"emulated kernel failed: {err.value.decode(errors='replace')}")


class EmuLibrary:
    """A loaded library of one `.cu` file; `kernel(name)` gives its entry points."""

    def __init__(self, path: Path, module: str, names: list[str]) -> None:
        self.path = path
        self.module = module
        self.names = list(names)
        self._lib = ctypes.CDLL(str(path))
        self._kernels: dict[str, EmuKernel] = {}

    def kernel(self, name: str) -> EmuKernel:
        k = self._kernels.get(name)
        if k is None:
            if name not in self.names:
                raise KernelError(f"kernel {self.module}.{name} does not exist: "
                                  f"{self.module}.cu has {', '.join(self.names) or 'none'}")
            k = self._kernels[name] = EmuKernel(self._lib, self.module, name)
        return k
