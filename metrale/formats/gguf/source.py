"""`GGUFSource`: a llama.cpp GGUF file as a `ModelSource` (so every command takes a .gguf).

The metadata becomes the config.json it stands for (gguf/config.py; every key honoured or
refused by name, field_table.GGUF), the tensors take their Hugging Face names (TENSOR_NAMES)
and are dequantized to BF16 when read (gguf/quants.py) or, for a 2-D tensor of a block type
the device keeps packed (`packed_type`), read as their planes (`read_planes`: gguf/packed.py,
ops/gguf_planes.py); the tokenizer is built from tokenizer.ggml.* (gguf/tokenizer.py) and
the chat template is tokenizer.chat_template.

Rotary layout: llama.cpp's converter permutes the rows of a llama q_proj / k_proj (and
their biases) per head from HF's half-split rotary layout into interleaved pairs (its NORM
rope: convert_hf_to_gguf.py `LlamaModel.permute`, row h*d + 2i + j <- h*d + j*d/2 + i for
head h, pair i, half j); `read_bf16` undoes it (`unpermute_rows`, as transformers' GGUF
loader does), and `read_planes` on the planes' rows (it moves whole rows). The other
architectures (gguf/archs.py) use llama.cpp's NEOX rope, which is HF's layout: no
permutation. Gemma's norm weights are stored as w + 1: read as (stored - 1), exact in
float32, then rounded to BF16. qwen3moe's stacked experts [E, ...] are read per expert, as
HF's `mlp.experts.{e}.*` (each expert's bytes are contiguous).
"""
from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path

import numpy as np

from ...errors import FormatError, Unsupported
from ...ops.gguf_planes import PACKED, plane_bytes
from .archs import EXPERT_NAMES, NORM_PLUS_ONE, PERMUTED, REFUSED_TENSORS, layer_names
from .config import hf_config
from .file import GGUFFile, file_type_name
from .packed import Planes, split_blocks
from .quants import SUPPORTED_NAMES, check_tensor_types, dequantize_bf16, dequantize_f32
from .tokenizer import check_token_ids
from ...ops.bf16 import f32_to_bf16
from ..metadata import ModelMetadata

