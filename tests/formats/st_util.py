"""Building safetensors files byte by byte (also broken ones) for the format tests."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from metrale.formats import PRESETS

_NP = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "I32": np.int32,
       "U8": np.uint8}


def st_bytes(header: dict, data: bytes = b"", pad_to: int | None = None) -> bytes:
    """8-byte length + JSON header (space padded to `pad_to`) + data."""
    h = json.dumps(header).encode()
    if pad_to is not None:
        h = h + b" " * (pad_to - len(h))
    return struct.pack("<Q", len(h)) + h + data


def tensors_bytes(tensors: dict[str, tuple[str, np.ndarray]]) -> bytes:
    """A valid file from name -> (dtype name, array); tensors laid out in order."""
    header, chunks, off = {}, [], 0
    for name, (dt, arr) in tensors.items():
        b = np.ascontiguousarray(arr, dtype=_NP[dt]).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        chunks.append(b)
        off += len(b)
    return st_bytes(header, b"".join(chunks))


def write_checkpoint(path: Path, config: dict, tensors: dict[str, np.ndarray],
                     generation_config: dict | None = None, shards: int = 1) -> Path:
    """A checkpoint directory of BF16 (uint16) tensors, optionally sharded with an index."""
    from safetensors.numpy import save_file
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    names = list(tensors)
    if shards == 1:
        (path / "model.safetensors").write_bytes(
            tensors_bytes({n: ("BF16", tensors[n]) for n in names}))
        return path
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        # safetensors.numpy has no bfloat16; store the bits through our own writer for
        # shard 0 and through the reference writer (as F32 values) for the others, so
        # both writers' output is exercised.
        if s == 0:
            (path / fname).write_bytes(tensors_bytes({n: ("BF16", tensors[n]) for n in part}))
        else:
            save_file({n: (tensors[n].astype(np.uint32) << 16).view(np.float32) for n in part},
                      str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


def tiny_config(**over) -> dict:
    cfg = dict(PRESETS["tiny"])
    cfg.update(num_hidden_layers=1, vocab_size=64, hidden_size=32, intermediate_size=48,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    cfg.update(over)
    return cfg
