"""MXFP4 experts of gpt-oss (`quantization_config.quant_method: "mxfp4"`, as released), read
field by field (fields.py QUANT_MXFP4).

Layout (transformers' integrations/mxfp4.py, `convert_moe_packed_tensors`): per expert
projection, `<name>_blocks` uint8 [E, N, K / 32, 16] and `<name>_scales` uint8 [E, N, K / 32]
with N the output features (gate_up: 2 * intermediate_size, its gate and up rows interleaved
as in the BF16 form; down: hidden_size) and K the inputs. Byte j of a block holds values
2j (low nibble) and 2j + 1 (high nibble) of its 32, each an e2m1 code (sign, 2 exponent
bits, 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}); a scale byte s means 2^(s - 127)
(e8m0) for its block's 32 values. Every value is code * 2^(s - 127): at most 3 significant
bits times a power of two, exact in BF16 (ops/mxfp4.py; the e8m0 range beyond BF16's
exponent refused at load). Only the experts are quantized (the router, attention,
embeddings and head are BF16): a `modules_to_not_convert` naming an experts module is
refused.
"""
from __future__ import annotations

import re

from ...errors import FormatError, Unsupported
from .fields import QUANT_MXFP4

_EXPERTS = re.compile(r"^(model\.)?layers\.(\d+|\*)\.mlp\.experts$")


def gpt_oss_mxfp4(config: dict, source: str) -> bool:
    """Whether a gpt_oss config.json stores MXFP4 experts (its quantization_config); other
    methods and unknown keys refused by name."""
    q = config.get("quantization_config")
    if q is None:
        return False
    where = f"{source} (quantization_config)"
    if not isinstance(q, dict):
        raise FormatError(f"{where}: must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "mxfp4":
        raise Unsupported(f"{where}: quant_method {method!r} is not supported for gpt_oss "
                          "(supported: mxfp4, as released; BF16 checkpoints have none)")
    for key in q:
        if key not in QUANT_MXFP4:
            raise Unsupported(f"{where}: key {key!r} is not supported (supported: "
                              f"{', '.join(QUANT_MXFP4)})")
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise FormatError(f"{where}: modules_to_not_convert must be a list of names, got "
                          f"{skip!r}")
    for m in skip:
        if _EXPERTS.match(m.rstrip(".")):
            raise Unsupported(f"{where}: modules_to_not_convert {m!r} keeps experts in BF16 "
                              "beside MXFP4 ones; metrale loads either form whole")
    if q.get("dequantize") not in (None, True, False):
        raise FormatError(f"{where}: dequantize must be true or false, got "
                          f"{q['dequantize']!r}")
    return True

