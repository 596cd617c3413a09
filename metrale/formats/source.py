"""Where a model's config and weights come from: a local directory, or random weights in memory.

`open_source` accepts a checkpoint directory, a `.safetensors` file next to a config.json,
"preset:<name>", a llama.cpp `.gguf` file (formats/gguf/), or any object implementing
`ModelSource` (passed through).
"""
from __future__ import annotations

import json
import os
import re
import zlib
from functools import cached_property
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import FormatError
from ..ops.bf16 import f32_to_bf16
from .config_bounds import check_decoder_sizes, check_layer_counts
from .deepseek_config import resolve_model_type
from .hub import hub_hint
from .key_names import canonical_key, unloaded_prefixes
from .layout import expected_tensors
from .metadata import DECODER_ARCHS, ModelMetadata
from .presets import preset_config
from .safetensors import SafetensorsFile

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_NAME = "model.safetensors.index.json"


@runtime_checkable
class ModelSource(Protocol):
    """A checkpoint: its config, its tensors by HF name, and BF16 reads of them."""

    description: str

    def config(self) -> dict: ...
    def generation_config(self) -> dict | None: ...
    def metadata(self) -> ModelMetadata: ...
    def tensor_names(self) -> list[str]: ...
    def tensor_shape(self, name: str) -> tuple[int, ...]: ...
    def tensor_dtype(self, name: str) -> str: ...
    def read_bf16(self, name: str) -> np.ndarray: ...
    def tokenizer_path(self) -> Path | None: ...


def open_source(path_or_source) -> ModelSource:
    """A `ModelSource` for a directory, a .safetensors or .gguf file, "preset:<name>", or a
    source."""
    if not isinstance(path_or_source, (str, os.PathLike)):
        if isinstance(path_or_source, ModelSource):
            return path_or_source
        raise FormatError(f"cannot open {path_or_source!r} as a model: expected a path, "
                          "'preset:<name>' or a ModelSource")
    if isinstance(path_or_source, str) and path_or_source.startswith("preset:"):
        return MemorySource.preset(path_or_source[len("preset:"):])
    p = Path(path_or_source)
    if p.is_dir():
        return DirectorySource(p)
    if p.is_file():
        if p.suffix == ".safetensors":
            return DirectorySource(p.parent, files=[p.name])
        if p.suffix == ".gguf":
            from .gguf.source import GGUFSource   # imported here: only GGUF users pay for it
            return GGUFSource(p)
        if p.suffix in PICKLE_SUFFIXES:
            raise FormatError(f"{p}: pickle checkpoints are never loaded; convert it to "
                              "safetensors (e.g. save_pretrained(..., safe_serialization=True))")
        raise FormatError(f"{p}: not a checkpoint directory, a .safetensors or a .gguf file")
    raise FormatError(f"{p}: no such file or directory{hub_hint(os.fspath(path_or_source))}")


# Checkpoint tensors no code consumes and whose absence changes nothing: buffers that old
# transformers versions saved next to the weights and recompute at load.
HARMLESS_UNUSED = (
    re.compile(r"(.*\.)?rotary_emb\.inv_freq"),   # rope frequencies (recomputed from config)
    re.compile(r"(.*\.)?embeddings\.position_ids"),  # CLIP's arange(num_positions) buffer
)


