"""Rules the quantized formats share: every quantization_config key honoured, refused or
irrelevant by the field table, the module-name rules of transformers and compressed-tensors
for modules left unquantized, and the scale checks made before any upload."""
from __future__ import annotations

import re

import numpy as np

from ...errors import FormatError, Unsupported
from ..field_table import FIELD_TABLE, REFUSED

# Every FP8 product e4m3 * s must be a normal float32 (or zero): FTZ on the GPU
# (--use_fast_math) and in the CPU twin would flush a subnormal one (kernels/gemm_q.cu).
FP8_MIN_SCALE = 2.0**-117


def check_fields(q: dict, scope: str, source: str) -> None:
    """Every key of a quantization_config (or a nested part of one) must be in the field
    table's `scope`; REFUSED ones raise Unsupported when they hold a value that matters
    (anything but null / false / an empty container)."""
    table = FIELD_TABLE[scope]
    for key, value in q.items():
        f = table.get(key)
        if f is None:
            raise Unsupported(f"{source}: {scope.replace('.', ' ', 1)} field {key!r} is not "
                              "known to metrale (a quantization setting it would ignore); "
                              f"known: {', '.join(sorted(table))}")
        if f.status == REFUSED and value not in (None, False, [], {}, ""):
            raise Unsupported(f"{source}: {scope.split('.')[0]}.{key} = {value!r} is not "
                              f"supported ({f.why})")


def pattern_list(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise FormatError(f"{where}: a list of module names was expected, got {value!r}")
    return tuple(value)


def hf_converts(module: str, skip: tuple[str, ...]) -> bool:
    """transformers' should_convert_module: a pattern skips `module` when it matches from the
    start up to a module boundary (also as a regex) or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for key in skip:
        try:
            if re.match(rf"(?:{key}){boundary}", module):
                return False
        except re.error:
            pass   # a name that is not a valid regex still matches as a suffix
        if module.endswith(key):
            return False
    return True


def ct_matches(module: str, target: str) -> bool:
    """compressed-tensors' match_name: "re:<regex>" by re.match, else the exact name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def check_scales(s: np.ndarray, file: str, tensor: str, field: str, fp8: bool = False) -> None:
    """Scales must be finite and nonzero (FP8 ones also at least 2^-117 in magnitude, so
    that every dequantized value is a normal float32)."""
    stored = np.asarray(s)
    s = stored.astype(np.float64)
    bad = ~np.isfinite(s) | (s == 0)
    if fp8:
        bad |= np.abs(s) < FP8_MIN_SCALE
    if bad.any():
        i = tuple(int(x) for x in np.unravel_index(int(np.argmax(bad)), s.shape)) \
            if s.ndim else ()
        # str() of the stored scalar: its shortest digits (1e-38, not 9.99999991e-38)
        raise FormatError(f"{file}: tensor {tensor} ({field}) holds {str(stored[i])} at "
                          f"{list(i)}: "
                          "scales must be finite and nonzero"
                          + (" with |s| >= 2^-117" if fp8 else ""))
