"""A built kernel library loaded with ctypes: its entry points, their C signatures and launch
bounds, launches, and the instrumented build's checks and counters (check.h, counters.h)."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import KernelError
from ..types import DevicePtr
from .build import EntryPoint


class Range(ctypes.Structure):
    """Mirror of `emu::Range` (check.h): an allocation a launch's pointers point into."""

    _fields_ = [("base", ctypes.c_ulonglong), ("size", ctypes.c_ulonglong),
                ("writable", ctypes.c_uint), ("pad", ctypes.c_uint)]


COUNTER_FIELDS = (
    "blocks", "gld_requests", "gld_sectors", "gld_bytes", "gld_unique",
    "gst_requests", "gst_sectors", "gst_bytes", "gst_unique",
    "sld_requests", "sld_wavefronts", "sld_ideal", "sst_requests", "sst_wavefronts", "sst_ideal",
    "ldsm_requests", "ldsm_wavefronts", "ldsm_ideal",
    "cp_async", "mma", "barriers", "syncwarps", "warp_ops", "atomics", "gld_ideal", "gst_ideal")


class Counters(ctypes.Structure):
    """Mirror of `emu::Counters` (counters.h)."""

    _fields_ = [(f, ctypes.c_ulonglong) for f in COUNTER_FIELDS]


class PcStat(ctypes.Structure):
    """Mirror of `emu::PcStat` (counters.h): one memory instruction's requests."""

    _fields_ = [("pc", ctypes.c_uint), ("kind", ctypes.c_uint),
                ("requests", ctypes.c_ulonglong), ("units", ctypes.c_ulonglong),
                ("ideal", ctypes.c_ulonglong), ("bytes", ctypes.c_ulonglong)]


class RangeStat(ctypes.Structure):
    """Mirror of `emu::RangeStat` (counters.h): unique bytes and sectors of one range."""

    _fields_ = [("ld_bytes", ctypes.c_ulonglong), ("st_bytes", ctypes.c_ulonglong),
                ("ld_sectors", ctypes.c_ulonglong), ("st_sectors", ctypes.c_ulonglong)]


class LaunchConfig(ctypes.Structure):
    """Mirror of `emu::LaunchConfig` in fiber.h."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_ulonglong), ("order", ctypes.c_int),
                ("seed", ctypes.c_ulonglong), ("block_order", ctypes.c_int),
                ("block_seed", ctypes.c_ulonglong), ("checks", ctypes.c_uint),
                ("sample_blocks", ctypes.c_uint), ("ranges", ctypes.POINTER(Range)),
                ("n_ranges", ctypes.c_int), ("counters", ctypes.POINTER(Counters)),
                ("pc_stats", ctypes.POINTER(PcStat)), ("pc_cap", ctypes.c_int),
                ("n_pc", ctypes.POINTER(ctypes.c_int)),
                ("range_stats", ctypes.POINTER(RangeStat))]


# check.h's CHECK_* flags
CHECK_ALIGN, CHECK_RACE, CHECK_COUNT = 1, 2, 4
PC_KINDS = ("global load", "global store", "shared load", "shared store", "ldmatrix")
_PC_CAP = 1024


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

    def __init__(self, lib: "EmuLibrary", entry: EntryPoint) -> None:
        module, name = lib.module, entry.name
        self.name = f"{module}.{name}"
        self.library = lib
        self.entry = entry
        try:
            self._fn = getattr(lib._lib, f"emu_launch__{name}")
            sig_fn = getattr(lib._lib, f"emu_sig__{name}")
            bounds_fn = getattr(lib._lib, f"emu_bounds__{name}")
        except AttributeError:
            raise KernelError(f"kernel {self.name} is not an entry point of {module}.cu "
                              "(no extern \"C\" __global__ function of that name)") from None
        sig_fn.restype = ctypes.c_char_p
        self.params = parse_signature(sig_fn().decode())
        b = (ctypes.c_int * 2)()
        bounds_fn(b)
        # __launch_bounds__(max_threads, min_blocks); 0 where the kernel declares none
        self.max_threads, self.min_blocks = int(b[0]), int(b[1])
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

    @property
    def where(self) -> str:
        """`file:line` of the kernel's declaration."""
        return f"{self.entry.file}:{self.entry.line}"

    def run(self, packed, grid3, block3, shared_mem: int, order: int, seed: int,
            block_order: int = 0, block_seed: int = 0, checks: int = 0,
            sample_blocks: int = 0, ranges=(), count: bool = False) -> dict | None:
        """Run the launch; raises KernelError with the emulator's diagnostic on a failure.

        `ranges`: `(base, size, writable)` of the allocations the pointers point into (the
        memory the checks and counters see); `count`: return the counters (CHECK_COUNT of
        an instrumented library) as a dict, with "pcs" (per memory instruction, located
        with file:line) and "ranges" (unique bytes per range)."""
        _, argv = packed
        rs = sorted(ranges)
        rarr = (Range * max(len(rs), 1))(*[Range(b, s, int(w), 0) for b, s, w in rs])
        counters, pcs, n_pc = Counters(), (PcStat * _PC_CAP)(), ctypes.c_int(0)
        rstats = (RangeStat * max(len(rs), 1))()
        if count:
            checks |= CHECK_COUNT
        cfg = LaunchConfig((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3),
                           int(shared_mem), int(order), int(seed) & (2**64 - 1),
                           int(block_order), int(block_seed) & (2**64 - 1), int(checks),
                           int(sample_blocks), rarr, len(rs),
                           ctypes.pointer(counters) if checks & CHECK_COUNT else None,
                           pcs, _PC_CAP, ctypes.pointer(n_pc), rstats)
        err = ctypes.create_string_buffer(_ERR_BYTES)
        if self._fn(ctypes.byref(cfg), argv, err, _ERR_BYTES):
            msg = self.library.symbolize(err.value.decode(errors="replace"))
            raise KernelError(f"emulated kernel failed: {msg}")
        if not checks & CHECK_COUNT:
            return None
        out = {f: int(getattr(counters, f)) for f in COUNTER_FIELDS}
        pcl = [pcs[i] for i in range(n_pc.value)]
        where = self.library.locations([p.pc for p in pcl])
        out["pcs"] = [{"where": where.get(p.pc, f"pc 0x{p.pc:x}"), "kind": PC_KINDS[p.kind],
                       "requests": int(p.requests), "units": int(p.units),
                       "ideal": int(p.ideal), "bytes": int(p.bytes)} for p in pcl]
        out["ranges"] = [{"base": b, "size": s, "writable": bool(w),
                          "ld_bytes": int(rstats[i].ld_bytes), "st_bytes": int(rstats[i].st_bytes),
                          "ld_sectors": int(rstats[i].ld_sectors),
                          "st_sectors": int(rstats[i].st_sectors)}
                         for i, (b, s, w) in enumerate(rs)]
        return out


