#!/usr/bin/env python3
"""metrale against Hugging Face transformers on identical weights, plus HF torch.compile.

    python benchmarks/compare_hf.py [--preset llama-3.1-8b] [--device cuda] [--batch 1,8]
        [--prompt-len 512] [--gen-len 64] [--hf-dtypes bfloat16] [--compile-batches 1]
        [--no-compile] [--json FILE]

The eager comparison is `metrale bench --compare-hf` (metrale/bench/compare.py): same
weights, logits check, interleaved repetitions, ratios under "hf". This script adds what
only the GPU suite wants: HF with a static cache under `torch.compile(mode=
"reduce-overhead")` for the batch sizes in `--compile-batches`, timed by one greedy
`generate(gen_len tokens)` per repetition with a timestamping streamer (prefill = time to
the first new token, decode = mean time between tokens), stored under "hf_compiled".
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.bench import BenchConfig, format_table, run_bench, write_json  # noqa: E402
from metrale.bench.compare import HFComparison, parse_dtypes  # noqa: E402
from metrale.bench.compare_hf import require_torch  # noqa: E402


class _Clock:
    """A `generate` streamer that only timestamps: put() gets the prompt, then each token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def compiled_generate_times(torch, model, prompts, gen_len: int, reps: int) -> dict:
    """Medians over `reps` (after one compiling warm-up) of greedy static-cache `generate`."""
    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.long, device=dev)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
              use_cache=True, max_new_tokens=gen_len, min_new_tokens=gen_len,
              cache_implementation="static")

    def run():
        clock = _Clock()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, streamer=clock, **kw)
        new = clock.stamps[1:]  # stamps[0]: the prompt
        return new[0] - t0, [b - a for a, b in zip(new, new[1:])]

    run()
    runs = [run() for _ in range(reps)]
    t_pre = statistics.median(r[0] for r in runs)
    step = statistics.median(sum(r[1]) / max(len(r[1]), 1) for r in runs)
    B, P = ids.shape
    return {"prefill_tokens_per_s": B * P / t_pre,
            "decode_tokens_per_s": B / step if step > 0 else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda", help="cuda[:N] or cpu (torch and metrale)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hf-dtypes", type=parse_dtypes, default=("bfloat16",))
    ap.add_argument("--compile-batches", default="1")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    torch, _ = require_torch()
    batches = tuple(int(x) for x in args.batch.split(","))
    peer = HFComparison(args.hf_dtypes)
    cfg = BenchConfig(model=f"preset:{args.preset}", device=args.device, batches=batches,
                      prompt_len=args.prompt_len, gen_len=args.gen_len, reps=args.reps,
                      progress=False, extra={"command": "compare_hf.py " + " ".join(
                          sys.argv[1:] if argv is None else argv)})
    report = run_bench(cfg, peer=peer)
    report["hf_compiled"], report["errors"] = [], []
    print(format_table(report), flush=True)
    if args.json:
        write_json(report, args.json)
    compile_batches = {int(x) for x in args.compile_batches.split(",")}
    if not args.no_compile and hasattr(torch, "compile"):
        name = "bfloat16" if "bfloat16" in peer.runners else args.hf_dtypes[0]
        hf = peer.runners[name].model
        eager = hf.forward
        hf.forward = torch.compile(eager, mode="reduce-overhead", fullgraph=False)
        V = hf.config.vocab_size
        try:
            for res in report["results"]:
                B = res["batch"]
                if B not in compile_batches:
                    continue
                prompts = np.random.default_rng([cfg.seed, B, 1]).integers(
                    0, V, (B, args.prompt_len)).tolist()
                try:
                    t = compiled_generate_times(torch, hf, prompts, args.gen_len, args.reps)
                except Exception as e:
                    report["errors"].append(f"batch {B} hf_compiled: {type(e).__name__}: {e}")
                    traceback.print_exc()
                    continue
                t.update({"batch": B, "dtype": name})
                for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
                    if res.get(key) and t.get(key):
                        t[f"metrale_ratio_{key}"] = res[key] / t[key]
                report["hf_compiled"].append(t)
                print(t, flush=True)
                if args.json:
                    write_json(report, args.json)
        finally:
            hf.forward = eager
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
