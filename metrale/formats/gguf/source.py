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
loader does), and `read_planes` on the planes' rows (it moves whole rows). qwen2 / qwen3 use llama.cpp's NEOX rope, which is HF's layout: no permutation.
"""
from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path

import numpy as np

from ...errors import FormatError, Unsupported
from ...ops.gguf_planes import PACKED, plane_bytes
from .config import hf_config
from .file import GGUFFile, file_type_name
from .packed import Planes, split_blocks
from .quants import SUPPORTED_NAMES, check_tensor_types, dequantize_bf16
from .tokenizer import check_token_ids
from ..metadata import ModelMetadata

# llama.cpp tensor name -> HF name ({n}: the layer)
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# elements split into planes per step of read_planes: bounds its temporaries (~8 bytes an
# element) at ~32 MiB whatever the tensor
_SPLIT_ELEMENTS = 1 << 22


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a llama.cpp tensor name, or None for one these families lack."""
    if gguf_name in TENSOR_NAMES:
        return TENSOR_NAMES[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


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
    """A .gguf file (llama / qwen2 / qwen3 architectures); see the module docstring."""

    CONVERTED_DTYPES = SUPPORTED_NAMES   # stored types read_bf16 converts (check_tensors)

    def __init__(self, path) -> None:
        self.path = Path(path)
        self.description = str(self.path)
        self.weights_description = str(self.path)
        self.file = GGUFFile(self.path)
        self.fields = self.file.fields
        if "rope_freqs.weight" in self.file.tensors:
            raise Unsupported(f"{self.description}: tensor 'rope_freqs.weight' (llama.cpp's "
                              "per-frequency rope factors, e.g. Llama 3.1's rope scaling) is "
                              "not supported")
        # refused by type (and the file's type) before anything else
        check_tensor_types(self.file.tensors, self.fields, self.description)
        self._config = hf_config(self.fields, self.file.tensors, self.description)
        # special ids and the token count at open: an EOS outside the vocabulary would
        # load and never stop a generation; the merges are checked when the tokenizer is
        # built (tokenizer())
        check_token_ids(self.fields, self.description, self._config["vocab_size"])
        self._names: dict[str, str] = {}      # HF name -> GGUF name
        for g in self.file.tensors:
            name = hf_name(g)
            # an unknown tensor keeps its GGUF name: check_tensors refuses it as unused
            self._names[name or g] = g
        self._permuted = self._config["model_type"] == "llama"

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
        try:
            return self.file.tensors[self._names[name]]
        except KeyError:
            raise FormatError(f"{self.description}: missing tensor {name!r}") from None

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

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

    def read_bf16(self, name: str) -> np.ndarray:
        """uint16 BF16 bits [*shape] of tensor `name`, dequantized, in HF's row order."""
        info = self._info(name)
        bits = dequantize_bf16(self.file.raw(info.name), info.ggml_type, info.shape)
        heads = self._permuted_heads(name)
        if heads is not None:
            bits = np.ascontiguousarray(unpermute_rows(bits, heads))
        return bits

    def packed_type(self, name: str) -> int | None:
        """The ggml type tensor `name` keeps on the device when loaded packed: its stored
        type for a 2-D tensor of a block type of ops/gguf_planes.PACKED, else None (F32,
        F16, BF16 and 1-D tensors are read as BF16)."""
        info = self._info(name)
        return info.ggml_type if info.ggml_type in PACKED and len(info.shape) == 2 else None

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
        info = self._info(name)
        if out.dtype != np.uint16 or out.size != int(np.prod(info.shape, dtype=np.int64)):
            raise FormatError(f"{self.description}: read_bf16_into({name!r}) needs a uint16 "
                              f"buffer of {int(np.prod(info.shape))} elements")
        if self._permuted_heads(name) is not None:
            out.reshape(info.shape)[...] = self.read_bf16(name)
        else:
            dequantize_bf16(self.file.raw(info.name), info.ggml_type, info.shape, out=out)

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
