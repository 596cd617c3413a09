#!/usr/bin/env python3
"""A paper model (nothing here runs on a GPU) of one decode step of Qwen3-235B-A22B in FP8 on
one 8x H200 node, its experts split by tensor parallelism (every expert's intermediate
dimension over the 8 GPUs, tp/moe_shard.py; and, for comparison, an all-gather of the
k slot outputs instead of the FP32 partial's reduction) or by expert parallelism (16 whole experts a
GPU, tp/expert_parallel.py): the bytes each GPU reads and receives per step, and what they
cost at published bandwidths. Extends benchmarks/tp_allreduce_model.py (its GPU figures,
latency range and sources).

    python benchmarks/tp_moe_model.py [--md FILE] [--json FILE]

Routing is assumed uniform and independent per token (real routers are skewed, which makes
expert parallelism's slowest GPU slower still); expert parallelism's slowest GPU is
estimated by sampling that routing with a fixed seed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tp_allreduce_model import ALPHA_US, GPUS, SOURCES  # noqa: E402
from metrale.model_engine.tp.runtime import gathers  # noqa: E402

# Qwen/Qwen3-235B-A22B(-FP8)'s config.json: every layer sparse, no shared expert
CFG = dict(layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, vocab=151936,
           experts=128, top_k=8, expert_inter=1536)
FP8_BLOCK = 128            # weight_block_size [128, 128], one float32 scale a block
N = 8
GPU = "H200 SXM"
HOST_SYNC_US = (10.0, 20.0)  # assumed: EP reads each MoE layer's routing back to the host


def fp8_bytes(rows: int, cols: int) -> float:
    """An FP8 block-scaled [rows, cols] weight: a byte an element + a float32 per block."""
    return rows * cols + 4 * -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)


def weights(mode: str) -> dict:
    """Bytes one GPU holds: attention (split by heads; the 4 KV heads copied over 8 GPUs),
    experts (TP: 1/8 of each; EP: 16 whole), router and norms whole, embedding and lm_head
    (BF16 in the release) split by vocabulary."""
    c, hid = CFG, CFG["hidden"]
    h, D = c["heads"] // N, c["head_dim"]
    attn = fp8_bytes(h * D, hid) * 2 + fp8_bytes(D, hid) * 2          # q, o; one k, v head
    tp = mode.startswith("tp")
    i = c["expert_inter"] // N if tp else c["expert_inter"]
    held = c["experts"] if tp else c["experts"] // N
    expert = 2 * fp8_bytes(i, hid) + fp8_bytes(hid, i)                  # gate, up, down
    per_layer = attn + held * expert + c["experts"] * hid * 2 + 2 * hid * 2
    vocab = -(-c["vocab"] // N) * hid * 2
    return {"attention_layer": attn, "expert_slice": expert, "experts_held": held,
            "total": c["layers"] * per_layer + 2 * vocab + hid * 2, "lm_head": vocab,
            "per_layer_fixed": attn + c["experts"] * hid * 2}


def expert_reads(mode: str, rows: int, rng) -> tuple[float, float]:
    """(mean, slowest GPU) expert slices read per layer: a GPU reads each expert slice it
    holds that any of the step's rows chose."""
    c = CFG
    E, k = c["experts"], c["top_k"]
    samples = 400
    hits = np.zeros((samples, E), bool)
    for s in range(samples):
        for _ in range(rows):
            hits[s, rng.choice(E, k, replace=False)] = True
    if mode.startswith("tp"):   # every GPU holds a slice of every expert
        n = hits.sum(1)
        return float(n.mean()), float(n.mean())
    per_gpu = hits.reshape(samples, N, E // N).sum(2)
    return float(per_gpu.mean()), float(per_gpu.max(1).mean())


def comm(mode: str, rows: int) -> dict:
    """Bytes one GPU receives per step and collectives per step (metrale's schedules)."""
    c, hid, L = CFG, CFG["hidden"], CFG["layers"]
    count = rows * hid   # o_proj's reduction: gather or exchange schedule (tp/runtime.py)
    dense = (N - 1) * count * 4 if gathers(N, count) else (N - 1) * (count // N) * 6
    embed = dense
    per = 1 if gathers(N, count) else 2   # collectives of one dense reduction
    logits = (N - 1) * rows * -(-c["vocab"] // N) * 2
    if mode == "tp":   # one FP32 partial a token (moe_combine_fp32), reduced as a dense
        moe = dense    # layer's down_proj (tp/moe_shard.py)
        calls = 2 * L * per + per + 1
        ring = 2 * (N - 1) / N * rows * hid * 2           # NCCL BF16 all-reduce instead
    elif mode == "tp-slots":   # NOT KEPT: every rank's k slot partials all-gathered
        moe = (N - 1) * rows * c["top_k"] * hid * 4
        calls = L * (per + 1) + per + 1
        ring = None
    else:              # dispatch BF16, return FP32, gather the home rows (expert_parallel.py)
        pairs = rows * c["top_k"]
        moe = (pairs / N * (N - 1) / N * hid * 2 + pairs / N * (N - 1) / N * hid * 4 +
               (N - 1) * -(-rows // N) * hid * 2)
        calls = L * (per + 3) + per + 1
        ring = None
    return {"bytes": embed + L * (dense + moe) + logits, "moe_bytes_layer": moe,
            "collectives": calls, "ring_bf16_moe_bytes_layer": ring}


def model(mode: str, rows: int) -> dict:
    g = GPUS[GPU]
    w = weights(mode)
    mean, slowest = expert_reads(mode, rows, np.random.default_rng(rows))
    L = CFG["layers"]
    read = L * (w["per_layer_fixed"] + slowest * w["expert_slice"]) + w["lm_head"]
    t_read = read / (g["hbm_tb_s"] * 1e12) * 1e3
    cm = comm(mode, rows)
    t_bw = cm["bytes"] / (g["nvlink_eff_gb_s"] * 1e9) * 1e3
    syncs = L if mode == "ep" else 0
    t_lat = [(cm["collectives"] * a + syncs * s) / 1e3 for a, s in zip(ALPHA_US, HOST_SYNC_US)]
    return {"mode": mode, "gpu": GPU, "gpus": N, "rows": rows,
            "weight_bytes_per_gpu": w["total"], "experts_read_mean": mean,
            "experts_read_slowest_gpu": slowest, "bytes_read_per_step": read,
            "weight_read_ms": t_read, "comm_bytes_per_step": cm["bytes"],
            "collectives_per_step": cm["collectives"], "nvlink_ms": t_bw,
            "latency_ms": t_lat, "step_ms": [t_read + t_bw + x for x in t_lat],
            "ring_bf16_moe_bytes_layer": cm["ring_bf16_moe_bytes_layer"]}


def markdown(rows: list[dict]) -> str:
    head = ("| split | rows | weights/GPU GB | expert slices read/layer, TP 1/8 expert, EP "
            "whole (mean; slowest GPU) | "
            "GB read/step (slowest) | read ms | MB received/step | collectives | NVLink ms | "
            "latency ms | step ms |\n|" + "---|" * 11)
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['mode'].upper()} | {r['rows']} | {r['weight_bytes_per_gpu'] / 1e9:.1f} | "
            f"{r['experts_read_mean']:.1f}; {r['experts_read_slowest_gpu']:.1f} | "
            f"{r['bytes_read_per_step'] / 1e9:.2f} | {r['weight_read_ms']:.2f} | "
            f"{r['comm_bytes_per_step'] / 1e6:.1f} | {r['collectives_per_step']} | "
            f"{r['nvlink_ms']:.3f} | {r['latency_ms'][0]:.2f}-{r['latency_ms'][1]:.2f} | "
            f"{r['step_ms'][0]:.2f}-{r['step_ms'][1]:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--md", help="write the table as markdown")
    ap.add_argument("--json", help="write the records as JSON")
    args = ap.parse_args(argv)
    rows = [model(m, b) for b in (1, 8, 64, 256) for m in ("tp", "ep", "tp-slots")]
    table = markdown(rows)
    print(table)
    if args.md:
        Path(args.md).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": "paper model, not a measurement",
                                               "config": CFG, "assumptions": {
                                                   "alpha_us": ALPHA_US,
                                                   "host_sync_us": HOST_SYNC_US,
                                                   "gpus": GPUS, "routing": "uniform"},
                                               "sources": SOURCES, "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
