"""Every emulated launch checked against its numpy twin: how far the CUDA source and the twin
the HostBackend runs actually are apart, per kernel, on whatever workload the backend runs.

For a launch, the allocations its non-const pointer arguments point into are saved; the twin
runs and its result is kept; the allocations are restored; the kernel runs; then both results
are compared element by element as the pointee type (BF16, FP32, integers). An allocation
only the kernel changes is its scratch space (e.g. split-K partials) and is not compared. Differences are counted in units in the last place: the distance between the two
values' positions in the ordered list of representable numbers (NaN equals NaN).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..host import LaunchContext
from .. import twins

# pointee C type -> (numpy dtype of the raw bits, float kind or None for exact types)
_TYPES = {"__nv_bfloat16": (np.uint16, "bf16"), "float": (np.uint32, "f32"),
          "int": (np.int32, None), "unsigned int": (np.uint32, None)}


@dataclass
class KernelAgreement:
    launches: int = 0
    compared: int = 0          # elements compared
    differing: int = 0
    max_ulps: int = 0
    max_rel_diff: float = 0.0  # max |kernel - twin| / max |twin| over an output
    max_ulps_large: int = 0    # max ulps over elements with |twin| >= max |twin| / 256
    scratch_bytes: int = 0     # written by the kernel only (e.g. split-K partials)
    kinds: set = field(default_factory=set)

    def as_dict(self) -> dict:
        return {"launches": self.launches, "elements": self.compared,
                "differing": self.differing, "max_ulps": self.max_ulps,
                "max_rel_diff": self.max_rel_diff, "max_ulps_large": self.max_ulps_large,
                "bit_exact": self.differing == 0,
                "scratch_bytes": self.scratch_bytes,
                "types": sorted(self.kinds)}


def _ordered(bits: np.ndarray, kind: str) -> np.ndarray:
    """Sign-magnitude float bits -> integers in the order of the values."""
    width = 16 if kind == "bf16" else 32
    b = bits.astype(np.int64)
    sign = 1 << (width - 1)
    return np.where(b & sign, -(b & (sign - 1)), b)


def _values(bits: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.view(np.float32).astype(np.float64)


def _is_nan(bits: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bf16":
        return (bits & 0x7FFF) > 0x7F80
    return (bits & 0x7FFFFFFF) > 0x7F800000


class TwinCheck:
    """Collects `KernelAgreement` per kernel; `EmuBackend(check_twins=True)` drives it."""

    def __init__(self) -> None:
        self.kernels: dict[str, KernelAgreement] = {}

    def launch(self, be, kernel, args, grid3, block3, shared_mem, run_compiled) -> None:
        twin = twins.lookup(kernel.module, kernel.function)
        outs = {}
        for a, p in zip(args, kernel.impl.params):
            if p.kind != "p" or p.c_type.startswith("const") or not int(a):
                continue
            base, size = be.find_allocation(a)
            pointee = p.c_type.rstrip("*").strip()
            outs.setdefault(int(base), (size, _TYPES.get(pointee, (np.uint8, None))))
        before = {b: be.view(b, s, np.uint8).copy() for b, (s, _) in outs.items()}
        if twin is not None:
            be._tracked(twin, LaunchContext(be, grid3, block3, shared_mem), *args)
        after_twin = {b: be.view(b, s, np.uint8).copy() for b, (s, _) in outs.items()}
        for b, (s, _) in outs.items():
            be.view(b, s, np.uint8)[:] = before[b]
        run_compiled()
        rec = self.kernels.setdefault(kernel.name, KernelAgreement())
        rec.launches += 1
        if twin is None:
            return
        for b, (s, (dtype, kind)) in outs.items():
            if (np.array_equal(after_twin[b], before[b])
                    and not np.array_equal(be.view(b, s, np.uint8), before[b])):
                rec.scratch_bytes += s  # only the kernel writes here: its scratch space
                continue
            n = s // np.dtype(dtype).itemsize
            want = after_twin[b][:n * np.dtype(dtype).itemsize].view(dtype)
            got = be.view(b, n, dtype)
            rec.compared += n
            rec.kinds.add(kind or np.dtype(dtype).name)
            if kind is None:
                rec.differing += int(np.count_nonzero(got != want))
                continue
            both_nan = _is_nan(got, kind) & _is_nan(want, kind)
            ulps = np.abs(_ordered(got, kind) - _ordered(want, kind))
            ulps[both_nan] = 0
            rec.differing += int(np.count_nonzero(ulps))
            rec.max_ulps = max(rec.max_ulps, int(ulps.max(initial=0)))
            if np.any(ulps):
                g, w = _values(got, kind), _values(want, kind)
                ok = np.isfinite(g) & np.isfinite(w)
                scale = float(np.max(np.abs(w[ok]), initial=0.0))
                if scale > 0:
                    diff = float(np.max(np.abs(g[ok] - w[ok]), initial=0.0))
                    rec.max_rel_diff = max(rec.max_rel_diff, diff / scale)
                    # near zero the ulp count means little (a sign flip of two tiny values
                    # spans the whole exponent range): also report it away from zero
                    large = ok & (np.abs(w) >= scale / 256)
                    rec.max_ulps_large = max(rec.max_ulps_large,
                                             int(ulps[large].max(initial=0)))

    def report(self) -> dict[str, dict]:
        return {k: v.as_dict() for k, v in sorted(self.kernels.items())}
