"""`metrale info --presets`: every preset (random weights at a real model's shapes), with
the architecture, size and what it stands for."""
from __future__ import annotations

import json


def human_count(n: int) -> str:
    """8_030_261_248 -> "8.03 B", 494_032_768 -> "494.0 M", 106_816 -> "106.8 K"."""
    for scale, unit, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return str(n)


def preset_rows() -> list[dict]:
    """One row per preset, in the order formats.presets lists them."""
    from ..formats import PRESETS, MemorySource, num_parameters
    from ..formats.moe_config import inactive_parameters
    rows = []
    for name in PRESETS:
        meta = MemorySource.preset(name).metadata()
        total = int(num_parameters(meta))
        q = getattr(meta, "quantization", None)
        rows.append({"name": name, "architecture": meta.architecture,
                     "parameters": total,
                     "active_parameters": total - int(inactive_parameters(meta, 1)),
                     "quantization": None if q is None else q.method,
                     "layers": meta.num_layers, "hidden_size": meta.hidden_size,
                     "context": meta.context_length or meta.max_position_embeddings})
    return rows


def run_presets(args) -> int:
    rows = preset_rows()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'preset':<26} {'architecture':<14} {'parameters':>10} {'active':>9}  "
          f"{'quantized':<9}  layers x hidden, context")
    for r in rows:
        active = "" if r["active_parameters"] == r["parameters"] else \
            human_count(r["active_parameters"])
        print(f"{'preset:' + r['name']:<26} {r['architecture']:<14} "
              f"{human_count(r['parameters']):>10} {active:>9}  {r['quantization'] or '-':<9}  "
              f"{r['layers']} x {r['hidden_size']}, {r['context']:,}")
    print("random weights at each model's shapes (no download, no tokenizer: pass --ids)")
    return 0