_PC = re.compile(r"@pc:0x([0-9a-f]+)")
_SYM = re.compile(r"@sym:0x([0-9a-f]+)")


class EmuLibrary:
    """A loaded library of one `.cu` file; `kernel(name)` gives its entry points."""

    def __init__(self, path: Path, module: str, entries: list[EntryPoint],
                 flavour: str = "plain") -> None:
        self.path = path
        self.module = module
        self.flavour = flavour
        self.entries = {e.name: e for e in entries}
        self.names = [e.name for e in entries]
        self._lib = ctypes.CDLL(str(path))
        self._kernels: dict[str, EmuKernel] = {}
        self._where: dict[int, str] = {}
        self._symbols: list | None = None

    def kernel(self, name: str) -> EmuKernel:
        k = self._kernels.get(name)
        if k is None:
            if name not in self.entries:
                raise KernelError(f"kernel {self.module}.{name} does not exist: "
                                  f"{self.module}.cu has {', '.join(self.names) or 'none'}")
            k = self._kernels[name] = EmuKernel(self, self.entries[name])
        return k

    def locations(self, pcs) -> dict[int, str]:
        """Code offsets (return addresses of the instrumented build's hooks) -> "file:line",
        the inline chain outward ("common.cuh:89 <- rmsnorm.cu:45"), from the debug info
        with addr2line."""
        pcs = [int(p) for p in pcs]
        todo = sorted(set(pcs) - self._where.keys())
        tool = shutil.which("addr2line")
        if todo and tool:
            proc = subprocess.run([tool, "-e", str(self.path), "-a", "-i", "-C",
                                   *[hex(p - 1) for p in todo]],
                                  capture_output=True, text=True, check=False)
            chains: dict[int, list[str]] = {}
            cur = None
            for line in proc.stdout.splitlines():
                if line.startswith("0x"):
                    cur = int(line, 16) + 1
                    chains[cur] = []
                elif cur is not None and ":" in line:
                    f, _, no = line.rpartition(":")
                    no = no.split()[0]
                    if f != "??" and no != "?":
                        # the compiled unit is the .cu file from its line 1 (build.py)
                        name = re.sub(r"\.emu\.cpp$", ".cu", Path(f).name)
                        chains[cur].append(f"{name}:{no}")
            for p, chain in chains.items():
                if chain:
                    self._where[p] = " <- ".join(chain)
        return {int(p): self._where.get(int(p), f"pc 0x{int(p):x}") for p in pcs}

    def variable(self, offset: int) -> str:
        """A data address (offset into the library) as "`symbol` + n", from the symbol
        table (function-local statics, e.g. `rmsnorm::scratch`, are local symbols)."""
        if self._symbols is None:
            tool = shutil.which("nm")
            out = subprocess.run([tool, "-C", "--defined-only", str(self.path)],
                                 capture_output=True, text=True, check=False).stdout if tool else ""
            syms = []
            for line in out.splitlines():
                parts = line.split(maxsplit=2)
                if len(parts) == 3 and parts[1] in "bBdD":
                    syms.append((int(parts[0], 16), parts[2]))
            self._symbols = sorted(syms)
        best = None
        for addr, name in self._symbols:
            if addr > offset:
                break
            best = (addr, name)
        if best is None:
            return f"+ 0x{offset:x}"
        return f"`{best[1]}` + {offset - best[0]}"

    def symbolize(self, message: str) -> str:
        """A diagnostic with each "@pc:0x..." replaced by its source location and each
        "@sym:0x..." by the variable there."""
        where = self.locations(int(m, 16) for m in _PC.findall(message))
        message = _PC.sub(lambda m: where[int(m.group(1), 16)], message)
        return _SYM.sub(lambda m: self.variable(int(m.group(1), 16)), message)
