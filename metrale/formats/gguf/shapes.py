"""A GGUF's counts and sizes checked against its tensor directory, before anything is built
from them.

`{arch}.block_count` sizes per-layer tables and `embedding_length`, `feed_forward_length`,
the head counts and the vocabulary size the memory plan and workspaces; the tensor
directory says what the file really holds. Each value is compared with the tensor that
carries it (llama.cpp's loader requires the same shapes of these tensors), so a value that
disagrees is refused naming the key and the tensor while it is still only a number.
"""
from __future__ import annotations

import re

from ...errors import FormatError

_BLOCK = re.compile(r"blk\.(\d+)\.")


def layers_held(tensors) -> list[int]:
    """The sorted layer indices n of the file's `blk.n.*` tensors."""
    return sorted({int(m.group(1)) for name in tensors if (m := _BLOCK.match(name))})


def check_block_count(value: int, key: str, tensors, where: str) -> None:
    """FormatError unless `value` (the block count) is the number of layers the file's
    tensors hold, blk.0 .. blk.{value-1}."""
    held = layers_held(tensors)
    if len(held) == value and held[-1] == value - 1:   # sorted, distinct: 0 .. value-1
        return
    if not held:
        have = "no layer tensors (blk.N.*)"
    elif held == list(range(len(held))):
        have = f"tensors for {len(held)} layers (blk.0 .. blk.{held[-1]})"
    else:
        missing = sorted(set(range(held[-1] + 1)) - set(held))
        have = (f"tensors for layers blk.{held[0]} .. blk.{held[-1]} without blk."
                f"{missing[0]}" if missing else f"tensors for {len(held)} layers")
    raise FormatError(f"{where}: {key} = {value} but the file holds {have}")


def check_dim(tensors, name: str, axis: int, key: str, value: int, where: str,
              shown: str | None = None) -> None:
    """FormatError unless tensor `name` (when the file has it: a missing tensor is
    refused by name later) is `value` long on `axis` (numpy order: 0 = rows); `shown`:
    how the message writes the key's value when `value` is derived from it."""
    info = tensors.get(name)
    if info is None or len(info.shape) <= axis or info.shape[axis] == value:
        return
    unit = "rows" if axis == 0 else "columns"
    shown = value if shown is None else f"{shown} = {value}"
    raise FormatError(f"{where}: {key} = {shown} but {name} has "
                      f"{info.shape[axis]} {unit} (shape {list(info.shape)})")
