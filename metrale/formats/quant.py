"""Quantized decoder checkpoints: `quantization_config` -> a family's config object
(quant_fp8.py: fine-grained and compressed-tensors FP8; quant_int4.py: GPTQ and AWQ 4-bit).

A config object answers `converts(module)`, `tensor_specs(module, n, k)` (name -> (shape,
dtypes, required)), `check_shape`, `read(source, module, n, k)` (the module's tensors
checked and repacked into the device layout) and `describe()`. quant_layout.py derives the
tensors a quantized checkpoint holds; quant_checkpoint.py checks them before any upload
(the value checks of `read` run before the module's bytes are uploaded).
"""
from __future__ import annotations

from ..errors import FormatError, Unsupported
from . import quant_fp8, quant_int4


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
