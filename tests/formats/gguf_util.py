"""Writing variants of the GGUF fixtures (tests/fixtures/gguf/) with the `gguf` package's
writer: a key changed, added or dropped, tensors dropped or added."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from metrale.formats.gguf.file import GGUFFile

GGUF_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"


def _vtype(v):
    if isinstance(v, bool):
        return GGUFValueType.BOOL, None
    if isinstance(v, int):
        return GGUFValueType.UINT32, None
    if isinstance(v, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(v, str):
        return GGUFValueType.STRING, None
    if isinstance(v, list):
        return GGUFValueType.ARRAY, _vtype(v[0])[0]
    raise TypeError(v)


def rewrite(src: Path, dst: Path, set_keys: dict | None = None, drop=(), arch=None,
            drop_tensors=(), add_tensors: dict | None = None) -> Path:
    """Copy GGUF `src` to `dst` with keys set (new or replaced, type from the Python value
    unless given as (value, GGUFValueType)), keys dropped and tensors dropped / added
    ({name: float32 array} stored as F32, or {name: (uint8 blocks, GGMLQuantizationType)})."""
    g = GGUFFile(src)
    arch = arch or g.fields["general.architecture"]
    w = GGUFWriter(str(dst), arch)
    set_keys = dict(set_keys or {})
    for key, value in g.fields.items():
        if key in drop or key in set_keys or key in ("general.architecture",
                                                      "general.alignment"):
            continue
        t = g.field_types[key]
        if isinstance(t, tuple):
            w.add_key_value(key, list(value) if not isinstance(value, list) else value,
                            GGUFValueType.ARRAY, GGUFValueType(t[1]))
        else:
            w.add_key_value(key, value, GGUFValueType(t))
    for key, value in set_keys.items():
        vt, sub = value[1:] + (None,) * (2 - len(value[1:])) if isinstance(value, tuple) \
            else _vtype(value)
        w.add_key_value(key, value[0] if isinstance(value, tuple) else value, vt, sub)
    for name, info in g.tensors.items():
        if name in drop_tensors:
            continue
        raw = np.array(g.raw(name))
        t = GGMLQuantizationType(info.ggml_type)
        if t == GGMLQuantizationType.F32:
            w.add_tensor(name, raw.view(np.float32).reshape(info.shape))
        else:
            w.add_tensor(name, raw.reshape(info.shape[0] if info.shape else 1, -1)
                         if len(info.shape) > 1 else raw, raw_dtype=t)
    for name, arr in (add_tensors or {}).items():
        if isinstance(arr, tuple):            # (stored bytes [rows, row bytes], type)
            w.add_tensor(name, arr[0], raw_dtype=arr[1])
        else:
            w.add_tensor(name, np.asarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g.close()
    return dst
