"""Quantized decoder checkpoints: `quantization_config` -> a family's config object
(quant_fp8.py: fine-grained and compressed-tensors FP8; quant_int4.py: GPTQ and AWQ 4-bit),
which linears it converts, the tensors the checkpoint must then hold, and their checks.

A config object answers `converts(module)`, `tensor_specs(module, n, k)` (name -> (shape,
dtypes, required)), `check_shape`, `read(source, module, n, k)` (the module's tensors
checked and repacked into the device layout) and `describe()`. Every check here runs
before the first byte is uploaded; the value checks of `read` (scales, zero points,
g_idx) before the module's bytes are.
"""
from __future__ import annotations

import re

import numpy as np

from ..errors import FormatError, Unsupported
from . import quant_fp8, quant_int4
from .layout import expected_tensors

# The linear modules of a decoder layer, as HF names them (n, k from the metadata).
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Tensors only a quantized linear has: found on a module the config leaves in BF16, they
# are refused (a quantized module the config does not describe).
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_scale_inv", "weight_scale",
                  "input_scale", "activation_scale", "weight_zero_point",
                  "weight_shape_original")


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


def linear_shapes(meta, names=None) -> dict[str, tuple[int, int]]:
    """HF module name -> (out_features n, in_features k) of every linear the model runs
    (the output head when the checkpoint has one of its own)."""
    h, d = meta.hidden_size, meta.head_dim
    q, kv, inter = meta.num_heads * d, meta.num_kv_heads * d, meta.intermediate_size
    dims = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}
    out = {f"model.layers.{i}.{m}": dims[m] for i in range(meta.num_layers)
           for m in LAYER_LINEARS}
    if "lm_head.weight" in expected_tensors(meta, names):
        out["lm_head"] = (meta.vocab_size, h)
    return out


def quantized_layout(meta, names=None):
    """(float tensors: name -> shape, quantized tensors: name -> (shape, dtypes, required),
    converted modules -> (n, k)) of a quantized checkpoint."""
    qc = meta.quantization
    floats = expected_tensors(meta, names)
    specs, converted = {}, {}
    if meta.tie_word_embeddings and "lm_head.weight" not in floats and qc.converts("lm_head"):
        # the head is the (BF16) input embedding; a config quantizing it describes a
        # checkpoint this one is not
        raise Unsupported(f"{qc.source}: quantization_config quantizes lm_head, which is tied "
                          "to the input embedding (modules_to_not_convert / ignore must list "
                          "it)")
    for module, (n, k) in linear_shapes(meta, names).items():
        if not qc.converts(module):
            continue
        converted[module] = (n, k)
        floats.pop(f"{module}.weight")
        specs.update(qc.tensor_specs(module, n, k))
    return floats, specs, converted


def check_quantized(source, meta) -> dict[str, tuple[int, ...]]:
    """Check a quantized checkpoint's tensors against its config; returns the float tensors
    (name -> shape) the model uploads as BF16. FormatError naming file, tensor and field."""
    from .source import HARMLESS_UNUSED, check_tensors
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
    unused = sorted(n for n in names - set(floats) - set(specs)
                    if not any(p.fullmatch(n) for p in HARMLESS_UNUSED))
    if unused:
        hint = (" (static activation scales are not supported)"
                if any(re.search(r"(input|activation)_scale$", n) for n in unused) else "")
        raise FormatError(f"{files}: {len(unused)} tensor(s) that no part of the model uses: "
                          f"{', '.join(unused[:8])}{hint}")
    return floats


def dequant_bits(host) -> np.ndarray:
    """A repacked quantized linear's BF16 bits [n, k] (ops.gemm_q's formulas)."""
    from ..ops import gemm_q
    if isinstance(host, quant_int4.HostQ4):
        return gemm_q.dequant_q4(host.q, host.scales, host.zeros, host.k, host.group_size,
                                 host.gidx, host.gidx_row)
    return gemm_q.dequant_fp8(host.q, host.scales, host.scale_row, host.k, host.block_k)


def checkpoint_tensors(meta) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor a quantized checkpoint of `meta` holds (the
    first dtype each spec allows; floats BF16): what random quantized presets generate."""
    floats, specs, _ = quantized_layout(meta)
    out = {n: (tuple(s), "BF16") for n, s in floats.items()}
    out.update({n: (tuple(s), dts[0]) for n, (s, dts, req) in specs.items() if req})
    return out


class DequantizedSource:
    """A quantized checkpoint seen as the BF16 checkpoint it stands for: the same config
    without its quantization_config, each quantized linear's `weight` the BF16 bits of its
    dequantization (ops.gemm_q's formula, the values the dequantizing GEMM multiplies by).
    The reference the quantized model is compared with bit for bit, and the same model in
    BF16 for speed comparisons."""

    def __init__(self, source) -> None:
        from .metadata import ModelMetadata
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
