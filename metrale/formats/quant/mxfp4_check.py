"""The tensors of an MXFP4 gpt-oss checkpoint against its layout (quant/mxfp4.py has the
format), before anything is uploaded."""
from __future__ import annotations

import numpy as np

from ...errors import FormatError
from ...ops.mxfp4 import SCALE_MAX, SCALE_MIN
from ..source import check_tensors


def packed(name: str) -> bool:
    """Whether a checkpoint tensor of a gpt-oss MXFP4 layout is packed (uint8)."""
    return name.endswith(("_blocks", "_scales"))


def check_mxfp4(source, expected: dict[str, tuple[int, ...]]) -> None:
    """Check an MXFP4 gpt-oss checkpoint against its layout (`expected`: layout.py's tensors,
    the experts as `*_blocks` / `*_scales`): the float tensors as every checkpoint's, the
    packed ones U8 of their shapes with every scale in ops/mxfp4.py's exact range, no tensor
    left unread. FormatError naming the file and the tensor."""
    check_tensors(source, {n: s for n, s in expected.items() if not packed(n)}, complete=False)
    files = getattr(source, "weights_description", source.description)
    file_of = getattr(source, "tensor_file", lambda name: files)
    for name in (n for n in expected if packed(n)):
        if name not in set(source.tensor_names()):
            raise FormatError(f"{files}: missing tensor {name!r} (expected shape "
                              f"{list(expected[name])} U8, mxfp4 quantized)")
        got, dt = tuple(source.tensor_shape(name)), source.tensor_dtype(name)
        if got != tuple(expected[name]) or dt != "U8":
            raise FormatError(f"{file_of(name)}: tensor {name!r} is {dt} {list(got)} but the "
                              f"mxfp4 layout needs U8 {list(expected[name])}")
        if name.endswith("_scales"):
            s = source.read_raw(name)
            bad = (s < SCALE_MIN) | (s > SCALE_MAX)
            if bad.any():
                v = int(s[np.unravel_index(int(np.argmax(bad)), s.shape)])
                raise FormatError(f"{file_of(name)}: tensor {name!r} holds the scale byte {v} "
                                  f"(2^{v - 127}): outside [{SCALE_MIN}, {SCALE_MAX}], where "
                                  "every MXFP4 value is an exact normal BF16 number")
    unused = sorted(set(source.tensor_names()) - set(expected))
    if unused:
        raise FormatError(f"{files}: {len(unused)} tensor(s) that no part of the model uses: "
                          f"{', '.join(unused[:8])}")