def check_tensors(source: ModelSource, expected: dict[str, tuple],
                  complete: bool = True) -> None:
    """Check presence, shape and float dtype of every expected tensor (before any upload).

    With `complete` (`expected` is every tensor the model uses), a checkpoint tensor that
    is not expected is an error too, unless it is on the HARMLESS_UNUSED list: a tensor
    nobody reads is how a field the model ignores goes unnoticed.
    Raises `FormatError` naming the source and the tensors at fault.
    """
    have = set(source.tensor_names())
    # DirectorySource names the safetensors file(s); other sources their description.
    files = getattr(source, "weights_description", source.description)
    file_of = getattr(source, "tensor_file", lambda name: files)
    for name, shape in expected.items():
        if name not in have:
            raise FormatError(f"{files}: missing tensor {name!r} "
                              f"(expected shape {list(shape)})")
        got = tuple(source.tensor_shape(name))
        if got != tuple(shape):
            raise FormatError(f"{file_of(name)}: tensor {name!r} has shape {list(got)} "
                              f"but config.json implies {list(shape)}")
        dt = source.tensor_dtype(name)
        # a GGUF source names its stored block types, which read_bf16 dequantizes
        if dt not in ("BF16", "F16", "F32", "F64") and \
                dt not in getattr(source, "CONVERTED_DTYPES", ()):
            raise FormatError(f"{file_of(name)}: tensor {name!r} has dtype {dt}; "
                              "expected a floating type (BF16, F16, F32)")
    if complete:
        # a source may hold parts that a load leaves out by design (a gemma3 checkpoint's
        # vision tower: its text model loads, images are refused)
        skipped = tuple(getattr(source, "unloaded_prefixes", ()))
        unused = sorted(n for n in have - set(expected) if not n.startswith(skipped)
                        and not any(p.fullmatch(n) for p in HARMLESS_UNUSED))
        if unused:
            more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
            raise FormatError(f"{files}: {len(unused)} tensor(s) that no part of the model "
                              f"uses: {', '.join(unused[:8])}{more} (a config field the model "
                              "would ignore, or a checkpoint of another architecture)")


def _read_json(path: Path, required: bool) -> dict | None:
    if not path.is_file():
        if required:
            raise FormatError(f"{path}: missing (every checkpoint needs a config.json)")
        return None
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise FormatError(f"{path}: must hold a JSON object")
    return d


class DirectorySource:
    """A Hugging Face checkpoint directory: config.json (+ generation_config.json) and
    model.safetensors, a sharded set named by model.safetensors.index.json, or other
    *.safetensors files. Pickle weights are refused, never read."""

    def __init__(self, path: str | os.PathLike, files: list[str] | None = None) -> None:
        self.path = Path(path)
        self.description = str(self.path)
        self._config = resolve_model_type(_read_json(self.path / "config.json", required=True))
        self._gen = _read_json(self.path / "generation_config.json", required=False)
        names, self.weights_description = self._weight_files(files)
        self._files = [SafetensorsFile(self.path / n) for n in names]
        self._where: dict[str, tuple[SafetensorsFile, str]] = {}
        for f in self._files:
            for raw in f.tensors:
                name = self._canonical(raw)
                if name in self._where:
                    raise FormatError(f"{f.path}: tensor {raw!r} also appears in "
                                      f"{self._where[name][0].path}")
                self._where[name] = (f, raw)
        if files is None and (self.path / INDEX_NAME).is_file():
            self._check_index()

    def _weight_files(self, files: list[str] | None) -> tuple[list[str], str]:
        if files is not None:
            return files, str(self.path / files[0]) if len(files) == 1 else str(self.path)
        index = self.path / INDEX_NAME
        if index.is_file():
            self._index = _read_json(index, required=True)
            wm = self._index.get("weight_map")
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise FormatError(f"{index}: weight_map must map tensor names to file names")
            for shard in set(wm.values()):
                # shards live next to the index; a path would escape the checkpoint
                if Path(shard).name != shard or not (self.path / shard).is_file():
                    raise FormatError(f"{index}: shard {shard!r} is missing or not a plain "
                                      "file name in the checkpoint directory")
            return sorted(set(wm.values())), str(index)
        if (self.path / "model.safetensors").is_file():
            return ["model.safetensors"], str(self.path / "model.safetensors")
        found = sorted(p.name for p in self.path.glob("*.safetensors"))
        if found:
            return found, str(self.path)
        pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise FormatError(f"{self.path}: holds only pickle weights ({', '.join(pickles)}); "
                              "metrale never loads pickle: convert the checkpoint to "
                              "safetensors (save_pretrained(..., safe_serialization=True))")
        raise FormatError(f"{self.path}: no model.safetensors or *.safetensors weights")

    def _check_index(self) -> None:
        index = self.path / INDEX_NAME
        for raw, shard in self._index["weight_map"].items():
            f, _ = self._where.get(self._canonical(raw), (None, None))
            if f is None or f.path.name != shard:
                raise FormatError(f"{index}: tensor {raw!r} is listed in {shard} but "
                                  f"{self.path / shard} does not hold it")

    @property
    def unloaded_prefixes(self) -> tuple[str, ...]:
        """Names no load reads: gemma3's vision tower and projector; DeepSeek-V3's MTP layers."""
        return unloaded_prefixes(self._config)

    def _canonical(self, raw: str) -> str:
        """One name per tensor whatever the layout (key_names.py)."""
        return canonical_key(self._config.get("model_type"), raw)

    # ModelSource ------------------------------------------------------------------
    def config(self) -> dict:
        return json.loads(json.dumps(self._config))

    def generation_config(self) -> dict | None:
        return None if self._gen is None else json.loads(json.dumps(self._gen))

    @cached_property
    def _meta(self) -> ModelMetadata:
        where = str(self.path / "config.json")
        # counts and sizes against the tensors held, before anything is sized by them
        check_layer_counts(self._config, self._where, where)
        meta = ModelMetadata.from_config(self._config, self._gen, source=where)
        if meta.architecture in DECODER_ARCHS or meta.hybrid is not None:
            check_decoder_sizes(meta, self._where, self.tensor_shape, where)
        return meta

    def metadata(self) -> ModelMetadata:
        return self._meta

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def _lookup(self, name: str) -> tuple[SafetensorsFile, str]:
        try:
            return self._where[name]
        except KeyError:
            raise FormatError(f"{self.weights_description}: missing tensor {name!r}") from None

    def tensor_file(self, name: str) -> str:
        return str(self._lookup(name)[0].path)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        f, raw = self._lookup(name)
        return f.info(raw).shape

    def tensor_dtype(self, name: str) -> str:
        f, raw = self._lookup(name)
        return f.info(raw).dtype

    def read_bf16(self, name: str) -> np.ndarray:
        """uint16 BF16 bits, shaped: a read-only mmap view for BF16, converted otherwise."""
        f, raw = self._lookup(name)
        return f.read_bf16(raw)

    def read_raw(self, name: str) -> np.ndarray:
        """The tensor as stored (quantized checkpoints): a read-only, shaped mmap view."""
        f, raw = self._lookup(name)
        return f.raw(raw)

    def tokenizer_path(self) -> Path | None:
        p = self.path / "tokenizer.json"
        return p if p.is_file() else None

    def close(self) -> None:
        for f in self._files:
            f.close()


