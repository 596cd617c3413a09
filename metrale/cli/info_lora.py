"""`metrale info MODEL --lora NAME=DIR ... [--max-loras N] [--max-lora-rank R]`: the LoRA
slots a load with these options reserves (their bytes, counted in the memory needed) and each
adapter checked against the checkpoint (rank, projections, layers, scaling, bytes)."""
from __future__ import annotations

from ..formats.lora import adapter_rank, read_adapter
from ..model_engine.lora_options import DEFAULT_RANK
from ..model_engine.lora_pool import (check_slot_options, layout, padded_rank, pool_bytes,
                                      slot_bytes)


def lora_info(meta, opts: dict, rows: int) -> dict | None:
    """The slots and adapters of the load options `opts` (lora_args.lora_load_options) for
    a workspace of `rows` rows, or None without LoRA options."""
    loras = opts.get("loras", {})
    n = opts.get("max_loras", len(loras))
    if not n and not loras:
        return None
    rank = opts.get("max_lora_rank") or max((adapter_rank(d) for d in loras.values()),
                                            default=DEFAULT_RANK)
    check_slot_options(n, rank)
    regions, _ = layout(meta, n, rank)
    adapters = []
    for name, directory in loras.items():
        a = read_adapter(directory, meta, max_rank=rank)   # refused naming what is wrong
        adapters.append({"name": name, "path": str(directory), "rank": a.max_rank,
                         "modules": a.kinds(), "layers": sorted({m.layer for m in a.modules}),
                         "scaling": sorted({round(m.scale, 6) for m in a.modules}),
                         "bytes": a.nbytes})
    return {"slots": n, "max_rank": rank, "padded_rank": padded_rank(rank),
            "slot_bytes": slot_bytes(regions), "bytes": pool_bytes(meta, n, rank, rows),
            "groups": list(dict.fromkeys(r.group for r in regions)), "adapters": adapters}


def lora_lines(info: dict, human_bytes) -> list[str]:
    """The text lines of `lora_info`'s dict."""
    out = [f"lora slots     {info['slots']} x rank {info['max_rank']} (held padded to "
           f"{info['padded_rank']}): {human_bytes(info['slot_bytes'])} per slot, "
           f"{human_bytes(info['bytes'])} in all with the per-pass buffers "
           f"({', '.join(info['groups'])} of every layer)"]
    for a in info["adapters"]:
        out.append(f"lora {a['name']:<9.9s} rank {a['rank']}, {', '.join(a['modules'])} on "
                   f"{len(a['layers'])} layer(s), scaling {', '.join(map(str, a['scaling']))}, "
                   f"{human_bytes(a['bytes'])} ({a['path']})")
    return out
