#!/usr/bin/env python3
"""A paper model of a tensor-parallel decode step's communication against its weight reads,
for Llama-3.1-70B at TP=4 and TP=8 on H100 / H200 HGX nodes (NVLink 4 through NVSwitch).

    python benchmarks/tp_allreduce_model.py [--md FILE] [--json FILE]

Nothing here runs on a GPU: the byte counts are metrale's own (`tp/shard.py: rank_weight_bytes`,
`tp/runtime.py: step_comm_bytes`, the same functions the model and `bench` use), the bandwidths
are published figures, and the per-collective latency is an assumed range, stated as such.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.formats import MemorySource  # noqa: E402
from metrale.model_engine.tp.shard import plan_shards, rank_weight_bytes  # noqa: E402
from metrale.model_engine.tp.runtime import gathers, step_comm_bytes  # noqa: E402

GPUS = {   # HBM bandwidth (datasheet peak), NVLink per direction (line rate / NCCL effective)
    "H100 SXM": {"hbm_tb_s": 3.35, "nvlink_line_gb_s": 450, "nvlink_eff_gb_s": 370},
    "H200 SXM": {"hbm_tb_s": 4.8, "nvlink_line_gb_s": 450, "nvlink_eff_gb_s": 370},
}
ALPHA_US = (10.0, 20.0)   # assumed latency of one small NCCL collective inside a CUDA graph
SUM_KERNEL_US = 2.0       # a tp_sum_partials launch inside a graph (assumed)
SOURCES = {
    "hbm": "NVIDIA H100 and H200 Tensor Core GPU datasheets: H100 SXM 3.35 TB/s HBM3, "
           "H200 SXM 4.8 TB/s HBM3e; NVLink 900 GB/s per GPU (bidirectional) on both",
    "nvlink": "NVIDIA/nccl-tests issue #212 (NCCL developer, 2024-05-06): 450 GB/s is the "
              "H100 NVLink line rate per direction; with ~20% protocol overhead NCCL reaches "
              "an effective ~370 GB/s busBw for non-all-reduce collectives",
    "latency": "sgl-project/sglang PR #2904 (H100, TP=8, without CUDA graphs): vLLM's custom "
               "one-shot/two-shot all-reduce 9.3-11.8 us up to 32 KB, 24 us at 256 KB, 45 us "
               "at 1 MB; a tuned kernel 5.7-7.8 us up to 32 KB",
}


def model(n_ranks: int, rows: int, gpu: str) -> dict:
    src = MemorySource.preset("llama-3.1-70b")
    meta = src.metadata()
    plan = plan_shards(meta, 0, n_ranks, "llama-3.1-70b")
    g = GPUS[gpu]
    L, hid = meta.num_layers, meta.hidden_size
    w = rank_weight_bytes(meta, plan, tied=False)
    # the step reads every weight slice once, except the embedding slice (rows gathered)
    w_read = w - (plan.vocab_shard - min(rows, plan.vocab_shard)) * hid * 2
    t_weights = w_read / (g["hbm_tb_s"] * 1e12) * 1e3
    count = rows * hid
    gather = gathers(n_ranks, count)
    ours = step_comm_bytes(n_ranks, hid, plan.vocab_shard, L, rows, 2, gather)
    reductions = 2 * L + 1
    calls = reductions * (1 if gather else 2) + 1          # + the logits all-gather
    t_bw = ours / (g["nvlink_eff_gb_s"] * 1e9) * 1e3
    t_lat = [(calls * a + reductions * SUM_KERNEL_US) / 1e3 for a in ALPHA_US]
    # NCCL's ring all-reduce of BF16 (batch-variant order): 2 (N-1)/N x 2 bytes per element
    ring = reductions * 2 * (n_ranks - 1) / n_ranks * count * 2 + \
        (n_ranks - 1) * rows * plan.vocab_shard * 2
    t_ring = ring / (g["nvlink_eff_gb_s"] * 1e9) * 1e3
    t_ring_lat = [(reductions + 1) * a / 1e3 for a in ALPHA_US]
    return {
        "gpu": gpu, "tp": n_ranks, "rows": rows,
        "weight_bytes_per_gpu": w, "weight_read_ms": t_weights,
        "schedule": "gather" if gather else "exchange",
        "bytes_per_step": ours, "collectives_per_step": calls,
        "bandwidth_ms": t_bw, "latency_ms": t_lat,
        "total_ms": [t_bw + x for x in t_lat],
        "fraction_of_weight_read": [(t_bw + x) / t_weights for x in t_lat],
        "nccl_ring_bf16_bytes": int(ring),
        "nccl_ring_bf16_ms": [t_ring + x for x in t_ring_lat],
    }


def markdown(rows: list[dict]) -> str:
    head = ("| GPU | TP | rows | weights/GPU GB | weight read ms | schedule | MB/step | "
            "collectives | NVLink ms | latency ms | comm total ms | comm / weights | "
            "NCCL ring BF16 MB | ring ms |\n|" + "---|" * 14)
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['gpu']} | {r['tp']} | {r['rows']} | {r['weight_bytes_per_gpu'] / 1e9:.2f} | "
            f"{r['weight_read_ms']:.2f} | {r['schedule']} | {r['bytes_per_step'] / 1e6:.1f} | "
            f"{r['collectives_per_step']} | {r['bandwidth_ms']:.3f} | "
            f"{r['latency_ms'][0]:.2f}-{r['latency_ms'][1]:.2f} | "
            f"{r['total_ms'][0]:.2f}-{r['total_ms'][1]:.2f} | "
            f"{r['fraction_of_weight_read'][0]:.0%}-{r['fraction_of_weight_read'][1]:.0%} | "
            f"{r['nccl_ring_bf16_bytes'] / 1e6:.1f} | "
            f"{r['nccl_ring_bf16_ms'][0]:.2f}-{r['nccl_ring_bf16_ms'][1]:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--md", help="write the table as markdown")
    ap.add_argument("--json", help="write the records as JSON")
    args = ap.parse_args(argv)
    rows = [model(n, b, gpu) for gpu in GPUS for n in (4, 8) for b in (1, 8, 64)]
    table = markdown(rows)
    print(table)
    if args.md:
        Path(args.md).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"assumptions": {
            "alpha_us": ALPHA_US, "sum_kernel_us": SUM_KERNEL_US, "gpus": GPUS},
            "sources": SOURCES, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
