#!/usr/bin/env python3
"""ESTIMATE (not a measurement) of the MLA decode kernel (kernels/attention_mla.cu) at
DeepSeek-V3's attention shape on H100 / H200, from the EmuBackend's counters.

    python benchmarks/emu_estimate_mla.py [--json FILE]

Shape: 128 heads, kv_lora_rank 512 + qk_rope_head_dim 64 (576 BF16 values a token), one
layer; decode of 1 and 8 rows at 4096 cached tokens each. attention_mla_split and
attention_mla_combine each run on ProfileEmuBackend (16 evenly spaced blocks of the grid,
counters scaled to it) and become a time through gpu_runtime/emu/estimate.py: a fixed 2 us
per launch plus the largest of DRAM bytes at the published HBM bandwidth, tensor-core FLOPs
and shared-memory wavefronts. The roofline is the latent cache read once per row plus the
queries and the output. Not counted (estimate.py's limits): CUDA-core FP32 arithmetic (this
kernel's dot products and weighted sums run on CUDA cores: 2 * 128 * 4096 * (576 + 512)
FLOPs a row, ~1.1 GFLOP, which at ~60 TFLOP/s of FP32 is ~19 us: likely the real limiter),
instruction issue and latency. Nothing here ran on a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.gpu_runtime.emu import estimate as est  # noqa: E402
from metrale.gpu_runtime.emu.trace import ProfileEmuBackend  # noqa: E402
from metrale.ops import attention_mla  # noqa: E402

import numpy as np  # noqa: E402

H, R, ROPE, BS, CONTEXT = 128, 512, 64, 64, 4096
SAMPLE_BLOCKS = 16


def run(rows_list=(1, 8)) -> dict:
    be = ProfileEmuBackend(sample_blocks=SAMPLE_BLOCKS, full_grid=0)
    s = be.default_stream()
    D, out = R + ROPE, []
    for n in rows_list:
        mb = CONTEXT // BS
        cache = be.alloc(n * mb * BS * D * 2)
        tables = be.alloc(n * mb * 4)
        be.copy_h2d(np.arange(n * mb, dtype=np.int32), tables)
        lens = be.alloc(n * 4)
        be.copy_h2d(np.full(n, CONTEXT, np.int32), lens)
        q, o = be.alloc(n * H * D * 2), be.alloc(n * H * R * 2)
        sp = attention_mla.mla_max_splits(CONTEXT)
        ws = be.alloc(attention_mla.mla_workspace_bytes(n, H, R, sp))
        first = len(be.launch_counters)
        attention_mla.attention_mla(be, s, o, q, cache, tables, lens, n, H, R, ROPE, BS, mb, 0.1, ws,
                              sp)
        be.synchronize(s)
        recs = be.launch_counters[first:]
        roof = n * CONTEXT * D * 2 + n * H * (D + R) * 2
        row = {"rows": n, "context": CONTEXT, "roofline_bytes": roof, "launches": []}
        for rec in recs:
            row["launches"].append({"kernel": rec.get("kernel"), "grid": list(rec["grid"]),
                                    **{dev.name: est.launch_estimate(rec, dev)["us"]
                                       for dev in est.DEVICES}})
        for dev in est.DEVICES:
            total = sum(est.launch_estimate(rec, dev)["us"] for rec in recs)
            roof_us = roof / dev.hbm_bytes_per_s * 1e6
            row[dev.name] = {"estimated_us": total, "roofline_us": roof_us,
                             "roofline_fraction": roof_us / total}
        out.append(row)
        for p in (cache, tables, lens, q, o, ws):
            be.free(p)
    return {"estimate": True,
            "what": "ESTIMATED time of one layer's MLA decode attention (split + combine) at "
                    "DeepSeek-V3's shape on H100/H200 from EmuBackend counters; not measured "
                    "on a GPU",
            "not_counted": "CUDA-core FP32 arithmetic, instruction issue, latency",
            "model": {"fixed_us_per_launch": est.FIXED_US,
                      "devices": [est.device_dict(d) for d in est.DEVICES],
                      "sampling": f"{SAMPLE_BLOCKS} evenly spaced blocks of each grid"},
            "command": "python benchmarks/emu_estimate_mla.py --json "
                       "benchmarks/results/emu_estimate_attention_mla.json",
            "rows": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the report as JSON")
    args = ap.parse_args(argv)
    rep = run()
    for r in rep["rows"]:
        print(f"rows {r['rows']}: " + ", ".join(
            f"{dev.name}: {r[dev.name]['estimated_us']:.1f} us (roofline "
            f"{r[dev.name]['roofline_us']:.1f} us)" for dev in est.DEVICES))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
