"""Quantized checkpoints as files: their tensors checked against the config before any
upload, and the BF16 checkpoint a quantized one stands for."""
from __future__ import annotations

import re

from ...errors import FormatError
from ..hybrid_layout import skipped
from ..metadata import ModelMetadata
from .layout import QUANT_SUFFIXES, dequant_bits, linear_shapes, quantized_layout
from ..source import HARMLESS_UNUSED, check_tensors


def check_quantized(source, meta) -> dict[str, tuple[int, ...]]:
    """Check a quantized checkpoint's tensors against its config; returns the float tensors
    (name -> shape) the model uploads as BF16. FormatError naming file, tensor and field."""
    qc = meta.quantization
    names = set(source.tensor_names())
    files = getattr(source, "weights_description", source.description)
    file_of = getattr(source, "tensor_file", lambda name: files)
    floats, specs, converted = quantized_layout(meta, names)
    field = ("modules_to_not_convert" if qc.method in ("fp8", "awq") else "ignore"
             if qc.method == "compressed-tensors" else "modules_in_block_to_quantize")
    for module in linear_shapes(meta, names):
        if module in converted:
            continue
        odd = [f"{module}.{s}" for s in QUANT_SUFFIXES if f"{module}.{s}" in names]
        w = f"{module}.weight"
        if w in names and source.tensor_dtype(w) not in ("BF16", "F16", "F32", "F64"):
            odd.append(w)
        if odd:
            raise FormatError(f"{file_of(odd[0])}: tensor {odd[0]} is quantized, but "
                              f"quantization_config.{field} leaves {module} unquantized")
    for module, (n, k) in converted.items():
        qc.check_shape(module, n, k, f"{qc.source} (tensors in {files})")
    for name, (shape, dtypes, required) in specs.items():
        if name not in names:
            if required:
                raise FormatError(f"{files}: missing tensor {name!r} (expected shape "
                                  f"{list(shape)} {'/'.join(dtypes)}, {qc.method} quantized)")
            continue
        got = tuple(source.tensor_shape(name))
        ok = got == tuple(shape) or (shape == (1,) and got == ())
        if not ok:
            raise FormatError(f"{file_of(name)}: tensor {name!r} has shape {list(got)} but "
                              f"the quantization_config implies {list(shape)}")
        if source.tensor_dtype(name) not in dtypes:
            raise FormatError(f"{file_of(name)}: tensor {name!r} has dtype "
                              f"{source.tensor_dtype(name)}; expected {'/'.join(dtypes)}")
    check_tensors(source, floats, complete=False)
    unloaded = tuple(getattr(source, "unloaded_prefixes", ()))   # DeepSeek-V3's MTP layers
    unused = sorted(n for n in names - set(floats) - set(specs)
                    if not any(p.fullmatch(n) for p in HARMLESS_UNUSED)
                    and not n.startswith(unloaded)
                    and not (meta.hybrid is not None and skipped(n)))   # MTP, vision
    if unused:
        hint = (" (static activation scales are not supported)"
                if any(re.search(r"(input|activation)_scale$", n) for n in unused) else "")
        raise FormatError(f"{files}: {len(unused)} tensor(s) that no part of the model uses: "
                          f"{', '.join(unused[:8])}{hint}")
    return floats


class DequantizedSource:
    """A quantized checkpoint seen as the BF16 checkpoint it stands for: the same config
    without its quantization_config, each quantized linear's `weight` the BF16 bits of its
    dequantization (ops.gemm_q's formula, the values the dequantizing GEMM multiplies by).
    The reference the quantized model is compared with bit for bit, and the same model in
    BF16 for speed comparisons."""

    def __init__(self, source) -> None:
        self.inner = source
        self.description = f"{source.description} (dequantized to BF16)"
        cfg = source.config()
        self._qmeta = source.metadata()
        cfg.pop("quantization_config", None)
        self._config = cfg
        self._meta = ModelMetadata.from_config(cfg, source.generation_config(),
                                               source=self.description)
        _, specs, self._converted = quantized_layout(self._qmeta, source.tensor_names())
        self._hidden = set(specs)

    def config(self) -> dict:
        return dict(self._config)

    def generation_config(self):
        return self.inner.generation_config()

    def metadata(self):
        return self._meta

    def tensor_names(self) -> list[str]:
        names = [n for n in self.inner.tensor_names() if n not in self._hidden]
        return names + [f"{m}.weight" for m in self._converted]

    def _module(self, name: str):
        m = name[:-len(".weight")] if name.endswith(".weight") else None
        return m if m in self._converted else None

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        m = self._module(name)
        return self._converted[m] if m else self.inner.tensor_shape(name)

    def tensor_dtype(self, name: str) -> str:
        return "BF16" if self._module(name) else self.inner.tensor_dtype(name)

    def read_bf16(self, name: str):
        m = self._module(name)
        if m is None:
            return self.inner.read_bf16(name)
        n, k = self._converted[m]
        return dequant_bits(self._qmeta.quantization.read(self.inner, m, n, k))

    def tokenizer_path(self):
        return self.inner.tokenizer_path()

    @property
    def unloaded_prefixes(self) -> tuple[str, ...]:
        """The inner source's parts no load reads (DeepSeek-V3's MTP layers)."""
        return tuple(getattr(self.inner, "unloaded_prefixes", ()))
