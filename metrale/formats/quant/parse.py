"""`parse_quantization`: a checkpoint's `quantization_config` -> its family's config object."""
from __future__ import annotations

from ...errors import FormatError, Unsupported
from . import fp8 as quant_fp8, int4 as quant_int4


def parse_quantization(config: dict, source: str):
    """The checkpoint's quantization config object, or None when it has none."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise FormatError(f"{source}: quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method == "fp8":
        return quant_fp8.parse_fine_grained(q, source)
    if method == "compressed-tensors":
        return quant_fp8.parse_compressed(q, source)
    if method in ("gptq", "awq"):
        return quant_int4.parse(method, q, source)
    raise Unsupported(f"{source}: quantization_config.quant_method = {method!r} is not "
                      "supported (supported: fp8, compressed-tensors (FP8), gptq, awq)")