# Tensors above this many elements repeat a random block of _BLOCK elements (a prime, so
# rows of power-of-two length do not line up), drawn once per source and started at a
# per-name offset: real-shape presets hold ~8e9 parameters (a MoE ~3e10 in ~2e4 expert
# tensors), and drawing each one from a normal distribution takes minutes.
_FULL_RANDOM_MAX = 1 << 20
_BLOCK = 1_048_573


class MemorySource:
    """Random BF16 weights at a config's shapes, generated lazily and deterministically.

    Tensor `name` is drawn from a generator seeded by `(seed, crc32(name))`: std-0.02 normal
    values, norm weights `1 + 0.02 * normal`; tensors over 2^20 elements tile one block per
    source (see _BLOCK). Nothing but that block is held in memory between reads.
    """

    def __init__(self, config: dict, generation_config: dict | None = None, seed: int = 0,
                 description: str | None = None) -> None:
        self._config = resolve_model_type(json.loads(json.dumps(config)))
        self._gen = None if generation_config is None else json.loads(json.dumps(generation_config))
        self.seed = int(seed)
        self.description = description or f"memory:{config.get('model_type')}"
        self._meta = ModelMetadata.from_config(self._config, self._gen, source=self.description)
        self._shapes = expected_tensors(self._meta)
        self._dtypes: dict[str, str] = {}
        if self._meta.quantization is not None:   # random quantized tensors (quant/)
            from .quant.layout import checkpoint_tensors
            layout = checkpoint_tensors(self._meta)
            self._shapes = {n: s for n, (s, _) in layout.items()}
            self._dtypes = {n: dt for n, (_, dt) in layout.items()}

    @staticmethod
    def preset(name: str, seed: int = 0) -> "MemorySource":
        """Random weights at a preset's shapes ("tiny", "llama-3.1-8b", ...; see PRESETS)."""
        cfg, gen = preset_config(name)
        return MemorySource(cfg, gen, seed=seed, description=f"preset:{name}")

    @staticmethod
    def from_config(config: dict, seed: int = 0) -> "MemorySource":
        return MemorySource(config, None, seed=seed)

    def config(self) -> dict:
        return json.loads(json.dumps(self._config))

    def generation_config(self) -> dict | None:
        return None if self._gen is None else json.loads(json.dumps(self._gen))

    def metadata(self) -> ModelMetadata:
        return self._meta

    def tensor_names(self) -> list[str]:
        return list(self._shapes)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        try:
            return self._shapes[name]
        except KeyError:
            raise FormatError(f"{self.description}: missing tensor {name!r}") from None

    def tensor_dtype(self, name: str) -> str:
        self.tensor_shape(name)
        return self._dtypes.get(name, "BF16")

    def read_raw(self, name: str) -> np.ndarray:
        """A quantized tensor's stored values, random but valid: FP8 codes without NaN,
        scales of weights about 0.02 in size, GPTQ zero points 8 (stored 7), AWQ 8."""
        shape, dt = self.tensor_shape(name), self.tensor_dtype(name)
        if dt == "BF16":
            return self.read_bf16(name)
        n = int(np.prod(shape, dtype=np.int64))
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode()), 1])
        m = min(n, _BLOCK) if n > _FULL_RANDOM_MAX else n
        if dt == "F8_E4M3":
            x = rng.integers(0, 0x7F, size=m, dtype=np.uint8) | (
                rng.integers(0, 2, size=m, dtype=np.uint8) << 7)
        elif dt in ("F32", "F16"):   # FP8 scales (values to 448) / 4-bit scales (codes to 15)
            x = rng.uniform(1.0, 2.0, size=m) * (1e-4 if dt == "F32" else 2e-3)
            x = x.astype(np.float32 if dt == "F32" else np.float16)
        elif name.endswith(".qzeros"):
            x = np.full(m, 0x77777777 if self._meta.quantization.method == "gptq"
                        else 0x88888888, np.uint32).view(np.int32)
        else:
            x = rng.integers(0, 2**32, size=m, dtype=np.uint64).astype(np.uint32).view(np.int32)
        return np.resize(x, n).reshape(shape) if m != n else x.reshape(shape)

    def read_bf16(self, name: str) -> np.ndarray:
        """uint16 BF16 bits of tensor `name`, shaped; the same bits on every call."""
        shape = self.tensor_shape(name)
        n = int(np.prod(shape, dtype=np.int64))
        if n > _FULL_RANDOM_MAX and not _is_norm_weight(name):
            start = zlib.crc32(name.encode()) % _BLOCK
            return np.resize(self._block()[start:start + _BLOCK], n).reshape(shape)
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        x = rng.standard_normal(min(n, _BLOCK) if n > _FULL_RANDOM_MAX else n,
                                dtype=np.float32)
        x *= 0.02
        if _is_norm_weight(name) and not _zero_centred(self._meta, name):
            x += 1.0   # a norm weight near 1 (a zero-centred (1 + w) one: near 0)
        bits = f32_to_bf16(x)
        if bits.size != n:
            bits = np.resize(bits, n)  # tiles the block
        return bits.reshape(shape)

    def _block(self) -> np.ndarray:
        """The big tensors' random block, twice over (a per-name window is one slice)."""
        if getattr(self, "_big_block", None) is None:
            rng = np.random.default_rng([self.seed, _BLOCK])
            bits = f32_to_bf16(rng.standard_normal(_BLOCK, dtype=np.float32) * 0.02)
            self._big_block = np.concatenate([bits, bits])
        return self._big_block

    def tokenizer_path(self) -> Path | None:
        return None


def _zero_centred(meta, name: str) -> bool:
    """A norm whose weight enters as (1 + w): every RMSNorm of Gemma, and of the Qwen
    hybrids but their gated one (HF initialises those to zeros, the gated one to ones).
    Near 1 there, each of Gemma's four norms a layer would double its output, and 26
    random layers of that make BF16 rounding alone move the logits by ~40%."""
    if meta.variant.norm_mode == "gemma":
        return True
    hy = meta.hybrid
    return hy is not None and hy.mamba is None and not name.endswith("linear_attn.norm.weight")


def _is_norm_weight(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and "norm" in parts[-2]
