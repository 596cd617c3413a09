"""The LoRA load options of `metrale.load` / `TransformerModel`, checked before anything is
allocated:

  max_loras=N       adapter slots on the device (0: none, the default; at most 1024)
  max_lora_rank=R   the largest rank a slot holds (1 .. 256; default: the largest rank of
                    `loras`, else 16). Memory: every slot reserves rank R for the q|k|v, o,
                    gate|up and down projections of every layer (lora_pool.py)
  loras={name: dir} PEFT adapters loaded at start-up into slots 0, 1, ... (pinned: a
                    promotion never evicts them); max_loras defaults to their count
On a tensor-parallel rank every slot holds the rank's slice of its adapter (tp/lora_shard.py:
A sharded like the projection's input, B like its output).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgument
from ..formats.lora import LoraAdapter, adapter_rank, read_adapter
from .lora_pool import AdapterPool, check_slot_options, pool_bytes

DEFAULT_RANK = 16


@dataclass(frozen=True)
class LoraOptions:
    n_slots: int
    max_rank: int
    loras: tuple[tuple[str, LoraAdapter], ...]   # start-up adapters, read and checked

    def device_bytes(self, meta, rows: int, ranks: int = 1) -> int:
        """Bytes of the pool (meta: the rank's layer metadata on a tensor-parallel rank)."""
        return pool_bytes(meta, self.n_slots, self.max_rank, rows, ranks) if self.n_slots \
            else 0

    def make_pool(self, backend, meta, rows: int, where: str, shard=None,
                  ranks: int = 1) -> AdapterPool | None:
        if not self.n_slots:
            return None
        return AdapterPool(backend, meta, self.n_slots, self.max_rank, rows, where, shard,
                           ranks)


def lora_options(source, meta, max_loras, max_lora_rank, loras) -> LoraOptions:
    """The checked options; every start-up adapter read and checked against `meta`
    (InvalidArgument / FormatError / Unsupported naming the option, file or tensor)."""
    pairs = _pairs(loras)
    if max_loras == 0 and pairs:
        max_loras = len(pairs)
    if max_lora_rank is None:
        max_lora_rank = max((adapter_rank(d) for _, d in pairs), default=DEFAULT_RANK)
    check_slot_options(max_loras, max_lora_rank)
    if len(pairs) > max_loras:
        raise InvalidArgument(f"load option loras: {len(pairs)} adapters for max_loras="
                              f"{max_loras} slots")
    read = tuple((name, read_adapter(d, meta, max_rank=max_lora_rank)) for name, d in pairs)
    return LoraOptions(max_loras, max_lora_rank, read)


def _pairs(loras) -> list[tuple[str, str]]:
    """`loras` as [(name, directory)]: a dict, or a sequence of pairs; names distinct."""
    if loras is None:
        return []
    items = list(loras.items()) if isinstance(loras, dict) else list(loras)
    out, seen = [], set()
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and
                isinstance(item[0], str) and item[0]):
            raise InvalidArgument(f"load option loras: expected {{name: directory}} or "
                                  f"(name, directory) pairs, got {item!r}")
        if item[0] in seen:
            raise InvalidArgument(f"load option loras: adapter name {item[0]!r} twice")
        seen.add(item[0])
        out.append((item[0], item[1]))
    return out
