#!/usr/bin/env python3
"""A PAPER MODEL (nothing here ran on a GPU) of one decode step of Qwen3-235B-A22B in FP8
(128 x 128 block scales) on 8 H200s: tensor parallelism inside every expert (what metrale
runs: tp/moe_shard.py) against expert parallelism (16 whole experts a GPU, tokens sent to
their experts' GPUs and back with all-to-all; not implemented in metrale). Attention is
tensor-parallel in both. Per GPU: the weight bytes a step reads, and the bytes it receives.

    python benchmarks/moe_tp_ep_model.py [--md FILE]

Config: Qwen/Qwen3-235B-A22B config.json (94 layers, hidden 4096, 64 query / 4 KV heads of
128, 128 experts of width 1536, top-8, vocabulary 151936, untied head). Routing: uniform
and independent per token (real routers are skewed: EP's hottest GPU is then worse than
modelled here). EP's per-step time is set by its most loaded GPU: the expected maximum over
the 8 GPUs of hit experts, by Monte Carlo (seeded). Bandwidths: H200 SXM HBM3e 4.8 TB/s and
NCCL's effective ~370 GB/s NVLink per direction, as benchmarks/results/tp_allreduce_model.md.
"""
from __future__ import annotations

import argparse

import numpy as np

L, H, HEADS, KV, D, E, K, I, V, N = 94, 4096, 64, 4, 128, 128, 8, 1536, 151936, 8
FP8_EXPERT = 3 * H * I * (1 + 4 / (128 * 128))        # bytes of one FP8 expert + scales
ATTN = (HEADS * D * H * 2 + 2 * KV * D * H) * (1 + 4 / (128 * 128))   # q, o + k, v (FP8)
HBM, LINK = 4.8e12, 370e9


def hit_per_gpu(n: int, trials: int = 2000, seed: int = 0):
    """(expected hit experts a GPU under TP (all of the layer's, each 1/N), expected
    maximum over GPUs of hit experts under EP (16 experts a GPU)) for n tokens."""
    rng = np.random.default_rng(seed)
    hit_tp, max_ep = 0.0, 0.0
    for _ in range(trials):
        ids = np.argsort(rng.random((n, E)), axis=1)[:, :K]
        hit = np.zeros(E, bool)
        hit[ids.reshape(-1)] = True
        hit_tp += hit.sum()
        max_ep += hit.reshape(N, E // N).sum(1).max()
    return hit_tp / trials, max_ep / trials


def step(n: int) -> dict:
    hit, ep_max = hit_per_gpu(n)
    # weights a GPU reads: attention 1/N (KV heads 4 < 8: k/v replicated over 2 GPUs),
    # vocabulary 1/N of the BF16 head (the embedding is a row lookup)
    attn = (HEADS * D * H * 2 / N + 2 * KV * D * H / KV) * (1 + 4 / (128 * 128))
    head = V * H * 2 / N
    tp_w = L * (attn + hit * FP8_EXPERT / N + E * H * 2) + head
    ep_w = L * (attn + ep_max * FP8_EXPERT + E * H * 2) + head
    # received per GPU: TP: per layer two rank-order sums of n x H FP32 partials (gather
    # schedule: (N-1) x n x H x 4), + the embedding's sum + the logits gather (BF16)
    logits = (N - 1) * n * (-(-V // N)) * 2
    tp_c = (2 * L + 1) * (N - 1) * n * H * 4 + logits
    # EP: attention's o_proj sum as TP, then dispatch + combine of every token's hidden
    # (BF16) to each remote GPU holding one of its experts and back (expected distinct
    # remote GPUs of a token: N-1 of them each hit with 1 - C(112, 8)/C(128, 8))
    p_gpu = 1 - np.prod([(E - E // N - j) / (E - j) for j in range(K)])
    remote = (N - 1) * p_gpu
    ep_c = (L + 1) * (N - 1) * n * H * 4 + L * 2 * n * remote * H * 2 + logits
    return {"n": n, "hit": hit, "ep_max": ep_max, "tp_weight_gb": tp_w / 1e9,
            "ep_weight_gb": ep_w / 1e9, "tp_comm_mb": tp_c / 1e6, "ep_comm_mb": ep_c / 1e6,
            "tp_ms": 1e3 * (tp_w / HBM + tp_c / LINK), "ep_ms": 1e3 * (ep_w / HBM + ep_c / LINK)}


def markdown(rows) -> str:
    out = ["# Qwen3-235B-A22B FP8 on 8x H200: TP inside experts vs expert parallelism "
           "(paper model)", "", __doc__.split("\n\n", 1)[1].strip(), "",
           "| rows | hit experts / layer | EP: busiest GPU's experts | weights read / GPU TP | "
           "EP | received / GPU TP | EP | bandwidth-only step TP | EP |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['n']} | {r['hit']:.1f} | {r['ep_max']:.2f} | "
                   f"{r['tp_weight_gb']:.2f} GB | {r['ep_weight_gb']:.2f} GB | "
                   f"{r['tp_comm_mb']:.1f} MB | {r['ep_comm_mb']:.1f} MB | "
                   f"{r['tp_ms']:.2f} ms | {r['ep_ms']:.2f} ms |")
    out += ["", "Latency (two to three collectives a layer, ~10-20 us each inside a graph) is "
            "left out of the step times: ~2-6 ms a step for either at 94 layers, which "
            "dominates at small batches. Reading: at decode batch sizes TP reads each hit "
            "expert once across the GPUs (1/8 each), while EP's step waits for the GPU "
            "whose 16 experts the batch hit most; EP's traffic is lower only once rows "
            "are many (the dispatch sends BF16 hidden states, TP's sums FP32 partials)."]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--md", help="write the markdown table here")
    args = ap.parse_args()
    text = markdown([step(n) for n in (1, 8, 64, 256)])
    if args.md:
        open(args.md, "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
