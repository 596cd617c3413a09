"""4-bit checkpoints: GPTQ (`quant_method: "gptq"`) and AWQ GEMM (`quant_method: "awq"`,
`version: "gemm"`), read and repacked into the layout of kernels/gemm_q.cu.

Packing, as the reference implementations write and read it (read, not copied: AutoGPTQ
auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py `pack` / `forward`; GPTQModel
gptqmodel/utils/model.py `convert_gptq_v1_to_v2_format_module`; AutoAWQ
awq/modules/linear/gemm.py `WQLinear_GEMM.from_linear` and awq/utils/packing_utils.py
`unpack_awq` / `reverse_awq_order` / `dequantize_gemm`; transformers 5.25's GPTQConfig /
AwqConfig for the config fields):

GPTQ, for a Linear of in_features k, out_features n, group size g (`group_size`, -1: k):
  M.qweight  int32 [k / 8, n]: word (r, j) holds the codes of inputs 8r .. 8r + 7 of output
             j, input 8r + e in bits 4e .. 4e + 3 (little end first).
  M.qzeros   int32 [ceil(k / g), n / 8]: word (G, c) holds the zero points of outputs
             8c .. 8c + 7 in group G, output 8c + e in bits 4e .. 4e + 3.
  M.scales   float16 [ceil(k / g), n].
  M.g_idx    int32 [k]: the group of each input (k // g unless act-order, desc_act).
  w[j, i] = scales[G, j] * (q[i, j] - z[G, j]), G = g_idx[i], where the stored zero
  point is z - 1 when `checkpoint_format` is "gptq" (v1: AutoGPTQ's pack does
  `zeros -= 1` before packing and its forward adds 1 back; GPTQModel converts v1 to v2 by
  adding 0x11111111 to each word) and z itself for "gptq_v2". A v1 nibble of 15 stands for
  a zero point of 16 (AutoGPTQ) or carries into the next nibble (GPTQModel): the two
  disagree, so it is refused. Symmetric GPTQ stores z = 8 (v1: 7) everywhere.
AWQ GEMM (zero points always present; AutoAWQ cannot pack GEMM weights without them):
  M.qweight  int32 [k, n / 8]: word (i, c) holds the codes of outputs 8c .. 8c + 7 for
             input i in AWQ's interleaved order: bits 4e .. 4e + 3 hold output
             8c + [0, 2, 4, 6, 1, 3, 5, 7][e].
  M.qzeros   int32 [k / g, n / 8], the same interleave; M.scales float16 [k / g, n].
  w[j, i] = (q[i, j] - z[i / g, j]) * scales[i / g, j].
The references dequantize in float16; here (q - z) * s is exact in FP32 and rounded once to
BF16 (ops/gemm_q.py), what the fixtures' golden (HF fp32 on the dequantized weights) uses.

Device layout (ops/gemm_q.py `gemm_q4`): q uint32 [n, ceil(k / 32) * 4] (row j: inputs
8w .. 8w + 7 in word w, bits 4e), scales FP16 bits [n, groups], zeros uint8 [n, groups],
act-order tables int32 [parts, k] with a table per row (`gidx_row`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ...errors import FormatError, Unsupported
from ...ops.gemm_q import q4_row_bytes
from . import rules

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # output 8c + AWQ_ORDER[e] in bits 4e of a word
_SHIFTS = 4 * np.arange(8, dtype=np.uint32)


@dataclass
class HostQ4:
    """A 4-bit linear in the device layout (host arrays; see the module doc)."""
    q: np.ndarray          # uint32 [n, ceil(k / 32) * 4]
    scales: np.ndarray     # uint16 FP16 bits [n, groups]
    zeros: np.ndarray      # uint8 [n, groups]
    gidx: np.ndarray | None   # int32 [parts, k] or None (group k // group_size)
    gidx_row: np.ndarray | None   # int32 [n]: each row's table
    k: int
    group_size: int

    @property
    def n(self) -> int:
        return len(self.q)


def concat_q4(parts: list[HostQ4]) -> HostQ4:
    """Parts stacked along n (fused q|k|v, gate|up); their act-order tables kept apart."""
    if len(parts) == 1:
        return parts[0]
    gidx = gidx_row = None
    if parts[0].gidx is not None:
        gidx = np.concatenate([p.gidx for p in parts])
        offs = np.cumsum([0] + [len(p.gidx) for p in parts[:-1]])
        gidx_row = np.concatenate([p.gidx_row + o for p, o in zip(parts, offs)]).astype(np.int32)
    return HostQ4(np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]),
                  np.concatenate([p.zeros for p in parts]), gidx, gidx_row, parts[0].k,
                  parts[0].group_size)


def unpack_columns(words: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """int32 [r, c] -> uint8 [r, 8c]: nibble e of word (., c) is column 8c + order[e]."""
    u = words.view(np.uint32)
    nib = ((u[:, :, None] >> _SHIFTS) & 15).astype(np.uint8)        # [r, c, e]
    out = np.empty_like(nib)
    out[:, :, list(order)] = nib
    return out.reshape(len(u), -1)


def pack_rows(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [n, k] (k % 8 == 0) -> the device's uint32 [n, ceil(k / 32) * 4]."""
    n, k = codes.shape
    words = np.zeros((n, q4_row_bytes(k) // 4), np.uint32)
    c = codes.reshape(n, k // 8, 8).astype(np.uint32)
    words[:, :k // 8] = (c << _SHIFTS).sum(axis=2, dtype=np.uint32)
    return words


@dataclass(frozen=True)
class Int4Config:
    """A GPTQ or AWQ quantization_config, field by field (field_table scopes
    "quantization_config.gptq" / ".awq")."""
    method: str                 # "gptq" | "awq"
    group_size: int             # -1: the whole input row
    desc_act: bool
    sym: bool
    zero_minus_one: bool        # GPTQ checkpoint_format "gptq": stored zero = z - 1
    skip: tuple[str, ...]       # AWQ modules_to_not_convert (HF pattern rule)
    block_modules: tuple[str, ...] | None   # GPTQ modules_in_block_to_quantize, flattened
    source: str

    kind = "int4"

    def converts(self, module: str) -> bool:
        """Whether `module` (an HF module name) is quantized: AWQ every Linear but the
        output head and modules_to_not_convert; GPTQ the Linears of the layer blocks (all,
        or those of modules_in_block_to_quantize)."""
        if module == "lm_head":
            return False
        if self.method == "awq":
            return rules.hf_converts(module, self.skip)
        if self.block_modules is None:
            return True
        rel = re.sub(r"^model\.layers\.\d+\.", "", module)
        return rel in self.block_modules

    def describe(self) -> str:
        g = "per row" if self.group_size == -1 else f"groups of {self.group_size}"
        what = (f"GPTQ 4-bit, {g}, {'symmetric' if self.sym else 'asymmetric'}, "
                f"{'act-order (g_idx)' if self.desc_act else 'no act-order'}, "
                f"checkpoint_format {'gptq' if self.zero_minus_one else 'gptq_v2'}"
                if self.method == "gptq" else f"AWQ 4-bit GEMM, {g}, zero points")
        return what + "; activations BF16"

    def groups(self, k: int) -> int:
        return 1 if self.group_size == -1 else -(-k // self.group_size)

    def tensor_specs(self, module: str, n: int, k: int) -> dict[str, tuple]:
        """name -> (shape, dtypes, required) of the tensors a quantized `module` holds."""
        g = self.groups(k)
        if self.method == "gptq":
            return {f"{module}.qweight": ((k // 8, n), ("I32",), True),
                    f"{module}.qzeros": ((g, n // 8), ("I32",), True),
                    f"{module}.scales": ((g, n), ("F16",), True),
                    f"{module}.g_idx": ((k,), ("I32",), self.desc_act)}
        return {f"{module}.qweight": ((k, n // 8), ("I32",), True),
                f"{module}.qzeros": ((g, n // 8), ("I32",), True),
                f"{module}.scales": ((g, n), ("F16",), True)}

    def check_shape(self, module: str, n: int, k: int, where: str) -> None:
        gs = k if self.group_size == -1 else self.group_size
        if k % 8 or n % 8:
            raise FormatError(f"{where}: {module}: in_features {k} and out_features {n} must "
                              "be multiples of 8 for 4-bit packing")
        if k % gs:
            raise FormatError(f"{where}: quantization_config.group_size {gs} does not divide "
                              f"the input dimension {k} of {module}")
        if gs % 8:
            raise FormatError(f"{where}: quantization_config.group_size {gs} is not a "
                              f"multiple of 8 ({module})")

    def read(self, source, module: str, n: int, k: int) -> HostQ4:
        """The module's tensors checked and repacked (FormatError naming file, tensor and
        field for wrong scales, zero points or g_idx)."""
        file_of = getattr(source, "tensor_file", lambda _: source.description)
        gs = k if self.group_size == -1 else self.group_size
        g = self.groups(k)
        scales = np.ascontiguousarray(source.read_raw(f"{module}.scales")).view(np.uint16)
        rules.check_scales(scales.view(np.float16),
                           file_of(f"{module}.scales"), f"{module}.scales",
                           "quantization_config scales (FP16)")
        if self.method == "gptq":
            qw = np.ascontiguousarray(source.read_raw(f"{module}.qweight"))
            # [k / 8, n] words, inputs 8r + e in nibble e -> codes [k, n]
            codes = ((qw.view(np.uint32)[:, None, :] >> _SHIFTS[None, :, None]) & 15)
            codes = codes.astype(np.uint8).reshape(k, n).T
            zeros = unpack_columns(np.ascontiguousarray(source.read_raw(f"{module}.qzeros")))
            if self.zero_minus_one:
                if (zeros == 15).any():
                    raise FormatError(f"{file_of(f'{module}.qzeros')}: tensor "
                                      f"{module}.qzeros holds the nibble 15, which "
                                      "checkpoint_format 'gptq' (stored zero = z - 1) cannot "
                                      "hold without overflow (AutoGPTQ reads it as 16, "
                                      "GPTQModel carries it into the next zero point)")
                zeros = zeros + 1
            gidx = self._g_idx(source, module, k, g, gs, file_of)
        else:
            qw = np.ascontiguousarray(source.read_raw(f"{module}.qweight"))
            codes = unpack_columns(qw, AWQ_ORDER).T                  # [n, k]
            zeros = unpack_columns(np.ascontiguousarray(source.read_raw(f"{module}.qzeros")),
                                   AWQ_ORDER)
            gidx = None
        host = HostQ4(pack_rows(np.ascontiguousarray(codes)),
                      np.ascontiguousarray(scales.T), np.ascontiguousarray(zeros.T),
                      None if gidx is None else gidx[None], None if gidx is None else
                      np.zeros(n, np.int32), k, gs)
        return host

    def _g_idx(self, source, module, k, g, gs, file_of) -> np.ndarray | None:
        """The act-order table, or None when it is k // group_size (or absent)."""
        name = f"{module}.g_idx"
        if name not in set(source.tensor_names()):
            return None
        gi = np.asarray(source.read_raw(name)).astype(np.int64)
        trivial = np.arange(k) // gs
        if np.array_equal(gi, trivial):
            return None
        if not self.desc_act:
            raise FormatError(f"{file_of(name)}: tensor {name} is not input // group_size but "
                              "quantization_config.desc_act is false (the references "
                              "disagree on such a checkpoint)")
        if gi.min() < 0 or gi.max() >= g:
            raise FormatError(f"{file_of(name)}: tensor {name} holds groups outside "
                              f"[0, {g})")
        return gi.astype(np.int32)


# --------------------------------------------------------------------------- config
def parse(method: str, q: dict, source: str) -> Int4Config:
    """A gptq / awq quantization_config -> Int4Config; Unsupported naming the field for
    every value metrale does not run, FormatError for malformed ones."""
    scope = f"quantization_config.{method}"
    rules.check_fields(q, scope, source)
    where = f"{source}: quantization_config"
    bits = q.get("bits", q.get("w_bit", 4) if method == "awq" else None)
    if bits != 4:
        raise Unsupported(f"{where}.bits = {bits!r}: only 4-bit {method.upper()} is supported")
    gs = q.get("group_size", q.get("q_group_size", 128))
    if not isinstance(gs, int) or isinstance(gs, bool) or not (gs == -1 or gs > 0):
        raise FormatError(f"{where}.group_size must be -1 or a positive integer, got {gs!r}")
    if method == "gptq":
        fmt = q.get("checkpoint_format", q.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise Unsupported(f"{where}.checkpoint_format = {fmt!r} is not supported "
                              "(supported: gptq, gptq_v2; marlin, bitblas, ... are kernel "
                              "layouts)")
        if q.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise Unsupported(f"{where}.pack_dtype = {q.get('pack_dtype')!r} is not supported "
                              "(int32 words)")
        for key in ("lm_head",):
            if q.get(key):
                raise Unsupported(f"{where}.{key} = true (a quantized output head) is not "
                                  "supported")
        if q.get("dynamic"):
            raise Unsupported(f"{where}.dynamic (per-module overrides) is not supported")
        blocks = q.get("modules_in_block_to_quantize")
        flat = None
        if blocks is not None:
            if not isinstance(blocks, list) or not all(isinstance(b, list) for b in blocks):
                raise FormatError(f"{where}.modules_in_block_to_quantize must be a list of "
                                  "lists of module names")
            flat = tuple(str(m) for b in blocks for m in b)
        name = q.get("block_name_to_quantize")
        if name not in (None, "model.layers"):
            raise Unsupported(f"{where}.block_name_to_quantize = {name!r}: only the decoder "
                              "layers (model.layers) can be quantized")
        return Int4Config("gptq", gs, bool(q.get("desc_act", False)), bool(q.get("sym", True)),
                          fmt == "gptq", (), flat, source)
    version = str(q.get("version", q.get("format", "gemm"))).lower()
    if version != "gemm":
        raise Unsupported(f"{where}.version = {version!r} is not supported (supported: gemm; "
                          "gemv / gemv_fast / marlin / exllama pack differently)")
    if q.get("zero_point", True) is not True:
        raise Unsupported(f"{where}.zero_point = {q.get('zero_point')!r}: AWQ GEMM checkpoints "
                          "always carry zero points (AutoAWQ cannot pack them without)")
    if q.get("desc_act"):
        raise Unsupported(f"{where}.desc_act = true: AWQ has no act-order")
    skip = q.get("modules_to_not_convert")
    return Int4Config("awq", gs, False, False, False, rules.pattern_list(skip, where),
                      None, source)
