#!/usr/bin/env python3
"""LoRA decode on the CPU (HostBackend): time per decode step of a batch of 8 sequences at
the Qwen2.5-0.5B shape (preset:qwen2.5-0.5b, random weights) with 4 random adapters of rank
16 on every linear (q, k, v, o, gate, up, down; two sequences per adapter), against the same
8 sequences on the base model, in one interleaved run on one model (a base step, an adapter
step, ..., so a shared machine's load hits both alike).

    python benchmarks/lora_cpu_decode.py [--steps 12] [--json FILE]

Each figure is the median of `--steps` steps after 3 warm-up steps of each. The adapters are
PEFT-layout directories written to a temporary directory (BF16 A ~ N(0, 1/k), B small).
"""
from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import metrale  # noqa: E402
from metrale.bench.env import environment  # noqa: E402
from metrale.formats import open_source  # noqa: E402
from metrale.formats.lora import base_modules  # noqa: E402
from metrale.gpu_runtime import HostBackend  # noqa: E402
from metrale.ops.bf16 import f32_to_bf16  # noqa: E402

PRESET, BATCH, ADAPTERS, RANK = "preset:qwen2.5-0.5b", 8, 4, 16


def write_adapter(path: Path, meta, seed: int) -> Path:
    """A PEFT adapter directory: rank RANK on every linear of every layer, BF16 tensors."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
         "target_modules": "all-linear", "bias": "none"}))
    header, blobs, off = {}, [], 0
    for mod in base_modules(meta):
        if mod.shape is None:
            continue
        n, k = mod.shape
        for ab, shape, std in (("A", (RANK, k), k ** -0.5), ("B", (n, RANK), 0.01)):
            data = f32_to_bf16((rng.standard_normal(shape) * std).astype(np.float32)).tobytes()
            header[f"base_model.model.{mod.name}.lora_{ab}.weight"] = {
                "dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + len(data)]}
            blobs.append(data)
            off += len(data)
    h = json.dumps(header).encode()
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h +
                                                     b"".join(blobs))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    meta = open_source(PRESET).metadata()
    with tempfile.TemporaryDirectory() as tmp:
        loras = {f"a{i}": write_adapter(Path(tmp) / f"a{i}", meta, i) for i in range(ADAPTERS)}
        m = metrale.load(PRESET, HostBackend(), progress=False, max_batch=BATCH,
                         kv_blocks=8 * BATCH, loras=loras)
    s = m.default_stream()
    groups = {"base": [None] * BATCH,
              "lora": [f"a{i % ADAPTERS}" for i in range(BATCH)]}
    seqs = {k: [m.alloc_sequence(adapter=a) for a in v] for k, v in groups.items()}
    for k in groups:
        for q in seqs[k]:
            m.prefill([1, 2, 3, 4, 5, 6, 7, 8], q, s)
    times = {k: [] for k in groups}
    for step in range(3 + args.steps):
        for k in groups:
            t = time.perf_counter()
            m.decode_batch([7] * BATCH, seqs[k], s)
            m.synchronize(s)
            if step >= 3:
                times[k].append(time.perf_counter() - t)
            for q in seqs[k]:
                m.rollback(q, 1)    # the same positions every step
    base, lora = (statistics.median(times[k]) * 1e3 for k in ("base", "lora"))
    rec = {"benchmark": "lora_cpu_decode", "model": PRESET, "batch": BATCH,
           "adapters": ADAPTERS, "rank": RANK, "modules": "all linears", "steps": args.steps,
           "base_step_ms": base, "lora_step_ms": lora, "ratio": lora / base,
           "goal_ratio": 1.3, "environment": environment(m.backend),
           "command": "python " + " ".join(sys.argv)}
    print(f"{PRESET} batch {BATCH}: base {base:.1f} ms/step, {ADAPTERS} adapters rank {RANK} "
          f"on every linear {lora:.1f} ms/step: {lora / base:.3f}x (goal <= 1.3x)")
    if args.json:
        Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
