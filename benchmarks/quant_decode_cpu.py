#!/usr/bin/env python3
"""Batch-1 decode of a quantized model against the same model in BF16, interleaved, on the
CPU backend (issue 24's CPU goal: speed-up >= 0.8x the reduction in bytes read per step).

    python benchmarks/quant_decode_cpu.py [--preset qwen2.5-0.5b-gptq] [--steps 32]
                                          [--prompt-len 16] [--json FILE]

The quantized model is a random-weight preset (`qwen2.5-0.5b-gptq`, `-awq`, `-fp8`: the
Qwen2.5-0.5B shape, BF16 tied head); the BF16 model is the same model, each quantized
linear dequantized (formats.quant.checkpoint.DequantizedSource), so both compute the same logits (the
first step's rows are compared bit for bit). Steps alternate quantized / BF16 after one
untimed warm-up step each, so a busy machine slows both alike; the report gives median
step times, tokens/s, the speed-up, the bytes each step reads (bench/roofline.py), their
ratio, the goal's threshold and each model's peak resident memory (measured around its
own load: ru_maxrss growth). The 1-minute load average is recorded: on a shared machine
the numbers are indicative only.

The goal assumes a step bound by the bytes it reads. The report checks that: each step's
multiply-adds per second (the linears' n * k) and bytes read per second, against the
machine's own read bandwidth (numpy sums on every usable CPU, measured here). When the
BF16 step reads at under half of it, the step is bound by the native GEMM's arithmetic,
not by bytes (`byte_bound` false): the speed-up then says how much cheaper the
dequantizing tile is, and is no evidence for or against the goal (`note` says so).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import metrale  # noqa: E402
from metrale.bench import roofline  # noqa: E402
from metrale.bench.env import environment  # noqa: E402
from metrale.formats import MemorySource  # noqa: E402
from metrale.formats.quant.checkpoint import DequantizedSource  # noqa: E402
from metrale.formats.quant.layout import linear_shapes  # noqa: E402
from metrale.gpu_runtime import HostBackend, native  # noqa: E402


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes/s this process reads a large float32 array at with one thread per usable CPU
    (numpy sums of equal parts, which release the GIL; best of `reps`), as the decode
    GEMMs read W with the library's threads (on the 2-core machine of the README's
    figures one thread read 25 GB/s, two 34)."""
    nt = native.usable_cpus()
    parts = np.array_split(np.ones(nbytes // 4, np.float32), nt)
    best = float("inf")
    with ThreadPoolExecutor(nt) as pool:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    return nbytes / best


def macs_per_token(meta) -> int:
    """Multiply-adds of the linears (and a tied head) for one token; attention excluded."""
    shapes = linear_shapes(meta)
    tied = 0 if "lm_head" in shapes else meta.vocab_size * meta.hidden_size
    return sum(n * k for n, k in shapes.values()) + tied


def logits(m, ptr) -> np.ndarray:
    out = np.empty(m.vocab_size() * (4 if m.logits_ptr_is_fp32(ptr) else 2), np.uint8)
    m.copy_logits_to_host(ptr, out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b-gptq")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per model")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)

    qsrc = MemorySource.preset(args.preset)
    models, peak = {}, {}
    for kind, src in (("quantized", qsrc), ("bf16", DequantizedSource(qsrc))):
        before = rss_bytes()
        t0 = time.perf_counter()
        models[kind] = metrale.load(src, HostBackend(), progress=False, max_batch=1,
                                    kv_blocks=64)
        peak[kind] = {"load_s": time.perf_counter() - t0,
                      "peak_rss_growth_bytes": rss_bytes() - before}
    prompt = list(range(100, 100 + args.prompt_len))
    seqs, last = {}, {}
    for kind, m in models.items():
        seqs[kind] = m.alloc_sequence()
        p = m.prefill(prompt, seqs[kind], m.default_stream())
        last[kind] = logits(m, p)
    same_prefill = bool(np.array_equal(last["quantized"], last["bf16"]))
    times = {k: [] for k in models}
    token = 7
    for step in range(args.steps + 1):          # step 0: warm-up, untimed
        for kind, m in models.items():
            t0 = time.perf_counter()
            p = m.decode(token, seqs[kind], m.default_stream())
            m.synchronize(m.default_stream())
            dt = time.perf_counter() - t0
            last[kind] = logits(m, p)
            if step:
                times[kind].append(dt)
        if not np.array_equal(last["quantized"], last["bf16"]):
            same_prefill = False
        token = (token * 31 + 11) % 1000
    kv_len = args.prompt_len + args.steps + 1
    res = {}
    for kind, m in models.items():
        step_bytes = roofline.decode_step_bytes(m.metadata(), [kv_len])
        med = statistics.median(times[kind])
        res[kind] = {"median_step_ms": med * 1e3, "tokens_per_s": 1 / med,
                     "min_step_ms": min(times[kind]) * 1e3,
                     "bytes_per_step": step_bytes, "weight_bytes": m._weights.nbytes,
                     "read_gb_per_s": step_bytes / med / 1e9,
                     "gmac_per_s": macs_per_token(m.metadata()) / med / 1e9,
                     **peak[kind]}
    machine_read = read_bandwidth()
    byte_bound = res["bf16"]["read_gb_per_s"] >= 0.5 * machine_read / 1e9
    byte_ratio = res["bf16"]["bytes_per_step"] / res["quantized"]["bytes_per_step"]
    speedup = res["quantized"]["tokens_per_s"] / res["bf16"]["tokens_per_s"]
    report = environment(models["quantized"].backend)
    report.update({
        "command": "python benchmarks/quant_decode_cpu.py " + " ".join(argv or sys.argv[1:]),
        "preset": args.preset, "quantization": qsrc.metadata().quantization.describe(),
        "steps": args.steps, "prompt_len": args.prompt_len, "results": res,
        "bytes_ratio_bf16_over_quantized": byte_ratio, "speedup": speedup,
        "goal_speedup": 0.8 * byte_ratio,
        "speedup_at_least_goal": speedup >= 0.8 * byte_ratio,
        "goal_met": (speedup >= 0.8 * byte_ratio) if byte_bound else None,  # null: unmeasured
        "same_logits_every_step": same_prefill,
        "machine_read_gb_per_s": machine_read / 1e9, "byte_bound": byte_bound,
        "note": ("the BF16 step reads its bytes at >= half the machine's read bandwidth: "
                 "the ratio measures the goal" if byte_bound else
                 f"compute-bound: the BF16 step reads {res['bf16']['read_gb_per_s']:.2f} "
                 f"GB/s of the {machine_read / 1e9:.1f} GB/s this machine reads (the native "
                 f"GEMM runs at {res['bf16']['gmac_per_s']:.2f} GMAC/s), so the speed-up "
                 "compares the GEMMs' arithmetic, not bytes read: no evidence for or "
                 "against the goal"),
        "load_average_1min": os.getloadavg()[0], "usable_cpus": os.cpu_count(),
    })
    for kind in models:
        r = res[kind]
        print(f"{kind:<10} {r['tokens_per_s']:7.2f} tok/s (median step {r['median_step_ms']:.1f} "
              f"ms), {r['bytes_per_step'] / 2**20:.1f} MiB read per step, peak RSS growth "
              f"{r['peak_rss_growth_bytes'] / 2**20:.0f} MiB")
    print(f"bytes ratio {byte_ratio:.2f}, speed-up {speedup:.2f} (goal >= {0.8 * byte_ratio:.2f}: "
          f"{'reached' if report['speedup_at_least_goal'] else 'NOT reached'}); same logits: {same_prefill}; "
          f"load average {report['load_average_1min']:.1f} on {os.cpu_count()} CPUs")
    print(report["note"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
