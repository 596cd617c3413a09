#!/usr/bin/env python3
"""The EmuBackend's ESTIMATE (benchmarks/results/emu_profile.json, `metrale check-kernels
--profile`) next to what a GPU run measured, when a device is lent (benchmarks/gpu_suite.sh):

    python benchmarks/estimate_vs_measured.py --bench OUT/bench.json \
        --kernels OUT/bench_kernels.json [--estimate FILE] [--json OUT_FILE]

Rows: the decode step at batch 1 (bench.json's median inter-token latency against the
estimated step of the same preset; the estimate's context length is stated, the bench's
own prompt and generation lengths differ) and every tensor-core GEMM launch of that step
(bench_kernels.json's gemm_tc records at the same m, n, k). The estimate's device is the one
whose name the measured GPU's name contains (H100 or H200); with neither, both are shown.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pick_devices(est_devices: list[str], gpu_name: str | None) -> list[str]:
    key = next((k for k in ("H200", "H100") if gpu_name and k in gpu_name), None)
    hits = [d for d in est_devices if key and key in d]
    return hits or est_devices


def rows(estimate: dict, bench: dict, kernels: dict) -> list[dict]:
    out = []
    preset_name = bench.get("preset") or (bench.get("results") or [{}])[0].get("preset")
    for p in estimate["presets"]:
        if preset_name and p["preset"] != preset_name:
            continue
        dec = p["steps"]["decode"]
        devices = pick_devices(list(dec["devices"]), bench.get("gpu_name"))
        measured = next((r for r in bench.get("results", []) if r.get("batch") == 1), None)
        for dev in devices:
            out.append({"what": f"{p['preset']} decode step, batch 1 (estimate at "
                                f"{p['context']} cached tokens)", "device": dev,
                        "estimated_us": dec["devices"][dev]["estimated_us"],
                        "measured_us": (measured["itl_ms_p50"] * 1e3
                                        if measured and measured.get("itl_ms_p50") else None)})
        for k in dec["kernels"]:
            if not k["kernel"].startswith("gemm_tc."):
                continue
            for v in k["variants"]:
                m, n, kk = v["scalars"][:3]
                rec = next((r for r in kernels.get("results", [])
                            if r.get("family") == "gemm_tc" and r.get("shape", {}).get("m") == m
                            and r["shape"].get("n") == n and r["shape"].get("k") == kk
                            and "fp32" not in r.get("kernel", "")), None)
                for dev in devices:
                    out.append({"what": f"{k['kernel']} m={m} n={n} k={kk}", "device": dev,
                                "estimated_us": v[dev],
                                "measured_us": rec.get("time_us") if rec else None})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--estimate", default=str(ROOT / "benchmarks/results/emu_profile.json"))
    ap.add_argument("--bench", required=True)
    ap.add_argument("--kernels", required=True)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)

    def load(p):
        try:
            return json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            print(f"estimate_vs_measured: {p}: {e}", file=sys.stderr)
            return {}
    estimate = load(args.estimate)
    if not estimate:
        return 1
    table = rows(estimate, load(args.bench), load(args.kernels))
    print("ESTIMATE (EmuBackend counters) vs MEASURED (this GPU)")
    print(f"{'':<60} {'device':<22} {'estimate us':>12} {'measured us':>12} {'ratio':>6}")
    for r in table:
        m, e = r["measured_us"], r["estimated_us"]
        print(f"{r['what']:<60} {r['device']:<22} {e:>12.1f} "
              f"{'n/a' if m is None else f'{m:.1f}':>12} {'' if not m else f'{m / e:.2f}':>6}")
    if args.json:
        Path(args.json).write_text(json.dumps({"estimate_file": args.estimate,
                                               "rows": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
