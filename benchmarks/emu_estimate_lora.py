#!/usr/bin/env python3
"""ESTIMATE (not a measurement) of the grouped LoRA GEMMs of a decode step on H100 / H200,
from the EmuBackend's counters, against their byte roofline and against the base GEMMs.

    python benchmarks/emu_estimate_lora.py [--json FILE]

Shapes: Llama 3.1 8B (hidden 4096, intermediate 14336, 32 heads / 8 KV heads x 128, 32
layers); decode of 1 and 8 rows, the rows spread over 4 adapters of rank 16 on every linear
(row i -> adapter i mod 4, one row per tile, as a decode step launches them). Per fused group
(q|k|v, o, gate|up, down) the shrink (lora_shrink_r1_v8) and the expand (lora_expand_r1_v8),
and the base GEMM the group already runs (gemm_tc's 16x16 decode tile), each on
ProfileEmuBackend (16 evenly spaced blocks of the grid, counters scaled to it) and turned into
a time by gpu_runtime/emu/estimate.py: a fixed 2 us per launch plus the largest of DRAM bytes
at the published HBM bandwidth, tensor-core FLOPs and shared-memory wavefronts. The roofline
is the bytes a launch must move (x, each used adapter's A or B once, t, and y read and
written) at the HBM bandwidth. Per step: the 32 layers' LoRA launches against the base GEMMs'.
Not counted (estimate.py's limits): CUDA-core FP32 arithmetic and instruction issue, and
latency: at these sizes a shrink's grid has few CTAs (8 rows x 6 column blocks for q|k|v), so
the bandwidth a few CTAs reach -- settled only on a GPU -- may be what limits it. Nothing here
ran on a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.gpu_runtime.emu import estimate as est  # noqa: E402
from metrale.gpu_runtime.emu.trace import ProfileEmuBackend  # noqa: E402
from metrale.ops import gemm_tc, lora  # noqa: E402

import numpy as np  # noqa: E402

HID, INTER, H, KV, D, LAYERS = 4096, 14336, 32, 8, 128, 32
ADAPTERS, RANK = 4, 16
GROUPS = [("qkv", HID, [H * D, (H + KV) * D, (H + 2 * KV) * D]), ("o", H * D, [HID]),
          ("gate_up", HID, [INTER, 2 * INTER]), ("down", INTER, [HID])]
SAMPLE_BLOCKS = 16


def profile(be, fn) -> dict:
    fn()
    be.synchronize(be.default_stream())
    return be.launch_counters[-1]


def estimate(rec: dict, roof_bytes: int) -> dict:
    out = {"grid": list(rec["grid"]), "roofline_bytes": int(roof_bytes)}
    for dev in est.DEVICES:
        e = est.launch_estimate(rec, dev)
        roof_us = roof_bytes / dev.hbm_bytes_per_s * 1e6
        out[dev.name] = {"estimated_us": e["us"], "estimated_us_without_fixed": e["work_us"],
                         "limiter": e["limiter"], "roofline_us": roof_us,
                         "roofline_fraction": roof_us / e["us"]}
    return out


def run(rows_list=(1, 8)) -> dict:
    be = ProfileEmuBackend(sample_blocks=SAMPLE_BLOCKS, full_grid=0)
    s = be.default_stream()
    out = []
    for m in rows_list:
        slots = [i % ADAPTERS for i in range(m)]
        used = len(set(slots))
        tiles = lora.build_tiles(slots, 1)
        tl = be.alloc(tiles.nbytes)
        be.copy_h2d(tiles, tl)
        for name, k, ends in GROUPS:
            n, c = ends[-1], len(ends) * RANK
            x, y, t = be.alloc(m * k * 2), be.alloc(m * n * 2), be.alloc(m * c * 4)
            a, b = be.alloc(ADAPTERS * c * k * 2), be.alloc(ADAPTERS * n * RANK * 2)
            w, sc = be.alloc(n * k * 2), be.alloc(ADAPTERS * len(ends) * 4)
            be.copy_h2d(np.ones(ADAPTERS * len(ends), np.float32), sc)
            shr = profile(be, lambda: lora.lora_shrink(be, s, t, x, a, c * k, tl, len(tiles),
                                                        m, k, c, ADAPTERS))
            exp = profile(be, lambda: lora.lora_expand(be, s, y, t, b, n * RANK, sc, tl,
                                                        len(tiles), m, n, RANK, ends, ADAPTERS))
            base = profile(be, lambda: gemm_tc.gemm_tc(be, s, y, x, w, m, n, k, tile="16x16"))
            out.append({"rows": m, "group": name, "n": n, "k": k, "c": c, "adapters": used,
                        "shrink": estimate(shr, m * k * 2 + used * c * k * 2 + m * c * 4),
                        "expand": estimate(exp, 2 * m * n * 2 + used * n * RANK * 2 +
                                           m * c * 4),
                        "base_gemm_tc": estimate(base, n * k * 2 + m * (k + n) * 2)})
            for p in (x, y, t, a, b, w, sc):
                be.free(p)
        be.free(tl)
    steps = {}
    for m in rows_list:
        rs = [r for r in out if r["rows"] == m]
        steps[str(m)] = {dev.name: {
            key: LAYERS * sum(r[part][dev.name]["estimated_us"] for r in rs for part in parts)
            for key, parts in (("lora_us", ("shrink", "expand")), ("base_linears_us",
                                                                   ("base_gemm_tc",)))}
            for dev in est.DEVICES}
        for dev in est.DEVICES:
            d = steps[str(m)][dev.name]
            d["lora_over_base_linears"] = d["lora_us"] / d["base_linears_us"]
    return {"estimate": True,
            "what": "ESTIMATED time of the LoRA shrink/expand launches of a decode step at "
                    "Llama 3.1 8B shapes (4 adapters, rank 16, every linear) on H100/H200 from "
                    "EmuBackend counters (gpu_runtime/emu/estimate.py), against their byte "
                    "roofline and the base gemm_tc decode GEMMs of the same groups. Not "
                    "measured on a GPU.",
            "not_counted": "CUDA-core FP32 arithmetic, instruction issue and latency (the "
                           "shrink's small grids); the lm_head and attention are not in the "
                           "per-step sums",
            "model": {"fixed_us_per_launch": est.FIXED_US,
                      "devices": [est.device_dict(d) for d in est.DEVICES],
                      "sampling": f"{SAMPLE_BLOCKS} evenly spaced blocks of each grid"},
            "command": "python benchmarks/emu_estimate_lora.py --json "
                       "benchmarks/results/emu_estimate_lora_decode.json",
            "rows": out, "per_step": steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the report as JSON")
    args = ap.parse_args(argv)
    rep = run()
    print("ESTIMATE (EmuBackend counters, not a GPU measurement)")
    for r in rep["rows"]:
        for part in ("shrink", "expand", "base_gemm_tc"):
            for dev in est.DEVICES:
                d = r[part][dev.name]
                print(f"rows {r['rows']} {r['group']:<8} {part:<13} {dev.name:<20} "
                      f"{d['estimated_us']:7.1f} us (roofline {d['roofline_us']:6.1f} us, "
                      f"{d['limiter']})")
    for m, per in rep["per_step"].items():
        for dev, d in per.items():
            print(f"decode step, {m} rows, {dev}: LoRA {d['lora_us']:.0f} us against the base "
                  f"linears' {d['base_linears_us']:.0f} us ({d['lora_over_base_linears']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
