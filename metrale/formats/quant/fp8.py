"""FP8 checkpoints: transformers' fine-grained FP8 (`quant_method: "fp8"`, DeepSeek-V3 /
Qwen3-FP8 style) and compressed-tensors float-quantized FP8 (`quant_method:
"compressed-tensors"`, llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK schemes), read and
repacked into the layout of kernels/gemm_q.cu.

Layouts, as the reference implementations read them (read, not copied: transformers 5.25
integrations/finegrained_fp8.py `FP8Linear.__init__` and `Fp8Dequantize._dequantize_one`,
utils/quantization_config.py `FineGrainedFP8Config`; compressed-tensors
quantization/lifecycle/forward.py `dequantize` / `_dequantize`, quant_args.py,
quant_config.py, compressors/quantized_compressors/naive_quantized.py, utils/match.py
`match_name`):

Fine-grained, for a Linear of in_features k, out_features n, weight_block_size [bn, bk]:
  M.weight            float8_e4m3fn [n, k]
  M.weight_scale_inv  float32, bfloat16 or float16 (releases store all three) [ceil(n / bn),
                      ceil(k / bk)] (a scalar when weight_block_size is null: one scale per
                      tensor); a BF16 / FP16 scale widens exactly to float32
  w[j, i] = bf16(f32(e4m3(weight[j, i]) * weight_scale_inv[j / bn, i / bk])): despite its
  name the scale multiplies (HF's dequantization: both to float32, multiply, to BF16).
  Modules left in BF16: modules_to_not_convert (alias ignored_layers) with transformers'
  should_convert_module rule; when it is null, transformers' default skip list (the output
  head). activation_scheme "dynamic" quantizes activations per 128-group in HF's FP8
  matmul; here activations stay BF16 (weight-only, as HF's dequantize path and vLLM's
  Marlin FP8 on GPUs without FP8 tensor cores); "static" (activation scales) is refused.
compressed-tensors, format "float-quantized" (or "naive-quantized"), status "compressed",
one scheme for the "Linear" targets with weights {num_bits 8, type float, symmetric}:
  M.weight        float8_e4m3fn [n, k]
  M.weight_scale  float32 or bfloat16: strategy "tensor" [1] (or a scalar), "channel"
                  [n, 1], "block" [ceil(n / bh), ceil(k / bw)] for block_structure [bh, bw]
  w = e4m3(weight) * weight_scale in the scale's dtype (compressed-tensors' _dequantize:
  x_q.to(scale.dtype) * scale), to BF16. A BF16 scale's product is exact in FP32, so FP32
  then BF16 rounding is that one rounding; an FP16 scale would round in FP16 first and is
  refused. `ignore` names (exact, or "re:" + a regex matched from the start) stay BF16.
  Dynamic input activations are left BF16 (as above); static ones (input_scale), output
  activations, a KV-cache scheme, weight padding (weight_shape_original), sparsity and
  transforms are refused.

Device layout (ops/gemm_q.py `gemm_fp8`): q uint8 [n, ceil(k / 32) * 32] (zero padded),
scales float32 [scale rows, k_blocks], scale_row int32 [n], block_k.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import FormatError, Unsupported
from ...ops.bf16 import bf16_to_f32
from ...ops.gemm_q import fp8_row_bytes
from . import rules


@dataclass
class HostFp8:
    """An FP8 linear in the device layout (host arrays; see the module doc)."""
    q: np.ndarray          # uint8 [n, ceil(k / 32) * 32]
    scales: np.ndarray     # float32 [rows, k_blocks]
    scale_row: np.ndarray  # int32 [n]
    k: int
    block_k: int

    @property
    def n(self) -> int:
        return len(self.q)


def concat_fp8(parts: list[HostFp8]) -> HostFp8:
    """Parts stacked along n, each keeping its own grid of scale rows."""
    if len(parts) == 1:
        return parts[0]
    offs = np.cumsum([0] + [len(p.scales) for p in parts[:-1]])
    return HostFp8(np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]),
                   np.concatenate([p.scale_row + o for p, o in zip(parts, offs)]).astype(np.int32),
                   parts[0].k, parts[0].block_k)


@dataclass(frozen=True)
class Fp8Config:
    """A fine-grained or compressed-tensors FP8 quantization_config."""
    method: str                        # "fp8" | "compressed-tensors"
    strategy: str                      # "block" | "tensor" | "channel"
    block: tuple[int, int] | None      # (rows, cols) of a scale block
    skip: tuple[str, ...] | None       # fp8: modules_to_not_convert (None: HF's defaults)
    ignore: tuple[str, ...]            # compressed-tensors: ignore
    source: str

    kind = "fp8"

    def converts(self, module: str) -> bool:
        if self.method == "compressed-tensors":
            return not any(rules.ct_matches(module, t) for t in self.ignore)
        if self.skip is None:          # transformers' default skip list: the output head
            return module != "lm_head"
        return rules.hf_converts(module, self.skip)

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.method == "fp8" else "weight_scale"

    def describe(self) -> str:
        if self.strategy == "block":
            how = f"block-scaled {self.block[0]}x{self.block[1]}"
        else:
            how = f"per-{self.strategy} scales"
        return f"FP8 e4m3 ({self.method}), {how}; activations BF16 (weight-only)"

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        if self.strategy == "block":
            return (-(-n // self.block[0]), -(-k // self.block[1]))
        return (n, 1) if self.strategy == "channel" else (1,)

    def tensor_specs(self, module: str, n: int, k: int) -> dict[str, tuple]:
        # fine-grained: F32, BF16 or F16, each widened exactly (e4m3 x a scale of <= 11
        # significant bits is exact in FP32, so the one rounding is still the BF16 one);
        # compressed-tensors multiplies in the scale's dtype, exact for BF16 only
        dts = ("F32", "BF16", "F16") if self.method == "fp8" else ("F32", "BF16")
        return {f"{module}.weight": ((n, k), ("F8_E4M3",), True),
                f"{module}.{self.scale_name}": (self.scale_shape(n, k), dts, True)}

    def check_shape(self, module: str, n: int, k: int, where: str) -> None:
        if self.strategy == "block" and self.block[1] % 8:
            raise Unsupported(f"{where}: a scale block {self.block[1]} inputs wide is not "
                              "supported (a multiple of 8 is)")

    def read(self, source, module: str, n: int, k: int) -> HostFp8:
        file_of = getattr(source, "tensor_file", lambda _: source.description)
        sname = f"{module}.{self.scale_name}"
        s = np.asarray(source.read_raw(sname))
        if source.tensor_dtype(sname) == "BF16":
            s = bf16_to_f32(s.view(np.uint16))
        elif source.tensor_dtype(sname) == "F16":
            s = s.view(np.float16).astype(np.float32)   # exact
        s = np.ascontiguousarray(s, np.float32).reshape(self.scale_shape(n, k))
        if self.strategy == "tensor":
            s = s.reshape(1, 1)
        rules.check_scales(s, file_of(sname), sname, f"quantization_config {self.scale_name}",
                           fp8=True)
        q = np.zeros((n, fp8_row_bytes(k)), np.uint8)
        q[:, :k] = np.asarray(source.read_raw(f"{module}.weight")).view(np.uint8)
        if self.strategy == "block":
            rows, block_k = np.arange(n) // self.block[0], self.block[1]
        elif self.strategy == "channel":
            rows, block_k = np.arange(n), fp8_row_bytes(k)
        else:
            rows, block_k = np.zeros(n, np.int64), fp8_row_bytes(k)
        return HostFp8(q, s, rows.astype(np.int32), k, block_k)


# --------------------------------------------------------------------------- configs
def parse_fine_grained(q: dict, source: str) -> Fp8Config:
    rules.check_fields(q, "quantization_config.fp8", source)
    where = f"{source}: quantization_config"
    scheme = str(q.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise Unsupported(f"{where}.activation_scheme = {scheme!r} is not supported (static "
                          "activation scales; supported: dynamic, run weight-only)")
    if q.get("fmt", "e4m3") != "e4m3" or q.get("scale_fmt", "float") != "float":
        raise Unsupported(f"{where}: fmt {q.get('fmt')!r} / scale_fmt {q.get('scale_fmt')!r} "
                          "are not supported (supported: e4m3 weights, float scales)")
    if q.get("expert_dtype", "fp8") != "fp8":
        raise Unsupported(f"{where}.expert_dtype = {q.get('expert_dtype')!r} is not supported")
    block = q.get("weight_block_size", [128, 128])
    if block is not None and not (isinstance(block, list) and len(block) == 2 and
                                  all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                      for b in block)):
        raise FormatError(f"{where}.weight_block_size must be [rows, cols] of positive "
                          f"integers or null, got {block!r}")
    skip = q.get("modules_to_not_convert")
    if skip is None:
        skip = q.get("ignored_layers")
    return Fp8Config("fp8", "block" if block else "tensor", tuple(block) if block else None,
                     None if skip is None else rules.pattern_list(skip, where), (), source)


def parse_compressed(q: dict, source: str) -> Fp8Config:
    scope = "quantization_config.compressed-tensors"
    rules.check_fields(q, scope, source)
    where = f"{source}: quantization_config"
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise Unsupported(f"{where}.format = {fmt!r} is not supported (supported: "
                          "float-quantized FP8; pack-quantized and others are refused)")
    if q.get("quantization_status", "compressed") != "compressed":
        raise Unsupported(f"{where}.quantization_status = {q.get('quantization_status')!r}: "
                          "only compressed checkpoints are read")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise FormatError(f"{where}.config_groups must be a non-empty object")
    weights = None
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise Unsupported(f"{where}.config_groups.{name}: preset scheme names are not "
                              "supported (write the scheme out)")
        rules.check_fields(g, f"{scope}.scheme", f"{source} (config_groups.{name})")
        if g.get("targets") != ["Linear"]:
            raise Unsupported(f"{where}.config_groups.{name}.targets = {g.get('targets')!r}: "
                              "only [\"Linear\"] is supported")
        w = g.get("weights")
        if not isinstance(w, dict):
            raise Unsupported(f"{where}.config_groups.{name}.weights = {w!r}: weight "
                              "quantization is required")
        rules.check_fields(w, f"{scope}.args", f"{source} (config_groups.{name}.weights)")
        if (w.get("num_bits"), w.get("type"), w.get("symmetric", True)) != (8, "float", True):
            raise Unsupported(f"{where}.config_groups.{name}.weights: num_bits "
                              f"{w.get('num_bits')!r}, type {w.get('type')!r}, symmetric "
                              f"{w.get('symmetric')!r} (supported: 8-bit float, symmetric)")
        if w.get("dynamic", False) is not False:
            raise Unsupported(f"{where}.config_groups.{name}.weights.dynamic must be false")
        act = g.get("input_activations")
        if act is not None:
            rules.check_fields(act, f"{scope}.args",
                               f"{source} (config_groups.{name}.input_activations)")
            if act.get("dynamic") is not True:
                raise Unsupported(f"{where}.config_groups.{name}.input_activations: static "
                                  "activation quantization (input_scale) is not supported; "
                                  "dynamic is (activations stay BF16)")
        if weights is not None and w != weights:
            raise Unsupported(f"{where}.config_groups: groups with different weight schemes "
                              "are not supported")
        weights = w
    strategy = weights.get("strategy") or ("tensor" if weights.get("group_size") is None
                                           else None)
    if strategy not in ("tensor", "channel", "block"):
        raise Unsupported(f"{where}: weight strategy {strategy!r} is not supported "
                          "(supported: tensor, channel, block)")
    block = None
    if strategy == "block":
        block = weights.get("block_structure")
        if isinstance(block, str):
            block = [int(x) for x in block.split("x")]
        if not (isinstance(block, list) and len(block) == 2 and all(
                isinstance(b, int) and b > 0 for b in block)):
            raise FormatError(f"{where}: block_structure must be [rows, cols], got {block!r}")
        block = tuple(block)
    return Fp8Config("compressed-tensors", strategy, block, None,
                     rules.pattern_list(q.get("ignore"), f"{where}.ignore"), source)