# llama.cpp tensor name -> HF name ({n}: the layer)
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# elements split into planes per step of read_planes: bounds its temporaries (~8 bytes an
# element) at ~32 MiB whatever the tensor
_SPLIT_ELEMENTS = 1 << 22


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a llama.cpp tensor name in architecture `arch` (gguf/archs.py), or
    None for one it lacks (qwen3moe's stacked experts: `expert_names`)."""
    if gguf_name in TENSOR_NAMES:
        return TENSOR_NAMES[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    names = layer_names(arch)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def expert_names(gguf_name: str, n_experts: int) -> list[str] | None:
    """HF's per-expert names of a stacked expert tensor blk.N.ffn_*_exps.weight, in order."""
    m = _LAYER.fullmatch(gguf_name)
    if not m or m.group(2) not in EXPERT_NAMES or m.group(3) != "weight":
        return None
    return [f"model.layers.{m.group(1)}.mlp.experts.{e}.{EXPERT_NAMES[m.group(2)]}.weight"
            for e in range(n_experts)]


def unpermute_rows(x: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q/k weight [n_heads*d, ...] or bias."""
    d = x.shape[0] // n_heads
    return x.reshape(n_heads, d // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _group(gguf_name: str) -> str:
    """The tensor group `stored_types` reports a llama.cpp tensor name in."""
    if "norm" in gguf_name:
        return "norms"
    if gguf_name.endswith(".bias"):
        return "biases"
    m = _LAYER.fullmatch(gguf_name)
    if m:
        return {"attn": "attention", "ffn": "ffn"}.get(m.group(2).split("_")[0], m.group(2))
    return gguf_name.rsplit(".", 1)[0]


class GGUFSource:
    """A .gguf file of an architecture of gguf/archs.py; see the module docstring."""

    CONVERTED_DTYPES = SUPPORTED_NAMES   # stored types read_bf16 converts (check_tensors)

    def __init__(self, path) -> None:
        self.path = Path(path)
        self.description = str(self.path)
        self.weights_description = str(self.path)
        self.file = GGUFFile(self.path)
        self.fields = self.file.fields
        for name, why in REFUSED_TENSORS.items():
            if name in self.file.tensors:
                raise Unsupported(f"{self.description}: tensor {name!r} ({why}) is not "
                                  "supported")
        # refused by type (and the file's type) before anything else
        check_tensor_types(self.file.tensors, self.fields, self.description)
        self._config = hf_config(self.fields, self.file.tensors, self.description)
        # special ids and the token count at open: an EOS outside the vocabulary would
        # load and never stop a generation; the merges are checked when the tokenizer is
        # built (tokenizer())
        check_token_ids(self.fields, self.description, self._config["vocab_size"])
        arch = self.fields["general.architecture"]
        # HF name -> (GGUF name, expert index or None)
        self._names: dict[str, tuple[str, int | None]] = {}
        for g, info in self.file.tensors.items():
            experts = expert_names(g, self._config.get("num_experts", 0)) \
                if arch == "qwen3moe" else None
            if experts is not None and len(info.shape) == 3 and \
                    info.shape[0] == len(experts):
                self._names.update((n, (g, e)) for e, n in enumerate(experts))
                continue
            # an unknown tensor keeps its GGUF name: check_tensors refuses it as unused
            self._names[hf_name(g, arch) or g] = (g, None)
        self._permuted = arch in PERMUTED
        self._norm_plus_one = arch in NORM_PLUS_ONE

    # ModelSource ------------------------------------------------------------------
    def config(self) -> dict:
        return dict(self._config)

    def generation_config(self) -> dict | None:
        return None

    @cached_property
    def _meta(self) -> ModelMetadata:
        return ModelMetadata.from_config(self._config, None, source=self.description)

    def metadata(self) -> ModelMetadata:
        return self._meta

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def _info(self, name: str):
        """The directory entry of the GGUF tensor holding `name` (all experts for one)."""
        try:
            return self.file.tensors[self._names[name][0]]
        except KeyError:
            raise FormatError(f"{self.description}: missing tensor {name!r}") from None

    def _raw(self, name: str) -> tuple[np.ndarray, int, tuple[int, ...]]:
        """(stored bytes, ggml type, shape) of tensor `name`: one expert's slice of a
        stacked expert tensor (its bytes are contiguous: whole rows of whole blocks)."""
        info = self._info(name)
        raw, expert = self.file.raw(info.name), self._names[name][1]
        if expert is None:
            return raw, info.ggml_type, info.shape
        per = info.nbytes // info.shape[0]
        return raw[expert * per:(expert + 1) * per], info.ggml_type, info.shape[1:]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._raw(name)[2]

    def tensor_dtype(self, name: str) -> str:
        """The stored ggml type ("Q4_1", "F32", ...); read_bf16 converts every one of
        CONVERTED_DTYPES."""
        return self._info(name).type_name

    def _permuted_heads(self, name: str) -> int | None:
        """The heads whose rows llama.cpp permuted in tensor `name` (None: not permuted)."""
        if not self._permuted or (".q_proj." not in name and ".k_proj." not in name):
            return None
        meta = self.metadata()
        return meta.num_heads if ".q_proj." in name else meta.num_kv_heads

    def _shifted(self, name: str) -> bool:
        """Whether tensor `name` is a norm weight the converter stored as w + 1."""
        return self._norm_plus_one and name.endswith("norm.weight")

    def read_bf16(self, name: str) -> np.ndarray:
        """uint16 BF16 bits [*shape] of tensor `name`, dequantized, in HF's row order."""
        raw, t, shape = self._raw(name)
        if self._shifted(name):
            n = int(np.prod(shape, dtype=np.int64))
            return f32_to_bf16(dequantize_f32(raw, t, n) - np.float32(1)).reshape(shape)
        bits = dequantize_bf16(raw, t, shape)
        heads = self._permuted_heads(name)
        if heads is not None:
            bits = np.ascontiguousarray(unpermute_rows(bits, heads))
        return bits

    def packed_type(self, name: str) -> int | None:
        """The ggml type tensor `name` keeps on the device when loaded packed: its stored
        type for a 2-D tensor of a block type of ops/gguf_planes.PACKED, else None (F32,
        F16, BF16 and 1-D tensors are read as BF16)."""
        info = self._info(name)
        return info.ggml_type if info.ggml_type in PACKED and len(info.shape) == 2 and \
            self._names[name][1] is None else None

    def planes_nbytes(self, name: str) -> int:
        """Bytes of tensor `name`'s planes (`read_planes`), of a `packed_type` tensor."""
        n, k = self._info(name).shape
        return n * sum(plane_bytes(self.packed_type(name), k))

    def read_planes(self, name: str) -> Planes:
        """The planes (q, qh, meta: gguf/packed.py) of `packed_type` tensor `name` [n, k]:
        its stored blocks split, in HF's row order (llama's q/k rows unpermuted)."""
        info = self._info(name)
        t = self.packed_type(name)
        if t is None:
            raise FormatError(f"{self.description}: tensor {name!r} ({info.type_name} "
                              f"{list(info.shape)}) is not of a packed block type")
        n, k = info.shape
        raw = self.file.raw(info.name).reshape(n, -1)
        q_row, qh_row, meta_row = plane_bytes(t, k)
        q = np.empty((n, q_row), np.uint8)
        qh = np.empty((n, qh_row), np.uint8) if qh_row else None
        meta = np.empty((n, meta_row), np.uint8)
        step = max(_SPLIT_ELEMENTS // k, 1)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            p = split_blocks(raw[lo:hi].reshape(-1), t, hi - lo, k)
            q[lo:hi], meta[lo:hi] = p.q, p.meta
            if qh is not None:
                qh[lo:hi] = p.qh
        heads = self._permuted_heads(name)
        if heads is not None:   # whole rows move: the same permutation on every plane
            q, meta = (np.ascontiguousarray(unpermute_rows(a, heads)) for a in (q, meta))
            qh = None if qh is None else np.ascontiguousarray(unpermute_rows(qh, heads))
        return Planes(q, qh, meta, t, n, k)

    def read_bf16_into(self, name: str, out: np.ndarray) -> None:
        """`read_bf16(name)` written into `out` (C-contiguous uint16 of the tensor's size):
        dequantized in place, without a staging buffer (formats/upload.py)."""
        raw, t, shape = self._raw(name)
        if out.dtype != np.uint16 or out.size != int(np.prod(shape, dtype=np.int64)):
            raise FormatError(f"{self.description}: read_bf16_into({name!r}) needs a uint16 "
                              f"buffer of {int(np.prod(shape))} elements")
        if self._permuted_heads(name) is not None or self._shifted(name):
            out.reshape(shape)[...] = self.read_bf16(name)
        else:
            dequantize_bf16(raw, t, shape, out=out)

    def stored_types(self) -> str:
        """The tensors' stored ggml types by group, e.g. "MOSTLY_Q4_K_M (general.file_type):
        token_embd Q4_K, attention Q4_K/Q6_K, ffn Q4_K/Q6_K, norms F32, output Q6_K"
        (read_bf16 dequantizes every one to BF16)."""
        groups: dict[str, set[str]] = {}
        for info in self.file.tensors.values():
            groups.setdefault(_group(info.name), set()).add(info.type_name)
        order = ("token_embd", "attention", "ffn", "biases", "norms", "output")
        names = sorted(groups, key=lambda g: (order.index(g) if g in order else len(order), g))
        text = ", ".join(f"{g} {'/'.join(sorted(groups[g]))}" for g in names)
        ftype = file_type_name(self.fields)
        return f"{ftype} (general.file_type): {text}" if ftype else text

    def tokenizer_path(self) -> Path | None:
        return None     # no tokenizer.json: `tokenizer()` builds one from the metadata

    # what a GGUF carries besides the weights -----------------------------------------
    @cached_property
    def _tokenizer(self):
        from .tokenizer import build_tokenizer
        return build_tokenizer(self.fields, self.description)

    def tokenizer(self):
        """A `tokenizers.Tokenizer` from tokenizer.ggml.*, or None when the file has none."""
        return self._tokenizer

    def chat_template(self) -> str | None:
        t = self.fields.get("tokenizer.chat_template")
        return t if isinstance(t, str) and t else None

    def special_tokens(self) -> dict:
        """The special-token strings a chat template sees (bos_token, eos_token, ...)."""
        tokens = self.fields.get("tokenizer.ggml.tokens") or []
        out = {}
        for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                          ("pad_token", "padding")):
            tid = self.fields.get(f"tokenizer.ggml.{key}_token_id")
            if tid is not None and 0 <= int(tid) < len(tokens):
                out[name] = tokens[int(tid)]
        return out

    def close(self) -> None:
        self.file.close()
