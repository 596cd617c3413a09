#!/usr/bin/env python3
"""CPU batch-1 decode of the newer families against HF transformers fp32, one shape each.

    python benchmarks/compare_hf_families.py gemma-3-1b [--layers N] [--json FILE]

The model is a preset's published shape (formats/presets.py: gemma-3-1b, phi-4-mini,
gpt-oss-20b, deepseek-v2-lite) with random weights. metrale holds BF16 weights and HF the
same bits widened to fp32, so a shape whose fp32 copy does not fit this machine's memory
beside metrale's is cut to its first `--layers` decoder layers (every other dimension, the
embedding and the head kept; layer_types cut with them); the report says so under
"model" and "shape". The run is `metrale bench --compare-hf --hf-dtypes float32` on that
source: the same prompts, metrale and HF interleaved per repetition, a logits check first.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.bench import BenchConfig, format_table, run_bench, write_json  # noqa: E402
from metrale.bench.compare import HFComparison  # noqa: E402
from metrale.bench.compare_hf import require_torch  # noqa: E402
from metrale.formats import MemorySource, preset_config  # noqa: E402

# Layers kept on this 24 GiB machine (BF16 + fp32 copies, plus HF's load transients):
# the full model where it fits, else as many layers as leave ~4 GiB free.
DEFAULT_LAYERS = {"gemma-3-1b": None, "phi-4-mini": 16, "gpt-oss-20b": 2,
                  "deepseek-v2-lite": 4}


def cut_to_layers(cfg: dict, layers: int | None) -> dict:
    """`cfg` with its first `layers` decoder layers (None or all: unchanged)."""
    total = cfg["num_hidden_layers"]
    if layers is None or layers >= total:
        return cfg
    out = dict(cfg, num_hidden_layers=layers)
    if isinstance(cfg.get("layer_types"), list):
        out["layer_types"] = cfg["layer_types"][:layers]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", choices=sorted(DEFAULT_LAYERS))
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers kept (default: the table in this script)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    require_torch()
    cfg, gen = preset_config(args.preset)
    layers = args.layers if args.layers is not None else DEFAULT_LAYERS[args.preset]
    total = cfg["num_hidden_layers"]
    cfg = cut_to_layers(cfg, layers)
    kept = cfg["num_hidden_layers"]
    what = (f"{args.preset}'s shapes, random weights" if kept == total else
            f"{args.preset}'s shapes, its first {kept} of {total} layers, random weights")
    source = MemorySource(cfg, gen, seed=0, description=what)
    command = "compare_hf_families.py " + " ".join(sys.argv[1:] if argv is None else argv)
    bench = BenchConfig(model=source, device="cpu", batches=(1,), prompt_len=args.prompt_len,
                        gen_len=args.gen_len, reps=args.reps, max_seconds=None,
                        progress=False,
                        extra={"command": command,
                               "shape": {"preset": args.preset, "layers_kept": kept,
                                         "layers_in_preset": total},
                               "load_average_at_start": list(os.getloadavg())})
    report = run_bench(bench, peer=HFComparison(("float32",)))
    report["load_average_at_end"] = list(os.getloadavg())
    print(format_table(report), flush=True)
    for row in report["hf"]["results"]:
        print(f"batch {row['batch']}: metrale / HF float32 = prefill "
              f"{row['ratios']['prefill_vs_float32']:.2f}x, decode "
              f"{row['ratios']['decode_vs_float32']:.2f}x", flush=True)
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
