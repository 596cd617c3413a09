"""`metrale bench`: prefill and decode throughput, latency, memory and roofline per batch
size (the harness is `metrale.bench`)."""
from __future__ import annotations

import shlex
import sys

from .args import (add_device, batch_list, model_spec, nonneg_int, out_file, positive_float,
                   positive_int, preset_name)


def register(sub) -> None:
    b = sub.add_parser("bench", help="throughput, latency, memory and roofline per batch size",
                       description="Prefill and decode benchmark per batch size: prefill and "
                       "decode tokens/s, TTFT, inter-token latency p50/p99, peak memory, and on "
                       "a GPU the achieved HBM GB/s and roofline fraction (decode bytes / step "
                       "time / measured copy bandwidth). Presets are random weights at real "
                       "shapes. On the CPU a time budget (--max-seconds, default 40) keeps the "
                       "defaults under a minute.")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=model_spec, metavar="DIR",
                     help="checkpoint directory, .safetensors file or preset:NAME")
    src.add_argument("--preset", type=preset_name, metavar="NAME",
                     help="random weights at a preset's shapes (tiny, llama-3.1-8b, ...)")
    add_device(b)
    b.add_argument("--batch", type=batch_list, default=(1, 8, 32, 64), metavar="1,8,32,64",
                   help="batch sizes, comma-separated (default 1,8,32,64)")
    b.add_argument("--prompt-len", type=positive_int, default=512,
                   help="prompt tokens per sequence (default 512)")
    b.add_argument("--gen-len", type=positive_int, default=128,
                   help="decode steps (default 128)")
    b.add_argument("--cache", choices=["paged", "contiguous"], default="paged",
                   help="KV cache: the paged pool or the contiguous baseline (default paged)")
    b.add_argument("--graphs", choices=["on", "off"], default=None,
                   help="CUDA graphs for decode (default: on for CUDA, off on CPU)")
    b.add_argument("--reps", type=positive_int, default=None,
                   help="timed repetitions per batch size (default 3 on a GPU, 1 on CPU)")
    b.add_argument("--warmup", type=nonneg_int, default=1,
                   help="untimed warm-up rounds per batch size (default 1)")
    b.add_argument("--max-seconds", type=positive_float, default=None,
                   help="soft time budget for the whole run (default 40 on CPU, none on "
                        "a GPU)")
    b.add_argument("--seed", type=nonneg_int, default=0, help="prompt RNG seed (default 0)")
    b.add_argument("--json", type=out_file, metavar="FILE", help="write the report as JSON")
    b.add_argument("--plot", type=out_file, metavar="FILE.png",
                   help="plot tokens/s and roofline fraction against batch size (needs "
                        "matplotlib: pip install 'metrale[plot]')")
    b.set_defaults(func=run)


def run(args) -> int:
    from ..bench import BenchConfig, format_table, run_bench, write_json
    if args.plot:
        from ..bench.plot import require_matplotlib
        require_matplotlib()  # fail before a long run, not after it
    model = f"preset:{args.preset}" if args.preset else args.model
    cfg = BenchConfig(model=model, device=args.device, batches=tuple(args.batch),
                      prompt_len=args.prompt_len, gen_len=args.gen_len, cache=args.cache,
                      graphs=None if args.graphs is None else args.graphs == "on",
                      reps=args.reps, warmup=args.warmup, max_seconds=args.max_seconds,
                      seed=args.seed,
                      extra={"command": "metrale " + shlex.join(args.argv)})
    report = run_bench(cfg)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from ..bench.plot import plot_report
        plot_report(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
