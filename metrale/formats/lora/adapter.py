"""A PEFT LoRA adapter directory read and checked against a base model: `read_adapter`.

Files: adapter_config.json (config.py) and adapter_model.safetensors (a pickled
adapter_model.bin is never loaded). Tensors, as PEFT saves them:
    base_model.model.<module>.lora_A.weight   [r_module, in_features]
    base_model.model.<module>.lora_B.weight   [out_features, r_module]
for every module the config targets (targets.py), r_module its rank_pattern rank; F32, F16
and BF16 are read as BF16 (round to nearest even), as the device holds them. Every tensor
must belong to a targeted module and every targeted module must have both: a missing,
extra or mis-shaped tensor is a FormatError naming it; DoRA magnitudes, embedding deltas,
lora_B biases and modules_to_save copies are refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import FormatError, Unsupported
from ..safetensors import SafetensorsFile
from .config import AdapterConfig, read_config
from .targets import SERVED, targeted

WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_REFUSED_PARTS = {"lora_magnitude_vector": "a DoRA magnitude vector (use_dora)",
                  "lora_embedding_A": "an embedding delta", "lora_embedding_B":
                  "an embedding delta", "modules_to_save": "a modules_to_save copy"}


@dataclass(frozen=True)
class LoraModule:
    """One adapted projection: A [r, k] and B [n, r] as BF16 bits, its PEFT scaling."""

    name: str          # HF module name, e.g. "model.layers.1.self_attn.o_proj"
    layer: int
    kind: str          # a targets.SERVED suffix, e.g. "self_attn.o_proj"
    rank: int
    scale: float       # alpha / r, or alpha / sqrt(r) (rsLoRA)
    a: np.ndarray      # uint16 [rank, in_features]
    b: np.ndarray      # uint16 [out_features, rank]

    @property
    def group(self) -> tuple[str, int]:
        """(fused device group, part): qkv 0-2, o 0, gate_up 0-1, down 0."""
        return SERVED[self.kind]


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter on the host: its config and every adapted module."""

    path: str
    config: AdapterConfig
    modules: tuple[LoraModule, ...]

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)

    @property
    def nbytes(self) -> int:
        """BF16 bytes of its A and B matrices (unpadded)."""
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules)

    def kinds(self) -> list[str]:
        """The projections it adapts (e.g. ["q_proj", "v_proj"]), in model order."""
        seen = []
        for m in self.modules:
            short = m.kind.split(".")[1]
            if short not in seen:
                seen.append(short)
        return seen


def adapter_rank(directory) -> int:
    """The largest rank an adapter directory's config declares (r and rank_pattern):
    what a slot must hold, read without the tensors."""
    cfg = read_config(Path(directory))
    return max([cfg.r, *cfg.rank_pattern.values()])


def read_adapter(directory, meta, max_rank: int | None = None) -> LoraAdapter:
    """Read the PEFT adapter at `directory` for a base with metadata `meta`; with
    `max_rank`, a module of a larger rank is refused naming the limit."""
    directory = Path(directory)
    cfg = read_config(directory)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        if (directory / "adapter_model.bin").is_file():
            raise FormatError(f"{directory}: only adapter_model.bin (a pickle) is there; "
                              "pickles are never loaded: save the adapter with "
                              "safe_serialization=True")
        raise FormatError(f"{directory}: no {WEIGHTS_FILE}")
    modules = targeted(cfg, meta)
    if not modules:
        raise FormatError(f"{cfg.source}: target_modules matches no q/k/v/o/gate/up/down "
                          "projection of this model")
    with SafetensorsFile(path) as f:
        names = set(f.tensors)
        for n in sorted(names):
            _check_name(n, path)
        wanted = {}
        for mod in modules:
            for ab in ("A", "B"):
                wanted[f"{_PREFIX}{mod.name}.lora_{ab}.weight"] = mod
        extra = sorted(names - set(wanted))
        if extra:
            raise FormatError(f"{path}: tensor {extra[0]!r} belongs to no module the config "
                              "targets (target_modules, layers_to_transform)")
        out = []
        for mod in modules:
            rank, _ = cfg.rank_alpha(mod.name)
            if max_rank is not None and rank > max_rank:
                raise Unsupported(f"{cfg.source}: {mod.name} has rank {rank}, above the "
                                  f"slots' max_lora_rank={max_rank}")
            n_out, k_in = mod.shape
            a = _tensor(f, f"{_PREFIX}{mod.name}.lora_A.weight", (rank, k_in), path)
            b = _tensor(f, f"{_PREFIX}{mod.name}.lora_B.weight", (n_out, rank), path)
            out.append(LoraModule(mod.name, mod.layer, mod.kind, rank,
                                  cfg.scaling(mod.name), a, b))
    return LoraAdapter(str(directory), cfg, tuple(out))


def _check_name(name: str, path: Path) -> None:
    for part, what in _REFUSED_PARTS.items():
        if f".{part}." in name or name.endswith("." + part):
            raise Unsupported(f"{path}: tensor {name!r} is {what}, which is not served")
    if not name.startswith(_PREFIX) or not (name.endswith(".lora_A.weight") or
                                            name.endswith(".lora_B.weight")):
        why = " (a lora_B bias: lora_bias)" if name.endswith(".lora_B.bias") else ""
        raise Unsupported(f"{path}: tensor {name!r} is not a PEFT lora_A / lora_B weight"
                          f"{why}; only LoRA deltas of the base's projections are served")


def _tensor(f: SafetensorsFile, name: str, shape: tuple[int, int], path: Path) -> np.ndarray:
    if name not in f.tensors:
        raise FormatError(f"{path}: missing tensor {name!r} (its module is targeted by the "
                          "config)")
    info = f.info(name)
    if tuple(info.shape) != shape:
        raise FormatError(f"{path}: tensor {name!r} has shape {list(info.shape)}, the base "
                          f"model needs {list(shape)}")
    return np.ascontiguousarray(f.read_bf16(name))
